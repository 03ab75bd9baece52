"""The reward-statistics contract between the two trainers: :class:`~trl_ppomax.PPOMaxRewardTrainer` measures the mean
and std of its rewards and stores them in the saved model's config (:data:`STATS_KEYS`); :class:`~trl_ppomax.PPOMaxTrainer`
seeds its running reward moments from them (:func:`running_moments_from_config`), which rejects non-finite ones."""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from trl_ppomax.base import core

logger = logging.getLogger(__name__)

#: Config attributes holding the reward statistics written by the reward trainer and read by the PPO trainer.
STATS_KEYS = ("reward_mean", "reward_std", "reward_stats_count")


def reward_statistics(pairs: torch.Tensor) -> dict[str, float]:
    """Mean and unbiased std of every reward in ``pairs`` (N, 2) = (chosen, rejected), and how many there were."""
    values = pairs.flatten().double()
    std = values.std().item() if values.numel() > 1 else 1.0
    return {"reward_mean": values.mean().item(), "reward_std": std, "reward_stats_count": float(values.numel())}


@torch.no_grad()
def fold_reward_stats(head: nn.Linear, stats: dict[str, float]) -> dict[str, float]:
    """Rescale ``head`` so it outputs ``(r − μ) / σ``: ``w ← w/σ``, ``b ← (b − μ)/σ``. Without a bias only the scale
    can be folded, and the outputs keep the mean ``μ/σ``. Returns the statistics of the folded head's outputs."""
    mean, std = stats["reward_mean"], stats["reward_std"]
    if not math.isfinite(std) or std <= 0:
        raise ValueError(f"Cannot fold a reward std of {std}; evaluate on more than one distinct reward first.")
    head.weight.div_(std)
    if head.bias is not None:
        head.bias.sub_(mean).div_(std)
        folded_mean = 0.0
    else:
        folded_mean = mean / std
        logger.warning(
            "The score head has no bias, so only the reward scale was folded; the mean (%.4g after scaling) stays in "
            "the outputs and is stored in the config as reward_mean.",
            folded_mean,
        )
    return {**stats, "reward_mean": folded_mean, "reward_std": 1.0}


def store_reward_stats(config, stats: dict[str, float] | None) -> None:
    """Write ``reward_mean``, ``reward_std`` and ``reward_stats_count`` into a model config (saved with it)."""
    if stats is not None:
        for key in STATS_KEYS:
            setattr(config, key, float(stats[key]))


def running_moments_from_config(config) -> core.RunningMoments | None:
    """RunningMoments seeded with the reward statistics stored by PPOMaxRewardTrainer, or None if there are none; a
    ``ValueError`` naming them when they are NaN/inf or a negative std or count (every reward would be non-finite)."""
    stored = {key: getattr(config, key, None) for key in STATS_KEYS}
    bad = {
        key: value
        for key, value in stored.items()
        if isinstance(value, (int, float)) and (not math.isfinite(value) or (key != "reward_mean" and value < 0))
    }
    if bad:
        listed = ", ".join(f"{key}={value!r}" for key, value in bad.items())
        raise ValueError(
            f"The reward model's config holds invalid reward statistics ({listed}; {', '.join(STATS_KEYS)} must be "
            "finite, the std and count non-negative): its evaluation produced NaN/inf rewards. Fix or retrain the "
            "reward model, or delete these keys from its config.json to start reward normalisation from scratch."
        )
    if not all(isinstance(value, (int, float)) for value in stored.values()):
        return None
    count, std = config.reward_stats_count, config.reward_std
    moments = core.RunningMoments()
    moments.load_state_dict({"count": count, "mean": config.reward_mean, "m2": std**2 * max(count - 1, 0)})
    return moments
