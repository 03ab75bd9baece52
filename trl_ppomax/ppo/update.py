"""Phase 3 of an iteration, the PPO update (§3.2): ``num_ppo_epochs`` passes over the rollout in ``num_mini_batches``
optimizer steps, each accumulated over micro-batches, and the PPO-max loss of one micro-batch (maths in ``core``).
:class:`PPOUpdate` runs it; the functions below are its steps."""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from trl_ppomax import models
from trl_ppomax.base import core
from trl_ppomax.base import metrics as M
from trl_ppomax.ppo import optim
from trl_ppomax.ppo.batching import forward_queries, update_micro_batches
from trl_ppomax.ppo.experience import Experience
from trl_ppomax.ppo.state import PPOState

logger = logging.getLogger(__name__)


class PPOUpdate:
    """The update phase: owns the prepared model (the policy and critic, :class:`~trl_ppomax.models.PolicyAndCritic`
    as ``accelerator.prepare`` returned it), its optimizer and schedule (the trainer's, the same objects), the ptx
    stream and the skipped-step counter (in ``ppo_state``, which checkpointing saves).

    Args:
        model: the prepared model (a DeepSpeed engine under ZeRO).
        optimizer, lr_scheduler: stepped once per minibatch (:func:`~trl_ppomax.ppo.optim.optimizer_step`).
        accelerator: the run's ``Accelerator``.
        args: the run's :class:`~trl_ppomax.PPOMaxConfig` (the update's epochs, minibatches, losses and clipping).
        ppo_state: the resumable state; ``counters[SKIPPED_UPDATES]`` and ``ptx_batches_used`` change here.
        ptx_batches: the PPO-ptx stream (indexable), or None without ``ptx_coef``.
        whiten: ``(advantages, mask) -> whitened`` over every process, for ``advantage_whitening_scope="minibatch"``.
        deepspeed: whether ``model`` is a DeepSpeed engine (it clips, steps and divides by its accumulation itself).

    Public surface: :meth:`run` (one iteration's update), :meth:`accumulate_gradients` and :meth:`micro_batch_loss`
    (one minibatch, one micro-batch; tests wrap the latter to poison or record a loss)."""

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler,
        accelerator,
        args,
        ppo_state: PPOState,
        ptx_batches: Sequence | None,
        whiten: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        deepspeed: bool = False,
    ) -> None:
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.accelerator, self.args, self.ppo_state = accelerator, args, ppo_state
        self.ptx_batches, self.whiten = ptx_batches, whiten
        self.uses_engine = deepspeed

    def run(self, experience: Experience, iteration: int) -> tuple[dict[str, float], str | None]:
        """The update of rollout batch ``iteration`` (the critic alone during its warm-up, §5.3.3): returns its mean
        metrics and why nothing trained (every optimizer step skipped for a non-finite gradient), else None."""
        args, skipped = self.args, self.ppo_state.counters[M.SKIPPED_UPDATES]
        metrics = self.epochs(experience, critic_only=iteration <= args.critic_warmup_steps, iteration=iteration)
        steps, problem = args.update_epochs * args.num_mini_batches, None
        if self.ppo_state.counters[M.SKIPPED_UPDATES] - skipped == steps:
            problem = f"non-finite gradients: all {steps} optimizer steps skipped"
        if iteration == args.critic_warmup_steps and self.uses_engine:
            optim.restart_policy_adam(self.optimizer)  # the policy starts training next: a fresh Adam for it
        return metrics, problem

    def epochs(self, experience: Experience, critic_only: bool = False, iteration: int = 0) -> dict[str, float]:
        """``num_ppo_epochs`` passes over the rollout in ``num_mini_batches`` optimizer steps, each accumulated over
        its micro-batches (:meth:`accumulate_gradients`), then the critic alone up to ``num_critic_epochs``;
        ``critic_only`` trains the critic alone (§5.3.3). Returns the mean of every statistic."""
        args, stats = self.args, defaultdict(list)
        for epoch, minibatch in minibatches(args, experience.advantages.device):
            step_experience = experience
            if args.advantage_whitening_scope == "minibatch":
                step_experience = whitened_per_minibatch(experience, minibatch, self.whiten)
            # H is logged from the first epoch only unless it trains: a full pass over the vocabulary per token
            log_entropy = epoch == 0 or args.entropy_coef > 0
            critic_alone = critic_only or epoch >= args.num_ppo_epochs
            micro_stats = self.accumulate_gradients(step_experience, minibatch, critic_alone, log_entropy)
            for step_stats in [*micro_stats, self.optimizer_step(critic_alone, iteration)]:
                for name, value in step_stats.items():
                    stats[name].append(value)
        return mean_stats(stats, self.accelerator)

    def accumulate_gradients(
        self, experience: Experience, minibatch: torch.Tensor, critic_only: bool, log_entropy: bool = True
    ) -> list[dict[str, torch.Tensor]]:
        """Forward and backward of one minibatch's micro-batches
        (:func:`~trl_ppomax.ppo.batching.update_micro_batches`); returns each micro-batch's stats."""
        divisor = self.model.gradient_accumulation_steps() if self.uses_engine else None
        batches = update_micro_batches(experience.rollout, minibatch, self.args, self.accelerator, divisor)

        def loss_of(rows, loss_weights):
            return self.micro_batch_loss(experience, rows, critic_only, loss_weights, log_entropy)

        return accumulate(batches, loss_of, self.model, self.accelerator, self.args.gradient_accumulation_steps)

    def micro_batch_loss(
        self,
        experience: Experience,
        index: torch.Tensor,
        critic_only: bool,
        loss_weights: torch.Tensor | None = None,
        log_entropy: bool = True,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """PPO-max loss of micro-batch ``index`` (:func:`micro_batch_loss`), the next ptx batch included."""
        ptx = self.next_ptx_batch() if self.ptx_batches is not None else None
        return micro_batch_loss(self.model, experience, index, critic_only, self.args, ptx, loss_weights, log_entropy)

    def optimizer_step(self, critic_only: bool, iteration: int = 0) -> dict[str, torch.Tensor]:
        """:func:`~trl_ppomax.ppo.optim.optimizer_step`; a step skipped for a non-finite gradient is counted and
        logged."""
        stats = optim.optimizer_step(
            self.model, self.accelerator, self.optimizer, self.lr_scheduler, self.args, critic_only
        )
        if stats is None:
            self.ppo_state.counters[M.SKIPPED_UPDATES] += 1
            logger.warning("Optimizer step skipped at iteration %d: non-finite gradient.", iteration)
        return stats or {}

    def next_ptx_batch(self) -> dict[str, torch.Tensor]:
        """The next batch of the PPO-ptx stream, on this process's device (its position in ``ppo_state``)."""
        batch = self.ptx_batches[self.ppo_state.ptx_batches_used]
        self.ppo_state.ptx_batches_used += 1
        return {k: v.to(self.accelerator.device) for k, v in batch.items()}


def minibatches(args, device) -> Iterator[tuple[int, torch.Tensor]]:
    """``(epoch, rows)`` of every optimizer step: each epoch a fresh permutation of the process's rollout rows split
    into ``local_mini_batch_size`` rows."""
    for epoch in range(args.update_epochs):
        for rows in torch.randperm(args.local_batch_size, device=device).split(args.local_mini_batch_size):
            yield epoch, rows


def whitened_per_minibatch(experience: Experience, rows: torch.Tensor, whiten: Callable) -> Experience:
    """``experience`` with the advantages of ``rows`` whitened over the minibatch of every process (``whiten``,
    ``advantage_whitening_scope="minibatch"``, §5.3.1)."""
    advantages = experience.advantages.clone()
    advantages[rows] = whiten(experience.raw_advantages[rows], experience.rollout.policy_mask[rows])
    return dataclasses.replace(experience, advantages=advantages)


def accumulate(micro_batches: list, loss_of: Callable, model: nn.Module, accelerator, accumulation_steps: int):
    """Forward and backward of one minibatch's ``(rows, loss weights)`` micro-batches under ``accelerator.accumulate``
    (gradients synchronised at the last; ``backward`` divides by their count), ``loss_of(rows, weights) -> (loss,
    stats)``; returns each micro-batch's stats. The accelerator's accumulation count is restored afterwards."""
    accelerator.gradient_accumulation_steps, accelerator.step = len(micro_batches), 0  # sync after the last
    stats = []
    for rows, loss_weights in micro_batches:
        with accelerator.accumulate(model):
            loss, micro_stats = loss_of(rows, loss_weights)
            accelerator.backward(loss)
        stats.append(micro_stats)
    accelerator.gradient_accumulation_steps = accumulation_steps
    return stats


def mean_stats(stats: dict[str, list[torch.Tensor]], accelerator) -> dict[str, float]:
    """The mean of each statistic over its values (NaN ignored) and over the processes."""
    means = torch.stack([torch.stack(values).float().nanmean() for values in stats.values()])
    means = accelerator.reduce(means, reduction="mean") if accelerator.num_processes > 1 else means
    return dict(zip(stats.keys(), means.tolist(), strict=True))


def micro_batch_loss(
    model: nn.Module,
    experience: Experience,
    rows: torch.Tensor,
    critic_only: bool,
    args,
    ptx_inputs: dict | None = None,
    loss_weights: torch.Tensor | None = None,
    log_entropy: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-max loss of micro-batch ``rows``: clipped policy loss + vf_coef·clipped value loss (+ entropy, + ptx on
    ``ptx_inputs``); token means, or sums with ``loss_weights`` (B, T). ``model``: the prepared policy and critic
    (:class:`~trl_ppomax.models.PolicyAndCritic`). The entropy (a pass over the vocabulary) is computed when it
    trains or ``log_entropy``. Critic warm-up (``critic_only``) keeps the policy in the graph with zero weight (DDP
    needs every parameter used)."""
    rollout = experience.rollout.select(rows)
    width = max(int(rollout.response_mask.sum(1).max()), 1)  # trim padding to this micro-batch's longest
    responses, attended = rollout.response_ids[:, :width], rollout.response_mask[:, :width]
    mask = rollout.policy_mask[:, :width]  # the tokens trained on (a trajectory's environment tokens left out)
    weights = None if loss_weights is None else loss_weights[:, :width]
    queries = forward_queries(rollout.query_ids, rollout.query_mask, args)
    inputs = models.sequence_inputs(*queries, responses, attended)
    ptx_mask = ptx_inputs.pop("loss_mask", ptx_inputs["attention_mask"]) if ptx_inputs is not None else None
    trains_entropy = args.entropy_coef > 0  # else the entropy is logged (when asked) without a gradient
    options = dict(entropy=trains_entropy or log_entropy, entropy_grad=trains_entropy, **models.logprob_options(args))
    logprobs, entropy, values, ptx_logprobs = model(inputs, responses, ptx_inputs=ptx_inputs, **options)
    old, advantages = experience.old_logprobs[rows, :width], experience.advantages[rows, :width]
    if experience.policy_metrics is not None:  # old_logprobs_from_update: π_old is this very forward, detached
        old = logprobs.detach() * attended
        experience.old_logprobs[rows, :width] = old
    sampling = None if rollout.sampling_weights is None else rollout.sampling_weights[:, :width]
    policy_loss, stats = _policy_terms(logprobs, entropy, old, advantages, sampling, mask, weights, args)
    if args.kl_placement == "loss":
        ref = rollout.ref_logprobs[:, :width]
        weighted = old if args.kl_loss_importance_weighted else None
        kl = core.kl_loss(logprobs, ref, mask, args.kl_estimator, weights, clamp=args.kl_clamp, old_logprobs=weighted)
        policy_loss, stats[M.KL_LOSS] = policy_loss + args.kl_coef * kl, kl.detach()
    if ptx_logprobs is not None:
        ptx_loss, ptx_stats = core.next_token_loss(ptx_logprobs, ptx_mask[:, 1:])
        policy_loss = policy_loss + args.ptx_coef * ptx_loss
        stats.update({M.PTX_LOSS: ptx_loss.detach(), M.PTX_PERPLEXITY: ptx_stats["perplexity"]})
    if values is None:  # a critic-free estimator: the policy alone
        return policy_loss, stats
    old_values, returns = rollout.values[:, :width], experience.returns[rows, :width]
    vf_loss, vf_stats = core.clipped_value_loss(values, old_values, returns, mask, args.cliprange_value, weights)
    stats |= {M.VALUE_LOSS: vf_loss.detach(), M.VF_CLIPFRAC: vf_stats["clipfrac"], M.VALUE_ERROR: vf_stats["error"]}
    return (0.0 if critic_only else 1.0) * policy_loss + args.vf_coef * vf_loss, stats


def _policy_terms(logprobs, entropy, old, advantages, sampling, mask, weights, args) -> tuple[torch.Tensor, dict]:
    """The clipped surrogate (+ entropy_coef · the entropy term) and their stats; ``old``: log π_old, ``sampling``:
    the truncated importance weights of the sampler (or None)."""
    clip = dict(cliprange_high=args.cliprange_high, dual_clip=args.dual_clip, logratio_clamp=args.logratio_clamp)
    pg_loss, pg_stats = core.clipped_policy_loss(
        logprobs, old, advantages, mask, args.cliprange, sampling, weights, **clip
    )
    logged = {M.CLIPFRAC: "clipfrac", M.APPROXKL: "approxkl", M.RATIO: "ratio", M.RATIO_VAR: "ratio_var"}
    if args.dual_clip is not None:
        logged[M.CLIPFRAC_LOWER] = "clipfrac_lower"
    stats = {M.POLICY_LOSS: pg_loss.detach(), **{name: pg_stats[key] for name, key in logged.items()}}
    if entropy is None:
        return pg_loss, stats
    entropy_weights = weights if args.entropy_target is None else None  # |mean(H) − H*| is a token mean
    entropy_term, entropy_stats = core.entropy_loss(entropy, mask, args.entropy_target, entropy_weights)
    stats[M.ENTROPY] = entropy_stats["entropy"]
    return pg_loss + args.entropy_coef * entropy_term, stats
