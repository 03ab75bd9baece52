"""Training-dynamics figures: panels from the logged metrics, loading a run's log history, the ``plot`` command."""

from __future__ import annotations

import json
import math

import pytest

from trl_ppomax.cli import main
from trl_ppomax.reporting.plotting import (
    METRICS_READ,
    PANELS,
    load_log_history,
    panels_for,
    plot_training_dynamics,
    training_dynamics_figure,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL_PANELS = ["reward", "gold_reward", "kl", "perplexity", "response_length", "policy_loss", "value_loss"]


def synthetic_history(steps=20, gold=True, eval_every=5, collapse_at=12, episodes_per_step=16):
    """Train logs every step with the plotted keys, evaluation logs (no episode, as the trainer writes them) every
    few steps, one collapse flag, and a final summary log without metrics."""
    history = []
    for step in range(1, steps + 1):
        log = {
            "episode": float(step * episodes_per_step),
            "step": step,
            "epoch": step / steps,
            "objective/scores": 0.1 * step,
            "objective/scores_normalized": math.tanh(0.1 * step),
            "objective/kl": 0.05 * step**1.5,
            "policy/perplexity": 20.0 - 0.5 * step,
            "policy/ref_perplexity": 20.0,
            "response/length": 30.0 + step,
            "loss/policy": -0.01 * step,
            "loss/value": 1.0 / step,
            "collapse/any": float(step == collapse_at),
        }
        if gold:
            log["gold/reward"] = 0.05 * step - 0.004 * step**2
        history.append(log)
        if step % eval_every == 0:
            ev = {
                "step": step,
                "epoch": step / steps,
                "eval_objective/scores": 0.1 * step + 0.05,
                "eval_policy/perplexity": 19.0 - 0.5 * step,
                "eval_objective/kl": 0.04 * step**1.5,
                "eval_response/length": 29.0 + step,
            }
            if gold:
                ev["eval_gold/reward"] = 0.04 * step
            history.append(ev)
    history.append({"step": steps, "train_runtime": 1.0, "train_loss": 0.0})
    return history


def assert_png(path):
    data = path.read_bytes()
    assert len(data) > 1000
    assert data[:8] == PNG_MAGIC


def write_state(folder, history):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 1, "log_history": history}))


# --------------------------------------------------------------------------------------------------------------
# panels


def test_panels_for_a_full_history():
    assert panels_for(synthetic_history()) == ALL_PANELS


def test_no_gold_panel_without_gold_keys():
    assert panels_for(synthetic_history(gold=False)) == [p for p in ALL_PANELS if p != "gold_reward"]


def test_panels_for_partial_and_odd_values():
    assert panels_for([]) == []
    assert panels_for([{"step": 1, "train_runtime": 3.0, "collapse/any": 1.0}]) == []
    assert panels_for([{"step": 1, "objective/kl": 0.3}]) == ["kl"]
    # an evaluation-only metric still gets its panel; NaN, None, strings and bools are not data
    assert panels_for([{"step": 1, "eval_gold/reward": 0.5}]) == ["gold_reward"]
    assert (
        panels_for([{"objective/kl": float("nan"), "loss/value": None, "loss/policy": "x", "gold/reward": True}]) == []
    )


def test_every_panel_key_is_documented_or_from_the_toy_world():
    keys = {key for panel in PANELS.values() for key in panel.keys}
    assert {"objective/scores", "objective/scores_normalized", "gold/reward", "eval_gold/reward"} <= keys


def test_figure_has_one_axes_per_panel_with_eval_markers_and_collapse_lines():
    history = synthetic_history(steps=20, eval_every=5, collapse_at=12)
    fig = training_dynamics_figure(history, title="demo")
    assert [ax.get_title() for ax in fig.axes] == [PANELS[name].title for name in ALL_PANELS]
    assert fig.get_suptitle() == "demo"
    by_title = {ax.get_title(): ax for ax in fig.axes}
    reward = by_title["Reward"]
    lines = {line.get_label(): line for line in reward.get_lines()}
    assert len(lines["score (raw)"].get_xdata()) == 20
    # the evaluation logs have no episode: their x comes from their step
    assert list(lines["eval score (raw)"].get_xdata()) == [80.0, 160.0, 240.0, 320.0]
    assert lines["eval score (raw)"].get_linestyle() == "None"
    # the collapse is a vertical red line at episode 12 * 16 on every panel
    for ax in fig.axes:
        vertical = [line for line in ax.get_lines() if list(line.get_xdata()) == [192.0, 192.0]]
        assert len(vertical) == 1 and vertical[0].get_color() == "red"
        assert ax.get_xlabel() == "episode"
    assert "collapse" in [t.get_text() for t in reward.get_legend().get_texts()]


def test_falls_back_to_step_without_episode():
    history = [{k: v for k, v in log.items() if k != "episode"} for log in synthetic_history(gold=False)]
    fig = training_dynamics_figure(history)
    assert len(fig.axes) == 6
    assert {ax.get_xlabel() for ax in fig.axes} == {"step"}
    kl = next(ax for ax in fig.axes if ax.get_title() == "KL to reference")
    assert list(kl.get_lines()[0].get_xdata())[:3] == [1, 2, 3]


def test_only_panels_with_data_are_drawn():
    fig = training_dynamics_figure([{"step": s, "episode": 8.0 * s, "loss/value": 1.0 / s} for s in (1, 2, 3)])
    assert [ax.get_title() for ax in fig.axes] == ["Value loss"]


def test_nothing_to_plot_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="none of the metrics"):
        plot_training_dynamics([{"step": 1, "train_runtime": 2.0}], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


# --------------------------------------------------------------------------------------------------------------
# writing the PNG


@pytest.mark.slow  # seconds (the README's command stays under 4 minutes; .ci/run runs it)
def test_plot_writes_a_png_and_creates_folders(tmp_path):
    path = tmp_path / "a" / "b" / "dynamics.png"
    result = plot_training_dynamics(synthetic_history(), path, title="PPO-max")
    assert result == str(path)
    assert_png(path)


@pytest.mark.slow  # seconds (the README's command stays under 4 minutes; .ci/run runs it)
def test_overlay_of_other_runs_has_a_legend_per_run(tmp_path):
    extra = {"vanilla": synthetic_history(steps=15, gold=False, collapse_at=7), "no-norm": synthetic_history(10)}
    fig = training_dynamics_figure(synthetic_history(), extra=extra, name="ppo_max")
    assert len(fig.axes) == len(ALL_PANELS)  # union of the runs' panels
    reward = next(ax for ax in fig.axes if ax.get_title() == "Reward")
    labels = [t.get_text() for t in reward.get_legend().get_texts()]
    for run in ("ppo_max", "vanilla", "no-norm"):
        assert f"{run}: score (raw)" in labels
    gold = next(ax for ax in fig.axes if ax.get_title() == "Gold reward")
    assert not any(line.get_label().startswith("vanilla") for line in gold.get_lines())
    # each run keeps one colour across its series
    colours = {line.get_color() for line in reward.get_lines() if line.get_label().startswith("vanilla:")}
    assert len(colours) == 1

    assert plot_training_dynamics(synthetic_history(), tmp_path / "cmp.png", extra=extra) == str(tmp_path / "cmp.png")
    assert_png(tmp_path / "cmp.png")


def test_baselines_are_horizontal_lines_on_their_panels():
    fig = training_dynamics_figure(synthetic_history(), baselines={"SFT": {"gold/reward": -0.2, "absent/key": 1.0}})
    gold = next(ax for ax in fig.axes if ax.get_title() == "Gold reward")
    (sft,) = [line for line in gold.get_lines() if line.get_label() == "SFT"]
    assert list(sft.get_ydata()) == [-0.2, -0.2] and sft.get_color() == "black" and sft.get_linestyle() == ":"
    assert "SFT" in [t.get_text() for t in gold.get_legend().get_texts()]
    others = [line for ax in fig.axes if ax is not gold for line in ax.get_lines()]
    assert not any(line.get_label() == "SFT" for line in others)


def test_metrics_read_are_the_panels_collapse_and_x_keys():
    panel_keys = {key for panel in PANELS.values() for key in panel.keys}
    assert panel_keys | {"collapse/any", "episode", "step"} == METRICS_READ


def test_duplicate_run_name_is_an_error():
    with pytest.raises(ValueError, match="used twice"):
        training_dynamics_figure(synthetic_history(), extra={"run": synthetic_history()})


# --------------------------------------------------------------------------------------------------------------
# loading


def test_load_from_run_dir(tmp_path):
    history = synthetic_history(steps=3)
    write_state(tmp_path, history)
    write_state(tmp_path / "checkpoint-9", history[:1])
    assert load_log_history(tmp_path) == history


def test_load_from_the_newest_checkpoint_by_number(tmp_path):
    for n in (2, 10, 9):
        write_state(tmp_path / f"checkpoint-{n}", [{"step": n, "loss/value": 1.0}])
    (tmp_path / "checkpoint-11").mkdir()  # incomplete: no trainer_state.json
    (tmp_path / "checkpoint-tmp-99").mkdir()
    write_state(tmp_path / "checkpoint-12-old", [{"step": 12}])  # not a name transformers writes
    assert load_log_history(str(tmp_path)) == [{"step": 10, "loss/value": 1.0}]


def test_missing_state_is_a_clear_error(tmp_path):
    (tmp_path / "checkpoint-3").mkdir()
    with pytest.raises(FileNotFoundError, match=r"trainer_state\.json.*checkpoint-N"):
        load_log_history(tmp_path)
    with pytest.raises(FileNotFoundError, match="run folder not found"):
        load_log_history(tmp_path / "absent")


def test_bad_state_file_is_a_value_error(tmp_path):
    (tmp_path / "trainer_state.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_log_history(tmp_path)
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    with pytest.raises(ValueError, match="no log_history"):
        load_log_history(tmp_path)


# --------------------------------------------------------------------------------------------------------------
# command line


@pytest.mark.slow  # seconds (the README's command stays under 4 minutes; .ci/run runs it)
def test_cli_plot_default_output(tmp_path, capsys):
    run = tmp_path / "run"
    write_state(run, synthetic_history())
    assert main(["plot", str(run)]) == 0
    out = capsys.readouterr().out.strip()
    assert out == str(run / "training_dynamics.png")
    assert_png(run / "training_dynamics.png")


@pytest.mark.slow  # seconds (the README's command stays under 4 minutes; .ci/run runs it)
def test_cli_plot_compare(tmp_path, capsys):
    write_state(tmp_path / "ppo_max", synthetic_history())
    write_state(tmp_path / "vanilla" / "checkpoint-5", synthetic_history(steps=5, gold=False))
    output = tmp_path / "figs" / "cmp.png"
    argv = ["plot", str(tmp_path / "ppo_max"), "--output", str(output)]
    argv += ["--compare", f"vanilla={tmp_path / 'vanilla'}", "--title", "PPO-max vs vanilla"]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == str(output)
    assert_png(output)


@pytest.mark.parametrize(
    ("argv_tail", "message"),
    [
        (["--compare", "novalue"], "NAME=RUN_DIR"),
        (["--compare", "=somewhere"], "NAME=RUN_DIR"),
        (["--compare", "x={missing}"], "run folder not found"),
        (["--compare", "x={run}", "x={run}"], "used twice"),
        (["--compare", "run={run}"], "name of RUN_DIR"),
    ],
)
def test_cli_plot_bad_compare(tmp_path, capsys, argv_tail, message):
    run = tmp_path / "run"
    write_state(run, synthetic_history())
    argv_tail = [a.format(run=run, missing=tmp_path / "missing") for a in argv_tail]
    assert main(["plot", str(run), *argv_tail]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trl-ppomax plot: error:") and message in err
    assert err.count("\n") == 1
    assert not (run / "training_dynamics.png").exists()


def test_cli_plot_missing_run_dir(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trl-ppomax plot: error:") and "trainer_state.json" in err and err.count("\n") == 1


def test_cli_plot_nothing_to_plot(tmp_path, capsys):
    write_state(tmp_path, [{"step": 1, "train_runtime": 1.0}])
    assert main(["plot", str(tmp_path)]) == 2
    assert "none of the metrics" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------------
# a real run


def test_plot_a_real_run(tmp_path, capsys):
    from helpers import make_trainer

    trainer = make_trainer(tmp_path, total_episodes=32, save_strategy="steps", save_steps=1)
    trainer.train()
    out = tmp_path / "out"
    history = load_log_history(out)  # no trainer_state.json at the top: the newest checkpoint's
    assert history == json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]
    assert {"reward", "kl", "perplexity", "response_length", "policy_loss", "value_loss"} <= set(panels_for(history))
    assert "gold_reward" not in panels_for(history)
    capsys.readouterr()  # training prints its logs
    assert main(["plot", str(out), "--compare", f"again={out}"]) == 0
    assert capsys.readouterr().out.strip() == str(out / "training_dynamics.png")
    assert_png(out / "training_dynamics.png")
