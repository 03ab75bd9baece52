"""The run plan: what a :class:`~trl_ppomax.PPOMaxTrainer` is about to do, printed by the recipes before training."""

from __future__ import annotations

from torch import nn


def _count(n: int) -> str:
    return f"{n / 1e6:,.1f}M" if n >= 100_000 else f"{n:,}"


def _describe(module) -> str:
    if not isinstance(module, nn.Module):
        return "a Python function" if module is not None else "policy with adapter disabled"
    total = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    share = f" ({_count(trainable)} trainable)" if 0 < trainable < total else ""
    return f"{type(module).__name__}, {_count(total)} params{share}"


def plan(trainer) -> str:
    """Models, batch sizes, episodes, devices, precision and the PPO-max settings of ``trainer``'s run."""
    args, accelerator = trainer.args, trainer.accelerator
    wrapper = accelerator.unwrap_model(trainer.model_wrapped)
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    critic = (
        _describe(wrapper.critic) if wrapper.critic is not None else f"none ({args.advantage_estimator} needs none)"
    )
    backend = "DeepSpeed" if trainer.is_deepspeed_enabled else "FSDP" if trainer.is_fsdp_enabled else "DDP/single"
    return "\n".join(
        [
            "PPO-max plan",
            f"  policy    : {_describe(wrapper.policy)}",
            f"  reference : {_describe(trainer.ref_model)}",
            f"  critic    : {critic}",
            f"  reward    : {_describe(trainer.reward_model)}",
            f"  devices   : {accelerator.num_processes} × {accelerator.device.type} ({backend}), {precision}",
            f"  rollout   : {args.batch_size} responses per iteration ({args.local_batch_size} per process, "
            f"{args.num_samples_per_prompt} per prompt), responses ≤ {args.response_length} tokens",
            f"  update    : {args.num_ppo_epochs} epochs × {args.num_mini_batches} minibatches of "
            f"{args.mini_batch_size} ({args.per_device_train_batch_size} per device × "
            f"{args.gradient_accumulation_steps} accumulation)",
            f"  length    : {args.total_episodes} episodes = {args.num_total_batches} iterations",
            f"  ppo-max   : preset={args.preset}, reward_norm={args.reward_norm}, reward_clip={args.reward_clip}, "
            f"kl_coef={args.kl_coef}, critic_warmup_steps={args.critic_warmup_steps}, "
            f"max_grad_norm={args.max_grad_norm}, ptx_coef={args.ptx_coef}",
        ]
    )
