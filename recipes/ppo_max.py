"""Train a policy with PPO-max: a thin wrapper around `trl_ppomax.cli.ppo` (the `trl-ppomax ppo` command).

    # no arguments: the toy world (SFT → reward model → PPO-max, with a known gold reward), CPU, a few minutes
    accelerate launch recipes/ppo_max.py
    # tiny CPU run (builds its own tiny models on first use); `--config tiny_cpu` (a shipped config) works too
    accelerate launch recipes/ppo_max.py --config recipes/configs/tiny_cpu.yaml
    # two CPU processes
    accelerate launch --multi_gpu --num_processes 2 recipes/ppo_max.py --config recipes/configs/tiny_cpu.yaml
    # the paper's English setting on 8 GPUs with DeepSpeed ZeRO-2
    accelerate launch --config_file recipes/accelerate/deepspeed_zero2.yaml recipes/ppo_max.py \
        --config recipes/configs/moss_7b_en.yaml

The same without the repository: `trl-ppomax ppo --config tiny_cpu`, `trl-ppomax ppo --config moss_7b_en
--accelerate_config zero2`. The code, and every field's documentation, is in `trl_ppomax/cli/ppo.py`.
"""

import sys
from pathlib import Path

# From a checkout, use this checkout's trl_ppomax (the code these wrappers belong to), even if another is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trl_ppomax.cli.ppo import PPOMaxScriptArguments, check_combination, main, run

__all__ = ["PPOMaxScriptArguments", "check_combination", "main", "run"]

if __name__ == "__main__":
    run()
