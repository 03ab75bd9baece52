"""The ``trl-ppomax`` command line: ``trl-ppomax env``, ``trl-ppomax presets`` and ``trl-ppomax tiny``."""

from __future__ import annotations

import argparse
import platform
import sys
from importlib.metadata import PackageNotFoundError, version

PACKAGES = (
    "trl-ppomax",
    "trl",
    "transformers",
    "accelerate",
    "peft",
    "datasets",
    "huggingface_hub",
    "torch",
    "deepspeed",
)


def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def show_env(_: argparse.Namespace) -> int:
    """Print the versions to paste into a bug report."""
    import torch

    print(f"- Python: {platform.python_version()} ({platform.platform()})")
    for name in PACKAGES:
        print(f"- {name}: {_version(name)}")
    print(f"- CUDA available: {torch.cuda.is_available()} ({torch.cuda.device_count()} device(s))")
    return 0


def show_presets(_: argparse.Namespace) -> int:
    """Print the defaults that differ between the 'ppo_max' and 'vanilla' presets."""
    from .ppo_config import PRESETS

    names = list(PRESETS)
    print(f"{'field':<22}" + "".join(f"{n:>12}" for n in names))
    for field in PRESETS[names[0]]:
        print(f"{field:<22}" + "".join(f"{PRESETS[n][field]!s:>12}" for n in names))
    return 0


def save_tiny(args: argparse.Namespace) -> int:
    """Write tiny offline models (sft/, reward/) and datasets (prompts.jsonl, preferences.jsonl) to a folder."""
    from .tiny import save_tiny_models

    try:
        paths = save_tiny_models(args.output_dir, arch=args.arch, seed=args.seed, overwrite=args.overwrite)
    except ValueError as err:
        print(f"trl-ppomax tiny: error: {err}", file=sys.stderr)
        return 2
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trl-ppomax", description="PPO-max for the Hugging Face stack.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("env", help=show_env.__doc__).set_defaults(run=show_env)
    commands.add_parser("presets", help=show_presets.__doc__).set_defaults(run=show_presets)
    tiny = commands.add_parser("tiny", help=save_tiny.__doc__, description=save_tiny.__doc__)
    tiny.add_argument("output_dir", metavar="OUTPUT_DIR", help="folder to create (must be absent or empty)")
    tiny.add_argument("--arch", choices=["llama", "gpt_neox"], default="llama", help="model architecture")
    tiny.add_argument("--seed", type=int, default=0, help="torch seed for the random weights (default: 0)")
    tiny.add_argument("--overwrite", action="store_true", help="replace OUTPUT_DIR even if it is not empty")
    tiny.set_defaults(run=save_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
