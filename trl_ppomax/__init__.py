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
    "RunningMoments": ".base.core",
    "WinRateCallback": ".judging.callback",
    "evaluate_policy": ".judging.run",
}

__all__ = sorted([*_LAZY, "__version__"])

if TYPE_CHECKING:  # for type checkers and IDEs; at run time these are imported lazily by __getattr__
    from trl_ppomax.base.core import RunningMoments as RunningMoments
    from trl_ppomax.judging.callback import WinRateCallback as WinRateCallback
    from trl_ppomax.judging.run import evaluate_policy as evaluate_policy
    from trl_ppomax.ppo.config import PPOMaxConfig as PPOMaxConfig
    from trl_ppomax.ppo.monitor import CollapseMonitor as CollapseMonitor
    from trl_ppomax.ppo.trainer import PPOMaxTrainer as PPOMaxTrainer
    from trl_ppomax.reward_modeling.config import PPOMaxRewardConfig as PPOMaxRewardConfig
    from trl_ppomax.reward_modeling.trainer import PPOMaxRewardTrainer as PPOMaxRewardTrainer
    from trl_ppomax.rewards.remote import RemoteRewardModel as RemoteRewardModel


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later accesses skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
