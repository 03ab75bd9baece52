"""The ``trl-ppomax`` command line: ``ppo`` and ``reward`` (:mod:`.ppo`, :mod:`.reward`), ``env`` and ``presets``
(:mod:`.env`), ``demo`` and ``plot`` (:mod:`.plot`), ``tiny``, ``consolidate``, ``push`` and ``moss recover``
(:mod:`.models`), ``evaluate`` (:mod:`trl_ppomax.judging.command`). Nothing heavy (torch, transformers, trl, the Hub
client) is imported at module level, so that ``trl-ppomax --help`` answers at once.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys

from trl_ppomax import __version__
from trl_ppomax.cli import arguments, env, models, plot

TRAINING_COMMANDS = {
    "ppo": (
        "trl_ppomax.cli.ppo",
        "run",
        "Train a policy with PPO-max (PPOMaxTrainer); no arguments: the toy world demo.",
    ),
    "reward": (
        "trl_ppomax.cli.reward",
        "main",
        "Train a PPO-max reward model (PPOMaxRewardTrainer: pairwise + imitation loss).",
    ),
}


TRAINING_HELP = """\
usage: trl-ppomax {name} [--config CONFIG] [--accelerate_config NAME] [FIELD VALUE ...]

{about}

  --config CONFIG         a YAML file, or a shipped config by name: {configs}
  --accelerate_config NAME
                          re-launch through `accelerate launch --config_file` with a shipped accelerate
                          config: {accelerate_configs}, or a file
                          (default: none, run in this process)

All other flags are the fields of the script's arguments, its training config and trl's ModelConfig, parsed by
trl's TrlParser as in `trl grpo`; set them in the YAML file or on the command line (`--learning_rate 1e-5`).
Run `trl-ppomax {name} --config {example} --help` for every field with its default and help.
"""


def run_training(name: str, argv: list[str]) -> int:
    """``trl-ppomax ppo|reward [--config X] [--accelerate_config Y] [flags]``: in this process, or re-launched
    through ``accelerate launch --config_file <shipped accelerate config>`` (as ``trl`` does)."""
    module, function, about = TRAINING_COMMANDS[name]
    if argv and argv[0] in ("-h", "--help") and "--config" not in argv:
        configs, accelerate_configs = arguments.shipped_configs(name), arguments.shipped_accelerate_configs()
        example = "tiny_cpu" if name == "ppo" else "reward_tiny_cpu"
        lists = {"configs": ", ".join(configs), "accelerate_configs": ", ".join(accelerate_configs)}
        print(TRAINING_HELP.format(name=name, about=about, example=example, **lists))
        return 0
    try:
        flags = ("--accelerate_config", "--accelerate-config")
        accelerate_config, argv = arguments.split_flag(argv, flags, "{flag} needs a value")
        argv = arguments.resolve_config_argv(argv, name)
        config_file = arguments.resolve_accelerate_config(accelerate_config) if accelerate_config else None
    except (ValueError, FileNotFoundError) as err:
        return arguments.fail(name, err)
    if config_file is not None:
        script = importlib.util.find_spec(module).origin
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config_file, script, *argv]
        print("Launching: " + " ".join(command[1:]), file=sys.stderr, flush=True)
        return subprocess.call(command)
    getattr(importlib.import_module(module), function)(argv, prog=f"trl-ppomax {name}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = arguments.Parser(
        prog="trl-ppomax",
        description="PPO-max for the Hugging Face stack.",
        epilog="Run `trl-ppomax COMMAND --help` for a command's flags.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, _, about) in TRAINING_COMMANDS.items():  # dispatched by main() before argparse
        commands.add_parser(name, help=about, description=about, add_help=False)
    env.add(commands)  # each family of commands adds its own, in its module
    plot.add_demo(commands)
    models.add(commands)
    plot.add(commands)
    from trl_ppomax.judging import command

    about = "Did RLHF help? The policy against a baseline: win / tie / lose by judges, or multiple-choice accuracy."
    evaluate = commands.add_parser("evaluate", help=about, description=command.__doc__, epilog=command.EPILOG)
    command.add_arguments(evaluate)
    evaluate.set_defaults(run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in TRAINING_COMMANDS:  # TrlParser parses these, as `trl grpo` does
        return run_training(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    return args.run(args)
