"""The optimisation of the policy and the critic (``trl_ppomax.ppo.optim``): joint gradient clipping bounds the norm of
both models together, the critic warm-up replaces the learning-rate warm-up, and the policy's learning rate is zero
while the critic warms up."""

from __future__ import annotations

import pytest
import torch
from helpers import make_trainer


def test_joint_clipping_bounds_the_norm_of_both_models_together(tmp_path):
    from trl_ppomax.ppo.optim import clip_gradients

    trainer = make_trainer(tmp_path)
    wrapper = trainer.model
    for parameter in wrapper.parameters():
        parameter.grad = torch.ones_like(parameter)
    clip_gradients(trainer.accelerator, wrapper, 1.0, "joint", critic_only=False)
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in wrapper.parameters()]))
    assert total.item() == pytest.approx(1.0, rel=1e-4)
    per_model = [
        torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in m.parameters()])) for m in wrapper.children()
    ]
    assert all(norm < 1.0 for norm in per_model)  # neither model alone is at the bound


def test_critic_warmup_replaces_the_lr_warmup(tmp_path):
    trainer = make_trainer(tmp_path, critic_warmup_steps=1, warmup_steps=2, lr_scheduler_type="constant_with_warmup")
    scheduler, groups = trainer.lr_scheduler, trainer.optimizer.param_groups
    lrs = {group["model"]: group["lr"] for group in groups}
    assert lrs["critic"] == trainer.args.effective_critic_learning_rate  # no warm-up on the critic
    assert lrs["policy"] == 0.0  # the policy's warm-up starts after the critic warm-up
    critic_steps = trainer.args.num_ppo_epochs * trainer.args.num_mini_batches
    for _ in range(critic_steps + 1):
        scheduler.step()
    policy_lr = next(group["lr"] for group in groups if group["model"] == "policy")
    assert policy_lr == pytest.approx(trainer.args.learning_rate / 2)  # one step into its two-step warm-up

    plain = make_trainer(
        tmp_path / "plain",
        critic_warmup_steps=1,
        warmup_steps=2,
        critic_warmup_replaces_lr_warmup=False,
        lr_scheduler_type="constant_with_warmup",
    )
    assert all(group["lr"] == 0.0 for group in plain.optimizer.param_groups)


def test_policy_learning_rate_is_zero_during_critic_warmup(tmp_path):
    """So that no engine moves the policy then, weight decay included (AdamW decays by lr · wd · θ)."""
    trainer = make_trainer(tmp_path, critic_warmup_steps=1, lr_scheduler_type="constant", weight_decay=0.1)
    groups, scheduler = trainer.optimizer.param_groups, trainer.lr_scheduler
    critic_steps = trainer.args.num_ppo_epochs * trainer.args.num_mini_batches
    for step in range(critic_steps + 1):
        lrs = {group["model"]: group["lr"] for group in groups}
        warming_up = step < critic_steps
        assert lrs["policy"] == (0.0 if warming_up else trainer.args.learning_rate)
        assert lrs["critic"] == trainer.args.effective_critic_learning_rate
        trainer.optimizer.step()
        scheduler.step()
