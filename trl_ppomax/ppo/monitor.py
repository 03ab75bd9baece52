"""Early warning of pattern collapse (PPO-max §5.2, Fig. 4) from the metrics the trainer logs: an over-optimised
policy cheats the reward model while the reward rises; :class:`CollapseMonitor` warns (and, if asked, stops the run)
before the collapse has spoiled many checkpoints."""

from __future__ import annotations

import copy
import logging
import math
from typing import Any, ClassVar

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState

from trl_ppomax.base import metrics
from trl_ppomax.data.files import last_checkpoint_before

logger = logging.getLogger(__name__)

KL, PERPLEXITY, LENGTH, REWARD_TAIL = "kl", "perplexity", "length", "reward_tail"
SIGNALS = (KL, PERPLEXITY, LENGTH, REWARD_TAIL)
#: Metrics whose warm-up mean is the reference; ``reward_tail`` is ``objective/scores_p95 − objective/scores``.
REFERENCE_METRICS = (metrics.POLICY_PERPLEXITY, metrics.RESPONSE_LENGTH, REWARD_TAIL)
#: What the monitor adds to a training log: ``collapse/<signal>`` for each active signal, and ``collapse/any``.
SIGNAL_METRICS = {signal: f"collapse/{signal}" for signal in SIGNALS}
ADVICE = "raise kl_coef, enable reward normalisation/clipping (preset='ppo_max'), lower the learning rate"


class CollapseMonitor(TrainerCallback, ExportableState):
    """Warn when the training metrics show the early signs of pattern collapse (PPO-max §5.2).

    Only training logs are watched: a log without ``objective/kl`` (an evaluation log, the end-of-training summary)
    is ignored. The first ``warmup_logs`` (3) training logs set the reference values (the mean of each metric over
    them); nothing is checked before. From then on each signal holds on a training log when (defaults in brackets):

    - ``kl``: ``objective/kl`` (mean per-response KL sum, nats) > ``max_kl`` (20.0), or it rose by more than
      ``max_kl_rise`` (5.0) over the last ``window`` (5) logs;
    - ``perplexity``: ``policy/perplexity`` < ``min_perplexity_ratio`` (0.5) × reference;
    - ``length``: ``response/length`` > ``max_length_ratio`` (2.0) × reference, or < ``min_length_ratio`` (0.5) × it;
    - ``reward_tail``: tail = ``objective/scores_p95 − objective/scores`` > ``max_tail_ratio`` (3.0) × max(reference
      tail, 1e-6), and tail − reference tail > ``min_tail_growth`` (0.5, reward units: guards a tail near zero).

    A signal fires once it holds on ``patience`` (2) consecutive training logs; ``stop_training`` (False) then stops
    the run.

    When a signal fires, the monitor logs a warning (signal, value, threshold, what to do), appends
    ``{"step", "signal", "value", "threshold", "since_step", "message"}`` to :attr:`events` (``since_step``: the first
    log of the streak), sets :attr:`last_healthy_checkpoint` on the first event (the newest ``checkpoint-N`` in
    ``args.output_dir`` with ``N < since_step``, or None) and, with ``stop_training``, stops the run. A signal stays
    active, without a new event, while it keeps holding.

    After the warm-up every training log (``logs`` and ``state.log_history``) gains ``collapse/any`` (1.0 while any
    signal is active, else 0.0) and ``collapse/<signal> = 1.0`` per active signal; :meth:`attach` puts the monitor
    before the ``report_to`` integrations so that they report these keys too. Its state is kept in
    ``state.stateful_callbacks`` at every log, so checkpoints carry it and a resume restores it (thresholds kept).

    Example::

        monitor = CollapseMonitor(stop_training=True)
        monitor.attach(trainer)  # or trainer.add_callback(monitor)
        trainer.train()
        if not monitor.healthy:
            print(monitor.events, monitor.last_healthy_checkpoint)
    """

    #: The trainer's metrics the monitor reads from training logs (a log without ``objective/kl`` is not one).
    metrics_read: ClassVar[frozenset[str]] = frozenset(
        {metrics.KL, metrics.POLICY_PERPLEXITY, metrics.RESPONSE_LENGTH, metrics.SCORES, metrics.SCORES_P95}
    )
    #: The metrics the monitor adds to training logs after the warm-up.
    metrics_written: ClassVar[frozenset[str]] = frozenset({*SIGNAL_METRICS.values(), metrics.COLLAPSE_ANY})

    def __init__(
        self,
        max_kl: float = 20.0,
        max_kl_rise: float = 5.0,
        window: int = 5,
        min_perplexity_ratio: float = 0.5,
        max_length_ratio: float = 2.0,
        min_length_ratio: float = 0.5,
        max_tail_ratio: float = 3.0,
        min_tail_growth: float = 0.5,
        patience: int = 2,
        warmup_logs: int = 3,
        stop_training: bool = False,
    ) -> None:
        for name, value in (("window", window), ("patience", patience), ("warmup_logs", warmup_logs)):
            if int(value) != value or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        positive = dict(max_kl=max_kl, max_kl_rise=max_kl_rise, min_perplexity_ratio=min_perplexity_ratio)
        positive.update(max_length_ratio=max_length_ratio, max_tail_ratio=max_tail_ratio)
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}.")
        if not 0 <= min_length_ratio < max_length_ratio:
            raise ValueError(
                f"Need 0 <= min_length_ratio < max_length_ratio, got {min_length_ratio!r} and {max_length_ratio!r}."
            )
        if min_tail_growth < 0:
            raise ValueError(f"min_tail_growth must be >= 0, got {min_tail_growth!r}.")
        self.max_kl, self.max_kl_rise, self.window = float(max_kl), float(max_kl_rise), int(window)
        self.min_perplexity_ratio = float(min_perplexity_ratio)
        self.max_length_ratio, self.min_length_ratio = float(max_length_ratio), float(min_length_ratio)
        self.max_tail_ratio, self.min_tail_growth = float(max_tail_ratio), float(min_tail_growth)
        self.patience, self.warmup_logs, self.stop_training = int(patience), int(warmup_logs), bool(stop_training)
        # ---- state (see state_dict) ----
        self.reference: dict[str, float | None] | None = None  # set once the warm-up is over
        self.events: list[dict[str, Any]] = []
        self.last_healthy_checkpoint: str | None = None
        self._logs_seen = 0  # training logs seen (warm-up included)
        self._warmup: dict[str, list[float]] = {}  # metric -> [sum, count] over the warm-up logs
        self._kl_history: list[float] = []  # the last window + 1 values of objective/kl
        self._streaks: dict[str, int] = dict.fromkeys(SIGNALS, 0)
        self._onsets: dict[str, int | None] = dict.fromkeys(SIGNALS)
        self._active: list[str] = []

    @property
    def healthy(self) -> bool:
        """True while no signal has fired."""
        return not self.events

    @property
    def logs_seen(self) -> int:
        """How many training logs (those with ``objective/kl``) the monitor has read, the warm-up's included."""
        return self._logs_seen

    def attach(self, trainer) -> CollapseMonitor:
        """Add the monitor to ``trainer`` *first* in its callback list, so that the reporting integrations (which run
        after it) also log the ``collapse/*`` keys. Returns the monitor."""
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        callbacks.insert(0, self)
        return self

    _ARGS = ("max_kl", "max_kl_rise", "window", "min_perplexity_ratio", "max_length_ratio", "min_length_ratio")
    _ARGS += ("max_tail_ratio", "min_tail_growth", "patience", "warmup_logs", "stop_training")
    _STATE_KEYS = ("reference", "events", "last_healthy_checkpoint", "_logs_seen", "_warmup", "_kl_history")
    _STATE_KEYS += ("_streaks", "_onsets", "_active")

    def state_dict(self) -> dict[str, Any]:
        """Reference values, counters, KL history and events (JSON-serialisable copies)."""
        return {key: copy.deepcopy(getattr(self, key)) for key in self._STATE_KEYS}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; the thresholds of this instance are kept."""
        if unknown := set(state_dict) - set(self._STATE_KEYS):
            raise KeyError(f"Unknown CollapseMonitor state keys: {sorted(unknown)}.")
        for key, value in state_dict.items():
            setattr(self, key, copy.deepcopy(value))

    def state(self) -> dict[str, Any]:
        """transformers' ``ExportableState``: constructor arguments and state attributes."""
        return {"args": {name: getattr(self, name) for name in self._ARGS}, "attributes": self.state_dict()}

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        stored = state.stateful_callbacks.get(type(self).__name__) if state.stateful_callbacks else None
        if state.global_step > 0 and self._logs_seen == 0 and isinstance(stored, dict) and "attributes" in stored:
            self.load_state_dict(stored["attributes"])
            logger.info(
                "CollapseMonitor restored %d logs, %d event(s) from checkpoint.", self._logs_seen, len(self.events)
            )
        self._export(state)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs=None, **kwargs):
        if not logs or metrics.KL not in logs:
            return
        self._logs_seen += 1
        kl = _finite(logs.get(metrics.KL))
        if kl is not None:
            self._kl_history = [*self._kl_history, kl][-(self.window + 1) :]
        p95, mean = _finite(logs.get(metrics.SCORES_P95)), _finite(logs.get(metrics.SCORES))
        perplexity, length = _finite(logs.get(metrics.POLICY_PERPLEXITY)), _finite(logs.get(metrics.RESPONSE_LENGTH))
        tail = None if p95 is None or mean is None else p95 - mean
        if self.reference is None:
            for name, value in zip(REFERENCE_METRICS, (perplexity, length, tail), strict=True):
                if value is not None:
                    total, count = self._warmup.get(name, [0.0, 0])
                    self._warmup[name] = [total + value, count + 1]
            if self._logs_seen >= self.warmup_logs:
                self.reference = {
                    name: (self._warmup[name][0] / self._warmup[name][1] if name in self._warmup else None)
                    for name in REFERENCE_METRICS
                }
            self._export(state)
            return

        step = state.global_step
        checks = {KL: self._check_kl(kl), PERPLEXITY: self._check_perplexity(perplexity)}
        checks.update({LENGTH: self._check_length(length), REWARD_TAIL: self._check_tail(tail)})
        for signal, check in checks.items():
            if check is None:
                self._streaks[signal], self._onsets[signal] = 0, None
                if signal in self._active:
                    self._active.remove(signal)
                continue
            self._streaks[signal] += 1
            if self._onsets[signal] is None:
                self._onsets[signal] = step
            if self._streaks[signal] >= self.patience and signal not in self._active:
                self._active.append(signal)
                self._fire(signal, *check, args, state, control)

        added = {SIGNAL_METRICS[signal]: 1.0 for signal in SIGNALS if signal in self._active}
        added[metrics.COLLAPSE_ANY] = 1.0 if self._active else 0.0
        logs.update(added)
        history = state.log_history
        if history and history[-1].get("step") == step and history[-1].get(metrics.KL) == logs[metrics.KL]:
            history[-1].update(added)  # Trainer.log appended a copy of logs before calling the callbacks
        self._export(state)

    # Signals: each check returns None (does not hold) or (value, threshold, description)
    def _check_kl(self, kl: float | None) -> tuple[float, float, str] | None:
        if kl is None:
            return None
        if kl > self.max_kl:
            return kl, self.max_kl, f"{metrics.KL} = {kl:.4g} nats > max_kl = {self.max_kl:g}"
        rise = self._kl_history[-1] - self._kl_history[0] if len(self._kl_history) > self.window else None
        if rise is None or rise <= self.max_kl_rise:
            return None
        description = f"{metrics.KL} rose by {rise:.4g} nats over the last {self.window} logs (to {kl:.4g})"
        return rise, self.max_kl_rise, f"{description} > max_kl_rise = {self.max_kl_rise:g}"

    def _formula(self, ratio: str, reference: float) -> str:
        return f"{ratio} {getattr(self, ratio):g} × reference {reference:.4g}"

    def _check_perplexity(self, perplexity: float | None) -> tuple[float, float, str] | None:
        reference = self.reference.get(metrics.POLICY_PERPLEXITY)
        if perplexity is None or reference is None or perplexity >= self.min_perplexity_ratio * reference:
            return None
        threshold, formula = self.min_perplexity_ratio * reference, self._formula("min_perplexity_ratio", reference)
        return perplexity, threshold, f"{metrics.POLICY_PERPLEXITY} = {perplexity:.4g} < {threshold:.4g} ({formula})"

    def _check_length(self, length: float | None) -> tuple[float, float, str] | None:
        reference = self.reference.get(metrics.RESPONSE_LENGTH)
        if length is None or reference is None or reference <= 0:
            return None
        if length > (threshold := self.max_length_ratio * reference):
            ratio, sign, change = "max_length_ratio", ">", "longer"
        elif length < (threshold := self.min_length_ratio * reference):
            ratio, sign, change = "min_length_ratio", "<", "shorter"
        else:
            return None
        description = f"{metrics.RESPONSE_LENGTH} = {length:.4g} {sign} {threshold:.4g}"
        return length, threshold, f"{description} ({self._formula(ratio, reference)}): responses got {change}"

    def _check_tail(self, tail: float | None) -> tuple[float, float, str] | None:
        reference = self.reference.get(REWARD_TAIL)
        if tail is None or reference is None:
            return None
        threshold = max(self.max_tail_ratio * max(reference, 1e-6), reference + self.min_tail_growth)
        if tail <= threshold:
            return None
        formula = f"{self._formula('max_tail_ratio', reference)}, min_tail_growth {self.min_tail_growth:g} above it"
        description = f"{metrics.SCORES_P95} − {metrics.SCORES} = {tail:.4g} > {threshold:.4g} ({formula})"
        return tail, threshold, f"{description}: a long tail of high rewards"

    def _fire(self, signal: str, value: float, threshold: float, description: str, args, state, control) -> None:
        since = self._onsets[signal]
        if not self.events:
            found = last_checkpoint_before(args.output_dir, since) if getattr(args, "output_dir", None) else None
            self.last_healthy_checkpoint = str(found) if found else None
        message = (
            f"Possible pattern collapse at step {state.global_step}: signal '{signal}', {description}, for "
            f"{self._streaks[signal]} consecutive logs since step {since}. The policy may be over-optimising the "
            f"reward model (PPO-max §5.2): {ADVICE}."
        )
        checkpoint = self.last_healthy_checkpoint
        where = f"the last checkpoint before the first collapse signal is {checkpoint}" if checkpoint else None
        if self.stop_training:
            control.should_training_stop = True
            message += " Stopping training; " + (
                f"{where}: resume from it with safer settings." if where else "no checkpoint precedes the collapse."
            )
        elif where:
            message += f" ({where}.)"
        event = dict(step=state.global_step, signal=signal, value=value, threshold=threshold, since_step=since)
        self.events.append({**event, "message": message})
        if state.is_world_process_zero:
            logger.warning(message)

    def _export(self, state: TrainerState) -> None:
        """Keep this monitor's state in ``state.stateful_callbacks`` so checkpoints carry it (several monitors of
        this class are left to transformers)."""
        if state.stateful_callbacks is None:
            state.stateful_callbacks = {}
        name = type(self).__name__
        if not isinstance(state.stateful_callbacks.get(name), list):
            state.stateful_callbacks[name] = self.state()


def _finite(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None
