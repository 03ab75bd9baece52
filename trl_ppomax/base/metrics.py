"""Every metric name trl-ppomax logs, in one place: the trainer logs them and every reader (the monitor, plotting, the
toy world, the benchmarks) uses these constants, so a rename cannot leave a reader behind (a test checks it).
Evaluation adds the ``eval_`` prefix (:func:`eval_name`). Glossary: the "Metrics" section of docs/reference.md."""

from __future__ import annotations

import time

import torch

from trl_ppomax.base.core import Reduce, ends_with_stop, masked_mean

# ---- per response, averaged over the rollout batch (and logged by evaluate() as eval_<name>) -----------------------
KL = "objective/kl"  # Σ_t KL_t of the response (the configured estimator)
NON_SCORE_REWARD = "objective/non_score_reward"  # −kl_coef · KL
RLHF_REWARD = "objective/rlhf_reward"  # normalised score + non-score reward
SCORES = "objective/scores"  # raw reward (after the missing-stop-token penalty)
SCORES_NORMALIZED = "objective/scores_normalized"  # after reward normalisation and clipping
POLICY_PERPLEXITY = "policy/perplexity"  # of the policy on its own response, temperature 1
REF_PERPLEXITY = "policy/ref_perplexity"  # of the reference on the same response
RESPONSE_LENGTH = "response/length"  # tokens, stop token included
STOP_TOKEN_MISSING = "response/stop_token_missing"  # share of responses without the stop token

# ---- rollout batch statistics ----------------------------------------------------------------------------------------
SCORES_STD = "objective/scores_std"
SCORES_P05 = "objective/scores_p05"
SCORES_P95 = "objective/scores_p95"
REWARD_RUNNING_MEAN = "objective/reward_running_mean"
REWARD_RUNNING_STD = "objective/reward_running_std"
VALUES = "critic/values"
RETURNS = "critic/returns"
ADVANTAGES_RAW = "critic/advantages_raw"
EXPLAINED_VARIANCE = "critic/explained_variance"  # 1 − Var(R − V) / Var(R) over the batch's tokens (with a critic)
SCORES_WINSORIZED = "objective/scores_winsorized"  # share of raw scores clipped by reward_winsorize
LAM_POLICY = "critic/lam_policy"  # mean GAE λ of the policy's advantages (with lam_alpha: per response)
SCORES_STD_WITHIN_PROMPT = "objective/scores_std_within_prompt"  # n > 1: mean std of a prompt's sampled scores
SCORES_ZERO_STD_FRAC = "objective/scores_zero_std_frac"  # n > 1: share of prompts whose sampled scores are all equal

# ---- update (means over the PPO epochs' micro-batches) ----------------------------------------------------------------
POLICY_LOSS = "loss/policy"
VALUE_LOSS = "loss/value"
PTX_LOSS = "loss/ptx"
KL_LOSS = "loss/kl"  # with kl_placement="loss": the kl_estimator's mean KL to the reference, before kl_coef
ENTROPY = "policy/entropy"
CLIPFRAC = "policy/clipfrac"
CLIPFRAC_LOWER = "policy/clipfrac_lower"  # with dual_clip: share of tokens whose loss −c·A bounds
APPROXKL = "policy/approxkl"
RATIO = "policy/ratio"
RATIO_VAR = "policy/ratio_var"
PTX_PERPLEXITY = "policy/ptx_perplexity"
VF_CLIPFRAC = "critic/vf_clipfrac"
VALUE_ERROR = "critic/error"
POLICY_GRAD_NORM = "policy/grad_norm"
CRITIC_GRAD_NORM = "critic/grad_norm"
GRAD_NORM = "grad_norm"  # with grad_clip_scope="joint": one norm over policy and critic

# ---- run state ------------------------------------------------------------------------------------------------------
SKIPPED_ITERATIONS = "skipped/iterations"  # batches not trained on: no finite reward, or a non-finite value/log-prob
SKIPPED_IN_A_ROW = "skipped/iterations_in_a_row"  # reset by a trained batch; max_skipped_iterations stops the run
SKIPPED_SAMPLES = "skipped/samples"  # samples masked out of their batch for a non-finite reward
SKIPPED_UPDATES = "skipped/updates"  # optimizer steps skipped for a non-finite gradient
EPISODE = "episode"
EPISODES_PER_SECOND = "eps"
LEARNING_RATE = "lr"
CRITIC_LEARNING_RATE = "critic/lr"
PEAK_GPU_MEMORY = "memory/peak_gpu_gb"

#: The run-state counters (``PPOState.counters``): saved in ``ppo_state.json`` and logged as they stand.
COUNTERS = (SKIPPED_ITERATIONS, SKIPPED_IN_A_ROW, SKIPPED_SAMPLES, SKIPPED_UPDATES)

# ---- with use_vllm (TRL GRPO's names): vLLM-vs-HF log-prob gap, truncated importance weights, engine seconds
SAMPLING_LOGP_DIFF_MEAN = "sampling/sampling_logp_difference/mean"
SAMPLING_LOGP_DIFF_MAX = "sampling/sampling_logp_difference/max"
IS_RATIO_MIN = "sampling/importance_sampling_ratio/min"
IS_RATIO_MEAN = "sampling/importance_sampling_ratio/mean"
IS_RATIO_MAX = "sampling/importance_sampling_ratio/max"
VLLM_SYNC_SECONDS = "vllm/sync_seconds"
VLLM_GENERATION_SECONDS = "vllm/generation_seconds"
IS_DROPPED = "sampling/importance_sampling_dropped"  # staleness_correction="icepop": share of tokens dropped
STALENESS_MEAN = "rollout/staleness_mean"  # max_staleness ≥ 1: iterations between the sampling and the scoring policy
STALENESS_MAX = "rollout/staleness_max"
ROLLOUT_SECONDS = "timing/rollout"  # the trainer's rollout phase: generate and score (k ≥ 1: wait and score)
GENERATION_SECONDS = "timing/generation"  # max_staleness ≥ 1: the producer's time on the batch
ROLLOUT_WAIT_SECONDS = "timing/rollout_wait"  # max_staleness ≥ 1: the trainer's wait for the producer
UPDATE_SECONDS = "timing/update"  # the PPO update

# ---- with tools or environment_factory (TRL GRPO's call frequency), per rollout batch
TOOL_CALL_FREQUENCY = "tools/call_frequency"  # well-formed tool calls per trajectory (TRL's)
TOOL_FAILURE_FREQUENCY = "tools/failure_frequency"  # share of the well-formed calls that failed, 0 without (TRL's)
TOOL_FAILURE_RATE = "tools/failure_rate"  # share of calls that failed (raised, unknown tool, bad arguments, malformed)
TOOL_TURNS = "tools/turns"  # tool-result turns per trajectory

# ---- added by CollapseMonitor ------------------------------------------------------------------------------------------
COLLAPSE_ANY = "collapse/any"

# ---- not logged by the trainer itself ----------------------------------------------------------------------------------
GOLD_REWARD = "gold/reward"  # a known gold reward passed as this ``rollout_metrics`` entry (the toy world does)
# By trl_ppomax.judging.WinRateCallback (Fig. 4): share of fixed prompts where the policy's answer beats the SFT's
WIN_RATE_VS_SFT = "eval/win_rate_vs_sft"
TIE_RATE_VS_SFT = "eval/tie_rate_vs_sft"
LOSE_RATE_VS_SFT = "eval/lose_rate_vs_sft"

#: Logged by the trainer for every rollout batch (and, with the eval_ prefix, by evaluate()).
PER_RESPONSE = (KL, NON_SCORE_REWARD, RLHF_REWARD, SCORES, SCORES_NORMALIZED, POLICY_PERPLEXITY, REF_PERPLEXITY)
PER_RESPONSE += (RESPONSE_LENGTH, STOP_TOKEN_MISSING)


def eval_name(name: str, prefix: str = "eval") -> str:
    """The name ``evaluate()`` logs ``name`` under: ``eval_objective/kl`` for ``objective/kl``."""
    return f"{prefix}_{name}"


# -- Computing them (``reduce`` sums a tensor over processes, ``gather`` concatenates) --------------------------------
#: The per-response metrics that read the policy's log-probs of its own responses (the KL, the rewards with its
#: penalty, the perplexity): logged after the update when that computes them (``old_logprobs_from_update``).
FROM_POLICY_LOGPROBS = (KL, NON_SCORE_REWARD, RLHF_REWARD, POLICY_PERPLEXITY)


def response_metrics(rollout, scores, kl, kl_coef: float, stop_token_id: int) -> dict[str, torch.Tensor]:
    """The :data:`PER_RESPONSE` values (B,) of one rollout — the collapse signals of §5.2. ``scores`` (B,) are the
    normalised scores, ``kl`` (B, T) the per-token KL."""
    non_score = -kl_coef * kl.sum(1)
    return {
        KL: kl.sum(1),
        NON_SCORE_REWARD: non_score,
        RLHF_REWARD: scores + non_score,
        SCORES: rollout.scores,
        SCORES_NORMALIZED: scores,
        POLICY_PERPLEXITY: rollout.policy_perplexity,
        REF_PERPLEXITY: rollout.ref_perplexity,
        RESPONSE_LENGTH: rollout.policy_mask.float().sum(1),  # the policy's tokens (a trajectory's, less the tools')
        STOP_TOKEN_MISSING: 1.0 - ends_with_stop(rollout.response_ids, rollout.response_mask, stop_token_id),
    }


def global_mean(per_sequence: torch.Tensor, reduce: Reduce) -> float:
    """Mean of ``per_sequence`` (B,) over every process."""
    count = torch.tensor(float(len(per_sequence)), device=per_sequence.device)
    total = reduce(torch.stack([per_sequence.float().sum(), count]))
    return (total[0] / total[1]).item()


def batch_metrics(rollout, advantages, returns, running_reward, reduce: Reduce, gather: Reduce) -> dict[str, float]:
    """Statistics of one rollout batch over every process: score spread and tails, running reward moments, mean
    value, return and raw advantage over real tokens."""
    mask = rollout.policy_mask.float()
    all_scores = gather(rollout.scores).float()
    return {
        SCORES_STD: all_scores.std().item() if len(all_scores) > 1 else 0.0,
        SCORES_P05: torch.quantile(all_scores, 0.05).item(),
        SCORES_P95: torch.quantile(all_scores, 0.95).item(),
        REWARD_RUNNING_MEAN: running_reward.mean,
        REWARD_RUNNING_STD: running_reward.std,
        VALUES: masked_mean(rollout.values.float(), mask, reduce=reduce).item(),
        RETURNS: masked_mean(returns.float(), mask, reduce=reduce).item(),
        ADVANTAGES_RAW: masked_mean(advantages.float(), mask, reduce=reduce).item(),
    }


def within_prompt_std(
    scores: torch.Tensor, keep: torch.Tensor, samples_per_prompt: int, reduce: Reduce
) -> tuple[float, float]:
    """The mean over prompts, on every process, of the standard deviation of a prompt's sampled raw scores (B,), rows
    ``i·n … i·n + n − 1`` being prompt ``i``'s (the kept samples; prompts with fewer than two left out), and the share
    of those prompts whose std is 0 (TRL's ``frac_reward_zero_std``: no advantage for a group estimator). Near 0: the
    reward does not tell a prompt's answers apart, whatever it says across prompts."""
    values, kept = scores.float().view(-1, samples_per_prompt), keep.float().view(-1, samples_per_prompt)
    count = kept.sum(1)
    mean = (values * kept).sum(1) / count.clamp(min=1)
    std = (((values - mean[:, None]) ** 2 * kept).sum(1) / count.clamp(min=1)).sqrt()[count >= 2]
    zero = torch.isclose(std, torch.zeros_like(std)).float()
    return global_mean(std, reduce), global_mean(zero, reduce)


def schedule_metrics(state, lr_scheduler, start: tuple[float, int], *, with_critic: bool) -> dict[str, float]:
    """Counters, speed since ``start = (time, episode)`` of this run (or resume), learning rates (the policy's groups
    come first, the critic's last; ``critic/lr`` only ``with_critic``), GPU memory."""
    lrs = lr_scheduler.get_last_lr()
    metrics = {
        EPISODE: float(state.episode),
        EPISODES_PER_SECOND: (state.episode - start[1]) / max(time.time() - start[0], 1e-9),
        LEARNING_RATE: lrs[0],
    }
    if with_critic:
        metrics[CRITIC_LEARNING_RATE] = lrs[-1]
    if torch.cuda.is_available():
        metrics[PEAK_GPU_MEMORY] = torch.cuda.max_memory_allocated() / 1e9
    return metrics


#: TRL GRPO's names of some of ours (the same quantity), logged beside them for a swapped GRPO script's dashboards
#: and tests; ``completions/mean_length`` counts the policy's tokens (an agent's tool tokens left out).
TRL_NAMES = {
    "reward": SCORES,
    "reward_std": SCORES_STD,
    "frac_reward_zero_std": SCORES_ZERO_STD_FRAC,
    "completions/mean_length": RESPONSE_LENGTH,
    "completions/clipped_ratio": STOP_TOKEN_MISSING,
    "entropy": ENTROPY,
    "clip_ratio/region_mean": CLIPFRAC,
}


def with_trl_names(logs: dict[str, float]) -> dict[str, float]:
    """``logs`` and, beside ours, TRL GRPO's names of them (:data:`TRL_NAMES`)."""
    return {**logs, **{trl: logs[ours] for trl, ours in TRL_NAMES.items() if ours in logs}}
