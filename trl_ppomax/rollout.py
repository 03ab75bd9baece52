"""Rollouts: generation, the no-grad forwards (policy, reference, critic, reward) and the tensors they produce.

Sequences are laid out as ``[query (left-padded, width L) | response (right-padded, width T)]``. The logits and the
value for response token ``t`` are read at position ``L − 1 + t`` (the state before the token); the score at the
last real response token.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch
from torch import nn

from .core import response_mask_from_stop

RewardFunction = Callable[[list[str], list[str]], Sequence[float]]


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

    def select(self, index: torch.Tensor) -> Rollout:
        """Rows ``index`` of every field."""
        return Rollout(**{f.name: getattr(self, f.name)[index] for f in fields(self)})


def concat_rollouts(parts: list[Rollout], pad_token_id: int) -> Rollout:
    """Concatenate rollout chunks, right-padding response-width fields to the widest chunk."""
    width = max(p.response_ids.shape[1] for p in parts)

    def cat(name: str) -> torch.Tensor:
        tensors = [getattr(p, name) for p in parts]
        if tensors[0].dim() == 2 and name != "query_ids" and name != "query_mask":
            fill = pad_token_id if name == "response_ids" else 0
            tensors = [nn.functional.pad(t, (0, width - t.shape[1]), value=fill) for t in tensors]
        return torch.cat(tensors)

    return Rollout(**{f.name: cat(f.name) for f in fields(Rollout)})


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


def _accepts(module: nn.Module, argument: str) -> bool:
    return argument in inspect.signature(module.forward).parameters


def response_logits(model: nn.Module, inputs: dict[str, torch.Tensor], response_width: int) -> torch.Tensor:
    """Logits (B, T, V) predicting each response token: positions ``L − 1 … L + T − 2``.

    Asks the model for the last ``T + 1`` positions only (``logits_to_keep``) when it supports it.
    """
    extra = {"logits_to_keep": response_width + 1} if _accepts(model, "logits_to_keep") else {}
    logits = model(**inputs, use_cache=False, **extra).logits
    return logits[:, -response_width - 1 : -1]


def _backbone_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The transformer body and the scalar head of a ``*ForSequenceClassification`` model."""
    backbone = getattr(model, getattr(model, "base_model_prefix", ""), None)
    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    if backbone is None or head is None:
        raise ValueError(
            f"{type(model).__name__} is not a sequence-classification model with a `score` head; load reward and "
            "value models with AutoModelForSequenceClassification.from_pretrained(..., num_labels=1)."
        )
    return backbone, head


def token_values(model: nn.Module, inputs: dict[str, torch.Tensor], response_width: int) -> torch.Tensor:
    """Per-token values (B, T) of a sequence-classification critic: its head applied at every position."""
    backbone, head = _backbone_and_head(model)
    hidden = backbone(**inputs, use_cache=False).last_hidden_state[:, -response_width - 1 : -1]
    return head(hidden).squeeze(-1).float()


def sequence_scores(
    model: nn.Module, inputs: dict[str, torch.Tensor], query_width: int, response_mask: torch.Tensor
) -> torch.Tensor:
    """Reward-model score (B,) read at the last real response token (the stop token when present)."""
    backbone, head = _backbone_and_head(model)
    hidden = backbone(**inputs, use_cache=False).last_hidden_state
    last = query_width + (response_mask.long().sum(1) - 1).clamp(min=0)
    picked = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    return head(picked).squeeze(-1).float()


@torch.no_grad()
def generate_responses(
    model: nn.Module,
    query_ids: torch.Tensor,
    query_mask: torch.Tensor,
    generation_kwargs: dict,
    stop_token_id: int | None,
    pad_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample responses; returns ``(response_ids, response_mask)``, (B, T), with pad after the stop token.

    Generation ends when every sequence has produced the stop token (or at ``max_new_tokens``).
    """
    output = model.generate(input_ids=query_ids, attention_mask=query_mask, **generation_kwargs)
    responses = output[:, query_ids.shape[1] :]
    mask = response_mask_from_stop(responses, stop_token_id)
    return responses.masked_fill(~mask, pad_token_id), mask


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
