"""Optimisation of the policy and the critic: parameter groups, gradient clipping, and the learning-rate schedules
around critic warm-up. Orchestration helpers for :class:`~trl_ppomax.PPOMaxTrainer`; the losses are in ``core``."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

MODELS = ("policy", "critic")


def param_groups(wrapper: nn.Module, decay: set[str], args) -> list[dict]:
    """Optimizer parameter groups of the trainable parameters of ``wrapper.policy`` and ``wrapper.critic``: per model
    (its own learning rate, §5.4, and optionally its own Adam ``eps``, as the release's 1e-6 / 1e-8) and per with or
    without weight decay (``decay`` = the parameter names that get it). Each group is tagged ``"model"``."""
    learning_rates = {"policy": args.learning_rate, "critic": args.effective_critic_learning_rate}
    eps = {"critic": args.critic_adam_epsilon} if args.critic_adam_epsilon is not None else {}
    weight_decay = args.weight_decay
    groups = []
    for model in MODELS:
        named = [(n, p) for n, p in wrapper.named_parameters() if n.startswith(f"{model}.") and p.requires_grad]
        for with_decay in (True, False):
            params = [p for n, p in named if (n in decay) == with_decay]
            if params:
                group = {"params": params, "lr": learning_rates[model], "weight_decay": weight_decay * with_decay}
                groups.append({**group, "model": model, **({"eps": eps[model]} if model in eps else {})})
    return groups


def clip_gradients(
    accelerator, wrapper: nn.Module, max_norm: float, scope: str, critic_only: bool
) -> dict[str, torch.Tensor]:
    """Clip the gradients (App. C.2) and return their norms before clipping, ``{metric name: norm}``.

    ``scope="per_model"``: the policy's and the critic's gradients are clipped separately (``policy/grad_norm``,
    ``critic/grad_norm``); ``"joint"``: as one vector (``grad_norm``), as the release's single engine did.
    ``max_norm`` 0 only measures. With ``critic_only`` the policy's gradients are dropped first (critic warm-up), so
    the optimizer leaves the policy (and its Adam state) untouched.
    """
    from .metrics import CRITIC_GRAD_NORM, GRAD_NORM, POLICY_GRAD_NORM

    if critic_only:
        for parameter in wrapper.policy.parameters():
            parameter.grad = None  # the optimizer skips parameters without gradients
    modules = {POLICY_GRAD_NORM: [wrapper.policy], CRITIC_GRAD_NORM: [wrapper.critic]}
    if scope == "joint":
        modules = {GRAD_NORM: [wrapper.policy, wrapper.critic]}
    norms = {}
    for name, parts in modules.items():
        params = [p for part in parts for p in part.parameters() if p.grad is not None]
        if params:
            norms[name] = accelerator.clip_grad_norm_(params, max_norm or float("inf")).detach()
    return norms


def deepspeed_step(engine) -> tuple[dict[str, torch.Tensor], bool]:
    """What a DeepSpeed engine did at its last step (it clips with ``gradient_clipping = max_grad_norm`` and steps
    inside ``backward``): ``({"grad_norm": norm before clipping}, applied)``; the engine skips the step when the norm
    is not finite (fp32, fp16, and bf16 with ``check_grad_overflow``)."""
    from .metrics import GRAD_NORM

    norm = engine.get_global_grad_norm()
    stats = {GRAD_NORM: torch.tensor(float(norm))} if norm is not None else {}
    return stats, bool(engine.was_step_applied())


def schedule_with_critic_warmup(scheduler, args, num_training_steps: int):
    """``scheduler`` with critic warm-up taken into account (a ``LambdaLR``; other schedulers are left alone): the
    policy's learning rate is 0 while only the critic trains, so that no engine moves it (not even by weight decay,
    which AdamW applies as ``lr · wd · θ``), and with ``critic_warmup_replaces_lr_warmup`` the schedules are shifted
    by :func:`after_critic_warmup`."""
    if not (args.critic_warmup_steps and isinstance(scheduler, LambdaLR)):
        return scheduler
    critic_steps = args.critic_warmup_steps * args.num_ppo_epochs * args.num_mini_batches
    warmup_steps = args.get_warmup_steps(num_training_steps)
    return after_critic_warmup(
        scheduler, critic_steps, warmup_steps, replace_lr_warmup=args.critic_warmup_replaces_lr_warmup
    )


def after_critic_warmup(
    scheduler: LambdaLR, critic_steps: int, warmup_steps: int, replace_lr_warmup: bool = True
) -> LambdaLR:
    """The schedule around ``critic_steps`` optimizer steps of critic warm-up: the policy's multiplier is 0 during
    them. With ``replace_lr_warmup`` (§5.3.3: "we recommend replacing the learning rate warm-up with the critic model
    pre-training") the policy's schedule then starts from its beginning, ``λ(t − critic_steps)``, and the critic's
    skips the warm-up, ``λ(max(t, warmup_steps))``; otherwise both follow ``λ(t)``."""
    optimizer = scheduler.optimizer

    def shifted(base: Callable[[int], float], model: str) -> Callable[[int], float]:
        if model == "policy":
            offset = critic_steps if replace_lr_warmup else 0
            return lambda step: 0.0 if step < critic_steps else base(step - offset)
        return (lambda step: base(max(step, warmup_steps))) if replace_lr_warmup else base

    lambdas = [
        shifted(base, group.get("model", "policy"))
        for base, group in zip(scheduler.lr_lambdas, optimizer.param_groups, strict=True)
    ]
    return LambdaLR(optimizer, lambdas)
