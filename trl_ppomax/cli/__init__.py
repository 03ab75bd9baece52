"""The ``trl-ppomax`` command line: ``ppo``, ``reward``, ``env``, ``presets``, ``demo``, ``tiny``, ``push``,
``moss recover``, ``plot`` and ``evaluate``.

Nothing heavy (torch, transformers, trl, the Hub client) is imported here at module level: each command imports what
it needs, so that ``trl-ppomax --help`` answers at once.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from trl_ppomax import __version__

PACKAGES = (
    "trl-ppomax",
    "torch",
    "transformers",
    "trl",
    "accelerate",
    "peft",
    "datasets",
    "huggingface_hub",
    "tokenizers",
    "deepspeed",
    "vllm",
    "bitsandbytes",
    "liger-kernel",
    "wandb",
    "trackio",
    "tensorboard",
)


def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def _accelerate_config_lines() -> list[str]:
    """accelerate's default config file (``accelerate config`` writes it, where ``accelerate launch`` looks it up)
    and its settings."""
    cache = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    folder = os.path.join(os.path.expanduser(cache), "accelerate")
    paths = [os.path.join(folder, name) for name in ("default_config.yaml", "default_config.json")]
    path = next((path for path in paths if os.path.isfile(path)), None)
    if path is None:
        return ["not found (run `accelerate config` to write one)"]
    try:
        text = Path(path).read_text()
        if path.endswith(".json"):
            import json

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


def _fail(command: str, error) -> int:
    """Print ``trl-ppomax COMMAND: error: ERROR`` on one line of stderr; returns the exit status, 2."""
    print(f"trl-ppomax {command}: error: {' '.join(str(error).split())}", file=sys.stderr)
    return 2


def positive_int(text: str) -> int:
    """An argparse ``type``: a whole number ≥ 1 (``--iterations 0`` is refused when parsed, naming the flag)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


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


def save_tiny(args: argparse.Namespace) -> int:
    """Write tiny offline models (sft/, reward/) and datasets (prompts.jsonl, preferences.jsonl) to a folder."""
    from trl_ppomax.toyworld.tiny import save_tiny_models

    try:
        paths = save_tiny_models(args.output_dir, arch=args.arch, seed=args.seed, overwrite=args.overwrite)
    except ValueError as err:
        return _fail("tiny", err)
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def consolidate(args: argparse.Namespace) -> int:
    """Turn a folder holding only DeepSpeed's sharded engine checkpoint (a ZeRO-3 run without
    stage3_gather_16bit_weights_on_model_save) into plain transformers folders: the policy, and critic/ beside it."""
    from trl_ppomax.ppo.checkpoint import consolidate_engine_checkpoint

    try:
        output = consolidate_engine_checkpoint(args.folder, args.output)
    except (ValueError, FileNotFoundError) as err:
        return _fail("consolidate", err)
    print(f"policy: {output}")
    if (Path(output) / "critic" / "config.json").is_file():
        print(f"critic: {Path(output) / 'critic'}")
    return 0


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError  # unreachable


def push_model(args: argparse.Namespace) -> int:
    """Upload a model folder (converted or trained) to the Hub with a generated model card, in one commit."""
    from trl_ppomax.moss.card import (
        moss_model_card,
    )  # the MOSS-RLHF card for a converted folder, the generic one otherwise
    from trl_ppomax.reporting import hub

    try:
        card = moss_model_card(
            args.folder, args.repo_id, model_type=args.model_type, lang=args.lang, base_model=args.base_model
        )
        result = hub.push_folder(
            args.folder,
            args.repo_id,
            private=args.private,
            revision=args.revision,
            commit_message=args.commit_message,
            dry_run=args.dry_run,
            card=card,
            include_internals=args.include_checkpoint_files,
        )
    except Exception as err:  # invalid folder / repo id, or any Hub or network error: one line, exit 2
        message = str(err) if isinstance(err, (ValueError, OSError)) else f"{type(err).__name__}: {err}"
        return _fail("push", hub.redact_token(message))
    root = Path(args.folder).expanduser()
    if result.excluded:
        print(
            f"trl-ppomax push: not uploading {len(result.excluded)} checkpoint file(s): {', '.join(result.excluded)} "
            "(pass --include-checkpoint-files to upload them)",
            file=sys.stderr,
        )
    if args.dry_run:
        sizes = {rel: (root / rel).stat().st_size for rel in result.files[:-1]}
        where = f"{args.repo_id} ({'private' if args.private else 'public'}, revision {args.revision or 'main'})"
        print(f"Dry run: would upload {len(result.files)} files ({_size(sum(sizes.values()))}) to {where}:")
        for rel, size in sizes.items():
            print(f"  {rel:<40} {_size(size):>10}")
        print(f"  {'README.md':<40} {'(card)':>10}")
        print("\n--- README.md ---")
        print(hub.redact_token(str(result.card)))
        return 0
    print(f"Pushed {len(result.files)} files to {result.repo_url}")
    if result.commit_url:
        print(f"Commit: {result.commit_url}")
    return 0


def recover_moss(args: argparse.Namespace) -> int:
    """Recover a MOSS-RLHF release model from its weight diff and LLaMA-7B, as a standard transformers model."""
    from trl_ppomax.moss.recovery import recover, resolve_source

    if args.expected_sum is not None and args.skip_integrity_check:
        return _fail("moss recover", "use --expected-sum or --skip-integrity-check, not both")
    try:
        output = recover(
            resolve_source(args.raw, "--raw"),
            resolve_source(args.diff, "--diff"),
            args.output,
            args.model_type,
            lang=args.lang,
            expected_sum=args.expected_sum,
            check=not args.skip_integrity_check,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
        )
    except (ValueError, OSError, KeyError) as err:
        return _fail("moss recover", err)
    print(f"Recovered {args.lang} {args.model_type} model: {output}")
    return 0


def plot_run(args: argparse.Namespace) -> int:
    """Draw a run's training dynamics (reward, KL, perplexity, length, losses, collapses) as a PNG."""
    from trl_ppomax.reporting.plotting import load_log_history, plot_training_dynamics

    try:
        extra = {}
        for item in args.compare:
            name, sep, run_dir = item.partition("=")
            if not sep or not name.strip() or not run_dir:
                raise ValueError(f"--compare takes NAME=RUN_DIR, got {item!r}")
            if name.strip() in extra:
                raise ValueError(f"--compare name {name.strip()!r} is used twice")
            extra[name.strip()] = load_log_history(run_dir)
        run_dir = Path(args.run_dir).expanduser()
        history = load_log_history(run_dir)
        name = run_dir.resolve().name or str(run_dir)
        if name in extra:
            raise ValueError(f"--compare name {name!r} is the name of RUN_DIR; choose another")
        output = args.output or run_dir / "training_dynamics.png"
        path = plot_training_dynamics(history, output, title=args.title or name, extra=extra or None, name=name)
        logged = _log_figure(args, run_dir, name, path, history) if args.report_to else []
    except (ValueError, OSError) as err:
        return _fail("plot", err)
    print(path)
    if logged:
        print(f"Logged as training_dynamics to {', '.join(logged)}")
    return 0


def _log_figure(args: argparse.Namespace, run_dir: Path, name: str, path: str, history: list[dict]) -> list[str]:
    """Log the figure as ``training_dynamics`` (at the run's last step) to the ``--report-to`` trackers, through
    :func:`trl_ppomax.reporting.plotting.log_image`: TensorBoard in ``--logging-dir`` (default: ``$TENSORBOARD_LOGGING_DIR``,
    else the newest ``RUN_DIR/runs/*`` folder with events, which is where the Trainer wrote, else ``RUN_DIR/runs``);
    wandb and trackio in a run started here, with ``resume="allow"`` (wandb resumes the run ``WANDB_RUN_ID`` names).
    Raises ValueError naming the tracker that is not installed."""
    import importlib
    from types import SimpleNamespace

    from trl_ppomax.reporting.plotting import log_image

    logging_dir = args.logging_dir or os.getenv("TENSORBOARD_LOGGING_DIR")
    if logging_dir is None:
        folders = [events.parent for events in run_dir.glob("runs/*/events.out.tfevents.*")]
        logging_dir = str(max(folders, key=lambda folder: folder.stat().st_mtime)) if folders else None
    started = []
    try:
        for tracker in dict.fromkeys(args.report_to):
            try:
                module = importlib.import_module("torch.utils.tensorboard" if tracker == "tensorboard" else tracker)
            except ImportError as err:
                raise ValueError(f"--report-to {tracker}: {err} (pip install 'trl-ppomax[{tracker}]')") from err
            if tracker != "tensorboard":
                project = args.project or (os.getenv("WANDB_PROJECT") if tracker == "wandb" else None)
                try:
                    module.init(project=project or "huggingface", name=args.run_name or name, resume="allow")
                except Exception as err:  # login, network, a run id of another project: one line, exit 2
                    raise ValueError(f"--report-to {tracker}: no run started ({type(err).__name__}: {err})") from err
                started.append(module)
        steps = [entry["step"] for entry in history if isinstance(entry.get("step"), int)]
        where = SimpleNamespace(report_to=args.report_to, output_dir=str(run_dir), logging_dir=logging_dir)
        return log_image(where, "training_dynamics", path, max(steps, default=None))
    finally:
        for module in started:
            module.finish()


def run_toy_world(args: argparse.Namespace) -> int:
    """Run the toy world: SFT → reward model → PPO-max on a CPU, with the gold reward (as the recipe's default)."""
    from trl_ppomax.toyworld.demo import run_demo

    run_demo(args.output_dir, iterations=args.iterations, seed=args.seed)
    return 0


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each flag's default (unless its help already says it), and keeps the descriptions' line breaks."""

    def _get_help_string(self, action):
        if action.help and "default:" in action.help:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An argument parser whose help (and its sub-commands' help) shows the defaults, and which takes flags only as
    spelt (no prefix matching, which made ``--judge`` ambiguous and would take ``--judge-m`` for ``--judge-model``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


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


def _split_accelerate_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """Take ``--accelerate_config NAME`` (or ``=NAME``) out of ``argv``."""
    rest, value, items = [], None, iter(argv)
    for item in items:
        if item in ("--accelerate_config", "--accelerate-config"):
            value = next(items, None)
            if value is None:
                raise ValueError(f"{item} needs a value")
        elif item.startswith(("--accelerate_config=", "--accelerate-config=")):
            value = item.partition("=")[2]
        else:
            rest.append(item)
    return value, rest


def run_training(name: str, argv: list[str]) -> int:
    """``trl-ppomax ppo|reward [--config X] [--accelerate_config Y] [flags]``: in this process, or re-launched
    through ``accelerate launch --config_file <shipped accelerate config>`` (as ``trl`` does)."""
    from trl_ppomax.cli.arguments import (
        resolve_accelerate_config,
        resolve_config_argv,
        shipped_accelerate_configs,
        shipped_configs,
    )

    module, function, about = TRAINING_COMMANDS[name]
    if argv and argv[0] in ("-h", "--help") and "--config" not in argv:
        lists = {
            "configs": ", ".join(shipped_configs(name)),
            "accelerate_configs": ", ".join(shipped_accelerate_configs()),
        }
        example = "tiny_cpu" if name == "ppo" else "reward_tiny_cpu"
        print(TRAINING_HELP.format(name=name, about=about, example=example, **lists))
        return 0
    try:
        accelerate_config, argv = _split_accelerate_config(argv)
        argv = resolve_config_argv(argv, name)
        config_file = resolve_accelerate_config(accelerate_config) if accelerate_config else None
    except (ValueError, FileNotFoundError) as err:
        return _fail(name, err)
    if config_file is not None:
        import importlib.util

        script = importlib.util.find_spec(module).origin
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config_file, script, *argv]
        print("Launching: " + " ".join(command[1:]), file=sys.stderr, flush=True)
        return subprocess.call(command)
    import importlib

    getattr(importlib.import_module(module), function)(argv, prog=f"trl-ppomax {name}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="trl-ppomax",
        description="PPO-max for the Hugging Face stack.",
        epilog="Run `trl-ppomax COMMAND --help` for a command's flags.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, _, about) in TRAINING_COMMANDS.items():  # dispatched by main() before argparse
        commands.add_parser(name, help=about, description=about, add_help=False)
    _command(commands, "env", show_env)
    _command(commands, "presets", show_presets)
    demo = _command(commands, "demo", run_toy_world)
    demo.add_argument("--output-dir", default="output/toyworld", help="where the figure and summary go")
    demo.add_argument("--iterations", type=positive_int, default=100, help="PPO-max iterations (32 prompts each)")
    demo.add_argument("--seed", type=int, default=0, help="random seed")
    tiny = _command(commands, "tiny", save_tiny)
    tiny.add_argument("output_dir", metavar="OUTPUT_DIR", help="folder to create (must be absent or empty)")
    tiny.add_argument("--arch", choices=["llama", "gpt_neox"], default="llama", help="model architecture")
    tiny.add_argument("--seed", type=int, default=0, help="torch seed for the random weights")
    tiny.add_argument("--overwrite", action="store_true", help="replace OUTPUT_DIR even if it is not empty")
    merge = _command(commands, "consolidate", consolidate)
    merge.add_argument("folder", metavar="DIR", help="a checkpoint-N or save_model folder of the run")
    merge.add_argument("--output", metavar="DIR", help="where to write the plain folders (default: DIR itself)")
    _add_push(commands)
    _add_moss(commands)
    _add_plot(commands)
    _add_evaluate(commands)
    return parser


def _command(commands, name: str, run, note: str = "") -> argparse.ArgumentParser:
    """The sub-command ``name``, run by ``run``, whose docstring (plus ``note``) is its help and description."""
    parser = commands.add_parser(name, help=run.__doc__, description=run.__doc__ + note)
    parser.set_defaults(run=run)
    return parser


def _add_push(commands) -> None:
    note = " The token comes from the HF_TOKEN environment variable or `hf auth login`, never the command line."
    push = _command(commands, "push", push_model, note)
    push.add_argument("folder", metavar="DIR", help="model folder with config.json (or adapter_config.json)")
    push.add_argument("--repo-id", required=True, metavar="NAME", help="Hub model repo, e.g. user/my-model")
    push.add_argument("--private", action="store_true", help="create the repo private (if it does not exist yet)")
    push.add_argument("--revision", metavar="REV", help="branch to commit to (created if missing; default: main)")
    push.add_argument("--commit-message", metavar="MSG", help="commit message")
    push.add_argument("--dry-run", action="store_true", help="print the files and the card, upload nothing")
    push.add_argument("--model-type", choices=["reward", "sft", "policy"], help="override the card's model type")
    push.add_argument("--lang", choices=["en", "zh"], help="override the card's language")
    push.add_argument("--base-model", metavar="REPO", help="override the card's base_model")
    push.add_argument(
        "--include-checkpoint-files",
        action="store_true",
        help="also upload checkpoint internals (optimizer/scheduler/RNG states, training_args.bin, trainer and PPO "
        "states, critic/, DeepSpeed folders), left out by default",
    )


def _add_moss(commands) -> None:
    moss = commands.add_parser("moss", help="the paper's released models (MOSS-RLHF)").add_subparsers(
        dest="moss_command", required=True
    )
    recover = _command(moss, "recover", recover_moss)
    recover.add_argument("--raw", required=True, help="LLaMA-7B in Hugging Face format: a folder or a Hub id")
    recover.add_argument("--diff", required=True, help="the release's diff: a folder or a Hub id")
    recover.add_argument("--output", required=True, help="folder to write (must be absent or empty)")
    recover.add_argument("--model-type", required=True, choices=["reward", "sft", "policy"], help="which model")
    recover.add_argument("--lang", choices=["en", "zh"], default="en", help="the release's language")
    recover.add_argument("--expected-sum", type=float, help="override the published parameter sum")
    recover.add_argument("--skip-integrity-check", action="store_true", help="do not check the parameter sum")
    recover.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="dtype of the written weights"
    )
    recover.add_argument("--max-shard-size", default="2GB", help="size of the output shards, e.g. 500MB or 5GB")


def _add_plot(commands) -> None:
    plot = _command(commands, "plot", plot_run)
    plot.add_argument(
        "run_dir", metavar="RUN_DIR", help="output folder with trainer_state.json (or checkpoint-N folders)"
    )
    plot.add_argument("--output", metavar="FILE.png", help="PNG to write (default: RUN_DIR/training_dynamics.png)")
    plot.add_argument(
        "--compare",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=RUN_DIR",
        help="other runs to overlay on the same panels, named in the legend",
    )
    plot.add_argument("--title", help="figure title (default: the name of RUN_DIR)")
    plot.add_argument(
        "--report-to",
        nargs="+",
        action="extend",
        default=[],
        choices=(
            "tensorboard",
            "wandb",
            "trackio",
        ),  # trl_ppomax.reporting.plotting.TRACKERS (not imported for --help)
        metavar="TRACKER",
        help="also log the figure, as training_dynamics, to these trackers: tensorboard, wandb, trackio",
    )
    plot.add_argument(
        "--logging-dir",
        metavar="DIR",
        help="TensorBoard folder (default: $TENSORBOARD_LOGGING_DIR, else the newest RUN_DIR/runs/* folder with "
        "events, where the Trainer wrote, else RUN_DIR/runs)",
    )
    plot.add_argument("--project", help="wandb / trackio project (default: $WANDB_PROJECT for wandb; huggingface)")
    plot.add_argument(
        "--run-name",
        help="wandb / trackio run, resumed if it exists (default: the name of RUN_DIR; wandb resumes the run "
        "$WANDB_RUN_ID names)",
    )


def _add_evaluate(commands) -> None:
    from trl_ppomax.judging import command

    about = "Did RLHF help? The policy against a baseline: win / tie / lose by judges, or multiple-choice accuracy."
    evaluate = commands.add_parser("evaluate", help=about, description=command.__doc__, epilog=command.EPILOG)
    command.add_arguments(evaluate)
    evaluate.set_defaults(run=command.run)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in TRAINING_COMMANDS:  # TrlParser parses these, as `trl grpo` does
        return run_training(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    return args.run(args)
