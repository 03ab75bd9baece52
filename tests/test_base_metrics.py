"""One source for metric names: everything the readers (CollapseMonitor, the figures, the toy world) look up in the
logs is a name a real tiny run logs. Renaming a metric in the trainer without changing ``trl_ppomax.base.metrics`` (which
the readers use) fails here."""

from __future__ import annotations

import pytest
from datasets import Dataset

from trl_ppomax.base import metrics
from trl_ppomax.base.metrics import eval_name
from trl_ppomax.ppo.monitor import CollapseMonitor
from trl_ppomax.reporting import plotting
from trl_ppomax.toyworld import pipeline
from trl_ppomax.toyworld.tiny import prompt_texts

# User-supplied rollout metrics: the trainer logs them (and eval_<name>) only when they are passed as
# ``rollout_metrics`` (the toy world passes its gold reward). The figures draw them when present, so they are read
# but not promised by the trainer; test_ppo_trainer.py checks that rollout metrics are logged under their own names.
USER_ROLLOUT_METRICS = {metrics.GOLD_REWARD, eval_name(metrics.GOLD_REWARD)}


@pytest.fixture(scope="module")
def logged_keys(tmp_path_factory) -> set[str]:
    """Every key of ``state.log_history`` of a two-iteration run evaluated after each iteration, with the monitor and
    the win-rate callback."""
    from helpers import make_trainer

    from trl_ppomax.judging.callback import WinRateCallback

    trainer = make_trainer(
        tmp_path_factory.mktemp("metrics"),
        total_episodes=32,
        eval_dataset=Dataset.from_dict({"prompt": prompt_texts(4)}),
        eval_strategy="steps",
        eval_steps=1,
    )
    CollapseMonitor(warmup_logs=1).attach(trainer)  # adds collapse/any from the second training log on
    trainer.add_callback(WinRateCallback(trainer, every=1, num_prompts=4))  # adds eval/win_rate_vs_sft, …
    trainer.train()
    keys = {key for entry in trainer.state.log_history for key in entry}
    assert any(key.startswith("eval_") for key in keys)  # the run did evaluate
    return keys


def test_every_per_response_metric_is_logged_in_training_and_evaluation(logged_keys):
    missing = {name for name in metrics.PER_RESPONSE if name not in logged_keys}
    missing |= {eval_name(name) for name in metrics.PER_RESPONSE if eval_name(name) not in logged_keys}
    assert not missing, f"in metrics.PER_RESPONSE but not logged: {sorted(missing)}"


def test_the_monitor_reads_only_logged_metrics(logged_keys):
    assert {metrics.KL, metrics.POLICY_PERPLEXITY, metrics.RESPONSE_LENGTH} <= CollapseMonitor.metrics_read
    missing = CollapseMonitor.metrics_read - logged_keys
    assert not missing, f"read by CollapseMonitor but not logged: {sorted(missing)}"
    assert metrics.COLLAPSE_ANY in CollapseMonitor.metrics_written & logged_keys


def test_the_figures_read_only_logged_metrics(logged_keys):
    read = plotting.METRICS_READ - USER_ROLLOUT_METRICS
    assert {metrics.KL, eval_name(metrics.KL), plotting.COLLAPSE_KEY, metrics.EPISODE} <= read
    assert not read - logged_keys, f"read by plotting but not logged: {sorted(read - logged_keys)}"


def test_the_toy_world_reads_only_logged_metrics(logged_keys):
    read = {*pipeline.SUMMARY_KEYS.values(), *pipeline.CURVE_KEYS.values(), metrics.EPISODE} - USER_ROLLOUT_METRICS
    assert not read - logged_keys, f"read by the toy world but not logged: {sorted(read - logged_keys)}"
    assert set(pipeline.GOLD_METRICS) == {metrics.GOLD_REWARD}


def test_eval_name():
    assert eval_name(metrics.KL) == "eval_objective/kl"
    assert eval_name(metrics.KL, prefix="test") == "test_objective/kl"
