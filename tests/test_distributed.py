"""Two CPU processes (gloo): global reward statistics and synchronised weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "ddp_run.py"


@pytest.mark.slow  # two training processes: 18 s cold (.ci/run runs it)
def test_two_process_run_shares_global_statistics(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        str(SCRIPT),
        str(tmp_path),
        "--cpu",
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        pytest.fail(result.stderr[-4000:])
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["world_size"] == ranks[1]["world_size"] == 2
    assert ranks[0]["steps"] == 2  # 32 episodes / (2 processes × 8 prompts)
    # Every score of both processes entered the running moments, identically on both ranks.
    assert ranks[0]["moments"]["count"] == 32
    assert ranks[0]["moments"] == pytest.approx(ranks[1]["moments"])
    # … and they equal the single-process statistics of the union of both processes' scores.
    moments = ranks[0]["moments"]
    assert moments["mean"] == pytest.approx(ranks[0]["union_mean"], rel=1e-9, abs=1e-12)
    assert (moments["m2"] / (moments["count"] - 1)) ** 0.5 == pytest.approx(ranks[0]["union_std"], rel=1e-9)
    # Advantages are whitened over the global batch: mean 0 and variance 1 over both processes' tokens.
    for mean, var in ranks[0]["whitening"]:
        assert mean == pytest.approx(0.0, abs=1e-5) and var == pytest.approx(1.0, abs=1e-3)
    assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], rel=1e-12)
    assert (tmp_path / "policy" / "model.safetensors").exists()
