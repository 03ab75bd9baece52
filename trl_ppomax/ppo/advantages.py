"""Advantage estimators: the registry ``PPOMaxConfig.advantage_estimator`` names one of. An estimator may first
replace each sequence score by a baseline-corrected one (``baseline``: a group baseline over one prompt's
``num_samples_per_prompt`` samples, rows ``i·n … i·n + n − 1``), then turns the shaped token rewards (that score on
the last token, −β·KL on every token when the KL is in the reward) into the policy's advantages and the critic's
targets, and says whether it needs a critic. A new estimator is a function and one :data:`ESTIMATORS` entry; the
trainer knows nothing else about it.

The critic-free estimators follow OpenRLHF's convention (``experience_maker.py``): the group baseline corrects the
score, and the advantage of token t is the return from t, ``A_t = Σ_{s≥t} γ^{s−t} r_s``, so a KL penalty in the
reward still counts from the token on. With the KL as a loss (``kl_placement="loss"``) ``A_t`` is the corrected score
on every token, as verl's ``core_algos`` computes them; both are cross-checked in ``tests/test_advantages.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trl_ppomax.base import core

__all__ = [
    "ESTIMATORS",
    "AdvantageEstimate",
    "AdvantageEstimator",
    "discounted_returns",
    "gae",
    "group_mean_baseline",
    "group_normalized",
    "leave_one_out_baseline",
]

GRPO_EPS = 1e-6  # verl's ε in (s − mean) / (std + ε)


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
    must come from a critic (else they are zeros and no critic is trained); ``baseline(scores, kept, n) -> scores``
    (B,): the group baseline applied to the sequence scores first, or None (a group estimator needs
    ``num_samples_per_prompt ≥ 2``); ``scales``: the baseline also takes ``eps``, ``scope`` and ``reduce``
    (``group_std_eps``, ``group_scale`` and the sum over processes, :func:`group_normalized`); ``whitens``: the advantages are whitened over every real token of the global
    batch, ``(A − μ)/sqrt(σ² + 1e-8)`` (verl's ``masked_whiten``, unbiased σ²)."""

    name: str
    needs_critic: bool
    estimate: Callable[..., AdvantageEstimate]
    baseline: Callable[..., torch.Tensor] | None = None
    whitens: bool = False
    scales: bool = False

    @property
    def whitening_applies(self) -> bool:
        """Whether ``whiten_advantages`` may whiten this estimator's advantages: not a group baseline's (GRPO, RLOO,
        Dr. GRPO, REINFORCE++-baseline: final as verl and OpenRLHF define them) nor those it whitens itself."""
        return self.baseline is None and not self.whitens


# -- Group baselines on the sequence scores (B,), kept samples only ------------------------------------------------------
def _groups(scores: torch.Tensor, kept: torch.Tensor, n: int):
    """``(centred, weights, count)``: the kept scores minus their prompt's mean and the kept mask, (prompts, n), and
    each prompt's kept samples (prompts, 1)."""
    values, weights = scores.view(-1, n), kept.to(scores.dtype).view(-1, n)
    count = weights.sum(1, keepdim=True)
    mean = (values * weights).sum(1, keepdim=True) / count.clamp(min=1)
    return (values - mean) * weights, weights, count


def group_mean_baseline(scores: torch.Tensor, kept: torch.Tensor, n: int) -> torch.Tensor:
    """``s_i − mean_group(s)`` (REINFORCE++-baseline, arXiv 2501.03262; Dr. GRPO, arXiv 2503.20783), over the kept
    samples of each prompt; a sample alone in its group gets 0 (nothing to compare it with); dropped ones 0."""
    centred, _, count = _groups(scores, kept, n)
    return (centred * (count > 1)).view(-1)


def leave_one_out_baseline(scores: torch.Tensor, kept: torch.Tensor, n: int) -> torch.Tensor:
    """RLOO (arXiv 2402.14740): ``s_i − mean_{j≠i}(s_j) = k/(k−1)·(s_i − mean_group(s))`` with ``k`` kept samples."""
    count = _groups(scores, kept, n)[2]
    factor = (count / (count - 1).clamp(min=1)).expand(-1, n).reshape(-1)
    return group_mean_baseline(scores, kept, n) * factor


def group_normalized(
    scores: torch.Tensor, kept: torch.Tensor, n: int, eps: float = GRPO_EPS, scope: str = "group", reduce=None
) -> torch.Tensor:
    """GRPO (arXiv 2402.03300): ``(s_i − mean_group(s)) / (std + ε)`` with the unbiased std of the kept samples of
    each prompt (``scope="group"``; verl's, OpenRLHF's ``group_norm``), or of all the kept scores of the batch over
    every process (``"batch"``, TRL's ``scale_rewards="batch"``; ``reduce`` sums a tensor over processes); ε =
    :data:`GRPO_EPS` (verl's) or TRL's 1e-4."""
    centred, weights, count = _groups(scores, kept, n)
    if scope == "group":
        std = (centred**2).sum(1, keepdim=True).div((count - 1).clamp(min=1)).sqrt()
    else:
        values = scores.view(-1, n) * weights
        moments = torch.stack([weights.sum(), values.sum(), (values * values).sum()]).reshape(3)
        total, first, second = (reduce(moments) if reduce is not None else moments).unbind()
        std = ((second - first * first / total.clamp(min=1)) / (total - 1).clamp(min=1)).clamp(min=0).sqrt()
    return (centred * (count > 1) / (std + eps)).view(-1)


# -- Estimates ----------------------------------------------------------------------------------------------------------
def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, args) -> AdvantageEstimate:
    """GAE (§3.2.2): ``δ_t = r_t + γV_{t+1} − V_t``, ``A_t = Σ_l (γλ)^l δ_{t+l}``, ``R_t = A_t + V_t``, with
    ``args.gamma`` and ``args.lam``, or, beyond the paper, the length-adaptive policy λ (``args.lam_alpha``,
    :func:`core.length_adaptive_lam`) and a critic λ of its own (``args.lam_critic``, :func:`core.decoupled_gae`)."""
    lam = args.lam if args.lam_alpha is None else core.length_adaptive_lam(mask, args.lam_alpha)
    advantages, returns = core.decoupled_gae(token_rewards, values, mask, args.gamma, lam, args.lam_critic)
    return AdvantageEstimate(advantages, returns, lam)


def discounted_returns(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, args):
    """The critic-free advantage ``A_t = R_t = Σ_{s≥t} γ^{s−t} r_s`` (B, T), ``γ = args.gamma`` (RLHF's 1.0)."""
    returns = core.compute_gae(token_rewards, torch.zeros_like(token_rewards), mask, args.gamma, 1.0)[0]
    return AdvantageEstimate(returns, returns)


#: The advantage estimators by name; GAE is PPO-max's (and the default).
ESTIMATORS: dict[str, AdvantageEstimator] = {
    estimator.name: estimator
    for estimator in (
        AdvantageEstimator("gae", needs_critic=True, estimate=gae),
        # REINFORCE++ and its group-baseline variant (arXiv 2501.03262) whiten over the global batch
        AdvantageEstimator("reinforce_pp", False, discounted_returns, whitens=True),
        AdvantageEstimator("reinforce_pp_baseline", False, discounted_returns, group_mean_baseline, whitens=True),
        AdvantageEstimator("rloo", False, discounted_returns, leave_one_out_baseline),
        AdvantageEstimator("grpo", False, discounted_returns, group_normalized, scales=True),
        AdvantageEstimator("dr_grpo", False, discounted_returns, group_mean_baseline),
    )
}


def estimate(args, scores, kl, mask, values, reduce: Callable[[torch.Tensor], torch.Tensor]) -> AdvantageEstimate:
    """The ``advantage_estimator``'s estimate (:data:`ESTIMATORS`) from the shaped ``scores`` (B,) and the token KL
    (B, T): the score (group-baselined first by a critic-free estimator) on the last token of ``mask`` (B, T), −β·KL
    on every token with ``kl_placement="reward"``; the token rewards whitened with ``whiten_rewards``, the advantages
    with the estimator's ``whitens``. ``values`` (B, T): the critic's (zeros without one); ``reduce``: a sum over
    every process."""
    estimator = ESTIMATORS[args.advantage_estimator]
    if estimator.baseline is not None:
        scale = dict(eps=args.group_std_eps, scope=args.group_scale, reduce=reduce) if estimator.scales else {}
        scores = estimator.baseline(scores, mask.sum(1) > 0, args.num_samples_per_prompt, **scale)
    kl_coef = args.kl_coef if args.kl_placement == "reward" else 0.0
    token_rewards = core.token_rewards(scores, kl, mask, kl_coef)[0]
    if args.whiten_rewards:
        token_rewards = core.masked_whiten(token_rewards, mask, shift_mean=False, reduce=reduce)
    result = estimator.estimate(token_rewards, values, mask, args)
    if estimator.whitens:
        result = dataclasses.replace(result, advantages=core.masked_whiten(result.advantages, mask, reduce=reduce))
    return result
