"""Set-up of :class:`~trl_ppomax.PPOMaxTrainer` (:func:`set_up`): the models loaded from paths and built (reference,
critic), the tokenizer, the prompt datasets prepared, the reward sources, the agent loop, the producer of rollouts
generated ahead; each step after the refusals of :mod:`~trl_ppomax.ppo.checks` that concern it, before anything
expensive."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

from datasets import Dataset
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from trl_ppomax import data, rewards
from trl_ppomax import models as modeling
from trl_ppomax.data.files import probe_writable
from trl_ppomax.ppo import checks
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
            if checks.is_path(args) or isinstance(args, nn.Module)
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
    for name, dataset in (*given, *checks.named_eval_datasets(eval_dataset)):
        checks.check_dataset_type(name, dataset)
    if args.ptx_coef > 0 and ptx_dataset is None:
        raise ValueError("ptx_coef > 0 needs a ptx_dataset: pass PPOMaxTrainer(..., ptx_dataset=...) or ptx_coef=0.")
    if rollouts.get("rollout_func") is None:  # else a reward function may also take the rollout_func's extra keys
        names = train_dataset.column_names if train_dataset is not None else ["prompt"]
        columns = [*names, *(["environments"] if environment else [])]
        rewards.check_reward_functions(models["reward_model"], columns)
    for name, value in models.items():  # a missing local folder, before loading anything (a tokenizer first)
        for item in value if isinstance(value, list | tuple) else [value]:
            checks.check_model_path(name, item)
    if processing_class is None:
        processing_class = policy_tokenizer(models["model"], args)
    data.check_tokenizer(processing_class)
    checks.check_stop_token(args, processing_class)
    options = load_options(args)
    loaded = {name: load_model(name, value, options) for name, value in models.items()}  # last: may take minutes
    checks.check_model_arguments(loaded, peft_config)
    for name in ("model", "ref_model"):
        checks.check_generates(name, loaded[name])
    return processing_class, loaded


def default_config(args, model) -> object:
    """``args``, or without one TRL GRPO's default: a config writing to ``<model name>-PPOMax``."""
    if args is not None:
        return args
    name = os.fspath(model) if checks.is_path(model) else getattr(getattr(model, "config", None), "_name_or_path", "")
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
    folder = (
        os.fspath(model) if checks.is_path(model) else getattr(getattr(model, "config", None), "_name_or_path", None)
    )
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
    if not checks.is_path(value):
        return value
    checks.check_model_path(name, value)
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


# -- Once the models are built -----------------------------------------------------------------------------------------
def prepare_and_check(
    args, tokenizer, built: dict[str, nn.Module | None], stop_token_id, train_dataset, eval_dataset, rollout_metrics
) -> tuple[Dataset, Dataset | dict[str, Dataset] | None]:
    """Check the built models (``built``: ``policy``, ``ref_model``, ``reward_model``, ``value_model``, the last
    being the critic) and the stop token id, prepare the prompt datasets and check ``metric_for_best_model``.
    Returns the prepared ``(train_dataset, eval_dataset)``."""
    policy = built["policy"]
    checks.check_vocabularies(tokenizer, built)
    checks.check_stop_token_id(stop_token_id, tokenizer, modeling.embedding_size(policy))
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
    checks.check_best_metric(args.metric_for_best_model, eval_dataset, rollout_metrics)
    return train_dataset, eval_dataset


def prepared_prompts(args, tokenizer, policy, dataset: Dataset, name: str) -> Dataset:
    """A prompt dataset tokenized and cut to the prompt budget (:func:`data.prompt_preparer`), its ids checked."""
    dataset = data.prompt_preparer(args, tokenizer, policy)(dataset, name=name)
    checks.check_prompt_ids(dataset, modeling.embedding_size(policy), name)
    return dataset


def prepare_eval_prompts(trainer, dataset: Dataset, name: str = "eval_dataset") -> Dataset:
    """A dataset passed to ``evaluate()`` prepared exactly as the training prompts (:func:`prepared_prompts`)."""
    checks.check_dataset_type(name, dataset)
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    return prepared_prompts(trainer.args, trainer.processing_class, policy, dataset, name)


def rollout_producer(trainer, policy: nn.Module, engine):
    """The ``max_staleness`` ≥ 1 producer (:class:`~trl_ppomax.generation.lagged.LaggedRollouts`) of a trainer's
    rollout batches, sampled by a copy of its unwrapped ``policy``, or by the colocated vLLM ``engine``
    (``use_vllm``), which then becomes the producer's: returns the producer and the trainer's engine for evaluation
    and samples (``model.generate`` on the live policy with vLLM, else ``engine``). Refused where the policy is
    sharded."""
    from trl_ppomax.generation import HFGeneration
    from trl_ppomax.generation.lagged import LaggedRollouts, PolicyCopy
    from trl_ppomax.ppo.scoring import policy_logprobs

    checks.check_producer_engine(trainer.is_fsdp_enabled, trainer.accelerator)
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


def agent_and_reward_sources(
    args, tokenizer, reward_model, processing_classes, rollouts: dict, end_token_id: int, context: int | None = None
):
    """The agent loop (None without ``tools`` and ``environment_factory``; its trajectories bounded by the policy's
    ``context``) and the reward sources: the user's, and the environment's ``get_reward`` (weight 1, named after its
    class) when it has one."""
    from trl_ppomax.generation.agent import AgentRollouts, EnvironmentReward

    agent = None
    if rollouts["tools"] or rollouts["environment_factory"] is not None:
        factory = rollouts["environment_factory"]
        agent = AgentRollouts(args, tokenizer, rollouts["tools"], factory, end_token_id, context_length=context)
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


@dataclass(kw_only=True)
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
    end_token_id: int
    rollout_func: object | None = None
    agent: object | None = None


def stop_and_end_tokens(args, tokenizer, rollouts: dict) -> tuple[int | None, int]:
    """``(stop_token_id, end_token_id)``: where generation stops (``stop_token``/``stop_token_id``; an agent's turns at
    the chat template's end of turn; None: ``response_length`` tokens), and the token a finished response ends with
    (the stop token, else eos), which the missing-stop-token penalty and the length metrics look for."""
    stop_token_id = tokenizer.eos_token_id if args.stop_token == "eos" else args.stop_token_id
    if rollouts["tools"] or rollouts["environment_factory"] is not None:
        stop_token_id = agent_turn_end(args, tokenizer, stop_token_id)
    return stop_token_id, stop_token_id if stop_token_id is not None else tokenizer.eos_token_id


def set_up(
    *,
    args,
    tokenizer,
    models: dict,
    train_dataset,
    eval_dataset,
    ptx_dataset,
    peft_config,
    reward_processing_classes,
    rollout_metrics,
    rollouts: dict,
) -> Setup:
    """:class:`~trl_ppomax.PPOMaxTrainer`'s set-up: arguments checked (:func:`check_inputs`; ``models``: the model
    arguments by name as passed, ``rollouts``: ``rollout_func``, ``tools`` and ``environment_factory``), policy,
    reference and critic (if needed) built, then checked with the prepared prompt datasets
    (:func:`prepare_and_check`)."""
    passed, datasets = models, (train_dataset, eval_dataset, ptx_dataset)
    if args.should_save:
        probe_writable(args.output_dir)  # a folder that cannot be written fails before any model is built
    rollouts = checks.check_rollout_sources(args, **rollouts)
    tokenizer, loaded = check_inputs(args, tokenizer, passed, *datasets, peft_config, rollouts)
    if rollouts["environment_factory"] is not None:  # an environment's rows may carry no prompt: reset() writes it
        train_dataset = with_empty_prompts(train_dataset, args, tokenizer)
    model, ref_model, value_model = loaded["model"], loaded["ref_model"], loaded["value_model"]
    stop_token_id, end_token_id = stop_and_end_tokens(args, tokenizer, rollouts)
    reward_model, classes = loaded["reward_model"], reward_processing_classes
    context = data.model_context(model)
    agent, sources = agent_and_reward_sources(args, tokenizer, reward_model, classes, rollouts, end_token_id, context)
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
    return Setup(
        tokenizer=tokenizer,
        policy=policy,
        ref_model=ref,
        critic=critic,
        reward_sources=sources,
        reward_model=critic_source if critic_source is not None else sources.sources[0],
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        stop_token_id=stop_token_id,
        end_token_id=end_token_id,
        rollout_func=rollouts["rollout_func"],
        agent=agent,
    )
