"""benchmarks/head_to_head.py: its ``--quick`` smoke run writes a JSON with every run (TRL's GRPOTrainer and
RLOOTrainer, fused and plain heads; PPOMaxTrainer with GRPO, RLOO and GAE) on identical, proven work; the plain head
the benchmark puts in TRL's place agrees with TRL's fused head."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCHMARKS / "head_to_head.py"
IMPLS = ("trl_grpo", "trl_grpo_plain", "trl_rloo", "trl_rloo_plain", "ppomax_grpo", "ppomax_rloo", "ppomax_gae")


def load_worker():
    spec = importlib.util.spec_from_file_location("head_to_head_worker", BENCHMARKS / "head_to_head_worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("head_to_head")
    output = folder / "head_to_head.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "WANDB_DISABLED": "true"}
    command = [sys.executable, str(SCRIPT), "--quick", "--cache", str(folder / "cache"), "--output", str(output)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=folder)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    return json.loads(output.read_text())


@pytest.mark.slow  # seven fresh training processes plus the head check: about 70 s on 2 cores
def test_quick_run_has_every_impl_on_the_same_work(report):
    assert set(report["runs"]) == set(IMPLS) and report["work_equal"] is True
    assert report["work"]["differences"] == []
    settings, expected = report["settings"], report["work"]["expected"]
    completions = settings["prompts"] * settings["generations"] * settings["steps"]
    assert expected["completions"] == expected["rewarded_completions"] == completions
    assert expected["generated_tokens"] == completions * settings["completion_length"]  # no early stop
    assert expected["completions_ended_by_eos"] == 0
    assert expected["logged_mean_completion_length"] == settings["completion_length"]
    assert expected["global_step"] == expected["optimizer_steps"] == expected["logged_steps"] == settings["steps"]
    assert expected["generate_calls"] == settings["steps"]  # one generate call per generation batch
    for impl, runs in report["runs"].items():
        for run in runs:
            assert run["policy_parameters_changed"] > 0, impl
            assert run["train_seconds"] < run["process_seconds"], impl
            split = ("generation_seconds", "scoring_forwards_seconds", "reward_seconds", "update_and_rest_seconds")
            assert sum(run[name] for name in split) == pytest.approx(run["train_seconds"], rel=1e-6), impl
            assert run["peak_memory_gb"] > 0, impl
            assert 0 < run["peak_memory_before_train_gb"] <= run["peak_memory_gb"], impl
            assert run["peak_memory_growth_in_train_gb"] == pytest.approx(
                run["peak_memory_gb"] - run["peak_memory_before_train_gb"]
            ), impl
    # TRL's own token count (prompt + completion tokens) is what the wrappers counted
    for impl in ("trl_grpo", "trl_rloo"):
        run = report["runs"][impl][0]
        assert run["logged_num_tokens"] == expected["prompt_tokens"] + expected["generated_tokens"]


@pytest.mark.slow  # shares the quick run above
def test_quick_run_reports_ratios_forwards_and_the_head_checks(report):
    for ours, theirs in (
        ("ppomax_grpo", "trl_grpo"),
        ("ppomax_rloo", "trl_rloo_plain"),
        ("ppomax_gae", "ppomax_grpo"),
    ):
        ratio = report["ratios"][f"{ours} / {theirs}"]
        medians = report["medians"]
        assert ratio["train_seconds"] == pytest.approx(
            medians[ours]["train_seconds"] / medians[theirs]["train_seconds"]
        )
        assert ratio["peak_memory_gb"] > 0
    forwards = report["forwards_by_design"]
    rows = report["work"]["expected"]["completions"]
    assert forwards["trl_grpo"]["policy_no_grad_forward_rows"] == 0  # on-policy: TRL skips the old log-probs
    assert forwards["trl_rloo"]["policy_no_grad_forward_rows"] == rows  # RLOO's KL in the reward needs them
    assert forwards["ppomax_gae"]["critic_no_grad_forward_rows"] == rows  # the critic's values
    assert forwards["ppomax_grpo"]["critic_no_grad_forward_rows"] == 0
    checks = report["plain_head_check"]
    assert checks["one_batch"]["agree_1e-5"] is True
    assert all(row["agree"] for rows in checks["first_training_step"].values() for row in rows)


@pytest.mark.slow  # two tiny models, a few seconds
def test_plain_head_agrees_with_trls_fused_head():
    report = load_worker().check_plain_head(vocab_size=128, hidden=32)
    assert report["agree_1e-5"], report
    assert report["max_abs_logp_difference"] < 1e-5
