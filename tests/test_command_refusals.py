"""The commands' refusals (``trl_ppomax.cli``, ``moss``, ``reward_modeling``, ``reporting``): a local path that
does not exist, a damaged release shard, a bad preference row, each named at once with the fix."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from helpers import TINY, make_trainer

from trl_ppomax import PPOMaxConfig, PPOMaxRewardTrainer
from trl_ppomax.cli import main
from trl_ppomax.data.sources import looks_local
from trl_ppomax.moss.recovery import TensorFolder, recover
from trl_ppomax.toyworld.tiny import (
    build_models,
)


# ------------------------------------------------------------------------------------------------------------------
# Recipes: a local path that does not exist fails at once, naming the setting
# ------------------------------------------------------------------------------------------------------------------
def load_recipe(name: str):
    """The module behind recipes/<name>.py (a thin wrapper): trl_ppomax.cli.ppo or trl_ppomax.cli.reward."""
    return importlib.import_module({"ppo_max": "trl_ppomax.cli.ppo", "reward_modeling": "trl_ppomax.cli.reward"}[name])


class NoLoading:
    """Stands in for the Auto classes: the path check must fail before any model or tokenizer is loaded."""

    @staticmethod
    def from_pretrained(*args, **kwargs):
        raise AssertionError(f"loaded {args[0]!r} before checking the local paths")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A working folder with existing local models and prompt files, and no model loading."""
    for folder in ("tiny/sft", "tiny/reward"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "tiny" / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "tiny" / "preferences.jsonl").write_text('{"chosen": "a", "rejected": "b"}\n')
    monkeypatch.chdir(tmp_path)
    return tmp_path


PPO_VALID = {
    "--sft_model_path": "tiny/sft",
    "--reward_model_path": "tiny/reward",
    "--dataset_name": "tiny/prompts.jsonl",
}


@pytest.mark.parametrize(
    "setting, value",
    [
        ("sft_model_path", "./missing-sft"),
        ("sft_model_path", "tiny/sfft"),  # a typo in a folder that exists
        ("model_name_or_path", "~/no/such/model"),
        ("reward_model_path", "output/typo/reward"),  # more parts than a Hub id
        ("value_model_path", "/nonexistent/critic"),
        ("dataset_name", "prompts.jsonl"),  # a data file
        ("dataset_name", "tiny/promts.jsonl"),
        ("eval_dataset_name", "data/ppo_data/valid.json"),
        ("ptx_dataset_name", "./ptx_texts"),
    ],
)
def test_ppo_recipe_fails_fast_on_a_missing_local_path(workdir, monkeypatch, setting, value):
    recipe = load_recipe("ppo_max")
    for name in ("AutoModelForCausalLM", "AutoModelForSequenceClassification", "AutoTokenizer"):
        monkeypatch.setattr(recipe, name, NoLoading)
    args = {**PPO_VALID, f"--{setting}": value}
    argv = [item for pair in args.items() for item in pair] + ["--output_dir", str(workdir / "out")]
    with pytest.raises(FileNotFoundError, match=f"^{setting} not found: {re.escape(value)} "):
        recipe.main([*argv, "--report_to", "none", "--bf16", "False"])


def test_ppo_recipe_passes_the_check_with_existing_paths(workdir, monkeypatch):
    recipe = load_recipe("ppo_max")
    monkeypatch.setattr(recipe, "AutoModelForCausalLM", NoLoading)
    argv = [item for pair in PPO_VALID.items() for item in pair] + ["--output_dir", str(workdir / "out")]
    with pytest.raises(AssertionError, match="loaded 'tiny/sft'"):  # got as far as loading the policy
        recipe.main([*argv, "--report_to", "none", "--bf16", "False"])


@pytest.mark.parametrize(
    "setting, value",
    [("model_name_or_path", "./missing-sft"), ("model_name_or_path", "tiny/sfft"), ("dataset_name", "prefs.jsonl")],
)
def test_reward_recipe_fails_fast_on_a_missing_local_path(workdir, monkeypatch, setting, value):
    recipe = load_recipe("reward_modeling")
    for name in ("AutoModelForCausalLM", "AutoModelForSequenceClassification", "AutoTokenizer"):
        monkeypatch.setattr(recipe, name, NoLoading)
    args = {"--model_name_or_path": "tiny/sft", "--dataset_name": "tiny/preferences.jsonl", f"--{setting}": value}
    argv = [item for pair in args.items() for item in pair] + ["--output_dir", str(workdir / "out")]
    with pytest.raises(FileNotFoundError, match=f"^{setting} not found: {re.escape(value)} "):
        recipe.main([*argv, "--report_to", "none", "--bf16", "False"])


@pytest.mark.parametrize(
    "name, data, local",
    [
        ("Anthropic/hh-rlhf", True, False),
        ("EleutherAI/pythia-160m", False, False),
        ("gpt2", False, False),
        ("./model", False, True),
        ("/abs/model", False, True),
        ("~/model", False, True),
        ("a/b/c", False, True),
        ("train.json", True, True),
        ("train.json", False, False),  # a model id ending in .json is not a data file
    ],
)
def test_what_looks_like_a_local_path(tmp_path, monkeypatch, name, data, local):
    monkeypatch.chdir(tmp_path)
    assert looks_local(name, data) is local


@pytest.mark.parametrize(
    "content, named",
    [
        ("", r"(\(the file is empty\)|holds no rows)"),
        ("\n\n", r"(\(the file is empty\)|holds no rows)"),
        ('{"prompt": "hi", "chosen": "a", "rejected": "b"}\n{"prompt": "a\n', r"\(line 2 is not JSON: "),
    ],
    ids=["empty", "blank-lines", "broken-line"],
)
@pytest.mark.parametrize("command", ["ppo", "reward", "evaluate"])
def test_an_empty_or_broken_jsonl_through_the_cli_names_the_file(
    workdir, monkeypatch, capsys, command, content, named
):
    """`trl-ppomax ppo|reward|evaluate` on an empty or broken JSONL file: an error naming the file (and the bad line),
    before any model or tokenizer loads (not StopIteration / ArrowInvalid from inside datasets)."""
    for recipe in map(load_recipe, ("ppo_max", "reward_modeling")):
        for name in ("AutoModelForCausalLM", "AutoModelForSequenceClassification", "AutoTokenizer"):
            monkeypatch.setattr(recipe, name, NoLoading)
    file = "tiny/preferences.jsonl" if command == "reward" else "tiny/prompts.jsonl"
    (workdir / file).write_text(content)
    pattern = f"^{re.escape(file)} .*{named}"
    common = ["--output_dir", str(workdir / "out"), "--report_to", "none", "--bf16", "False"]
    if command == "evaluate":
        argv = ["--policy", "tiny/sft", "--baseline", "tiny/sft", "--prompts", file, "--judges", "gold"]
        assert main(["evaluate", *argv, "--output", str(workdir / "eval")]) == 2
        error = capsys.readouterr().err.splitlines()[-1]  # after the progress bars of datasets
        assert re.search(pattern, error.removeprefix("trl-ppomax evaluate: error: "))
        return
    argv = [item for pair in PPO_VALID.items() for item in pair]
    if command == "reward":
        argv = ["--model_name_or_path", "tiny/sft", "--dataset_name", file]
    with pytest.raises(ValueError, match=pattern):
        main([command, *argv, *common])


@pytest.mark.parametrize(
    "written, named",
    [
        ({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}, "train_micro_batch_size_per_gpu=8"),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}, "gradient_accumulation_steps=1"),
        ({"train_micro_batch_size_per_gpu": 4}, r"gradient_accumulation_steps=1 \(accelerate's value"),
    ],
    ids=["micro-batch", "accumulation", "accumulation-missing"],
)
def test_a_deepspeed_json_whose_batch_is_not_the_runs_is_refused(tmp_path, monkeypatch, written, named):
    """A user's DeepSpeed JSON with other batch numbers than the run's: DeepSpeed would step the optimizer after its
    own accumulation count (accelerate only warns), silently changing every update. Refused when the config is made."""
    pytest.importorskip("deepspeed")
    from transformers.integrations import unset_hf_deepspeed_config

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**written, "zero_optimization": {"stage": 2}}))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
    try:
        with pytest.raises(ValueError, match=f"The DeepSpeed config says {named}.*set them equal"):
            PPOMaxConfig(output_dir=str(tmp_path / "out"), use_cpu=True, **TINY)  # 4 per device × 2 accumulation
        run = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 8}
        path.write_text(json.dumps({**run, "zero_optimization": {"stage": 2}}))
        PPOMaxConfig(output_dir=str(tmp_path / "out"), use_cpu=True, **TINY)  # the run's numbers: accepted
    finally:
        unset_hf_deepspeed_config()


def test_the_engine_memory_benchmark_launches_accelerate_of_this_interpreter(tmp_path, monkeypatch):
    """From a virtual environment that is not activated, `accelerate` on PATH is another install or none: the
    benchmark (and tests/test_engines.py through it) runs `python -m accelerate.commands.launch` of its interpreter."""
    import subprocess
    import sys

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "engine_memory.py"
    spec = importlib.util.spec_from_file_location("engine_memory", path)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    commands = []
    monkeypatch.setattr(
        subprocess, "run", lambda command, **_: commands.append(command) or SimpleNamespace(returncode=0)
    )
    benchmark.launch(tmp_path / "zero3.yaml", [], {}, tmp_path / "run.json", 2, 60)
    (command,) = commands
    assert command[:3] == [sys.executable, "-m", "accelerate.commands.launch"]


# ------------------------------------------------------------------------------------------------------------------
# moss recover: a truncated .bin shard is named
# ------------------------------------------------------------------------------------------------------------------
def truncate_file(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("keep", [0.5, 0.99, 0.0])
def test_a_truncated_single_bin_file_is_named(tmp_path, keep):
    torch.save({"a": torch.ones(64, 64), "b": torch.zeros(8)}, tmp_path / "pytorch_model.bin")
    truncate_file(tmp_path / "pytorch_model.bin", keep)
    with pytest.raises(ValueError, match=r"pytorch_model\.bin .*truncated or corrupt.*Re-download"):
        TensorFolder(tmp_path)


def test_an_old_format_bin_file_still_loads(tmp_path):
    torch.save({"a": torch.ones(3)}, tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    assert torch.equal(TensorFolder(tmp_path)["a"], torch.ones(3))


def test_moss_recover_names_a_truncated_diff_shard_and_writes_nothing(tmp_path):
    from test_moss_recovery import Release

    release = Release(tmp_path)
    shard = sorted(release.diff_dir.glob("pytorch_model-*.bin"))[1]
    truncate_file(shard)
    with pytest.raises(ValueError, match=rf"{shard.name} .*truncated or corrupt") as error:
        recover(release.raw_dir, release.diff_dir, tmp_path / "out", "reward", check=False, progress=False)
    assert str(error.value).startswith(f"Shard {shard} ")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".tmp-*"))


def test_moss_recover_cli_reports_a_truncated_shard_in_one_line(tmp_path, capsys):
    from test_moss_recovery import Release

    from trl_ppomax.cli import main

    release = Release(tmp_path)
    shard = sorted(release.diff_dir.glob("pytorch_model-*.bin"))[0]
    truncate_file(shard)
    argv = ["moss", "recover", "--raw", str(release.raw_dir), "--diff", str(release.diff_dir)]
    code = main([*argv, "--output", str(tmp_path / "out"), "--model-type", "reward", "--skip-integrity-check"])
    assert code == 2
    assert shard.name in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------------
# Reward trainer: a preference row without a chosen or rejected response
# ------------------------------------------------------------------------------------------------------------------
GOOD = {"prompt": "say hi", "chosen": " hi there", "rejected": " go away"}


@pytest.mark.parametrize(
    "bad_row, column, what",
    [
        ({**GOOD, "chosen": None}, "chosen", "no 'chosen' (None)"),
        ({**GOOD, "rejected": None}, "rejected", "no 'rejected' (None)"),
        ({**GOOD, "chosen": ""}, "chosen", "an empty 'chosen'"),
        ({**GOOD, "rejected": ""}, "rejected", "an empty 'rejected'"),
    ],
)
@pytest.mark.parametrize("split", ["train", "eval"])
def test_reward_trainer_rejects_a_row_without_a_response(tmp_path, bad_row, column, what, split):
    from test_reward_modeling_trainer import reward_args

    tokenizer, policy, _ = build_models()
    rows = [GOOD, GOOD, bad_row, GOOD]
    datasets = {"train": Dataset.from_list([GOOD] * 4), "eval": Dataset.from_list([GOOD] * 4)}
    datasets[split] = Dataset.from_list(rows)
    with pytest.raises(ValueError, match=rf"Row 2 of the {split} dataset has {re.escape(what)}") as error:
        PPOMaxRewardTrainer(
            model=policy,
            args=reward_args(tmp_path, eval_strategy="no"),
            train_dataset=datasets["train"],
            eval_dataset=datasets["eval"],
            processing_class=tokenizer,
        )
    assert column in str(error.value)


@pytest.mark.parametrize(
    "rows, message",
    [
        (
            [{"chosen_ids": [5, 6], "rejected_ids": [7]}, {"chosen_ids": [], "rejected_ids": [7]}],
            "Row 1 .* 'chosen_ids'",
        ),
        (
            [
                {"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]},
                {"chosen": [{"role": "user", "content": "a"}], "rejected": []},
            ],
            "Row 1 .* an empty 'rejected'",
        ),
    ],
    ids=["token-ids", "conversation"],
)
def test_preference_row_check_covers_ids_and_conversations(rows, message):
    from trl_ppomax.reward_modeling.trainer import check_preference_rows

    with pytest.raises(ValueError, match=message):
        check_preference_rows(Dataset.from_list(rows), "train")
    check_preference_rows(Dataset.from_list(rows[:1]), "train")  # a complete row passes


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0])
def test_reward_config_refuses_a_non_finite_or_negative_lm_loss_coef(tmp_path, value):
    from trl_ppomax import PPOMaxRewardConfig

    with pytest.raises(ValueError, match=rf"^lm_loss_coef \(β_rm\) must be a finite number ≥ 0, got {value!r}:"):
        PPOMaxRewardConfig(output_dir=str(tmp_path), lm_loss_coef=value, report_to="none")


@pytest.mark.parametrize("flag", ["--raw", "--diff"])
def test_moss_recover_names_a_local_folder_that_does_not_exist(tmp_path, capsys, flag):
    """`moss recover --diff ./typo` was reported as a malformed Hub repo id."""
    paths = {"--raw": str(tmp_path), "--diff": str(tmp_path), flag: "./no/such/release"}
    argv = [item for pair in paths.items() for item in pair]
    code = main(["moss", "recover", *argv, "--output", str(tmp_path / "out"), "--model-type", "reward"])
    assert code == 2
    err = capsys.readouterr().err
    assert f"{flag} ./no/such/release: the local folder " in err and "does not exist" in err
    assert "Repo id" not in err and "repo_id" not in err


def test_the_card_of_an_in_memory_policy_links_no_base_model(tmp_path):
    """Reported as `[None](…/None)`; the trainer's card (as create_model_card and push_to_hub write it) of a policy
    built in memory must name no base model at all (a regression guard: not reproduced on the current code)."""
    trainer = make_trainer(tmp_path)
    trainer.create_model_card()
    card = (tmp_path / "out" / "README.md").read_text()
    assert "None](" not in card and "huggingface.co/None" not in card and "base_model" not in card
    assert "starting from" not in card and "on the Hugging Face stack." in card
