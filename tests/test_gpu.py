"""Sharded runs on a GPU: DeepSpeed ZeRO-3 (with and without gathering weights for generation) and FSDP.

Not run on CPU-only machines (marked ``gpu`` and skipped without CUDA); ZeRO-3 also needs the ``deepspeed`` extra.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
SCRIPTS = Path(__file__).parent / "scripts"
ACCELERATE = Path(__file__).resolve().parents[1] / "recipes" / "accelerate"


def launch(config: str, output: Path, *extra: str) -> dict:
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(SCRIPTS / config),
        str(SCRIPTS / "ddp_run.py"),
        str(output),
        *extra,
    ]
    result = subprocess.run(command, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(result.stderr[-4000:])
    return json.loads((output / "rank0.json").read_text())


def assert_full_policy_saved(folder: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    assert all(p.numel() > 0 and torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs pip install trl-ppomax[deepspeed]")
@pytest.mark.parametrize("gather", [True, False])
def test_zero3_trains_and_saves_full_weights(tmp_path, gather):
    result = launch("deepspeed_zero3.yaml", tmp_path, *([] if gather else ["--no-ds3-gather"]))
    assert result["steps"] == 4
    assert_full_policy_saved(tmp_path / "policy")


def test_fsdp_trains_and_saves_full_weights(tmp_path):
    result = launch("fsdp.yaml", tmp_path)
    assert result["steps"] == 4
    assert_full_policy_saved(tmp_path / "policy")
