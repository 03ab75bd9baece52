"""Phase 2, a scored rollout turned into training targets (``trl_ppomax.ppo.experience``), with non-finite rewards: the
samples dropped leave the same experience as a batch without them, the masking is per process and the skip decision
global, and the kept values are gathered from every process."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import make_trainer, run_distributed

from trl_ppomax.base import metrics as M
from trl_ppomax.base.rollout import Rollout
from trl_ppomax.ppo.experience import drop_non_finite, kept_gather

NAN, INF = math.nan, math.inf


def first_rollout(trainer) -> Rollout:
    batch = trainer.prompt_batches[0]
    return trainer.rollout(batch["input_ids"], batch["attention_mask"])


@pytest.mark.parametrize("whiten_rewards", [False, True])
def test_dropped_samples_leave_the_same_experience_as_a_batch_without_them(tmp_path, whiten_rewards):
    trainer = make_trainer(tmp_path, whiten_rewards=whiten_rewards, reward_norm="running")
    rollout = first_rollout(trainer)
    poisoned = Rollout(**{**vars(rollout), "scores": rollout.scores.clone()})
    poisoned.scores[[1, 5]] = torch.tensor([NAN, -INF])
    keep = torch.isfinite(poisoned.scores)
    start = trainer.ppo_state.running_reward.state_dict()

    masked, masked_metrics, _ = trainer.make_experience(poisoned)
    moments = trainer.ppo_state.running_reward.state_dict()
    trainer.ppo_state.running_reward.load_state_dict(start)
    clean, clean_metrics, _ = trainer.make_experience(rollout.select(keep))

    assert moments == pytest.approx(trainer.ppo_state.running_reward.state_dict())
    assert moments["count"] == start["count"] + keep.sum().item()
    for name in ("advantages", "returns", "raw_advantages"):
        torch.testing.assert_close(getattr(masked, name)[keep], getattr(clean, name), msg=name)
        assert torch.all(getattr(masked, name)[~keep] == 0), name
    assert masked.rollout.response_mask[~keep].sum() == 0 and torch.all(masked.rollout.scores[~keep] == 0)
    assert masked_metrics == pytest.approx(clean_metrics)
    assert trainer.ppo_state.counters[M.SKIPPED_SAMPLES] == 2


def fake_rollout(scores, values=None) -> Rollout:
    batch = len(scores)
    mask = torch.ones(batch, 3, dtype=torch.long)
    return Rollout(
        query_ids=torch.zeros(batch, 2, dtype=torch.long),
        query_mask=torch.ones(batch, 2, dtype=torch.long),
        response_ids=torch.ones(batch, 3, dtype=torch.long),
        response_mask=mask,
        logprobs=-torch.ones(batch, 3),
        ref_logprobs=-torch.ones(batch, 3),
        values=torch.ones(batch, 3) if values is None else torch.tensor(values),
        scores=torch.tensor(scores),
        policy_perplexity=torch.ones(batch),
        ref_perplexity=torch.ones(batch),
    )


@pytest.mark.parametrize(
    "rank0, rank1, dropped, problem",
    [
        (fake_rollout([NAN, NAN]), fake_rollout([1.0, 2.0]), 2, None),  # one process keeps nothing: masked only
        (
            fake_rollout([NAN, INF]),
            fake_rollout([-INF, NAN]),
            4,
            "no finite reward (None, NaN or inf) for all 4 samples",
        ),
        (fake_rollout([1.0, NAN]), fake_rollout([1.0, 2.0], [[1, 1, 1], [1, NAN, 1]]), 1, "non-finite values (1)"),
    ],
    ids=["masked", "all-dropped", "bad-value"],
)
def test_the_masking_is_per_process_and_the_skip_decision_global(rank0, rank1, dropped, problem):
    results = run_distributed(lambda r: drop_non_finite(rank0, r), lambda r: drop_non_finite(rank1, r))
    for original, (rollout, keep, n, reason) in zip((rank0, rank1), results, strict=True):
        assert (n, reason) == (dropped, problem)  # the same on every process
        torch.testing.assert_close(keep, torch.isfinite(original.scores))
        if problem is None:
            assert torch.all(rollout.response_mask[~keep] == 0) and torch.all(rollout.scores[~keep] == 0)
            assert torch.equal(rollout.response_mask[keep], original.response_mask[keep])
            assert all(torch.isfinite(t).all() for t in (rollout.scores, rollout.logprobs, rollout.values))


def test_kept_gather_returns_the_kept_values_of_every_process():
    keep = torch.tensor([True, False, True])
    gather = kept_gather(keep, lambda t: torch.cat([t, t]))  # two processes holding the same rows
    assert gather(torch.tensor([1.0, NAN, 3.0])).tolist() == [1.0, 3.0, 1.0, 3.0]
