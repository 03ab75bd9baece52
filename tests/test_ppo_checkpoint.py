"""Output folders, checkpoints, resume and secrets (``trl_ppomax.ppo.checkpoint``, and the refusals of
``checkpoint_files`` met through a resume): nothing a user paid for is lost or mixed; a checkpoint that cannot be
resumed is refused with what to do. What an engine-only checkpoint must hold is in ``test_ppo_checkpoint_files.py``, the
output_dir lock in ``test_data_files.py``."""

from __future__ import annotations

import errno
import importlib.util
import json
import logging
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from helpers import StopAt, make_trainer, no_rollout
from safetensors.torch import load_file
from transformers import TrainerCallback

from trl_ppomax.cli import main
from trl_ppomax.data.files import DiskFullError
from trl_ppomax.ppo.checkpoint_files import CheckpointError
from trl_ppomax.reporting import hub
from trl_ppomax.toyworld.tiny import prompt_texts

# ==================================================================================================================
# Output folders, checkpoints, resume and secrets: nothing a user paid for is lost or mixed.
# ==================================================================================================================
SENTINEL = "hf_SENTINELsecretTokenDoNotPersist987654"


#: Three iterations of 16 episodes, a checkpoint after each.
RUN = dict(total_episodes=48, save_strategy="steps", save_steps=1)


class PolicyAtStart(TrainerCallback):
    """Records the policy's parameters when training begins (after a resume has loaded them)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.params = {name: p.detach().clone() for name, p in model.policy.named_parameters()}


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """The output_dir of a run of 3 iterations stopped after 2: checkpoint-1 and checkpoint-2 (copied per test)."""
    root = tmp_path_factory.mktemp("stopped")
    trainer = make_trainer(root, **RUN)
    trainer.add_callback(StopAt(2))
    trainer.train()
    return root / "out"


@pytest.fixture
def run_dir(stopped_run, tmp_path):
    """A copy of :func:`stopped_run` at ``tmp_path / "out"``, where ``make_trainer(tmp_path)`` writes."""
    shutil.copytree(stopped_run, tmp_path / "out")
    return tmp_path / "out"


def all_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------------------------------
# 1. Reusing an output_dir
# ------------------------------------------------------------------------------------------------------------------
def test_fresh_run_refuses_an_output_dir_holding_checkpoints(run_dir, tmp_path, monkeypatch):
    before = all_bytes(run_dir)
    trainer = no_rollout(make_trainer(tmp_path, **RUN), monkeypatch)
    with pytest.raises(ValueError) as caught:
        trainer.train()
    message = str(caught.value)
    for text in (
        str(run_dir),
        "checkpoint-1, checkpoint-2",
        "resume_from_checkpoint=True",
        "overwrite_output_dir=True",
    ):
        assert text in message, text
    assert all_bytes(run_dir) == before  # nothing touched


def test_overwrite_output_dir_deletes_the_old_checkpoints(run_dir, tmp_path, caplog):
    (run_dir / "checkpoint-2" / "other-run.txt").write_text("x")
    trainer = make_trainer(tmp_path, **{**RUN, "total_episodes": 16}, overwrite_output_dir=True)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-1"]  # only this run's
    assert json.loads((run_dir / "checkpoint-1" / "ppo_state.json").read_text())["run"]["total_episodes"] == 16
    assert "deleting the checkpoints of the previous run" in caplog.text


# ------------------------------------------------------------------------------------------------------------------
# 2. Partial and 8. damaged checkpoints
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "missing",
    [
        "optimizer.pt",
        "scheduler.pt",
        "rng_state.pth",
        "model.safetensors",
        "critic/model.safetensors",
        "trainer_state.json",
    ],
)
def test_incomplete_checkpoint_is_refused(run_dir, tmp_path, monkeypatch, missing):
    (run_dir / "checkpoint-2" / missing).unlink()
    trainer = no_rollout(make_trainer(tmp_path, **RUN), monkeypatch)
    with pytest.raises(CheckpointError) as caught:
        trainer.train(resume_from_checkpoint=True)
    message = str(caught.value)
    assert "incomplete" in message and "checkpoint-2" in message
    assert (Path(missing).name if "/" not in missing else "critic") in message
    if missing != "trainer_state.json":  # needed even for a weights-only resume
        assert "resume_weights_only=True" in message


def test_weights_only_resume_loads_the_weights_and_warns(run_dir, tmp_path, caplog):
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        (run_dir / "checkpoint-2" / name).unlink()
    trainer = make_trainer(tmp_path, **RUN, resume_weights_only=True)
    trainer.add_callback(start := PolicyAtStart())
    with caplog.at_level(logging.WARNING):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 3 and trainer.state.episode == 48  # continued from iteration 2
    saved = load_file(run_dir / "checkpoint-2" / "model.safetensors")
    for name, value in start.params.items():
        torch.testing.assert_close(value, saved[name], msg=name)
    assert "resume_weights_only=True" in caplog.text and "restart" in caplog.text


def test_a_checkpoint_without_config_json_resumes_into_the_existing_models(run_dir, tmp_path):
    """Issue 26, bad 1: without config.json, from_pretrained on the folder used to build a default-size (7B) Llama."""
    for name in ("config.json", "critic/config.json"):
        (run_dir / "checkpoint-2" / name).unlink()
    trainer = make_trainer(tmp_path, **RUN)
    trainer.add_callback(start := PolicyAtStart())
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 3
    saved = load_file(run_dir / "checkpoint-2" / "model.safetensors")
    for name, value in start.params.items():
        assert torch.equal(value, saved[name]), name


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "model.safetensors": truncate,
    "critic/model.safetensors": truncate,
    "optimizer.pt": truncate,
    "scheduler.pt": truncate,
    "rng_state.pth": truncate,
    "ppo_state.json": lambda path: path.write_text(""),
    "trainer_state.json": lambda path: path.write_text("{not json"),
}


@pytest.mark.parametrize("damaged", [*DAMAGE, "ppo_state.json without keys"])
def test_damaged_checkpoint_names_the_file_and_the_previous_checkpoint(run_dir, tmp_path, monkeypatch, damaged):
    if damaged == "ppo_state.json without keys":
        (run_dir / "checkpoint-2" / "ppo_state.json").write_text("{}")
        damaged = "ppo_state.json"
    else:
        DAMAGE[damaged](run_dir / "checkpoint-2" / damaged)
    trainer = no_rollout(make_trainer(tmp_path, **RUN), monkeypatch)
    with pytest.raises(CheckpointError) as caught:
        trainer.train(resume_from_checkpoint=True)
    message = str(caught.value)
    assert damaged in message and "damaged" in message
    assert f"resume_from_checkpoint={str(run_dir / 'checkpoint-1')!r}" in message


# ------------------------------------------------------------------------------------------------------------------
# 1./3. A resume with other settings
# ------------------------------------------------------------------------------------------------------------------
CHANGES = {
    "batch size": (dict(per_device_train_batch_size=2), ["per_device_train_batch_size: checkpoint 4, now 2"]),
    "episodes": (dict(total_episodes=32), ["total_episodes: checkpoint 48, now 32", "num_total_batches"]),
    "seed": (dict(seed=1), ["seed: checkpoint 0, now 1"]),
    "samples per prompt": (dict(num_samples_per_prompt=2), ["num_samples_per_prompt: checkpoint 1, now 2"]),
    "preset": (dict(preset="vanilla"), ["preset: checkpoint 'ppo_max', now 'vanilla'"]),
    "learning rate": (dict(learning_rate=5e-4), ["learning_rate: checkpoint 0.001, now 0.0005"]),
    "dataset": (
        dict(dataset=Dataset.from_dict({"prompt": prompt_texts(40)})),
        ["train_dataset_size: checkpoint 32, now 40"],
    ),
    "model": (dict(arch="gpt_neox"), ["policy_parameters: checkpoint 23776, now 20288"]),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_resume_with_other_run_settings_is_refused(run_dir, tmp_path, monkeypatch, change):
    overrides, expected = CHANGES[change]
    trainer = no_rollout(make_trainer(tmp_path, **{**RUN, **overrides}), monkeypatch)
    with pytest.raises(CheckpointError) as caught:
        trainer.train(resume_from_checkpoint=True)
    message = str(caught.value)
    for text in [*expected, "checkpoint-2", "resume_allow_changes=True"]:
        assert text in message, text


def test_resume_allow_changes_continues_with_a_warning(run_dir, tmp_path, caplog):
    trainer = make_trainer(tmp_path, **{**RUN, "total_episodes": 64}, resume_allow_changes=True)
    with caplog.at_level(logging.WARNING):
        trainer.train(resume_from_checkpoint=True)
    assert "total_episodes: checkpoint 48, now 64" in caplog.text
    assert trainer.state.global_step == 4 and trainer.state.episode == 64


def test_a_resume_with_fewer_samples_per_prompt_is_refused_and_an_unchanged_one_continues(tmp_path, monkeypatch):
    """Issue 31, item 6: num_samples_per_prompt 2 -> 1 keeps the batch size (episodes) but reads twice the prompts per
    iteration, so a resume would read prompts already trained on again and never reach the rest of the dataset."""
    first = make_trainer(tmp_path, **RUN, num_samples_per_prompt=2)
    first.add_callback(StopAt(1))
    first.train()
    changed_run = no_rollout(make_trainer(tmp_path, **RUN, num_samples_per_prompt=1), monkeypatch)
    with pytest.raises(CheckpointError) as caught:
        changed_run.train(resume_from_checkpoint=True)
    message = str(caught.value)
    for text in ("num_samples_per_prompt: checkpoint 2, now 1", "checkpoint-1", "resume_allow_changes=True"):
        assert text in message, text
    same = make_trainer(tmp_path, **RUN, num_samples_per_prompt=2)
    same.add_callback(StopAt(2))
    same.train(resume_from_checkpoint=True)
    assert same.state.global_step == 2 and same.state.episode == 32


def test_a_checkpoint_predating_a_run_setting_resumes_with_a_warning_naming_it(run_dir, tmp_path, caplog):
    """A checkpoint of an earlier trl-ppomax lacks num_samples_per_prompt in its run settings: not compared (its value
    is unknown), and the warning says so with this run's value."""
    path = run_dir / "checkpoint-2" / "ppo_state.json"
    state = json.loads(path.read_text())
    del state["run"]["num_samples_per_prompt"]
    path.write_text(json.dumps(state))
    trainer = make_trainer(tmp_path, **RUN)
    with caplog.at_level(logging.WARNING):
        trainer.train(resume_from_checkpoint=True)
    assert "predates the stored run setting(s) num_samples_per_prompt" in caplog.text
    assert "num_samples_per_prompt=1" in caplog.text
    assert trainer.state.global_step == 3


class LearningRates(TrainerCallback):
    """Records each parameter group's learning rate, by model, when an iteration begins."""

    def __init__(self, trainer) -> None:
        self.trainer, self.at_start = trainer, []

    def on_step_begin(self, args, state, control, **kwargs):
        self.at_start.append({group["model"]: group["lr"] for group in self.trainer.optimizer.param_groups})


def test_a_changed_learning_rate_applies_on_resume_when_changes_are_allowed(run_dir, tmp_path, caplog):
    """Issue 26, bad 4: the saved schedule used to restore the old base rate silently."""
    trainer = make_trainer(tmp_path, **RUN, learning_rate=2e-4, critic_learning_rate=3e-4, resume_allow_changes=True)
    trainer.add_callback(rates := LearningRates(trainer))
    with caplog.at_level(logging.WARNING):
        trainer.train(resume_from_checkpoint=True)
    assert "learning_rate: checkpoint 0.001, now 0.0002" in caplog.text
    policy, critic = trainer.lr_scheduler.base_lrs[0], trainer.lr_scheduler.base_lrs[-1]
    assert (policy, critic) == (2e-4, 3e-4)
    step = trainer.lr_scheduler.last_epoch - trainer.args.num_ppo_epochs * trainer.args.num_mini_batches
    fraction = trainer.lr_scheduler.lr_lambdas[0](step)  # the schedule's position when iteration 3 began
    assert rates.at_start[0] == pytest.approx({"policy": 2e-4 * fraction, "critic": 3e-4 * fraction})


def test_old_checkpoint_without_run_settings_resumes_with_a_warning(run_dir, tmp_path, caplog):
    path = run_dir / "checkpoint-2" / "ppo_state.json"
    state = json.loads(path.read_text())
    del state["run"]
    path.write_text(json.dumps(state))
    trainer = make_trainer(tmp_path, **RUN)
    with caplog.at_level(logging.WARNING):
        trainer.train(resume_from_checkpoint=True)
    assert "predates stored run settings" in caplog.text
    assert trainer.state.global_step == 3


# ------------------------------------------------------------------------------------------------------------------
# 4. Secrets and checkpoint internals
# ------------------------------------------------------------------------------------------------------------------
def test_hub_token_is_never_written(tmp_path):
    trainer = make_trainer(tmp_path, **RUN, hub_token=SENTINEL)
    trainer.train()
    trainer.save_model()
    trainer.save_model(str(tmp_path / "final"))
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "training_args.bin" for p in written)
    assert not [p for p in written if SENTINEL.encode() in p.read_bytes()]
    assert trainer.args.hub_token == SENTINEL  # the live arguments are untouched
    saved = torch.load(tmp_path / "final" / "training_args.bin", weights_only=False)
    assert saved.hub_token is None and saved.output_dir == trainer.args.output_dir


INTERNALS = ["critic/", "optimizer.pt", "ppo_state.json", "rng_state.pth", "scheduler.pt", "trainer_state.json"]


def test_push_leaves_checkpoint_internals_out_unless_asked(stopped_run, monkeypatch, capsys):
    checkpoint = stopped_run / "checkpoint-2"
    files, excluded = hub.upload_plan(checkpoint)
    assert excluded == sorted([*INTERNALS, "training_args.bin"])
    assert not set(files) & set(excluded) and "model.safetensors" in files
    everything = hub.upload_files(checkpoint, include_internals=True)
    assert {"optimizer.pt", "training_args.bin", "critic/model.safetensors"} <= set(everything)

    assert main(["push", str(checkpoint), "--repo-id", "me/m", "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert "optimizer.pt" not in captured.out and "training_args.bin" not in captured.out
    assert "optimizer.pt" in captured.err and "--include-checkpoint-files" in captured.err
    assert main(["push", str(checkpoint), "--repo-id", "me/m", "--dry-run", "--include-checkpoint-files"]) == 0
    captured = capsys.readouterr()
    assert "optimizer.pt" in captured.out and "not uploading" not in captured.err


# ------------------------------------------------------------------------------------------------------------------
# 5. An unwritable output_dir
# ------------------------------------------------------------------------------------------------------------------
def _under_a_file(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("a regular file")
    return tmp_path / "file"


def _read_only(tmp_path, monkeypatch):
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    if os.access(folder, os.W_OK):
        folder.chmod(0o700)
        pytest.skip("permissions do not apply (running as root)")
    return folder


def _write_fails(tmp_path, monkeypatch):
    original = Path.write_bytes

    def write_bytes(self, data):
        if self.name.startswith(".trl-ppomax-write-test"):
            raise OSError(errno.EROFS, "Read-only file system")
        return original(self, data)

    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    return tmp_path


@pytest.mark.parametrize("make_parent", [_under_a_file, _read_only, _write_fails], ids=lambda f: f.__name__[1:])
def test_unwritable_output_dir_fails_at_init(tmp_path, monkeypatch, make_parent):
    parent = make_parent(tmp_path, monkeypatch)
    try:
        with pytest.raises(ValueError) as caught:
            make_trainer(parent, **RUN)
    finally:
        parent.chmod(0o700)
    message = str(caught.value)
    assert "output_dir" in message and str(parent / "out") in message and "not writable" in message


# ------------------------------------------------------------------------------------------------------------------
# 6. train() twice
# ------------------------------------------------------------------------------------------------------------------
def test_train_twice_is_a_clear_error(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, total_episodes=16)
    trainer.train()
    no_rollout(trainer, monkeypatch)
    with pytest.raises(RuntimeError) as caught:
        trainer.train()
    message = str(caught.value)
    assert "train() was already called" in message
    assert "new PPOMaxTrainer" in message and "resume_from_checkpoint=True" in message


# ------------------------------------------------------------------------------------------------------------------
# 7. A full disk during save_model; push of a folder without weights
# ------------------------------------------------------------------------------------------------------------------
def disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_save_model_is_atomic_on_a_full_disk(tmp_path, monkeypatch):
    import transformers.modeling_utils

    trainer = make_trainer(tmp_path)
    final = tmp_path / "final"
    trainer.save_model(str(final))
    before = all_bytes(final)
    with torch.no_grad():
        next(trainer.model.policy.parameters()).add_(1.0)
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        trainer.save_model(str(final))
    assert all_bytes(final) == before  # the previous save is intact, no half-written file, no temporary folder

    with pytest.raises(OSError, match="No space left"):
        trainer.save_model(str(tmp_path / "fresh"))
    assert not (tmp_path / "fresh" / "config.json").exists()
    assert not list((tmp_path / "fresh").iterdir())


def test_save_model_into_output_dir_keeps_checkpoints_and_replaces_stale_weights(run_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    checkpoints = {p.name: all_bytes(p) for p in run_dir.glob("checkpoint-*")}
    (run_dir / "model.safetensors.index.json").write_text('{"weight_map": {}}')  # an earlier sharded save
    (run_dir / "model-00001-of-00002.safetensors").write_bytes(b"old")
    make_trainer(tmp_path).save_model()
    assert {p.name: all_bytes(p) for p in run_dir.glob("checkpoint-*")} == checkpoints
    assert not (run_dir / "model.safetensors.index.json").exists()
    assert not (run_dir / "model-00001-of-00002.safetensors").exists()
    assert not list(run_dir.glob(".tmp*"))
    AutoModelForCausalLM.from_pretrained(run_dir)


def _no_weights(folder: Path) -> None:
    (folder / "model.safetensors").unlink()


def _truncated_weights(folder: Path) -> None:
    truncate(folder / "model.safetensors")


def _missing_shard(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"x")


@pytest.mark.parametrize(
    ("break_folder", "named"),
    [(_no_weights, "no complete weights"), (_truncated_weights, "damaged"), (_missing_shard, "model-00002-of-00002")],
    ids=["no-weights", "truncated", "missing-shard"],
)
def test_push_refuses_a_folder_without_whole_weights(tmp_path, capsys, break_folder, named):
    folder = tmp_path / "final"
    make_trainer(tmp_path).save_model(str(folder))
    hub.push_folder(folder, "me/m", dry_run=True)  # whole: accepted
    break_folder(folder)
    with pytest.raises(ValueError, match=named):
        hub.upload_files(folder)
    assert main(["push", str(folder), "--repo-id", "me/m", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert named in err and "Save the model again" in err


def test_allowed_change_of_model_still_fails_clearly_when_the_weights_do_not_fit(run_dir, tmp_path, monkeypatch):
    trainer = no_rollout(make_trainer(tmp_path, **RUN, arch="gpt_neox", resume_allow_changes=True), monkeypatch)
    with pytest.raises(CheckpointError) as caught:
        trainer.train(resume_from_checkpoint=True)
    message = str(caught.value)
    assert "Could not load the weights" in message and "other models or settings" in message


# ==================================================================================================================
# Issue 26, poor cases: what was late, raw or misleading now fails early, naming the setting, file or argument
# (the construction-time ones are in CASES, section 10)
# ==================================================================================================================


def _basic_ios(*args, **kwargs):
    raise RuntimeError("basic_ios::clear: iostream error")


def _file_write_failed(*args, **kwargs):
    raise RuntimeError(
        "[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing file data/0: file write failed"
    )


@pytest.mark.parametrize(
    ("module", "name", "fail"),
    [
        ("transformers.modeling_utils", "safe_save_file", disk_full),
        ("torch", "save", _basic_ios),
        ("torch", "save", _file_write_failed),
    ],
    ids=["ENOSPC", "basic_ios", "file-write-failed"],
)
def test_a_full_disk_is_said_with_the_folder_and_its_free_space(tmp_path, monkeypatch, module, name, fail):
    """A full disk gave "basic_ios::clear: iostream error" (data safe, but nothing said so)."""
    trainer = make_trainer(tmp_path)
    final = tmp_path / "final"
    trainer.save_model(str(final))
    before = all_bytes(final)
    monkeypatch.setattr(importlib.import_module(module), name, fail)
    with pytest.raises(DiskFullError) as caught:
        trainer.save_model(str(final))
    message = str(caught.value)
    assert message.startswith(f"The disk is full: writing {final} failed"), message
    assert re.search(r"; [\d.]+ [KMGT]?B free on the disk of ", message), message
    assert "Nothing was overwritten" in message and "save again" in message
    assert isinstance(caught.value, OSError) and caught.value.errno == errno.ENOSPC
    assert all_bytes(final) == before


def test_a_full_disk_at_a_checkpoint_stops_the_run_saying_how_to_resume(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, **RUN)
    monkeypatch.setattr(torch, "save", _basic_ios)
    with pytest.raises(DiskFullError) as caught:
        trainer.train()
    message, out = str(caught.value), tmp_path / "out"
    assert f"The disk is full: writing {out / 'checkpoint-1'} failed (RuntimeError: basic_ios::clear" in message
    assert "Training stopped at iteration 1" in message and "train(resume_from_checkpoint=True)" in message
    assert not list(out.glob("*checkpoint-1"))  # neither the checkpoint nor its temporary folder
