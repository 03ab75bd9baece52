"""The wheel works on its own: built, installed into a fresh virtual environment, and run from an empty folder.

torch, transformers, trl... come from this environment (`--system-site-packages`); the wheel is installed with
`--no-deps --force-reinstall`, and the test checks that the environment's `trl_ppomax` is the wheel's, not this
checkout (an editable install of it may also be visible through the system site-packages).
"""

import os
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def run(command, cwd, timeout=900, env=None) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        pytest.fail(f"{' '.join(map(str, command))} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A virtual environment with the wheel of this checkout installed: its bin/ folder."""
    base = tmp_path_factory.mktemp("wheel")
    source = base / "source"  # build from a copy: nothing is written into the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "trl_ppomax", source / "trl_ppomax", ignore=shutil.ignore_patterns("__pycache__"))
    dist = base / "dist"
    start = time.perf_counter()
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", dist, "."], cwd=source)
    (wheel,) = dist.glob("trl_ppomax-*.whl")
    environment = base / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(environment)
    bin_dir = environment / "bin"
    run([sys.executable, "-m", "pip", "--python", bin_dir / "python", "install", "--no-deps", "--force-reinstall",
         "--no-index", wheel], cwd=base)  # fmt: skip
    print(f"wheel built and installed in {time.perf_counter() - start:.1f} s")
    return bin_dir


def clean_env(bin_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {
        **env,
        "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        "HF_HUB_OFFLINE": "1",
        "WANDB_DISABLED": "true",
        "CUDA_VISIBLE_DEVICES": "",
        "TOKENIZERS_PARALLELISM": "false",
    }


def test_the_wheel_ships_the_configs_and_is_the_one_imported(installed, tmp_path):
    probe = "import trl_ppomax, trl_ppomax.cli.arguments as s; print(trl_ppomax.__file__); print(*s.shipped_configs())"
    out = run([installed / "python", "-c", probe], cwd=tmp_path, env=clean_env(installed)).stdout.splitlines()
    assert Path(out[0]).is_relative_to(installed.parent), f"imported {out[0]}, not the wheel's trl_ppomax"
    assert {"tiny_cpu", "reward_tiny_cpu", "moss_7b_en"} <= set(out[1].split())
    package = Path(out[0]).parent
    assert {p.name for p in (package / "cli" / "accelerate_configs").glob("*.yaml")} == {
        p.name for p in (ROOT / "recipes" / "accelerate").glob("*.yaml")
    }


def test_installed_commands_train_from_an_empty_folder(installed, tmp_path):
    env = clean_env(installed)
    command = installed / "trl-ppomax"
    assert run([command, "--version"], cwd=tmp_path, env=env).stdout.startswith("trl-ppomax ")

    start = time.perf_counter()
    run([command, "reward", "--config", "reward_tiny_cpu", "--num_train_epochs", "1"], cwd=tmp_path, env=env)
    reward_s = time.perf_counter() - start
    assert (tmp_path / "tiny" / "sft" / "config.json").is_file()  # the tiny models were built on first use
    assert (tmp_path / "output" / "reward-tiny" / "config.json").is_file()

    start = time.perf_counter()
    stdout = run([command, "ppo", "--config", "tiny_cpu", "--disable_tqdm", "True"], cwd=tmp_path, env=env).stdout
    ppo_s = time.perf_counter() - start
    assert "devices" in stdout  # the run plan
    output = tmp_path / "output" / "ppo-max-tiny"
    assert (output / "config.json").is_file() and any(output.glob("*.safetensors"))
    print(f"trl-ppomax reward: {reward_s:.1f} s, trl-ppomax ppo: {ppo_s:.1f} s")
