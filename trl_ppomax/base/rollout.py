"""The rollout types that flow from generation to scoring and training: :class:`Generated` (what an engine wrote, to
be scored) and :class:`Rollout` (the scored batch), with their row operations. Sequences are
``[query (left-padded, width L) | response (right-padded, width T)]`` (see ``trl_ppomax.models``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from torch import nn


@dataclass
class Generated:
    """What a rollout's generation wrote, to be scored: prompts (N, L) left-padded, responses (N, T) right-padded, the
    sampler's log-probs (N, T) when another sampler wrote them (vLLM, the producer's older copy), ``env_mask`` (N, T) 0 on a
    multi-turn trajectory's environment tokens, and ``columns``: per-row values for the reward functions (a
    ``rollout_func``'s extra keys, the agent's ``environments``)."""

    query_ids: torch.Tensor
    query_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    sampler_logprobs: torch.Tensor | None = None
    env_mask: torch.Tensor | None = None
    columns: dict[str, list] = field(default_factory=dict)


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
    env_mask: torch.Tensor | None = None  # (B, T) 1 on the tokens the policy wrote, 0 on the environment's (tools)

    @property
    def policy_mask(self) -> torch.Tensor:
        """(B, T) the tokens trained on: the response's, less the environment's (``env_mask`` 0) in a multi-turn
        trajectory. The losses, the KL penalty, GAE, the whitening and the length metrics use it; the forwards
        attend to the whole ``response_mask``."""
        return self.response_mask if self.env_mask is None else self.response_mask * self.env_mask

    def select(self, index: torch.Tensor) -> Rollout:
        """Rows ``index`` of every field."""
        return Rollout(**{f.name: take_rows(getattr(self, f.name), index) for f in fields(self)})


def take_rows(tensor: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    return None if tensor is None else tensor[index]


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


def pad_right(tensors, value: int | float) -> torch.Tensor:
    """Concatenate (B_i, T_i) tensors along rows, right-padded with ``value`` to the widest."""
    width = max(t.shape[1] for t in tensors)
    return torch.cat([nn.functional.pad(t, (0, width - t.shape[1]), value=value) for t in tensors])
