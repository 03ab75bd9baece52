"""trl-ppomax: PPO-max (Zheng et al., 2023) as a TRL-style trainer on the current TRL / transformers stack.

The public classes are imported on first access (PEP 562), so that ``import trl_ppomax`` (and the ``trl-ppomax``
command's ``--help``) does not pull in torch, transformers and trl.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> submodule that defines it
_LAZY = {
    "CollapseMonitor": ".ppo.monitor",
    "PPOMaxConfig": ".ppo.config",
    "PPOMaxRewardConfig": ".reward_modeling.config",
    "PPOMaxRewardTrainer": ".reward_modeling.trainer",
    "PPOMaxTrainer": ".ppo.trainer",
    "RemoteRewardModel": ".rewards.remote",
    "RunningMoments": ".ppo.core",
    "WinRateCallback": ".judging.callback",
    "evaluate_policy": ".judging.run",
}

__all__ = [
    "CollapseMonitor",
    "PPOMaxConfig",
    "PPOMaxRewardConfig",
    "PPOMaxRewardTrainer",
    "PPOMaxTrainer",
    "RemoteRewardModel",
    "RunningMoments",
    "WinRateCallback",
    "__version__",
    "evaluate_policy",
]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time these are imported lazily by __getattr__
    from trl_ppomax.judging.callback import WinRateCallback
    from trl_ppomax.judging.run import evaluate_policy
    from trl_ppomax.ppo.config import PPOMaxConfig
    from trl_ppomax.ppo.core import RunningMoments
    from trl_ppomax.ppo.monitor import CollapseMonitor
    from trl_ppomax.ppo.trainer import PPOMaxTrainer
    from trl_ppomax.reward_modeling.config import PPOMaxRewardConfig
    from trl_ppomax.reward_modeling.trainer import PPOMaxRewardTrainer
    from trl_ppomax.rewards.remote import RemoteRewardModel


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later accesses skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
