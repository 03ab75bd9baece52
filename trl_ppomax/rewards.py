"""Reward sources and the reward-statistics contract.

- Sources: a reward model (a ``*ForSequenceClassification`` with one label, read where the model reads it, see
  :func:`~trl_ppomax.modeling.score_position`) or a
  Python function ``f(prompts, completions) -> list[float]`` on the decoded texts; :func:`score_responses` gives
  either's scores (B,). The missing-stop-token penalty is applied on top (:func:`apply_missing_eos_penalty`).
- Statistics: :class:`~trl_ppomax.PPOMaxRewardTrainer` measures the mean and std of its rewards and stores them in
  the saved model's config (:data:`STATS_KEYS`); :class:`~trl_ppomax.PPOMaxTrainer` seeds its running reward moments
  from them (:func:`running_moments_from_config`), which rejects non-finite ones.
- Non-finite rewards: the samples are masked out of their batch (:func:`drop_non_finite`); a batch with none left is
  skipped, and ``max_skipped_iterations`` skips in a row stop the run (:func:`count_skipped_iteration`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import reprlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from . import core
from .modeling import sequence_scores

if TYPE_CHECKING:
    from .rollout import Rollout

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
    """Scores (B,) from a Python reward ``function(prompts, completions)``.

    Accepts exactly one number per completion, as a list, tuple, numpy array or 1-D tensor; anything else (a dict,
    None, a single number, text, the wrong count) raises a ``ValueError`` that blames the function and shows what it
    returned (NaN and ±inf are numbers: they pass, and the trainer deals with them)."""
    returned = function(prompts, completions)
    if isinstance(returned, torch.Tensor | np.ndarray) and returned.ndim == 1:
        values = returned.tolist()
    elif isinstance(returned, Sequence) and not isinstance(returned, str | bytes):
        values = list(returned)
    else:
        raise _reward_function_fault(function, returned, len(prompts), "it did not return a sequence of scores")
    if len(values) != len(prompts):
        problem = f"it returned {len(values)} scores for {len(prompts)} completions"
        raise _reward_function_fault(function, returned, len(prompts), problem)
    wrong = [value for value in values if not _is_number(value)]
    if wrong:
        problem = (
            f"it must return numbers, but {len(wrong)} of its {len(values)} scores are not (e.g. "
            f"{type(wrong[0]).__name__} {_SHORT.repr(wrong[0])})"
        )
        raise _reward_function_fault(function, returned, len(prompts), problem)
    return torch.tensor([float(value) for value in values], device=device)


_SHORT = reprlib.Repr()  # a short repr of what a reward function returned, for the error message
_SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxother = 6, 6, 4, 60, 80


def _is_number(value) -> bool:
    if isinstance(value, torch.Tensor | np.ndarray):
        return value.size == 1 if isinstance(value, np.ndarray) else value.numel() == 1 and not value.is_complex()
    return isinstance(value, numbers.Real)


def _reward_function_fault(function, returned, count: int, problem: str) -> ValueError:
    name = getattr(function, "__name__", type(function).__name__)
    return ValueError(
        f"The reward function {name!r} is at fault: {problem}. It returned {type(returned).__name__} "
        f"{_SHORT.repr(returned)}; a reward function must return a list, tuple, numpy array or 1-D tensor with one "
        f"number per completion ({count} here)."
    )


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
# Non-finite rewards
# --------------------------------------------------------------------------------------------------------------------
def drop_non_finite(rollout: Rollout, reduce: core.Reduce) -> tuple[Rollout, torch.Tensor, int, str | None]:
    """Mask out the samples whose score is NaN or ±inf: their response mask is zeroed and their score, log-probs and
    values set to 0, so that they add nothing to the running reward moments, advantages, losses or metrics.

    Returns ``(rollout, keep, dropped, problem)``: ``keep`` (B,) marks the samples kept on this process, ``dropped``
    counts the samples dropped on every process, and ``problem`` says why the whole batch must be skipped — no finite
    score left on any process, or a non-finite log-prob or value — else None. One reduction; ``dropped`` and
    ``problem`` are the same on every process.
    """
    keep = torch.isfinite(rollout.scores)
    checked = {"policy log-probs": rollout.logprobs, "reference log-probs": rollout.ref_logprobs}
    checked["values"] = rollout.values
    local = [(~keep).sum(), torch.tensor(keep.numel(), device=keep.device)]
    local += [(~torch.isfinite(tensor)).sum() for tensor in checked.values()]
    dropped, total, *bad = (int(n) for n in reduce(torch.stack(local).double()).tolist())
    problem = ", ".join(f"non-finite {name} ({n})" for name, n in zip(checked, bad, strict=True) if n) or None
    if problem is None and dropped == total:
        problem = f"non-finite rewards (NaN or inf) for all {total} samples"
    if problem is None and dropped:
        logger.warning("Dropped %d of %d samples from the batch: their rewards were NaN or inf.", dropped, total)
    if problem is None and not keep.all():
        row = keep[:, None]
        zero_rows = {name: torch.where(row, getattr(rollout, name), 0.0) for name in ("logprobs", "ref_logprobs")}
        rollout = dataclasses.replace(
            rollout,
            **zero_rows,
            values=torch.where(row, rollout.values, 0.0),
            scores=torch.where(keep, rollout.scores, 0.0),
            response_mask=rollout.response_mask * row.to(rollout.response_mask.dtype),
        )
    return rollout, keep, dropped, problem


def kept_gather(keep: torch.Tensor, gather: core.Reduce) -> core.Reduce:
    """``gather`` (concatenation over processes) restricted to the kept samples: maps values (B,) to the kept values of
    every process, which may keep different numbers of samples (so those cannot be gathered directly)."""

    def gather_kept(values: torch.Tensor) -> torch.Tensor:
        both = gather(torch.stack([values.float(), keep.float()], dim=1))
        return both[both[:, 1] > 0, 0]

    return gather_kept


def count_skipped_iteration(counters: dict[str, float], problem: str | None, args, iteration: int) -> None:
    """Count iteration ``iteration`` in the trainer's ``counters``: skipped because of ``problem``, or trained when
    ``problem`` is None, which ends a run of skips. Raises ``RuntimeError`` at the ``args.max_skipped_iterations``-th
    skip in a row, or when the last iteration ends a run in which every iteration was skipped: either would otherwise
    end "successfully" with an untrained model.
    """
    from . import metrics as M  # metrics imports this module

    if problem is None:
        counters[M.SKIPPED_IN_A_ROW] = 0
        return
    counters[M.SKIPPED_ITERATIONS] += 1
    counters[M.SKIPPED_IN_A_ROW] += 1
    streak, limit = counters[M.SKIPPED_IN_A_ROW], args.max_skipped_iterations
    if streak >= limit:
        what = f"{streak:g} iterations in a row were skipped for non-finite numbers (max_skipped_iterations={limit})"
    elif iteration == args.num_total_batches and streak == iteration:
        what = (
            f"every one of the run's {iteration} iterations was skipped for non-finite numbers, so the model is "
            f"untrained (max_skipped_iterations={limit} was not reached)"
        )
    else:
        logger.warning(
            "Iteration %d skipped (%g in a row, max_skipped_iterations=%d): %s.", iteration, streak, limit, problem
        )
        return
    raise RuntimeError(
        f"Stopped at iteration {iteration}: {what}; the last had {problem}. Check the reward function or model "
        "(NaN/inf scores), the learning rate and mixed precision (non-finite log-probs or values), then resume from "
        "the last checkpoint; or raise max_skipped_iterations."
    )


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
    """RunningMoments seeded with the reward statistics stored by PPOMaxRewardTrainer, or None if there are none.

    Raises ``ValueError`` naming them when stored statistics are NaN/inf, or a negative std or count: seeding reward
    normalisation with them would make every reward non-finite and skip every iteration.
    """
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


def initial_reward_moments(reward_model, reward_norm: str) -> core.RunningMoments:
    """The PPO trainer's running reward moments at the start: seeded with the statistics PPOMaxRewardTrainer stored in
    the reward model's config when rewards are normalised, else empty."""
    seeded = running_moments_from_config(getattr(reward_model, "config", None))  # checked even when unused
    seeded = seeded if reward_norm != "none" else None
    if seeded is not None:
        logger.info("Reward normalisation starts from the reward model's stored statistics: %s", seeded)
    return seeded or core.RunningMoments()
