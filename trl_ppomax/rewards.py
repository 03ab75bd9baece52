"""Reward sources and the reward-statistics contract.

- Sources: a reward model (a ``*ForSequenceClassification`` with one label, read where the model reads it, see
  :func:`~trl_ppomax.modeling.score_position`) or a
  Python function ``f(prompts, completions) -> list[float]`` on the decoded texts; :func:`score_responses` gives
  either's scores (B,). The missing-stop-token penalty is applied on top (:func:`apply_missing_eos_penalty`).
- Statistics: :class:`~trl_ppomax.PPOMaxRewardTrainer` measures the mean and std of its rewards and stores them in
  the saved model's config (:data:`STATS_KEYS`); :class:`~trl_ppomax.PPOMaxTrainer` seeds its running reward moments
  from them (:func:`running_moments_from_config`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from . import core
from .modeling import sequence_scores

logger = logging.getLogger(__name__)

RewardFunction = Callable[[list[str], list[str]], Sequence[float]]

#: Config attributes holding the reward statistics written by the reward trainer and read by the PPO trainer.
STATS_KEYS = ("reward_mean", "reward_std", "reward_stats_count")


# --------------------------------------------------------------------------------------------------------------------
# Reward sources
# --------------------------------------------------------------------------------------------------------------------
def decode_texts(tokenizer, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """Decode the masked tokens of each row, without special tokens."""
    return [tokenizer.decode(row[m.bool()], skip_special_tokens=True) for row, m in zip(ids, mask, strict=True)]


def call_reward_function(
    function: RewardFunction, prompts: list[str], completions: list[str], device: torch.device
) -> torch.Tensor:
    """Scores (B,) from a Python reward ``function(prompts, completions)``, with clear errors on bad output."""
    scores = list(function(prompts, completions))
    if len(scores) != len(prompts):
        raise ValueError(
            f"The reward function returned {len(scores)} scores for {len(prompts)} completions; it must return one "
            "number per completion."
        )
    try:
        return torch.tensor([float(s) for s in scores], device=device)
    except (TypeError, ValueError) as error:
        raise ValueError(f"The reward function must return numbers; got {scores[:4]!r}…") from error


def score_responses(
    reward: nn.Module | RewardFunction,
    tokenizer,
    inputs: dict[str, torch.Tensor],
    query_mask: torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """Scores (B,) of query ⊕ response ``inputs`` (see :func:`~trl_ppomax.rollout.sequence_inputs`) by a reward model,
    or by a reward function on the decoded prompt and response texts."""
    query_width = query_mask.shape[1]
    if isinstance(reward, nn.Module):
        return sequence_scores(reward, inputs)
    ids = inputs["input_ids"]
    prompts = decode_texts(tokenizer, ids[:, :query_width], query_mask)
    completions = decode_texts(tokenizer, ids[:, query_width:], response_mask)
    return call_reward_function(reward, prompts, completions, ids.device)


def text_metrics(functions: dict[str, RewardFunction], tokenizer, rollout) -> dict[str, torch.Tensor]:
    """``{name: f(prompts, completions)}`` (B,) each, on the decoded prompts and responses of a rollout (the
    trainer's ``rollout_metrics``)."""
    if not functions:
        return {}
    prompts = decode_texts(tokenizer, rollout.query_ids, rollout.query_mask)
    completions = decode_texts(tokenizer, rollout.response_ids, rollout.response_mask)
    device = rollout.scores.device
    return {name: call_reward_function(f, prompts, completions, device) for name, f in functions.items()}


def ends_with_stop(responses: torch.Tensor, mask: torch.Tensor, stop_token_id: int) -> torch.Tensor:
    """1.0 (B,) where the response holds ``stop_token_id``, else 0.0."""
    return ((responses == stop_token_id) & mask.bool()).any(dim=1).float()


def apply_missing_eos_penalty(
    scores: torch.Tensor, responses: torch.Tensor, mask: torch.Tensor, stop_token_id: int, penalty: float | None
) -> torch.Tensor:
    """``scores − penalty`` for the responses (B,) without the stop token; unchanged when ``penalty`` is None."""
    if penalty is None:
        return scores
    return scores - penalty * (1.0 - ends_with_stop(responses, mask, stop_token_id))


# --------------------------------------------------------------------------------------------------------------------
# The reward-statistics contract
# --------------------------------------------------------------------------------------------------------------------
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
    """RunningMoments seeded with the reward statistics stored by PPOMaxRewardTrainer, or None if there are none."""
    if not all(isinstance(getattr(config, key, None), (int, float)) for key in STATS_KEYS):
        return None
    count, std = config.reward_stats_count, config.reward_std
    moments = core.RunningMoments()
    moments.load_state_dict({"count": count, "mean": config.reward_mean, "m2": std**2 * max(count - 1, 0)})
    return moments


def initial_reward_moments(reward_model, reward_norm: str) -> core.RunningMoments:
    """The PPO trainer's running reward moments at the start: seeded with the statistics PPOMaxRewardTrainer stored in
    the reward model's config when rewards are normalised, else empty."""
    seeded = running_moments_from_config(getattr(reward_model, "config", None)) if reward_norm != "none" else None
    if seeded is not None:
        logger.info("Reward normalisation starts from the reward model's stored statistics: %s", seeded)
    return seeded or core.RunningMoments()
