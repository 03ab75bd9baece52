"""Training-dynamics figures in the style of the paper (Fig. 4 and 9), from a run's ``log_history``.

One panel per group of metrics the logs contain (:data:`PANELS`), over ``episode`` (or ``step``); evaluation values
(``eval_…``) are markers, logs with ``collapse/any == 1`` vertical red lines. Other runs can be overlaid and reference
values drawn as horizontal lines. Matplotlib's Agg canvas is used directly: no pyplot global state, no display.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback, TrainerState

from trl_ppomax.base import metrics
from trl_ppomax.base.metrics import eval_name
from trl_ppomax.data.files import checkpoint_folders

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "COLLAPSE_KEY",
    "METRICS_READ",
    "PANELS",
    "Panel",
    "load_log_history",
    "panels_for",
    "plot_training_dynamics",
    "training_dynamics_figure",
]


@dataclass(frozen=True)
class Panel:
    """A panel of the figure: ``train`` keys drawn as lines, ``eval`` keys as markers, as ``(key, label)`` pairs."""

    title: str
    train: tuple[tuple[str, str], ...]
    eval: tuple[tuple[str, str], ...] = ()

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(key for key, _ in self.train + self.eval)


def _evaluated(title: str, *train: tuple[str, str]) -> Panel:
    """A panel whose first training metric is also drawn as evaluation markers (``eval_…``, labelled ``eval …``)."""
    key, label = train[0]
    return Panel(title, train, ((eval_name(key), f"eval {label}"),))


PANELS: dict[str, Panel] = {
    "reward": _evaluated("Reward", (metrics.SCORES, "score (raw)"), (metrics.SCORES_NORMALIZED, "score (normalised)")),
    "gold_reward": _evaluated("Gold reward", (metrics.GOLD_REWARD, "gold reward")),
    "win_rate": Panel(
        "Win rate vs SFT", (), ((metrics.WIN_RATE_VS_SFT, "win rate"), (metrics.LOSE_RATE_VS_SFT, "lose rate"))
    ),
    "kl": _evaluated("KL to reference", (metrics.KL, "KL")),
    "perplexity": _evaluated(
        "Perplexity", (metrics.POLICY_PERPLEXITY, "policy"), (metrics.REF_PERPLEXITY, "reference")
    ),
    "response_length": _evaluated("Response length", (metrics.RESPONSE_LENGTH, "length")),
    "policy_loss": Panel("Policy loss", ((metrics.POLICY_LOSS, "policy loss"),)),
    "value_loss": Panel("Value loss", ((metrics.VALUE_LOSS, "value loss"),)),
}

#: Logs with this key equal to 1 are drawn as collapse lines (added by :class:`~trl_ppomax.CollapseMonitor`).
COLLAPSE_KEY = metrics.COLLAPSE_ANY
#: The x axis: ``episode`` when every run logs it, else transformers' ``step``.
X_KEYS = (metrics.EPISODE, "step")
#: Every log key the figures read: the panels' metrics, the collapse marker and the x axis.
METRICS_READ: frozenset[str] = frozenset(
    {key for panel in PANELS.values() for key in panel.keys} | {COLLAPSE_KEY, *X_KEYS}
)
_LINESTYLES = ("-", "--", ":", "-.")
_MARKER_STYLE = dict(linestyle="none", markersize=5, markeredgecolor="black", markeredgewidth=0.5)


def _number(value: Any) -> float | None:
    """``value`` as a finite float, or None for anything else (missing, bool, str, NaN, inf)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if number else None


def panels_for(log_history: Sequence[Mapping[str, Any]]) -> list[str]:
    """Names of the :data:`PANELS` (in figure order) for which ``log_history`` has at least one finite value."""
    present = {key for entry in log_history for key, value in entry.items() if _number(value) is not None}
    return [name for name, panel in PANELS.items() if present.intersection(panel.keys)]


def _x_values(log_history: Sequence[Mapping[str, Any]], x_key: str) -> list[float | None]:
    """The x of each log. With ``episode``, a log without one (evaluation logs) gets it from its ``step``, using the
    step → episode pairs of the other logs (the episodes per step are fixed by the batch size)."""
    episode_key, step_key = X_KEYS
    if x_key == step_key:
        return [_number(e.get(step_key)) for e in log_history]
    logged = [(_number(entry.get(step_key)), _number(entry.get(episode_key))) for entry in log_history]
    pairs = {step: episode for step, episode in logged if step is not None and episode is not None}
    xs = []
    for step, episode in logged:
        if episode is None and step is not None and pairs:  # the nearest known step, scaled by its episodes per step
            near = min(pairs, key=lambda s: abs(s - step))
            episode = pairs[near] + (step - near) * (pairs[near] / near if near else 0.0)
        xs.append(episode)
    return xs


def _series(log_history, xs, key) -> tuple[list[float], list[float]]:
    points = [(x, _number(e.get(key))) for e, x in zip(log_history, xs, strict=True)]
    points = [(x, y) for x, y in points if x is not None and y is not None]
    return [x for x, _ in points], [y for _, y in points]


def _collapses(log_history, xs) -> list[float]:
    hits = {x for e, x in zip(log_history, xs, strict=True) if x is not None and _number(e.get(COLLAPSE_KEY)) == 1}
    return sorted(hits)


def training_dynamics_figure(
    log_history: Sequence[Mapping[str, Any]],
    title: str | None = None,
    extra: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    name: str = "run",
    baselines: Mapping[str, Mapping[str, float]] | None = None,
) -> Figure:
    """The figure drawn by :func:`plot_training_dynamics`, one axes per panel of :func:`panels_for` (of this run and
    the ``extra`` runs together). Raises ValueError when no log has any of the plotted metrics."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs: dict[str, Sequence[Mapping[str, Any]]] = {name: list(log_history)}
    for other, history in (extra or {}).items():
        if other in runs:
            raise ValueError(f"run name {other!r} is used twice")
        runs[other] = list(history)
    names = panels_for([entry for history in runs.values() for entry in history])
    if not names:
        keys = ", ".join(key for panel in PANELS.values() for key, _ in panel.train)
        raise ValueError(f"the log history has none of the metrics to plot ({keys})")

    episode, step = X_KEYS  # episode when every run logs it
    x_key = episode if all(any(_number(e.get(episode)) is not None for e in h) for h in runs.values() if h) else step
    xs = {run: _x_values(history, x_key) for run, history in runs.items()}
    colors = {run: f"C{i % 10}" for i, run in enumerate(runs)}

    ncols = min(3, len(names))
    nrows = math.ceil(len(names) / ncols)
    fig = Figure(figsize=(4.8 * ncols, 3.4 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(names) :]:
        fig.delaxes(ax)

    for ax, panel_name in zip(axes, names, strict=False):
        _draw_panel(ax, PANELS[panel_name], runs, xs, colors, name, baselines or {})
        ax.set_xlabel(x_key)
    fig.suptitle(title or "Training dynamics")
    return fig


def _draw_panel(ax, panel: Panel, runs, xs, colors, name: str, baselines: Mapping[str, Mapping[str, float]]) -> None:
    """One panel: each run's training lines, its evaluation markers, its collapse events, and the baselines."""
    from matplotlib.lines import Line2D

    compare = len(runs) > 1
    for run, history in runs.items():
        prefix = f"{run}: " if compare else ""
        for i, (key, label) in enumerate(panel.train + panel.eval):
            x, y = _series(history, xs[run], key)
            if not x:
                continue
            if i < len(panel.train):  # training values: lines
                style = dict(linestyle=_LINESTYLES[i % len(_LINESTYLES)], linewidth=1.4)
            else:  # evaluation values: markers
                style = dict(_MARKER_STYLE, marker="os^D"[(i - len(panel.train)) % 4])
            ax.plot(x, y, color=colors[run] if compare else f"C{i}", label=prefix + label, **style)
        for x in _collapses(history, xs[run]):
            ax.axvline(x, color="red", linewidth=1.0, alpha=0.6, linestyle="-" if run == name else "--")
    for i, (label, values) in enumerate(baselines.items()):
        for key in panel.keys:
            if (value := _number(values.get(key))) is not None:
                ax.axhline(value, color="black", linewidth=1.0, linestyle=_LINESTYLES[(i + 2) % 4], label=label)
    ax.set_title(panel.title)
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if any(_collapses(history, xs[run]) for run, history in runs.items()):
        handles.append(Line2D([], [], color="red", alpha=0.6, linewidth=1.0))
        labels.append("collapse")
    if len(handles) > 1:
        ax.legend(handles, labels, fontsize="small")


def plot_training_dynamics(
    log_history: Sequence[Mapping[str, Any]],
    path: str | Path,
    title: str | None = None,
    extra: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    name: str = "run",
    baselines: Mapping[str, Mapping[str, float]] | None = None,
) -> str:
    """Draw the training-dynamics figure of ``log_history`` (a trainer's ``state.log_history``) to the PNG ``path``
    (parent folders are created) and return the path. Only panels with data are drawn (:func:`panels_for`).

    ``extra`` maps names to the log histories of other runs, overlaid on the same panels with a legend in which this
    run is called ``name``. ``baselines`` maps a label to reference values by metric, e.g.
    ``{"SFT": {"gold/reward": -0.16}}``, each drawn as a horizontal black line on the panel that plots the metric.
    """
    fig = training_dynamics_figure(log_history, title=title, extra=extra, name=name, baselines=baselines)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return str(path)


def load_log_history(run_dir: str | Path) -> list[dict]:
    """The ``log_history`` of ``RUN_DIR/trainer_state.json``, else of the newest ``checkpoint-N`` that has one."""
    run_dir = Path(run_dir).expanduser()
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run folder not found: {run_dir}")
    state_file = run_dir / "trainer_state.json"
    if not state_file.is_file():
        checkpoints = [path for path in checkpoint_folders(run_dir) if (path / "trainer_state.json").is_file()]
        if not checkpoints:
            raise FileNotFoundError(
                f"no trainer_state.json in {run_dir} nor in a checkpoint-N folder of it (looked for "
                f"{state_file} and {run_dir / 'checkpoint-N' / 'trainer_state.json'})"
            )
        state_file = checkpoints[-1] / "trainer_state.json"
    try:
        history = TrainerState.load_from_json(str(state_file)).log_history
    except json.JSONDecodeError as err:
        raise ValueError(f"{state_file} is not valid JSON: {err}") from err
    except TypeError as err:
        raise ValueError(f"{state_file} is not a trainer state: {err}") from err
    if not history or not isinstance(history, list):
        raise ValueError(f"{state_file} has no log_history entries")
    return [entry for entry in history if isinstance(entry, dict)]


# Trackers: what the terminal shows (sample tables, figures) also goes to wandb / trackio / TensorBoard when they are
# reported to (``report_to``), each through an adaptor with ``table(key, frame, step)`` and ``image(key, path, step)``.
TRACKERS = ("wandb", "trackio", "tensorboard")


class ModuleTracker:
    """wandb or trackio: a table or an image as the module's own ``Table`` / ``Image``, logged with its ``log``."""

    def __init__(self, module) -> None:
        self.module, self.name = module, module.__name__

    def table(self, key: str, frame, step: int | None) -> None:
        self.module.log({key: self.module.Table(dataframe=frame)})

    def image(self, key: str, path: str | Path, step: int | None) -> None:
        self.module.log({key: self.module.Image(str(path))})


class TensorBoardTracker:
    """TensorBoard: a table as Markdown text (:func:`markdown_table`), an image as an image, in ``logging_dir``. Each
    call opens and closes its own ``SummaryWriter``: the Trainer's ``TensorBoardCallback`` closes its writer before
    the end-of-training figure is drawn."""

    name = "tensorboard"

    def __init__(self, logging_dir: str) -> None:
        self.logging_dir = logging_dir

    def _write(self, add) -> None:
        from torch.utils.tensorboard import SummaryWriter

        with contextlib.closing(SummaryWriter(self.logging_dir)) as writer:  # closing flushes
            add(writer)

    def table(self, key: str, frame, step: int | None) -> None:
        self._write(lambda writer: writer.add_text(key, markdown_table(frame), step))

    def image(self, key: str, path: str | Path, step: int | None) -> None:
        import numpy as np
        from matplotlib.image import imread

        pixels = imread(str(path))
        pixels = np.repeat(pixels[..., None], 3, axis=-1) if pixels.ndim == 2 else pixels[..., :3]  # RGB, no alpha
        self._write(lambda writer: writer.add_image(key, pixels, step, dataformats="HWC"))


def markdown_table(frame) -> str:
    """A pandas DataFrame as a Markdown table (header, separator, a row per row), with ``|`` escaped and line breaks
    written as ``<br>``: what TensorBoard's text panel shows as a table."""

    def cell(value) -> str:
        return str(value).replace("|", "\\|").replace("\r\n", "<br>").replace("\n", "<br>").replace("\r", "<br>")

    lines = [[cell(c) for c in frame.columns], ["---"] * len(frame.columns)]
    lines += [[cell(v) for v in row] for row in frame.itertuples(index=False)]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def tensorboard_dir(args, callbacks: Sequence[TrainerCallback] = ()) -> str:
    """Where this run's TensorBoard events go: the folder of the Trainer's ``TensorBoardCallback`` among
    ``callbacks`` (known once training starts), else ``args.logging_dir`` (transformers < 5, ``trl-ppomax plot
    --logging-dir``), else ``$TENSORBOARD_LOGGING_DIR`` (transformers 5's setting), else ``OUTPUT_DIR/runs``."""
    from transformers.integrations import TensorBoardCallback

    for callback in callbacks:
        if isinstance(callback, TensorBoardCallback) and getattr(callback, "logging_dir", None):
            return callback.logging_dir
    folder = getattr(args, "logging_dir", None) or os.getenv("TENSORBOARD_LOGGING_DIR")
    return os.path.expanduser(folder) if folder else os.path.join(args.output_dir, "runs")


def active_trackers(args, callbacks: Sequence[TrainerCallback] = ()) -> list[ModuleTracker | TensorBoardTracker]:
    """The trackers that ``args.report_to`` names and that are installed: wandb (only with a run: ``wandb.log``
    would start one), trackio, TensorBoard (in :func:`tensorboard_dir` of ``callbacks``). Imported only then."""
    import importlib

    report_to = getattr(args, "report_to", None) or []
    report_to = [report_to] if isinstance(report_to, str) else list(report_to)
    found = []
    for name in [name for name in TRACKERS if name in report_to or "all" in report_to]:
        try:
            module = importlib.import_module("torch.utils.tensorboard" if name == "tensorboard" else name)
        except ImportError:  # not installed (torch.utils.tensorboard needs the tensorboard package)
            continue
        if name == "tensorboard":
            found.append(TensorBoardTracker(tensorboard_dir(args, callbacks)))
        elif name != "wandb" or getattr(module, "run", None) is not None:
            found.append(ModuleTracker(module))
    return found


def log_table(
    args,
    key: str,
    rows: Sequence[Mapping[str, Any]],
    step: int | None = None,
    callbacks: Sequence[TrainerCallback] = (),
) -> list[str]:
    """Log ``rows`` (dicts with the same keys) as the table ``key`` to each :func:`active_trackers` (as GRPO's
    ``log_completions``; TensorBoard gets it as text); returns the names of the trackers logged to."""
    trackers = active_trackers(args, callbacks)
    if not trackers or not rows:
        return []
    import pandas as pd

    frame = pd.DataFrame({"step": [step] * len(rows), **{c: [r[c] for r in rows] for c in rows[0]}})
    for tracker in trackers:
        tracker.table(key, frame, step)
    return [t.name for t in trackers]


def log_image(
    args, key: str, path: str | Path, step: int | None = None, callbacks: Sequence[TrainerCallback] = ()
) -> list[str]:
    """Log the image file ``path`` as ``key`` to each :func:`active_trackers`; returns their names."""
    trackers = active_trackers(args, callbacks)
    for tracker in trackers:
        tracker.image(key, path, step)
    return [t.name for t in trackers]


class DynamicsFigureCallback(TrainerCallback):
    """At the end of training, draw :func:`plot_training_dynamics` into ``output_dir/training_dynamics.png`` and log
    it to the active trackers, when one is on; ``callbacks`` is the trainer's list (see :func:`tensorboard_dir`)."""

    def __init__(self, callbacks: Sequence[TrainerCallback] = ()) -> None:
        self.callbacks = callbacks

    def on_train_end(self, args, state, control, **kwargs):
        on = state.is_world_process_zero and panels_for(state.log_history)  # the main process, with a panel to draw
        if not on or not active_trackers(args, self.callbacks):
            return
        path = plot_training_dynamics(state.log_history, Path(args.output_dir) / "training_dynamics.png")
        log_image(args, "training_dynamics", path, state.global_step, self.callbacks)
