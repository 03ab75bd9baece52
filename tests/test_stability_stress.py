"""benchmarks/stability.py --stress: the JSON and figures, resuming without repeating runs, the stress conditions
(reward scale, offset and outliers through the trainer's reward sources; learning rates; length) and the
ppo_max-minus-one-trick methods."""

from __future__ import annotations

import importlib.util
import itertools
import json
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from trl_ppomax.models import sequence_inputs, sequence_scores
from trl_ppomax.rewards import decode_texts
from trl_ppomax.toyworld.pipeline import METHODS, eval_prompts, ppo_config, ppo_trainer
from trl_ppomax.toyworld.world import vocabulary

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "stability.py"


@pytest.fixture(scope="module")
def stability():
    spec = importlib.util.spec_from_file_location("stability_stress_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # fifteen seconds of benchmark runs (.ci/run runs it)
def test_stress_writes_the_documented_json_and_figures_and_resumes(
    stability, world, world_cache, tmp_path, monkeypatch
):
    output = tmp_path / "s.json"

    def arguments(methods=("trl_ppo", "ppo_max"), seeds=("0",), *extra):
        selection = ["--conditions", "reward_scale_10", "--methods", *methods, "--seed", *seeds, "--iterations", "2"]
        return ["--stress", *selection, "--cache-dir", str(world_cache), "--output", str(output), *extra]

    argv = arguments()
    calls = []
    run_seed = stability.run_seed

    def counting_run_seed(*args, **kwargs):
        calls.append(args[1:4])
        return run_seed(*args, **kwargs)

    monkeypatch.setattr(stability, "run_seed", counting_run_seed)
    stability.main(argv)
    assert sorted(calls) == [("ppo_max", 0, 2), ("trl_ppo", 0, 2)]

    results = json.loads(output.read_text())
    assert {"command", "iterations", "seeds", "world", "sft", "conditions"} <= set(results)
    assert results["iterations"] == 2 and results["seeds"] == [0]
    assert set(results["sft"]) == {"gold_reward", "proxy_reward", "response_length", "perplexity"}
    assert list(results["conditions"]) == ["reward_scale_10"]
    condition = results["conditions"]["reward_scale_10"]
    assert condition["iterations"] == 2 and list(condition["methods"]) == ["trl_ppo", "ppo_max"]
    for method in condition["methods"].values():
        for field in (*stability.FINAL_FIELDS, "gold_reward_final_std"):
            assert isinstance(method[field], float), field
        assert method["gold_reward_final_std"] == 0.0  # one seed
        assert len(method["seeds"]) == 1 and method["seeds"][0]["seed"] == 0 and method["failed"] == []
        assert set(stability.FINAL_FIELDS) <= set(method["seeds"][0])
        assert set(method["curves"]) >= {"gold_reward", "proxy_reward", "kl", "episode"}
        assert len(method["curves"]["episode"]) == 2
    for figure in ("s_reward_scale_10.png", "s_summary.png"):
        assert (tmp_path / figure).read_bytes()[:4] == b"\x89PNG"
    sidecar = tmp_path / "s.runs.jsonl"
    assert len(sidecar.read_text().splitlines()) == 2

    calls.clear()  # the same command again: nothing is re-run, the same JSON is written from the sidecar
    again = stability.main(argv)
    assert calls == [] and len(sidecar.read_text().splitlines()) == 2
    assert again["conditions"] == json.loads(output.read_text())["conditions"] == results["conditions"]

    # a new seed runs only the missing runs; --fresh forgets the old ones
    stability.main(arguments(seeds=("0", "1")))
    assert sorted(calls) == [("ppo_max", 1, 2), ("trl_ppo", 1, 2)]
    assert len(sidecar.read_text().splitlines()) == 4
    calls.clear()
    stability.main(arguments(("ppo_max",), ("0",), "--fresh"))
    assert calls == [("ppo_max", 0, 2)] and len(sidecar.read_text().splitlines()) == 1


def test_outliers_are_deterministic_rare_heavy_tailed_and_seeded(stability):
    completions = [f"the cat is nice {i}" for i in range(2000)]
    prompts = ["user: tell me about the cat </s> assistant:"] * len(completions)
    first = stability.outlier_reward(0)(prompts, completions)
    assert first == stability.outlier_reward(0)(prompts, completions)  # same (seed, prompt, completion), same value
    assert first[7] == stability.outlier_value(0, prompts[7], completions[7])
    hit = [v != 0.0 for v in first]
    assert 0.015 < sum(hit) / len(hit) < 0.05  # ~3 %
    assert max(abs(v) for v in first) > 10.0 and max(abs(v) for v in first) <= 300.0  # heavy tail, capped
    other = stability.outlier_reward(1)(prompts, completions)
    assert [v != 0.0 for v in other] != hit
    assert stability.outlier_reward(0).__name__ == "reward_outliers"  # logged as rewards/reward_outliers/mean


def _scored_batch(stability, tokenizer, n: int = 16):
    """Query ⊕ response inputs of ``n`` held-out prompts with responses of two content words, half of which the
    seed-0 outlier function perturbs (as the trainer gives them to it: decoded without special tokens)."""
    prompts = list(eval_prompts(n)["prompt"])
    query = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    decoded = decode_texts(tokenizer, query["input_ids"], query["attention_mask"])
    words = [w for w in vocabulary() if w.isalpha() and w not in ("user", "assistant")]
    hits, misses = [], []
    for i, prompt in enumerate(decoded):
        for a, b in itertools.product(words, words):
            perturbed = stability.outlier_value(0, prompt, f"{a} {b}") != 0.0
            if perturbed == (i % 2 == 0):
                (hits if perturbed else misses).append(f" {a} {b} </s>")
                break
    tokenizer.padding_side = "right"
    response = tokenizer(hits + misses, return_tensors="pt", padding=True, add_special_tokens=False)
    tokenizer.padding_side = "left"
    order = [i for pair in zip(range(len(hits)), range(len(hits), n), strict=True) for i in pair]
    response_ids, response_mask = response["input_ids"][order], response["attention_mask"][order]
    inputs = sequence_inputs(query["input_ids"], query["attention_mask"], response_ids, response_mask)
    outliers = stability.outlier_reward(0)(decoded, decode_texts(tokenizer, response_ids, response_mask))
    return inputs, query["attention_mask"], response_mask, torch.tensor(outliers)


@pytest.mark.parametrize(
    ("condition", "expected"),
    [
        ("baseline", lambda base, outliers: base),
        ("reward_scale_10", lambda base, outliers: 10 * base),
        ("reward_scale_0.1", lambda base, outliers: 0.1 * base),
        ("reward_offset_5", lambda base, outliers: base + 5),
        ("reward_outliers", lambda base, outliers: base + outliers),
    ],
)
def test_reward_conditions_change_the_trainers_scores_as_they_say(stability, world, tmp_path, condition, expected):
    from transformers import AutoModelForSequenceClassification

    arguments = stability.condition_arguments(condition, "ppo_max", seed=0)
    config = ppo_config(str(tmp_path), "ppo_max", iterations=1, seed=0, **arguments["config_overrides"])
    trainer = ppo_trainer(world, config, extra_rewards=arguments["extra_rewards"])
    tokenizer = trainer.processing_class
    inputs, query_mask, response_mask, outliers = _scored_batch(stability, tokenizer)
    assert (outliers[0::2] != 0).all() and (outliers[1::2] == 0).all()
    combined, _ = trainer.reward_sources.score(tokenizer, inputs, query_mask, response_mask)
    with torch.no_grad():
        base = sequence_scores(AutoModelForSequenceClassification.from_pretrained(world.reward).eval(), inputs).float()
    torch.testing.assert_close(combined, expected(base, outliers).float(), rtol=1e-5, atol=1e-4)
    names = {"reward_offset_5": ["reward", "reward_offset"], "reward_outliers": ["reward", "reward_outliers"]}
    assert trainer.reward_sources.names == names.get(condition, ["reward"])  # rewards/<name>/mean


def test_learning_rate_and_length_conditions(stability):
    for method in ("vanilla_ppo", "ppo_max"):
        base = ppo_config("unused", method)
        overrides = stability.condition_arguments("lr_x3", method, seed=0)["config_overrides"]
        stressed = ppo_config("unused", method, **overrides)
        assert stressed.learning_rate == pytest.approx(3 * base.learning_rate)
        assert stressed.effective_critic_learning_rate == pytest.approx(3 * base.effective_critic_learning_rate)
    assert stability.condition_iterations("long", 60) == 180
    assert stability.condition_iterations("reward_outliers", 60) == 60
    assert stability.condition_arguments("long", "ppo_max", seed=0) == {
        "config_overrides": {},
        "extra_rewards": [],
        "callbacks": [],
    }


def test_long_responses_condition_has_no_stop_token(stability):
    overrides = stability.condition_arguments("long_responses", "ppo_max", seed=0)["config_overrides"]
    config = ppo_config("unused", "ppo_max", **overrides)
    assert config.stop_token is None and config.stop_token_id is None and config.response_length == 32


def test_reward_drift_flips_its_preference_halfway(stability):
    from transformers import TrainerControl, TrainerState

    arguments = stability.condition_arguments("reward_drift", "ppo_max", seed=0, iterations=60)
    drift = arguments["extra_rewards"][0]
    assert arguments["callbacks"] == [drift] and arguments["config_overrides"]["reward_weights"] == [1.0, 1.0]
    completions = ["very nice cat", "so nice cat", "very so cat", "nice cat"]
    scores = []
    for step in (0, 29, 30, 59):
        drift.on_step_begin(None, TrainerState(global_step=step), TrainerControl())
        scores.append(drift(["p"] * 4, completions))
    assert scores[0] == scores[1] == [1.0, -1.0, 0.0, 0.0]
    assert scores[2] == scores[3] == [-1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("base", "method", "field", "off"),
    [
        ("ppo_max", "ppo_max_no_reward_norm", "reward_norm", "none"),
        ("ppo_max", "ppo_max_no_reward_clip", "reward_clip", None),
        ("ppo_max", "ppo_max_no_critic_warmup", "critic_warmup_steps", 0),
        ("ppo_max", "ppo_max_no_grad_clip", "max_grad_norm", 0.0),
        ("ppo_max", "ppo_max_no_kl", "kl_coef", 0.0),
        ("ppo_max_robust", "ppo_max_robust_no_freeze", "reward_norm_freeze", False),
        ("ppo_max_robust", "ppo_max_robust_no_winsorize", "reward_winsorize", None),
        ("ppo_max_robust", "ppo_max_robust_no_lam_critic", "lam_critic", None),
        ("ppo_max_robust", "ppo_max_robust_no_lam_alpha", "lam_alpha", None),
    ],
)
def test_each_ablation_changes_exactly_one_option(stability, base, method, field, off):
    assert method in (*stability.ROBUST_ABLATIONS, *stability.PAPER_ABLATIONS) and method in METHODS
    full, ablated = ppo_config("unused", base), ppo_config("unused", method)
    differ = [f.name for f in fields(full) if getattr(full, f.name) != getattr(ablated, f.name)]
    assert differ == [field] and getattr(ablated, field) == off
