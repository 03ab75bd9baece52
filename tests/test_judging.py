"""``trl-ppomax evaluate`` and ``trl_ppomax.judging``: the report's numbers by hand, the ``rm`` and ``gold`` judges,
the end-to-end evaluation with its cache and resume, the command line (with the human sheet round trip) and the
training-time win rate."""

from __future__ import annotations

import json
import math

import pytest
import torch
from datasets import Dataset
from helpers import make_trainer, snapshot

from trl_ppomax.base import metrics as M
from trl_ppomax.cli import main
from trl_ppomax.data import tokenize_prompt
from trl_ppomax.judging.answers import GenerationSettings, load_prompts
from trl_ppomax.judging.base import JsonlCache, Pair, combine_swapped, margin_verdict
from trl_ppomax.judging.callback import WinRateCallback
from trl_ppomax.judging.report import count, tally, wilson_interval
from trl_ppomax.judging.run import evaluate_policy
from trl_ppomax.judging.scored import FunctionJudge, RewardModelJudge
from trl_ppomax.models import sequence_scores
from trl_ppomax.toyworld import eval_prompts, gold_rewards

CAT = "user: tell me about the cat </s> assistant:"
TOY = GenerationSettings(max_new_tokens=12, temperature=1.0, top_p=1.0, repetition_penalty=1.0, batch_size=4)


def test_report_numbers_by_hand():
    verdicts = ["win", "win", "tie", "lose", "invalid"]
    report = tally(verdicts, ["a", "a", "b", "b", "a"])
    assert list(report) == ["a", "b", "all"]
    assert report["a"] | {"win_rate_ci95": None} == {
        "win": 2,
        "tie": 0,
        "lose": 0,
        "invalid": 1,
        "n": 2,
        "win_rate": 1.0,
        "win_rate_ci95": None,
    }
    assert report["b"]["win_rate"] == 0.0 and report["b"]["n"] == 2
    total = report["all"]
    assert (total["win"], total["tie"], total["lose"], total["invalid"], total["n"]) == (2, 1, 1, 1, 4)
    assert total["win_rate"] == 0.5
    # Wilson interval of 2/4 at 95 %: (p + z²/2n ± z·sqrt(p(1−p)/n + z²/4n²)) / (1 + z²/n) = (0.1500, 0.8500)
    assert total["win_rate_ci95"] == pytest.approx([0.15003, 0.84997], abs=1e-4)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == pytest.approx(1.0)
    assert math.isnan(count(["invalid"])["win_rate"])


def test_verdict_rules():
    assert margin_verdict(1.0, 0.5) == "win" and margin_verdict(0.5, 1.0) == "lose"
    assert margin_verdict(1.0, 0.8, tie_threshold=0.25) == "tie"
    assert margin_verdict(float("nan"), 0.0) == "invalid"
    assert combine_swapped("win", "win") == "win"
    assert combine_swapped("win", "lose") == "tie"
    assert combine_swapped("tie", "invalid") == "invalid"


def test_cache_survives_a_cut_line(tmp_path):
    cache = JsonlCache(tmp_path / "c.jsonl")
    cache.put("a", 1)
    with (tmp_path / "c.jsonl").open("a") as file:
        file.write('{"key": "b", "val')  # a crash in the middle of a line
    reopened = JsonlCache(tmp_path / "c.jsonl")
    assert reopened.get("a") == 1 and "b" not in reopened
    reopened.put("b", 2)
    assert JsonlCache(tmp_path / "c.jsonl").get("b") == 2


def test_gold_judge_by_hand(tmp_path):
    # gold: topic 1 + polite 0.5 = 1.5 against 3 words with 2 repeats: −0.6 − 0.3 (too short) = −0.9
    good, bad = "the cat is nice please", "the the the"
    pairs = [Pair("0", CAT, good, bad), Pair("1", CAT, bad, good), Pair("2", CAT, good, good)]
    judge = FunctionJudge(gold_rewards)
    cache = JsonlCache(tmp_path / "gold.jsonl")
    assert judge.judge(pairs, cache) == ["win", "lose", "tie"]
    assert cache.get("0") == {"policy": pytest.approx(1.5), "baseline": pytest.approx(-0.9)}
    assert (
        FunctionJudge(gold_rewards, tie_threshold=3.0).judge(pairs, JsonlCache(tmp_path / "g2.jsonl")) == ["tie"] * 3
    )


def test_rm_judge_scores_the_trained_inputs(tiny_dir, tmp_path):
    judge = RewardModelJudge(tiny_dir["llama"]["reward"])
    tokenizer = judge.tokenizer
    prompt, answers = "hello there", ["a b c", "d"]
    pairs = [Pair("0", prompt, answers[0], answers[1], finished=(True, False))]
    [verdict] = judge.judge(pairs, JsonlCache(tmp_path / "rm.jsonl"))
    scored = JsonlCache(tmp_path / "rm.jsonl").get("0")
    # by hand: the prompt's ids (BOS rule), the answer's tokens, the stop token only where the answer ended with it
    ids = [
        tokenize_prompt(prompt, tokenizer)
        + tokenizer(answers[0], add_special_tokens=False)["input_ids"]
        + [tokenizer.eos_token_id],
        tokenize_prompt(prompt, tokenizer) + tokenizer(answers[1], add_special_tokens=False)["input_ids"],
    ]
    expected = [
        sequence_scores(judge.model, {"input_ids": torch.tensor([row]), "attention_mask": torch.ones(1, len(row))})
        for row in ids
    ]
    assert scored["policy"] == pytest.approx(expected[0].item(), abs=1e-5)
    assert scored["baseline"] == pytest.approx(expected[1].item(), abs=1e-5)
    assert verdict == margin_verdict(scored["policy"], scored["baseline"])


@pytest.mark.slow  # builds the toy world, half a minute cold (.ci/run runs it)
def test_evaluate_policy_end_to_end_and_resume(world, tmp_path, monkeypatch):
    prompts = load_prompts(eval_prompts(8))
    judges = [FunctionJudge(gold_rewards), RewardModelJudge(world.reward)]
    report = evaluate_policy(world.sft, world.sft, prompts, tmp_path / "ev", judges, TOY)
    for name in ("gold", "rm"):
        entry = report["judges"][name]["categories"]["all"]
        # the same model with the same seed per batch gives the same answers: every pair is a tie
        assert (entry["tie"], entry["n"], entry["win_rate"]) == (8, 8, 0.0)
    written = json.loads((tmp_path / "ev" / "report.json").read_text())
    assert written["judges"]["gold"]["categories"]["all"]["tie"] == 8
    assert (tmp_path / "ev" / "report.png").stat().st_size > 0
    assert len((tmp_path / "ev" / "pairs.jsonl").read_text().splitlines()) == 8

    # a second run generates nothing and asks no judge: everything comes from the cache
    def refuse(*args, **kwargs):
        raise AssertionError("nothing should be generated or scored again")

    monkeypatch.setattr("trl_ppomax.judging.answers.load_causal_lm", refuse)
    monkeypatch.setattr(FunctionJudge, "score", refuse)
    again = evaluate_policy(world.sft, world.sft, prompts, tmp_path / "ev", [FunctionJudge(gold_rewards)], TOY)
    assert again["judges"]["gold"] == report["judges"]["gold"]
    with pytest.raises(ValueError, match=r"other settings .*generation"):
        evaluate_policy(world.sft, world.sft, prompts, tmp_path / "ev", [], GenerationSettings(max_new_tokens=5))


@pytest.mark.slow  # seconds (the README's command stays under 4 minutes; .ci/run runs it)
def test_resumed_generation_samples_what_an_uninterrupted_run_would(world, tmp_path):
    prompts = load_prompts(eval_prompts(8))
    whole = evaluate_policy(world.sft, world.sft, prompts, tmp_path / "whole", [], TOY)
    del whole
    # interrupted after the first batch of the policy: the cache holds 4 answers
    lines = (tmp_path / "whole" / "generations.jsonl").read_text().splitlines()
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "generations.jsonl").write_text("\n".join(lines[:4]) + "\n")
    evaluate_policy(world.sft, world.sft, prompts, tmp_path / "cut", [], TOY)
    read = lambda folder: (tmp_path / folder / "pairs.jsonl").read_text()  # noqa: E731
    assert read("cut") == read("whole")


@pytest.mark.slow  # seconds (the README's command stays under 4 minutes; .ci/run runs it)
def test_cli_pairwise_with_categories_and_the_human_round_trip(world, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": p, "topic": p.split()[-3]} for p in eval_prompts(6)["prompt"]]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    common = [
        "evaluate",
        "--policy",
        world.sft,
        "--baseline",
        world.sft,
        "--prompts",
        str(data),
        "--split",
        "train",
        "--category-column",
        "topic",
        "--max-new-tokens",
        "8",
        "--output",
        str(out),
    ]
    assert main([*common, "--judges", "gold", "rm", "human", "--reward-model", world.reward, "--seed", "3"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert set(report["judges"]) == {"gold", "rm"}  # the human judge waits for its sheet
    categories = report["judges"]["gold"]["categories"]
    assert set(categories) == {r["topic"] for r in rows} | {"all"}
    assert sum(c["n"] for name, c in categories.items() if name != "all") == 6
    printed = capsys.readouterr().out
    assert "win rate (95% CI)" in printed and "human_sheet.csv" in printed

    # annotators prefer response_1 everywhere: the key says which side that was
    import csv

    from trl_ppomax.judging.human import load_key

    sheet = out / "human" / "human_sheet.csv"
    with sheet.open(encoding="utf-8-sig", newline="") as file:
        table = list(csv.DictReader(file))
    for row in table:
        row["preferred"] = "1"
    filled = tmp_path / "filled.csv"
    with filled.open("w", encoding="utf-8", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    wins = sum(entry["policy_column"] == "response_1" for entry in load_key(out / "human" / "human_key.json").values())
    assert main([*common, "--seed", "3", "--judges", "gold", "human", "--human-sheet", str(filled)]) == 0
    human = json.loads((out / "report.json").read_text())["judges"]["human"]["categories"]["all"]
    assert (human["win"], human["lose"], human["n"]) == (wins, 6 - wins, 6)


@pytest.mark.slow  # builds the toy world, half a minute cold (.ci/run runs it)
def test_cli_errors_are_one_line(world, tmp_path, capsys):
    base = ["evaluate", "--policy", world.sft, "--baseline", world.sft, "--output", str(tmp_path / "o")]
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": CAT}) + "\n")
    assert main([*base, "--prompts", str(data), "--judges", "rm"]) == 2
    assert "--judges rm needs --reward-model" in capsys.readouterr().err
    assert main([*base, "--prompts", "missing.jsonl", "--judges", "gold"]) == 2
    assert "--prompts missing.jsonl not found" in capsys.readouterr().err
    assert main([*base, "--judges", "gold"]) == 2
    assert "needs --baseline, --prompts and --judges" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("judge", ["rm", "gold_like"])
def test_win_rate_callback_logs_and_leaves_training_unchanged(tmp_path, judge):
    def lengths(prompts, completions):  # a scoring judge: longer answers win
        return [float(len(c)) for c in completions]

    plain = make_trainer(tmp_path / "plain")
    plain.train()
    trainer = make_trainer(tmp_path / "cb")
    before = snapshot(trainer.model)
    judge_arg = "rm" if judge == "rm" else FunctionJudge(lengths, name="length")
    trainer.add_callback(WinRateCallback(trainer, judge=judge_arg, every=1, num_prompts=6))
    trainer.train()
    logged = [e for e in trainer.state.log_history if M.WIN_RATE_VS_SFT in e]
    assert [e["step"] for e in logged] == [1, 2]
    for entry in logged:
        rates = [entry[M.WIN_RATE_VS_SFT], entry[M.TIE_RATE_VS_SFT], entry[M.LOSE_RATE_VS_SFT]]
        assert all(0 <= r <= 1 for r in rates) and sum(rates) == pytest.approx(1.0)
    assert (tmp_path / "cb" / "out" / "win_rate_baseline" / "process-0.json").exists()
    # the checks sample under their own seed: training is exactly what it is without the callback
    for name, value in plain.model.named_parameters():
        assert torch.equal(value, dict(trainer.model.named_parameters())[name]), name
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_win_rate_callback_refuses_bad_settings(tmp_path):
    trainer = make_trainer(tmp_path)
    with pytest.raises(ValueError, match="every=0"):
        WinRateCallback(trainer, every=0)
    with pytest.raises(ValueError, match="ScoreJudge"):
        WinRateCallback(trainer, judge="llm")


def test_load_prompts_categories_and_subset():
    data = Dataset.from_dict({"prompt": [f"p{i}" for i in range(10)], "kind": ["x", "y"] * 5})
    assert set(load_prompts(data, category_column="kind")["category"]) == {"x", "y"}
    assert set(load_prompts(data, category="harmless")["category"]) == {"harmless"}
    subset = load_prompts(data, num_prompts=4, seed=1)
    assert len(subset) == 4 and subset["prompt"] == load_prompts(data, num_prompts=4, seed=1)["prompt"]
    with pytest.raises(ValueError, match="not a column"):
        load_prompts(data, category_column="nope")


def test_answers_too_long_for_the_model_name_the_evaluate_flag(tiny_dir, tmp_path, capsys):
    """A 128-position model: the evaluate command has no response_length, its answers are --max-new-tokens long."""
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "user: " + "tell me about the cat " * 20}) + "\n")
    sft = tiny_dir["llama"]["sft"]
    base = ["evaluate", "--policy", sft, "--baseline", sft, "--prompts", str(data), "--judges", "gold"]
    assert main([*base, "--max-new-tokens", "200", "--output", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # after the datasets progress bars
    assert err.startswith(
        "trl-ppomax evaluate: error: max_new_tokens=200 (--max-new-tokens) does not fit the model's context of 128 "
        "tokens (config.max_position_embeddings)"
    )
    assert "Lower --max-new-tokens (e.g. --max-new-tokens 32" in err and "response_length" not in err
    # a prompt longer than what 120 answer tokens leave: none is left to answer
    assert main([*base, "--max-new-tokens", "120", "--output", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("trl-ppomax evaluate: error: The evaluation prompts: 1 of 1 prompts are longer")
    assert "none is left. Shorten the prompts or lower max_new_tokens (--max-new-tokens)." in err
    assert "response_length" not in err
