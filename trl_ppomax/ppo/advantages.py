"""Advantage estimators: the registry ``PPOMaxConfig.advantage_estimator`` names one of. An estimator turns a
rollout's shaped token rewards into the policy's advantages and the critic's targets, and says whether it needs a
critic (GAE does; a group baseline over one prompt's samples would not). A new estimator is a function and one
:data:`ESTIMATORS` entry; the trainer calls :meth:`AdvantageEstimator.estimate` and knows nothing else about it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from trl_ppomax.ppo import core

__all__ = ["ESTIMATORS", "AdvantageEstimate", "AdvantageEstimator", "gae"]


@dataclass(frozen=True)
class AdvantageEstimate:
    """``advantages`` and ``returns`` (B, T), zero after each response; ``lam_policy``: the policy's λ (a float, or
    (B,) per response with the length-adaptive λ), logged when it varies."""

    advantages: torch.Tensor
    returns: torch.Tensor
    lam_policy: float | torch.Tensor | None = None


@dataclass(frozen=True)
class AdvantageEstimator:
    """One entry of :data:`ESTIMATORS`: ``estimate(token_rewards, values, mask, args) -> AdvantageEstimate`` with
    token rewards, values and the response mask (B, T), and the run's config; ``needs_critic``: whether ``values``
    must come from a critic (else they are zeros and no critic is trained)."""

    name: str
    needs_critic: bool
    estimate: Callable[..., AdvantageEstimate]


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, args) -> AdvantageEstimate:
    """GAE (§3.2.2): ``δ_t = r_t + γV_{t+1} − V_t``, ``A_t = Σ_l (γλ)^l δ_{t+l}``, ``R_t = A_t + V_t``, with
    ``args.gamma`` and ``args.lam``, or, beyond the paper, the length-adaptive policy λ (``args.lam_alpha``,
    :func:`core.length_adaptive_lam`) and a critic λ of its own (``args.lam_critic``, :func:`core.decoupled_gae`)."""
    lam = args.lam if args.lam_alpha is None else core.length_adaptive_lam(mask, args.lam_alpha)
    advantages, returns = core.decoupled_gae(token_rewards, values, mask, args.gamma, lam, args.lam_critic)
    return AdvantageEstimate(advantages, returns, lam)


#: The advantage estimators by name; GAE is PPO-max's (and the default).
ESTIMATORS: dict[str, AdvantageEstimator] = {"gae": AdvantageEstimator("gae", needs_critic=True, estimate=gae)}
