"""Optimisation of the policy and the critic for :class:`~trl_ppomax.PPOMaxTrainer` (the losses are in ``core``):
parameter groups, gradient clipping, the learning-rate schedules around critic warm-up, one optimizer step."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from accelerate.utils import DistributedType
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

logger = logging.getLogger(__name__)
MODELS = ("policy", "critic")


def param_groups(wrapper: nn.Module, decay: set[str], args) -> list[dict]:
    """Parameter groups of the trainable parameters of ``wrapper.policy`` and ``wrapper.critic``, tagged ``"model"``:
    per model (own learning rate, §5.4; optional own Adam ``eps``, as the release's 1e-6 / 1e-8) and per decay or not
    (``decay`` = the parameter names that get weight decay)."""
    learning_rates = {"policy": args.learning_rate, "critic": args.effective_critic_learning_rate}
    groups = []
    for model in MODELS:
        named = [(n, p) for n, p in wrapper.named_parameters() if n.startswith(f"{model}.") and p.requires_grad]
        eps = {"eps": args.critic_adam_epsilon} if model == "critic" and args.critic_adam_epsilon is not None else {}
        for with_decay in (True, False):
            params = [p for n, p in named if (n in decay) == with_decay]
            if params:
                group = {"params": params, "lr": learning_rates[model], "weight_decay": args.weight_decay * with_decay}
                groups.append({**group, "model": model, **eps})
    return groups


def clip_gradients(
    accelerator, wrapper: nn.Module, max_norm: float, scope: str, critic_only: bool
) -> dict[str, torch.Tensor]:
    """Clip the gradients (App. C.2); returns their norms before clipping, ``{metric name: norm}``. ``scope``
    ``"per_model"`` clips policy and critic separately (``policy/grad_norm``, ``critic/grad_norm``), ``"joint"`` as
    one vector (``grad_norm``, the release's single engine). ``max_norm`` 0 only measures. ``critic_only`` (critic
    warm-up) drops the policy's gradients first, so the optimizer leaves the policy and its Adam state untouched."""
    from trl_ppomax.base.metrics import CRITIC_GRAD_NORM, GRAD_NORM, POLICY_GRAD_NORM

    if critic_only:
        for parameter in wrapper.policy.parameters():
            parameter.grad = None  # the optimizer skips parameters without gradients
    modules = {POLICY_GRAD_NORM: [wrapper.policy], CRITIC_GRAD_NORM: wrapper.trained[1:]}
    if scope == "joint":
        modules = {GRAD_NORM: wrapper.trained}
    norms = {}
    for name, parts in modules.items():
        params = [p for part in parts for p in part.parameters() if p.grad is not None]
        if params:
            norm = accelerator.clip_grad_norm_(params, max_norm or float("inf")).detach()
            norms[name] = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor under FSDP2
    return norms


def deepspeed_step(engine) -> tuple[dict[str, torch.Tensor], bool]:
    """What a DeepSpeed engine did at its last step (it clips with ``gradient_clipping = max_grad_norm`` and steps
    inside ``backward``): ``({"grad_norm": norm before clipping}, applied)``; the engine skips the step when the norm
    is not finite (fp32, fp16, and bf16 with ``check_grad_overflow``)."""
    from trl_ppomax.base.metrics import GRAD_NORM

    norm = engine.get_global_grad_norm()
    stats = {GRAD_NORM: torch.tensor(float(norm))} if norm is not None else {}
    return stats, bool(engine.was_step_applied())


def restart_policy_adam(optimizer) -> None:
    """Reset the policy's Adam step counter to 0 when it starts training after critic warm-up: under DeepSpeed its
    warm-up gradients are zeros, not absent, so the step advanced while the moments stayed 0, and bias correction
    would make the first updates several times too large. Exact (moments are 0); a no-op without state."""
    for model, state in adam_states(optimizer):
        if model == "policy" and "step" in state:
            state["step"] = torch.zeros_like(state["step"]) if torch.is_tensor(state["step"]) else 0


def adam_states(optimizer) -> list[tuple[str, dict]]:
    """``(model, state)`` for every parameter of the innermost torch optimizer (``model`` = "policy" or "critic"),
    through accelerate's and DeepSpeed's wrappers (under ZeRO-3 the groups are empty between steps: its flat fp32
    partitions are used)."""
    chain = [optimizer]
    while hasattr(chain[-1], "optimizer"):
        chain.append(chain[-1].optimizer)
    inner = chain[-1]
    zero3 = next((o for o in chain if hasattr(o, "fp32_partitioned_groups_flat")), None)
    if zero3 is not None:
        pairs = [
            (inner.param_groups[zero3.sub_group_to_group_id[i]], flat)
            for i, flat in enumerate(zero3.fp32_partitioned_groups_flat)
        ]
    else:
        pairs = [(group, parameter) for group in inner.param_groups for parameter in group["params"]]
    return [(group.get("model", "policy"), inner.state[p]) for group, p in pairs if p in inner.state]


def schedule_with_critic_warmup(scheduler, args, num_training_steps: int):
    """A ``LambdaLR`` ``scheduler`` (others are left alone) with the policy's learning rate 0 during critic warm-up,
    so no engine moves it (not even AdamW's weight decay ``lr · wd · θ``), shifted by :func:`after_critic_warmup`."""
    if not (args.critic_warmup_steps and isinstance(scheduler, LambdaLR)):
        return scheduler
    critic_steps = args.critic_warmup_steps * args.update_epochs * args.num_mini_batches
    warmup = args.get_warmup_steps(num_training_steps)
    return after_critic_warmup(scheduler, critic_steps, warmup, args.critic_warmup_replaces_lr_warmup)


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

    models = [group.get("model", "policy") for group in optimizer.param_groups]
    return LambdaLR(optimizer, [shifted(base, m) for base, m in zip(scheduler.lr_lambdas, models, strict=True)])


def rebase_learning_rates(optimizer, scheduler, args) -> None:
    """After a resume restored the checkpoint's schedule, give every parameter group its base rate from ``args``
    (``learning_rate``, the critic's rate) at the schedule's position: ``lr = base · λ(step)`` (``LambdaLR``; a no-op
    when the rates are unchanged)."""
    if not isinstance(scheduler, LambdaLR):
        return
    rates = {"policy": args.learning_rate, "critic": args.effective_critic_learning_rate}
    for index, group in enumerate(optimizer.param_groups):
        base = rates[group.get("model", "policy")]
        scheduler.base_lrs[index] = group["initial_lr"] = base
        group["lr"] = base * scheduler.lr_lambdas[index](scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def optimizer_step(model_wrapped, accelerator, optimizer, lr_scheduler, args, critic_only: bool) -> dict | None:
    """Clip the gradients (per model or jointly, App. C.2), then step the optimizer and the schedule — unless a
    gradient is non-finite: then nothing steps and None is returned (the gradients are identical on every process).
    Under DeepSpeed (``model_wrapped`` an engine) the engine clips and steps inside ``backward`` and skips a
    non-finite step itself; its norm and decision are read back. Returns the gradient-norm stats."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        stats, applied = deepspeed_step(model_wrapped)
    else:
        wrapper = accelerator.unwrap_model(model_wrapped)
        stats = clip_gradients(accelerator, wrapper, args.max_grad_norm, args.grad_clip_scope, critic_only)
        applied = not stats or bool(torch.isfinite(torch.stack(list(stats.values()))).all())
        if applied:
            optimizer.step()
    if applied:
        lr_scheduler.step()
    optimizer.zero_grad()
    return stats if applied else None
