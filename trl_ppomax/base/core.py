"""Pure tensor maths of PPO-max (Zheng et al., 2023, "Secrets of RLHF in Large Language Models Part I: PPO").

No trainer state lives here: every function takes tensors and plain numbers, returns new tensors and never edits its
inputs. Shapes use ``B`` for the batch and ``T`` for the response width. A ``mask`` is 1 (or True) on real response
tokens and 0 on padding. Cross-process statistics take an optional ``reduce`` callable that sums a tensor over all
processes (for example ``lambda t: accelerator.reduce(t, "sum")``); ``None`` means a single process."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from torch.utils.checkpoint import checkpoint

Reduce = Callable[[torch.Tensor], torch.Tensor]
KLEstimator = Literal["k1", "k2", "k3"]
RewardNorm = Literal["none", "running", "scale"]
LossAggregation = Literal[
    "token_mean", "minibatch_token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"
]


# -- Masked statistics -------------------------------------------------------------------------------------------------
def masked_sum_and_count(
    x: torch.Tensor, mask: torch.Tensor, reduce: Reduce | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Σ x·m, Σ m)`` over all elements (and over processes when ``reduce`` is given). Both are 0-d float64."""
    mask = torch.broadcast_to(mask, x.shape).bool()
    masked = torch.where(mask, x.to(torch.float64), 0.0)  # not x·m: inf or NaN on padding must not leak
    totals = torch.stack([masked.sum(), mask.sum().to(torch.float64)])
    totals = reduce(totals) if reduce is not None else totals
    return totals[0], totals[1]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, reduce: Reduce | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1: ``Σ x·m / Σ m`` (0-d, dtype of ``x``; NaN if the mask is empty)."""
    total, count = masked_sum_and_count(x, mask, reduce)
    return (total / count).to(x.dtype)


def masked_loss_mean(x: torch.Tensor, mask: torch.Tensor, loss_weights: torch.Tensor | None = None) -> torch.Tensor:
    """``Σ x·m / max(Σ m, 1)`` (0-d, dtype of ``x``): an empty mask (all samples dropped) gives 0 with a zero gradient,
    not NaN. With ``loss_weights`` (B, T): ``Σ x·w·m`` (:func:`row_split_loss_weights`)."""
    if loss_weights is not None:
        return masked_sum_and_count(x * loss_weights, mask)[0].to(x.dtype)
    total, count = masked_sum_and_count(x, mask)
    return (total / count.clamp(min=1)).to(x.dtype)


def row_split_loss_weights(
    mask: torch.Tensor,
    rows_per_micro_batch: int,
    aggregation: LossAggregation = "token_mean",
    response_length: int | None = None,
) -> torch.Tensor:
    """Per-token loss weights (B, T) of a minibatch's rows, in order, under the row split: G micro-batches of
    ``rows_per_micro_batch`` rows, each adding its ``aggregation`` of the token losses ÷ G (verl's
    ``loss_agg_mode``). With ``N_g`` the tokens, ``S_g`` the rows with tokens and ``R_g`` all the rows of row ``r``'s
    micro-batch and ``l_r`` its own tokens: ``token_mean`` ``w_rt = m_rt / (G·N_g)``; ``seq_mean_token_sum``
    ``m_rt / (G·S_g)``; ``seq_mean_token_mean`` ``m_rt / (G·S_g·l_r)`` (each count at least 1);
    ``seq_mean_token_sum_norm`` ``m_rt / (G·R_g·L)`` with the constant ``L = response_length`` (Dr. GRPO, TRL's
    ``loss_type="dr_grpo"``: the token sum ÷ (rows × max_completion_length), whatever the lengths);
    ``minibatch_token_mean`` ``m_rt / N`` with ``N`` the tokens of all the rows (TRL's ``loss_type="dapo"``: one
    token mean over the optimizer step's micro-batches). ``Σ w·ℓ`` over any grouping of the rows is the row split's
    loss."""
    if aggregation == "minibatch_token_mean":
        return mask / mask.sum().clamp(min=1)
    group = torch.arange(mask.shape[0], device=mask.device) // rows_per_micro_batch
    lengths = mask.sum(1).float()
    if aggregation == "seq_mean_token_sum_norm":
        if response_length is None:
            raise ValueError("row_split_loss_weights: 'seq_mean_token_sum_norm' needs the constant response_length.")
        counted = torch.full_like(lengths, float(response_length))  # every row counts, with tokens or not
    else:
        counted = lengths if aggregation == "token_mean" else (lengths > 0).float()
    totals = torch.zeros(int(group[-1]) + 1, device=mask.device).index_add_(0, group, counted)
    weights = mask * (1.0 / (len(totals) * totals.clamp(min=1)))[group, None]
    return weights / lengths.clamp(min=1)[:, None] if aggregation == "seq_mean_token_mean" else weights


def masked_var(
    x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, reduce: Reduce | None = None
) -> torch.Tensor:
    """Variance of ``x`` over masked positions, two-pass: ``Σ m·(x − μ)² / (n − 1)`` (``/ n`` when not unbiased);
    ``ValueError`` when ``unbiased`` and the mask holds fewer than two elements."""
    mean = masked_mean(x, mask, reduce)
    sq_dev, count = masked_sum_and_count((x - mean) ** 2, mask, reduce)
    if unbiased and count < 2:
        raise ValueError(f"masked_var(unbiased=True) needs at least 2 masked elements, got {int(count)}.")
    return (sq_dev / (count - 1 if unbiased else count)).to(x.dtype)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, reduce: Reduce | None = None, eps: float = 1e-8
) -> torch.Tensor:
    """``(x − μ) / sqrt(σ² + eps)`` with μ, σ² the masked (global when ``reduce``) mean and unbiased variance; with
    ``shift_mean=False``, ``+ μ`` afterwards. Masked-out positions are 0. Shapes: any, ``mask`` broadcastable to ``x``.
    With fewer than two masked elements (globally) there is no spread: masked positions come back centred (0) with
    ``shift_mean``, else unchanged (an all-dropped minibatch gives zeros, not an error)."""
    total, count = masked_sum_and_count(x, mask, reduce)
    if count < 2:
        return torch.zeros_like(x) if shift_mean else torch.where(torch.broadcast_to(mask, x.shape).bool(), x, 0)
    mean = (total / count).to(x.dtype)
    var = masked_var(x, mask, unbiased=True, reduce=reduce)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


# -- Running moments (reward normalisation, §5.3.1) --------------------------------------------------------------------
class RunningMoments:
    """Running mean and unbiased std of every value ever passed to :meth:`update` (float64 state).

    Batches are merged with the parallel-variance formula (Chan et al.): for the stored ``(n, μ, M2)`` and a batch
    ``(n_b, μ_b, M2_b)``, ``δ = μ_b − μ``, ``n' = n + n_b``, ``μ' = μ + δ·n_b/n'``, ``M2' = M2 + M2_b + δ²·n·n_b/n'``;
    ``std = sqrt(M2 / (n − 1))``. With ``reduce`` the batch moments are global, as one process seeing all data."""

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0.0, 0.0, 0.0

    @property
    def var(self) -> float:
        """Unbiased variance; 0 before two values were seen."""
        return self.m2 / (self.count - 1) if self.count > 1 else 0.0

    @property
    def std(self) -> float:
        """Unbiased standard deviation; 1 before two values were seen, so dividing by it is always safe."""
        return math.sqrt(self.var) if self.count > 1 else 1.0

    def update(self, values: torch.Tensor, reduce: Reduce | None = None) -> tuple[float, float]:
        """Merge ``values`` (any shape) into the running moments; returns the batch's ``(mean, std)`` (global)."""
        ones = torch.ones_like(values, dtype=torch.float64)
        total, batch_count = masked_sum_and_count(values, ones, reduce)
        batch_count = float(batch_count)
        if batch_count == 0:
            return float("nan"), float("nan")
        batch_mean = float(total) / batch_count
        batch_m2 = float(masked_sum_and_count((values.to(torch.float64) - batch_mean) ** 2, ones, reduce)[0])
        new_count = self.count + batch_count
        delta = batch_mean - self.mean
        self.mean += delta * batch_count / new_count
        self.m2 += batch_m2 + delta**2 * self.count * batch_count / new_count
        self.count = new_count
        batch_std = math.sqrt(batch_m2 / (batch_count - 1)) if batch_count > 1 else 0.0
        return batch_mean, batch_std

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = float(state["count"]), float(state["mean"]), float(state["m2"])

    def __repr__(self) -> str:
        return f"RunningMoments(count={self.count:g}, mean={self.mean:.6g}, std={self.std:.6g})"


# -- Log-probabilities, entropy, sequence lengths ----------------------------------------------------------------------
def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / temperature)[tokens]``: ``(B, T, V)``, ``(B, T)`` → ``(B, T)`` in float32, one row at a
    time (one ``(T, V)`` float32 copy at once)."""
    rows = []
    for row_logits, row_tokens in zip(logits, tokens, strict=True):
        row_logits = row_logits.float() / temperature
        picked = row_logits.gather(-1, row_tokens.unsqueeze(-1)).squeeze(-1)
        rows.append(picked - torch.logsumexp(row_logits, dim=-1))
    return torch.stack(rows)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-token entropy ``H = logsumexp(z) − Σ softmax(z)·z`` of ``z = logits / temperature``: ``(B, T, V)`` → ``(B, T)``."""
    rows = []
    for row_logits in logits:
        z = row_logits.float() / temperature
        p = torch.softmax(z, dim=-1)
        rows.append(torch.logsumexp(z, dim=-1) - torch.where(p > 0, p * z, 0.0).sum(-1))  # 0·(−inf) counts as 0
    return torch.stack(rows)


def _softmax_statistics(z: torch.Tensor, entropy: bool, scratch: torch.Tensor | None = None):
    """``(lse, H or None)`` (N,) of logits ``z`` (N, V): ``lse = logsumexp(z)`` (as ``torch.logsumexp``: the row's
    maximum taken out) and ``H = lse − Σ p·z`` (0·(−inf) counts as 0), through one (N, V) ``scratch`` (a new one if
    None)."""
    top = z.amax(-1, keepdim=True)
    top.masked_fill_(top.abs() == math.inf, 0.0)
    scratch = torch.sub(z, top, out=scratch).exp_()
    lse = scratch.sum(-1).log_().add_(top.squeeze(-1))
    ent = lse - torch.sub(z, lse.unsqueeze(-1), out=scratch).exp_().mul_(z).nansum(-1) if entropy else None
    return lse, ent


def _logit_gradient(log_p, tokens, ent, grad_logprobs, grad_entropy, temperature: float, scratch=None):
    """∂/∂z of ``Σ g_y·log p_y + Σ g_H·H`` with ``p = softmax(z / τ)``, written into ``log_p`` (N, V) (``z / τ −
    lse``): ``∂ log p_y / ∂z = (1[v = y] − p) / τ``, ``∂H / ∂z = −p·(log p + H) / τ``; ``scratch`` (N, V) holds p
    when the entropy has a gradient (a new one if None)."""
    if grad_entropy is None:  # −p·g_y
        grad = log_p.exp_().mul_(-grad_logprobs.unsqueeze(-1))
    else:  # −p·(log p + H)·g_H − p·g_y
        p = torch.exp(log_p, out=scratch)
        grad = log_p.add_(ent.unsqueeze(-1)).mul_(p).mul_(-grad_entropy.unsqueeze(-1))
        if grad_logprobs is not None:
            grad.sub_(p.mul_(grad_logprobs.unsqueeze(-1)))
    if grad_logprobs is not None:
        grad.scatter_add_(-1, tokens.unsqueeze(-1), grad_logprobs.unsqueeze(-1))
    return grad.div_(temperature) if temperature != 1.0 else grad


class _ChosenLogProb(torch.autograd.Function):
    """``log softmax(z / τ)[y]`` (N,) and the entropy ``H`` (N,) of ``softmax(z / τ)`` from logits ``z`` (N, V), with
    the gradient written out (:func:`_logit_gradient`). It saves the float32 logits and the two (N,) statistics; its
    backward needs at most two (N, V) buffers. Returns ``(log p_y, H or None, lse)``, ``lse = logsumexp(z / τ)``
    without a gradient; ``known = (lse, H)`` of these very logits (a recomputation) skips the reductions."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature: float, entropy: bool, entropy_grad: bool, known: tuple = ()):
        z = logits.float() / temperature if temperature != 1.0 else logits.float()
        if known:
            lse, ent = (None if t is None else t.clone() for t in known)
        else:
            lse, ent = _softmax_statistics(z, entropy)
        logprobs = z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse
        ctx.save_for_backward(z, tokens, lse, ent if entropy_grad else None)
        ctx.temperature, ctx.logits_dtype = temperature, logits.dtype
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse, *([ent] if ent is not None and not entropy_grad else []))
        return logprobs, ent, lse

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, _):
        z, tokens, lse, ent = ctx.saved_tensors
        grad = _logit_gradient(z - lse.unsqueeze(-1), tokens, ent, grad_logprobs, grad_entropy, ctx.temperature)
        return grad.to(ctx.logits_dtype), None, None, None, None, None


class _LinearHeadLogProbs(torch.autograd.Function):
    """:class:`_ChosenLogProb` through a linear head, ``z = (h Wᵀ + b) / τ`` for hidden states ``h`` (N, H), weight
    ``W`` (V, H) and bias ``b`` (V,) or None, ``chunk_size`` positions at a time and written out: the forward keeps
    ``lse`` and ``H`` (N,), the backward recomputes each chunk's logits and adds ``∂h = ∂z·W``, ``∂W += ∂zᵀ·h`` and
    ``∂b += Σ ∂z``. Every chunk goes through the same (c, V) buffers, allocated once per call (two in float32, one
    in the matmul's precision below it): :func:`token_logprobs` with a checkpoint per chunk, without allocating a
    chunk's logits, their gradient and ``∂W`` again for every chunk. The matmul runs at autocast's precision when
    autocast is on, as ``nn.Linear`` would. Returns ``(log p_y, H or None)`` (N,)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature: float, chunk_size: int, entropy, entropy_grad):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        logprobs = hidden.new_empty(len(hidden), dtype=torch.float32)
        lse, ent = torch.empty_like(logprobs), torch.empty_like(logprobs) if entropy else None
        with torch.autocast(device, enabled=False):
            head = _ChunkedLinear(hidden, weight, bias, dtype, chunk_size)
            for rows, z in head.logits(temperature):
                lse[rows], chunk_ent = _softmax_statistics(z, entropy, head.scratch[: len(z)])
                logprobs[rows] = z.gather(-1, tokens[rows].unsqueeze(-1)).squeeze(-1) - lse[rows]
                if entropy:
                    ent[rows] = chunk_ent
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, ent if entropy_grad else None)
        ctx.temperature, ctx.chunk_size, ctx.dtype = temperature, chunk_size, dtype
        ctx.set_materialize_grads(False)
        if entropy and not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logprobs, ent

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, tokens, lse, ent = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        if grad_logprobs is None and grad_entropy is None:
            return (None,) * 8
        with torch.autocast(hidden.device.type, enabled=False):
            head = _ChunkedLinear(hidden, weight, bias, ctx.dtype, ctx.chunk_size)
            grad_hidden = torch.empty_like(head.hidden) if needs_hidden else None
            grad_weight = torch.zeros_like(weight) if needs_weight else None
            grad_bias = torch.zeros_like(bias) if needs_bias else None
            low_weight_grad = None  # ∂W of a chunk at the matmul's precision when below the weight's (autocast)
            for rows, z in head.logits(ctx.temperature):
                ent_rows, lse_rows = None if ent is None else ent[rows], lse[rows].unsqueeze(-1)
                grad_y = None if grad_logprobs is None else grad_logprobs[rows]
                grad_h = None if grad_entropy is None else grad_entropy[rows]
                scratch = head.scratch[: len(z)]
                grad = _logit_gradient(
                    z.sub_(lse_rows), tokens[rows], ent_rows, grad_y, grad_h, ctx.temperature, scratch
                )
                grad = head.at_matmul_precision(grad)
                if needs_hidden:
                    torch.mm(grad, head.weight, out=grad_hidden[rows])
                if needs_weight and ctx.dtype == weight.dtype:
                    grad_weight.addmm_(grad.t(), head.hidden[rows])
                elif needs_weight:
                    low_weight_grad = torch.mm(grad.t(), head.hidden[rows], out=low_weight_grad)
                    grad_weight.add_(low_weight_grad)
                if needs_bias:
                    grad_bias.add_(grad.sum(0))
        grad_hidden = None if grad_hidden is None else grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


class _ChunkedLinear:
    """A linear head's logits ``z = (h Wᵀ + b) / τ`` (c, V) in float32, chunk by chunk through one reused buffer,
    the matmul at ``dtype`` (as ``F.linear`` of ``h``, ``W``, ``b`` cast to it); ``scratch`` (c, V) float32 is
    the callers' to use within a chunk."""

    def __init__(self, hidden, weight, bias, dtype: torch.dtype, chunk_size: int) -> None:
        self.hidden, self.weight = hidden.to(dtype), weight.to(dtype)
        self.bias = None if bias is None else bias.to(dtype)
        self.chunk_size = chunk_size
        shape = (min(chunk_size, len(hidden)), len(weight))
        self.z = hidden.new_empty(shape, dtype=torch.float32)
        self.scratch = torch.empty_like(self.z)
        self.low = None if dtype == torch.float32 else hidden.new_empty(shape, dtype=dtype)

    def logits(self, temperature: float):
        """``(rows, z)`` for each chunk of positions: a slice of them and its logits (a view of the buffer, valid
        until the next chunk)."""
        for start in range(0, len(self.hidden), self.chunk_size):
            rows = slice(start, start + self.chunk_size)
            h = self.hidden[rows]
            z = self.z[: len(h)]
            out = z if self.low is None else self.low[: len(h)]
            if self.bias is None:
                torch.mm(h, self.weight.t(), out=out)
            else:
                torch.addmm(self.bias, h, self.weight.t(), out=out)
            if self.low is not None:
                z.copy_(out)
            yield rows, z.div_(temperature) if temperature != 1.0 else z

    def at_matmul_precision(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` (c, V) float32 at the matmul's precision (in the low-precision buffer when below float32)."""
        return grad if self.low is None else self.low[: len(grad)].copy_(grad)


def _plain_linear(head) -> bool:
    """Whether calling ``head`` is ``F.linear`` with its own whole, local parameters and nothing more: an
    ``nn.Linear`` without hooks (ZeRO-3's gathering, accelerate's offload) nor a replaced ``forward``, its weight
    neither a partition (ZeRO-3) nor a DTensor shard."""
    return (
        type(head) is torch.nn.Linear
        and not (head._forward_hooks or head._forward_pre_hooks or "forward" in vars(head))
        and type(head.weight.data) is torch.Tensor
        and tuple(head.weight.shape) == (head.out_features, head.in_features)
    )


def token_logprobs(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``log softmax(head(h) / τ)[y]`` (B, T) of ``tokens`` (B, T) and, with ``entropy``, the entropy (B, T)
    of the same distribution, from ``hidden`` (B, T, H) and the LM ``head`` ((N, H) → (N, V) logits), in float32.

    With ``chunk_size`` the B·T positions go through the head ``chunk_size`` at a time and, under autograd, each chunk
    is recomputed in backward (``torch.utils.checkpoint``): at most one chunk's (c, V) logits are alive, instead of
    the whole (B, T, V) tensor. ``None``: one chunk, no recomputation. The values and gradients are the same either
    way. ``entropy_grad``: the entropy carries a gradient (it trains), else it comes back detached."""
    flat_hidden, flat_tokens = hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1)

    def chunk(h, y, kept: list):
        # a second call, the recomputation in backward, recomputes the logits alone: their reductions are kept
        logprobs, ent, lse = _ChosenLogProb.apply(head(h), y, temperature, entropy, entropy_grad, tuple(kept))
        if not kept:
            kept += [lse.detach(), None if ent is None else ent.detach()]
        return logprobs, ent

    size = chunk_size or max(len(flat_tokens), 1)
    recompute = chunk_size is not None and torch.is_grad_enabled() and len(flat_tokens) > size  # one chunk: as is
    if recompute and _plain_linear(head):  # the same, written out: the chunks share their buffers
        options = (temperature, size, entropy, entropy_grad)
        logprobs, ent = _LinearHeadLogProbs.apply(flat_hidden, head.weight, head.bias, flat_tokens, *options)
        return logprobs.view(tokens.shape), None if ent is None else ent.view(tokens.shape)
    parts = [
        checkpoint(chunk, h, y, [], use_reentrant=False) if recompute else chunk(h, y, [])
        for h, y in zip(flat_hidden.split(size), flat_tokens.split(size), strict=True)
    ]
    logprobs = torch.cat([lp for lp, _ in parts]).view(tokens.shape)
    return logprobs, torch.cat([ent for _, ent in parts]).view(tokens.shape) if entropy else None


@torch.no_grad()
def token_logprobs_at(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    tokens: torch.Tensor,
    temperatures: tuple[float, ...],
    chunk_size: int | None = None,
) -> list[torch.Tensor]:
    """:func:`token_logprobs` (B, T) at each of ``temperatures``, without a gradient, the head run once per chunk."""
    flat_hidden, flat_tokens = hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1)
    size = chunk_size or max(len(flat_tokens), 1)
    parts = [[] for _ in temperatures]
    for h, y in zip(flat_hidden.split(size), flat_tokens.split(size), strict=True):
        logits = head(h)
        for part, temperature in zip(parts, temperatures, strict=True):
            part.append(_ChosenLogProb.apply(logits, y, temperature, False, False)[0])
    return [torch.cat(part).view(tokens.shape) for part in parts]


def response_mask_from_stop(responses: torch.Tensor, stop_token_id: int | None) -> torch.Tensor:
    """Mask (B, T) of real response tokens: everything up to and including the first ``stop_token_id`` (every token
    with ``stop_token_id=None``)."""
    if stop_token_id is None:
        return torch.ones_like(responses, dtype=torch.bool)
    is_stop = responses == stop_token_id
    stops_before = torch.cumsum(is_stop.long(), dim=1) - is_stop.long()  # stop tokens strictly before t
    return stops_before == 0


def ends_with_stop(responses: torch.Tensor, mask: torch.Tensor, stop_token_id: int) -> torch.Tensor:
    """1.0 (B,) where the masked response (B, T) holds ``stop_token_id``, else 0.0."""
    return ((responses == stop_token_id) & mask.bool()).any(dim=1).float()


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index (B,) of the last 1 in each row of a mask (B, T), holes allowed (a multi-turn trajectory's policy tokens);
    0 for an empty row."""
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return ((mask.long() != 0) * positions).amax(dim=1).sub(1).clamp(min=0)


# -- Reward shaping (§5.3.1, §5.3.2) -----------------------------------------------------------------------------------
def normalize_scores(
    scores: torch.Tensor, mean: float, std: float, mode: RewardNorm, clip: float | None = None, eps: float = 1e-8
) -> torch.Tensor:
    """Reparameterise sequence scores (B,) with historical moments, then clip (§5.3.1, eq. 18): ``"running"``:
    ``r̃ = (r − μ_hist) / (σ_hist + eps)`` (PPO-max); ``"scale"``: ``r̃ = r / (σ_hist + eps)`` (no mean shift);
    ``"none"``: ``r̃ = r``. ``clip=δ`` then applies ``clip(r̃, −δ, δ)``; ``None`` leaves it unclipped."""
    scores = scores.clone()
    if mode == "running":
        scores = (scores - mean) / (std + eps)
    elif mode == "scale":
        scores = scores / (std + eps)
    elif mode != "none":
        raise ValueError(f"Unknown reward normalisation {mode!r}; use 'running', 'scale' or 'none'.")
    if clip is not None:
        scores = scores.clamp(-clip, clip)
    return scores


def _median(values: torch.Tensor) -> torch.Tensor:
    """The median of ``values`` (N,), the mean of the two middle values for an even N (``torch.median`` takes the
    lower one); NaN when N is 0 or a value is NaN."""
    if values.numel() == 0 or values.isnan().any():
        return values.new_tensor(float("nan"))
    ordered = values.sort().values
    n = ordered.numel()
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


def robust_location_scale(values: torch.Tensor) -> tuple[float, float]:
    """``(median, 1.4826·MAD)`` of ``values`` (N,): a location and scale that a few extreme values cannot move
    (1.4826·MAD is σ for normal data; true medians, :func:`_median`). With MAD = 0 the scale is the std."""
    values = values.detach().to(torch.float64).flatten()
    median = _median(values)
    scale = 1.4826 * _median((values - median).abs())
    if scale == 0:
        scale = values.std() if values.numel() > 1 else torch.zeros((), dtype=torch.float64)
    return float(median), float(scale)


def winsorize(scores: torch.Tensor, center: float, scale: float, k: float) -> torch.Tensor:
    """``clip(r, c − k·s, c + k·s)`` of scores (B,) (winsorising). On the raw score, before the running moments, it
    keeps heavy-tailed scores from inflating σ (beyond the paper: its clip acts after normalisation)."""
    return scores.clamp(center - k * scale, center + k * scale)


def bounded(x: torch.Tensor, bound: float | None) -> torch.Tensor:
    """``clamp(x, −b, b)`` (zero gradient outside), or ``x`` itself with ``bound=None``: the one place the optional
    numerical clamps act (``logratio_clamp`` on the policy's log-ratio, ``kl_clamp`` on the KL estimate)."""
    return x if bound is None else x.clamp(-bound, bound)


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k1", clamp: float | None = None
) -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from samples of π_θ (http://joschu.net/blog/kl-approx.html), (B, T):
    with ``r = log π_ref − log π_θ``, ``k1 = −r``, ``k2 = r²/2``, ``k3 = (eʳ − 1) − r``. ``clamp=c`` bounds the
    estimate to ``[−c, c]`` (OpenRLHF's ``compute_approx_kl``: 10 for every estimator; verl's ``low_var_kl``: k3);
    k3's ``r`` is first bounded to ``±(c + 1)``, where already ``k3 ≥ c``, so ``eʳ`` stays finite (and so does its
    gradient) without changing the clamped value."""
    logr = ref_logprobs - logprobs
    if estimator == "k1":
        kl = -logr
    elif estimator == "k2":
        kl = 0.5 * logr**2
    elif estimator == "k3":
        logr = bounded(logr, None if clamp is None else clamp + 1.0)
        kl = torch.expm1(logr) - logr
    else:
        raise ValueError(f"Unknown KL estimator {estimator!r}; use 'k1', 'k2' or 'k3'.")
    return bounded(kl, clamp)


def token_rewards(
    scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level rewards (§5.3.2, eq. 19): ``r_t = −η·KL_t`` on every real token, plus the sequence score at the
    **last real token** of each response. Shapes: ``scores`` (B,), ``kl`` and ``mask`` (B, T) right-padded. Returns
    ``(rewards, non_score_rewards)``, both (B, T) and 0 on padding."""
    mask = mask.to(kl.dtype)
    non_score = -kl_coef * kl * mask
    score_at_last = torch.zeros_like(non_score)
    score_at_last[torch.arange(len(scores), device=scores.device), last_token_index(mask)] = scores.to(non_score.dtype)
    return non_score + score_at_last * mask, non_score


# -- Advantages (§3.2.2, §5.3.1) ---------------------------------------------------------------------------------------
def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the tokens of ``mask``, (B, T) each: ``δ_t = r_t + γ·V_{t'} − V_t`` and
    ``A_t = δ_t + γλ·A_{t'}``, where ``t'`` is the next position of ``mask`` after ``t`` (``V_{t'} = A_{t'} = 0``
    past the last: no bootstrap past the end). ``R_t = A_t + V_t``; both outputs are 0 off ``mask``. A right-padded
    response has ``t' = t + 1``; a multi-turn trajectory's policy tokens skip the environment's (verl's multi-turn
    GAE: the value after an observation bootstraps across it). ``lam`` is one number or one per response, (B,)
    (:func:`length_adaptive_lam`)."""
    mask = mask.to(values.dtype)
    rewards, values = rewards * mask, values * mask
    lam = lam.to(values.dtype) if torch.is_tensor(lam) else lam
    next_value, next_advantage = values.new_zeros(len(values)), values.new_zeros(len(values))
    advantages = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages.append(advantage)
        here = mask[:, t].bool()  # off the mask, t' and its carry stay those of the next masked token
        next_value = torch.where(here, values[:, t], next_value)
        next_advantage = torch.where(here, advantage, next_advantage)
    advantages = torch.stack(advantages[::-1], dim=1) * mask
    return advantages, (advantages + values) * mask


def length_adaptive_lam(mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """The policy's GAE λ per response (B,) from its length ``l`` (real tokens of ``mask``, (B, T)):
    ``λ = clip(1 − 1/(α·l), 0, 1)`` (VAPO, arXiv 2504.05118, "length-adaptive GAE"): long responses bootstrap less.
    λ = 0.5 at ``l = 2/α`` (α = 0.05 there); ``l ≤ 1/α`` gives λ = 0 (one-step TD)."""
    lengths = mask.sum(dim=1).to(torch.float32).clamp(min=1.0)
    return (1.0 - 1.0 / (alpha * lengths)).clamp(0.0, 1.0)


def decoupled_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam_policy: float | torch.Tensor,
    lam_critic: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` (B, T) with separate λ for the two (decoupled GAE: VC-PPO, arXiv 2503.01491, and
    VAPO): the policy's advantages ``A^{λ_policy}``, the critic's targets ``R = A^{λ_critic} + V``. With
    ``λ_critic = 1`` the targets are the Monte-Carlo returns ``Σ_{k≥t} γ^{k−t} r_k``, unbiased by the critic's own
    errors. ``lam_critic=None`` uses ``lam_policy`` for both (plain GAE, :func:`compute_gae`)."""
    advantages, returns = compute_gae(rewards, values, mask, gamma, lam_policy)
    if lam_critic is not None:
        returns = compute_gae(rewards, values, mask, gamma, lam_critic)[1]
    return advantages, returns


def normalize_advantages(
    advantages: torch.Tensor,
    mask: torch.Tensor,
    whiten: bool = True,
    clip: float | None = None,
    reduce: Reduce | None = None,
) -> torch.Tensor:
    """Whiten advantages over the real tokens of the (global) batch, then optionally clip to ``[−c, c]`` (§5.3.1)."""
    if whiten:
        advantages = masked_whiten(advantages, mask, shift_mean=True, reduce=reduce)
    if clip is not None:
        advantages = advantages.clamp(-clip, clip)
    return advantages * mask


# -- Sampling: the nucleus (§6.1 top-p), importance weights of another sampler -----------------------------------------
def nucleus_threshold(probs: torch.Tensor, top_p: float, buckets: int = 1024, leading: int = 64) -> torch.Tensor:
    """The smallest probability nucleus (top-p) sampling keeps, per row: ``probs`` (..., V) → (...). Sorted
    descending as d₁ ≥ d₂ ≥ …, the nucleus is d₁ … d_K with ``K`` the last index whose preceding mass ``Σ_{i<K} d_i``
    is below ``top_p``, and every token tied with ``τ = d_K`` (what a full sort keeps; masses summed in float64).

    Without sorting the vocabulary: a row whose ``leading`` largest probabilities (``topk``) hold ``top_p`` has its
    ``K`` among them (a trained policy's row, nearly always). The other rows' τ is the smallest probability ``t`` with
    ``Σ_{p>t} p < top_p``: their range is cut into ``buckets`` bands (one scatter of the masses), the band holding τ
    is found from the masses above each band, and only that band's tokens are sorted (cut again while it holds more
    than 256)."""
    shape, vocab = probs.shape[:-1], probs.shape[-1]
    rows = probs.reshape(-1, vocab)
    top = rows.topk(min(leading, vocab), dim=-1).values  # descending
    mass = top.double()
    before = mass.cumsum(-1) - mass
    threshold = top.gather(-1, (before < top_p).sum(-1, keepdim=True) - 1).squeeze(-1)
    beyond = (before[:, -1] + mass[:, -1] < top_p).nonzero().squeeze(-1)  # rows whose nucleus is wider than the top
    if len(beyond):
        threshold[beyond] = _threshold_by_bands(rows[beyond], top_p, buckets)
    return threshold.reshape(shape)


def _threshold_by_bands(rows: torch.Tensor, top_p: float, buckets: int) -> torch.Tensor:
    """:func:`nucleus_threshold` of rows (N, V) by value bands (:func:`_nucleus_band`), the band's tokens sorted."""
    band, above = _nucleus_band(rows, top_p, buckets)
    row, column = band.nonzero(as_tuple=True)
    values = rows[row, column]
    order = values.argsort(descending=True, stable=True)
    order = order[row[order].argsort(stable=True)]  # by row, then descending
    row, values = row[order], values[order]
    before = values.double().cumsum(0) - values.double()
    counts = torch.bincount(row, minlength=len(rows))
    first = counts.cumsum(0) - counts  # each row's first band entry
    kept = above[row] + before - before[first][row] < top_p
    threshold = torch.full((len(rows),), float("inf"), dtype=rows.dtype, device=rows.device)
    return threshold.scatter_reduce_(0, row[kept], values[kept], reduce="amin")


def _nucleus_band(rows: torch.Tensor, top_p: float, buckets: int, rounds: int = 3, most: int = 256):
    """The tokens of each row (N, V) in the value band holding its nucleus threshold (a (N, V) mask) and the float64
    mass of the row's tokens above the band (N,): the band is the lowest non-empty one whose mass above is below
    ``top_p``; every token above it is in the nucleus. Band indices are monotone in ``p``, so ties share a band."""
    mass_of = rows.double()
    low = torch.zeros(len(rows), 1, dtype=rows.dtype, device=rows.device)
    high = rows.amax(-1, keepdim=True)
    above = torch.zeros(len(rows), 1, dtype=torch.float64, device=rows.device)
    band, order = None, torch.arange(buckets, device=rows.device)
    for _ in range(rounds):
        scale = buckets / (high - low).clamp_min(torch.finfo(rows.dtype).tiny)
        index = ((rows - low) * scale).clamp_(0, buckets - 1).long()
        weights = mass_of if band is None else mass_of * band
        mass = torch.zeros(len(rows), buckets, dtype=torch.float64, device=rows.device).scatter_add_(1, index, weights)
        above_each = above + mass.flip(-1).cumsum(-1).flip(-1) - mass
        chosen = torch.where((above_each < top_p) & (mass > 0), order, buckets).amin(-1, keepdim=True)
        above = above_each.gather(-1, chosen)
        band = index == chosen if band is None else band & (index == chosen)
        low, high = low + chosen / scale, low + (chosen + 1) / scale
        if band.sum(-1).max() <= most:
            break
    return band, above.squeeze(-1)


def nucleus_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """log-probs (B, T) of ``tokens`` under the nucleus-sampling distribution of ``logits`` (B, T, V): softmax at
    ``temperature``, renormalised over the nucleus (:func:`nucleus_threshold`):
    ``log p_T(y) − log Σ_{v ∈ nucleus} p_T(v)`` (what a sampler with top-p reports as its log-prob)."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if top_p >= 1.0:
        return chosen
    probs = logprobs.exp()
    threshold = nucleus_threshold(probs, top_p)
    return chosen - torch.log((probs * (probs >= threshold.unsqueeze(-1))).sum(-1))


def truncated_importance_weights(
    logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance weights ``w_t = min(exp(log π(y_t) − log q(y_t)), cap)`` (B, T) of the distribution the
    update assumes (``logprobs``) over the one that sampled (``sampler_logprobs``, e.g. vLLM's); 1 outside ``mask``.
    They multiply the per-token policy loss (TRL GRPO's ``token_truncate``)."""
    weights = torch.exp(logprobs - sampler_logprobs).clamp(max=cap)
    return torch.where(mask.bool(), weights, torch.ones_like(weights))


# -- Losses (§3.2.3, App. B.3): (loss, 0-d detached stats); an empty mask gives a zero loss and gradient, NaN stats --
def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float | None,
    weights: torch.Tensor | None = None,
    loss_weights: torch.Tensor | None = None,
    cliprange_high: float | None = None,
    dual_clip: float | None = None,
    logratio_clamp: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO surrogate: masked mean of ``max(−A·ρ, −A·clip(ρ, 1−ε, 1+ε_high))`` with ``ρ = exp(log π_θ − log π_old)``
    and ``ε_high = cliprange_high`` (DAPO's clip-higher, arXiv 2503.14476; None: ε), each token's term times
    ``weights`` (B, T) when given (:func:`truncated_importance_weights`); with ``loss_weights`` the weighted sum
    instead of the mean (:func:`row_split_loss_weights`). ``dual_clip`` c > 1 bounds the loss of a negative advantage
    by ``−c·A`` (dual-clip PPO, arXiv 1912.09729; verl's ``clip_ratio_c``). ``logratio_clamp`` b bounds
    ``log ρ`` to ``[−b, b]`` before the exponential (verl's 20: ``ρ ≤ e²⁰``, and no gradient beyond); the stats
    describe the unclamped ratio.

    ``cliprange=None`` gives the unclipped policy gradient ``−A·ρ``. Inputs (B, T). Stats: ``clipfrac`` (share of
    tokens where the clipped term is taken), ``clipfrac_lower`` (share where the dual clip is), ``approxkl``
    (``½·mean((log ρ)²)``), ``ratio`` and ``ratio_var``."""
    logratio = logprobs - old_logprobs
    ratio = torch.exp(bounded(logratio, logratio_clamp))
    pg_losses = -advantages * ratio
    if cliprange is None:
        pg_max, clipped = pg_losses, torch.zeros_like(pg_losses)
    else:
        high = cliprange if cliprange_high is None else cliprange_high
        pg_losses_clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + high)
        pg_max = torch.max(pg_losses, pg_losses_clipped)
        clipped = (pg_losses_clipped > pg_losses).to(pg_losses.dtype)
    dual_clipped = torch.zeros_like(pg_losses)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_clipped = ((advantages < 0) & (pg_max > bound)).to(pg_losses.dtype)
        pg_max = torch.where(advantages < 0, torch.min(pg_max, bound), pg_max)
    loss = masked_loss_mean(pg_max if weights is None else pg_max * weights, mask, loss_weights)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean(clipped, mask),
            "clipfrac_lower": masked_mean(dual_clipped, mask),
            "approxkl": 0.5 * masked_mean(logratio**2, mask),
            "ratio": masked_mean(torch.exp(logratio), mask),
            "ratio_var": masked_var(torch.exp(logratio), mask, unbiased=False),
        }
    return loss, stats


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    estimator: KLEstimator,
    loss_weights: torch.Tensor | None = None,
    clamp: float | None = None,
    old_logprobs: torch.Tensor | None = None,
) -> torch.Tensor:
    """KL to the reference as a loss term (verl's ``use_kl_loss``, OpenRLHF's ``--algo.kl.use_loss``): the masked
    mean (or ``loss_weights`` sum) of :func:`kl_penalty` of the current log-probs (B, T) (bounded by ``clamp``),
    with gradient; with ``old_logprobs`` each token's term times ``ρ = exp(log π − log π_old)`` (TRL GRPO's
    ``use_bias_correction_kl``: 1 on-policy, but its gradient adds ``KL·∇log π``). k2's gradient equals k1-in-the-reward's on-policy; k3's (GRPO's) is biased (arXiv 2510.01555);
    k1's is zero in expectation on-policy (``E[∇ log π] = 0``)."""
    kl = kl_penalty(logprobs, ref_logprobs, estimator, clamp)
    if old_logprobs is not None:
        kl = kl * torch.exp(logprobs - old_logprobs)
    return masked_loss_mean(kl, mask, loss_weights)


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float | None,
    loss_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped critic loss: masked mean (or ``loss_weights`` sum) of
    ``½·max((V − R)², (clip(V, V_old − ε, V_old + ε) − R)²)``; ``cliprange_value=None`` gives ``½·(V − R)²``.
    Inputs (B, T). Stats: ``clipfrac``, ``values`` and ``error`` (unclipped ``mean((V − R)²)``)."""
    unclipped = (values - returns) ** 2
    if cliprange_value is None:
        worst, clipped = unclipped, torch.zeros_like(unclipped)
    else:
        values_clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
        clipped_losses = (values_clipped - returns) ** 2
        worst = torch.max(unclipped, clipped_losses)
        clipped = (clipped_losses > unclipped).to(values.dtype)
    loss = 0.5 * masked_loss_mean(worst, mask, loss_weights)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean(clipped, mask),
            "values": masked_mean(values, mask),
            "error": masked_mean(unclipped, mask),
        }
    return loss, stats


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, reduce: Reduce | None = None):
    """``1 − Var(R − V) / Var(R)`` over the real tokens (B, T) of every process (0-d; NaN when the returns do not
    vary): 1 is a perfect critic, 0 one no better than the mean return, below 0 worse (CleanRL's
    ``explained_variance``)."""
    residual = masked_var(returns - values, mask, unbiased=False, reduce=reduce)
    spread = masked_var(returns, mask, unbiased=False, reduce=reduce)
    return 1.0 - residual / spread


def entropy_loss(
    entropy: torch.Tensor, mask: torch.Tensor, target: float | None = None, loss_weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Entropy regulariser to be *added* to the loss (App. B.3), from per-token entropy (B, T). ``target=None``: the
    plain bonus ``−mean(H)`` (``−Σ w·H`` with ``loss_weights``). ``target=H*``: the release's clipped form
    ``|mean(H) − H*|``, pulling entropy towards ``H*`` instead of growing it without bound (no ``loss_weights``)."""
    if target is not None and loss_weights is not None:
        raise ValueError("entropy_loss: an entropy target |mean(H) − H*| cannot be split into per-token weights.")
    mean_entropy = masked_loss_mean(entropy, mask, loss_weights)
    loss = -mean_entropy if target is None else (mean_entropy - target).abs()
    return loss, {"entropy": masked_mean(entropy.detach(), mask)}


def lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Next-token cross-entropy (PPO-ptx §3.2.3 eq. 17; the reward model's imitation loss §3.1 eq. 2): logits
    (B, L, V) at position ``i`` predict ``labels[:, i+1]``; ``mask`` (B, L) marks the label tokens that count.
    Stats: ``perplexity`` = ``exp(loss)`` and ``accuracy`` (share of label tokens that are the argmax)."""
    loss, stats = next_token_loss(logprobs_from_logits(logits[:, :-1], labels[:, 1:]), mask[:, 1:])
    with torch.no_grad():
        correct = (logits[:, :-1].argmax(-1) == labels[:, 1:]).float()
        stats["accuracy"] = masked_mean(correct, mask[:, 1:])
    return loss, stats


def next_token_loss(logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The cross-entropy of :func:`lm_loss` from the label tokens' log-probs (B, L − 1) and their ``mask``:
    ``−mean(log p)``, with ``perplexity`` = ``exp(loss)``."""
    loss = -masked_mean(logprobs, mask)
    return loss, {"perplexity": torch.exp(loss.detach())}


def sequence_perplexity(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence perplexity ``exp(−mean_t log p(y_t))`` over real tokens: (B, T) → (B,)."""
    mask = mask.to(logprobs.dtype)
    mean_logprob = (logprobs * mask).sum(1) / mask.sum(1).clamp(min=1)
    return torch.exp(-mean_logprob)
