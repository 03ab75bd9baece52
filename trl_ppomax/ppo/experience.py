"""Rollouts: generation and the tensors one rollout batch produces.

Sequences are laid out as ``[query (left-padded, width L) | response (right-padded, width T)]``; how logits, values
and scores are read from that layout is in :mod:`trl_ppomax.models`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, fields

import torch
from torch import nn
from transformers import LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper
from trl.trainer.utils import selective_log_softmax

from trl_ppomax.ppo.core import Reduce, nucleus_threshold, response_mask_from_stop, sequence_perplexity

logger = logging.getLogger(__name__)


@dataclass
class Rollout:
    """One rollout batch on one process. ``B`` = prompts, ``L`` = query width, ``T`` = response width."""

    query_ids: torch.Tensor  # (B, L) left-padded prompts
    query_mask: torch.Tensor  # (B, L) 1 on prompt tokens
    response_ids: torch.Tensor  # (B, T) sampled tokens, pad after the stop token
    response_mask: torch.Tensor  # (B, T) 1 on response tokens up to and including the stop token
    logprobs: torch.Tensor  # (B, T) log π_old(y_t) at the sampling temperature
    ref_logprobs: torch.Tensor  # (B, T) log π_ref(y_t) at the sampling temperature
    values: torch.Tensor  # (B, T) V_old(s_t) from the critic
    scores: torch.Tensor  # (B,) reward-model score, after the missing-stop-token penalty
    policy_perplexity: torch.Tensor  # (B,) perplexity of the policy (temperature 1) on its own response
    ref_perplexity: torch.Tensor  # (B,) perplexity of the reference model (temperature 1) on the same response
    source_scores: torch.Tensor | None = None  # (B, S) each reward source's score (rewards.RewardSources), if known
    sampling_weights: torch.Tensor | None = None  # (B, T) truncated importance weights of a vLLM rollout, if corrected

    def select(self, index: torch.Tensor) -> Rollout:
        """Rows ``index`` of every field."""
        return Rollout(**{f.name: take_rows(getattr(self, f.name), index) for f in fields(self)})


def take_rows(tensor: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    return None if tensor is None else tensor[index]


def pad_right(tensors: list[torch.Tensor], value: int | float) -> torch.Tensor:
    """Concatenate (B_i, T_i) tensors along rows, right-padded with ``value`` to the widest."""
    width = max(t.shape[1] for t in tensors)
    return torch.cat([nn.functional.pad(t, (0, width - t.shape[1]), value=value) for t in tensors])


def merge_rollouts(parts: list[Rollout], groups: list[torch.Tensor], pad_token_id: int) -> Rollout:
    """One rollout of ``sum(len(g))`` rows from ``parts[i]`` holding rows ``groups[i]`` (micro-batches, possibly
    reordered by length), response-width fields right-padded to the widest part."""
    order = torch.cat(groups).argsort()

    def merge(name: str) -> torch.Tensor | None:
        tensors = [getattr(p, name) for p in parts]
        if any(t is None for t in tensors):
            return None
        if tensors[0].dim() == 2 and name not in ("query_ids", "query_mask", "source_scores"):  # (B, T) fields
            return pad_right(tensors, pad_token_id if name == "response_ids" else 0)[order]
        return torch.cat(tensors)[order]

    return Rollout(**{f.name: merge(f.name) for f in fields(Rollout)})


def token_budget_batches(
    query_lengths: torch.Tensor, response_lengths: torch.Tensor, budget: int
) -> list[torch.Tensor]:
    """Row indices packed into micro-batches of at most ``budget`` padded tokens, rows × (longest prompt + longest
    response): rows sorted by total length, longest first, each batch filled greedily; a row over the budget goes
    alone. Neighbours in length share a batch, so little padding is computed."""
    queries, responses = query_lengths.tolist(), response_lengths.tolist()
    order = sorted(range(len(queries)), key=lambda i: -(queries[i] + responses[i]))
    batches: list[list[int]] = []
    longest = (0, 0)
    for i in order:
        grown = (max(longest[0], queries[i]), max(longest[1], responses[i]))
        if batches and (len(batches[-1]) + 1) * sum(grown) <= budget:
            batches[-1].append(i)
            longest = grown
        else:
            batches.append([i])
            longest = (queries[i], responses[i])
    return [torch.tensor(batch, dtype=torch.long, device=query_lengths.device) for batch in batches]


def trim_query_padding(query_ids: torch.Tensor, query_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts (B, L) without the columns that are padding in every row."""
    width = max(int(query_mask.sum(1).max()), 1)
    return query_ids[:, -width:], query_mask[:, -width:]


def sequence_inputs(
    query_ids: torch.Tensor, query_mask: torch.Tensor, response_ids: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` and ``position_ids`` (B, L + T) of query ⊕ response, positions counting real
    tokens only (correct for left padding)."""
    attention_mask = torch.cat([query_mask, response_mask.to(query_mask.dtype)], dim=1)
    position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    return {
        "input_ids": torch.cat([query_ids, response_ids], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
    }


@torch.no_grad()
def generate_responses(
    model: nn.Module, query_ids: torch.Tensor, query_mask: torch.Tensor, generation_kwargs: dict
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample responses with :func:`generation_kwargs`; returns ``(response_ids, response_mask)``, (B, T), with pad
    after the stop token (``eos_token_id``).

    Generation ends when every sequence has produced the stop token (or at ``max_new_tokens``).
    """
    output = model.generate(input_ids=query_ids, attention_mask=query_mask, **generation_kwargs)
    responses = output[:, query_ids.shape[1] :]
    mask = response_mask_from_stop(responses, generation_kwargs["eos_token_id"])
    return responses.masked_fill(~mask, generation_kwargs["pad_token_id"]), mask


@dataclass
class Experience:
    """Training targets of one rollout batch (per process), computed once before the PPO epochs."""

    rollout: Rollout
    old_logprobs: torch.Tensor  # (B, T) denominator of the ratio: rollout policy or reference (§5.3.2)
    advantages: torch.Tensor  # (B, T) normalised / clipped over the batch (raw when normalised per minibatch)
    returns: torch.Tensor  # (B, T)
    raw_advantages: torch.Tensor  # (B, T) GAE advantages before normalisation


class GeneratedTokensPenalty(LogitsProcessor):
    """CTRL's repetition penalty on the tokens generated so far, the prompt's ``prompt_width`` columns exempt (§6.1 and
    the release): for each id ``y`` already generated, ``s_y ← s_y·θ`` if ``s_y < 0`` else ``s_y/θ``. In place, on the
    (B, t) generated ids only: no copy of the (B, V) scores (transformers' processor pads and scatters two)."""

    def __init__(self, penalty: float, prompt_width: int) -> None:
        self.penalty, self.prompt_width = penalty, prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_width :]
        if generated.shape[1] == 0:
            return scores
        seen = scores.gather(1, generated)
        return scores.scatter_(1, generated, torch.where(seen < 0, seen * self.penalty, seen / self.penalty))


class NucleusFilter(LogitsProcessor):
    """Top-p filtering as :func:`~trl_ppomax.ppo.core.nucleus_threshold` defines it: scores below the nucleus set to −∞, in
    place. Sorts only the ``top_k`` most likely tokens of a row unless its nucleus reaches past them (transformers'
    ``TopPLogitsWarper`` sorts the whole vocabulary at every step)."""

    def __init__(self, top_p: float, top_k: int | None = 256) -> None:
        self.top_p, self.top_k = top_p, top_k

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        probs = scores.float().softmax(dim=-1)
        threshold = nucleus_threshold(probs, self.top_p, self.top_k)
        return scores.masked_fill_(probs < threshold.unsqueeze(-1), float("-inf"))


def generation_kwargs(
    args, stop_token_id: int | None, pad_token_id: int, sampling: bool = True, prompt_width: int = 0
) -> dict:
    """``generate()`` arguments of a rollout: at most ``response_length`` new tokens, ending at the stop token;
    greedy, or sampled (top-k off) through, in this order, the repetition penalty on the tokens **generated so far**
    (the prompt, ``prompt_width`` left-padded columns, is exempt: §6.1 and the release penalise previously generated
    tokens only, whereas ``generate(repetition_penalty=…)`` also penalises the prompt), the temperature and top-p.
    """
    kwargs = {
        "max_new_tokens": args.response_length,
        "eos_token_id": stop_token_id,
        "pad_token_id": pad_token_id,
        "do_sample": sampling,
    }
    if sampling:
        processors = []
        if args.repetition_penalty != 1.0:
            processors.append(GeneratedTokensPenalty(args.repetition_penalty, prompt_width))
        if args.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(args.temperature))
        if args.top_p < 1.0:
            processors.append(NucleusFilter(args.top_p))
        kwargs.update(temperature=1.0, top_k=0, top_p=1.0, logits_processor=LogitsProcessorList(processors))
    return kwargs


def logprobs_and_perplexity(
    logits: torch.Tensor, responses: torch.Tensor, mask: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked log-probs (B, T) of ``responses`` at ``temperature`` (:func:`core.logprobs_from_logits`) and the
    perplexity (B,) at temperature 1, with trl's fused (GPU) or row-wise ``selective_log_softmax``; one pass when
    ``temperature`` is 1."""
    logprobs = selective_log_softmax(logits, responses, temperature=temperature)
    at_one = logprobs if temperature == 1 else selective_log_softmax(logits, responses)
    return logprobs * mask, sequence_perplexity(at_one, mask)


# --------------------------------------------------------------------------------------------------------------------
# Non-finite samples: the experience phase's guard
# --------------------------------------------------------------------------------------------------------------------
def drop_non_finite(rollout: Rollout, reduce: Reduce) -> tuple[Rollout, torch.Tensor, int, str | None]:
    """Mask out the samples whose score is NaN (a reward function's None) or ±inf: their response mask is zeroed and their score, log-probs and
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
        problem = f"no finite reward (None, NaN or inf) for all {total} samples"
    if problem is None and dropped:
        logger.warning("Dropped %d of %d samples from the batch: their rewards were None, NaN or inf.", dropped, total)
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


def kept_gather(keep: torch.Tensor, gather: Reduce) -> Reduce:
    """``gather`` (concatenation over processes) restricted to the kept samples: maps values (B,) to the kept values of
    every process, which may keep different numbers of samples (so those cannot be gathered directly)."""

    def gather_kept(values: torch.Tensor) -> torch.Tensor:
        both = gather(torch.stack([values.float(), keep.float()], dim=1))
        return both[both[:, 1] > 0, 0]

    return gather_kept
