"""Models: the policy + critic wrapper and how logits, values and scores are read from a model.

This is the one place a new model family is taught: :func:`backbone_and_head` finds the transformer body and the
scalar head of a ``*ForSequenceClassification`` model (reward model and critic); the rest reads through it.

Sequences are laid out as ``[query (left-padded, width L) | response (right-padded, width T)]``. The logits and the
value for response token ``t`` are read at position ``L − 1 + t`` (the state before the token); the score at the
last real response token.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

#: Attribute names of the scalar head of a sequence-classification model, in the order they are tried.
SCORE_HEAD_NAMES = ("score", "classifier")


class PolicyAndCritic(nn.Module):
    """Policy and critic behind one ``forward`` so that one ``accelerator.prepare`` (DDP, DeepSpeed) wraps both.

    ``forward`` returns the response logits (B, T, V), the values (B, T) and, when ``ptx_inputs`` is given, the
    policy's logits on that pre-training batch. trl 1.12's names ``policy`` and ``value_model`` both work.
    """

    def __init__(self, policy: nn.Module, critic: nn.Module) -> None:
        super().__init__()
        self.policy = policy
        self.critic = critic

    @property
    def value_model(self) -> nn.Module:
        """The critic, under trl 1.12's name (``trainer.model.value_model``)."""
        return self.critic

    def forward(self, inputs: dict, response_width: int, ptx_inputs: dict | None = None):
        logits = response_logits(self.policy, inputs, response_width)
        values = token_values(self.critic, inputs, response_width)
        ptx_logits = self.policy(**ptx_inputs, use_cache=False).logits if ptx_inputs is not None else None
        return logits, values, ptx_logits

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        kwargs = gradient_checkpointing_kwargs or {"use_reentrant": False}
        for model in (self.policy, self.critic):
            if hasattr(type(model), "activation_checkpointing_enable"):  # transformers ≥ 5.x name
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    @property
    def is_gradient_checkpointing(self) -> bool:
        flag = getattr(type(self.policy), "is_activation_checkpointing", None)
        name = "is_activation_checkpointing" if flag is not None else "is_gradient_checkpointing"
        return bool(getattr(self.policy, name, False))

    def gradient_checkpointing_disable(self) -> None:
        for model in (self.policy, self.critic):
            name = "activation_checkpointing_disable"
            getattr(model, name if hasattr(type(model), name) else "gradient_checkpointing_disable")()


def _accepts(module: nn.Module, argument: str) -> bool:
    return argument in inspect.signature(module.forward).parameters


def response_logits(model: nn.Module, inputs: dict[str, torch.Tensor], response_width: int) -> torch.Tensor:
    """Logits (B, T, V) predicting each response token: positions ``L − 1 … L + T − 2``.

    Asks the model for the last ``T + 1`` positions only (``logits_to_keep``) when it supports it.
    """
    extra = {"logits_to_keep": response_width + 1} if _accepts(model, "logits_to_keep") else {}
    logits = model(**inputs, use_cache=False, **extra).logits
    return logits[:, -response_width - 1 : -1]


def score_head(model: nn.Module) -> nn.Module | None:
    """The scalar head of a ``*ForSequenceClassification`` model (PEFT-wrapped or not), or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for name in SCORE_HEAD_NAMES:
        head = getattr(base, name, None)
        if head is not None:
            return head
    return None


def backbone_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The transformer body and the scalar head of a ``*ForSequenceClassification`` model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone = getattr(base, getattr(base, "base_model_prefix", ""), None)
    head = score_head(model)
    if backbone is None or head is None:
        raise ValueError(
            f"{type(model).__name__} is not a sequence-classification model with a `score` head; load reward and "
            "value models with AutoModelForSequenceClassification.from_pretrained(..., num_labels=1)."
        )
    return backbone, head


def token_values(model: nn.Module, inputs: dict[str, torch.Tensor], response_width: int) -> torch.Tensor:
    """Per-token values (B, T) of a sequence-classification critic: its head applied at every position."""
    backbone, head = backbone_and_head(model)
    hidden = backbone(**inputs, use_cache=False).last_hidden_state[:, -response_width - 1 : -1]
    return head(hidden).squeeze(-1).float()


def sequence_scores(
    model: nn.Module, inputs: dict[str, torch.Tensor], query_width: int, response_mask: torch.Tensor
) -> torch.Tensor:
    """Reward-model score (B,) read at the last real response token (the stop token when present)."""
    backbone, head = backbone_and_head(model)
    hidden = backbone(**inputs, use_cache=False).last_hidden_state
    last = query_width + (response_mask.long().sum(1) - 1).clamp(min=0)
    picked = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    return head(picked).squeeze(-1).float()
