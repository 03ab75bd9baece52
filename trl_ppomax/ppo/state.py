"""The PPO state a resumed run restores beyond transformers' ``TrainerState``: one object, owned by the trainer and
handed to checkpointing (``ppo_state.json``), with ``state_dict()`` / ``load_state_dict()``."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from trl_ppomax.base import metrics as M
from trl_ppomax.base.core import RunningMoments

logger = logging.getLogger(__name__)


@dataclass
class PPOState:
    """``running_reward``: the historical reward moments of reward normalisation (§5.3.1); ``counters``: the skipped
    samples, iterations and optimizer steps (:data:`metrics.COUNTERS`, logged every step); ``ptx_batches_used``: the
    position in the PPO-ptx data stream."""

    running_reward: RunningMoments = field(default_factory=RunningMoments)
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(M.COUNTERS, 0))
    ptx_batches_used: int = 0

    def state_dict(self) -> dict:
        return {
            "running_reward": self.running_reward.state_dict(),
            "counters": dict(self.counters),
            "ptx_batches_used": self.ptx_batches_used,
        }

    def load_state_dict(self, state: dict) -> None:
        self.running_reward.load_state_dict(state["running_reward"])
        self.counters.update(state["counters"])
        self.ptx_batches_used = state["ptx_batches_used"]

    def count_iteration(self, problem: str | None, iteration: int, last_iteration: int, limit: int) -> None:
        """Count ``iteration``: skipped because of ``problem``, or trained (``problem`` None, ending a run of skips).
        Raises ``RuntimeError`` at the ``limit``-th skip in a row, or when ``last_iteration`` ends a run in which every
        iteration was skipped: either would otherwise end "successfully" with an untrained model."""
        counters = self.counters
        if problem is None:
            counters[M.SKIPPED_IN_A_ROW] = 0
            return
        counters[M.SKIPPED_ITERATIONS] += 1
        counters[M.SKIPPED_IN_A_ROW] += 1
        streak = counters[M.SKIPPED_IN_A_ROW]
        if streak >= limit:
            what = (
                f"{streak:g} iterations in a row were skipped for non-finite numbers (max_skipped_iterations={limit})"
            )
        elif iteration == last_iteration and streak == iteration:
            what = (
                f"every one of the run's {iteration} iterations was skipped for non-finite numbers, so the model is "
                f"untrained (max_skipped_iterations={limit} was not reached)"
            )
        else:
            logger.warning(
                "Iteration %d skipped (%g in a row, max_skipped_iterations=%d): %s.", iteration, streak, limit, problem
            )
            return
        raise RuntimeError(
            f"Stopped at iteration {iteration}: {what}; the last had {problem}. Check the reward function or model "
            "(None, NaN or inf scores), the learning rate and mixed precision (non-finite log-probs or values), then "
            "resume from the last checkpoint; or raise max_skipped_iterations."
        )


def start_trainer_state(state, args, episodes_per_epoch: int) -> None:
    """A fresh ``TrainerState`` for a run of ``args.num_total_batches`` iterations: counters at 0, and
    ``logging_steps``/``eval_steps``/``save_steps`` given as a fraction (< 1) of the run made whole, as the Trainer does."""
    state.max_steps = args.num_total_batches
    state.num_train_epochs = args.total_episodes / episodes_per_epoch
    state.global_step, state.episode, state.epoch = 0, 0, 0.0
    for attribute in ("logging_steps", "eval_steps", "save_steps"):
        value = getattr(args, attribute)
        value = math.ceil(args.num_total_batches * value) if value and value < 1 else value
        setattr(state, attribute, value)
