"""The gap between another sampler's log-probs ``μ`` (vLLM, or a ``rollout_func``'s own sampler) and the scoring
policy's sampling distribution ``π`` (temperature, then top-p renormalised: :func:`core.nucleus_logprobs`), logged per
rollout chunk, and its truncated importance weights ``min(π/μ, C)`` (TRL GRPO's ``token_truncate``)."""

from __future__ import annotations

from statistics import fmean as mean

import torch

from trl_ppomax.base import core
from trl_ppomax.base import metrics as M

__all__ = ["REDUCERS", "SAMPLING_STATS", "reduced", "sampler_weights"]

#: What :func:`sampler_weights` records per rollout chunk, in order, and how :func:`reduced` reduces each (else mean).
SAMPLING_STATS = (M.SAMPLING_LOGP_DIFF_MEAN, M.SAMPLING_LOGP_DIFF_MAX, M.IS_RATIO_MEAN, M.IS_RATIO_MIN, M.IS_RATIO_MAX)
REDUCERS = {M.SAMPLING_LOGP_DIFF_MAX: max, M.IS_RATIO_MAX: max, M.IS_RATIO_MIN: min}


def sampler_weights(args, stats: dict, policy_logits, responses, mask, sampler_logprobs) -> torch.Tensor:
    """Per-token weights (B, T) ``min(π/μ, vllm_importance_sampling_clip_max)`` of the sampled ``responses`` over
    ``mask`` (the tokens the sampler wrote), ``π`` from ``policy_logits`` (B, T, V) at ``args``' temperature and top-p;
    ``|log π − log μ|`` and the ratios appended to ``stats`` (one host sync)."""
    target = core.nucleus_logprobs(policy_logits, responses, args.temperature, args.top_p)
    gap = (target - sampler_logprobs).abs()[mask.bool()]
    weights = core.truncated_importance_weights(target, sampler_logprobs, mask, args.vllm_importance_sampling_clip_max)
    ratios = weights[mask.bool()]
    if gap.numel():
        values = torch.stack([gap.mean(), gap.max(), ratios.mean(), ratios.min(), ratios.max()]).tolist()
        for name, value in zip(SAMPLING_STATS, values, strict=True):
            stats[name].append(value)
    return weights


def reduced(stats: dict, reducers: dict | None = None) -> dict[str, float]:
    """Each statistic's values reduced as ``reducers`` (default :data:`REDUCERS`) says, else averaged."""
    reducers = REDUCERS if reducers is None else reducers
    return {name: reducers.get(name, mean)(values) for name, values in stats.items() if values}
