"""benchmarks/gpu/ppo_max_gpu.py: its dry run (tiny fp32 models on CPU, the GPU run's code path) writes the benchmark's
JSON with consistent numbers; its peak table and time guard decide as documented."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "ppo_max_gpu.py"
SPLIT = ("generation_seconds", "scoring_forwards_seconds", "update_and_rest_seconds")


def load_script():
    spec = importlib.util.spec_from_file_location("ppo_max_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def llama_parameters(vocab: int, hidden: int, layers: int, intermediate: int, head: int) -> int:
    """Parameters of a Llama (untied, no biases, full multi-head attention) with an output head of ``head`` rows."""
    per_layer = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
    return vocab * hidden + layers * per_layer + hidden + head * hidden


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    output = tmp_path_factory.mktemp("gpu_benchmark") / "gpu.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, str(SCRIPT), "--dry-run", "--peak-tflops", "1", "--output", str(output)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads(output.read_text())


@pytest.mark.slow  # the dry run: 17 s of the default suite's cold time (.ci/run runs it)
def test_dry_run_reports_throughput_and_a_time_split_that_adds_up(report):
    run, settings = report["runs"]["ppomax"], report["settings"]
    assert report["dry_run"] and report["device"] == "cpu" and report["failed"] == []
    assert run["timed_iterations"] == settings["iterations"] - settings["warmup_iterations"]
    assert run["episodes"] == run["timed_iterations"] * settings["batch_size"]
    assert run["generated_tokens"] == run["episodes"] * settings["response_length"]  # stop_token=None
    assert run["episodes_per_second"] > 0 and run["generated_tokens_per_second"] > 0
    assert all(run[name] > 0 for name in SPLIT)
    assert sum(run[name] for name in SPLIT) == pytest.approx(run["train_seconds"], rel=1e-6)
    assert run["train_seconds"] < run["process_seconds"]
    assert run["peak_gpu_memory_gib"] is None
    assert run["trainer"]["preset"] == "ppo_max" and run["trainer"]["stop_token"] is None


@pytest.mark.slow  # the dry run: 17 s of the default suite's cold time (.ci/run runs it)
def test_dry_run_counts_parameters_computes_mfu_and_trains_the_policy(report):
    settings, parameters, run = report["settings"], report["parameters"], report["runs"]["ppomax"]
    shape = settings["policy"]
    size = (settings["vocab_size"], shape["hidden_size"], shape["layers"], shape["intermediate_size"])
    assert parameters["policy"] == parameters["ref"] == llama_parameters(*size, head=settings["vocab_size"])
    assert parameters["reward"] == parameters["value"] == llama_parameters(*size, head=1)
    trained = (run["episodes"] * settings["prompt_length"] + run["generated_tokens"]) * settings["num_ppo_epochs"]
    flops = 6 * (parameters["policy"] + parameters["value"]) * trained
    assert (run["trained_tokens"], run["update_flops"]) == (trained, flops)
    assert run["mfu"] == pytest.approx(flops / run["update_and_rest_seconds"] / 1e12)  # --peak-tflops 1
    assert run["policy_parameters_changed"] is True and run["policy_lm_head_max_abs_change"] > 0


@pytest.mark.slow  # the dry run: 17 s of the default suite's cold time (.ci/run runs it)
def test_dry_run_also_times_a_lagged_run_against_the_synchronous_one(report):
    run = report["runs"]["ppomax+staleness1"]
    assert run["trainer"]["max_staleness"] == 1 and run["policy_parameters_changed"] is True
    # the same episodes; its generated tokens are counted when the producer makes them, ahead of the timed window
    assert run["episodes"] == report["runs"]["ppomax"]["episodes"]
    assert report["staleness"]["episodes_per_second_k1_over_k0"] > 0


@pytest.mark.slow  # the dry run: 17 s of the default suite's cold time (.ci/run runs it)
def test_dry_run_records_the_runs_it_skipped(report):
    reasons = {entry["run"]: entry["reason"] for entry in report["skipped"]}
    assert reasons == {"trl112": "no --trl112-python given", "ppomax+vllm": "dry run: the vLLM run needs a GPU"}


@pytest.mark.slow  # the dry run: 17 s of the default suite's cold time (.ci/run runs it)
def test_dry_run_runs_issue_46s_rows_first_into_the_same_json(report):
    """The head-to-head (identical work, ours without the no-grad policy forward, as TRL's GRPO), the vocabulary's
    memory share with the log-probs whole and in chunks, and the Liger row, each in the JSON."""
    head_to_head = report["head_to_head"]
    assert head_to_head["work_equal"] and set(head_to_head["medians"]) == {"trl_grpo", "ppomax_grpo"}
    assert {run["policy_no_grad_forward_rows"] for run in head_to_head["forwards_by_design"].values()} == {0}
    by_chunk_size = report["vocab_memory"]["by_chunk_size"]
    assert set(by_chunk_size) == {"None", "256"} and by_chunk_size["None"]["vocabulary_share_mib"] > 0
    (liger,) = report["liger"]["runs"]
    assert liger["policy_changed"] and liger["logprob_chunk_size"] == 256


def test_peak_table_and_time_guard():
    script = load_script()
    assert script.peak_flops("NVIDIA H100 80GB HBM3", None) == script.peak_flops("NVIDIA H200", None) == 989e12
    assert script.peak_flops("NVIDIA H100 PCIe", None) == 756e12
    assert script.peak_flops("cpu", None) is None and script.peak_flops("cpu", 2.0) == 2e12
    assert script.time_guard(estimate=100, left=120, budget=450) is None
    assert script.time_guard(estimate=200, left=120, budget=450).startswith("time guard: about 200 s needed, 120 s")
    args = argparse.Namespace(trl112_python="/some/python", dry_run=False)
    assert script.extra_run_python("trl112", args) == ("/some/python", None)
