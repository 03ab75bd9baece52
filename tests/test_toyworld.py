"""The toy world: gold function, cached pipeline, the collapse of vanilla PPO against PPO-max's stability."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trl_ppomax.ppo.monitor import CollapseMonitor
from trl_ppomax.toyworld import WorldSettings, gold_reward, prepare_world
from trl_ppomax.toyworld.pipeline import SUMMARY_KEYS, run_method
from trl_ppomax.toyworld.world import WorldSampler, prompt_text

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "ppo_max.py"


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("please the cat is very nice today", 1.5),  # on topic, polite, 7 words, no repeat
        ("the cat", 1.0 - 0.15 * 3),  # too short by 3 words
        ("the dog and the moon", 0.0 - 0.5 * 2 - 0.3 * 1),  # two other topics, "the" repeated
        (" ".join(["cat"] * 14), 1.0 - 0.3 * 13 - 0.15 * 2),  # repetition and two words too many
        ("please the cat is very nice today </s>", 1.5),  # special tokens are not words
    ],
)
def test_gold_reward_by_hand(response, expected):
    assert gold_reward(prompt_text("cat"), response) == pytest.approx(expected)


def test_gold_reward_rejects_foreign_prompts():
    with pytest.raises(ValueError, match="toy-world prompt"):
        gold_reward("user: hello there </s> assistant:", "hi")


def test_sft_data_is_mediocre():
    rows = WorldSampler(seed=0).sft_rows(500)
    scores = [gold_reward(r["prompt"], r["completion"]) for r in rows]
    assert -0.5 < sum(scores) / len(scores) < 0.6 and max(scores) == 1.5


@pytest.mark.slow  # builds the toy world, half a minute cold (.ci/run runs it)
def test_world_is_cached_and_the_reward_model_is_an_imperfect_proxy(world, world_cache):
    assert 0.6 < world.report["held_out_accuracy"] < 0.95
    start = time.time()
    again = prepare_world(WorldSettings(), cache_dir=world_cache)
    assert again.sft == world.sft and time.time() - start < 5  # a second run skips the trained stages


@pytest.fixture(scope="module")
def forty_iterations(world, tmp_path_factory):
    """vanilla PPO and PPO-max, 40 iterations each from the same SFT policy, each watched by a CollapseMonitor:
    ``{method: (sft, final, curves, monitor events)}``."""
    runs = {}
    for method in ("vanilla_ppo", "ppo_max"):
        monitor = CollapseMonitor()
        _, sft, final, curves = run_method(
            world, method, str(tmp_path_factory.mktemp(method)), 40, callbacks=[monitor]
        )
        runs[method] = (sft, final, curves, {event["signal"] for event in monitor.events})
    return runs


@pytest.mark.slow  # a toy-world run (.ci/run runs it)
def test_a_critic_free_method_runs_in_the_toy_world_without_a_value_curve(world, tmp_path):
    trainer, _, final, curves = run_method(world, "rloo", str(tmp_path), 2)
    assert trainer.model.critic is None and "value_loss" not in curves
    assert len(curves["gold_reward"]) == len(curves["policy_loss"]) > 0 and set(final) == set(SUMMARY_KEYS)


# Margins: measured on fresh worlds (vanilla: KL 14.8–17.3, proxy +1.6, gold 0.45 under its best; PPO-max: KL 4.1,
# gold 0.5 above vanilla's), each assertion holds with room to spare on a world built by other hardware or libraries.
@pytest.mark.slow  # 40 toy-world iterations of two methods, 40 s cold (.ci/run runs it)
def test_vanilla_ppo_collapses_and_the_monitor_fires(forty_iterations):
    sft, final, curves, signals = forty_iterations["vanilla_ppo"]
    assert final["proxy_reward"] > sft["proxy_reward"] + 0.8  # the proxy keeps rising …
    assert final["gold_reward"] < max(curves["gold_reward"]) - 0.15  # … while the gold reward falls from its best
    assert final["kl"] > 10
    assert signals & {"kl", "perplexity"}


@pytest.mark.slow  # 40 toy-world iterations of two methods, 40 s cold (.ci/run runs it)
def test_ppo_max_stays_stable_and_the_monitor_stays_quiet(forty_iterations):
    _, final, _, signals = forty_iterations["ppo_max"]
    _, vanilla, _, _ = forty_iterations["vanilla_ppo"]
    assert final["gold_reward"] > vanilla["gold_reward"] + 0.2
    assert final["kl"] < 8 and final["kl"] < vanilla["kl"] / 2
    assert signals == set()


@pytest.mark.slow  # half a minute: the whole demo in its own process (.ci/run runs it)
def test_recipe_without_arguments_runs_the_toy_world(world, cache_root, tmp_path):
    """``accelerate launch recipes/ppo_max.py``, the README's second command, with no arguments: the toy world."""
    env = {**os.environ, "TRL_PPOMAX_CACHE": str(cache_root), "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_processes",
        "1",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(RECIPE),
    ]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gold_reward" in result.stdout and "PPO-max" in result.stdout and "SFT" in result.stdout
    assert "PPO-max against SFT" in result.stdout and "win rate (95% CI)" in result.stdout
    summary = json.loads((tmp_path / "output" / "toyworld" / "summary.json").read_text())
    assert summary["vs_sft"]["n"] == 64
    assert (tmp_path / "output" / "toyworld" / "training_dynamics.png").stat().st_size > 0


@pytest.mark.slow  # ten seconds of benchmark runs (.ci/run runs it)
def test_stability_benchmark_writes_the_documented_json(world, world_cache, tmp_path):
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("stability", RECIPE.parents[1] / "benchmarks" / "stability.py")
    stability = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stability)
    output = tmp_path / "stability.json"
    stability.main(
        [
            "--iterations",
            "2",
            "--seed",
            "0",
            "1",
            "--methods",
            "vanilla_ppo",
            "ppo_max",
            "--cache-dir",
            str(world_cache),
            "--output",
            str(output),
        ]
    )
    results = json.loads(output.read_text())
    assert set(results["sft"]) == {"gold_reward", "proxy_reward", "response_length", "perplexity"}
    for method in ("vanilla_ppo", "ppo_max"):
        entry = results["methods"][method]
        for field in (
            "gold_reward_final",
            "gold_reward_best",
            "proxy_reward_final",
            "kl_final",
            "response_length_final",
            "perplexity_final",
            "win_rate_vs_sft",
        ):
            assert field in entry and len(entry["seeds"]) == 2 and field in entry["seeds"][0]
        assert len(entry["curves"]["gold_reward"]) == 2
        assert 0 <= entry["win_rate_vs_sft"] <= 1 and entry["seeds"][0]["vs_sft"]["n"] == 64
    assert output.with_suffix(".png").stat().st_size > 0
