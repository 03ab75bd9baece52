"""What users type on the command line (``trl_ppomax.cli.arguments``, issue 31): every command's ``--help`` renders,
each command offers its own configs, a float from YAML is refused while the command line converts, a YAML typo is named
with the nearest field (exit 2, no traceback), and the shipped configs build without deprecation warnings. The configs'
own refusals (whole-number fields given floats) are in ``test_ppo_config.py``."""

from __future__ import annotations

import argparse
import runpy
import sys
import warnings
from pathlib import Path

import pytest
from helpers import exit_code
from trl import ModelConfig

from trl_ppomax import PPOMaxConfig, PPOMaxRewardConfig
from trl_ppomax.cli import TRAINING_COMMANDS, build_parser, main
from trl_ppomax.cli.arguments import parse_script_args, read_config, shipped_configs
from trl_ppomax.cli.ppo import PPOMaxScriptArguments
from trl_ppomax.cli.reward import RewardScriptArguments

ROOT = Path(__file__).resolve().parents[1]
DATACLASSES = {
    "ppo": (PPOMaxScriptArguments, PPOMaxConfig, ModelConfig),
    "reward": (RewardScriptArguments, PPOMaxRewardConfig, ModelConfig),
}


# ------------------------------------------------------------------------------------------------------------------
# 1. --help renders everywhere (a '%' in a help text crashed argparse: "must be real number, not dict")
# ------------------------------------------------------------------------------------------------------------------
def command_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """Every command and sub-command of ``parser``: ("env",), ("moss",), ("moss", "recover"), ..."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name)
                yield from command_paths(sub, (*prefix, name))


HELP_CALLS = [[], *([*path] for path in command_paths(build_parser()))] + [
    [name, "--config", config] for name in TRAINING_COMMANDS for config in shipped_configs(name)
]


@pytest.mark.parametrize("argv", HELP_CALLS, ids=lambda argv: " ".join(argv) or "trl-ppomax")
def test_every_command_renders_its_help(argv, capsys):
    assert exit_code(lambda: main([*argv, "--help"])) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: trl-ppomax"), out[:200]
    if "--config" in argv:  # the fields, with the config's values
        assert "--learning_rate" in out and f"usage: trl-ppomax {argv[0]} [-h]" in out
        assert ("--num_samples_per_prompt" in out) == (argv[0] == "ppo")


@pytest.mark.parametrize("recipe", sorted(p.name for p in (ROOT / "recipes").glob("*.py")))
def test_every_recipe_renders_its_help(recipe, capsys, monkeypatch):
    """``python recipes/RECIPE --help``, in this process (the recipe puts the checkout first on sys.path)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", [str(ROOT / "recipes" / recipe), "--help"])
    assert exit_code(lambda: runpy.run_path(str(ROOT / "recipes" / recipe), run_name="__main__")) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {recipe}") and "--learning_rate" in out


# ------------------------------------------------------------------------------------------------------------------
# 2. each training command offers its own configs
# ------------------------------------------------------------------------------------------------------------------
def test_each_training_command_offers_only_its_configs(capsys):
    offered = {}
    for name in TRAINING_COMMANDS:
        assert main([name, "--help"]) == 0
        line = next(line for line in capsys.readouterr().out.splitlines() if "by name: " in line)
        offered[name] = line.partition("by name: ")[2].split(", ")
    assert offered["reward"] == ["reward_moss_7b_en", "reward_tiny_cpu"]
    assert "tiny_cpu" in offered["ppo"] and not any(name.startswith("reward") for name in offered["ppo"])
    assert sorted(offered["ppo"] + offered["reward"]) == shipped_configs()
    assert main(["ppo", "--config", "reward_tiny_cpu"]) == 2
    assert "a config of `trl-ppomax reward`, not of `trl-ppomax ppo`" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------------
# 3. whole-number fields refuse floats (and bools) when the config is built
# ------------------------------------------------------------------------------------------------------------------


def write(tmp_path: Path, text: str, name: str = "mine.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_float_from_yaml_is_refused_and_the_command_line_converts(tmp_path):
    path = write(tmp_path, "output_dir: out\nbf16: false\nuse_cpu: true\nnum_samples_per_prompt: 2.0\n")
    with pytest.raises(ValueError, match=r"num_samples_per_prompt must be a whole number, got 2\.0.*`num_samples"):
        parse_script_args(DATACLASSES["ppo"], ["--config", path])
    path = write(tmp_path, "output_dir: out\nbf16: false\nuse_cpu: true\neval_samples: 8.0\n")
    with pytest.raises(ValueError, match=r"eval_samples must be a whole number, got 8\.0"):
        parse_script_args(DATACLASSES["ppo"], ["--config", path])
    script_args, _, _ = parse_script_args(DATACLASSES["ppo"], ["--config", path, "--eval_samples", "8"])
    assert script_args.eval_samples == 8  # the command line's value wins, converted by argparse
    _, args, _ = parse_script_args(DATACLASSES["ppo"], [*cpu_flags(), "--num_samples_per_prompt", "2"])
    assert args.num_samples_per_prompt == 2 and type(args.num_samples_per_prompt) is int


def cpu_flags() -> list[str]:
    return ["--output_dir", "out", "--bf16", "False", "--use_cpu", "True"]


# ------------------------------------------------------------------------------------------------------------------
# 4. a typo in a user's YAML config: named, with the nearest field, exit 2 and no traceback
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["ppo", "reward"])
def test_a_yaml_typo_names_the_field_and_exits_2(command, tmp_path, capsys):
    path = write(tmp_path, "output_dir: out\nlearnig_rate: 1e-5\n")
    with pytest.raises(SystemExit) as exit_:
        main([command, "--config", path])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        f"trl-ppomax {command}: error: unknown field 'learnig_rate' in {path} — did you mean 'learning_rate'?\n"
    )


def test_bad_config_files_and_flags_are_one_line_errors(tmp_path, capsys):
    cases = [
        ("zzz_qqq: 1\n", [], "unknown field 'zzz_qqq' in {path} (see --help for every field)"),
        ("a: [\n", [], "{path} is not valid YAML: "),
        ("- 1\n", [], "{path} must hold a YAML mapping of field: value, got a list"),
        ("env: 3\n", [], "`env` in {path} must be a mapping of environment variables"),
        ("seed: 1\n", ["--learnig_rate", "1e-5"], "unknown flag '--learnig_rate' — did you mean '--learning_rate'?"),
    ]
    for text, flags, message in cases:
        path = write(tmp_path, text)
        with pytest.raises(SystemExit) as exit_:
            parse_script_args(DATACLASSES["ppo"], ["--config", path, *flags], prog="trl-ppomax ppo")
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith(f"trl-ppomax ppo: error: {message.format(path=path)}"), err
        assert err.count("\n") == 1


def test_a_correct_user_yaml_works(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_PPOMAX_TEST_VARIABLE", "before")
    text = (
        "# my run\nenv:\n  TRL_PPOMAX_TEST_VARIABLE: from-yaml\nsft_model_path: my/sft\nlearning_rate: 1e-5\n"
        "num_samples_per_prompt: 2\neval_samples: 4\nactivation_checkpointing: false\nlora_r: 8\n"
        "output_dir: out\nbf16: false\nuse_cpu: true\n"
    )
    path = write(tmp_path, text)
    for argv in (["--config", path], [f"--config={path}"]):
        script_args, args, model_args = parse_script_args(DATACLASSES["ppo"], [*argv, "--kl_coef", "0.02"])
        assert (args.learning_rate, args.num_samples_per_prompt, args.kl_coef) == (1e-5, 2, 0.02)
        assert args.sft_model_path == "my/sft" and script_args.eval_samples == 4 and model_args.lora_r == 8
        assert not args.checkpointing[0]
    import os

    assert os.environ["TRL_PPOMAX_TEST_VARIABLE"] == "from-yaml"


def test_new_field_names_are_read_as_the_old_ones_on_older_transformers(tmp_path):
    """Before transformers 5.20 activation checkpointing was called gradient checkpointing."""
    path = write(tmp_path, "activation_checkpointing: false\nactivation_checkpointing_kwargs: {use_reentrant: true}\n")
    old = read_config(path, {"gradient_checkpointing", "gradient_checkpointing_kwargs"})
    assert old == {"gradient_checkpointing": False, "gradient_checkpointing_kwargs": {"use_reentrant": True}}
    assert read_config(path, {"activation_checkpointing", "activation_checkpointing_kwargs", "gradient_checkpointing"})


# ------------------------------------------------------------------------------------------------------------------
# 6. every shipped config builds, without a deprecation warning (gradient_checkpointing is activation_checkpointing)
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", shipped_configs())
def test_every_shipped_config_builds_without_deprecation_warnings(config, tmp_path, monkeypatch):
    import trl_ppomax.toyworld.tiny

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        trl_ppomax.toyworld.tiny, "save_tiny_models", lambda folder: None
    )  # tiny_cpu builds them otherwise
    command = "reward" if config.startswith("reward_") else "ppo"
    argv = ["--config", config, "--bf16", "False", "--output_dir", str(tmp_path)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, args, _ = parse_script_args(DATACLASSES[command], argv)
    deprecated = [str(w.message) for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))]
    assert not deprecated
    text = (ROOT / "trl_ppomax" / "cli" / "configs" / f"{config}.yaml").read_text()
    assert "\ngradient_checkpointing" not in text
    assert args.activation_checkpointing == ("activation_checkpointing: true" in text)
