import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trl_ppomax.cli import main


def test_presets_table(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "reward_norm" in out and "running" in out and "none" in out


def test_env_lists_versions(capsys):
    assert main(["env"]) == 0
    assert "- trl version:" in capsys.readouterr().out


@pytest.mark.slow  # a fresh interpreter importing the package: 8 s cold (.ci/run runs it)
def test_console_entry_point_runs():
    result = subprocess.run([sys.executable, "-m", "trl_ppomax.cli", "presets"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# ------------------------------------------------------------------------------------------------------------------
# A fast, helpful command line (issue 15, item 4)
# ------------------------------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    """`trl-ppomax ARGS` from this checkout (the console script runs `trl_ppomax.cli:main`)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "trl_ppomax.cli", *args], capture_output=True, text=True, cwd=cwd, env=env
    )


def test_help_is_fast_and_imports_nothing_heavy():
    start = time.perf_counter()
    result = cli("--help")
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    assert elapsed < 3, f"trl-ppomax --help took {elapsed:.1f} s"
    for command in ("ppo", "reward", "env", "push", "plot"):
        assert f"    {command} " in result.stdout
    probe = "import sys, trl_ppomax.cli; print(sorted({m.split('.')[0] for m in sys.modules}))"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    for heavy in ("torch", "transformers", "trl", "accelerate", "datasets", "huggingface_hub"):
        assert f"'{heavy}'" not in loaded.stdout, f"import trl_ppomax.cli imports {heavy}"


def test_lazy_package_keeps_the_public_api():
    import trl_ppomax

    assert set(trl_ppomax.__all__) <= set(dir(trl_ppomax))
    from trl_ppomax import PPOMaxTrainer
    from trl_ppomax.ppo.trainer import PPOMaxTrainer as direct

    assert PPOMaxTrainer is direct
    with pytest.raises(AttributeError):
        trl_ppomax.NoSuchThing  # noqa: B018


def test_version():
    import trl_ppomax

    result = cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"trl-ppomax {trl_ppomax.__version__}"


def test_every_flag_shows_its_default():
    from trl_ppomax.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            if action.option_strings and action.help != argparse.SUPPRESS and action.dest != "help":
                assert action.help, f"trl-ppomax {name} {action.option_strings[0]} has no help"
    assert "(default: 100)" in " ".join(cli("demo", "--help").stdout.split())
    assert "(default: 2GB)" in " ".join(cli("moss", "recover", "--help").stdout.split())


def test_env_lists_everything_a_bug_report_needs(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    (tmp_path / "accelerate").mkdir()
    (tmp_path / "accelerate" / "default_config.yaml").write_text("distributed_type: MULTI_GPU\nnum_processes: 8\n")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for key in (
        "Platform:",
        "Python version:",
        "torch version:",
        "transformers version:",
        "trl version:",
        "accelerate version:",
        "peft version:",
        "datasets version:",
        "deepspeed version:",
        "vllm version:",
        "bitsandbytes version:",
        "trl-ppomax version:",
        "Accelerators:",
        "Accelerate default config:",
    ):
        assert f"- {key}" in out, key
    assert "num_processes: 8" in out and str(tmp_path) in out


# ------------------------------------------------------------------------------------------------------------------
# Installed training commands (issue 15, item 1): shipped configs, one copy (recipes/ links to the package's)
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shipped, repo", [("configs", "configs"), ("accelerate_configs", "accelerate")])
def test_recipes_use_the_shipped_configs(shipped, repo):
    assert (ROOT / "recipes" / repo).resolve() == (ROOT / "trl_ppomax" / "cli" / shipped).resolve()
    assert list((ROOT / "trl_ppomax" / "cli" / shipped).glob("*.yaml"))


def test_config_names_resolve_to_shipped_files(tmp_path):
    from trl_ppomax.cli.arguments import resolve_accelerate_config, resolve_config, resolve_config_argv

    assert resolve_config("tiny_cpu").endswith("trl_ppomax/cli/configs/tiny_cpu.yaml")
    assert resolve_config("tiny_cpu.yaml") == resolve_config("tiny_cpu")
    mine = tmp_path / "mine.yaml"
    mine.write_text("seed: 1\n")
    assert resolve_config(str(mine)) == str(mine)
    assert resolve_config_argv(["--config=tiny_cpu", "--seed", "1"])[0] == "--config=" + resolve_config("tiny_cpu")
    for name, file in [("zero2", "deepspeed_zero2"), ("zero3", "deepspeed_zero3"), ("fsdp2", "fsdp")]:
        assert resolve_accelerate_config(name).endswith(f"accelerate_configs/{file}.yaml")
    assert resolve_accelerate_config("multi_gpu").endswith("accelerate_configs/multi_gpu.yaml")
    with pytest.raises(FileNotFoundError, match="not a shipped config"):
        resolve_config("no_such_config")


def test_training_commands_report_bad_names():
    result = cli("ppo", "--config", "no_such_config")
    assert result.returncode == 2 and "not a shipped config" in result.stderr and "tiny_cpu" in result.stderr
    result = cli("reward", "--config", "reward_tiny_cpu", "--accelerate_config", "zero9")
    assert result.returncode == 2 and "zero2" in result.stderr
    result = cli("ppo", "--help")
    assert result.returncode == 0 and "--accelerate_config" in result.stdout and "tiny_cpu" in result.stdout


def test_accelerate_config_relaunches_through_accelerate(monkeypatch):
    from trl_ppomax import cli as module

    calls = []
    monkeypatch.setattr(module.subprocess, "call", lambda command: calls.append(command) or 0)
    assert module.main(["ppo", "--config", "tiny_cpu", "--accelerate_config", "zero2", "--seed", "3"]) == 0
    (command,) = calls
    assert command[1:3] == ["-m", "accelerate.commands.launch"]
    assert command[3] == "--config_file" and command[4].endswith("accelerate_configs/deepspeed_zero2.yaml")
    assert command[5].endswith("trl_ppomax/cli/ppo.py")
    assert command[6:] == ["--config", module_config("tiny_cpu"), "--seed", "3"]


def module_config(name: str) -> str:
    from trl_ppomax.cli.arguments import resolve_config

    return resolve_config(name)


# ------------------------------------------------------------------------------------------------------------------
# The command line's rough edges (issue 26, item 10, and its poor cases)
# ------------------------------------------------------------------------------------------------------------------
@pytest.fixture
def demo_runs(monkeypatch):
    """The toy world's ``run_demo`` calls (their keyword arguments), instead of running it."""
    from trl_ppomax.toyworld import demo

    calls = []
    monkeypatch.setattr(demo, "run_demo", lambda *args, **kwargs: calls.append((args, kwargs)))
    return calls


def test_ppo_with_only_an_output_dir_runs_the_toy_world_there(demo_runs, tmp_path):
    folder = str(tmp_path / "toy")
    assert main(["ppo", "--output_dir", folder]) == 0
    assert main(["ppo", f"--output_dir={folder}"]) == 0
    assert main(["ppo"]) == 0  # its default folder
    assert demo_runs == [((), {"output_dir": folder}), ((), {"output_dir": folder}), ((), {})]


def test_ppo_with_other_settings_and_no_dataset_says_what_to_set(demo_runs, tmp_path):
    with pytest.raises(ValueError, match=r"Set dataset_name.*--output_dir"):
        main(["ppo", "--output_dir", str(tmp_path), "--kl_coef", "0.02"])  # not the toy world: it has no kl_coef
    assert demo_runs == []


def test_evaluate_takes_judge_as_judges_and_no_flag_prefixes(capsys):
    from trl_ppomax.cli import build_parser

    base = ["evaluate", "--policy", "p", "--output", "o"]
    assert build_parser().parse_args([*base, "--judge", "llm", "--judge-model", "m"]).judges == ["llm"]
    for prefix in (["--judge-m", "gpt-4o"], ["--num", "3"]):  # unique prefixes of --judge-model, --num-prompts
        with pytest.raises(SystemExit):
            build_parser().parse_args([*base, *prefix])
        assert f"unrecognized arguments: {prefix[0]}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--iter", "3"])
    assert "unrecognized arguments: --iter" in capsys.readouterr().err


def test_demo_refuses_zero_iterations_when_parsed(demo_runs, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--iterations", "0"])
    assert exit_.value.code == 2 and demo_runs == []
    assert "argument --iterations: must be at least 1, got 0" in capsys.readouterr().err


@pytest.fixture
def evaluate_base(tmp_path, monkeypatch):
    """``trl-ppomax evaluate`` arguments on existing folders and prompts, with nothing allowed to load."""

    def forbidden(*args, **kwargs):
        raise AssertionError("prompts or models loaded before the settings were checked")

    from trl_ppomax.judging import answers, run

    monkeypatch.setattr(answers, "load_prompts", forbidden)
    monkeypatch.setattr(run, "evaluate_policy", forbidden)
    for name in ("policy", "sft"):
        (tmp_path / name).mkdir()
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    flags = {"--policy": "policy", "--baseline": "sft", "--prompts": "prompts.jsonl", "--output": "eval"}
    paths = [item for flag, name in flags.items() for item in (flag, str(tmp_path / name))]
    return ["evaluate", "--judges", "gold", *paths]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-prompts", "0"], "--num-prompts must be at least 1, got 0"),
        (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
        (["--temperature", "0"], "--temperature must be > 0 for sampling, got 0.0; for greedy decoding use --greedy"),
        (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    ],
)
def test_evaluate_refuses_settings_that_cannot_work_before_loading(evaluate_base, capsys, flags, message):
    assert main([*evaluate_base, *flags]) == 2
    assert capsys.readouterr().err.strip() == f"trl-ppomax evaluate: error: {message}"


def test_evaluate_takes_temperature_zero_with_greedy(evaluate_base):
    with pytest.raises(AssertionError, match="loaded before the settings were checked"):  # got past the checks
        main([*evaluate_base, "--temperature", "0", "--greedy"])


def without_deepspeed(monkeypatch) -> None:
    """``import deepspeed`` (and any submodule) fails in this process, as after the README's ``pip install -e
    ".[dev]"``, whether or not the extra is installed here."""
    for name in [n for n in sys.modules if n.startswith("deepspeed.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "deepspeed", None)


def engine_only_folder(tmp_path) -> Path:
    """A save_model folder as a ZeRO-3 run without gathering writes it: configs, tokenizer, DeepSpeed's ``latest``
    and its engine folder, no plain weights (the real one is made in tests/test_engines.py)."""
    from trl_ppomax.toyworld.tiny import save_tiny_models

    sft = Path(save_tiny_models(tmp_path / "tiny")["sft"])
    folder = tmp_path / "engine-only"
    folder.mkdir()
    for entry in sft.iterdir():
        if entry.is_file() and not entry.name.endswith(".safetensors"):
            (folder / entry.name).write_bytes(entry.read_bytes())
    (folder / "global_step4").mkdir()
    (folder / "latest").write_text("global_step4")
    return folder


def test_consolidate_names_what_is_missing(tmp_path, capsys, monkeypatch):
    """``trl-ppomax consolidate`` on a folder without an engine checkpoint: a one-line error, exit 2, with or without
    DeepSpeed (the real consolidation runs on a ZeRO-3 run's checkpoint in tests/test_engines.py)."""
    from trl_ppomax.toyworld.tiny import save_tiny_models

    without_deepspeed(monkeypatch)
    plain = save_tiny_models(tmp_path / "tiny")["sft"]
    capsys.readouterr()
    assert main(["consolidate", plain]) == 2
    error = capsys.readouterr().err
    assert "holds no DeepSpeed engine checkpoint" in error and "already plain" in error
    assert main(["consolidate", str(tmp_path)]) == 2
    assert "has no config.json" in capsys.readouterr().err
    assert main(["consolidate", str(tmp_path / "absent")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_consolidate_without_deepspeed_names_the_extra_in_one_line(tmp_path, capsys, monkeypatch):
    """A folder that does hold an engine checkpoint, DeepSpeed not installed: the extra to install, exit 2."""
    folder = engine_only_folder(tmp_path)
    without_deepspeed(monkeypatch)
    capsys.readouterr()  # the fixture's progress bars
    assert main(["consolidate", str(folder)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("trl-ppomax consolidate: error: ")
    assert "needs DeepSpeed, which is not installed" in error and 'pip install "trl-ppomax[deepspeed]"' in error


@pytest.mark.slow  # a fresh interpreter: 10 s cold; the message is tested in process above (.ci/run runs it)
def test_consolidate_without_deepspeed_prints_no_traceback(tmp_path):
    """The command as a user runs it, in a process where DeepSpeed cannot be imported: one line, no traceback."""
    folder = engine_only_folder(tmp_path)
    code = (
        "import sys; sys.modules['deepspeed'] = None; from trl_ppomax.cli import main; "
        f"raise SystemExit(main(['consolidate', {str(folder)!r}]))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("trl-ppomax consolidate")]
    assert len(lines) == 1 and 'pip install "trl-ppomax[deepspeed]"' in lines[0]


def tiny_cpu_argv(output_dir, *settings: str) -> list[str]:
    """``trl-ppomax ppo --config tiny_cpu`` cut to one iteration of 16 episodes, nothing evaluated or saved midway."""
    quick = ["--total_episodes", "16", "--eval_strategy", "no", "--save_strategy", "no", "--num_sample_generations"]
    return ["ppo", "--config", "tiny_cpu", "--output_dir", str(output_dir), *quick, "0", *settings]


def test_the_command_line_trains_a_critic_free_estimator_without_a_critic(tmp_path, monkeypatch):
    """``--advantage_estimator rloo --num_samples_per_prompt 2``: no critic is built (it used to fail after loading
    with "pass value_model=None"), the policy is saved and no value_model/ beside it."""
    monkeypatch.chdir(tmp_path)  # tiny_cpu builds its tiny models in ./tiny
    out = tmp_path / "rloo"
    assert main(tiny_cpu_argv(out, "--advantage_estimator", "rloo", "--num_samples_per_prompt", "2")) == 0
    assert (out / "model.safetensors").exists() and not (out / "value_model").exists()


def test_the_command_line_refuses_a_value_model_path_without_a_critic(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = tiny_cpu_argv(tmp_path / "out", "--advantage_estimator", "grpo", "--num_samples_per_prompt", "2")
    with pytest.raises(ValueError, match="value_model_path='tiny/reward', but advantage_estimator='grpo' needs no"):
        main([*argv, "--value_model_path", "tiny/reward"])


def test_the_command_line_still_builds_the_critic_for_gae(tmp_path, monkeypatch):
    """The everyday setup: GAE with value_model_path (or the reward model by default) trains a critic and saves it."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "gae"
    assert main([*tiny_cpu_argv(out, "--critic_warmup_steps", "0"), "--value_model_path", "tiny/reward"]) == 0
    assert (out / "value_model" / "config.json").exists()
