"""What a checkpoint must hold (``trl_ppomax.ppo.checkpoint_files``): an engine-only DeepSpeed checkpoint is complete
without plain weights, an incomplete one is refused naming what is missing, and one resumed without DeepSpeed says how
to consolidate it. The refusals met through a resume (incomplete, damaged, other run settings) are in
``test_ppo_checkpoint.py``."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trl_ppomax.data.files import file_problem
from trl_ppomax.ppo.checkpoint_files import CheckpointError, required_checkpoint_files


def engine_only_checkpoint(folder: Path) -> Path:
    """A checkpoint of 2 processes as a ZeRO-3 run without stage3_gather_16bit_weights_on_model_save writes it: the
    engine folder (named by ``latest``) holds the weights; configs, states, no plain weight files."""
    engine = folder / "global_step4"
    (folder / "critic").mkdir(parents=True)
    engine.mkdir()
    for name in ("config.json", "critic/config.json"):
        (folder / name).write_text("{}")
    for name in ("scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"):
        torch.save({}, folder / name)
    (folder / "latest").write_text("global_step4")
    for rank in (0, 1):
        for kind in ("model", "optim"):
            torch.save({}, engine / f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt")
    return folder


@pytest.mark.parametrize("weights_only", [False, True])
def test_an_engine_only_checkpoint_is_complete_under_deepspeed(tmp_path, weights_only):
    """Issue 31, item 4: no consolidated weights, the engine checkpoint holds them (read even by a weights-only
    resume): required, and its files checked for damage."""
    path = engine_only_checkpoint(tmp_path / "checkpoint-2")
    args = SimpleNamespace(resume_weights_only=weights_only, world_size=2, uses_critic=True)
    files = required_checkpoint_files(str(path), args, "deepspeed")
    engine = sorted(str(f) for f in (path / "global_step4").iterdir())
    assert set(engine) <= set(files) and str(path / "latest") in files
    (path / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"PK\x03\x04 cut")
    assert file_problem(path / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")  # a truncation shows


@pytest.mark.parametrize(
    "missing, named",
    [
        ("latest", "the DeepSpeed engine checkpoint"),
        ("global_step4", "global_step4/ that `latest` names"),
        (
            "global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt",
            "global_step4/ optimizer states of process(es) [1]",
        ),
        ("global_step4/zero_pp_rank_0_mp_rank_00_model_states.pt", "global_step4/ model states of process(es) [0]"),
        ("scheduler.pt", "scheduler.pt"),
    ],
)
def test_an_incomplete_engine_only_checkpoint_is_refused(tmp_path, missing, named):
    path = engine_only_checkpoint(tmp_path / "checkpoint-2")
    target = path / missing
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    with pytest.raises(CheckpointError) as caught:
        required_checkpoint_files(
            str(path), SimpleNamespace(resume_weights_only=False, world_size=2, uses_critic=True), "deepspeed"
        )
    assert "incomplete" in str(caught.value) and named in str(caught.value)


def test_an_engine_only_checkpoint_resumed_without_deepspeed_says_how(tmp_path):
    path = engine_only_checkpoint(tmp_path / "checkpoint-2")
    with pytest.raises(CheckpointError) as caught:
        required_checkpoint_files(
            str(path), SimpleNamespace(resume_weights_only=True, world_size=2, uses_critic=True), None
        )
    message = str(caught.value)
    assert "only a sharded DeepSpeed engine checkpoint" in message and "consolidate_engine_checkpoint" in message
