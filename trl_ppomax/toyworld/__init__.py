"""The toy world: the whole RLHF pipeline on a laptop CPU, with a known gold reward (see ``world.py``)."""

from trl_ppomax.toyworld.build import World, WorldSettings, prepare_world
from trl_ppomax.toyworld.pipeline import GOLD_METRICS, eval_prompts, train_prompts
from trl_ppomax.toyworld.world import gold_reward, gold_rewards

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
