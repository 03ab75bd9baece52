"""trl-ppomax: PPO-max (Zheng et al., 2023) as a TRL-style trainer on the current TRL / transformers stack."""

from .core import RunningMoments
from .ppo_config import PPOMaxConfig

__version__ = "0.1.0"

__all__ = ["PPOMaxConfig", "RunningMoments", "__version__"]
