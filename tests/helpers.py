"""Helpers shared by the test modules and ``tests/scripts``: a tiny PPO-max trainer and parameter snapshots.

Import them with ``from helpers import ...`` (pytest puts ``tests/`` on ``sys.path``, as for ``conftest``). Tiny
models, tokenizers and prompts come from the package itself, :mod:`trl_ppomax.tiny`; fixtures live in ``conftest``.
"""

from __future__ import annotations

import torch
from datasets import Dataset
from transformers import TrainerCallback

from trl_ppomax import PPOMaxConfig, PPOMaxTrainer
from trl_ppomax.tiny import build_models, prompt_texts

__all__ = ["SMOKE", "TINY", "StopAt", "changed", "make_trainer", "snapshot"]

#: A fast PPO-max run on the tiny models: two iterations of 16 episodes (4 prompts × 2 accumulation steps × 2).
TINY = dict(
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    num_mini_batches=2,
    total_episodes=32,
    response_length=6,
    num_ppo_epochs=1,
    learning_rate=1e-3,
    stop_token="eos",
    report_to="none",
    gradient_checkpointing=False,
    num_sample_generations=0,
    logging_steps=1,
    save_strategy="no",
    critic_warmup_steps=0,
    seed=0,
)
# Two iterations of 4 prompts: for the tests that only check a model works inside PPO.
SMOKE = {**TINY, "gradient_accumulation_steps": 1, "num_mini_batches": 1, "total_episodes": 8}


def make_trainer(
    tmp_path,
    reward=None,
    value_model=None,
    ptx_dataset=None,
    dataset=None,
    peft_config=None,
    eval_dataset=None,
    arch="llama",
    **overrides,
):
    """A :class:`PPOMaxTrainer` on the tiny ``arch`` models with :data:`TINY` (``overrides`` win), writing to
    ``tmp_path / "out"``; the reward model is the tiny one unless ``reward`` is given, the prompts
    ``prompt_texts(32)`` unless ``dataset`` is."""
    tokenizer, policy, reward_model = build_models(arch)
    args = PPOMaxConfig(output_dir=str(tmp_path / "out"), **{**TINY, **overrides})
    return PPOMaxTrainer(
        args=args,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,
        reward_model=reward_model if reward is None else reward,
        train_dataset=dataset if dataset is not None else Dataset.from_dict({"prompt": prompt_texts(32)}),
        value_model=value_model,
        ptx_dataset=ptx_dataset,
        peft_config=peft_config,
        eval_dataset=eval_dataset,
    )


def snapshot(module):
    """A detached copy of every parameter of ``module``, by name."""
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def changed(before, module):
    """How many parameters of ``module`` differ from the :func:`snapshot` ``before``."""
    return sum(not torch.equal(before[n], p) for n, p in module.named_parameters())


class StopAt(TrainerCallback):
    """Simulates a pre-emption: stop the run after iteration ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control
