"""TRL GRPO's config names on :class:`~trl_ppomax.PPOMaxConfig`, so that ``PPOMaxConfig as GRPOConfig`` runs a TRL
GRPO script: every field ``trl.GRPOConfig`` adds to ``TrainingArguments`` is ours with TRL's meaning, mapped onto
ours, or refused by name with why and the nearest setting (:data:`GRPO_NAMES`, the one table; the GRPO guide's table
is rendered from it by :func:`render_table`).

The fields :class:`GRPOArguments` declares default to ``None`` ("not set"): :func:`apply_grpo_names` maps what a
script set onto our fields before the preset fills the rest, and writes TRL's name back for the pure aliases
(``num_generations``, ``max_completion_length``, …) so a script reading them finds the run's value."""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
from dataclasses import dataclass, field, fields
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GRPOName:
    """One ``trl.GRPOConfig`` field: ``how`` it is taken here (``"same"``: our field of that name, TRL's meaning;
    ``"mapped"``: onto ``ours``; ``"accepted"``: TRL's behaviour, implemented here; ``"refused"``: only TRL's default
    ``accepted`` is accepted, where it changes nothing), and ``meaning``: what it does here, or why it is refused
    and what comes nearest."""

    name: str
    how: str
    meaning: str
    ours: str = ""
    accepted: Any = None


def _same(name: str, meaning: str = "") -> GRPOName:
    return GRPOName(name, "same", meaning or "Our field of that name, TRL's meaning.", name)


def _refused(name: str, accepted: Any, why: str) -> GRPOName:
    return GRPOName(name, "refused", why, accepted=accepted)


_VLLM_SAME = (
    "use_vllm",
    "vllm_mode",
    "vllm_model_impl",
    "vllm_enable_sleep_mode",
    "vllm_server_base_url",
    "vllm_server_host",
    "vllm_server_port",
    "vllm_server_timeout",
    "vllm_group_port",
    "vllm_gpu_memory_utilization",
    "vllm_max_model_length",
    "vllm_tensor_parallel_size",
)

#: Every field ``trl.GRPOConfig`` (trl 1.16) adds to ``TrainingArguments``, and how it is taken here.
GRPO_NAMES: tuple[GRPOName, ...] = (
    # -- models -----------------------------------------------------------------------------------------------------
    GRPOName(
        "model_init_kwargs", "accepted", "Keyword arguments of from_pretrained for models passed as a path or Hub id."
    ),
    GRPOName("trust_remote_code", "accepted", "Passed to from_pretrained of the models and tokenizer loaded by name."),
    _refused("router_aux_loss_coef", None, "A MoE router's auxiliary loss is not added to the policy loss."),
    GRPOName(
        "disable_dropout",
        "accepted",
        "Dropout is always off in the policy, reference and critic (PPO's ratio needs deterministic forwards): True "
        "is what runs; False is accepted and said (dropout stays off).",
    ),
    _refused("cast_lm_head_to_fp32", False, "The LM head runs in the model's dtype; log-probs are taken in float32."),
    # -- generation -------------------------------------------------------------------------------------------------
    GRPOName("num_generations", "mapped", "Responses per prompt.", "num_samples_per_prompt"),
    _refused(
        "num_generations_eval", None, "Evaluation samples one response per prompt (greedy unless eval_do_sample)."
    ),
    GRPOName(
        "max_completion_length",
        "mapped",
        "The policy's tokens per response; in agent runs also the trajectory's budget, tool tokens included "
        "(max_completion_tokens, when that is unset), as TRL bounds the whole completion.",
        "response_length",
    ),
    _same("ds3_gather_for_generation"),
    GRPOName(
        "shuffle_dataset",
        "accepted",
        "True (TRL's default): prompts in a reshuffled order each epoch, which is what runs (a resumable order); "
        "False is accepted and said: the order is still reshuffled.",
    ),
    _refused("pad_to_multiple_of", "auto", "Batches are padded to their longest row; 'auto' and None are accepted."),
    GRPOName(
        "generation_batch_size",
        "mapped",
        "Completions per generation over all processes: num_mini_batches = generation_batch_size ÷ "
        "(per_device_train_batch_size × gradient_accumulation_steps × processes).",
        "num_mini_batches",
    ),
    GRPOName(
        "steps_per_generation",
        "mapped",
        "Micro-steps per generation: num_mini_batches = steps_per_generation ÷ gradient_accumulation_steps (one "
        "optimizer step per minibatch).",
        "num_mini_batches",
    ),
    _same("temperature", "Our field; PPO-max's default is 0.8 (GRPOConfig's 1.0), said at start."),
    _same("top_p", "Our field; PPO-max's default is 0.9 (GRPOConfig's 1.0), said at start."),
    GRPOName("top_k", "accepted", "Top-k filtering of rollout sampling (0: off), after temperature, before top-p."),
    GRPOName("min_p", "accepted", "Min-p filtering of rollout sampling (None: off)."),
    GRPOName(
        "generation_kwargs",
        "accepted",
        "Extra keyword arguments of generate() (or vLLM's SamplingParams), applied last, as in TRL.",
    ),
    GRPOName(
        "chat_template_kwargs",
        "accepted",
        "Extra keyword arguments of apply_chat_template for conversational prompts and agent turns (e.g. "
        "{'enable_thinking': False} for Qwen3).",
    ),
    _same("repetition_penalty", "Our field; PPO-max's default is 1.1 on generated tokens (GRPOConfig's 1.0)."),
    GRPOName("cache_implementation", "accepted", "generate()'s cache_implementation."),
    *(_same(name) for name in _VLLM_SAME),
    _refused("vllm_structured_outputs_regex", None, "Structured outputs are not passed to vLLM."),
    # -- the objective ----------------------------------------------------------------------------------------------
    GRPOName(
        "beta",
        "mapped",
        "TRL's KL as a loss: kl_coef = beta, kl_placement='loss', kl_estimator='k3'. Unset: PPO-max's KL penalty "
        "in the reward (kl_coef 0.05).",
        "kl_coef",
    ),
    GRPOName("num_iterations", "mapped", "Passes over each generation batch.", "num_ppo_epochs"),
    GRPOName("epsilon", "mapped", "ε of the clipped surrogate (the lower clip).", "cliprange"),
    GRPOName("delta", "mapped", "INTELLECT-2's upper bound of the ratio: for A < 0 it is dual-clip's c.", "dual_clip"),
    GRPOName("epsilon_high", "mapped", "ε_high of the upper clip (DAPO).", "cliprange_high"),
    *(
        _refused(name, default, "Acts only with loss_type='sapo' or 'vespo', which are refused.")
        for name, default in (
            ("sapo_temperature_neg", 1.05),
            ("sapo_temperature_pos", 1.0),
            ("vespo_k_pos", 2.0),
            ("vespo_lambda_pos", 3.0),
            ("vespo_k_neg", 3.0),
            ("vespo_lambda_neg", 2.0),
        )
    ),
    _refused(
        "importance_sampling_level", "token", "Ratios are per token; GSPO's sequence-level ratio is not offered."
    ),
    _same("reward_weights"),
    _refused(
        "multi_objective_aggregation",
        "sum_then_normalize",
        "The weighted sum of the reward sources is the score ('sum_then_normalize'); normalising each first is not "
        "offered.",
    ),
    GRPOName(
        "scale_rewards",
        "mapped",
        "With a group estimator: 'group'/True divides by each group's std + 1e-4 (TRL's ε), 'batch' by the batch's, "
        "'none'/False by nothing (advantage_estimator='grpo' becomes 'dr_grpo'). With 'gae' it is not applied "
        "(said).",
        "group_scale",
    ),
    GRPOName(
        "loss_type",
        "mapped",
        "'grpo' → seq_mean_token_mean, 'bnpo' → token_mean (each micro-batch's), 'dapo' → minibatch_token_mean, "
        "'dr_grpo' → seq_mean_token_sum_norm, 'luspo' → seq_mean_token_sum; 'cispo', 'sapo' and 'vespo' (other "
        "objectives) are refused: the nearest is 'dapo' with epsilon_high.",
        "loss_aggregation",
    ),
    GRPOName(
        "mask_truncated_completions",
        "accepted",
        "Responses cut by the length budget (no stop token) are left out of the policy loss and the KL.",
    ),
    _refused(
        "sync_ref_model", False, "The reference stays the initial policy (TR-DPO's reference sync is not offered)."
    ),
    _refused("ref_model_mixup_alpha", 0.6, "Acts only with sync_ref_model, which is refused."),
    _refused("ref_model_sync_steps", 512, "Acts only with sync_ref_model, which is refused."),
    _refused(
        "top_entropy_quantile", 1.0, "Every policy token is trained; high-entropy token filtering is not offered."
    ),
    _same("entropy_coef", "Our field: the loss − entropy_coef·H, TRL's static entropy bonus."),
    _refused("use_adaptive_entropy", False, "The entropy coefficient is fixed: set entropy_coef."),
    _refused("entropy_coef_min", 0.0, "Acts only with use_adaptive_entropy, which is refused."),
    _refused("entropy_coef_max", 1.0, "Acts only with use_adaptive_entropy, which is refused."),
    _refused("entropy_coef_delta", 0.005, "Acts only with use_adaptive_entropy, which is refused."),
    _same(
        "entropy_target",
        "Our field, not TRL's: H* of the release's |H − H*| (with entropy_coef); TRL's is the adaptive controller's "
        "target, which does nothing without use_adaptive_entropy.",
    ),
    GRPOName("max_tool_calling_iterations", "mapped", "The most tool-result turns per trajectory.", "max_tool_turns"),
    _same("vllm_importance_sampling_correction"),
    _refused(
        "vllm_importance_sampling_mode",
        "token_truncate",
        "vLLM's gap is corrected per token, truncated at vllm_importance_sampling_clip_max (TRL's "
        "'token_truncate'); the other modes are not offered.",
    ),
    _same("vllm_importance_sampling_clip_max"),
    _refused("vllm_importance_sampling_clip_min", None, "Importance weights are truncated from above only."),
    _refused("off_policy_mask_threshold", None, "No off-policy sequence mask; max_staleness has its own correction."),
    GRPOName(
        "use_bias_correction_kl",
        "mapped",
        "With beta: TRL's KL term times the importance ratio π_θ/π_old (default True, as TRL).",
        "kl_loss_importance_weighted",
    ),
    # -- logging ----------------------------------------------------------------------------------------------------
    GRPOName(
        "log_completions", "accepted", "Print the last rollout's completions and scores at each log (rich table)."
    ),
    GRPOName("num_completions_to_print", "accepted", "How many completions log_completions prints (None: all)."),
    GRPOName("log_multimodal", "accepted", "Text-only runs: nothing multimodal to log."),
    _refused("log_unique_prompts", False, "log_completions prints every completion row."),
    _refused("log_completions_hub_repo", None, "Completions are not uploaded; trackers get the logged metrics."),
    _same("use_transformers_continuous_batching"),
    _same("transformers_continuous_batching_config"),
    _refused("use_transformers_paged", False, "Deprecated in TRL for use_transformers_continuous_batching, refused."),
    _refused("vllm_importance_sampling_cap", None, "Deprecated in TRL: set vllm_importance_sampling_clip_max."),
)
BY_NAME = {entry.name: entry for entry in GRPO_NAMES}


def _unset(name: str) -> Any:
    """The field ``name``: None ("not set"), its help how :data:`GRPO_NAMES` takes it."""
    entry = BY_NAME[name]
    target = f" (→ {entry.ours})" if entry.how == "mapped" else ""
    text = f"TRL GRPOConfig's name. {entry.how.capitalize()}{target}: {entry.meaning} None: not set."
    return field(default=None, metadata={"help": text})


@dataclass
class GRPOArguments:
    """The fields of ``trl.GRPOConfig`` that are not our own, each ``None`` until a script sets it (a dataclass of
    fields, the base of :class:`~trl_ppomax.PPOMaxConfig` ahead of ``TrainingArguments``)."""

    model_init_kwargs: dict | str | None = _unset("model_init_kwargs")  # noqa: RUF009
    trust_remote_code: bool | None = _unset("trust_remote_code")
    router_aux_loss_coef: float | None = _unset("router_aux_loss_coef")
    disable_dropout: bool | None = _unset("disable_dropout")
    cast_lm_head_to_fp32: bool | None = _unset("cast_lm_head_to_fp32")
    num_generations: int | None = _unset("num_generations")
    num_generations_eval: int | None = _unset("num_generations_eval")
    max_completion_length: int | None = _unset("max_completion_length")
    shuffle_dataset: bool | None = _unset("shuffle_dataset")
    pad_to_multiple_of: int | str | None = _unset("pad_to_multiple_of")
    generation_batch_size: int | None = _unset("generation_batch_size")
    steps_per_generation: int | None = _unset("steps_per_generation")
    top_k: int | None = _unset("top_k")
    min_p: float | None = _unset("min_p")
    generation_kwargs: dict | str | None = _unset("generation_kwargs")  # noqa: RUF009
    chat_template_kwargs: dict | str | None = _unset("chat_template_kwargs")  # noqa: RUF009
    cache_implementation: str | None = _unset("cache_implementation")
    vllm_structured_outputs_regex: str | None = _unset("vllm_structured_outputs_regex")
    beta: float | None = _unset("beta")
    num_iterations: int | None = _unset("num_iterations")
    epsilon: float | None = _unset("epsilon")
    delta: float | None = _unset("delta")
    epsilon_high: float | None = _unset("epsilon_high")
    sapo_temperature_neg: float | None = _unset("sapo_temperature_neg")
    sapo_temperature_pos: float | None = _unset("sapo_temperature_pos")
    vespo_k_pos: float | None = _unset("vespo_k_pos")
    vespo_lambda_pos: float | None = _unset("vespo_lambda_pos")
    vespo_k_neg: float | None = _unset("vespo_k_neg")
    vespo_lambda_neg: float | None = _unset("vespo_lambda_neg")
    importance_sampling_level: str | None = _unset("importance_sampling_level")
    multi_objective_aggregation: str | None = _unset("multi_objective_aggregation")
    scale_rewards: str | None = _unset("scale_rewards")
    loss_type: str | None = _unset("loss_type")
    mask_truncated_completions: bool | None = _unset("mask_truncated_completions")
    sync_ref_model: bool | None = _unset("sync_ref_model")
    ref_model_mixup_alpha: float | None = _unset("ref_model_mixup_alpha")
    ref_model_sync_steps: int | None = _unset("ref_model_sync_steps")
    top_entropy_quantile: float | None = _unset("top_entropy_quantile")
    use_adaptive_entropy: bool | None = _unset("use_adaptive_entropy")
    entropy_coef_min: float | None = _unset("entropy_coef_min")
    entropy_coef_max: float | None = _unset("entropy_coef_max")
    entropy_coef_delta: float | None = _unset("entropy_coef_delta")
    max_tool_calling_iterations: int | None = _unset("max_tool_calling_iterations")
    vllm_importance_sampling_mode: str | None = _unset("vllm_importance_sampling_mode")
    vllm_importance_sampling_clip_min: float | None = _unset("vllm_importance_sampling_clip_min")
    off_policy_mask_threshold: float | None = _unset("off_policy_mask_threshold")
    use_bias_correction_kl: bool | None = _unset("use_bias_correction_kl")
    log_completions: bool | None = _unset("log_completions")
    log_multimodal: bool | None = _unset("log_multimodal")
    num_completions_to_print: int | None = _unset("num_completions_to_print")
    log_unique_prompts: bool | None = _unset("log_unique_prompts")
    log_completions_hub_repo: str | None = _unset("log_completions_hub_repo")
    use_transformers_paged: bool | None = _unset("use_transformers_paged")
    vllm_importance_sampling_cap: float | None = _unset("vllm_importance_sampling_cap")


GRPO_ONLY = tuple(f.name for f in fields(GRPOArguments))

#: TRL's ``loss_type`` → our ``loss_aggregation`` (same per-token loss, same normaliser).
LOSS_TYPES = {
    "grpo": "seq_mean_token_mean",
    "bnpo": "token_mean",
    "dapo": "minibatch_token_mean",
    "dr_grpo": "seq_mean_token_sum_norm",
    "luspo": "seq_mean_token_sum",
}
#: TRL's ``scale_rewards`` (the CLI's strings and the booleans TRL accepts) → ours.
SCALE_REWARDS = {"group": "group", "true": "group", "batch": "batch", "none": "none", "false": "none"}
#: ε TRL adds to the std it divides advantages by.
TRL_STD_EPS = 1e-4


def _json(name: str, value):
    """A dict field given as JSON text (the command line's form), parsed; refused naming the field otherwise."""
    if not isinstance(value, str):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{name}={value!r} is not a JSON object ({error}): write it as '{{\"key\": value}}'."
        ) from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{name}={value!r} must be a JSON object, e.g. '{{\"key\": value}}'.")
    return parsed


def _check_picklable(name: str, value) -> None:
    """Every checkpoint saves the config (``training_args.bin``): a value pickle cannot write would fail the first save,
    hours in, so it is refused now."""
    try:
        pickle.dumps(value)
    except Exception as error:
        raise ValueError(
            f"{name}={value!r} cannot be saved with the checkpoints' training_args.bin ({error}): define its functions "
            "at module level (not inside a function), or leave them out."
        ) from None


def is_default(config, name: str) -> bool:
    """Whether our field ``name`` still holds its dataclass default (or the preset's "unset")."""
    value, default = getattr(config, name), config.__dataclass_fields__[name].default
    return value is default or value is None or value == default


def _set(config, ours: str, value, grpo: str) -> None:
    """Our field ``ours`` takes the value of TRL's ``grpo``; both set to different values is refused."""
    if not is_default(config, ours) and getattr(config, ours) != value:
        raise ValueError(
            f"{grpo}={getattr(config, grpo)!r} (TRL's name) sets {ours}={value!r}, but {ours}={getattr(config, ours)!r} "
            f"is set too: keep one of them."
        )
    setattr(config, ours, value)


def _refuse_non_defaults(config) -> None:
    for entry in GRPO_NAMES:
        if entry.how != "refused" or not hasattr(config, entry.name):
            continue
        value = getattr(config, entry.name)
        if entry.name.startswith("vllm_") and not config.use_vllm:
            continue  # vLLM's settings change nothing without vLLM (TRL reads them only with use_vllm)
        if value is None or value == entry.accepted or (entry.accepted == "auto" and value == "auto"):
            continue
        if entry.name == "pad_to_multiple_of" and str(value).lower() in ("none", "null", "auto"):
            continue
        raise ValueError(
            f"{entry.name}={value!r} (TRL GRPOConfig's) is not supported: {entry.meaning} Remove it, or set it to "
            f"TRL's default {entry.accepted!r}."
        )


def _map_batches(config) -> None:
    """``steps_per_generation`` / ``generation_batch_size`` → ``num_mini_batches`` (one optimizer step each)."""
    if config.steps_per_generation is not None and config.generation_batch_size is not None:
        raise ValueError(
            "generation_batch_size and steps_per_generation both set: as in TRL, set one of them (each fixes the other)."
        )
    accumulation = config.gradient_accumulation_steps
    if config.generation_batch_size is not None:
        processes = int(os.environ.get("WORLD_SIZE", "1"))  # the launcher's; the process state is not set up yet
        per_step = config.per_device_train_batch_size * processes * accumulation
        steps, remainder = divmod(config.generation_batch_size, per_step)
        name, value, unit = "generation_batch_size", config.generation_batch_size, per_step
    elif config.steps_per_generation is not None:
        steps, remainder = divmod(config.steps_per_generation, accumulation)
        name, value, unit = "steps_per_generation", config.steps_per_generation, accumulation
    else:
        return
    if remainder or steps < 1:
        raise ValueError(
            f"{name}={value} must be a multiple of {unit} (per optimizer step: per_device_train_batch_size × processes "
            "× gradient_accumulation_steps completions, gradient_accumulation_steps micro-steps), so that each "
            "minibatch of the generation batch is one optimizer step; change one of them."
        )
    _set(config, "num_mini_batches", steps, name)


def _map_objective(config) -> None:
    """``beta``, ``epsilon``/``epsilon_high``/``delta``, ``num_iterations``, ``loss_type``, ``scale_rewards``."""
    if config.beta is not None:
        _set(config, "kl_coef", float(config.beta), "beta")
        config.kl_placement, config.kl_estimator = "loss", "k3"
        weighted = True if config.use_bias_correction_kl is None else bool(config.use_bias_correction_kl)
        _set(config, "kl_loss_importance_weighted", weighted, "use_bias_correction_kl")
    elif config.use_bias_correction_kl:
        logger.warning("use_bias_correction_kl=True: not applied, it weights TRL's KL loss, which needs beta.")
    for grpo, ours in (("epsilon", "cliprange"), ("epsilon_high", "cliprange_high"), ("delta", "dual_clip")):
        if getattr(config, grpo) is not None:
            _set(config, ours, float(getattr(config, grpo)), grpo)
    if config.num_iterations is not None:
        _set(config, "num_ppo_epochs", config.num_iterations, "num_iterations")
    if config.loss_type is not None:
        if config.loss_type not in LOSS_TYPES:
            raise ValueError(
                f"loss_type={config.loss_type!r}: {BY_NAME['loss_type'].meaning} Choose one of {sorted(LOSS_TYPES)}."
            )
        _set(config, "loss_aggregation", LOSS_TYPES[config.loss_type], "loss_type")
    if config.scale_rewards is not None:
        _map_scale_rewards(config)


def _map_scale_rewards(config) -> None:
    scale = SCALE_REWARDS.get(str(config.scale_rewards).lower())
    if scale is None:
        raise ValueError(f"scale_rewards={config.scale_rewards!r} must be 'group', 'batch' or 'none' (or True/False).")
    config.scale_rewards = scale
    if config.advantage_estimator not in ("grpo", "dr_grpo"):
        logger.warning(
            "scale_rewards=%r: not applied, advantage_estimator=%r takes no group baseline (PPO-max's GAE uses the "
            "critic). Set advantage_estimator='grpo' for TRL's GRPO advantages.",
            scale,
            config.advantage_estimator,
        )
        return
    config.advantage_estimator = "dr_grpo" if scale == "none" else "grpo"
    if scale != "none":
        config.group_scale, config.group_std_eps = scale, TRL_STD_EPS


def _map_agent_and_sampling(config) -> None:
    if config.num_generations is not None:
        _set(config, "num_samples_per_prompt", config.num_generations, "num_generations")
    if config.max_completion_length is not None:  # TRL bounds the whole completion, an agent's tool tokens included
        _set(config, "response_length", config.max_completion_length, "max_completion_length")
        if config.max_completion_tokens is None:
            config.max_completion_tokens = config.max_completion_length
    if config.max_tool_calling_iterations is not None:
        _set(config, "max_tool_turns", config.max_tool_calling_iterations, "max_tool_calling_iterations")
    for name in (
        "model_init_kwargs",
        "generation_kwargs",
        "chat_template_kwargs",
        "transformers_continuous_batching_config",
    ):
        setattr(config, name, _json(name, getattr(config, name)))
        _check_picklable(name, getattr(config, name))
    if config.top_k is not None and config.top_k < 0:
        raise ValueError(f"top_k={config.top_k} must be ≥ 0 (0 turns top-k filtering off).")
    if config.min_p is not None and not 0.0 <= config.min_p <= 1.0:
        raise ValueError(f"min_p={config.min_p} must be in [0, 1] (None turns min-p filtering off).")
    if config.disable_dropout is False:
        logger.info("disable_dropout=False: dropout stays off here (PPO's ratio needs deterministic forwards).")
    if config.shuffle_dataset is False:
        logger.warning(
            "shuffle_dataset=False: not applied, prompts are drawn in a reshuffled order each epoch (a pure function "
            "of the seed, so that a resume continues exactly); shuffle the dataset yourself for another order."
        )


def apply_grpo_names(config) -> None:
    """Map the TRL GRPO names a script set (:data:`GRPO_NAMES`) onto our fields, refusing those not offered and a
    TRL name set together with ours to another value; a GRPO script's completions end at the eos token, as TRL's
    (``stop_token="eos"`` unless a stop token is set), and it generates only to train, as TRL's
    (``num_sample_generations=0`` unless set: no sample tables, ``log_completions`` prints TRL's), and a malformed
    tool call is text, as TRL's (``malformed_tool_calls="ignore"`` unless set). Runs before the preset fills the
    unset fields."""
    if grpo_names_set(config):
        if config.stop_token is None and config.stop_token_id is None:
            config.stop_token = "eos"
        if is_default(config, "num_sample_generations"):
            config.num_sample_generations = 0
        if config.malformed_tool_calls is None:
            config.malformed_tool_calls = "ignore"
    _refuse_non_defaults(config)
    _map_batches(config)
    _map_objective(config)
    _map_agent_and_sampling(config)


def write_back_aliases(config) -> None:
    """TRL's names of our settings, for scripts reading them (``args.num_generations``): the run's values."""
    config.num_generations = config.num_samples_per_prompt
    config.max_completion_length = config.response_length
    config.num_iterations = config.num_ppo_epochs
    config.steps_per_generation = config.num_mini_batches * config.gradient_accumulation_steps
    config.epsilon = config.cliprange
    config.max_tool_calling_iterations = config.max_tool_turns


def grpo_names_set(config) -> list[str]:
    """The GRPO-only names a script set (before :func:`write_back_aliases`)."""
    return [name for name in GRPO_ONLY if getattr(config, name) is not None]


#: Names whose PPO-max default differs from GRPOConfig's (said once at the start of a swapped GRPO script).
DIFFERING_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "repetition_penalty": 1.0,
    "learning_rate": 1e-6,
    "num_ppo_epochs": 1,
}


def swap_notice(config, set_by_user: set[str]) -> str:
    """What a swapped GRPO script runs, for one line at the start: the algorithm, and each default it did not set
    that differs from GRPOConfig's."""
    kl = "the KL in the reward" if config.kl_placement == "reward" else f"TRL's KL as a loss, β={config.kl_coef}"
    estimator = "a critic, GAE" if config.advantage_estimator == "gae" else repr(config.advantage_estimator)
    algorithm = f"{'PPO-max' if config.advantage_estimator == 'gae' else 'PPO'} ({estimator}, {kl})"
    differing = [
        f"{name}={getattr(config, name)!r} (GRPOConfig: {trl!r})"
        for name, trl in DIFFERING_DEFAULTS.items()
        if name not in set_by_user and not math.isclose(float(getattr(config, name)), trl)
    ]
    kept = f"; PPO-max's defaults where GRPOConfig's differ: {', '.join(differing)}" if differing else ""
    stop = ", completions ending at the eos token as TRL's" if config.stop_token == "eos" else ""
    stop += ", no sample tables (log_completions prints TRL's)" if config.num_sample_generations == 0 else ""
    return f"A TRL GRPO script on PPOMaxTrainer runs {algorithm}{stop}{kept}. Set a field to keep GRPO's value."


def render_table() -> str:
    """The GRPO guide's table: each ``trl.GRPOConfig`` field, how it is taken, what it does here."""
    rows = ["| GRPOConfig field | here | meaning |", "|---|---|---|"]
    for entry in GRPO_NAMES:
        how = f"mapped → `{entry.ours}`" if entry.how == "mapped" else entry.how
        if entry.how == "refused":
            how = f"refused unless `{entry.accepted!r}`"
        rows.append(f"| `{entry.name}` | {how} | {entry.meaning.replace('|', '∣')} |")
    return "\n".join(rows)
