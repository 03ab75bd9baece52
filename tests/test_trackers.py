"""What the terminal shows also reaches the trackers: completions tables and figures logged to a stub ``wandb``
(injected into ``sys.modules``, so nothing tries the network), and the toy-world demo's compact log table."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace

import pytest
from helpers import make_trainer
from transformers import TrainerControl, TrainerState

from trl_ppomax import plotting
from trl_ppomax.toyworld.demo import CompactLogCallback


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
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def test_no_tracker_without_report_to(stub_wandb):
    args = SimpleNamespace(report_to=["tensorboard"])
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
