"""What the terminal shows also reaches the trackers: completions tables and figures logged to a stub ``wandb``
(injected into ``sys.modules``, so nothing tries the network) and to TensorBoard (read back from its event files),
``trl-ppomax plot --report-to``, and the toy-world demo's compact log table."""

from __future__ import annotations

import json
import sys
from types import ModuleType, SimpleNamespace

import pandas as pd
import pytest
from datasets import Dataset
from helpers import SMOKE, make_trainer
from transformers import TrainerControl, TrainerState

from trl_ppomax.cli import main
from trl_ppomax.reporting import plotting
from trl_ppomax.toyworld.demo import CompactLogCallback
from trl_ppomax.toyworld.tiny import prompt_texts


class StubTable:
    def __init__(self, dataframe):
        self.dataframe = dataframe


class StubImage:
    def __init__(self, path):
        self.path = path


@pytest.fixture
def stub_wandb(monkeypatch):
    module = ModuleType("wandb")
    module.logged = []
    module.run = SimpleNamespace(url="https://wandb.ai/me/p/runs/abc")
    module.Table, module.Image = StubTable, StubImage
    module.log = lambda data, **kwargs: module.logged.append(data)
    module.inits, module.finished = [], []
    module.init = lambda **kwargs: module.inits.append(kwargs)
    module.finish = lambda: module.finished.append(True)
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def test_no_tracker_without_report_to(stub_wandb):
    args = SimpleNamespace(report_to=["mlflow"])
    assert plotting.active_trackers(args) == []
    assert plotting.log_table(args, "t", [{"a": 1}]) == []
    assert stub_wandb.logged == []


def test_completions_table_logged_to_wandb(tmp_path, stub_wandb):
    trainer = make_trainer(tmp_path, total_episodes=8)
    trainer.args.report_to = ["wandb"]  # set after init: the Trainer's own WandbCallback is not wanted here
    rows = trainer.generate_completions(num_prompts=3)
    (entry,) = stub_wandb.logged
    frame = entry["completions"].dataframe
    assert list(frame.columns) == ["step", "query", "response", "score"]
    assert len(frame) == len(rows) == 3 and list(frame["response"]) == [r["response"] for r in rows]


def test_images_logged(tmp_path, stub_wandb):
    args = SimpleNamespace(report_to=["wandb"], output_dir=str(tmp_path))
    state = TrainerState()
    state.log_history = [{"episode": 8, "objective/scores": 0.1, "objective/kl": 0.0, "step": 1}]
    plotting.DynamicsFigureCallback().on_train_end(args, state, TrainerControl())
    (entry,) = stub_wandb.logged
    assert entry["training_dynamics"].path.endswith("training_dynamics.png")
    assert (tmp_path / "training_dynamics.png").is_file()
    assert plotting.log_image(args, "reward_margins", tmp_path / "training_dynamics.png") == ["wandb"]


def test_demo_prints_a_compact_table(capsys):
    callback, state = CompactLogCallback(), TrainerState()
    for step in (1, 2):
        state.global_step = step
        logs = {"objective/scores": 0.5, "gold/reward": -0.25, "objective/kl": 0.01, "response/length": 7.0}
        callback.on_log(None, state, TrainerControl(), logs={**logs, "policy/perplexity": 3.0})
    callback.on_log(None, state, TrainerControl(), logs={"eval_objective/scores": 1.0})  # evaluation: no row
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["step", "gold", "proxy", "KL", "length", "ppl"]
    assert lines[1].split() == ["1", "-0.250", "0.500", "0.010", "7.000", "3.000"]
    assert len(lines) == 3


# --------------------------------------------------------------------------------------------------------------
# TensorBoard


def tensorboard_events(folder):
    """Everything in the event files of ``folder`` (all of them, as TensorBoard reads a run)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"tensors": 0, "images": 0, "scalars": 0})
    events.Reload()
    return events


def test_markdown_table_escapes_pipes_and_line_breaks():
    frame = pd.DataFrame({"step": [3, 3], "query": ["a|b", "x"], "response": ["one\ntwo", "y\r\nz"]})
    assert plotting.markdown_table(frame).splitlines() == [
        "| step | query | response |",
        "| --- | --- | --- |",
        "| 3 | a\\|b | one<br>two |",
        "| 3 | x | y<br>z |",
    ]


@pytest.mark.slow  # seconds (the README's command stays under 4 minutes; .ci/run runs it)
def test_tensorboard_run_holds_completions_and_figure(tmp_path, monkeypatch):
    """Item 12 of issue 26: a ``report_to="tensorboard"`` run writes the completions (text) and the training-dynamics
    figure (image) into the run's own TensorBoard folder, beside its scalars."""
    pytest.importorskip("tensorboard")
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    trainer = make_trainer(
        tmp_path,
        **{**SMOKE, "report_to": "tensorboard", "num_sample_generations": 1},
        eval_dataset=Dataset.from_dict({"prompt": prompt_texts(3)}),
    )
    samples = []
    generate = trainer.generate_completions
    monkeypatch.setattr(trainer, "generate_completions", lambda **kw: samples.append(generate(**kw)) or samples[-1])
    trainer.train()
    assert samples, "num_sample_generations=1 printed no samples"

    out = tmp_path / "out"
    (folder,) = {path.parent for path in out.rglob("events.out.tfevents.*")}  # one run: the Trainer's folder
    events = tensorboard_events(folder)
    assert "train/objective/scores" in events.Tags()["scalars"]
    (text,) = events.Tensors("completions/text_summary")
    columns = {name: [row[name] for row in samples[-1]] for name in ("query", "response", "score")}
    frame = pd.DataFrame({"step": [text.step] * len(samples[-1]), **columns})
    assert text.tensor_proto.string_val[0].decode() == plotting.markdown_table(frame)
    assert len(samples[-1]) == 3 and text.step == trainer.state.global_step
    (image,) = events.Images("training_dynamics")
    assert image.step == trainer.state.global_step and image.width > 100 and image.height > 100
    assert image.encoded_image_string.startswith(b"\x89PNG")

    # `trl-ppomax plot --report-to tensorboard` adds its figure to the same run (the newest RUN_DIR/runs/* folder)
    trainer.save_state()  # RUN_DIR/trainer_state.json
    assert main(["plot", str(out), "--output", str(tmp_path / "again.png"), "--report-to", "tensorboard"]) == 0
    assert len(tensorboard_events(folder).Images("training_dynamics")) == 2


def write_state(folder, history):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 3, "log_history": history}))


HISTORY = [{"episode": 8.0 * step, "step": step, "objective/scores": 0.1 * step} for step in (1, 2, 3)]


def test_cli_plot_logs_the_figure_to_tensorboard(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tensorboard")
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    write_state(tmp_path / "run", HISTORY)
    argv = ["plot", str(tmp_path / "run"), "--report-to", "tensorboard", "--logging-dir", str(tmp_path / "tb")]
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "Logged as training_dynamics to tensorboard"
    (image,) = tensorboard_events(tmp_path / "tb").Images("training_dynamics")
    assert image.step == 3 and image.encoded_image_string.startswith(b"\x89PNG")

    assert main(["plot", str(tmp_path / "run"), "--report-to", "tensorboard"]) == 0  # no events yet: RUN_DIR/runs
    assert len(tensorboard_events(tmp_path / "run" / "runs").Images("training_dynamics")) == 1


def test_cli_plot_starts_a_wandb_run_and_finishes_it(tmp_path, stub_wandb, monkeypatch):
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    write_state(tmp_path / "run", HISTORY)
    assert main(["plot", str(tmp_path / "run"), "--report-to", "wandb", "--run-name", "ppo-1"]) == 0
    assert stub_wandb.inits == [{"project": "huggingface", "name": "ppo-1", "resume": "allow"}]
    (entry,) = stub_wandb.logged
    assert entry["training_dynamics"].path == str(tmp_path / "run" / "training_dynamics.png")
    assert stub_wandb.finished == [True]


def test_cli_plot_names_a_tracker_that_is_not_installed(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "trackio", None)  # import trackio raises ImportError
    write_state(tmp_path / "run", HISTORY)
    assert main(["plot", str(tmp_path / "run"), "--report-to", "trackio"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trl-ppomax plot: error: --report-to trackio:") and "trl-ppomax[trackio]" in err
