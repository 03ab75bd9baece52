"""CollapseMonitor: the pattern-collapse early warnings (§5.2) on synthetic log sequences, plus one real tiny run."""

from __future__ import annotations

import json
import logging
import random

import pytest
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import CallbackHandler

from trl_ppomax.data.files import last_checkpoint_before
from trl_ppomax.ppo.monitor import CollapseMonitor

LOGGER = "trl_ppomax.ppo.monitor"
HEALTHY = {
    "objective/kl": 1.0,
    "policy/perplexity": 8.0,
    "policy/ref_perplexity": 8.0,
    "response/length": 100.0,
    "objective/scores": 0.0,
    "objective/scores_std": 1.0,
    "objective/scores_p95": 1.6,
    "objective/scores_p05": -1.6,
    "policy/entropy": 2.0,
}


@pytest.fixture
def args(tmp_path):
    return TrainingArguments(output_dir=str(tmp_path), report_to="none")


def log(**changes) -> dict[str, float]:
    """A healthy training log with ``changes`` (``objective_kl=3`` sets ``objective/kl``)."""
    return {**HEALTHY, **{name.replace("_", "/", 1): value for name, value in changes.items()}}


def feed(monitor, args, logs, state=None, control=None):
    """Feed ``logs`` as steps 1, 2, ... (each log's step is its position); return (state, control, logs)."""
    state = state or TrainerState()
    control = control or TrainerControl()
    for entry in logs:
        state.global_step += 1
        result = monitor.on_log(args, state, control, logs=entry)
        assert result is None  # the callback changes `control` in place
    return state, control, logs


def warmup(n=3):
    return [log() for _ in range(n)]


def test_healthy_noisy_run_stays_quiet(args, caplog):
    rng = random.Random(0)
    logs = [
        log(
            objective_kl=1.0 + 0.05 * i + rng.uniform(-0.5, 0.5),
            policy_perplexity=8.0 * rng.uniform(0.8, 1.2),
            response_length=100.0 * rng.uniform(0.85, 1.15),
            objective_scores=0.1 * i + rng.uniform(-0.3, 0.3),
        )
        for i in range(60)
    ]
    for entry in logs:
        entry["objective/scores_p95"] = entry["objective/scores"] + rng.uniform(1.3, 2.2)
    monitor = CollapseMonitor()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        feed(monitor, args, logs)
    assert monitor.healthy and monitor.events == [] and caplog.text == ""
    assert monitor.logs_seen == 60
    assert monitor.reference["response/length"] == pytest.approx(sum(e["response/length"] for e in logs[:3]) / 3)
    assert all(entry["collapse/any"] == 0.0 for entry in logs[3:])
    assert not any("collapse/any" in entry for entry in logs[:3])  # nothing is checked during the warm-up


def test_kl_exploding_fires_after_patience(args, caplog):
    monitor = CollapseMonitor()
    logs = [*warmup(), log(), log(objective_kl=25.0), log(objective_kl=30.0), log(objective_kl=40.0)]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        feed(monitor, args, logs[:5])
        assert monitor.healthy  # holds on one log only so far
        feed(monitor, args, logs[5:], state=TrainerState(global_step=5))
    assert not monitor.healthy
    assert len(monitor.events) == 1  # stays active without a new event
    event = monitor.events[0]
    assert (event["step"], event["signal"], event["value"], event["threshold"]) == (6, "kl", 30.0, 20.0)
    assert event["since_step"] == 5
    assert "collapse/kl" not in logs[4] and logs[4]["collapse/any"] == 0.0
    assert logs[5]["collapse/kl"] == 1.0 and logs[5]["collapse/any"] == 1.0
    assert logs[6]["collapse/kl"] == 1.0
    text = caplog.text
    assert "'kl'" in text and "30" in text and "max_kl = 20" in text
    assert "raise kl_coef" in text and "preset='ppo_max'" in text and "lower the learning rate" in text


def test_kl_rising_fast_fires_below_max_kl(args):
    monitor = CollapseMonitor(max_kl=100.0, max_kl_rise=5.0, window=5)
    kls = [1.0, 1.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0]  # over 5 logs: +5 (step 8), +6, +7
    feed(monitor, args, [log(objective_kl=kl) for kl in kls])
    assert [(e["signal"], e["step"], e["since_step"]) for e in monitor.events] == [("kl", 10, 9)]
    assert monitor.events[0]["value"] == pytest.approx(10.0 - 3.0)
    assert monitor.events[0]["threshold"] == 5.0


def test_perplexity_dropping_fires(args):
    monitor = CollapseMonitor()
    feed(monitor, args, [*warmup(), log(policy_perplexity=6.0), log(policy_perplexity=3.9), log(policy_perplexity=3)])
    assert [(e["signal"], e["step"]) for e in monitor.events] == [("perplexity", 6)]
    assert monitor.events[0]["threshold"] == pytest.approx(4.0)  # 0.5 × reference 8


@pytest.mark.parametrize(
    "lengths", [[150.0, 250.0, 250.0], [60.0, 45.0, 40.0]], ids=["more than doubling", "shrinking"]
)
def test_length_jumping_or_shrinking_fires(args, lengths):
    monitor = CollapseMonitor()
    feed(monitor, args, [*warmup(), *(log(response_length=n) for n in lengths)])
    assert [(e["signal"], e["step"], e["since_step"]) for e in monitor.events] == [("length", 6, 5)]
    assert monitor.events[0]["threshold"] == (200.0 if lengths[0] > 100 else 50.0)


def test_reward_long_tail_fires(args):
    monitor = CollapseMonitor()
    # the mean reward rises while the 95th percentile runs far ahead of it: a few responses exploit the RM
    tails = [(0.5, 3.0), (1.0, 6.0), (1.2, 7.0)]
    logs = [log(objective_scores=mean, objective_scores_p95=p95) for mean, p95 in tails]
    feed(monitor, args, [*warmup(), *logs])
    assert [(e["signal"], e["step"]) for e in monitor.events] == [("reward_tail", 6)]
    assert monitor.events[0]["value"] == pytest.approx(5.8)
    assert monitor.events[0]["threshold"] == pytest.approx(3.0 * 1.6)


def test_reward_tail_needs_absolute_growth_when_the_reference_spread_is_zero(args):
    flat = [log(objective_scores=0.0, objective_scores_p95=0.0) for _ in range(3)]
    tiny = [log(objective_scores=0.0, objective_scores_p95=0.01) for _ in range(4)]  # ratio 1e4, growth 0.01
    monitor = CollapseMonitor()
    feed(monitor, args, [*flat, *tiny])
    assert monitor.healthy
    monitor = CollapseMonitor()
    feed(monitor, args, [*flat, *[log(objective_scores=0.0, objective_scores_p95=1.0)] * 2])
    assert [e["signal"] for e in monitor.events] == ["reward_tail"]


def test_single_spike_shorter_than_patience_is_ignored(args):
    monitor = CollapseMonitor(patience=2)
    spikes = [
        log(objective_kl=50.0),
        log(),
        log(policy_perplexity=1.0),
        log(),
        log(response_length=300.0),
        log(),
        log(objective_scores_p95=20.0),
        log(),
    ]
    _, _, logs = feed(monitor, args, [*warmup(), *spikes])
    assert monitor.healthy
    assert all(entry["collapse/any"] == 0.0 for entry in logs[3:])


def test_stop_training_points_at_the_last_healthy_checkpoint(args, tmp_path, caplog):
    for step in (2, 4, 6):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / ".tmp-checkpoint-3").mkdir()  # an unfinished save is never a checkpoint
    (tmp_path / "checkpoint-1").write_text("not a folder")
    (tmp_path / "checkpoint-5-old").mkdir()  # not a name transformers writes
    monitor = CollapseMonitor(stop_training=True)
    logs = [*warmup(), log(), log(objective_kl=30.0), log(objective_kl=30.0)]  # collapse begins at step 5
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _, control, _ = feed(monitor, args, logs)
    assert control.should_training_stop
    assert monitor.events[0]["since_step"] == 5 and monitor.events[0]["step"] == 6
    assert monitor.last_healthy_checkpoint == str(tmp_path / "checkpoint-4")
    assert "Stopping training" in caplog.text and str(tmp_path / "checkpoint-4") in caplog.text


def test_no_stop_by_default_and_no_checkpoint_before_the_collapse(args, tmp_path, caplog):
    (tmp_path / "checkpoint-6").mkdir()
    monitor = CollapseMonitor(patience=1, stop_training=True)
    _, control, _ = feed(monitor, args, [*warmup(), log(objective_kl=30.0)])
    assert control.should_training_stop and monitor.last_healthy_checkpoint is None
    monitor = CollapseMonitor(patience=1)
    _, control, _ = feed(monitor, args, [*warmup(), log(objective_kl=30.0)])
    assert not control.should_training_stop and not monitor.healthy
    assert last_checkpoint_before(tmp_path / "missing", 10) is None


def test_eval_and_other_logs_are_ignored(args):
    monitor = CollapseMonitor(patience=1)
    bad_eval = {f"eval_{name}": value for name, value in log(objective_kl=99.0, policy_perplexity=0.1).items()}
    logs = [*warmup(), bad_eval, {"train_runtime": 3.0}, {}, bad_eval]
    feed(monitor, args, logs)
    assert monitor.healthy and monitor.logs_seen == 3
    assert "collapse/any" not in bad_eval


def test_thresholds_are_configurable(args):
    drift = [log(objective_kl=15.0, response_length=130.0, policy_perplexity=5.0) for _ in range(3)]
    default = CollapseMonitor()
    feed(default, args, [*[log(objective_kl=15.0) for _ in range(3)], *drift])
    assert default.healthy
    strict = CollapseMonitor(max_kl=10.0, max_length_ratio=1.2, min_perplexity_ratio=0.7, patience=3, warmup_logs=2)
    feed(strict, args, [log(objective_kl=15.0), log(objective_kl=15.0), *drift])
    assert sorted(e["signal"] for e in strict.events) == ["kl", "length", "perplexity"]
    assert {e["step"] for e in strict.events} == {5}
    with pytest.raises(ValueError, match="patience"):
        CollapseMonitor(patience=0)
    with pytest.raises(ValueError, match="min_length_ratio"):
        CollapseMonitor(min_length_ratio=2.0)


def test_logs_dict_is_shared_with_later_callbacks_and_log_history(args):
    """CallbackHandler passes the same dict to each callback, so callbacks after the monitor see collapse/*."""

    class Recorder(TrainerCallback):
        def __init__(self):
            self.seen = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.seen.append(dict(logs))

    monitor, recorder = CollapseMonitor(patience=1), Recorder()
    handler = CallbackHandler([monitor, recorder], None, None, None, None)
    state, control = TrainerState(), TrainerControl()
    for entry in [*warmup(), log(objective_kl=30.0)]:
        state.global_step += 1
        state.log_history.append({**entry, "step": state.global_step})  # what Trainer.log does first
        handler.on_log(args, state, control, entry)
    assert recorder.seen[-1]["collapse/kl"] == 1.0 and recorder.seen[-1]["collapse/any"] == 1.0
    assert state.log_history[-1]["collapse/kl"] == 1.0
    assert "collapse/any" not in state.log_history[0]

    class FakeTrainer:
        callback_handler = CallbackHandler([recorder], None, None, None, None)

    trainer = FakeTrainer()
    monitor.attach(trainer)
    monitor.attach(trainer)
    assert trainer.callback_handler.callbacks == [monitor, recorder]


def test_state_round_trip_and_resume(args, tmp_path):
    monitor = CollapseMonitor(max_kl=10.0, patience=1)
    logs = [*warmup(), log(objective_kl=12.0), log(), log(objective_kl=12.0, policy_perplexity=7.9)]
    state, _, _ = feed(monitor, args, logs)
    saved = json.loads(json.dumps(monitor.state_dict()))  # JSON-serialisable
    assert saved["reference"]["policy/perplexity"] == 8.0 and saved["_logs_seen"] == 6
    assert [e["step"] for e in saved["events"]] == [4, 6]

    restored = CollapseMonitor(max_kl=10.0, patience=1)
    restored.load_state_dict(saved)
    assert restored.state_dict() == monitor.state_dict()
    with pytest.raises(KeyError):
        restored.load_state_dict({"bogus": 1})

    exported = CollapseMonitor.from_state(json.loads(json.dumps(monitor.state())))  # transformers' ExportableState
    assert exported.max_kl == 10.0 and exported.state_dict() == monitor.state_dict()

    # The monitor keeps its state in state.stateful_callbacks, so trainer_state.json of a checkpoint carries it and a
    # resumed run picks it up at on_train_begin.
    state.save_to_json(str(tmp_path / "trainer_state.json"))
    resumed_state = TrainerState.load_from_json(str(tmp_path / "trainer_state.json"))
    resumed = CollapseMonitor(max_kl=10.0, patience=1)
    resumed.on_train_begin(args, resumed_state, TrainerControl())
    assert resumed.state_dict() == monitor.state_dict()
    feed(resumed, args, [log(objective_kl=12.0)], state=resumed_state)
    assert [e["step"] for e in resumed.events] == [4, 6]  # still active since step 6: no new event

    fresh = CollapseMonitor()
    fresh.on_train_begin(args, TrainerState(stateful_callbacks=dict(resumed_state.stateful_callbacks)), None)
    assert fresh.reference is None  # a run from step 0 starts from scratch


def test_real_tiny_run_feeds_the_monitor_and_stays_quiet(tmp_path, caplog):
    from helpers import make_trainer

    trainer = make_trainer(tmp_path, total_episodes=32)
    monitor = CollapseMonitor(warmup_logs=1, patience=1)  # this run logs only twice: check the second log
    trainer.add_callback(monitor)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        trainer.train()
    train_logs = [entry for entry in trainer.state.log_history if "objective/kl" in entry]
    assert monitor.logs_seen == len(train_logs) >= 2
    assert monitor.healthy and monitor.reference["policy/perplexity"] > 1.0
    assert "Possible pattern collapse" not in caplog.text
    assert [entry.get("collapse/any") for entry in train_logs] == [None] + [0.0] * (len(train_logs) - 1)
    assert trainer.state.stateful_callbacks["CollapseMonitor"]["attributes"]["_logs_seen"] == len(train_logs)
