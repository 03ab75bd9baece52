"""Unit tests for ``trl_ppomax.base.core``: hand-computed tensors for every function, plus invariants.

Expected values are written out by hand or computed with plain-Python float loops in the test; the function under
test never produces its own expectation. Cross-process statistics are tested by running two simulated "processes"
in threads whose ``reduce`` is a real all-reduce (sum) over both ranks.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from helpers import run_distributed

from trl_ppomax.base import core
from trl_ppomax.base.core import (
    RunningMoments,
    clipped_policy_loss,
    clipped_value_loss,
    compute_gae,
    ends_with_stop,
    entropy_from_logits,
    entropy_loss,
    kl_penalty,
    last_token_index,
    lm_loss,
    logprobs_from_logits,
    masked_mean,
    masked_sum_and_count,
    masked_var,
    masked_whiten,
    next_token_loss,
    normalize_advantages,
    normalize_scores,
    response_mask_from_stop,
    sequence_perplexity,
    token_logprobs,
    token_logprobs_at,
    token_rewards,
)

F64 = torch.float64


def t64(data) -> torch.Tensor:
    return torch.tensor(data, dtype=F64)


def assert_close(actual, expected, atol: float = 1e-9, rtol: float = 1e-7) -> None:
    actual = torch.as_tensor(actual, dtype=F64)
    expected = torch.as_tensor(expected, dtype=F64)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def test_run_distributed_helper_sums_over_ranks():
    out = run_distributed(lambda r: r(t64([1.0, 2.0])), lambda r: r(t64([10.0, 20.0])))
    assert_close(out[0], [11.0, 22.0])
    assert_close(out[1], [11.0, 22.0])


# Two shards of different shapes (processes may hold different B and T); valid values are listed explicitly.
X_A = t64([[1.0, 2.0, 100.0], [4.0, -50.0, -7.0]])
M_A = torch.tensor([[1, 1, 0], [1, 0, 1]])
VALID_A = [1.0, 2.0, 4.0, -7.0]
X_B = t64([[0.5, 3.0, 8.0, 1e3, 1e3], [2.0, 2.0, 9.0, 9.0, -1e3]])
M_B = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
VALID_B = [0.5, 3.0, 8.0, 2.0, 2.0, 9.0, 9.0]


def py_mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def py_var(xs: list[float], unbiased: bool = True) -> float:
    mu = py_mean(xs)
    return sum((x - mu) ** 2 for x in xs) / (len(xs) - (1 if unbiased else 0))


# --------------------------------------------------------------------------------------------------------------------
# masked_sum_and_count / masked_mean / masked_var / masked_whiten
# --------------------------------------------------------------------------------------------------------------------
def test_masked_sum_and_count_hand_values():
    total, count = masked_sum_and_count(X_A, M_A)
    assert total.dtype == F64 and count.dtype == F64
    assert total.dim() == 0 and count.dim() == 0
    assert_close(total, 1.0 + 2.0 + 4.0 - 7.0)
    assert_close(count, 4.0)


def test_masked_sum_and_count_float32_input_accumulates_in_float64():
    x = torch.tensor([1.0, 1e-8, 1e-8], dtype=torch.float32)
    total, _ = masked_sum_and_count(x, torch.ones(3))
    assert total.dtype == F64
    assert_close(total, 1.0 + 2 * float(torch.tensor(1e-8, dtype=torch.float32)), atol=1e-15)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.long, torch.float32])
def test_masked_mean_hand_value(mask_dtype):
    x = t64([[1.0, 2.0, 3.0, 99.0], [5.0, 99.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]]).to(mask_dtype)
    assert_close(masked_mean(x, mask), (1.0 + 2.0 + 3.0 + 5.0) / 4)


def test_masked_mean_keeps_input_dtype():
    x = torch.tensor([[1.0, 2.0]], dtype=torch.float32)
    out = masked_mean(x, torch.ones(1, 2))
    assert out.dtype == torch.float32
    assert out.dim() == 0


def test_masked_mean_empty_mask_is_nan():
    assert torch.isnan(masked_mean(t64([1.0, 2.0]), torch.zeros(2)))


@pytest.mark.parametrize("unbiased", [True, False])
def test_masked_var_hand_value(unbiased):
    x = t64([[1.0, 2.0, 3.0, 99.0], [5.0, -99.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    # mean = 11/4 = 2.75; squared deviations 3.0625 + 0.5625 + 0.0625 + 5.0625 = 8.75
    expected = 8.75 / 3 if unbiased else 8.75 / 4
    assert_close(masked_var(x, mask, unbiased=unbiased), expected)
    assert_close(expected, py_var([1.0, 2.0, 3.0, 5.0], unbiased))


def test_masked_var_matches_torch_var():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, generator=gen, dtype=F64)
    mask = torch.rand(3, 7, generator=gen) > 0.3
    assert_close(masked_var(x, mask), torch.var(x[mask], unbiased=True))
    assert_close(masked_var(x, mask, unbiased=False), torch.var(x[mask], unbiased=False))


@pytest.mark.parametrize("n_valid", [0, 1])
def test_masked_var_unbiased_needs_two_elements(n_valid):
    x = t64([3.0, 4.0, 5.0])
    mask = torch.tensor([1, 0, 0]) if n_valid else torch.zeros(3)
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(x, mask, unbiased=True)


def test_masked_var_biased_single_element_is_zero():
    assert_close(masked_var(t64([3.0, 4.0, 5.0]), torch.tensor([0, 1, 0]), unbiased=False), 0.0)


def test_masked_var_exactly_two_elements():
    assert_close(masked_var(t64([3.0, 7.0, 100.0]), torch.tensor([1, 1, 0])), 8.0)  # (4 + 4) / 1


def test_masked_whiten_hand_values():
    x = t64([[1.0, 2.0, 3.0, 50.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # mean 2, unbiased var 1
    scale = 1.0 / math.sqrt(1.0 + 1e-8)
    assert_close(masked_whiten(x, mask), [[-scale, 0.0, scale, 0.0]])
    assert_close(masked_whiten(x, mask, shift_mean=False), [[-scale + 2.0, 2.0, scale + 2.0, 0.0]])
    assert_close(masked_whiten(x, mask, eps=3.0), [[-0.5, 0.0, 0.5, 0.0]])


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_moments_on_valid_tokens(shift_mean):
    gen = torch.Generator().manual_seed(1)
    x = 3.0 + 5.0 * torch.randn(4, 9, generator=gen, dtype=F64)
    mask = torch.ones(4, 9, dtype=torch.bool)
    mask[0, 5:] = False
    mask[2, 1:] = False
    x_padded = x.masked_fill(~mask, 1e6)  # garbage on padding must not matter
    out = masked_whiten(x_padded, mask, shift_mean=shift_mean)
    valid = out[mask]
    expected_mean = 0.0 if shift_mean else py_mean(x[mask].tolist())
    assert_close(valid.mean(), expected_mean, atol=1e-9)
    assert_close(valid.std(unbiased=True), 1.0, atol=1e-7)
    assert torch.all(out[~mask] == 0)


def test_masked_whiten_float32():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    out = masked_whiten(x, torch.ones(1, 4))
    assert out.dtype == torch.float32
    s = math.sqrt(py_var([1.0, 2.0, 3.0, 4.0]))
    assert_close(out, [[(v - 2.5) / s for v in (1.0, 2.0, 3.0, 4.0)]], atol=1e-6, rtol=1e-5)


def test_masked_statistics_with_broadcast_mask():
    x = t64([[1.0, 2.0, 3.0], [10.0, 20.0, 30.0]])
    row_mask = torch.tensor([[1], [0]])  # (B, 1): keep row 0 only
    assert_close(masked_mean(x, row_mask), 2.0)
    assert_close(masked_whiten(x, row_mask), [[-1.0, 0.0, 1.0], [0.0, 0.0, 0.0]], atol=1e-7)


# -- injected reduce: two shards behave like their concatenation -----------------------------------------------------
def test_masked_mean_with_closure_reduce_adds_other_shard():
    def reduce_a(t: torch.Tensor) -> torch.Tensor:  # shard A's view of an all-reduce over {A, B}
        return t + torch.stack(masked_sum_and_count(X_B, M_B))

    assert_close(masked_mean(X_A, M_A, reduce=reduce_a), py_mean(VALID_A + VALID_B))
    total, count = masked_sum_and_count(X_A, M_A, reduce=reduce_a)
    assert_close(total, sum(VALID_A + VALID_B))
    assert_close(count, len(VALID_A + VALID_B))


def test_masked_mean_and_var_global_over_two_processes():
    union = VALID_A + VALID_B

    def stats(x, m):
        return lambda reduce: (
            masked_mean(x, m, reduce=reduce),
            masked_var(x, m, unbiased=True, reduce=reduce),
            masked_var(x, m, unbiased=False, reduce=reduce),
        )

    for mean, var_u, var_b in run_distributed(stats(X_A, M_A), stats(X_B, M_B)):
        assert_close(mean, py_mean(union))
        assert_close(var_u, py_var(union, unbiased=True))
        assert_close(var_b, py_var(union, unbiased=False))
    # the global answer differs from the local one, so the reduce really mattered
    assert not math.isclose(float(masked_mean(X_A, M_A)), py_mean(union))


def test_masked_var_global_count_decides_the_error():
    # each shard has only one valid element, the union has two: no error, and the global variance
    x_a, m_a = t64([1.0, 9.0]), torch.tensor([1, 0])
    x_b, m_b = t64([3.0]), torch.tensor([1])
    out = run_distributed(lambda r: masked_var(x_a, m_a, reduce=r), lambda r: masked_var(x_b, m_b, reduce=r))
    assert_close(out[0], 2.0)
    assert_close(out[1], 2.0)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_global_over_two_processes(shift_mean):
    out_a, out_b = run_distributed(
        lambda r: masked_whiten(X_A, M_A, shift_mean=shift_mean, reduce=r),
        lambda r: masked_whiten(X_B, M_B, shift_mean=shift_mean, reduce=r),
    )
    union = VALID_A + VALID_B
    mu, sd = py_mean(union), math.sqrt(py_var(union) + 1e-8)
    shift = 0.0 if shift_mean else mu
    assert_close(out_a[M_A.bool()], [(v - mu) / sd + shift for v in VALID_A])
    assert_close(out_b[M_B.bool()], [(v - mu) / sd + shift for v in VALID_B])
    assert torch.all(out_a[~M_A.bool()] == 0) and torch.all(out_b[~M_B.bool()] == 0)


# --------------------------------------------------------------------------------------------------------------------
# RunningMoments
# --------------------------------------------------------------------------------------------------------------------
def test_running_moments_initial_state():
    rm = RunningMoments()
    assert rm.count == 0 and rm.mean == 0 and rm.var == 0.0
    assert rm.std == 1.0
    assert "RunningMoments(" in repr(rm)


def test_running_moments_std_is_one_before_two_values():
    rm = RunningMoments()
    batch_mean, batch_std = rm.update(torch.tensor([5.0]))
    assert batch_mean == 5.0 and batch_std == 0.0
    assert rm.count == 1 and rm.mean == 5.0
    assert rm.std == 1.0 and rm.var == 0.0
    rm.update(torch.tensor([7.0]))
    assert rm.mean == 6.0
    assert_close(rm.var, 2.0)
    assert_close(rm.std, math.sqrt(2.0))


def test_running_moments_hand_values():
    rm = RunningMoments()
    rm.update(t64([1.0, 2.0, 3.0]))
    rm.update(t64([[10.0], [20.0]]))  # any shape
    values = [1.0, 2.0, 3.0, 10.0, 20.0]
    assert rm.count == 5
    assert_close(rm.mean, py_mean(values))
    assert_close(rm.var, py_var(values))
    assert_close(rm.std, math.sqrt(py_var(values)))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_running_moments_matches_concatenation(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    rm = RunningMoments()
    seen: list[torch.Tensor] = []
    sizes = [1, 1] + [rng.choice([1, 2, 3, 7, 16]) for _ in range(12)]
    rng.shuffle(sizes)
    for size in sizes:
        batch = 10.0 + 4.0 * torch.randn(size, generator=gen)
        batch_mean, batch_std = rm.update(batch)
        seen.append(batch.double())
        everything = torch.cat(seen)
        assert rm.count == everything.numel()
        assert_close(batch_mean, batch.double().mean(), atol=1e-10)
        assert_close(batch_std, batch.double().std() if size > 1 else 0.0, atol=1e-10)
        assert_close(rm.mean, everything.mean(), atol=1e-10)
        expected_std = everything.std(unbiased=True) if everything.numel() > 1 else 1.0
        assert_close(rm.std, expected_std, atol=1e-10)


def test_running_moments_empty_batch_is_ignored():
    rm = RunningMoments()
    rm.update(t64([1.0, 3.0]))
    before = rm.state_dict()
    batch_mean, batch_std = rm.update(torch.zeros(0))
    assert math.isnan(batch_mean) and math.isnan(batch_std)
    assert rm.state_dict() == before


def test_running_moments_state_dict_round_trip():
    gen = torch.Generator().manual_seed(7)
    rm = RunningMoments()
    for size in (3, 1, 5):
        rm.update(torch.randn(size, generator=gen))
    state = rm.state_dict()
    assert set(state) == {"count", "mean", "m2"}
    assert all(isinstance(v, float) for v in state.values())
    restored = RunningMoments()
    restored.load_state_dict(dict(state))
    assert restored.state_dict() == state
    assert restored.std == rm.std
    for size in (1, 4, 2):
        batch = torch.randn(size, generator=gen)
        assert rm.update(batch) == restored.update(batch)
        assert rm.state_dict() == restored.state_dict()


def test_running_moments_load_state_dict_accepts_tensors_and_ints():
    rm = RunningMoments()
    rm.load_state_dict({"count": 3, "mean": torch.tensor(2.0), "m2": torch.tensor(8.0)})
    assert isinstance(rm.count, float) and isinstance(rm.mean, float) and isinstance(rm.m2, float)
    assert rm.var == 4.0 and rm.std == 2.0


@pytest.mark.parametrize("sizes", [[(3, 2), (1, 5)], [(1, 1), (4, 2), (2, 3)], [(0, 3), (2, 2)]])
def test_running_moments_global_update_equals_union(sizes):
    """Two ranks update with a global reduce; both end where a single process that saw the union ends."""
    gen = torch.Generator().manual_seed(sum(a + b for a, b in sizes))
    shards_a = [torch.randn(a, generator=gen) for a, _ in sizes]
    shards_b = [torch.randn(b, generator=gen) + 3.0 for _, b in sizes]

    def rank_fn(shards):
        def fn(reduce):
            rm = RunningMoments()
            batch_stats = [rm.update(s, reduce=reduce) for s in shards]
            return rm, batch_stats

        return fn

    (rm_a, stats_a), (rm_b, stats_b) = run_distributed(rank_fn(shards_a), rank_fn(shards_b))
    single = RunningMoments()
    single_stats = [single.update(torch.cat([a, b])) for a, b in zip(shards_a, shards_b, strict=True)]
    assert rm_a.state_dict() == rm_b.state_dict()
    assert stats_a == stats_b
    for key, value in single.state_dict().items():
        assert_close(rm_a.state_dict()[key], value, atol=1e-12)
    for (gm, gs), (sm, ss) in zip(stats_a, single_stats, strict=True):
        assert_close(gm, sm, atol=1e-12)
        assert_close(gs, ss, atol=1e-12)
    union = torch.cat([torch.cat([a, b]) for a, b in zip(shards_a, shards_b, strict=True)]).double()
    assert_close(rm_a.mean, union.mean(), atol=1e-10)
    assert_close(rm_a.std, union.std(), atol=1e-10)


# --------------------------------------------------------------------------------------------------------------------
# Log-probabilities and entropy
# --------------------------------------------------------------------------------------------------------------------
def test_logprobs_from_logits_hand_value():
    logits = torch.tensor([[[0.0, math.log(3.0)], [math.log(2.0), math.log(2.0)]]])  # probs (1/4, 3/4), (1/2, 1/2)
    tokens = torch.tensor([[1, 0]])
    assert_close(logprobs_from_logits(logits, tokens), [[math.log(0.75), math.log(0.5)]], atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.5])
def test_logprobs_from_logits_equals_log_softmax_gather(temperature):
    gen = torch.Generator().manual_seed(3)
    logits = 3.0 * torch.randn(2, 4, 11, generator=gen)
    tokens = torch.randint(0, 11, (2, 4), generator=gen)
    expected = torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    out = logprobs_from_logits(logits, tokens, temperature=temperature)
    assert out.shape == (2, 4)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_logprobs_from_logits_temperature_divides_logits():
    logits = torch.tensor([[[1.0, 2.0, 4.0]]])
    tokens = torch.tensor([[2]])
    # T = 2: z = (0.5, 1, 2)
    expected = 2.0 - math.log(math.exp(0.5) + math.exp(1.0) + math.exp(2.0))
    assert_close(logprobs_from_logits(logits, tokens, temperature=2.0), [[expected]], atol=1e-6)


def test_logprobs_from_logits_upcasts_half_precision():
    logits = torch.randn(2, 3, 5).to(torch.bfloat16)
    tokens = torch.zeros(2, 3, dtype=torch.long)
    out = logprobs_from_logits(logits, tokens)
    assert out.dtype == torch.float32
    expected = torch.log_softmax(logits.float(), -1)[..., 0]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_logprobs_from_logits_is_differentiable():
    logits = torch.randn(1, 2, 3, requires_grad=True)
    logprobs_from_logits(logits, torch.tensor([[0, 2]])).sum().backward()
    # d/dz log softmax(z)[k] = onehot(k) - softmax(z)
    expected = F.one_hot(torch.tensor([[0, 2]]), 3).float() - torch.softmax(logits.detach(), -1)
    torch.testing.assert_close(logits.grad, expected)


@pytest.mark.parametrize("vocab", [2, 5, 32])
def test_entropy_of_uniform_logits_is_log_vocab(vocab):
    logits = torch.full((2, 3, vocab), 1.7)
    assert_close(entropy_from_logits(logits), torch.full((2, 3), math.log(vocab)), atol=1e-6)


def test_entropy_hand_value():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # p = (1/4, 3/4)
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert_close(entropy_from_logits(logits), [[expected]], atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 3.0])
def test_entropy_matches_manual_formula(temperature):
    gen = torch.Generator().manual_seed(4)
    logits = 2.0 * torch.randn(2, 3, 7, generator=gen, dtype=F64)
    p = torch.softmax(logits / temperature, dim=-1)
    expected = -(p * torch.log(p)).sum(-1)
    out = entropy_from_logits(logits, temperature=temperature)
    assert out.shape == (2, 3)
    assert_close(out, expected, atol=1e-5)
    assert torch.all(out >= 0) and torch.all(out <= math.log(7) + 1e-5)


def test_entropy_of_peaked_logits_is_near_zero():
    logits = torch.tensor([[[50.0, 0.0, 0.0]]])
    assert float(entropy_from_logits(logits)) < 1e-12 + 1e-6


# --------------------------------------------------------------------------------------------------------------------
# Response masks and lengths
# --------------------------------------------------------------------------------------------------------------------
STOP = 2


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ([5, 7, STOP, 0, 0], [1, 1, 1, 0, 0]),  # stop in the middle: included, padding after it excluded
        ([STOP, 4, 4, 4, 4], [1, 0, 0, 0, 0]),  # stop at position 0
        ([5, 6, 7, 8, 9], [1, 1, 1, 1, 1]),  # no stop: truncated response, everything real
        ([5, STOP, STOP, STOP, STOP], [1, 1, 0, 0, 0]),  # pad == stop: only the first stop counts
        ([5, 6, 7, 8, STOP], [1, 1, 1, 1, 1]),  # stop at the last position
        ([5, STOP, 6, STOP, 7], [1, 1, 0, 0, 0]),  # tokens after the first stop are not part of the response
    ],
)
def test_response_mask_from_stop(row, expected):
    responses = torch.tensor([row, [9, 9, 9, 9, 9]])
    mask = response_mask_from_stop(responses, STOP)
    assert mask.dtype == torch.bool
    assert mask.tolist() == [[bool(v) for v in expected], [True] * 5]


def test_response_mask_from_stop_none_is_all_real():
    responses = torch.tensor([[1, 2, 3], [2, 2, 2]])
    mask = response_mask_from_stop(responses, None)
    assert mask.dtype == torch.bool and mask.shape == (2, 3) and bool(mask.all())


def test_ends_with_stop_looks_inside_the_mask_only():
    responses = torch.tensor([[5, STOP, 0], [5, 6, 7], [5, 6, STOP], [STOP, 6, 7]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]])  # row 2: its stop token is padding
    assert ends_with_stop(responses, mask, STOP).tolist() == [1.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("dtype", [torch.bool, torch.long, torch.float32])
def test_last_token_index(dtype):
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]]).to(dtype)
    idx = last_token_index(mask)
    assert idx.dtype == torch.long
    assert idx.tolist() == [1, 3, 0, 0]


# --------------------------------------------------------------------------------------------------------------------
# Reward shaping
# --------------------------------------------------------------------------------------------------------------------
SCORES = t64([3.0, -1.0, 0.5])


@pytest.mark.parametrize(
    ("mode", "clip", "expected"),
    [
        ("running", None, [(3.0 - 1.0) / 2.0, (-1.0 - 1.0) / 2.0, (0.5 - 1.0) / 2.0]),
        ("scale", None, [3.0 / 2.0, -1.0 / 2.0, 0.5 / 2.0]),
        ("none", None, [3.0, -1.0, 0.5]),
        ("running", 0.5, [0.5, -0.5, -0.25]),
        ("scale", 1.0, [1.0, -0.5, 0.25]),
        ("none", 2.0, [2.0, -1.0, 0.5]),
    ],
)
def test_normalize_scores(mode, clip, expected):
    out = normalize_scores(SCORES, mean=1.0, std=2.0, mode=mode, clip=clip, eps=0.0)
    assert_close(out, expected)


def test_normalize_scores_eps_in_denominator():
    out = normalize_scores(t64([2.0]), mean=0.0, std=0.0, mode="scale", eps=0.5)
    assert_close(out, [4.0])
    out = normalize_scores(t64([3.0]), mean=1.0, std=0.0, mode="running")  # default eps keeps it finite
    assert torch.isfinite(out).all()


def test_normalize_scores_unknown_mode():
    with pytest.raises(ValueError, match="Unknown reward normalisation"):
        normalize_scores(SCORES, 0.0, 1.0, mode="whiten")  # type: ignore[arg-type]


def test_kl_penalty_hand_values():
    logprobs = t64([[-1.0, -2.0]])
    ref = t64([[-1.5, -1.0]])
    # r = ref - logprobs = (-0.5, 1.0)
    assert_close(kl_penalty(logprobs, ref, "k1"), [[0.5, -1.0]])
    assert_close(kl_penalty(logprobs, ref), [[0.5, -1.0]])  # k1 is the default
    assert_close(kl_penalty(logprobs, ref, "k2"), [[0.125, 0.5]])
    assert_close(kl_penalty(logprobs, ref, "k3"), [[math.exp(-0.5) - 1 + 0.5, math.e - 1 - 1.0]])


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_zero_when_equal(estimator):
    lp = t64([[-0.3, -2.0, -7.0]])
    assert_close(kl_penalty(lp, lp.clone(), estimator), [[0.0, 0.0, 0.0]])


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_kl_penalty_nonnegative_estimators(estimator):
    gen = torch.Generator().manual_seed(5)
    lp = -3.0 * torch.rand(4, 16, generator=gen)
    ref = -3.0 * torch.rand(4, 16, generator=gen)
    assert torch.all(kl_penalty(lp, ref, estimator) >= 0)


def test_kl_penalty_unknown_estimator():
    with pytest.raises(ValueError, match="Unknown KL estimator"):
        kl_penalty(t64([0.0]), t64([0.0]), "k4")  # type: ignore[arg-type]


def test_token_rewards_score_on_stop_token_not_first_pad():
    """TRL issue #3750: the score belongs to the last real token (the stop token), not to the first pad after it."""
    pad = 0
    responses = torch.tensor([[5, 7, STOP, pad, pad], [5, 6, 7, 8, 9], [STOP, pad, pad, pad, pad]])
    mask = response_mask_from_stop(responses, STOP)
    kl = t64([[0.1, 0.2, 0.3, 9.0, 9.0], [1.0, 0.0, -1.0, 0.5, 2.0], [0.4, 7.0, 7.0, 7.0, 7.0]])
    scores = t64([10.0, 20.0, 30.0])
    rewards, non_score = token_rewards(scores, kl, mask, kl_coef=0.5)
    expected_non_score = [
        [-0.05, -0.1, -0.15, 0.0, 0.0],
        [-0.5, 0.0, 0.5, -0.25, -1.0],
        [-0.2, 0.0, 0.0, 0.0, 0.0],
    ]
    expected = [
        [-0.05, -0.1, -0.15 + 10.0, 0.0, 0.0],  # stop token at index 2 gets the score; index 3 (first pad) does not
        [-0.5, 0.0, 0.5, -0.25, -1.0 + 20.0],  # truncated response: the last token gets it
        [-0.2 + 30.0, 0.0, 0.0, 0.0, 0.0],  # response = just the stop token
    ]
    assert_close(non_score, expected_non_score)
    assert_close(rewards, expected)
    assert rewards.dtype == F64 and non_score.dtype == F64


def test_token_rewards_pad_equals_stop():
    responses = torch.tensor([[4, 5, STOP, STOP, STOP]])  # tokenizers with pad_token = eos_token
    mask = response_mask_from_stop(responses, STOP)
    rewards, _ = token_rewards(t64([1.0]), torch.zeros(1, 5, dtype=F64), mask, kl_coef=0.1)
    assert_close(rewards, [[0.0, 0.0, 1.0, 0.0, 0.0]])


def test_token_rewards_empty_row_and_zero_coef():
    kl = t64([[0.3, 0.3], [0.3, 0.3]])
    mask = torch.tensor([[1, 1], [0, 0]])
    rewards, non_score = token_rewards(t64([2.0, 5.0]), kl, mask, kl_coef=0.0)
    assert_close(rewards, [[0.0, 2.0], [0.0, 0.0]])  # an empty row gets nothing, not even the score
    assert_close(non_score, [[0.0, 0.0], [0.0, 0.0]])


def test_token_rewards_sum_is_score_minus_kl():
    gen = torch.Generator().manual_seed(6)
    kl = torch.rand(3, 6, generator=gen, dtype=F64)
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    scores = t64([1.0, -2.0, 0.25])
    rewards, non_score = token_rewards(scores, kl, mask, kl_coef=0.05)
    expected_rows = [scores[i].item() - 0.05 * sum(kl[i, : int(mask[i].sum())].tolist()) for i in range(3)]
    assert_close(rewards.sum(1), expected_rows, atol=1e-12)
    assert_close(rewards - non_score, [[0, 0, 0, 0, 0, 1.0], [0, 0, -2.0, 0, 0, 0], [0.25, 0, 0, 0, 0, 0]])


# --------------------------------------------------------------------------------------------------------------------
# GAE and advantage normalisation
# --------------------------------------------------------------------------------------------------------------------
def gae_reference(rewards, values, mask, gamma, lam):
    """Plain-Python GAE over the real prefix of each row; padded positions 0."""
    advantages, returns = [], []
    for r_row, v_row, m_row in zip(rewards, values, mask, strict=True):
        n = int(sum(m_row))
        adv = [0.0] * len(r_row)
        next_adv = 0.0
        for t in reversed(range(n)):
            next_v = v_row[t + 1] if t + 1 < n else 0.0
            delta = r_row[t] + gamma * next_v - v_row[t]
            next_adv = delta + gamma * lam * next_adv
            adv[t] = next_adv
        advantages.append(adv)
        returns.append([a + v if t < n else 0.0 for t, (a, v) in enumerate(zip(adv, v_row, strict=True))])
    return advantages, returns


GAE_REWARDS = t64([[0.0, 0.0, 1.0], [0.2, 1.0, 5.0]])
GAE_VALUES = t64([[0.5, 0.6, 0.7], [0.4, 0.3, 9.0]])
GAE_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


@pytest.mark.parametrize(
    ("gamma", "lam", "expected_adv", "expected_ret"),
    [
        # gamma=1, lam=0.95
        # row 0: d2 = 1 - 0.7 = 0.3; d1 = 0.7 - 0.6 = 0.1 -> A1 = 0.1 + 0.95*0.3 = 0.385;
        #        d0 = 0.6 - 0.5 = 0.1 -> A0 = 0.1 + 0.95*0.385 = 0.46575
        # row 1 (padded): d1 = 1.0 - 0.3 = 0.7 (no bootstrap from the pad's value 9.0);
        #        d0 = 0.2 + 0.3 - 0.4 = 0.1 -> A0 = 0.1 + 0.95*0.7 = 0.765
        (1.0, 0.95, [[0.46575, 0.385, 0.3], [0.765, 0.7, 0.0]], [[0.96575, 0.985, 1.0], [1.165, 1.0, 0.0]]),
        # gamma=0.9, lam=0.5 (gamma*lam = 0.45)
        # row 0: A2 = 0.3; d1 = 0.9*0.7 - 0.6 = 0.03 -> A1 = 0.03 + 0.45*0.3 = 0.165;
        #        d0 = 0.9*0.6 - 0.5 = 0.04 -> A0 = 0.04 + 0.45*0.165 = 0.11425
        # row 1: A1 = 0.7; d0 = 0.2 + 0.9*0.3 - 0.4 = 0.07 -> A0 = 0.07 + 0.45*0.7 = 0.385
        (0.9, 0.5, [[0.11425, 0.165, 0.3], [0.385, 0.7, 0.0]], [[0.61425, 0.765, 1.0], [0.785, 1.0, 0.0]]),
    ],
)
def test_compute_gae_hand_values(gamma, lam, expected_adv, expected_ret):
    advantages, returns = compute_gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=gamma, lam=lam)
    assert_close(advantages, expected_adv, atol=1e-12)
    assert_close(returns, expected_ret, atol=1e-12)
    ref_adv, ref_ret = gae_reference(GAE_REWARDS.tolist(), GAE_VALUES.tolist(), GAE_MASK.tolist(), gamma, lam)
    assert_close(ref_adv, expected_adv, atol=1e-12)
    assert_close(ref_ret, expected_ret, atol=1e-12)


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.9, 0.5), (0.99, 1.0), (1.0, 0.0), (0.0, 0.7)])
def test_compute_gae_matches_python_loop(gamma, lam):
    gen = torch.Generator().manual_seed(8)
    rewards = torch.randn(4, 6, generator=gen, dtype=F64)
    values = torch.randn(4, 6, generator=gen, dtype=F64)
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [0] * 6])
    advantages, returns = compute_gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    assert_close(advantages, ref_adv, atol=1e-12)
    assert_close(returns, ref_ret, atol=1e-12)


def test_compute_gae_ignores_padding():
    """No bootstrap past the last real token: whatever sits on padded positions changes nothing."""
    adv, ret = compute_gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=0.9, lam=0.95)
    rewards, values = GAE_REWARDS.clone(), GAE_VALUES.clone()
    rewards[1, 2], values[1, 2] = -123.0, 456.0
    adv2, ret2 = compute_gae(rewards, values, GAE_MASK, gamma=0.9, lam=0.95)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)


def test_compute_gae_masked_outputs_zero_and_returns_identity():
    gen = torch.Generator().manual_seed(9)
    rewards = torch.randn(3, 5, generator=gen, dtype=F64)
    values = torch.randn(3, 5, generator=gen, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    adv, ret = compute_gae(rewards, values, mask, gamma=0.97, lam=0.9)
    assert torch.all(adv[~mask] == 0) and torch.all(ret[~mask] == 0)
    assert_close(ret[mask], (adv + values)[mask], atol=1e-12)


def test_compute_gae_lam1_gamma1_is_reward_to_go_minus_value():
    rewards = t64([[0.5, -1.0, 2.0, 0.25], [1.0, 3.0, 8.0, 8.0]])
    values = t64([[0.1, 0.2, 0.3, 0.4], [2.0, -1.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # reward-to-go: row 0 (1.75, 1.25, 2.25, 0.25); row 1 (4.0, 3.0)
    assert_close(adv, [[1.65, 1.05, 1.95, -0.15], [2.0, 4.0, 0.0, 0.0]], atol=1e-12)
    assert_close(ret, [[1.75, 1.25, 2.25, 0.25], [4.0, 3.0, 0.0, 0.0]], atol=1e-12)


def test_compute_gae_lam0_is_one_step_td():
    adv, _ = compute_gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=1.0, lam=0.0)
    assert_close(adv, [[0.1, 0.1, 0.3], [0.1, 0.7, 0.0]], atol=1e-12)


def test_normalize_advantages_whiten_and_clip():
    adv = t64([[1.0, 2.0, 3.0, 77.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    scale = 1.0 / math.sqrt(1.0 + 1e-8)  # mean 2, unbiased var 1
    assert_close(normalize_advantages(adv, mask), [[-scale, 0.0, scale, 0.0]])
    assert_close(normalize_advantages(adv, mask, clip=0.5), [[-0.5, 0.0, 0.5, 0.0]])
    assert_close(normalize_advantages(adv, mask, whiten=False, clip=2.5), [[1.0, 2.0, 2.5, 0.0]])
    assert_close(normalize_advantages(adv, mask, whiten=False), [[1.0, 2.0, 3.0, 0.0]])


def test_normalize_advantages_global_over_two_processes():
    gen = torch.Generator().manual_seed(10)
    adv_a, adv_b = torch.randn(2, 4, generator=gen, dtype=F64), 2 + torch.randn(3, 4, generator=gen, dtype=F64)
    m_a = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    m_b = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]])
    out_a, out_b = run_distributed(
        lambda r: normalize_advantages(adv_a, m_a, clip=1.0, reduce=r),
        lambda r: normalize_advantages(adv_b, m_b, clip=1.0, reduce=r),
    )
    single = normalize_advantages(torch.cat([adv_a, adv_b]), torch.cat([m_a, m_b]), clip=1.0)
    assert_close(torch.cat([out_a, out_b]), single, atol=1e-12)
    union = torch.cat([adv_a[m_a.bool()], adv_b[m_b.bool()]])
    expected = ((union - union.mean()) / torch.sqrt(union.var() + 1e-8)).clamp(-1.0, 1.0)
    assert_close(torch.cat([out_a[m_a.bool()], out_b[m_b.bool()]]), expected, atol=1e-12)


# --------------------------------------------------------------------------------------------------------------------
# Policy loss
# --------------------------------------------------------------------------------------------------------------------
def policy_inputs():
    # ratios (1.5, 0.5, 1.1 | 1.5, 0.5, masked) with advantages (+2, +2, +2 | -2, -2, masked), eps = 0.2
    ratios = [[1.5, 0.5, 1.1], [1.5, 0.5, 1.0]]
    old = t64([[-1.0, -2.0, -0.5], [-3.0, -1.0, -2.0]])
    logprobs = old + torch.log(t64(ratios))
    logprobs[1, 2] = old[1, 2] + 4.0  # a wild ratio on the masked token
    advantages = t64([[2.0, 2.0, 2.0], [-2.0, -2.0, 50.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return logprobs, old, advantages, mask


def test_clipped_policy_loss_hand_values():
    logprobs, old, advantages, mask = policy_inputs()
    loss, stats = clipped_policy_loss(logprobs, old, advantages, mask, cliprange=0.2)
    # per token max(-A*rho, -A*clip(rho, 0.8, 1.2)):
    #   A=+2, rho=1.5: max(-3.0, -2.4) = -2.4  (clipped)
    #   A=+2, rho=0.5: max(-1.0, -1.6) = -1.0
    #   A=+2, rho=1.1: max(-2.2, -2.2) = -2.2
    #   A=-2, rho=1.5: max( 3.0,  2.4) =  3.0
    #   A=-2, rho=0.5: max( 1.0,  1.6) =  1.6  (clipped)
    assert_close(loss, (-2.4 - 1.0 - 2.2 + 3.0 + 1.6) / 5, atol=1e-12)
    assert_close(stats["clipfrac"], 2 / 5, atol=1e-12)
    logr = [math.log(1.5), math.log(0.5), math.log(1.1), math.log(1.5), math.log(0.5)]
    assert_close(stats["approxkl"], 0.5 * sum(v * v for v in logr) / 5, atol=1e-12)
    ratios = [1.5, 0.5, 1.1, 1.5, 0.5]
    assert_close(stats["ratio"], py_mean(ratios), atol=1e-12)
    assert_close(stats["ratio_var"], py_var(ratios, unbiased=False), atol=1e-12)
    assert set(stats) == {"clipfrac", "clipfrac_lower", "approxkl", "ratio", "ratio_var"}
    for value in stats.values():
        assert value.dim() == 0


def test_clipped_policy_loss_unclipped():
    logprobs, old, advantages, mask = policy_inputs()
    loss, stats = clipped_policy_loss(logprobs, old, advantages, mask, cliprange=None)
    assert_close(loss, (-3.0 - 1.0 - 2.2 + 3.0 + 1.0) / 5, atol=1e-12)
    assert_close(stats["clipfrac"], 0.0)


def test_clipped_policy_loss_huge_cliprange_equals_unclipped():
    gen = torch.Generator().manual_seed(11)
    old = -torch.rand(3, 5, generator=gen, dtype=F64)
    logprobs = old + 0.5 * torch.randn(3, 5, generator=gen, dtype=F64)
    advantages = torch.randn(3, 5, generator=gen, dtype=F64)
    mask = torch.rand(3, 5, generator=gen) > 0.2
    loss_none, stats_none = clipped_policy_loss(logprobs, old, advantages, mask, None)
    loss_huge, stats_huge = clipped_policy_loss(logprobs, old, advantages, mask, 1e6)
    assert_close(loss_huge, loss_none, atol=1e-12)
    assert_close(stats_huge["clipfrac"], 0.0)
    for key in ("approxkl", "ratio", "ratio_var"):
        assert_close(stats_huge[key], stats_none[key], atol=1e-12)


def test_clipped_policy_loss_masked_tokens_do_not_matter():
    logprobs, old, advantages, mask = policy_inputs()
    base = clipped_policy_loss(logprobs, old, advantages, mask, 0.2)
    logprobs2, old2, advantages2 = logprobs.clone(), old.clone(), advantages.clone()
    logprobs2[1, 2], old2[1, 2], advantages2[1, 2] = -10.0, -25.0, -1e4
    other = clipped_policy_loss(logprobs2, old2, advantages2, mask, 0.2)
    assert_close(other[0], base[0], atol=1e-12)
    for key in base[1]:
        assert_close(other[1][key], base[1][key], atol=1e-12)


def test_clipped_policy_loss_gradient_zero_on_clipped_tokens():
    logprobs, old, advantages, mask = policy_inputs()
    logprobs = logprobs.clone().requires_grad_(True)
    loss, stats = clipped_policy_loss(logprobs, old, advantages, mask, 0.2)
    loss.backward()
    assert all(not v.requires_grad for v in stats.values())
    # d/dlogp of -A*rho/n is -A*rho/n (rho = exp(logp - old)); 0 on clipped and masked tokens
    expected = [[0.0, -2.0 * 0.5 / 5, -2.0 * 1.1 / 5], [2.0 * 1.5 / 5, 0.0, 0.0]]
    assert_close(logprobs.grad, expected, atol=1e-12)


def test_clipped_policy_loss_float32_and_bool_mask():
    logprobs, old, advantages, mask = (t.float() for t in policy_inputs())
    loss, _ = clipped_policy_loss(logprobs, old, advantages, mask.bool(), 0.2)
    assert loss.dtype == torch.float32
    assert_close(loss, (-2.4 - 1.0 - 2.2 + 3.0 + 1.6) / 5, atol=1e-6)


# --------------------------------------------------------------------------------------------------------------------
# Value loss
# --------------------------------------------------------------------------------------------------------------------
def value_inputs():
    values = t64([[1.0, 1.0, 0.1], [-1.0, 0.3, 42.0]])
    old_values = t64([[0.5, 0.5, 0.0], [0.0, 0.0, -42.0]])
    returns = t64([[0.0, 2.0, 1.0], [0.5, 0.1, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return values, old_values, returns, mask


def test_clipped_value_loss_hand_values():
    values, old_values, returns, mask = value_inputs()
    loss, stats = clipped_value_loss(values, old_values, returns, mask, cliprange_value=0.2)
    # V, V_old, R -> (V-R)^2 vs (clip(V, V_old±0.2)-R)^2:
    #   1.0, 0.5, 0.0 -> 1.0  vs (0.7-0.0)^2 = 0.49 -> 1.0
    #   1.0, 0.5, 2.0 -> 1.0  vs (0.7-2.0)^2 = 1.69 -> 1.69 (clipped)
    #   0.1, 0.0, 1.0 -> 0.81 vs (0.1-1.0)^2 = 0.81 -> 0.81 (inside the range: not counted as clipped)
    #  -1.0, 0.0, 0.5 -> 2.25 vs (-0.2-0.5)^2 = 0.49 -> 2.25
    #   0.3, 0.0, 0.1 -> 0.04 vs (0.2-0.1)^2 = 0.01 -> 0.04
    assert_close(loss, 0.5 * (1.0 + 1.69 + 0.81 + 2.25 + 0.04) / 5, atol=1e-12)
    assert_close(stats["clipfrac"], 1 / 5, atol=1e-12)
    assert_close(stats["values"], (1.0 + 1.0 + 0.1 - 1.0 + 0.3) / 5, atol=1e-12)
    assert {"clipfrac", "values"} <= set(stats)


def test_clipped_value_loss_unclipped_and_huge_cliprange():
    values, old_values, returns, mask = value_inputs()
    loss_none, stats_none = clipped_value_loss(values, old_values, returns, mask, None)
    assert_close(loss_none, 0.5 * (1.0 + 1.0 + 0.81 + 2.25 + 0.04) / 5, atol=1e-12)
    assert_close(stats_none["clipfrac"], 0.0)
    loss_huge, stats_huge = clipped_value_loss(values, old_values, returns, mask, 1e6)
    assert_close(loss_huge, loss_none, atol=1e-9)
    assert_close(stats_huge["clipfrac"], 0.0)


def test_clipped_value_loss_masked_tokens_do_not_matter():
    values, old_values, returns, mask = value_inputs()
    base = clipped_value_loss(values, old_values, returns, mask, 0.2)
    values2, returns2 = values.clone(), returns.clone()
    values2[1, 2], returns2[1, 2] = -1e3, 1e3
    other = clipped_value_loss(values2, old_values, returns2, mask, 0.2)
    assert_close(other[0], base[0], atol=1e-12)
    for key in base[1]:
        assert_close(other[1][key], base[1][key], atol=1e-12)


def test_clipped_value_loss_gradient_zero_on_clipped_tokens():
    values, old_values, returns, mask = value_inputs()
    values = values.clone().requires_grad_(True)
    loss, stats = clipped_value_loss(values, old_values, returns, mask, 0.2)
    loss.backward()
    assert all(not v.requires_grad for v in stats.values())
    # d/dV of 0.5*(V-R)^2/n = (V-R)/n on unclipped tokens; 0 on the clipped and the masked token
    expected = [[1.0 / 5, 0.0, -0.9 / 5], [-1.5 / 5, 0.2 / 5, 0.0]]
    assert_close(values.grad, expected, atol=1e-12)


def test_clipped_value_loss_stats_match_docstring():
    _, stats = clipped_value_loss(*value_inputs(), cliprange_value=0.2)
    assert "error" in stats


# --------------------------------------------------------------------------------------------------------------------
# Entropy loss, LM loss, perplexity
# --------------------------------------------------------------------------------------------------------------------
ENTROPY = t64([[2.0, 4.0, 100.0], [3.0, 100.0, 100.0]])
ENTROPY_MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])  # mean entropy over real tokens = 3


@pytest.mark.parametrize(("target", "expected"), [(None, -3.0), (5.0, 2.0), (1.0, 2.0), (3.0, 0.0)])
def test_entropy_loss(target, expected):
    loss, stats = entropy_loss(ENTROPY, ENTROPY_MASK, target=target)
    assert_close(loss, expected, atol=1e-12)
    assert_close(stats["entropy"], 3.0, atol=1e-12)
    assert not stats["entropy"].requires_grad


@pytest.mark.parametrize(("target", "expected_sign"), [(None, -1.0), (5.0, -1.0), (1.0, 1.0)])
def test_entropy_loss_gradient_direction(target, expected_sign):
    entropy = ENTROPY.clone().requires_grad_(True)
    loss, _ = entropy_loss(entropy, ENTROPY_MASK, target=target)
    loss.backward()
    # minimising the loss raises entropy below the target (and for the plain bonus), lowers it above the target
    assert_close(entropy.grad, expected_sign * ENTROPY_MASK.double() / 3, atol=1e-12)


def test_lm_loss_matches_cross_entropy_with_ignore_mask():
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(2, 5, 9, generator=gen)
    labels = torch.randint(0, 9, (2, 5), generator=gen)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]])  # prompt and padding do not count
    loss, stats = lm_loss(logits, labels, mask)
    target = labels[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 9), target.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats["perplexity"], torch.exp(expected), atol=1e-4, rtol=1e-5)
    assert not stats["perplexity"].requires_grad


def test_lm_loss_hand_value():
    # position 0 predicts labels[1]; position 1 predicts labels[2] (masked out); the last position predicts nothing
    logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, -5.0], [9.0, 9.0]]])
    labels = torch.tensor([[0, 1, 1]])
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = lm_loss(logits, labels, mask)
    assert_close(loss, -math.log(0.75), atol=1e-6)
    assert_close(stats["perplexity"], 1 / 0.75, atol=1e-6)


def test_sequence_perplexity_hand_values():
    logprobs = t64([[math.log(0.5), math.log(0.25), -99.0], [math.log(0.1), -5.0, -5.0], [-3.0, -3.0, -3.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    # row 0: exp(-(log .5 + log .25)/2) = sqrt(8); row 1: 1/0.1; empty row: exp(0) = 1
    assert_close(sequence_perplexity(logprobs, mask), [math.sqrt(8.0), 10.0, 1.0], atol=1e-12)


def test_sequence_perplexity_bool_mask_and_shape():
    out = sequence_perplexity(torch.full((4, 3), -1.0), torch.ones(4, 3, dtype=torch.bool))
    assert out.shape == (4,)
    assert_close(out, [math.e] * 4, atol=1e-6)


# --------------------------------------------------------------------------------------------------------------------
# No function edits its inputs in place
# --------------------------------------------------------------------------------------------------------------------
def _random_inputs():
    gen = torch.Generator().manual_seed(13)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    return {
        "x": torch.randn(2, 4, generator=gen, dtype=F64),
        "y": torch.randn(2, 4, generator=gen, dtype=F64),
        "z": torch.randn(2, 4, generator=gen, dtype=F64),
        "mask": mask,
        "fmask": mask.float(),
        "bmask": mask.bool(),
        "logits": torch.randn(2, 4, 6, generator=gen),
        "tokens": torch.randint(0, 6, (2, 4), generator=gen),
        "scores": torch.randn(2, generator=gen, dtype=F64),
    }


CALLS = {
    "masked_sum_and_count": lambda i: masked_sum_and_count(i["x"], i["fmask"]),
    "masked_mean": lambda i: masked_mean(i["x"], i["fmask"]),
    "masked_var": lambda i: masked_var(i["x"], i["fmask"]),
    "masked_whiten": lambda i: masked_whiten(i["x"], i["fmask"]),
    "masked_whiten_noshift": lambda i: masked_whiten(i["x"], i["mask"], shift_mean=False),
    "running_moments": lambda i: RunningMoments().update(i["x"]),
    "logprobs_from_logits": lambda i: logprobs_from_logits(i["logits"], i["tokens"], temperature=0.7),
    "entropy_from_logits": lambda i: entropy_from_logits(i["logits"], temperature=0.7),
    "response_mask_from_stop": lambda i: response_mask_from_stop(i["tokens"], 3),
    "last_token_index": lambda i: last_token_index(i["fmask"]),
    "normalize_scores_running": lambda i: normalize_scores(i["scores"], 0.5, 2.0, "running", clip=0.3),
    "normalize_scores_none": lambda i: normalize_scores(i["scores"], 0.5, 2.0, "none", clip=0.3),
    "kl_penalty": lambda i: kl_penalty(i["x"], i["y"], "k3"),
    "token_rewards": lambda i: token_rewards(i["scores"], i["x"], i["fmask"], 0.1),
    "compute_gae": lambda i: compute_gae(i["x"], i["y"], i["fmask"], 0.9, 0.95),
    "normalize_advantages": lambda i: normalize_advantages(i["x"], i["fmask"], clip=0.5),
    "normalize_advantages_nowhiten": lambda i: normalize_advantages(i["x"], i["fmask"], whiten=False, clip=0.5),
    "clipped_policy_loss": lambda i: clipped_policy_loss(i["x"], i["y"], i["z"], i["fmask"], 0.2),
    "clipped_value_loss": lambda i: clipped_value_loss(i["x"], i["y"], i["z"], i["fmask"], 0.2),
    "entropy_loss": lambda i: entropy_loss(i["x"], i["bmask"], target=0.5),
    "lm_loss": lambda i: lm_loss(i["logits"], i["tokens"], i["fmask"]),
    "sequence_perplexity": lambda i: sequence_perplexity(i["x"], i["fmask"]),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_inputs_not_modified(name):
    inputs = _random_inputs()
    originals = {k: v.clone() for k, v in inputs.items()}
    CALLS[name](inputs)
    for key, value in inputs.items():
        assert torch.equal(value, originals[key]), f"{name} modified input {key!r}"
        assert value.dtype == originals[key].dtype


def test_outputs_do_not_alias_inputs():
    """Returned tensors must be new: editing an output must not change an input."""
    inputs = _random_inputs()
    originals = {k: v.clone() for k, v in inputs.items()}
    outputs = [
        normalize_scores(inputs["scores"], 0.0, 1.0, "running"),
        kl_penalty(inputs["x"], inputs["y"], "k1"),
        *compute_gae(inputs["x"], inputs["y"], inputs["fmask"], 1.0, 1.0),
        normalize_advantages(inputs["x"], inputs["fmask"], whiten=False),
        *token_rewards(inputs["scores"], inputs["x"], inputs["fmask"], 0.0),
    ]
    for out in outputs:
        out.add_(1.0)
    for key, value in inputs.items():
        assert torch.equal(value, originals[key]), f"an output aliases input {key!r}"


def test_normalize_scores_none_returns_new_tensor():
    scores = t64([1.0, 2.0])
    out = normalize_scores(scores, 0.0, 1.0, "none")
    assert out is not scores and out.data_ptr() != scores.data_ptr()


def test_nucleus_logprobs_by_hand():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.2]]]))
    # top_p 0.7: the mass before "1" is 0.5 < 0.7 (kept), before "2" it is 0.8 (dropped): nucleus {0, 1}, mass 0.8
    got = core.nucleus_logprobs(logits, torch.tensor([[1]]), temperature=1.0, top_p=0.7)
    assert got.item() == pytest.approx(math.log(0.3 / 0.8))
    assert core.nucleus_logprobs(logits, torch.tensor([[2]]), 1.0, 1.0).item() == pytest.approx(math.log(0.2))


def test_truncated_importance_weights_by_hand():
    logprobs = torch.tensor([[math.log(0.5), math.log(0.9), math.log(0.2)]])
    sampler = torch.tensor([[math.log(0.25), math.log(0.1), math.log(0.4)]])
    mask = torch.tensor([[1, 1, 0]])
    weights = core.truncated_importance_weights(logprobs, sampler, mask, cap=3.0)
    # 0.5 / 0.25 = 2; 0.9 / 0.1 = 9 truncated to 3; outside the mask: 1
    assert torch.allclose(weights, torch.tensor([[2.0, 3.0, 1.0]]))


def test_policy_loss_weights_scale_each_token():
    logprobs, old = torch.zeros(1, 2), torch.zeros(1, 2)
    advantages, mask = torch.tensor([[1.0, -2.0]]), torch.ones(1, 2)
    plain, _ = core.clipped_policy_loss(logprobs, old, advantages, mask, 0.2)
    weighted, _ = core.clipped_policy_loss(logprobs, old, advantages, mask, 0.2, weights=torch.tensor([[3.0, 0.5]]))
    assert plain.item() == pytest.approx((-1.0 + 2.0) / 2)  # ρ = 1: mean of −A
    assert weighted.item() == pytest.approx((-1.0 * 3.0 + 2.0 * 0.5) / 2)


def test_row_split_loss_weights_give_the_mean_of_the_micro_batch_means_under_any_grouping():
    torch.manual_seed(0)
    mask = (torch.rand(12, 9) < 0.6).float()
    mask[5] = 0  # a row with no token (a dropped sample)
    losses = torch.randn(12, 9)
    row_split = torch.stack([core.masked_mean(losses[g], mask[g]) for g in torch.arange(12).split(4)]).mean()
    weights = core.row_split_loss_weights(mask, rows_per_micro_batch=4)
    for grouping in (torch.arange(12).split(4), torch.randperm(12).split(5), [torch.arange(12)]):
        packed = sum((losses[g] * weights[g] * mask[g]).sum() for g in grouping)
        torch.testing.assert_close(packed, row_split)
    assert torch.equal(weights[5], torch.zeros(9))


def test_public_api_is_covered():
    public = {
        name
        for name, obj in vars(core).items()
        if not name.startswith("_")
        and callable(obj)
        and getattr(obj, "__module__", None) == core.__name__
        and (isinstance(obj, type) or hasattr(obj, "__code__"))
    }
    tested = {
        "RunningMoments",
        "bounded",  # tests/test_estimator_edges.py
        "row_split_loss_weights",
        "masked_loss_mean",  # tests/test_nonfinite_rewards.py
        "kl_loss",
        "explained_variance",
        "truncated_importance_weights",
        "nucleus_logprobs",
        "clipped_policy_loss",
        "clipped_value_loss",
        "compute_gae",
        "decoupled_gae",
        "nucleus_threshold",
        "length_adaptive_lam",
        "robust_location_scale",
        "winsorize",
        "ends_with_stop",
        "entropy_from_logits",
        "entropy_loss",
        "kl_penalty",
        "last_token_index",
        "lm_loss",
        "logprobs_from_logits",
        "masked_mean",
        "masked_sum_and_count",
        "masked_var",
        "masked_whiten",
        "normalize_advantages",
        "normalize_scores",
        "response_mask_from_stop",
        "sequence_perplexity",
        "token_rewards",
        "token_logprobs",
        "token_logprobs_at",
        "next_token_loss",
    }
    assert public == tested, f"untested public names: {sorted(public - tested)}; gone: {sorted(tested - public)}"


def test_padding_with_inf_or_nan_does_not_leak_into_masked_statistics():
    x = torch.tensor([[1.0, 3.0, float("inf")], [5.0, float("nan"), 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert_close(masked_mean(x, mask), 3.0)
    assert_close(masked_var(x, mask), 4.0)


def test_entropy_with_masked_vocabulary_is_finite():
    logits = torch.tensor([[[0.0, 0.0, float("-inf"), float("-inf")]]])
    assert_close(entropy_from_logits(logits), [[math.log(2.0)]], atol=1e-6)


# --------------------------------------------------------------------------------------------------------------------
# Beyond the paper (issue 24): per-response λ, decoupled GAE, length-adaptive λ, winsorised scores
# --------------------------------------------------------------------------------------------------------------------
def test_compute_gae_takes_one_lambda_per_response():
    """Row 0 with λ 0.95 and row 1 with λ 0.5 (γ 1): each row equals plain GAE with its own λ.
    Row 1 by hand: A1 = 0.7; d0 = 0.2 + 0.3 − 0.4 = 0.1 → A0 = 0.1 + 0.5·0.7 = 0.45."""
    advantages, returns = compute_gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=1.0, lam=t64([0.95, 0.5]))
    assert_close(advantages, [[0.46575, 0.385, 0.3], [0.45, 0.7, 0.0]], atol=1e-12)
    assert_close(returns, [[0.96575, 0.985, 1.0], [0.85, 1.0, 0.0]], atol=1e-12)


def test_length_adaptive_lam_hand_values():
    """λ = clip(1 − 1/(α·l), 0, 1) with α 0.05: l 40 → 0.5, l 100 → 0.8, l 10 → 0 (clipped), l 0 → 0."""
    mask = torch.zeros(4, 100)
    for row, length in enumerate((40, 100, 10, 0)):
        mask[row, :length] = 1
    assert_close(core.length_adaptive_lam(mask, 0.05), torch.tensor([0.5, 0.8, 0.0, 0.0]), atol=1e-6)


def test_decoupled_gae_critic_targets_with_lambda_1_are_monte_carlo_returns():
    """λ_critic = 1, γ = 1: R_t = Σ_{k≥t} r_k (row 0: 1, 1, 1; row 1: 1.2, 1.0), whatever the values; the policy's
    advantages are plain GAE with λ_policy."""
    advantages, returns = core.decoupled_gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, 1.0, 0.95, lam_critic=1.0)
    assert_close(advantages, [[0.46575, 0.385, 0.3], [0.765, 0.7, 0.0]], atol=1e-12)
    assert_close(returns, [[1.0, 1.0, 1.0], [1.2, 1.0, 0.0]], atol=1e-12)
    plain = core.decoupled_gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, 1.0, 0.95, lam_critic=None)
    assert_close(plain[1], compute_gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, 1.0, 0.95)[1], atol=0)


def test_robust_location_scale_hand_values():
    """[1, 2, 3, 4, 1000]: median 3, |x − 3| = [2, 1, 0, 1, 997] → MAD 1, scale 1.4826 (the outlier moves nothing);
    [5, 5, 5, 9]: MAD 0, so the scale is the std, sqrt(4) = 2."""
    assert core.robust_location_scale(torch.tensor([1.0, 2, 3, 4, 1000])) == pytest.approx((3.0, 1.4826))
    assert core.robust_location_scale(torch.tensor([5.0, 5, 5, 9])) == pytest.approx((5.0, 2.0))


def test_winsorize_hand_values():
    """Center 1, scale 2, k 3: bounds [−5, 7]."""
    scores = torch.tensor([-100.0, -5.0, 0.0, 6.9, 7.5, 300.0])
    assert_close(core.winsorize(scores, 1.0, 2.0, 3.0), torch.tensor([-5.0, -5.0, 0.0, 6.9, 7.0, 7.0]))


# --------------------------------------------------------------------------------------------------------------------
# Nucleus sampling without sorting the vocabulary (issues 25 and 34)
# --------------------------------------------------------------------------------------------------------------------
def _random_probs(rows: int, vocab: int, seed: int, scale: float, tie_step: float | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * scale
    if tie_step is not None:  # logits on a grid: many tokens share a probability
        logits = (logits / tie_step).round() * tie_step
    return logits.softmax(-1)


def sorted_nucleus_threshold(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition by a full sort: the last sorted probability whose preceding (float64) mass is below top_p."""
    descending = probs.sort(dim=-1, descending=True).values
    before = descending.double().cumsum(-1) - descending.double()
    kept = (before < top_p).sum(-1, keepdim=True)
    return descending.gather(-1, kept - 1).squeeze(-1)


@pytest.mark.parametrize("scale", [0.0, 0.5, 3.0, 8.0])  # uniform, flat (a nucleus of most tokens), moderate, peaked
@pytest.mark.parametrize("tie_step", [None, 0.5])
@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.999])
def test_nucleus_threshold_equals_the_full_sort(scale, tie_step, top_p):
    probs = _random_probs(32, 16384, seed=int(scale * 10), scale=scale, tie_step=tie_step)
    assert torch.equal(core.nucleus_threshold(probs, top_p), sorted_nucleus_threshold(probs, top_p))


def test_nucleus_threshold_cuts_a_crowded_band_again_and_keeps_leading_dimensions():
    """Few buckets force more rounds (a band of more than 256 tokens is cut again); (B, T, V) inputs keep (B, T)."""
    probs = _random_probs(24, 4096, seed=5, scale=1.0).reshape(4, 6, 4096)
    for buckets in (2, 16, 1024):
        assert torch.equal(core.nucleus_threshold(probs, 0.9, buckets), sorted_nucleus_threshold(probs, 0.9))


def test_nucleus_threshold_takes_peaked_rows_from_the_top_and_the_others_by_bands():
    """A batch mixing peaked rows (their nucleus within the ``leading`` largest probabilities: read from ``topk``) and
    flat ones (wider: found by bands) gives the full sort's thresholds row by row, whatever ``leading`` is."""
    peaked, flat = _random_probs(8, 8192, seed=1, scale=8.0), _random_probs(8, 8192, seed=2, scale=0.5)
    probs = torch.stack([peaked, flat], dim=1).reshape(16, 8192)  # alternating rows
    expected = sorted_nucleus_threshold(probs, 0.9)
    for leading in (1, 8, 64, 8192):
        assert torch.equal(core.nucleus_threshold(probs, 0.9, leading=leading), expected)
    top_holds = probs.topk(64, dim=-1).values.double().sum(-1) >= 0.9
    assert top_holds[::2].all() and not top_holds[1::2].any()  # both paths ran


def test_nucleus_threshold_keeps_ties_at_the_boundary():
    """[0.3, 0.3, 0.2, 0.1, 0.1] with top_p 0.65: the mass before the sorted values is 0, 0.3, 0.6, 0.8 — the first
    three are kept, τ = 0.2. With top_p 0.85 the fourth (mass before 0.8) is kept, τ = 0.1, and its tie with the
    fifth keeps both."""
    probs = torch.tensor([[0.1, 0.3, 0.2, 0.3, 0.1]] * 2)
    for top_p, expected in ((0.65, 0.2), (0.85, 0.1)):
        assert_close(core.nucleus_threshold(probs, top_p), torch.full((2,), expected))
    ties = torch.full((3, 100), 0.01)  # all tied: every token is in the nucleus
    assert torch.equal(core.nucleus_threshold(ties, 0.5), torch.full((3,), 0.01))


def test_nucleus_filter_keeps_what_transformers_top_p_keeps():
    """The same nucleus as transformers' ``TopPLogitsWarper`` (which sums the ascending probabilities, we the
    descending ones): at most the one token at the boundary differs, where the two summation orders round apart."""
    from transformers import TopPLogitsWarper

    from trl_ppomax.generation import NucleusFilter

    gen = torch.Generator().manual_seed(3)
    for scale in (0.5, 2.0, 6.0):
        scores = torch.randn(32, 16384, generator=gen) * scale
        ours = ~NucleusFilter(0.9)(None, scores.clone()).isinf()
        theirs = ~TopPLogitsWarper(0.9)(None, scores.clone()).isinf()
        assert (ours != theirs).sum(-1).max() <= 1 and (ours != theirs).sum() <= 2
        probs = scores.softmax(-1)
        for row in (ours != theirs).any(-1).nonzero().flatten():  # the odd token is the smallest of the larger set
            larger = ours[row] | theirs[row]
            odd = (ours[row] != theirs[row]).nonzero().item()
            assert probs[row, odd] == probs[row][larger].min()


def test_generated_tokens_penalty_equals_transformers_with_the_prompt_exempt():
    from transformers import RepetitionPenaltyLogitsProcessor

    from trl_ppomax.generation import GeneratedTokensPenalty

    gen = torch.Generator().manual_seed(4)
    scores = torch.randn(4, 50, generator=gen)
    input_ids = torch.randint(0, 50, (4, 9), generator=gen)
    input_ids[:, 6] = input_ids[:, 7]  # a token generated twice
    ours = GeneratedTokensPenalty(1.3, prompt_width=5)(input_ids, scores.clone())
    theirs = RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=5)(input_ids, scores.clone())
    assert torch.equal(ours, theirs)
    assert torch.equal(GeneratedTokensPenalty(1.3, prompt_width=9)(input_ids, scores.clone()), scores)


def test_robust_location_scale_takes_the_true_median_of_an_even_count():
    """[1, 2, 4, 10]: median (2 + 4)/2 = 3 (not the lower middle value, 2); |x − 3| = [2, 1, 1, 7] → sorted
    [1, 1, 2, 7], MAD (1 + 2)/2 = 1.5 → scale 1.4826·1.5 = 2.2239. Order does not matter; one value: (x, 0);
    none (every sample dropped): NaN, as before."""
    assert core.robust_location_scale(torch.tensor([10.0, 2, 4, 1])) == pytest.approx((3.0, 2.2239))
    assert core.robust_location_scale(torch.tensor([[1.0, 2], [4, 10]])) == pytest.approx((3.0, 2.2239))
    assert core.robust_location_scale(torch.tensor([7.0])) == (7.0, 0.0)
    assert all(math.isnan(v) for v in core.robust_location_scale(torch.tensor([])))


# -- Clip-higher, dual-clip, loss aggregation, the KL as a loss, explained variance (issue 33) -------------------------
def peer_policy_inputs():
    import json
    from pathlib import Path

    peers = json.loads((Path(__file__).parent / "data" / "peer_estimators.json").read_text())
    loss = peers["verl_policy_loss"]
    names = ("logprobs", "old_logprobs", "advantages")
    return [torch.tensor(loss[n]) for n in names], torch.tensor(peers["inputs"]["mask"]), loss


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"])
def test_clip_higher_dual_clip_and_each_aggregation_equal_verls_policy_loss(aggregation):
    """verl's compute_policy_loss_vanilla (clip_ratio_low 0.2, clip_ratio_high 0.28, clip_ratio_c 3) and agg_loss on
    the same tensors, one micro-batch, run in a throwaway check (tests/data)."""
    (logprobs, old, advantages), mask, peer = peer_policy_inputs()
    weights = None if aggregation == "token_mean" else core.row_split_loss_weights(mask, len(mask), aggregation)
    loss, _ = core.clipped_policy_loss(
        logprobs, old, advantages, mask, 0.2, loss_weights=weights, cliprange_high=0.28, dual_clip=3.0
    )
    assert loss.item() == pytest.approx(peer["loss"][aggregation.replace("_", "-")], rel=1e-5)


def test_clip_higher_and_dual_clip_by_hand():
    """One token each: ρ = 1.25 with A = 1 is clipped at 1 + ε_high = 1.28 only above it (kept: −1.25); ρ = 5 with
    A = −1: PPO's loss 5 is bounded by dual-clip's −c·A = 3."""
    logprobs = torch.log(torch.tensor([[1.25, 5.0]]))
    old, advantages, mask = torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    symmetric, stats = core.clipped_policy_loss(logprobs, old, advantages, mask, 0.2)
    assert symmetric.item() == pytest.approx((-1.2 + 5.0) / 2) and stats["clipfrac"].item() == 0.5
    higher, _ = core.clipped_policy_loss(logprobs, old, advantages, mask, 0.2, cliprange_high=0.28)
    assert higher.item() == pytest.approx((-1.25 + 5.0) / 2)
    dual, stats = core.clipped_policy_loss(logprobs, old, advantages, mask, 0.2, cliprange_high=0.28, dual_clip=3.0)
    assert dual.item() == pytest.approx((-1.25 + 3.0) / 2) and stats["clipfrac_lower"].item() == 0.5


def test_loss_aggregation_weights_by_hand():
    """Rows of 3, 1 and 0 tokens (the last dropped), one micro-batch."""
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]]).float()
    token = core.row_split_loss_weights(mask, 3, "token_mean")
    seq_sum = core.row_split_loss_weights(mask, 3, "seq_mean_token_sum")
    seq_mean = core.row_split_loss_weights(mask, 3, "seq_mean_token_mean")
    torch.testing.assert_close(token, mask / 4)
    torch.testing.assert_close(seq_sum, mask / 2)
    torch.testing.assert_close(seq_mean, torch.tensor([[1 / 6, 1 / 6, 1 / 6], [0.5, 0, 0], [0, 0, 0]]))


def test_the_kl_loss_is_the_estimators_mean_with_its_gradient():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref, mask = torch.tensor([[-1.5, -1.0, -9.0]]), torch.tensor([[1, 1, 0]])
    k2 = core.kl_loss(logprobs, ref, mask, "k2")
    assert k2.item() == pytest.approx((0.5 * 0.5**2 + 0.5 * 1.0**2) / 2)
    k2.backward()  # d/dlogπ ½(logπ − logπ_ref)² / 2 = (logπ − logπ_ref) / 2
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.25, -0.5, 0.0]]))


def test_explained_variance_by_hand():
    returns, mask = torch.tensor([[1.0, 2.0, 3.0, 99.0]]), torch.tensor([[1, 1, 1, 0]])
    assert core.explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    assert core.explained_variance(torch.full_like(returns, 2.0), returns, mask).item() == pytest.approx(0.0)
    # residuals (0.5, 0, −0.5): Var 1/6 against Var(R) 2/3
    values = torch.tensor([[0.5, 2.0, 3.5, 0.0]])
    assert core.explained_variance(values, returns, mask).item() == pytest.approx(1 - (1 / 6) / (2 / 3))


# -- Log-probs in chunks through the LM head --------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64, None])
@pytest.mark.parametrize("trains_entropy", [False, True])
@pytest.mark.parametrize("head_kind", ["linear", "callable"])
def test_token_logprobs_in_chunks_equal_the_whole_logits_in_values_and_gradients(
    temperature, chunk_size, trains_entropy, head_kind
):
    """float32, several chunk sizes (one position, an uneven split, more than the positions, off), a masked loss:
    log-probs, entropy and the gradients of the hidden states and of the head equal trl's ``selective_log_softmax``
    and ``entropy_from_logits`` on the whole (B, T, V) logits to 1e-6; for an ``nn.Linear`` head (its chunks written
    out, sharing buffers) and for any other callable (a checkpoint per chunk)."""
    from trl.trainer.utils import selective_log_softmax_and_entropy

    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 50)
    head = linear if head_kind == "linear" else lambda h: linear(h)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    tokens, mask = torch.randint(0, 50, (3, 7)), torch.ones(3, 7)
    mask[1, 4:], mask[2, 1:] = 0, 0  # padded responses
    advantages, entropy_weights = torch.randn(3, 7), torch.randn(3, 7)

    def loss_and_grads(logprobs, entropy):
        loss = masked_mean(logprobs * advantages, mask)
        if trains_entropy:
            loss = loss + masked_mean(entropy * entropy_weights, mask)
        grads = torch.autograd.grad(loss, [hidden, linear.weight, linear.bias])
        return [logprobs, entropy, *grads]

    expected = loss_and_grads(
        *selective_log_softmax_and_entropy(head(hidden), tokens, trains_entropy, temperature=temperature)
    )
    options = dict(temperature=temperature, chunk_size=chunk_size, entropy=True, entropy_grad=trains_entropy)
    logprobs, entropy = token_logprobs(hidden, head, tokens, **options)
    assert entropy.requires_grad == trains_entropy
    for got, want in zip(loss_and_grads(logprobs, entropy), expected, strict=True):
        assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_token_logprobs_hold_one_chunks_logits_at_a_time():
    """The head sees ``chunk_size`` positions per call, and under autograd again in backward (recomputed, not held)."""
    torch.manual_seed(0)
    linear, seen = torch.nn.Linear(8, 30), []

    def head(h):
        seen.append(len(h))
        return linear(h)

    hidden, tokens = torch.randn(2, 5, 8, requires_grad=True), torch.randint(0, 30, (2, 5))
    logprobs, entropy = token_logprobs(hidden, head, tokens, chunk_size=4)
    assert entropy is None and seen == [4, 4, 2]
    logprobs.sum().backward()
    assert sorted(seen) == [2, 2, 4, 4, 4, 4]  # each chunk's logits recomputed in backward
    seen.clear()
    with torch.no_grad():
        token_logprobs(hidden, head, tokens, chunk_size=None)
    assert seen == [10]


def chunk_sized_allocations(head, positions: int, chunk_size: int, vocab: int) -> int:
    """How many allocations of at least one chunk's logits a forward and backward of ``token_logprobs`` makes."""
    from torch.profiler import profile

    hidden, tokens = torch.randn(positions, 8, requires_grad=True), torch.randint(0, vocab, (positions,))
    with profile(profile_memory=True) as profiler:
        token_logprobs(hidden, head, tokens, chunk_size=chunk_size, entropy=True)[0].sum().backward()
    events = profiler.events()
    return sum(e.name.startswith("aten::") and e.cpu_memory_usage >= chunk_size * vocab * 4 for e in events)


def test_a_linear_heads_chunks_share_their_buffers_any_other_head_allocates_per_chunk():
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 1000)
    shared = [chunk_sized_allocations(linear, positions, 4, 1000) for positions in (32, 128)]
    assert shared[0] == shared[1] < 32  # a few buffers per call (nested ops count too), however many chunks
    per_chunk = [chunk_sized_allocations(lambda h: linear(h), positions, 4, 1000) for positions in (32, 128)]
    assert per_chunk[1] >= 4 * 32 > shared[1]  # ≥ one per chunk of 128 positions


@pytest.mark.parametrize("setup", ["frozen_head", "no_bias", "hooked", "bf16_autocast"])
def test_token_logprobs_of_a_linear_head_equal_its_calls_chunk_by_chunk(setup):
    """Where the head is a plain ``nn.Linear`` its chunks are written out; they equal the head called chunk by chunk
    (a checkpoint each) with a frozen head, without a bias, under bf16 autocast (where the head's gradient is summed
    over the chunks in float32, autocast's in bf16: equal to bf16's precision); a head with a forward hook (ZeRO-3's
    gathering, accelerate's offload) is called for every chunk."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 300, bias=setup != "no_bias")
    linear.requires_grad_(setup != "frozen_head")
    calls = []
    if setup == "hooked":
        linear.register_forward_pre_hook(lambda module, args: calls.append(len(args[0])))
    hidden, tokens, weights = (
        torch.randn(2, 9, 16, requires_grad=True),
        torch.randint(0, 300, (2, 9)),
        torch.randn(2, 9),
    )
    parameters = [hidden] + [p for p in linear.parameters() if p.requires_grad]

    def outputs(head):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setup == "bf16_autocast"):
            logprobs, entropy = token_logprobs(hidden, head, tokens, chunk_size=4, entropy=True, entropy_grad=True)
        loss = (logprobs * weights).sum() + entropy.mean()
        return [logprobs, entropy, *torch.autograd.grad(loss, parameters)]

    got = outputs(linear)
    if setup == "hooked":
        assert sorted(calls) == [2, 2] + [4] * 8  # forward, and each chunk again in backward
    for index, (got_one, want) in enumerate(zip(got, outputs(lambda h: linear(h)), strict=True)):
        bf16_sum = setup == "bf16_autocast" and index > 2  # the head's parameters
        assert_close(got_one, want, atol=3e-2 if bf16_sum else 1e-6, rtol=1.6e-2 if bf16_sum else 1e-6)


def test_next_token_loss_is_the_lm_loss_of_the_label_log_probs():
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 6, 11), torch.randint(0, 11, (2, 6))
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]])
    loss, stats = lm_loss(logits, labels, mask)
    logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, labels[:, 1:, None]).squeeze(-1)
    same, same_stats = next_token_loss(logprobs, mask[:, 1:])
    assert_close(same, loss)
    assert_close(same_stats["perplexity"], stats["perplexity"])


def test_token_logprobs_at_several_temperatures_run_the_head_once_per_chunk():
    torch.manual_seed(0)
    linear, calls = torch.nn.Linear(8, 30), []

    def head(h):
        calls.append(len(h))
        return linear(h)

    hidden, tokens = torch.randn(2, 5, 8), torch.randint(0, 30, (2, 5))
    at_07, at_1 = token_logprobs_at(hidden, head, tokens, (0.7, 1.0), chunk_size=4)
    assert calls == [4, 4, 2]
    for got, temperature in ((at_07, 0.7), (at_1, 1.0)):
        with torch.no_grad():
            expected = torch.log_softmax(linear(hidden) / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)
        assert_close(got, expected, atol=1e-6, rtol=1e-6)
