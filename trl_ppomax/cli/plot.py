"""``trl-ppomax plot`` and ``trl-ppomax demo``: a run's training dynamics as a figure, and the toy world that makes one."""

from __future__ import annotations

import argparse
import importlib
import os
from pathlib import Path
from types import SimpleNamespace

from trl_ppomax.cli.arguments import add_command, fail, positive_int


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
        return fail("plot", err)
    print(path)
    if logged:
        print(f"Logged as training_dynamics to {', '.join(logged)}")
    return 0


def _log_figure(args: argparse.Namespace, run_dir: Path, name: str, path: str, history: list[dict]) -> list[str]:
    """Log the figure as ``training_dynamics`` (at the run's last step) to the ``--report-to`` trackers
    (:func:`trl_ppomax.reporting.plotting.log_image`): TensorBoard in ``--logging-dir``, wandb and trackio in a run
    started here with ``resume="allow"``. Raises ValueError naming a tracker that is not installed."""
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


def add(commands) -> None:
    plot = add_command(commands, "plot", plot_run)
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
        choices=("tensorboard", "wandb", "trackio"),  # reporting.plotting.TRACKERS (not imported for --help)
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


def add_demo(commands) -> None:
    demo = add_command(commands, "demo", run_toy_world)
    demo.add_argument("--output-dir", default="output/toyworld", help="where the figure and summary go")
    demo.add_argument("--iterations", type=positive_int, default=100, help="PPO-max iterations (32 prompts each)")
    demo.add_argument("--seed", type=int, default=0, help="random seed")
