"""PPOMaxConfig: every field of trl 1.12's ``PPOConfig`` (same names, defaults and meaning) plus the PPO-max fields.

Preset-dependent fields default to ``None`` (or :data:`FROM_PRESET` where ``None`` means "off"), resolved in
``__post_init__`` from :data:`PRESETS`, the one table of those defaults; an explicit value always wins. Help texts and
the class docstring are generated from it, so documentation cannot drift from behaviour.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args, get_origin

import torch
from transformers import TrainingArguments

from trl_ppomax.base.core import KLEstimator, LossAggregation, RewardNorm
from trl_ppomax.ppo import advantages, grpo_names
from trl_ppomax.ppo.grpo_names import GRPOArguments

logger = logging.getLogger(__name__)

Preset = Literal["ppo_max", "vanilla", "ppo_max_robust"]
ImportanceSampling = Literal["old_policy", "reference"]
VLLMMode = Literal["colocate", "server"]
AdvantageScope = Literal["batch", "minibatch"]
GradClipScope = Literal["per_model", "joint"]
KLPlacement = Literal["reward", "loss"]
StalenessCorrection = Literal["tis", "icepop"]
GroupScale = Literal["group", "batch"]
MalformedToolCalls = Literal["feedback", "ignore"]

#: The tricks beyond the paper, off in the paper's and trl's presets.
_BEYOND_PAPER_OFF = {"reward_norm_freeze": False, "reward_winsorize": None, "lam_critic": None, "lam_alpha": None}
# Defaults that differ between the paper's PPO-max, trl 1.12's PPO and our robust PPO-max; the rest have one default.
PRESETS: dict[str, dict[str, Any]] = {
    "ppo_max": {
        "reward_norm": "running",
        "reward_clip": 10.0,
        "whiten_advantages": False,
        "lam": 0.9,
        "max_grad_norm": 1.0,
        "critic_warmup_steps": 4,
        "temperature": 0.8,
        "top_p": 0.9,
        "repetition_penalty": 1.1,
        "logprob_temperature": 1.0,
        "vllm_importance_sampling_correction": True,
        **_BEYOND_PAPER_OFF,
    },
    "vanilla": {
        "reward_norm": "none",
        "reward_clip": None,
        "whiten_advantages": True,
        "lam": 0.95,
        "max_grad_norm": 0.0,
        "critic_warmup_steps": 0,
        "temperature": 0.7,
        "top_p": 1.0,
        "repetition_penalty": 1.0,
        "logprob_temperature": None,
        "vllm_importance_sampling_correction": False,
        **_BEYOND_PAPER_OFF,
    },
}
#: Beyond the paper: PPO-max plus frozen, winsorised reward moments and decoupled, length-adaptive GAE, the combination
#: the stress benchmark shows helping (benchmarks/README.md).
PRESETS["ppo_max_robust"] = {
    **PRESETS["ppo_max"],
    "reward_norm_freeze": True,
    "reward_winsorize": 3.0,
    "lam_critic": 1.0,
    "lam_alpha": 0.05,
}


#: The KL estimator names verl and OpenRLHF users type that are not ours, and what to set instead.
KL_ESTIMATOR_ALIASES = {
    "kl": "verl's name of k1 (the log-ratio): set kl_estimator='k1'.",
    "mse": "verl's name of k2 (½·log-ratio²): set kl_estimator='k2'.",
    "low_var_kl": "low_var_kl is verl's name of k3 (clamped ±10): set kl_estimator='k3' (and kl_clamp=10.0 for "
    "verl's clamp).",
    "abs": "verl's |log-ratio| is not offered: set kl_estimator='k1', 'k2' or 'k3'.",
    "k3+": "verl's k3+ (k3's value, k2's gradient) is not offered: set kl_estimator='k2' for the KL's gradient, or "
    "'k3'.",
    "low_var_kl+": "verl's low_var_kl+ (k3's value, k2's gradient) is not offered: set kl_estimator='k2' for the "
    "KL's gradient, or 'k3'.",
}

#: Settings of the critic alone (GAE's λ included): a critic-free estimator warns about any set away from its default.
CRITIC_SETTINGS = (
    "vf_coef",
    "cliprange_value",
    "critic_learning_rate",
    "critic_adam_epsilon",
    "num_critic_epochs",
    "lam",
    "lam_critic",
    "lam_alpha",
)


def default_bf16(fp16: bool) -> bool:
    """bf16 by default only where it runs: on a GPU that supports it, and not together with fp16."""
    return not fp16 and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


class _FromPreset:
    """Default of a preset field where ``None`` means "off"; replaced in ``__post_init__`` by the preset's value. Not a
    string, so argument parsers pass it through."""

    def __repr__(self) -> str:
        return "<from preset>"


FROM_PRESET = _FromPreset()


def _field(default: Any, text: str) -> Any:
    """A dataclass field with the help text ``text`` (``--help`` and the docstring)."""
    return field(default=default, metadata={"help": text})


def _preset_field(name: str, text: str, none_is_a_value: bool = False) -> Any:
    """A field whose default comes from the preset; unset: ``None``, or :data:`FROM_PRESET` if ``None`` means "off"."""
    defaults = ", ".join(f"`{PRESETS[p][name]!r}` with preset={p!r}" for p in PRESETS)
    return _field(FROM_PRESET if none_is_a_value else None, f"{text} Default: {defaults}.")


#: The tests behind the allowed values a range rule names.
_RANGES: dict[str, Callable[[float], bool]] = {
    "≥ 0": lambda v: v >= 0,
    "> 0": lambda v: v > 0,
    "≥ 1": lambda v: v >= 1,
    "in [0, 1]": lambda v: 0 <= v <= 1,
    "in (0, 1]": lambda v: 0 < v <= 1,
    "> 1": lambda v: v > 1,
}
# Numeric fields checked at construction: (field, allowed values as :data:`_RANGES` names them, what the field means or
# what to set). ", or None" after the allowed values lets None through; NaN and ±inf never pass.
_RANGE_RULES: tuple[tuple[str, str, str], ...] = (
    ("learning_rate", "≥ 0", "A negative rate is gradient ascent; typical values: 1e-7 to 1e-5."),
    ("critic_learning_rate", "≥ 0, or None", "None uses learning_rate; a negative rate trains away from the returns."),
    ("kl_coef", "≥ 0", "A negative coefficient rewards drifting from the reference policy; 0 disables the penalty."),
    ("cliprange", "≥ 0, or None", "None disables policy clipping; the usual ε is 0.2."),
    ("cliprange_value", "≥ 0, or None", "None disables value clipping; the usual ε_v is 0.2."),
    ("gamma", "in [0, 1]", "The discount factor of GAE; RLHF uses 1.0."),
    ("lam", "in [0, 1]", "The λ of GAE; the paper uses 0.9, trl 1.12 0.95."),
    ("vf_coef", "≥ 0", "A negative weight trains the critic away from the returns; the usual weight is 0.1."),
    ("total_episodes", "> 0, or None", "None: num_train_epochs × dataset size × samples per prompt."),
    ("num_train_epochs", "> 0", "Passes over the prompts when total_episodes is None."),
    ("missing_eos_penalty", "≥ 0, or None", "Subtracted from the score of a response without the stop token."),
    ("temperature", "> 0", "The sampling temperature; 1.0 samples the model as it is."),
    ("logprob_temperature", "> 0, or None", "None uses the sampling temperature; 1.0 the model's raw logits."),
    ("top_p", "in (0, 1]", "The nucleus-sampling threshold; 1.0 disables it."),
    ("repetition_penalty", "> 0", "CTRL's θ on tokens already generated (> 1 discourages repeats); 1.0 disables it."),
    ("critic_adam_epsilon", "> 0, or None", "None uses adam_epsilon; the release used 1e-8 for the critic."),
    ("max_skipped_iterations", "≥ 1", "Consecutive skipped iterations before the run stops with an error."),
    ("stop_token_id", "≥ 0, or None", "A token id of the tokenizer; None uses stop_token."),
    ("response_length", "≥ 1", "The most tokens a response may have."),
    ("per_device_train_batch_size", "≥ 1", "Rows per process in each optimizer micro-batch."),
    ("gradient_accumulation_steps", "≥ 1", "Micro-batches per optimizer step."),
    ("local_rollout_forward_batch_size", "≥ 1", "Rows per process in each no-grad forward and generation call."),
    ("num_samples_per_prompt", "≥ 1", "Responses sampled per prompt; 1 samples each prompt once."),
    ("max_tokens_per_microbatch", "≥ 1, or None", "None splits micro-batches by rows."),
    ("logprob_chunk_size", "≥ 1, or None", "None computes log-probs from the whole logits at once."),
    ("max_prompt_length", "≥ 1, or None", "None: the policy's context minus response_length."),
    ("num_ppo_epochs", "≥ 1", "Passes over each rollout batch."),
    ("num_critic_epochs", "≥ 1, or None", "None uses num_ppo_epochs."),
    ("cliprange_high", "≥ 0, or None", "None uses cliprange; DAPO's ε_high is 0.28."),
    ("dual_clip", "> 1, or None", "None disables dual clipping; verl's c is 3."),
    ("logratio_clamp", "> 0, or None", "None leaves the log-ratio unbounded; verl's bound is 20."),
    ("kl_clamp", "> 0, or None", "None leaves the KL estimate unbounded; OpenRLHF's bound is 10."),
    ("num_mini_batches", "≥ 1", "Minibatches each rollout batch is split into."),
    ("reward_clip", "> 0, or None", "δ of the score clip [−δ, δ]; None disables it."),
    ("max_grad_norm", "≥ 0", "0 disables gradient clipping."),
    ("advantage_clip", "> 0, or None", "c of the advantage clip [−c, c]; None disables it."),
    ("critic_warmup_steps", "≥ 0", "Critic-only iterations at the start; 0 disables critic pre-training."),
    ("ptx_coef", "≥ 0", "λ_ptx of the PPO-ptx loss; 0 disables it."),
    ("entropy_coef", "≥ 0", "0 disables the entropy regulariser."),
    ("vllm_importance_sampling_clip_max", "≥ 1", "A cap below 1 shrinks every token's weight."),
    ("staleness_clip_max", "≥ 1", "A cap below 1 shrinks every token's weight."),
    ("max_staleness", "≥ 0", "0 generates each batch with the policy that trains on it."),
    (
        "max_tool_turns",
        "≥ 0, or None",
        "None lets the policy call tools until it stops or a budget ends the trajectory.",
    ),
    ("max_completion_tokens", "≥ 1, or None", "None bounds a trajectory by response_length and max_tool_turns alone."),
    ("tool_timeout", "> 0, or None", "Seconds a tool call may take before it is a failure; None waits."),
    ("reward_winsorize", "> 0, or None", "k of the raw-score clip at k scales of the center; None disables it."),
    ("lam_critic", "in [0, 1], or None", "The critic's GAE λ (1: Monte-Carlo returns); None uses lam."),
    ("lam_alpha", "> 0, or None", "α of the length-adaptive policy λ = 1 − 1/(α·l); None uses lam."),
)


def _check_range(name: str, value: Any, allowed: str, hint: str) -> None:
    """A ``ValueError`` naming ``name``, ``allowed`` and ``hint`` unless ``value`` is finite and allowed (or None)."""
    if value is None and allowed.endswith("or None"):
        return
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if number and math.isfinite(value) and _RANGES[allowed.removesuffix(", or None")](value):
        return
    raise ValueError(f"{name} must be a finite number {allowed}; got {value!r}. {hint}")


def _is_int_type(hint: Any) -> bool:
    """Whether a field's type is ``int`` or ``int | None`` (not ``bool``, ``float``, ``int | float``, ``int | str``)."""
    union = get_origin(hint) in (typing.Union, types.UnionType)
    return hint is int or (union and set(get_args(hint)) == {int, type(None)})


@functools.cache
def int_fields(cls: type) -> tuple[tuple[str, bool], ...]:
    """``(name, None allowed)`` of the ``int`` and ``int | None`` fields a dataclass ``cls`` takes."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name] is not int) for f in fields(cls) if f.init and _is_int_type(hints.get(f.name)))


def _whole_number_hint(name: str, value: Any) -> str:
    """What to write instead of ``value`` for the whole-number field ``name``."""
    if isinstance(value, bool):
        return f"write {name}={int(value)} if you mean that number."
    if isinstance(value, numbers.Real) and math.isfinite(value):
        if float(value).is_integer():
            return f"write {name}={int(value)} (in a YAML config `{name}: {int(value)}`, without the '.0')."
        return f"write {name}={math.floor(value)} or {name}={math.ceil(value)}."
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return f"write {name}={int(value)}, a number, not a string."
    return f"write a whole number, e.g. {name}=1."


def check_int_fields(config: Any) -> None:
    """A ``ValueError`` for the first ``int`` field of the dataclass ``config`` holding no whole number (``2.0`` from
    YAML, a bool, a string), naming the value and what to write: a float used to fail deep in training
    (``torch.manual_seed`` "expected a long"). Call it in ``__post_init__``, before the base classes set fields."""
    for name, none_allowed in int_fields(type(config)):
        value = getattr(config, name)
        if (value is None and none_allowed) or (isinstance(value, numbers.Integral) and not isinstance(value, bool)):
            continue
        kind = "" if value is None else f" (a {type(value).__name__})"
        raise ValueError(
            f"{name} must be a whole number{' or None' if none_allowed else ''}, got {value!r}{kind}: "
            + _whole_number_hint(name, value)
        )


@dataclass
class PPOMaxConfig(GRPOArguments, TrainingArguments):
    r"""Configuration of [`PPOMaxTrainer`]: trl 1.12's ``PPOConfig`` plus PPO-max (see the field list below), and
    trl's ``GRPOConfig`` names (:mod:`~trl_ppomax.ppo.grpo_names`: each with TRL's meaning, or refused by name).

    Works with [`~transformers.HfArgumentParser`] / [`trl.TrlParser`]. Defaults that differ from
    [`~transformers.TrainingArguments`]: ``logging_steps=10``, activation (gradient) checkpointing on, ``bf16`` on
    a GPU that supports it unless ``fp16``, ``learning_rate=3e-6``, and ``max_grad_norm`` from the preset.
    """

    # ---- preset ---------------------------------------------------------------------------------------------------
    preset: Preset = _field(  # noqa: RUF009
        "ppo_max",
        "Defaults to start from: 'ppo_max' (the paper's PPO-max), 'vanilla' (trl 1.12's PPO maths, for ablations) or "
        "'ppo_max_robust' (beyond the paper: PPO-max with frozen, winsorised reward moments and decoupled, "
        "length-adaptive GAE; benchmarks/README.md). Fields set explicitly override the preset.",
    )

    # ---- TrainingArguments overrides (as in TRL) ------------------------------------------------------------------
    learning_rate: float = _field(3e-6, "Learning rate of the policy (AdamW).")
    logging_steps: float = _field(10, "Log every X PPO iterations (a float in (0, 1) is a ratio of all iterations).")
    bf16: bool | None = _field(None, "bf16 mixed precision; default: True on a GPU supporting it, unless fp16.")
    max_grad_norm: float | None = _preset_field(
        "max_grad_norm",
        "Global gradient clipping (App. C.2 of the paper), applied separately to the policy's and the critic's "
        "gradients; 0 disables it (0, not None, as in trl 1.12 and TrainingArguments, which never clipped).",
    )

    # ---- trl 1.12 PPOConfig fields --------------------------------------------------------------------------------
    dataset_num_proc: int | None = _field(None, "Processes used to prepare the dataset.")
    num_mini_batches: int = _field(1, "Minibatches each rollout batch is split into.")
    total_episodes: int | None = _field(
        None, "Episodes (responses) to train on; default num_train_epochs × dataset size × samples per prompt."
    )
    local_rollout_forward_batch_size: int = _field(64, "Per-process batch of rollout generation and no-grad forwards.")
    num_samples_per_prompt: int = _field(
        1,
        "Responses sampled per prompt (TRL GRPO's num_generations, OpenRLHF's n_samples_per_prompt): each prompt is "
        "encoded once and sampled n times. Batch sizes and total_episodes count responses, so a rollout batch holds "
        "batch_size / n prompts.",
    )
    max_tokens_per_microbatch: int | None = _field(
        None,
        "Token budget (rows × padded prompt + response width, per process) of each no-grad forward and update "
        "micro-batch: sequences are sorted by length and packed under it; a longer sequence goes alone. The update's "
        "loss and gradients are those of the row split (per-token weights). None: split by rows.",
    )
    logprob_chunk_size: int | None = _field(
        128,
        "Token positions per pass through the LM head when computing log-probs and entropy (update and scoring): the "
        "policy's and reference's (B, T, V) logits are never held whole, each chunk's are recomputed in backward; "
        "values and gradients equal the unchunked ones. Under autograd the count is at a vocabulary of 151,936 (a "
        "smaller one takes proportionally more, each chunk's logits the same size); no-grad forwards (scoring) take "
        "it at any vocabulary. None: all positions at once (the whole logits).",
    )
    num_sample_generations: int = _field(10, "Number of `generate_completions` sample tables printed during training.")
    response_length: int = _field(53, "Maximum number of generated response tokens.")
    stop_token: Literal["eos"] | None = _field(
        None, "'eos' to stop responses at the tokenizer's eos token; exclusive with `stop_token_id`."
    )
    stop_token_id: int | None = _field(None, "Token id that ends a response; exclusive with `stop_token`.")
    temperature: float | None = _preset_field(
        "temperature", "Sampling temperature (§5.4). The log-probs of KL, ratio and entropy use `logprob_temperature`."
    )
    logprob_temperature: float | None = _preset_field(
        "logprob_temperature",
        "Temperature of the log-probs behind the KL penalty, the PPO ratio and the entropy: None = the sampling "
        "temperature, logits / T (trl 1.12); 1.0 = the model's raw logits, as the MOSS-RLHF release computes them "
        "(ppo_trainer.py), so KL and ratio measure the model itself rather than its tempered sampling distribution.",
        none_is_a_value=True,
    )
    missing_eos_penalty: float | None = _field(None, "Score penalty (≥ 0) of a response without the stop token.")
    sft_model_path: str = _field("EleutherAI/pythia-160m", "Path of the SFT model.")
    reward_model_path: str = _field("EleutherAI/pythia-160m", "Path of the reward model.")
    model_adapter_name: str | None = _field(None, "PEFT adapter trained as the policy, when the model has several.")
    ref_adapter_name: str | None = _field(None, "PEFT adapter used as the reference; default: adapters disabled.")
    num_ppo_epochs: int = _field(4, "Passes over each rollout batch.")
    whiten_rewards: bool = _field(False, "Whiten token rewards per batch keeping the mean, (r − μ)/σ + μ (trl 1.12).")
    kl_coef: float = _field(0.05, "η of the token-level KL penalty r_t = −η·KL_t (§5.3.2, eq. 19).")
    kl_estimator: KLEstimator = _field(  # noqa: RUF009
        "k1",
        "KL estimator: 'k1' (log-ratio), 'k2' or 'k3' (§5.3.2); verl's 'kl', 'mse' and 'low_var_kl' are our k1, k2 "
        "and k3 (low_var_kl clamped: kl_clamp=10). As a loss (kl_placement='loss'), k1's expected gradient is zero "
        "on-policy: use k2 or k3 there.",
    )
    cliprange: float | None = _field(0.2, "ε of the clipped policy surrogate (§3.2.3); None disables policy clipping.")
    vf_coef: float = _field(0.1, "Weight of the value loss.")
    cliprange_value: float | None = _field(0.2, "ε_v of the clipped value loss (§3.2.3); None disables it.")
    advantage_estimator: str = _field(
        "gae",
        "A key of trl_ppomax.ppo.advantages.ESTIMATORS: 'gae' (§3.2.2, with a critic), or critic-free 'rloo', "
        "'reinforce_pp', 'reinforce_pp_baseline', 'grpo', 'dr_grpo' (the group ones need num_samples_per_prompt ≥ 2).",
    )
    kl_placement: KLPlacement = _field(  # noqa: RUF009
        "reward",
        "Where the KL to the reference goes: 'reward' (the paper's token penalty −η·KL_t) or 'loss' (kl_coef × the "
        "kl_estimator's mean KL added to the policy loss; verl's use_kl_loss). k2 as a loss has k1-in-reward's "
        "gradient, k3 (GRPO's) a biased one (arXiv 2510.01555).",
    )
    cliprange_high: float | None = _field(
        None, "ε_high of the ratio's upper clip, 1 + ε_high (DAPO's clip-higher: 0.28); None uses cliprange."
    )
    dual_clip: float | None = _field(
        None,
        "c > 1 of dual-clip PPO: a negative advantage's loss is at most −c·A (verl's clip_ratio_c: 3); None: off.",
    )
    loss_aggregation: LossAggregation = _field(  # noqa: RUF009
        "token_mean",
        "How token losses make a micro-batch's loss (verl's loss_agg_mode): 'token_mean' over all tokens (TRL GRPO's "
        "loss_type='bnpo'), 'minibatch_token_mean' over all tokens of the optimizer step's micro-batches (per process; "
        "TRL's 'dapo'), "
        "'seq_mean_token_sum' or 'seq_mean_token_mean' (per response, then the mean over responses), or "
        "'seq_mean_token_sum_norm': the token sum ÷ (responses × response_length), a constant normaliser (Dr. GRPO; "
        "TRL GRPO's loss_type='dr_grpo', verl's seq-mean-token-sum-norm with loss_scale_factor = micro-batch rows × "
        "response_length).",
    )
    kl_loss_importance_weighted: bool = _field(
        False,
        "With kl_placement='loss': each token's KL term times the ratio π_θ/π_old (its value 1 on-policy, its gradient "
        "not; TRL GRPO's use_bias_correction_kl, on when a GRPO script sets beta).",
    )
    group_std_eps: float = _field(
        1e-6, "ε of grpo's (s − mean)/(std + ε): verl's 1e-6; TRL's 1e-4 (set by GRPOConfig's scale_rewards)."
    )
    group_scale: GroupScale = _field(  # noqa: RUF009
        "group",
        "grpo's std: each prompt's group ('group'), or all the batch's scores over every process ('batch', TRL's "
        "scale_rewards='batch', arXiv 2508.08221).",
    )
    logratio_clamp: float | None = _field(
        None,
        "b: bound the policy's log-ratio log(π_θ/π_old) to [−b, b] before exp in the PPO surrogate (verl clamps at "
        "20), so one absurd token cannot give an astronomic ratio, and gets no gradient; a healthy run's ratios are "
        "far inside. None (the paper's and trl 1.12's exact maths): unbounded.",
    )
    kl_clamp: float | None = _field(
        None,
        "c: bound each token's KL estimate (in the reward or the loss) to [−c, c] (OpenRLHF: 10 for every estimator, "
        "verl: 10 for k3, its low_var_kl). None (exact): unbounded. Unlike logratio_clamp it can act in an ordinary "
        "run (k3 passes 10 where π_ref/π ≈ 13.5), saturating the penalty of the tokens that drifted most.",
    )
    save_value_model: bool = _field(
        True,
        "save_model also writes the trained critic, with the tokenizer, to <dir>/value_model (pushed with the "
        "policy as that subfolder); value_model=<dir>/value_model warm-starts a run from it.",
    )
    num_critic_epochs: int | None = _field(
        None,
        "Passes of the critic over each rollout batch (≥ num_ppo_epochs; the extra ones train it alone); None: "
        "num_ppo_epochs.",
    )
    gamma: float = _field(
        1.0,
        "Discount factor γ of GAE (§3.2.2) and of reinforce_pp's return. A group estimator (grpo, rloo, dr_grpo, "
        "reinforce_pp_baseline) refuses γ < 1: it compares whole responses, and discounting would only scale each "
        "token's advantage by γ^(tokens after it) (OpenRLHF forces γ = 1 there, verl ignores γ).",
    )
    lam: float | None = _preset_field(
        "lam",
        "λ of GAE (§3.2.2); the paper uses 0.9 in all its experiments (App. C.3), trl 1.12 and the release 0.95.",
    )
    ds3_gather_for_generation: bool = _field(True, "ZeRO-3: gather the policy for generation (faster, more memory).")

    # ---- prompts and evaluation ----------------------------------------------------------------------------------
    max_prompt_length: int | None = _field(None, "Prompt token limit; None: the policy's context − response_length.")
    truncate_long_prompts: bool = _field(
        True,
        "A prompt over max_prompt_length after dropping oldest turns is never cut: True keeps it if it fits the "
        "context with response_length, else skips it (counted in a warning), as MOSS-RLHF; False raises.",
    )
    eval_do_sample: bool = _field(False, "Evaluation responses: sampled like rollouts (True) or greedy (False).")

    # ---- safety: reusing folders, resuming, bad numbers ------------------------------------------------------------
    overwrite_output_dir: bool = _field(
        False, "Start afresh in an output_dir holding checkpoints (deleted first); else it is refused."
    )
    resume_weights_only: bool = _field(
        False, "Resume without optimizer, scheduler or RNG states (fresh Adam and schedule); else refused."
    )
    resume_allow_changes: bool = _field(
        False,
        "Resume even if settings that define the run (batch sizes, episodes, seed, dataset size, preset, models) "
        "differ from the checkpoint's; otherwise the differences are listed and the resume refused.",
    )
    max_skipped_iterations: int = _field(3, "Fail after this many iterations in a row skipped for non-finite numbers.")
    reward_weights: list[float] | None = _field(  # noqa: RUF009
        None,
        "Weights of the reward sources (reward_model / reward_funcs as a list), one per source, as in TRL's "
        "GRPOConfig; the weighted sum is the score PPO-max normalises. Default: all 1.",
    )

    # ---- derived sizes (trl 1.12 names), filled in __post_init__ --------------------------------------------------
    num_total_batches: int | None = _field(None, "Derived: PPO iterations, from total_episodes (as in trl 1.12).")
    micro_batch_size: int | None = _field(None, "Derived: per_device_train_batch_size × world_size.")
    local_batch_size: int | None = _field(
        None, "Derived: per-process rollout batch = per_device × grad_accumulation × num_mini_batches."
    )
    batch_size: int | None = _field(None, "Derived: rollout batch over all processes.")
    local_mini_batch_size: int | None = _field(None, "Derived: minibatch per process.")
    mini_batch_size: int | None = _field(None, "Derived: minibatch over all processes.")
    local_prompt_batch_size: int | None = _field(None, "Derived: prompts per process per rollout batch.")

    # ---- PPO-max: sampling (§5.4) ---------------------------------------------------------------------------------
    top_p: float | None = _preset_field("top_p", "Nucleus sampling threshold for rollouts (§5.4).")
    repetition_penalty: float | None = _preset_field(
        "repetition_penalty", "Repetition penalty for rollouts (§5.4 of the paper's release)."
    )

    # ---- PPO-max: score reparameterisation (§5.3.1) ---------------------------------------------------------------
    reward_norm: RewardNorm | None = _preset_field(  # noqa: RUF009
        "reward_norm",
        "Reward normalisation with historical moments over all processes (§5.3.1, eq. 18): 'running' = (r − μ)/σ, "
        "'scale' = r/σ, 'none'.",
    )
    reward_clip: float | None = _preset_field(
        "reward_clip", "δ: clip the (normalised) score to [−δ, δ] (§5.3.1); None disables it.", none_is_a_value=True
    )
    whiten_advantages: bool | None = _preset_field(
        "whiten_advantages",
        "Advantage normalisation over the real tokens of the global batch (§5.3.1). Not part of PPO-max (Fig. 5 gives it "
        "no star; App. B.1, Fig. 14: with reward normalisation and value clipping it is the first run to collapse); "
        "trl 1.12 always whitened. Never applied to a group estimator's advantages (grpo, rloo, dr_grpo, "
        "reinforce_pp_baseline: verl and OpenRLHF use them as they are) nor to reinforce_pp's (already whitened); "
        "True set with one is said and ignored.",
    )
    advantage_clip: float | None = _field(
        None,
        "Clip whitened advantages to [−c, c] (§5.3.1; the release's option, off in its scripts, is 0.5); None "
        "disables it. App. B.1: advantage clipping together with value clipping did not converge.",
    )
    advantage_whitening_scope: AdvantageScope = _field(  # noqa: RUF009
        "batch",
        "Whiten (and clip) advantages over the whole rollout batch ('batch', trl 1.12) or over each minibatch before "
        "its optimizer step ('minibatch', §5.3.1 and the release's option); global over processes.",
    )

    # ---- PPO-max: policy constraints and critic (§5.3.2, §5.3.3) --------------------------------------------------
    importance_sampling: ImportanceSampling = _field(  # noqa: RUF009
        "old_policy", "PPO ratio's denominator: the rollout ('old') policy or the reference model (§5.3.2)."
    )
    critic_learning_rate: float | None = _field(None, "Critic LR (§5.4: ~3× the policy's); None = learning_rate.")
    critic_warmup_steps: int | None = _preset_field(
        "critic_warmup_steps", "PPO iterations at the start that train only the critic (critic pre-training, §5.3.3)."
    )
    critic_warmup_replaces_lr_warmup: bool = _field(
        True,
        "With critic_warmup_steps > 0: the critic's learning rate skips the LR warm-up (the critic pre-training "
        "replaces it, §5.3.3) and the policy's schedule starts when the policy starts training.",
    )
    critic_adam_epsilon: float | None = _field(None, "Critic's Adam ε; None = adam_epsilon (the release's: 1e-8).")
    grad_clip_scope: GradClipScope = _field(  # noqa: RUF009
        "per_model",
        "max_grad_norm clips the policy's and the critic's gradients separately ('per_model') or as one vector "
        "('joint', the release's single DeepSpeed engine). Under DeepSpeed the engine always clips jointly.",
    )

    # ---- beyond the paper: robust reward normalisation and a better critic (preset "ppo_max_robust") -----------------
    reward_norm_freeze: bool | None = _preset_field(
        "reward_norm_freeze",
        "Seed the reward moments with the starting policy's scores, then freeze them: they are updated only during the "
        "first max(critic_warmup_steps, 1) iterations (sampled before the policy moves), so that later improvement is "
        "not normalised away as the moments follow the policy (the paper keeps updating them).",
    )
    reward_winsorize: float | None = _preset_field(
        "reward_winsorize",
        "k: clip each raw score to μ ± k·σ of the reward moments (the batch's median ± k·1.4826·MAD while they are "
        "empty) before it updates the moments and is normalised, so that a few heavy-tailed scores cannot inflate σ; "
        "None disables it.",
        none_is_a_value=True,
    )
    lam_critic: float | None = _preset_field(
        "lam_critic",
        "Decoupled GAE (VC-PPO, VAPO): the λ of the critic's targets, separate from the policy's; 1.0 regresses the "
        "critic on Monte-Carlo returns. None uses the policy's λ.",
        none_is_a_value=True,
    )
    lam_alpha: float | None = _preset_field(
        "lam_alpha",
        "Length-adaptive GAE (VAPO): the policy's λ per response is clip(1 − 1/(α·l), 0, 1) for a response of l "
        "tokens (VAPO's α: 0.05) instead of `lam`; None uses `lam`.",
        none_is_a_value=True,
    )

    # ---- PPO-max: auxiliary losses (§3.2.3, §5.4, App. B.3) -------------------------------------------------------
    ptx_coef: float = _field(0.0, "λ_ptx: weight of the PPO-ptx LM loss on ptx_dataset (needed; §3.2.3 eq. 17, §5.4).")
    ptx_assistant_only: bool = _field(
        True,
        "For a conversational ptx_dataset ('messages'), the LM loss counts only assistant turns, as the release masks "
        "it (ppo_datahelper.py); needs a chat template that marks the assistant turns as generation blocks (see "
        "transformers' return_assistant_tokens_mask).",
    )
    entropy_coef: float = _field(0.0, "Weight of the entropy regulariser (App. B.3); 0 disables it (paper default).")
    entropy_target: float | None = _field(None, "None: bonus −H; H*: the release's clipped |H − H*| (App. B.3).")

    # ---- Agent rollouts: tools and environments (TRL GRPO's tools= / environment_factory=) -------------------------
    max_tool_turns: int | None = _field(
        None,
        "The most tool-result turns in a trajectory (TRL GRPO's max_tool_calling_iterations); None: the policy calls "
        "tools until it answers without one or a token budget ends the trajectory.",
    )
    max_completion_tokens: int | None = _field(
        None,
        "A trajectory's budget of tokens, the policy's and the tools' together (response_length bounds the policy's "
        "alone; a tool result that does not fit is cut and ends the trajectory); None: no bound beyond those.",
    )
    tool_timeout: float | None = _field(
        None,
        "Seconds a tool call may take (sync tools in a worker thread, async ones with asyncio.wait_for); a call past it "
        "is a failure the policy reads ('TimeoutError: …') and counts in tools/failure_rate. None: wait for every call.",
    )
    malformed_tool_calls: MalformedToolCalls | None = _field(  # noqa: RUF009
        None,
        "A tool call that cannot be parsed (bad JSON, no name): 'feedback' runs a turn whose result says what is wrong "
        "(a failure in tools/failure_rate); 'ignore' leaves it text, as TRL GRPO does (the turn ends the trajectory). "
        "None: 'feedback', or 'ignore' in a TRL GRPO script.",
    )
    rollout_func_importance_sampling: bool = _field(
        False,
        "With a rollout_func whose logprobs μ come from another sampler (e.g. a vLLM server of its own): weight each "
        "policy token's loss by min(π/μ, `vllm_importance_sampling_clip_max`), π the scoring policy's sampling "
        "distribution (temperature, top-p), and log the gap (sampling/…). False: its logprobs are checked only.",
    )
    train_on_env_tokens: bool = _field(
        False,
        "An ablation: train on the tokens a tool or environment inserted (env_mask ignored), as if the policy wrote "
        "them. False masks them out of the losses, the KL, GAE, whitening and the metrics (verl's multi-turn rule).",
    )

    # ---- vLLM rollouts (TRL GRPO's field names) ----------------------------------------------------------------------
    max_staleness: int = _field(
        0,
        "k ≥ 1: a producer thread generates the next rollout batches while the trainer updates; batch i is sampled by "
        "the policy after max(0, i − 1 − k) iterations, exactly (a fixed lag: reproducible and resumable), and the "
        "update corrects the gap with the decoupled objective (`staleness_correction`). 0: generate, then update.",
    )
    staleness_correction: StalenessCorrection = _field(  # noqa: RUF009
        "tis",
        "With max_staleness ≥ 1, each token's policy loss is weighted by w = π_prox/μ (the scoring policy over the "
        "one that sampled; AReaL's decoupled PPO): 'tis' truncates it at `staleness_clip_max`, 'icepop' drops the "
        "tokens whose w is outside [1/C, C].",
    )
    staleness_clip_max: float = _field(3.0, "C of the staleness correction (max_staleness ≥ 1).")
    use_vllm: bool = _field(False, "Generate rollouts with vLLM (other forwards stay in the trainer); needs `vllm`.")
    vllm_mode: VLLMMode = _field(  # noqa: RUF009
        "colocate",
        "'colocate': a vLLM engine in every training process, sharing its GPU; 'server': a separate `trl vllm-serve` "
        "server (weights are pushed over NCCL: needs CUDA).",
    )
    vllm_gpu_memory_utilization: float = _field(0.3, "colocate: share of GPU memory vLLM may use (weights, KV cache).")
    vllm_tensor_parallel_size: int = _field(1, "colocate: GPUs per vLLM engine (must divide the number of processes).")
    vllm_enable_sleep_mode: bool = _field(False, "colocate: free vLLM's memory between rollouts (slower wake-up).")
    vllm_max_model_length: int | None = _field(None, "colocate: vLLM's context, prompt + response; None: the model's.")
    vllm_model_impl: str = _field("vllm", "vLLM's model implementation: 'vllm' or 'transformers'.")
    vllm_server_base_url: str | None = _field(None, "server: URL, e.g. http://localhost:8000 (overrides host, port).")
    vllm_server_host: str = _field("0.0.0.0", "server: host.")
    vllm_server_port: int = _field(8000, "server: port.")
    vllm_server_timeout: float = _field(240.0, "server: seconds to wait for it to be up.")
    vllm_group_port: int = _field(51216, "server: port of the weight-update group.")
    use_transformers_continuous_batching: bool = _field(
        False,
        "Generate rollouts with transformers' continuous batching (`generate_batch`: a paged KV cache, each response "
        "leaving the batch at its stop token), as TRL GRPO's; the repetition penalty is then transformers' processor, "
        "not §6.1's generated-tokens-only one. Not with use_vllm.",
    )
    transformers_continuous_batching_config: dict | None = _field(  # noqa: RUF009
        None,
        'transformers\' `ContinuousBatchingConfig` arguments, a dict or JSON text (e.g. {"num_blocks": 256}); '
        "max_memory_percent is 0.5 unless set, as TRL leaves memory for the update.",
    )
    vllm_importance_sampling_correction: bool | None = _preset_field(
        "vllm_importance_sampling_correction",
        "With use_vllm: multiply each token's policy loss by the truncated importance weight min(π_HF / π_vLLM, "
        "`vllm_importance_sampling_clip_max`), correcting for vLLM sampling from a slightly different distribution "
        "than the HF forward (TRL GRPO's token_truncate).",
    )
    vllm_importance_sampling_clip_max: float = _field(3.0, "Cap C of truncated importance weights, as in TRL GRPO.")

    def __post_init__(self) -> None:
        check_int_fields(
            self
        )  # what the user passed, before TRL's names are mapped and TrainingArguments sets its own
        given = {name for name in grpo_names.DIFFERING_DEFAULTS if not grpo_names.is_default(self, name)}
        grpo_set = grpo_names.grpo_names_set(self)
        grpo_names.apply_grpo_names(self)  # TRL GRPO's names onto ours, before the preset fills the rest
        if self.malformed_tool_calls is None:
            self.malformed_tool_calls = "feedback"
        self._skip_critic_warmup_without_critic()
        self._skip_whitening_of_final_advantages()
        self._resolve_preset()
        self._validate()
        if self.advantage_clip is not None and self.cliprange_value is not None:
            logger.warning(
                "advantage_clip=%s together with cliprange_value=%s: the paper (App. B.1) found that constraining both "
                "the advantages and the value function did not converge; it recommends reward scaling + value "
                "clipping, or reward + advantage normalisation and clipping, not both.",
                self.advantage_clip,
                self.cliprange_value,
            )
        if self.bf16 is None:
            self.bf16 = default_bf16(self.fp16)
        if self.load_best_model_at_end and self.metric_for_best_model is None:
            self.metric_for_best_model = "objective/scores"  # the release kept the best policy by validation reward
        if getattr(self, "activation_checkpointing", False) is None and self.gradient_checkpointing is None:
            self.activation_checkpointing = True  # trl's default; `--gradient_checkpointing False` still turns it off
        super().__post_init__()
        self._check_deepspeed_batch()
        self._derive_sizes()
        #: What a swapped TRL GRPO script runs (the algorithm, the defaults that differ), said when training starts.
        self.grpo_swap_notice = grpo_names.swap_notice(self, given) if grpo_set else None
        self.grpo_names_given = tuple(grpo_set)  #: the TRL GRPO names the script set (before the aliases are written)
        grpo_names.write_back_aliases(self)

    # -- helpers ----------------------------------------------------------------------------------------------------
    def _skip_critic_warmup_without_critic(self) -> None:
        """An estimator that needs no critic has no critic to pre-train or fit: the preset's ``critic_warmup_steps``
        does not apply (0), and the critic's settings a user set away from their defaults are named in a warning
        (they would change nothing)."""
        estimator = advantages.ESTIMATORS.get(self.advantage_estimator)
        if estimator is None or estimator.needs_critic:
            return
        defaults = {f.name: f.default for f in fields(self) if f.name in CRITIC_SETTINGS}
        unused = [
            f"{name}={getattr(self, name)!r}" for name in CRITIC_SETTINGS if getattr(self, name) != defaults[name]
        ]
        if self.critic_warmup_steps:
            unused.insert(0, f"critic_warmup_steps={self.critic_warmup_steps}")
        if unused:
            logger.warning(
                "%s: not applied, advantage_estimator=%r needs no critic and builds none; the policy trains from the "
                "first iteration.",
                ", ".join(unused),
                self.advantage_estimator,
            )
        self.critic_warmup_steps = 0

    def _skip_whitening_of_final_advantages(self) -> None:
        """An estimator whose advantages are final as defined (:attr:`~trl_ppomax.ppo.advantages.AdvantageEstimator.
        whitening_applies` False: a group baseline, or REINFORCE++'s own whitening) is not whitened a second time:
        the preset's ``whiten_advantages`` (``vanilla``'s True) does not apply (False), and a True set explicitly is
        named in a warning (verl and OpenRLHF whiten none of them again; under ``vanilla`` GRPO's moved 0.61)."""
        estimator = advantages.ESTIMATORS.get(self.advantage_estimator)
        if estimator is None or estimator.whitening_applies:
            return
        if self.whiten_advantages:
            why = (
                "already whitens its advantages over the batch"
                if estimator.baseline is None
                else "takes its advantages from a group baseline over each prompt's samples, as verl and OpenRLHF use "
                "them; whitening them again over the batch would change them"
            )
            logger.warning(
                "whiten_advantages=True: not applied, advantage_estimator=%r %s. Leave whiten_advantages unset (or "
                "False) to silence this; advantage_clip still applies.",
                self.advantage_estimator,
                why,
            )
        self.whiten_advantages = False

    def _resolve_preset(self) -> None:
        if self.preset not in get_args(Preset):
            raise ValueError(f"Unknown preset {self.preset!r}; choose one of {sorted(PRESETS)}.")
        for name, value in PRESETS[self.preset].items():
            current = getattr(self, name)
            if current is self.__dataclass_fields__[name].default or current is FROM_PRESET:
                setattr(self, name, value)

    def _validate(self) -> None:
        """Reject settings that would crash late or train silently wrong, naming the field, allowed values and fix."""
        for name, allowed, hint in _RANGE_RULES:
            _check_range(name, getattr(self, name), allowed, hint)
        if self.stop_token is not None and self.stop_token_id is not None:
            raise ValueError("Set either stop_token='eos' or stop_token_id, not both.")
        self._validate_sampling_and_packing()
        self._validate_estimator()
        self._validate_policy_loss_and_kl()
        self._validate_producer_vllm()
        if self.use_vllm and self.use_transformers_continuous_batching:
            raise ValueError(
                "use_vllm=True and use_transformers_continuous_batching=True name two generation engines: keep one."
            )
        for name, allowed in (
            ("stop_token", Literal["eos", None]),
            ("reward_norm", RewardNorm),
            ("kl_estimator", KLEstimator),
            ("importance_sampling", ImportanceSampling),
            ("advantage_whitening_scope", AdvantageScope),
            ("grad_clip_scope", GradClipScope),
            ("vllm_mode", VLLMMode),
            ("kl_placement", KLPlacement),
            ("loss_aggregation", LossAggregation),
            ("staleness_correction", StalenessCorrection),
            ("group_scale", GroupScale),
            ("malformed_tool_calls", MalformedToolCalls),
        ):
            choices = get_args(allowed)
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}.")

    def _validate_producer_vllm(self) -> None:
        """max_staleness ≥ 1 with vLLM: a colocated engine of one GPU, awake, owned by the producer thread."""
        if not (self.max_staleness and self.use_vllm):
            return
        refused = {
            "vllm_mode='server'": self.vllm_mode == "server",
            "vllm_enable_sleep_mode=True": self.vllm_enable_sleep_mode,
            f"vllm_tensor_parallel_size={self.vllm_tensor_parallel_size}": self.vllm_tensor_parallel_size > 1,
        }
        for setting, on in refused.items():
            if on:
                raise ValueError(
                    f"max_staleness={self.max_staleness} with use_vllm generates on a colocated engine of one device, "
                    f"awake while the trainer updates; {setting} is not supported with it yet: use vllm_mode="
                    "'colocate' without sleep mode and tensor_parallel_size=1, or set max_staleness=0."
                )

    def _validate_estimator(self) -> None:
        estimator = advantages.ESTIMATORS.get(self.advantage_estimator)
        if estimator is None:
            raise ValueError(
                f"advantage_estimator must be one of {tuple(advantages.ESTIMATORS)}, got {self.advantage_estimator!r}; "
                "register another in trl_ppomax.ppo.advantages.ESTIMATORS."
            )
        if estimator.baseline is not None and self.num_samples_per_prompt < 2:
            raise ValueError(
                f"advantage_estimator={self.advantage_estimator!r} compares the responses to one prompt with each "
                f"other, but num_samples_per_prompt={self.num_samples_per_prompt}: set num_samples_per_prompt ≥ 2 "
                "(e.g. 4, as TRL GRPO's num_generations), or use 'reinforce_pp' or 'gae'."
            )
        if estimator.baseline is not None and self.gamma != 1.0:
            raise ValueError(
                f"gamma={self.gamma} with advantage_estimator={self.advantage_estimator!r}: a group baseline compares "
                "whole responses, so discounting would only scale each token's advantage by γ^(tokens after it) "
                "(OpenRLHF sets γ = 1 for its group estimators, verl ignores γ). Set gamma=1.0, or use 'reinforce_pp' "
                "or 'gae' for a discounted return."
            )
        if self.num_critic_epochs is not None and self.num_critic_epochs < self.num_ppo_epochs:
            raise ValueError(
                f"num_critic_epochs={self.num_critic_epochs} is below num_ppo_epochs={self.num_ppo_epochs}: the critic "
                "trains in every policy epoch; set num_critic_epochs ≥ num_ppo_epochs (or None)."
            )

    def _validate_policy_loss_and_kl(self) -> None:
        """The peers' KL names, the k1 KL as a loss, and a clip-higher that cannot act as one."""
        if self.kl_estimator in KL_ESTIMATOR_ALIASES:
            raise ValueError(f"kl_estimator={self.kl_estimator!r}: {KL_ESTIMATOR_ALIASES[self.kl_estimator]}")
        if self.kl_placement == "loss" and self.kl_estimator == "k1":
            logger.warning(
                "kl_placement='loss' with kl_estimator='k1': the k1 loss mean(log π − log π_ref) has zero expected "
                "gradient on the policy's own samples (E[∇ log π] = 0), so it barely holds the policy near the "
                "reference. Set kl_estimator='k2' (its gradient is the KL's) or 'k3' (GRPO's, lower variance, "
                "biased gradient), or kl_placement='reward' for k1."
            )
        if self.cliprange_high is not None and self.cliprange is None:
            raise ValueError(
                f"cliprange_high={self.cliprange_high} with cliprange=None: without clipping there is no upper clip "
                "to raise, so it would be ignored. Set cliprange (e.g. 0.2) to clip, or cliprange_high=None."
            )
        if self.cliprange_high is not None and self.cliprange_high < self.cliprange:
            raise ValueError(
                f"cliprange_high={self.cliprange_high} is below cliprange={self.cliprange}: clip-higher raises the "
                "ratio's upper clip 1 + ε_high above 1 + ε (DAPO: 0.28 with 0.2). Set cliprange_high ≥ cliprange, or "
                "None for the symmetric clip."
            )

    def _validate_sampling_and_packing(self) -> None:
        local = self.per_device_train_batch_size * self.gradient_accumulation_steps * self.num_mini_batches
        if local % self.num_samples_per_prompt:
            raise ValueError(
                f"num_samples_per_prompt={self.num_samples_per_prompt} must divide the per-process rollout batch "
                f"(per_device_train_batch_size × gradient_accumulation_steps × num_mini_batches = {local}), which "
                "counts responses; change one of them."
            )
        if self.max_tokens_per_microbatch is None:
            return
        if self.ptx_coef > 0:
            raise ValueError("max_tokens_per_microbatch does not support ptx_coef > 0 yet; set one of them off.")
        if self.entropy_coef > 0 and self.entropy_target is not None:
            raise ValueError(
                "max_tokens_per_microbatch with entropy_target: |mean(H) − H*| is not a per-token sum, so packing "
                "would change the loss; set entropy_target=None (the plain bonus) or max_tokens_per_microbatch=None."
            )

    def _check_deepspeed_batch(self) -> None:
        """A DeepSpeed JSON of the user's own that writes its batch sizes out must say what this run does: DeepSpeed
        steps the optimizer after its own ``gradient_accumulation_steps`` micro-batches, so another number would
        silently change every update (accelerate only warns, and uses DeepSpeed's)."""
        plugin = getattr(self, "deepspeed_plugin", None)
        config = plugin.deepspeed_config if plugin is not None else {}
        for key, name in [
            ("train_micro_batch_size_per_gpu", "per_device_train_batch_size"),
            ("gradient_accumulation_steps", "gradient_accumulation_steps"),
        ]:
            given = config.get(key, "auto")
            if given != "auto" and int(given) != getattr(self, name):
                missing = (
                    " (accelerate's value when the file has none)" if key == "gradient_accumulation_steps" else ""
                )
                raise ValueError(
                    f"The DeepSpeed config says {key}={given}{missing}, but {name}={getattr(self, name)}: set them "
                    f'equal, or {key} to "auto" in the DeepSpeed config (and train_batch_size to their product × the '
                    'number of processes, or "auto").'
                )

    def _derive_sizes(self) -> None:
        self.local_batch_size = (
            self.per_device_train_batch_size * self.gradient_accumulation_steps * self.num_mini_batches
        )
        self.micro_batch_size = self.per_device_train_batch_size * self.world_size
        self.batch_size = self.local_batch_size * self.world_size
        self.mini_batch_size = self.batch_size // self.num_mini_batches
        self.local_mini_batch_size = self.local_batch_size // self.num_mini_batches
        self.local_prompt_batch_size = self.local_batch_size // self.num_samples_per_prompt

    @property
    def checkpointing(self) -> tuple[bool, dict | None]:
        """Whether activation checkpointing is on, and its kwargs (transformers < 5.20 names it gradient_…)."""
        if hasattr(self, "activation_checkpointing"):
            return bool(self.activation_checkpointing), self.activation_checkpointing_kwargs
        return bool(self.gradient_checkpointing), self.gradient_checkpointing_kwargs

    @property
    def effective_critic_learning_rate(self) -> float:
        return self.learning_rate if self.critic_learning_rate is None else self.critic_learning_rate

    @property
    def update_epochs(self) -> int:
        """Passes over each rollout batch: ``num_ppo_epochs``, or more with ``num_critic_epochs`` (the critic alone)."""
        return max(self.num_ppo_epochs, (self.num_critic_epochs or 0) if self.uses_critic else 0)

    @property
    def uses_critic(self) -> bool:
        """Whether the ``advantage_estimator`` needs a critic (else none is built, trained or saved)."""
        return advantages.ESTIMATORS[self.advantage_estimator].needs_critic

    @property
    def old_logprobs_from_update(self) -> bool:
        """Whether log π_old is the update's own forward, detached (TRL GRPO's shortcut), so that scoring runs no
        policy forward: the update is one optimizer step (one epoch, one minibatch) on the policy that just generated,
        and nothing before it reads the policy's log-probs (no KL in the reward, the ratio over the old policy, the
        policy's own sampler, log-probs at temperature 1 as the logged perplexity has them). A batch whose sampler
        wrote its own log-probs (a ``rollout_func``) is scored as always."""
        return (
            self.update_epochs == 1
            and self.num_mini_batches == 1
            and (self.kl_placement == "loss" or self.kl_coef == 0)
            and self.importance_sampling == "old_policy"
            and self.effective_logprob_temperature == 1.0
            and not self.use_vllm
            and self.max_staleness == 0
        )

    @property
    def effective_logprob_temperature(self) -> float:
        """The temperature of the log-probs of KL, ratio and entropy (``logprob_temperature`` or the sampling one)."""
        return self.temperature if self.logprob_temperature is None else self.logprob_temperature

    def set_run_length(self, dataset_size: int) -> None:
        """Write back ``total_episodes`` (if unset: ``max_steps`` × ``batch_size`` when ``max_steps`` > 0, as
        TrainingArguments' ``max_steps`` overrides the epochs; else ``num_train_epochs`` × ``dataset_size`` ×
        ``num_samples_per_prompt``) and ``num_total_batches`` (PPO iterations), as trl 1.12's trainer did, for scripts
        reading them."""
        if self.max_steps > 0:
            if self.total_episodes is not None and self.total_episodes != self.max_steps * self.batch_size:
                raise ValueError(
                    f"max_steps={self.max_steps} (PPO iterations of batch_size={self.batch_size}) and total_episodes="
                    f"{self.total_episodes} disagree: set one of them."
                )
            self.total_episodes, self.num_total_batches = self.max_steps * self.batch_size, self.max_steps
            self._warn_if_only_the_critic_trains()
            return
        prompts = self.batch_size // self.num_samples_per_prompt
        if dataset_size < prompts:
            raise ValueError(
                f"The training dataset has {dataset_size} prompts, fewer than one rollout batch "
                f"(per_device_train_batch_size × gradient_accumulation_steps × num_mini_batches × processes "
                f"÷ num_samples_per_prompt = {prompts}); add prompts or lower those sizes."
            )
        episodes_per_epoch = dataset_size * self.num_samples_per_prompt
        given = self.total_episodes
        self.total_episodes = self.total_episodes or int(self.num_train_epochs * episodes_per_epoch)
        self.num_total_batches = math.ceil(self.total_episodes / self.batch_size)
        trained = self.num_total_batches * self.batch_size
        if trained != self.total_episodes:  # PPO trains whole rollout batches
            (logger.warning if given else logger.info)(
                "total_episodes=%d%s is not a multiple of the rollout batch, batch_size=%d (per_device_train_batch_size "
                "× gradient_accumulation_steps × num_mini_batches × processes): the run trains %d iterations = %d "
                "episodes, %d more than asked. Set total_episodes to a multiple of %d (e.g. %s) to train exactly that.",
                self.total_episodes,
                "" if given else " (num_train_epochs × prompts × num_samples_per_prompt)",
                self.batch_size,
                self.num_total_batches,
                trained,
                trained - self.total_episodes,
                self.batch_size,
                " or ".join(str(n) for n in (trained - self.batch_size, trained) if n > 0),
            )
        self._warn_if_only_the_critic_trains()

    def _warn_if_only_the_critic_trains(self) -> None:
        if self.critic_warmup_steps >= self.num_total_batches:
            logger.warning(
                "critic_warmup_steps=%d is not below the run's %d iterations (total_episodes=%d ÷ batch_size=%d, "
                "rounded up): only the critic trains, the policy will not change. Lower critic_warmup_steps or raise "
                "total_episodes to train the policy.",
                self.critic_warmup_steps,
                self.num_total_batches,
                self.total_episodes,
                self.batch_size,
            )


def render_field_docs(cls: type, base: type, always: tuple[str, ...] = ()) -> str:
    """The "Fields" section of a config's docstring, from each field's help text: the fields ``cls`` adds to
    ``base``, plus the ``always`` fields it re-defaults. Keeps the docstring and ``--help`` from drifting apart."""
    inherited = {f.name for f in fields(base)} - set(always)
    lines = [f"        {f.name}: {f.metadata.get('help', '')}" for f in fields(cls) if f.name not in inherited]
    return "\n".join(["", f"    Fields (beyond ``{base.__name__}``):", *lines])


PPOMaxConfig.__doc__ = (PPOMaxConfig.__doc__ or "") + render_field_docs(
    PPOMaxConfig, TrainingArguments, always=tuple(PRESETS["ppo_max"])
)
