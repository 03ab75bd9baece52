"""The trainer's refusals, run before anything expensive: every fault visible in its arguments fails here, naming
the argument and the fix, not as an ``IndexError`` in the first rollout or as silently wrong training (the models fit
together, vocabularies and tokenizers agree, prompt ids are readable, the stop token can be generated, the best-model
metric is logged, the rollout sources and engines can run together). Numeric settings alone are checked by
``PPOMaxConfig._validate``; :mod:`~trl_ppomax.ppo.setup` calls these as it builds."""

from __future__ import annotations

import difflib
import logging
import os

from datasets import Dataset
from torch import nn
from transformers import AutoTokenizer

from trl_ppomax import models as modeling
from trl_ppomax.base import metrics as M
from trl_ppomax.data.sources import looks_local
from trl_ppomax.models import embedding_size

logger = logging.getLogger(__name__)


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


def is_path(value) -> bool:
    return isinstance(value, str | os.PathLike)


def check_model_path(name: str, value) -> None:
    """A ``FileNotFoundError`` naming the argument when ``value`` is meant as a local path (a ``Path``, or a string
    :func:`~trl_ppomax.data.sources.looks_local` says is one) that does not exist."""
    if not is_path(value):
        return
    text = os.fspath(value)
    local = isinstance(value, os.PathLike) or looks_local(text)
    path = os.path.expanduser(text)
    if local and not os.path.exists(path):
        raise FileNotFoundError(
            f"{name}={text!r} could not be loaded: the local path {os.path.abspath(path)} does not exist. Fix the "
            f"path (relative paths start from the current folder, {os.getcwd()}); a Hub model is named 'org/name'."
        )


def check_dataset_type(name: str, dataset) -> None:
    if isinstance(dataset, Dataset):
        return
    if isinstance(dataset, dict):
        fix = f"pass one split, e.g. {name}=dataset[{next(iter(dataset), 'train')!r}]"
    else:
        fix = "PPO samples prompts by index, so pass a datasets.Dataset (not a streaming IterableDataset)"
    raise TypeError(f"{name} must be a datasets.Dataset, got {type(dataset).__name__}: {fix}.")


def named_eval_datasets(eval_dataset) -> list[tuple[str, object]]:
    if eval_dataset is None:
        return []
    if isinstance(eval_dataset, dict):
        return [(f"eval_dataset[{key!r}]", value) for key, value in eval_dataset.items()]
    return [("eval_dataset", eval_dataset)]


def check_stop_token(args, tokenizer) -> None:
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


def check_producer_engine(fsdp_enabled: bool, accelerator) -> None:
    """``max_staleness`` ≥ 1 copies the whole policy into the producer: refused where each process holds a shard."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if fsdp_enabled or (plugin is not None and plugin.zero_stage == 3):
        engine = "FSDP" if fsdp_enabled else "DeepSpeed ZeRO-3"
        raise ValueError(
            f"max_staleness ≥ 1 generates with a full copy of the policy on each process, but {engine} shards it: "
            "use DDP or ZeRO-1/2, or set max_staleness=0."
        )
