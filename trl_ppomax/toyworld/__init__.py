"""The toy world: the whole RLHF pipeline on a laptop CPU, with a known gold reward (see ``world.py``)."""

from .build import World, WorldSettings, prepare_world
from .pipeline import GOLD_METRICS, eval_prompts, train_prompts
from .world import gold_reward, gold_rewards

__all__ = [
    "GOLD_METRICS",
    "World",
    "WorldSettings",
    "eval_prompts",
    "gold_reward",
    "gold_rewards",
    "prepare_world",
    "train_prompts",
]
