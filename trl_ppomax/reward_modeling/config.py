"""PPOMaxRewardConfig: trl's ``RewardConfig`` plus the PPO-max reward-model options (§3.1 of the paper)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from trl import RewardConfig

from trl_ppomax.ppo.config import check_int_fields, default_bf16, render_field_docs


@dataclass
class PPOMaxRewardConfig(RewardConfig):
    r"""Configuration of [`PPOMaxRewardTrainer`]: every field of [`trl.RewardConfig`] (``bf16`` defaults to True
    only on a GPU that supports it; activation checkpointing is on, as in trl, without the deprecated
    ``gradient_checkpointing`` name), plus the fields below."""

    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Deprecated alias of activation_checkpointing (transformers 5.20 on; the setting itself before). "
            "Default: activation checkpointing on, as trl's RewardConfig."
        },
    )

    lm_loss_coef: float = field(
        default=1.0,
        metadata={
            "help": "β_rm: weight of the imitation (LM) loss on the chosen response, added to the pairwise loss "
            "(§3.1, eq. 2; the paper uses 1). 0 gives trl's RewardTrainer exactly. > 0 needs a causal-LM start."
        },
    )
    fold_reward_stats: bool = field(
        default=False,
        metadata={
            "help": "Fold the evaluation reward mean/std into the saved score head, so that it outputs rewards with "
            "std 1 (and mean 0 when the head has a bias). The statistics are stored in the config either way."
        },
    )
    reward_histogram: bool = field(
        default=True,
        metadata={"help": "After each evaluation, save the histogram of r(chosen) − r(rejected) as a PNG (Fig. 2)."},
    )

    def __post_init__(self) -> None:
        check_int_fields(self)  # what the user passed, before RewardConfig and TrainingArguments set their fields
        coef = self.lm_loss_coef
        if not (isinstance(coef, numbers.Real) and not isinstance(coef, bool) and math.isfinite(coef) and coef >= 0):
            raise ValueError(
                f"lm_loss_coef (β_rm) must be a finite number ≥ 0, got {coef!r}: it weights the imitation loss on the "
                "chosen response (the paper uses 1; 0 trains with the pairwise loss alone)."
            )
        if self.bf16 is None:
            self.bf16 = default_bf16(self.fp16)
        if self.gradient_checkpointing is None and getattr(self, "activation_checkpointing", None) is None:
            # trl's default, under transformers ≥ 5.20's name when it has it (the deprecated one warns)
            new = hasattr(self, "activation_checkpointing")
            setattr(self, "activation_checkpointing" if new else "gradient_checkpointing", True)
        super().__post_init__()


PPOMaxRewardConfig.__doc__ = (PPOMaxRewardConfig.__doc__ or "") + render_field_docs(PPOMaxRewardConfig, RewardConfig)
