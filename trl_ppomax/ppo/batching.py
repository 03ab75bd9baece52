"""Batching mechanics below the iteration: rows packed under a token budget, every process running as many forwards
and backwards as the busiest, and the micro-batches of an update step with the row split's loss weights."""

from __future__ import annotations

import math

import torch

from trl_ppomax.base import core


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
        longest = (max(longest[0], queries[i]), max(longest[1], responses[i]))
        if not batches or (len(batches[-1]) + 1) * sum(longest) > budget:
            batches.append([])
            longest = (queries[i], responses[i])
        batches[-1].append(i)
    return [torch.tensor(batch, dtype=torch.long, device=query_lengths.device) for batch in batches]


def forward_groups(query_mask: torch.Tensor, response_mask: torch.Tensor, args, accelerator):
    """Row indices of the no-grad forward micro-batches, and how many forwards every process runs: packed under
    ``max_tokens_per_microbatch`` (:func:`token_budget_groups`), else consecutive ``local_rollout_forward_batch_size``
    rows."""
    if args.max_tokens_per_microbatch is not None:
        return token_budget_groups(query_mask, response_mask, args.max_tokens_per_microbatch, accelerator)
    rows = torch.arange(len(query_mask), device=query_mask.device)
    groups = list(rows.split(args.local_rollout_forward_batch_size))
    return groups, len(groups)


def token_budget_groups(query_mask, response_mask, budget: int, accelerator) -> tuple[list[torch.Tensor], int]:
    """The rows packed under ``budget`` (:func:`token_budget_batches`), and the most packs any process has: all must
    run as many forwards (ZeRO-3 gathers parameters in each) and backwards (ZeRO reduces at every micro-step)."""
    groups = token_budget_batches(query_mask.sum(1), response_mask.sum(1), budget)
    if accelerator.num_processes == 1:
        return groups, len(groups)
    return groups, int(accelerator.gather(torch.tensor([len(groups)], device=query_mask.device)).max())


def update_micro_batches(rollout, minibatch: torch.Tensor, args, accelerator, engine_divisor: int | None) -> list:
    """``(rows, loss weights)`` of one update step's micro-batches: ``per_device_train_batch_size`` rows each (weights
    None: token means; else the ``loss_aggregation``'s, :func:`core.row_split_loss_weights`), or packed by length
    under ``max_tokens_per_microbatch`` with the row split's weights times the divisor ``backward`` applies
    (``engine_divisor``, DeepSpeed's accumulation steps, else the count), which leaves the gradients unchanged; every
    process gets as many as the busiest (repeating a row with zero weight)."""
    aggregation, rows_each = args.loss_aggregation, args.per_device_train_batch_size
    length = args.response_length  # seq_mean_token_sum_norm's constant
    if args.max_tokens_per_microbatch is None:
        if aggregation == "token_mean":
            return [(rows, None) for rows in minibatch.split(rows_each)]
        mask = rollout.policy_mask
        if aggregation == "minibatch_token_mean":  # one normaliser for the step; backward divides each by their count
            count = math.ceil(len(minibatch) / rows_each)
            weights = core.row_split_loss_weights(mask[minibatch], rows_each, aggregation, length) * count
            return list(zip(minibatch.split(rows_each), weights.split(rows_each), strict=True))
        return [
            (rows, core.row_split_loss_weights(mask[rows], len(rows), aggregation, length))
            for rows in minibatch.split(rows_each)
        ]
    budget = args.max_tokens_per_microbatch
    groups, count = token_budget_groups(
        rollout.query_mask[minibatch], rollout.response_mask[minibatch], budget, accelerator
    )
    weights = core.row_split_loss_weights(rollout.policy_mask[minibatch], rows_each, aggregation, length).float()
    micro_batches = [(minibatch[g], weights[g] * (engine_divisor or count)) for g in groups]
    idle = (minibatch[:1], torch.zeros_like(weights[:1]))
    return micro_batches + [idle] * (count - len(groups))


def forward_queries(query_ids: torch.Tensor, query_mask: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's left-padded prompts (B, L) as its forwards see them: under a token budget, without the columns
    that are padding in every row."""
    if args.max_tokens_per_microbatch is None:
        return query_ids, query_mask
    width = max(int(query_mask.sum(1).max()), 1)
    return query_ids[:, -width:], query_mask[:, -width:]
