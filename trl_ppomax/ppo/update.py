"""Phase 3 of an iteration, the PPO update (§3.2): ``num_ppo_epochs`` passes over the rollout in ``num_mini_batches``
optimizer steps, each accumulated over micro-batches, and the PPO-max loss of one micro-batch (maths in ``core``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch
from torch import nn
from trl.trainer.utils import selective_log_softmax, selective_log_softmax_and_entropy

from trl_ppomax import models
from trl_ppomax.base import core
from trl_ppomax.base import metrics as M
from trl_ppomax.ppo.batching import forward_queries
from trl_ppomax.ppo.experience import Experience


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
    logits, values, ptx_logits = model(inputs, width, ptx_inputs=ptx_inputs)
    logprobs, entropy = _logprobs_and_entropy(logits, responses, args, log_entropy)
    old, advantages = experience.old_logprobs[rows, :width], experience.advantages[rows, :width]
    sampling = None if rollout.sampling_weights is None else rollout.sampling_weights[:, :width]
    policy_loss, stats = _policy_terms(logprobs, entropy, old, advantages, sampling, mask, weights, args)
    if args.kl_placement == "loss":
        ref = rollout.ref_logprobs[:, :width]
        weighted = old if args.kl_loss_importance_weighted else None
        kl = core.kl_loss(logprobs, ref, mask, args.kl_estimator, weights, clamp=args.kl_clamp, old_logprobs=weighted)
        policy_loss, stats[M.KL_LOSS] = policy_loss + args.kl_coef * kl, kl.detach()
    if ptx_logits is not None:
        ptx_loss, ptx_stats = core.lm_loss(ptx_logits, ptx_inputs["input_ids"], ptx_mask)
        policy_loss = policy_loss + args.ptx_coef * ptx_loss
        stats.update({M.PTX_LOSS: ptx_loss.detach(), M.PTX_PERPLEXITY: ptx_stats["perplexity"]})
    if values is None:  # a critic-free estimator: the policy alone
        return policy_loss, stats
    old_values, returns = rollout.values[:, :width], experience.returns[rows, :width]
    vf_loss, vf_stats = core.clipped_value_loss(values, old_values, returns, mask, args.cliprange_value, weights)
    stats |= {M.VALUE_LOSS: vf_loss.detach(), M.VF_CLIPFRAC: vf_stats["clipfrac"], M.VALUE_ERROR: vf_stats["error"]}
    return (0.0 if critic_only else 1.0) * policy_loss + args.vf_coef * vf_loss, stats


def _logprobs_and_entropy(logits, responses, args, log_entropy: bool):
    """log π (B, T) at the log-prob temperature, and the entropy (B, T) in the same pass when it trains or is logged
    (else None)."""
    temperature, trains_entropy = args.effective_logprob_temperature, args.entropy_coef > 0
    if trains_entropy or log_entropy:
        return selective_log_softmax_and_entropy(
            logits, responses, entropy_requires_grad=trains_entropy, temperature=temperature
        )
    return selective_log_softmax(logits, responses, temperature=temperature), None


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
