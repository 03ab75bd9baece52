"""Train a PPO-max reward model: a thin wrapper around `trl_ppomax.cli.reward` (the `trl-ppomax reward` command).

    # tiny CPU run (builds its own tiny models on first use); `--config reward_tiny_cpu` (a shipped config) works too
    accelerate launch recipes/reward_modeling.py --config recipes/configs/reward_tiny_cpu.yaml
    # the paper's setting (LLaMA-7B-style SFT model, Anthropic HH-RLHF)
    accelerate launch --config_file recipes/accelerate/deepspeed_zero2.yaml recipes/reward_modeling.py \
        --config recipes/configs/reward_moss_7b_en.yaml

The same without the repository: `trl-ppomax reward --config reward_tiny_cpu`. The code is in
`trl_ppomax/cli/reward.py`.
"""

import sys
from pathlib import Path

# From a checkout, use this checkout's trl_ppomax (the code these wrappers belong to), even if another is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trl_ppomax.cli.reward import RewardScriptArguments, load_preferences, main

__all__ = ["RewardScriptArguments", "load_preferences", "main"]

if __name__ == "__main__":
    main()
