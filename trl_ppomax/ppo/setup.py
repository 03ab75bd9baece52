"""Set-up of :class:`~trl_ppomax.PPOMaxTrainer` (:func:`set_up`) and the checks of its inputs, run before anything
expensive: every fault visible in the arguments fails here, naming the argument and the fix, not as an ``IndexError``
in the first rollout or as silently wrong training (numeric settings: ``PPOMaxConfig._validate``)."""

from __future__ import annotations

import difflib
import functools
import logging
import os
from dataclasses import dataclass

from datasets import Dataset
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from trl_ppomax import data, rewards
from trl_ppomax import models as modeling
from trl_ppomax.base import metrics as M
from trl_ppomax.data.files import probe_writable
from trl_ppomax.data.sources import looks_local
from trl_ppomax.ppo.config import PPOMaxConfig

logger = logging.getLogger(__name__)

_CAUSAL_LM, _SCORER = (AutoModelForCausalLM, {}), (AutoModelForSequenceClassification, {"num_labels": 1})
#: How a model argument given as a path or Hub id is loaded.
MODEL_LOADERS = {"model": _CAUSAL_LM, "ref_model": _CAUSAL_LM, "reward_model": _SCORER, "value_model": _SCORER}

_MISSING = {
    "model": "pass the policy to train: a causal LM (AutoModelForCausalLM.from_pretrained(...)) or its path / Hub id",
    "reward_model": "pass a reward model (AutoModelForSequenceClassification with num_labels=1, or its path / Hub id) "
    "or a reward function (prompts=, completions=, completion_ids=, **columns) -> list[float], or a list of them "
    "(reward_funcs=)",
    "train_dataset": "pass a datasets.Dataset of prompts (a 'prompt' or an 'input_ids' column)",
}


NO_RUN_LENGTH = (
    "No train_dataset: the environment makes each prompt in reset(), so the run's length must be given: set max_steps "
    "(PPO iterations), as TRL GRPO requires."
)


#: TRL GRPO's words for the same refusals, first in ours, so that its tests' messages match.
TRL_WORDS = {
    "reward_model": "No reward source provided: ",
    "train_dataset": "`train_dataset` is required unless an environment_factory owns the data: ",
}


def check_inputs(
    args, processing_class, models: dict, train_dataset, eval_dataset, ptx_dataset, peft_config=None,
    rollouts: dict | None = None,
) -> tuple[object, dict]:  # fmt: skip
    """Check the constructor's arguments (``models``: ``model``, ``ref_model``, ``reward_model``, ``value_model`` as
    passed; ``rollouts``: the checked ``rollout_func``, ``tools`` and ``environment_factory``) and load those given as
    paths. Returns ``(processing_class, loaded models by name)``; the tokenizer is loaded from ``model``'s path when
    ``processing_class`` is None."""
    if not isinstance(args, PPOMaxConfig):
        hint = (
            " (GRPOTrainer's model-first positional form: pass model=, reward_funcs= and args= by keyword)"
            if _is_path(args) or isinstance(args, nn.Module)
            else ""
        )
        raise TypeError(f"args must be a PPOMaxConfig, got {type(args).__name__}{hint}.")
    rollouts = rollouts or {}
    environment = rollouts.get("environment_factory") is not None
    for name, value in {**models, "train_dataset": train_dataset}.items():
        owned = name in ("reward_model", "train_dataset") and environment  # an environment may own reward and data
        if name in _MISSING and value is None and not owned:
            raise ValueError(f"{TRL_WORDS.get(name, '')}{name} is None: {_MISSING[name]}.")
    if train_dataset is None and isinstance(rollouts.get("environment_factory"), dict):
        raise ValueError(
            "A dict environment_factory (several environments) requires a `train_dataset` with an 'environment' "
            "column naming each row's environment; pass one, or a single environment factory."
        )
    if train_dataset is None and args.max_steps <= 0:  # an environment owns the data: before any model loads
        raise ValueError(NO_RUN_LENGTH)
    given = [("train_dataset", train_dataset)] if train_dataset is not None else []
    for name, dataset in (*given, *_named_eval_datasets(eval_dataset)):
        _check_dataset_type(name, dataset)
    if args.ptx_coef > 0 and ptx_dataset is None:
        raise ValueError("ptx_coef > 0 needs a ptx_dataset: pass PPOMaxTrainer(..., ptx_dataset=...) or ptx_coef=0.")
    if rollouts.get("rollout_func") is None:  # else a reward function may also take the rollout_func's extra keys
        names = train_dataset.column_names if train_dataset is not None else ["prompt"]
        columns = [*names, *(["environments"] if environment else [])]
        rewards.check_reward_functions(models["reward_model"], columns)
    for name, value in models.items():  # a missing local folder, before loading anything (a tokenizer first)
        for item in value if isinstance(value, list | tuple) else [value]:
            check_model_path(name, item)
    if processing_class is None:
        processing_class = policy_tokenizer(models["model"], args)
    data.check_tokenizer(processing_class)
    _check_stop_token(args, processing_class)
    options = load_options(args)
    loaded = {name: load_model(name, value, options) for name, value in models.items()}  # last: may take minutes
    check_model_arguments(loaded, peft_config)
    for name in ("model", "ref_model"):
        check_generates(name, loaded[name])
    return processing_class, loaded


def check_model_arguments(models: dict, peft_config=None) -> None:
    """The models fit together: none passed twice (the critic would train the reward model, or the reference move
    with the policy), one PEFT wrapping, no reference beside a PEFT policy."""
    model, ref_model, value_model = models["model"], models["ref_model"], models["value_model"]
    if value_model is not None and value_model is models["reward_model"]:
        raise ValueError(
            "value_model is the same object as reward_model, so training the critic would change the reward; "
            "pass a separate copy, or value_model=None to initialise the critic from the reward model."
        )
    if ref_model is not None and ref_model is model:
        raise ValueError("ref_model is the same object as model; pass a separate copy, or None to copy it.")
    peft = modeling.is_peft(model)
    if peft and peft_config is not None:
        raise ValueError("model is already a PEFT model; do not pass peft_config as well.")
    if (peft or peft_config is not None) and ref_model is not None:
        raise ValueError("A PEFT policy's reference is the model with its adapter disabled: pass ref_model=None.")


def check_generates(name: str, model) -> None:
    """The policy (``model``) and its reference must be causal LMs with ``generate`` (not, e.g., a reward model)."""
    if model is None:
        return
    base = model.get_base_model() if modeling.is_peft(model) else model
    kind = type(base).__name__
    if callable(getattr(base, "generate", None)) and not kind.endswith("ForSequenceClassification"):
        return
    role = "the policy" if name == "model" else "the reference policy"
    raise TypeError(
        f"{name} is a {kind}, which cannot generate text: {role} must be a causal language model with generate(), "
        "e.g. AutoModelForCausalLM.from_pretrained(<the SFT model>). A *ForSequenceClassification model is a reward "
        "model or critic: pass it as reward_model= or value_model=."
    )


def _is_path(value) -> bool:
    return isinstance(value, str | os.PathLike)


def default_config(args, model) -> object:
    """``args``, or without one TRL GRPO's default: a config writing to ``<model name>-PPOMax``."""
    if args is not None:
        return args
    name = os.fspath(model) if _is_path(model) else getattr(getattr(model, "config", None), "_name_or_path", "")
    return PPOMaxConfig(output_dir=f"{os.path.basename(os.path.normpath(name or 'model'))}-PPOMax")


def load_options(args) -> dict:
    """``from_pretrained`` keyword arguments of the models given by name: TRL GRPO's ``model_init_kwargs`` and
    ``trust_remote_code``."""
    options = dict(args.model_init_kwargs or {})
    if args.trust_remote_code:
        options["trust_remote_code"] = True
    return options


def policy_tokenizer(model, args):
    """The tokenizer beside the policy (its path, or the folder it was loaded from), as TRL GRPO loads it; a pad token
    added as TRL does (the eos token) when it has none."""
    folder = os.fspath(model) if _is_path(model) else getattr(getattr(model, "config", None), "_name_or_path", None)
    fix = (
        "processing_class is None: pass the policy's tokenizer, e.g. processing_class=AutoTokenizer.from_pretrained("
        "<the policy's path or Hub id>)"
    )
    if not folder:
        raise ValueError(f"{fix}; the policy was not loaded from a folder to take it from.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=bool(args.trust_remote_code))
    except (OSError, ValueError) as error:
        raise ValueError(f"{fix}; none could be loaded from {folder!r}: {error}") from error
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(name: str, value, options: dict | None = None):
    """``value`` itself, or, for a path or Hub id, the model loaded from it as :data:`MODEL_LOADERS` says, with the
    ``from_pretrained`` ``options`` (:func:`load_options`)."""
    if isinstance(value, list | tuple):  # several reward sources: models, paths and functions
        return [load_model(name, item, options) for item in value]
    if not _is_path(value):
        return value
    check_model_path(name, value)
    cls, kwargs = MODEL_LOADERS[name]
    kwargs = {**(options or {}), **kwargs}
    logger.info("Loading %s from %s with %s.from_pretrained.", name, value, cls.__name__)
    try:
        if name != "value_model":
            return cls.from_pretrained(os.fspath(value), **kwargs)
        critic, info = cls.from_pretrained(os.fspath(value), output_loading_info=True, **kwargs)
        modeling.warn_new_value_head(os.fspath(value), info["missing_keys"])  # e.g. a policy folder
        return critic
    except (OSError, ValueError) as error:
        kind = OSError if isinstance(error, OSError) else ValueError
        raise kind(f"{name}={os.fspath(value)!r} could not be loaded with {cls.__name__}: {error}") from error


def check_model_path(name: str, value) -> None:
    """A ``FileNotFoundError`` naming the argument when ``value`` is meant as a local path (a ``Path``, or a string
    :func:`~trl_ppomax.data.sources.looks_local` says is one) that does not exist."""
    if not _is_path(value):
        return
    text = os.fspath(value)
    local = isinstance(value, os.PathLike) or looks_local(text)
    path = os.path.expanduser(text)
    if local and not os.path.exists(path):
        raise FileNotFoundError(
            f"{name}={text!r} could not be loaded: the local path {os.path.abspath(path)} does not exist. Fix the "
            f"path (relative paths start from the current folder, {os.getcwd()}); a Hub model is named 'org/name'."
        )


def _check_dataset_type(name: str, dataset) -> None:
    if isinstance(dataset, Dataset):
        return
    if isinstance(dataset, dict):
        fix = f"pass one split, e.g. {name}=dataset[{next(iter(dataset), 'train')!r}]"
    else:
        fix = "PPO samples prompts by index, so pass a datasets.Dataset (not a streaming IterableDataset)"
    raise TypeError(f"{name} must be a datasets.Dataset, got {type(dataset).__name__}: {fix}.")


def _named_eval_datasets(eval_dataset) -> list[tuple[str, object]]:
    if eval_dataset is None:
        return []
    if isinstance(eval_dataset, dict):
        return [(f"eval_dataset[{key!r}]", value) for key, value in eval_dataset.items()]
    return [("eval_dataset", eval_dataset)]


def _check_stop_token(args, tokenizer) -> None:
    if args.stop_token == "eos" and tokenizer.eos_token_id is None:
        raise ValueError(
            "stop_token='eos' but the tokenizer has no eos token, so responses would never stop (and every one "
            "would get missing_eos_penalty). Set stop_token_id to the id that ends a response, give the tokenizer an "
            "eos token (tokenizer.eos_token = ...), or set stop_token=None to generate response_length tokens."
        )
    if args.missing_eos_penalty is not None and args.stop_token_id is None and tokenizer.eos_token_id is None:
        raise ValueError(
            f"missing_eos_penalty={args.missing_eos_penalty} needs a stop token, but there is none (no stop_token_id, "
            "no eos token): every response would be penalised. Set stop_token_id, or missing_eos_penalty=None."
        )


# -- Once the models are built -----------------------------------------------------------------------------------------
def prepare_and_check(
    args, tokenizer, built: dict[str, nn.Module | None], stop_token_id, train_dataset, eval_dataset, rollout_metrics
) -> tuple[Dataset, Dataset | dict[str, Dataset] | None]:
    """Check the built models (``built``: ``policy``, ``ref_model``, ``reward_model``, ``value_model``, the last
    being the critic) and the stop token id, prepare the prompt datasets and check ``metric_for_best_model``.
    Returns the prepared ``(train_dataset, eval_dataset)``."""
    policy = built["policy"]
    check_vocabularies(tokenizer, built)
    check_stop_token_id(stop_token_id, tokenizer, embedding_size(policy))
    for name, module in built.items():  # reward_model (reward_model[i] for several sources) and value_model
        if name.startswith(("reward_model", "value_model")) and isinstance(module, nn.Module):
            modeling.backbone_and_head(module)  # raises, naming the fix, for a model without a score head

    def prepared(dataset: Dataset, name: str) -> Dataset:
        return prepared_prompts(args, tokenizer, policy, dataset, name)

    train_dataset = prepared(train_dataset, "train_dataset") if train_dataset is not None else None
    if isinstance(eval_dataset, dict):
        eval_dataset = {key: prepared(value, f"eval_dataset[{key!r}]") for key, value in eval_dataset.items()}
    elif eval_dataset is not None:
        eval_dataset = prepared(eval_dataset, "eval_dataset")
    rewards.check_reward_functions(list((rollout_metrics or {}).values()), what="rollout metric")
    check_best_metric(args.metric_for_best_model, eval_dataset, rollout_metrics)
    return train_dataset, eval_dataset


def prepared_prompts(args, tokenizer, policy, dataset: Dataset, name: str) -> Dataset:
    """A prompt dataset tokenized and cut to the prompt budget (:func:`data.prompt_preparer`), its ids checked."""
    dataset = data.prompt_preparer(args, tokenizer, policy)(dataset, name=name)
    check_prompt_ids(dataset, embedding_size(policy), name)
    return dataset


def prepare_eval_prompts(trainer, dataset: Dataset, name: str = "eval_dataset") -> Dataset:
    """A dataset passed to ``evaluate()`` prepared exactly as the training prompts (:func:`prepared_prompts`)."""
    _check_dataset_type(name, dataset)
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    return prepared_prompts(trainer.args, trainer.processing_class, policy, dataset, name)


def embedding_size(model) -> int | None:
    """Rows of ``model``'s input embedding (the ids it can read), or its config's ``vocab_size``; None if unknown."""
    if not isinstance(model, nn.Module):
        return None
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embeddings = None
    size = getattr(embeddings, "num_embeddings", None)  # kept under ZeRO-3, where the weight is a placeholder
    if size is None and getattr(embeddings, "weight", None) is not None and embeddings.weight.ndim == 2:
        size = embeddings.weight.shape[0]
    if size is None:
        config = getattr(model, "config", None)
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        size = getattr(config, "vocab_size", None)
    return int(size) if size is not None else None


def check_vocabularies(tokenizer, built: dict[str, nn.Module | None]) -> None:
    """Every model must read every id the policy can generate or the tokenizer can produce, the policy the pad id
    too. Reward models with their own tokenizer are not in ``built``."""
    policy_size, tokens = embedding_size(built["policy"]), len(tokenizer)
    if policy_size is not None and tokenizer.pad_token_id >= policy_size:
        raise ValueError(
            f"The tokenizer's pad token id {tokenizer.pad_token_id} is outside the policy's embedding ({policy_size} "
            f"ids), so padded batches would fail. Resize the policy after adding tokens: "
            f"model.resize_token_embeddings(len(tokenizer)) (= {tokens}), or use a pad token the policy knows."
        )
    if policy_size is not None and policy_size < tokens:  # not blamed on the reference, a copy when ref_model=None
        raise ValueError(
            f"The policy (model) has an embedding for {policy_size} token ids, fewer than the tokenizer's "
            f"(processing_class) {tokens} tokens: prompts can hold ids up to {tokens - 1}, which it cannot read. "
            f"Pass the policy's tokenizer as processing_class, or resize it: model.resize_token_embeddings({tokens})."
        )
    for name in [name for name in built if name != "policy"]:
        size = embedding_size(built.get(name))
        check_same_tokenizer(name, built.get(name), tokenizer, size, policy_size)
        if size is not None and size < tokens:
            raise ValueError(
                f"{name} has an embedding for {size} token ids, fewer than the tokenizer's {tokens} tokens: prompts "
                f"and responses can hold ids up to {tokens - 1}, which {name} cannot read (an IndexError, or a "
                f"device-side assert on GPU, in the first rollout). Use a {name} built for the policy's tokenizer, or "
                f"resize it: {name}.resize_token_embeddings({tokens})."
            )
        if size is not None and policy_size is not None and size < policy_size:
            logger.warning(
                "%s reads %d token ids, the policy's embedding has %d rows (padded past the tokenizer's tokens, as "
                "e.g. Qwen's are): should the policy ever sample one of the padding ids, it cannot read it.",
                name,
                size,
                policy_size,
            )


#: A text whose ids tell two tokenizers apart (words, digits, punctuation, accents, CJK).
TOKENIZER_PROBE = "The quick brown fox paid 12.50 for 3 naïve cafés; 你好, world!"


def own_tokenizer(model: nn.Module):
    """The tokenizer saved beside ``model`` (the local folder it was loaded from), or None."""
    folder = getattr(getattr(model, "config", None), "_name_or_path", None)
    files = ("tokenizer.json", "tokenizer_config.json")
    if not folder or not any(os.path.isfile(os.path.join(folder, file)) for file in files):
        return None
    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception:  # an unreadable or foreign tokenizer: judged by the vocabulary size alone
        return None


def special_tokens(tokenizer) -> set[str]:
    """The tokens ``tokenizer`` treats as special: named ones (pad, eos, ...) and added special tokens."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_tokens) | {token.content for token in added.values() if token.special}


def tokenizer_mismatch(own, tokenizer) -> str | None:
    """Why a model's ``own`` tokenizer is not the policy's ``tokenizer``, or None when they are the same: every id both
    have stands for the same token, and :data:`TOKENIZER_PROBE` becomes the same ids. Ids only one has are extensions
    (a ``[PAD]`` added later, the MOSS role tokens; the embedding size check covers them). Two special tokens at one
    id (``[PAD]`` and ``<pad>``) agree: the models only see them masked or at the end."""
    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    ours, theirs = special_tokens(tokenizer), special_tokens(own)
    conflicts = sorted(
        (i, token, by_id[i])
        for token, i in own.get_vocab().items()
        if i in by_id and by_id[i] != token and not (token in theirs and by_id[i] in ours)
    )
    if conflicts:
        i, token, policy_token = conflicts[0]
        return (
            f"{len(conflicts)} of its {len(own)} token ids stand for other tokens in the policy's tokenizer (id {i} is "
            f"{token!r} for it, {policy_token!r} for the policy)"
        )
    encoded = [t(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"] for t in (tokenizer, own)]
    if encoded[0] != encoded[1]:
        return f"{TOKENIZER_PROBE!r} becomes other ids ({encoded[1][:8]}… for it, {encoded[0][:8]}… for the policy)"
    return None


def check_same_tokenizer(name: str, model, tokenizer, size: int | None, policy_size: int | None) -> None:
    """A model that reads the policy's token ids must be built for the policy's tokenizer: its own tokenizer (saved
    beside it) must match (:func:`tokenizer_mismatch`); without one, an embedding larger than the policy's means
    another tokenizer."""
    if not isinstance(model, nn.Module):
        return
    own = own_tokenizer(model)
    fix = (
        "Pass its tokenizer, reward_processing_classes=[...] with one entry per reward source, so that the texts are "
        "re-tokenized for it"
        if name.startswith("reward_model")
        else f"Use a {name} built on the policy's tokenizer"
    )
    mismatch = tokenizer_mismatch(own, tokenizer) if own is not None else None
    if mismatch:
        raise ValueError(
            f"{name} comes with another tokenizer ({own.name_or_path}: {len(own)} tokens; the policy's has "
            f"{len(tokenizer)}): {mismatch}, so it would read the policy's token ids as other words. {fix}."
        )
    if own is None and size is not None and policy_size is not None and size > policy_size:
        raise ValueError(
            f"{name} reads {size} token ids, more than the policy's {policy_size}: it was built for another "
            f"tokenizer, and would read the policy's token ids as its own words. {fix}; if it does share the "
            f"policy's tokenizer, resize it: {name}.resize_token_embeddings({policy_size})."
        )


def check_stop_token_id(stop_token_id: int | None, tokenizer, policy_size: int | None) -> None:
    """The stop token must be an id the tokenizer has and the policy can generate, or responses never stop."""
    if stop_token_id is None:
        return
    limit = min(len(tokenizer), policy_size or len(tokenizer))
    if not 0 <= stop_token_id < limit:
        raise ValueError(
            f"stop_token_id={stop_token_id} is outside the vocabulary (the tokenizer has {len(tokenizer)} tokens, "
            f"the policy's embedding {policy_size} ids), so the policy can never generate it and responses would never "
            f"stop. Use an id below {limit}, e.g. the eos id {tokenizer.eos_token_id}, or stop_token='eos'."
        )


def check_prompt_ids(dataset: Dataset, vocab_size: int | None, name: str) -> None:
    """Every prompt id must be in ``[0, vocab_size)`` of the policy (computed with Arrow, without a Python pass)."""
    if vocab_size is None or len(dataset) == 0:
        return
    import pyarrow.compute as pc

    bounds = pc.min_max(pc.list_flatten(dataset.with_format("arrow")["input_ids"]))
    low, high = bounds["min"].as_py(), bounds["max"].as_py()
    if low is None or (low >= 0 and high < vocab_size):
        return
    row = next(i for i, ids in enumerate(dataset["input_ids"]) if min(ids) < 0 or max(ids) >= vocab_size)
    raise ValueError(
        f"{name} holds input_ids outside the policy's vocabulary [0, {vocab_size}): they range from {low} to {high} "
        f"(the first such row: {row}). They were tokenized with another tokenizer or hold a placeholder such as -100. "
        "Tokenize the prompts with this trainer's processing_class, or pass a 'prompt' column instead."
    )


def evaluation_metric_names(eval_dataset, rollout_metrics) -> list[str]:
    """The names ``evaluate()`` logs: ``eval_<metric>``, or ``eval_<name>_<metric>`` for a dict of datasets."""
    prefixes = [f"eval_{key}" for key in eval_dataset] if isinstance(eval_dataset, dict) else ["eval"]
    names = [*M.PER_RESPONSE, *(rollout_metrics or {})]
    return [M.eval_name(name, prefix) for prefix in prefixes for name in names]


def check_best_metric(metric_for_best_model: str | None, eval_dataset, rollout_metrics) -> None:
    """``metric_for_best_model`` must be one that ``evaluate()`` logs, or the first evaluation fails, hours in."""
    if metric_for_best_model is None:
        return
    key = metric_for_best_model if metric_for_best_model.startswith("eval_") else f"eval_{metric_for_best_model}"
    logged = evaluation_metric_names(eval_dataset, rollout_metrics)
    if key in logged:
        return
    close = difflib.get_close_matches(key, logged, n=4, cutoff=0.5)
    hint = f"Close names: {', '.join(close)}. " if close else ""
    raise ValueError(
        f"metric_for_best_model={metric_for_best_model!r} is never logged: evaluate() reports no {key!r}, so choosing "
        f"the best model would fail at the first evaluation. {hint}evaluate() logs: {', '.join(logged)}. Set "
        "metric_for_best_model to one of them (the 'eval_' prefix is optional), e.g. 'objective/scores' (mean reward)."
    )


def check_deepspeed_epochs(args) -> None:
    """Extra critic epochs are refused under DeepSpeed: its engine steps every parameter inside ``backward``, so the
    policy's zero gradients there would still move it by Adam's momentum."""
    if args.update_epochs > args.num_ppo_epochs:
        raise ValueError(
            f"num_critic_epochs={args.num_critic_epochs} > num_ppo_epochs={args.num_ppo_epochs} is not supported under "
            "DeepSpeed (its optimizer steps the policy in the critic's extra epochs too); set num_critic_epochs=None, "
            "or train without DeepSpeed (DDP or FSDP)."
        )


def check_engine(fsdp_enabled: bool, distributed_type) -> None:
    """Warn when the launcher asked for FSDP but the trainer runs without it: accelerate (1.x) enables FSDP only on
    GPU-type process groups, silently running plain DDP on CPU."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not fsdp_enabled:
        logger.warning(
            "FSDP was requested (ACCELERATE_USE_FSDP=true) but is not active: accelerate enables it only on GPU "
            "process groups (this one is %s), so this run replicates every model on every process (DDP).",
            distributed_type,
        )


def lagged_rollouts(trainer, policy: nn.Module, engine):
    """The ``max_staleness`` ≥ 1 producer (:class:`~trl_ppomax.generation.lagged.LaggedRollouts`) of a trainer's
    rollout batches, sampled by a copy of its unwrapped ``policy``, or by the colocated vLLM ``engine``
    (``use_vllm``), which then becomes the producer's: returns the producer and the trainer's engine for evaluation
    and samples (``model.generate`` on the live policy with vLLM, else ``engine``). Refused where the policy is
    sharded."""
    from trl_ppomax.generation import HFGeneration
    from trl_ppomax.generation.lagged import LaggedRollouts, PolicyCopy
    from trl_ppomax.ppo.scoring import policy_logprobs

    check_lagged_engine(trainer.is_fsdp_enabled, trainer.accelerator)
    accelerator, args = trainer.accelerator, trainer.args

    def prompts(batch: int):
        tensors, columns = data.split_batch(trainer.prompt_batches[batch - 1], accelerator.device)
        return tensors["input_ids"], tensors["attention_mask"], columns

    ids = (trainer.stop_token_id, trainer.processing_class.pad_token_id)
    if args.use_vllm:
        producer_engine, engine = engine, HFGeneration(policy, args, *ids)
    else:
        producer_engine = PolicyCopy(policy, args, *ids, functools.partial(policy_logprobs, args=args))
    return LaggedRollouts(producer_engine, args, prompts, accelerator.autocast, accelerator.process_index), engine


def check_rollout_sources(args, rollout_func=None, tools=None, environment_factory=None) -> dict:
    """The user's ``rollout_func``, ``tools`` and ``environment_factory`` (TRL GRPO's), refused where they cannot
    generate the training rollouts; returned by name."""
    if rollout_func is not None and not callable(rollout_func):
        raise TypeError(f"rollout_func must be a callable f(prompts, trainer) -> dict; got {type(rollout_func)}.")
    if tools is not None and (not isinstance(tools, list | tuple) or not all(callable(t) for t in tools)):
        raise TypeError(f"tools must be a list of functions (sync or async); got {tools!r}.")
    factories = environment_factory.values() if isinstance(environment_factory, dict) else [environment_factory]
    if environment_factory is not None and not all(callable(factory) for factory in factories):
        raise TypeError(
            f"environment_factory must be a callable returning an environment (e.g. its class), or a dict of them "
            f"by name (TRL's several environments); got {environment_factory!r}."
        )
    agent = bool(tools) or environment_factory is not None
    if not agent:
        warn_agent_settings_without_an_agent(args, rollout_func is not None)
    if rollout_func is not None and agent:
        raise ValueError(
            "rollout_func writes the whole rollout, so it cannot be combined with tools or environment_factory (the "
            "trainer's agent loop): call your tools inside rollout_func, or drop rollout_func."
        )
    if args.max_staleness and (agent or rollout_func is not None):
        what, fix = ("rollout_func", "a rollout_func") if rollout_func is not None else ("The agent loop", "tools")
        raise ValueError(
            f"{what} generates each batch when the trainer asks for it; max_staleness={args.max_staleness} "
            f"generates ahead with the trainer's own engine. Set max_staleness=0 with {fix}."
        )
    return dict(rollout_func=rollout_func, tools=list(tools or []), environment_factory=environment_factory)


def warn_agent_settings_without_an_agent(args, has_rollout_func: bool) -> None:
    """The agent loop's settings, set without ``tools`` or ``environment_factory``, do nothing: say so (as the
    critic's settings without a critic). ``train_on_env_tokens`` also acts on a ``rollout_func``'s ``env_mask``."""
    by_grpo = {"max_tool_turns": "max_tool_calling_iterations", "max_completion_tokens": "max_completion_length"}
    given = getattr(args, "grpo_names_given", ())
    unused = [  # set through TRL GRPO's names, which a script without tools sets too: not named
        name
        for name in ("max_tool_turns", "max_completion_tokens", "tool_timeout")
        if getattr(args, name) is not None and by_grpo.get(name) not in given
    ]
    if args.train_on_env_tokens and not has_rollout_func:
        unused.append("train_on_env_tokens")
    if unused:
        logger.warning(
            "%s: not applied, the run has no agent loop (pass tools=[...] or environment_factory= to the trainer).",
            ", ".join(f"{name}={getattr(args, name)!r}" for name in unused),
        )


def agent_and_reward_sources(
    args, tokenizer, reward_model, processing_classes, rollouts: dict, stop_id: int, context: int | None = None
):
    """The agent loop (None without ``tools`` and ``environment_factory``; its trajectories bounded by the policy's
    ``context``) and the reward sources: the user's, and the environment's ``get_reward`` (weight 1, named after its
    class) when it has one."""
    from trl_ppomax.generation.agent import AgentRollouts, EnvironmentReward

    agent = None
    if rollouts["tools"] or rollouts["environment_factory"] is not None:
        factory = rollouts["environment_factory"]
        agent = AgentRollouts(args, tokenizer, rollouts["tools"], factory, stop_id, context_length=context)
    owned = [] if agent is None else [t for t in agent.environment_types if callable(getattr(t, "get_reward", None))]
    if not owned:
        if reward_model is None:
            raise ValueError(
                f"reward_model is None: {_MISSING['reward_model']}; or an environment_factory whose environment "
                "defines get_reward()."
            )
        return agent, rewards.RewardSources(reward_model, processing_classes, args.reward_weights)
    given = (
        []
        if reward_model is None
        else list(reward_model)
        if isinstance(reward_model, list | tuple)
        else [reward_model]
    )
    classes = [None] * len(given) if processing_classes is None else list(processing_classes)
    weights = None if args.reward_weights is None else [*args.reward_weights, *[1.0] * len(owned)]
    sources = [*given, *(EnvironmentReward(environment_type) for environment_type in owned)]
    return agent, rewards.RewardSources(sources, [*classes, *[None] * len(owned)], weights)


def agent_turn_end(args, tokenizer, stop_token_id: int | None) -> int | None:
    """The token an agent's policy turn ends at: the chat template's end-of-turn token (as TRL GRPO's turns end,
    whatever ``stop_token`` says), else ``stop_token_id``."""
    from trl_ppomax.generation.tools import end_of_turn_token

    turn_end = end_of_turn_token(tokenizer, args.chat_template_kwargs)
    if turn_end is None:
        return stop_token_id
    if stop_token_id not in (None, turn_end):
        logger.info(
            "Agent turns end at the chat template's end-of-turn token %r (id %d), not at the stop token id %d.",
            tokenizer.convert_ids_to_tokens(turn_end),
            turn_end,
            stop_token_id,
        )
    return turn_end


#: TRL GRPO's prompt of a row whose environment writes it (``reset()``): one empty user turn.
EMPTY_PROMPT = [{"role": "user", "content": ""}]


def environment_placeholder_prompts(args, tokenizer) -> Dataset:
    """TRL GRPO's training without a ``train_dataset``: the environment's ``reset()`` writes each prompt, so the
    dataset is one rollout batch of empty user turns (cycled, tokenized here: they are not prompts to check), and
    ``max_steps`` says how long to train."""
    if args.max_steps <= 0:
        raise ValueError(NO_RUN_LENGTH)
    rows = max(1, args.batch_size // args.num_samples_per_prompt)
    return with_empty_prompts(Dataset.from_dict({"row": list(range(rows))}), args, tokenizer).remove_columns("row")


def with_empty_prompts(dataset: Dataset | None, args, tokenizer) -> Dataset | None:
    """A dataset of an environment's rows (e.g. only TRL's ``environment`` column) with TRL's empty user turn as
    each row's prompt when it has neither ``prompt`` nor ``input_ids`` (tokenized here: not prompts to check);
    others unchanged."""
    if dataset is None or {"prompt", "input_ids"} & set(dataset.column_names):
        return dataset
    ids = data.tokenize_prompt(EMPTY_PROMPT, tokenizer, template_kwargs=args.chat_template_kwargs)
    return dataset.add_column("prompt", [EMPTY_PROMPT] * len(dataset)).add_column("input_ids", [ids] * len(dataset))


def check_lagged_engine(fsdp_enabled: bool, accelerator) -> None:
    """``max_staleness`` ≥ 1 copies the whole policy into the producer: refused where each process holds a shard."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if fsdp_enabled or (plugin is not None and plugin.zero_stage == 3):
        engine = "FSDP" if fsdp_enabled else "DeepSpeed ZeRO-3"
        raise ValueError(
            f"max_staleness ≥ 1 generates with a full copy of the policy on each process, but {engine} shards it: "
            "use DDP or ZeRO-1/2, or set max_staleness=0."
        )


@dataclass
class Setup:
    """What :func:`set_up` hands the trainer: the tokenizer, the built models, the reward sources (``reward_model``:
    trl 1.12's ``trainer.reward_model``, the one the critic was initialised from, else the first source), the prepared
    prompt datasets, the stop token id (None: none), the token the missing-stop-token penalty looks for and the
    checked ``rollout_func`` and agent loop."""

    tokenizer: object
    policy: nn.Module
    ref_model: nn.Module | None
    critic: nn.Module | None
    reward_sources: rewards.RewardSources
    reward_model: object
    train_dataset: Dataset
    eval_dataset: Dataset | dict[str, Dataset] | None
    stop_token_id: int | None
    stop_id: int
    rollout_func: object | None = None
    agent: object | None = None


def set_up(
    args,
    tokenizer,
    passed: dict,
    datasets: tuple,
    peft_config,
    reward_processing_classes,
    rollout_metrics,
    rollouts: dict,
):
    """:class:`~trl_ppomax.PPOMaxTrainer`'s set-up: arguments checked (:func:`check_inputs`; ``passed``: the model
    arguments by name, ``datasets``: train, eval and ptx), policy, reference and critic (if needed) built, then
    checked with the prepared prompt datasets (:func:`prepare_and_check`)."""
    train_dataset, eval_dataset, _ = datasets
    if args.should_save:
        probe_writable(args.output_dir)  # a folder that cannot be written fails before any model is built
    rollouts = check_rollout_sources(args, **rollouts)
    tokenizer, loaded = check_inputs(args, tokenizer, passed, *datasets, peft_config, rollouts)
    if rollouts["environment_factory"] is not None:  # an environment's rows may carry no prompt: reset() writes it
        train_dataset = with_empty_prompts(train_dataset, args, tokenizer)
    model, ref_model, value_model = loaded["model"], loaded["ref_model"], loaded["value_model"]
    stop_token_id = tokenizer.eos_token_id if args.stop_token == "eos" else args.stop_token_id
    if rollouts["tools"] or rollouts["environment_factory"] is not None:
        stop_token_id = agent_turn_end(args, tokenizer, stop_token_id)
    stop_id = stop_token_id if stop_token_id is not None else tokenizer.eos_token_id
    reward_model, classes = loaded["reward_model"], reward_processing_classes
    context = data.model_context(model)
    agent, sources = agent_and_reward_sources(args, tokenizer, reward_model, classes, rollouts, stop_id, context)
    if not args.uses_critic and value_model is not None:
        raise ValueError(
            f"value_model was passed, but advantage_estimator={args.advantage_estimator!r} needs no critic and builds "
            "none: pass value_model=None, or an estimator with a critic (advantage_estimator='gae')."
        )
    critic_source = sources.critic_source(value_model) if args.uses_critic else None
    policy, ref, critic = modeling.build_models(args, model, ref_model, critic_source, value_model, peft_config)
    # The models the user passed, by argument name: a reference or critic copied for None is not theirs to blame
    built = dict(policy=policy, ref_model=ref if ref_model is not None else None)
    built.update(sources.shared_vocabulary_models(), value_model=critic if value_model is not None else None)
    train_dataset, eval_dataset = prepare_and_check(
        args, tokenizer, built, stop_token_id, train_dataset, eval_dataset, rollout_metrics
    )
    if train_dataset is None:
        train_dataset = environment_placeholder_prompts(args, tokenizer)
    first = critic_source if critic_source is not None else sources.sources[0]
    datasets, rollout_func = (train_dataset, eval_dataset), rollouts["rollout_func"]
    return Setup(
        tokenizer, policy, ref, critic, sources, first, *datasets, stop_token_id, stop_id, rollout_func, agent
    )
