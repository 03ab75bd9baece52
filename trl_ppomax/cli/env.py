"""``trl-ppomax env`` and ``trl-ppomax presets``: what a bug report needs, and how the presets differ."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from trl_ppomax.cli.arguments import add_command

PACKAGES = (
    "trl-ppomax", "torch", "transformers", "trl", "accelerate", "peft", "datasets", "huggingface_hub", "tokenizers",
    "deepspeed", "vllm", "bitsandbytes", "liger-kernel", "wandb", "trackio", "tensorboard",
)  # fmt: skip


def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def _accelerate_config_lines() -> list[str]:
    """accelerate's default config file (where ``accelerate config`` writes it) and its settings."""
    cache = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    folder = os.path.join(os.path.expanduser(cache), "accelerate")
    paths = [os.path.join(folder, name) for name in ("default_config.yaml", "default_config.json")]
    path = next((path for path in paths if os.path.isfile(path)), None)
    if path is None:
        return ["not found (run `accelerate config` to write one)"]
    try:
        text = Path(path).read_text()
        if path.endswith(".json"):
            items = json.loads(text).items()
        else:
            import yaml  # a dependency of transformers, accelerate and datasets

            items = (yaml.safe_load(text) or {}).items()
    except Exception as err:  # unreadable: show the path and why
        return [f"{path} (unreadable: {type(err).__name__}: {err})"]
    return [path] + [f"  - {key}: {value}" for key, value in items]


def _gpu_lines() -> list[str]:
    try:
        import torch
    except ImportError:
        return ["torch not installed"]
    lines = []
    if torch.cuda.is_available():
        lines.append(
            f"CUDA {torch.version.cuda or '-'} (HIP {torch.version.hip})"
            if torch.version.hip
            else f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}"
        )
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            lines.append(f"  - GPU {i}: {props.name}, {props.total_memory / 2**30:.0f} GiB")
    else:
        lines.append(f"CUDA not available (torch built with CUDA {torch.version.cuda})")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        lines.append("MPS available")
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        lines.append(f"XPU available ({torch.xpu.device_count()} device(s))")
    return lines


def show_env(_: argparse.Namespace) -> int:
    """Print the platform, package versions, GPUs and accelerate config to paste into a bug report."""
    print("Copy-paste the following information when reporting an issue:\n")
    print(f"- Platform: {platform.platform()}")
    print(f"- Python version: {platform.python_version()} ({sys.executable})")
    for name in PACKAGES:
        print(f"- {name} version: {_version(name)}")
    gpus, config = _gpu_lines(), _accelerate_config_lines()
    print(f"- Accelerators: {gpus[0]}", *gpus[1:], sep="\n")
    print(f"- Accelerate default config: {config[0]}", *config[1:], sep="\n")
    return 0


def show_presets(_: argparse.Namespace) -> int:
    """Print the defaults that differ between the presets ('ppo_max', 'vanilla', 'ppo_max_robust')."""
    from trl_ppomax.ppo.config import PRESETS

    names = list(PRESETS)
    first = max(map(len, ["field", *PRESETS[names[0]]])) + 2
    width = max(len(n) for n in names) + 2
    print(f"{'field':<{first}}" + "".join(f"{n:>{width}}" for n in names))
    for field in PRESETS[names[0]]:
        print(f"{field:<{first}}" + "".join(f"{PRESETS[n][field]!s:>{width}}" for n in names))
    return 0


def add(commands) -> None:
    add_command(commands, "env", show_env)
    add_command(commands, "presets", show_presets)
