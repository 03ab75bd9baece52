"""Phase 2: a scored :class:`~trl_ppomax.base.rollout.Rollout` turned into training targets (:class:`ExperienceMaker`,
an :class:`Experience`)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trl_ppomax import rewards
from trl_ppomax.base import core
from trl_ppomax.base import metrics as M
from trl_ppomax.base.core import Reduce
from trl_ppomax.base.rollout import Rollout
from trl_ppomax.ppo import advantages

logger = logging.getLogger(__name__)


@dataclass
class Experience:
    """Training targets of one rollout batch (per process), computed once before the PPO epochs."""

    rollout: Rollout
    old_logprobs: torch.Tensor  # (B, T) denominator of the ratio: rollout policy or reference (§5.3.2)
    advantages: torch.Tensor  # (B, T) normalised / clipped over the batch (raw when normalised per minibatch)
    returns: torch.Tensor  # (B, T)
    raw_advantages: torch.Tensor  # (B, T) GAE advantages before normalisation
    #: With ``old_logprobs_from_update``: ``old_logprobs`` is a buffer the update's forward fills (π_old is the
    #: policy itself, detached), and this returns the metrics that read them once it has (else None).
    policy_metrics: Callable[[], dict[str, float]] | None = None


# -- Non-finite samples: the experience phase's guard ------------------------------------------------------------------
def drop_non_finite(rollout: Rollout, reduce: Reduce) -> tuple[Rollout, torch.Tensor, int, str | None]:
    """Mask out the samples whose score is NaN (a reward function's None) or ±inf: response mask, score, log-probs
    and values zeroed, so they add nothing to the reward moments, advantages, losses or metrics. Returns ``(rollout,
    keep, dropped, problem)``: ``keep`` (B,) marks this process's kept samples, ``dropped`` counts the samples dropped
    on every process, ``problem`` says why the whole batch must be skipped (no finite score left, or a non-finite
    log-prob or value), else None. One reduction; ``dropped`` and ``problem`` agree on every process."""
    keep = torch.isfinite(rollout.scores)
    checked = {"policy log-probs": rollout.logprobs, "reference log-probs": rollout.ref_logprobs}
    checked = {name: tensor for name, tensor in checked.items() if tensor is not None}  # None: the update's to come
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
        fields = [f for f in ("logprobs", "ref_logprobs", "values") if getattr(rollout, f) is not None]
        zeroed = {f: torch.where(row, getattr(rollout, f), 0.0) for f in fields}
        mask = rollout.response_mask * row.to(rollout.response_mask.dtype)
        scores = torch.where(keep, rollout.scores, 0.0)
        rollout = dataclasses.replace(rollout, **zeroed, scores=scores, response_mask=mask)
    return rollout, keep, dropped, problem


def kept_gather(keep: torch.Tensor, gather: Reduce) -> Reduce:
    """``gather`` (concatenation over processes) restricted to the kept samples: maps values (B,) to the kept values of
    every process, which may keep different numbers of samples (so those cannot be gathered directly)."""

    def gather_kept(values: torch.Tensor) -> torch.Tensor:
        both = gather(torch.stack([values.float(), keep.float()], dim=1))
        return both[both[:, 1] > 0, 0]

    return gather_kept


def process_sum(accelerator) -> Reduce:
    """Sum of a tensor over every process (the tensor itself on one)."""
    if accelerator.num_processes == 1:
        return lambda tensor: tensor
    return lambda tensor: accelerator.reduce(tensor, reduction="sum")


class ExperienceMaker:
    """Phase 2, rewards and advantages (§5.3): scores normalised and clipped with the running moments, the token KL
    penalty, the ``advantage_estimator``'s advantages and returns (:mod:`~trl_ppomax.ppo.advantages`), whitened, and
    the rollout's metrics.

    Args (keyword-only):
        args: the run's config (reward shaping, the estimator, whitening).
        ppo_state: the :class:`~trl_ppomax.ppo.state.PPOState` whose running moments and counters it updates.
        accelerator: the run's ``Accelerator`` (gathers and sums over processes); ``tokenizer``: the policy's.
        reward_sources: the run's reward sources (their names and statistics in the metrics).
        rollout_metrics: the user's extra per-response measurements, ``{name: f(prompts, completions)}``.
        end_token_id: the token that ends a finished response, which the length metrics look for.
    """

    def __init__(
        self, *, args, ppo_state, accelerator, tokenizer, reward_sources, rollout_metrics, end_token_id
    ) -> None:
        self.args, self.ppo_state, self.gather = args, ppo_state, accelerator.gather
        self.reduce, self.reward_sources, self.tokenizer = process_sum(accelerator), reward_sources, tokenizer
        self.rollout_metrics, self.end_token_id = rollout_metrics, end_token_id

    def make(self, rollout: Rollout, step: int) -> tuple[Experience | None, dict[str, float], str | None]:
        """The experience of ``rollout`` at iteration ``step + 1``: samples with a non-finite score are masked out
        (:func:`drop_non_finite`). Returns ``(experience, metrics, None)``, or ``(None, {}, why)`` on every process
        when none is left or a number is non-finite: such a batch leaves the moments unchanged."""
        rollout, keep, dropped, problem = drop_non_finite(rollout, self.reduce)
        self.ppo_state.counters[M.SKIPPED_SAMPLES] += dropped
        if problem:
            return None, {}, problem
        moments = self.ppo_state.running_reward
        before = moments.state_dict()  # restored if the batch is skipped below
        if not self._moments_frozen(step):
            moments.update(self.winsorized(rollout.scores, keep)[keep], reduce=self.reduce)
        scores, kl = self.shape_scores(rollout)
        estimate = advantages.estimate(self.args, scores, kl, rollout.policy_mask, rollout.values, self.reduce)
        normalised = estimate.advantages
        if self.args.advantage_whitening_scope == "batch":  # else per minibatch, in the update
            normalised = self.whitened(estimate.advantages, rollout.policy_mask)
        if not self._all_finite(normalised, estimate.returns):
            moments.load_state_dict(before)
            return None, {}, "non-finite advantages or returns"
        old = rollout.ref_logprobs if self.args.importance_sampling == "reference" else rollout.logprobs
        trained = self.without_truncated(rollout) if self.args.mask_truncated_completions else rollout
        experience = Experience(trained, old, normalised, estimate.returns, raw_advantages=estimate.advantages)
        logged = self._logged(rollout, keep, scores, kl, estimate)
        if rollout.logprobs is None:  # old_logprobs_from_update: the update's forward writes π_old
            experience.old_logprobs = torch.zeros_like(rollout.ref_logprobs)
            experience.policy_metrics = functools.partial(self.policy_metrics, experience, rollout, keep, scores)
            logged = {name: value for name, value in logged.items() if name not in M.FROM_POLICY_LOGPROBS}
        return experience, logged, None

    def policy_metrics(self, experience: Experience, rollout: Rollout, keep, scores) -> dict[str, float]:
        """The metrics of :data:`~trl_ppomax.base.metrics.FROM_POLICY_LOGPROBS` of a batch whose π_old the update
        wrote into ``experience.old_logprobs`` (``old_logprobs_from_update``): those :meth:`make` logs otherwise."""
        logprobs = experience.old_logprobs
        perplexity = core.sequence_perplexity(logprobs, rollout.response_mask)  # at temperature 1, as scoring's
        rollout = dataclasses.replace(rollout, logprobs=logprobs, policy_perplexity=perplexity)
        _, kl = self.shape_scores(rollout)
        per_response = M.response_metrics(
            rollout.select(keep), scores[keep], kl[keep], self.args.kl_coef, self.end_token_id
        )
        return {name: M.global_mean(per_response[name], self.reduce) for name in M.FROM_POLICY_LOGPROBS}

    def without_truncated(self, rollout: Rollout) -> Rollout:
        """TRL GRPO's ``mask_truncated_completions``: a response whose last token is not the stop token (cut by the
        length budget) leaves the update's losses (its policy mask 0); its score still counts in the baselines and
        the statistics, as in TRL."""
        mask = rollout.response_mask
        last = rollout.response_ids.gather(1, core.last_token_index(mask).unsqueeze(1)).squeeze(1)
        finished = ((last == self.end_token_id) & (mask.sum(1) > 0)).to(mask.dtype)
        return dataclasses.replace(rollout, env_mask=rollout.policy_mask * finished.unsqueeze(1))

    def shape_scores(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised and clipped scores (B,) with the current running moments (the raw scores winsorised first with
        ``reward_winsorize``), and the per-token KL (B, T)."""
        args, moments = self.args, self.ppo_state.running_reward
        raw = self.winsorized(rollout.scores)
        scores = core.normalize_scores(raw, moments.mean, moments.std, args.reward_norm, args.reward_clip)
        if rollout.logprobs is None:  # old_logprobs_from_update: nothing before the update reads the KL
            return scores, torch.zeros_like(rollout.ref_logprobs)
        kl = core.kl_penalty(rollout.logprobs, rollout.ref_logprobs, args.kl_estimator, args.kl_clamp)
        kl = kl * rollout.policy_mask
        return scores, kl

    def winsorized(self, scores: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The raw scores (B,), with ``reward_winsorize`` k clipped to μ ± k·σ of the moments; while those are empty,
        to the kept batch's global median ± k·1.4826·MAD when ``keep`` is given, else unchanged."""
        moments, k = self.ppo_state.running_reward, self.args.reward_winsorize
        if k is None or (keep is None and moments.count <= 1):
            return scores
        if moments.count > 1:
            return core.winsorize(scores, moments.mean, moments.std, k)
        center, scale = core.robust_location_scale(kept_gather(keep, self.gather)(scores))
        return core.winsorize(scores, center, scale, k)

    def whitened(self, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Advantages whitened (``whiten_advantages``) and clipped (``advantage_clip``) over every process's rows."""
        args = self.args
        return core.normalize_advantages(advantages, mask, args.whiten_advantages, args.advantage_clip, self.reduce)

    def response_metrics(self, rollout: Rollout, scores: torch.Tensor, kl: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-response monitoring values (B,): the user's ``rollout_metrics`` and :data:`metrics.PER_RESPONSE`."""
        return {
            **rewards.text_metrics(self.rollout_metrics, self.tokenizer, rollout),
            **self.reward_sources.metrics(rollout.source_scores),
            **M.response_metrics(rollout, scores, kl, self.args.kl_coef, self.end_token_id),
        }

    def source_spreads(self, rollout: Rollout, keep: torch.Tensor) -> dict[str, float]:
        """``rewards/<name>/std`` of each reward source over the kept samples of every process (unbiased, a sample a
        source does not score left out; TRL GRPO's)."""
        spreads, gather = {}, kept_gather(keep, self.gather)
        for name, scores in self.reward_sources.metrics(rollout.source_scores).items():
            values = gather(scores)
            values = values[~values.isnan()]
            spreads[name.removesuffix("/mean") + "/std"] = values.std().item() if len(values) > 1 else 0.0
        return spreads

    def _moments_frozen(self, step: int) -> bool:
        """With ``reward_norm_freeze`` only the first ``max(critic_warmup_steps, 1)`` iterations update the moments."""
        return bool(self.args.reward_norm_freeze) and step >= max(self.args.critic_warmup_steps, 1)

    def _logged(self, rollout: Rollout, keep, scores, kl, estimate) -> dict[str, float]:
        """The kept samples' per-response metrics averaged over every process, and the batch's."""
        per_response = self.response_metrics(rollout.select(keep), scores[keep], kl[keep])
        metrics = {
            name: M.global_mean(value, self.reduce) for name, value in per_response.items() if value is not None
        }
        moments, gather = self.ppo_state.running_reward, kept_gather(keep, self.gather)
        metrics.update(M.batch_metrics(rollout, estimate.advantages, estimate.returns, moments, self.reduce, gather))
        metrics.update(self.source_spreads(rollout, keep))
        if not self.args.uses_critic:  # no critic, no values: the zeros stand in for none
            metrics.pop(M.VALUES)
        else:
            mask = rollout.policy_mask
            explained = core.explained_variance(rollout.values, estimate.returns, mask, self.reduce)
            metrics[M.EXPLAINED_VARIANCE] = explained.item()
        if isinstance(estimate.lam_policy, torch.Tensor):
            metrics[M.LAM_POLICY] = M.global_mean(estimate.lam_policy[keep], self.reduce)
        if (n := self.args.num_samples_per_prompt) > 1:
            spread, zero_spread = M.within_prompt_std(rollout.scores, keep, n, self.reduce)
            metrics[M.SCORES_STD_WITHIN_PROMPT], metrics[M.SCORES_ZERO_STD_FRAC] = spread, zero_spread
        if self.args.reward_winsorize is not None:
            clipped = self.winsorized(rollout.scores) != rollout.scores
            metrics[M.SCORES_WINSORIZED] = M.global_mean(clipped[keep], self.reduce)
        return metrics

    def _all_finite(self, *tensors: torch.Tensor) -> bool:
        """Whether every tensor is finite on every process (one reduction)."""
        bad = sum((~torch.isfinite(t)).sum() for t in tensors).float()
        return self.reduce(bad.reshape(1)).item() == 0
