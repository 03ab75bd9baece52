"""Non-finite rewards and numbers during a run (``trl_ppomax.ppo.experience``, ``base.core``): dropped per sample,
skipped per batch, stopped after ``max_skipped_iterations`` in a row; losses with nothing left to average over. The
experience made of a rollout with dropped samples is in ``test_ppo_experience.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import StopAt, changed, make_trainer, snapshot

from trl_ppomax.base import core
from trl_ppomax.base import metrics as M
from trl_ppomax.ppo.state import PPOState
from trl_ppomax.toyworld.tiny import build_models

# ==================================================================================================================
# Faults during a run: non-finite rewards, path typos in the recipes, damaged release shards, bad preference rows.
# ==================================================================================================================
RECIPES = Path(__file__).resolve().parents[1] / "recipes"


NAN, INF = math.nan, math.inf


def nan_reward(positions, calls: list[int] | None = None):
    """A reward function scoring a completion by its length, NaN at ``positions`` of each call (all: ``"all"``)."""

    def reward(prompts, completions):
        scores = [float(len(c)) for c in completions]
        for i in range(len(scores)) if positions == "all" else positions:
            scores[i] = NAN
        if calls is not None:
            calls.append(len(scores))
        return scores

    return reward


def critic():
    return build_models()[2]


# ------------------------------------------------------------------------------------------------------------------
# Non-finite rewards: dropped per sample, skipped per batch, stopped after max_skipped_iterations in a row
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        # one sample per micro-batch: a dropped sample leaves its micro-batch empty, which must add nothing
        {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 8},
    ],
    ids=["micro-batch-4", "micro-batch-1"],
)
def test_one_nan_reward_per_batch_still_trains_and_counts_the_dropped_samples(tmp_path, overrides):
    calls: list[int] = []
    trainer = make_trainer(tmp_path, reward=nan_reward([0], calls), value_model=critic(), **overrides)
    before = snapshot(trainer.model.policy), snapshot(trainer.model.critic)
    trainer.train()
    dropped = len(calls)  # one NaN per call of the reward function
    assert trainer.ppo_state.counters[M.SKIPPED_SAMPLES] == dropped > 0
    assert trainer.ppo_state.counters[M.SKIPPED_ITERATIONS] == 0 and trainer.ppo_state.counters[M.SKIPPED_UPDATES] == 0
    assert (
        trainer.ppo_state.running_reward.count == sum(calls) - dropped
    )  # the dropped scores never entered the moments
    assert changed(before[0], trainer.model.policy) > 0 and changed(before[1], trainer.model.critic) > 0
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    last = trainer.state.log_history[-1]
    assert last[M.SKIPPED_SAMPLES] == dropped
    logged = [value for entry in trainer.state.log_history for value in entry.values() if isinstance(value, float)]
    assert all(math.isfinite(value) for value in logged)  # no NaN leaks into any metric


def test_minibatch_whitening_survives_a_minibatch_with_no_sample_left(tmp_path):
    # 15 of 16 samples dropped: at least one of the two minibatches has no real token to whiten over
    trainer = make_trainer(
        tmp_path, reward=nan_reward(range(1, 16)), value_model=critic(), advantage_whitening_scope="minibatch"
    )
    before = snapshot(trainer.model.critic)
    trainer.train()
    assert trainer.ppo_state.counters[M.SKIPPED_SAMPLES] == 30 and trainer.ppo_state.counters[M.SKIPPED_UPDATES] == 0
    assert changed(before, trainer.model.critic) > 0


def test_an_all_nan_reward_stops_after_max_skipped_iterations(tmp_path):
    calls: list[int] = []
    trainer = make_trainer(
        tmp_path, reward=nan_reward("all", calls), value_model=critic(), total_episodes=64, max_skipped_iterations=2
    )
    before = snapshot(trainer.model)
    with pytest.raises(RuntimeError, match=r"max_skipped_iterations=2") as error:
        trainer.train()
    assert "iteration 2" in str(error.value) and "no finite reward (None, NaN or inf)" in str(error.value)
    assert len(calls) == 2  # stopped at once: no third rollout
    assert (
        trainer.ppo_state.counters[M.SKIPPED_ITERATIONS] == 2 and trainer.ppo_state.counters[M.SKIPPED_SAMPLES] == 32
    )
    assert trainer.ppo_state.running_reward.count == 0  # never updated from a skipped batch
    assert changed(before, trainer.model) == 0


def test_the_run_of_skipped_iterations_survives_a_resume(tmp_path):
    settings = dict(total_episodes=64, max_skipped_iterations=2, save_strategy="steps", save_steps=1)
    first = make_trainer(tmp_path, reward=nan_reward("all"), value_model=critic(), **settings)
    first.add_callback(StopAt(1))
    first.train()  # iteration 1 skipped and saved
    checkpoint = tmp_path / "out" / "checkpoint-1"
    assert json.loads((checkpoint / "ppo_state.json").read_text())["counters"][M.SKIPPED_IN_A_ROW] == 1
    resumed = make_trainer(tmp_path, reward=nan_reward("all"), value_model=critic(), **settings)
    with pytest.raises(RuntimeError, match="max_skipped_iterations=2"):
        resumed.train(resume_from_checkpoint=str(checkpoint))  # the 2nd skip in a row, across the resume
    assert resumed.state.global_step == 1


@pytest.mark.parametrize(
    "pattern, limit, total, stops_at, message",
    [
        ("SSS", 3, 10, 3, "3 iterations in a row"),
        ("SST", 3, 10, None, None),  # a trained iteration resets the run
        ("STSTST", 2, 10, None, None),
        ("STSS", 2, 10, 4, "2 iterations in a row"),
        ("S", 1, 10, 1, "1 iterations in a row"),
        ("TTT", 1, 3, None, None),
        ("SS", 3, 2, 2, "every one of the run's 2 iterations"),  # a short run that never trained
        ("TS", 3, 2, None, None),
    ],
)
def test_skips_in_a_row_are_counted_and_stop_the_run(pattern, limit, total, stops_at, message):
    state = PPOState()
    counters = state.counters
    for iteration, kind in enumerate(pattern, start=1):
        problem = "non-finite values (1)" if kind == "S" else None
        if iteration == stops_at:
            with pytest.raises(RuntimeError, match=rf"max_skipped_iterations={limit}\b") as error:
                state.count_iteration(problem, iteration, total, limit)
            assert message in str(error.value) and "the last had non-finite values (1)" in str(error.value)
            return
        state.count_iteration(problem, iteration, total, limit)
    assert stops_at is None
    assert counters[M.SKIPPED_ITERATIONS] == pattern.count("S")
    assert counters[M.SKIPPED_IN_A_ROW] == len(pattern) - len(pattern.rstrip("S"))


def test_a_run_whose_every_optimizer_step_is_skipped_stops_with_an_error(tmp_path, monkeypatch):
    """Issue 26, bad 5: skipped updates used to end the run normally, untrained; they count as skipped iterations."""
    trainer = make_trainer(tmp_path, total_episodes=64, max_skipped_iterations=2)
    original = trainer.updater.micro_batch_loss

    def poisoned(*args):
        loss, stats = original(*args)
        return loss * math.nan, stats

    monkeypatch.setattr(trainer.updater, "micro_batch_loss", poisoned)
    before = snapshot(trainer.model)
    with pytest.raises(RuntimeError, match=r"Stopped at iteration 2: 2 iterations in a row .*all 2 optimizer steps"):
        trainer.train()
    assert changed(before, trainer.model) == 0


def test_a_short_run_whose_every_iteration_is_skipped_fails(tmp_path):
    trainer = make_trainer(tmp_path, reward=nan_reward("all"), value_model=critic(), max_skipped_iterations=3)
    with pytest.raises(RuntimeError, match=r"every one of the run's 2 iterations .*max_skipped_iterations=3"):
        trainer.train()  # 2 iterations, both skipped: fewer than max_skipped_iterations, but nothing trained


@pytest.mark.parametrize(
    "stats, named",
    [
        ({"reward_mean": NAN}, "reward_mean=nan"),
        ({"reward_std": INF}, "reward_std=inf"),
        ({"reward_stats_count": NAN}, "reward_stats_count=nan"),
        ({"reward_std": -1.0}, "reward_std=-1.0"),
        ({"reward_mean": NAN, "reward_std": NAN}, "reward_mean=nan, reward_std=nan"),
    ],
)
@pytest.mark.parametrize("reward_norm", ["running", "none"])
def test_non_finite_stored_reward_statistics_are_rejected_at_init(tmp_path, stats, named, reward_norm):
    reward_model = build_models()[2]
    for key, value in {"reward_mean": 0.5, "reward_std": 2.0, "reward_stats_count": 100.0, **stats}.items():
        setattr(reward_model.config, key, value)
    with pytest.raises(ValueError, match=named) as error:
        make_trainer(tmp_path, reward=reward_model, reward_norm=reward_norm)
    assert "config.json" in str(error.value)


def test_valid_stored_reward_statistics_still_seed_the_moments(tmp_path):
    reward_model = build_models()[2]
    for key, value in {"reward_mean": 0.5, "reward_std": 2.0, "reward_stats_count": 100.0}.items():
        setattr(reward_model.config, key, value)
    moments = make_trainer(tmp_path, reward=reward_model).ppo_state.running_reward
    assert (moments.count, moments.mean, moments.std) == pytest.approx((100.0, 0.5, 2.0))


# ------------------------------------------------------------------------------------------------------------------
# Core: losses and whitening with nothing left to average over
# ------------------------------------------------------------------------------------------------------------------
def test_losses_on_an_empty_mask_are_zero_with_a_zero_gradient():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    empty, half = torch.zeros(2, 2), torch.tensor([[1, 1], [0, 0]])
    assert core.masked_loss_mean(x, half).item() == pytest.approx(1.5)  # = masked_mean where the mask is not empty
    loss = core.masked_loss_mean(x, empty)
    loss.backward()
    assert loss.item() == 0.0 and torch.all(x.grad == 0)
    pg_loss, _ = core.clipped_policy_loss(x, x.detach(), torch.ones(2, 2), empty, 0.2)
    vf_loss, _ = core.clipped_value_loss(x, x.detach(), torch.ones(2, 2), empty, 0.2)
    entropy, stats = core.entropy_loss(x, empty)
    assert (pg_loss.item(), vf_loss.item(), entropy.item()) == (0.0, 0.0, 0.0)
    assert math.isnan(stats["entropy"])  # a statistic of nothing stays NaN (the trainer averages with nanmean)


@pytest.mark.parametrize(
    "mask, shift_mean, expected",
    [
        ([[0, 0, 0]], True, [[0.0, 0.0, 0.0]]),
        ([[0, 0, 0]], False, [[0.0, 0.0, 0.0]]),
        ([[0, 1, 0]], True, [[0.0, 0.0, 0.0]]),  # one element: centred, nothing to scale
        ([[0, 1, 0]], False, [[0.0, 5.0, 0.0]]),
    ],
)
def test_masked_whiten_with_fewer_than_two_elements(mask, shift_mean, expected):
    x = torch.tensor([[NAN, 5.0, 7.0]])
    out = core.masked_whiten(x, torch.tensor(mask), shift_mean=shift_mean)
    assert out.tolist() == expected
