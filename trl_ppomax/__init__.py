"""trl-ppomax: PPO-max (Zheng et al., 2023) as a TRL-style trainer on the current TRL / transformers stack."""

__version__ = "0.1.0"

from .core import RunningMoments
from .monitor import CollapseMonitor
from .ppo_config import PPOMaxConfig
from .ppo_trainer import PPOMaxTrainer
from .reward_config import PPOMaxRewardConfig
from .reward_trainer import PPOMaxRewardTrainer

__all__ = [
    "CollapseMonitor",
    "PPOMaxConfig",
    "PPOMaxRewardConfig",
    "PPOMaxRewardTrainer",
    "PPOMaxTrainer",
    "RunningMoments",
    "__version__",
]
