"""One process of ``engine_memory.py``: a tiny PPO-max run under an accelerate engine, measuring what this rank holds.

Run under ``accelerate launch --config_file recipes/accelerate/<engine>_cpu.yaml --num_processes 2`` (see
``engine_memory.py``, which does it for every engine)::

    engine_memory_worker.py OUTPUT_DIR [--no-ds3-gather] [--persistence-threshold N] [--fsdp-on-cpu]

``--fsdp-on-cpu`` makes FSDP2 really shard on CPU processes (``tests/helpers.let_fsdp_run_on_cpu``; accelerate
runs DDP on CPU otherwise).

Builds a :class:`~trl_ppomax.PPOMaxTrainer` on the tiny models (fp32, CPU, two iterations of 2 PPO epochs × 2
mini-batches = 4 optimizer steps each) and writes ``OUTPUT_DIR/rank{r}.json`` with, in bytes **held by this rank**:

- ``trained``: the policy+critic wrapper (also split into ``policy`` / ``critic``):
  ``params`` (after the iteration; ZeRO-3: the local partitions ``p.ds_tensor`` plus any parameter still
  materialised in full, i.e. below ``stage3_param_persistence_threshold``; ZeRO-1/2 and DDP: the full parameters;
  FSDP2: the local DTensor shards ``p.to_local()``),
  ``grads`` (the largest over the optimizer steps, taken just before each step: ``p.grad`` plus DeepSpeed's flat
  gradient partitions ``averaged_gradients`` / ``grad_partitions_flat_buffer``),
  ``optimizer_states`` (after the iteration: the tensors in the optimizer's ``state``; under DeepSpeed ZeRO the inner
  optimizer's, over the fp32 flat partitions) and ``master_weights`` (DeepSpeed ZeRO's fp32 partitions, not counting
  any that are the parameter partitions themselves);
- ``frozen``: ``params`` of the reference and of the reward model;
- ``generation``: at the entry of ``generate_responses`` (the policy gathered if the engine gathers it), the
  materialised bytes ``p.data.numel() * p.element_size()`` of the policy and the critic, and the peak over every
  module call during ``generate`` (forward pre-hooks: what ZeRO-3 without the gather, or FSDP2, fetches layer by
  layer).

Every size is counted by unique storage (views into one flat buffer are counted once, padding included).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn
from transformers import TrainerCallback

import trl_ppomax.generation as generation_module
from trl_ppomax import PPOMaxTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/helpers.py
from helpers import engine_name, tiny_trainer


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--no-ds3-gather", action="store_true")
    parser.add_argument("--fsdp-on-cpu", action="store_true", help="let accelerate build FSDP on CPU processes")
    parser.add_argument(
        "--persistence-threshold",
        type=int,
        default=None,
        help="DeepSpeed ZeRO-3 stage3_param_persistence_threshold (elements) for the trained engine; DeepSpeed's "
        "default, 100000, keeps every parameter of the tiny models in full on every rank",
    )
    return parser.parse_args()


# --------------------------------------------------------------------------------------------------------------------
# Counting
# --------------------------------------------------------------------------------------------------------------------
def local(tensor: torch.Tensor) -> torch.Tensor:
    """The local part of a tensor: a DTensor's shard, else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def flatten(obj) -> list[torch.Tensor]:
    if obj is None:
        return []
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for value in obj.values() for t in flatten(value)]
    if isinstance(obj, list | tuple):
        return [t for value in obj for t in flatten(value)]
    return []


def storages(tensors) -> dict[int, int]:
    """``{storage address: bytes}`` of the tensors' storages (a view counts its whole storage, once)."""
    found = {}
    for tensor in tensors:
        tensor = local(tensor)
        storage = tensor.untyped_storage()
        if storage.nbytes():
            found[storage.data_ptr()] = storage.nbytes()
    return found


def nbytes(tensors, exclude: dict[int, int] | None = None) -> int:
    return sum(size for ptr, size in storages(tensors).items() if not exclude or ptr not in exclude)


def elements_bytes(tensors) -> int:
    """Bytes of the tensors' own elements (their local shards), whatever storage they share."""
    return sum(local(t).numel() * local(t).element_size() for t in tensors)


def param_tensors(module: nn.Module) -> list[torch.Tensor]:
    """What a module's parameters occupy on this rank: ZeRO-3 partitions and whatever is materialised."""
    tensors = []
    for p in module.parameters():
        if hasattr(p, "ds_tensor"):
            tensors.append(p.ds_tensor)
        tensors.append(local(p).data)
    return tensors


def materialised(module: nn.Module) -> int:
    """Bytes of the parameters materialised at this moment: full tensors (a partitioned ZeRO-3 parameter has
    ``p.data.numel() == 0``), local shards for DTensors."""
    return sum(local(p).data.numel() * local(p).element_size() for p in module.parameters())


def unwrap(module):
    return module.module if hasattr(module, "module") and isinstance(module.module, nn.Module) else module


# --------------------------------------------------------------------------------------------------------------------
# Probes
# --------------------------------------------------------------------------------------------------------------------
class Probe:
    def __init__(self) -> None:
        self.trainer: PPOMaxTrainer | None = None
        self.grads = {"trained": 0, "policy": 0, "critic": 0, "flat_partitions": 0, "param_grads": 0}
        self.generation = {"policy_at_entry": 0, "critic_at_entry": 0, "policy_peak": 0, "critic_peak": 0}
        self.after_iterations: list[dict] = []
        self.generation_per_call: list[dict] = []

    @property
    def wrapper(self):
        return self.trainer.accelerator.unwrap_model(self.trainer.model_wrapped)

    # gradients, just before each optimizer step
    def grad_tensors(self, module: nn.Module) -> list[torch.Tensor]:
        return [p.grad for p in module.parameters() if p.grad is not None]

    def flat_grad_tensors(self) -> list[torch.Tensor]:
        zero = getattr(self.trainer.model_wrapped, "optimizer", None) if self.trainer.is_deepspeed_enabled else None
        if zero is None:
            return []
        tensors = flatten(getattr(zero, "averaged_gradients", None))
        for name in ("grad_partitions_flat_buffer", "grads_in_partition"):
            tensors += flatten(getattr(zero, name, None))
        return tensors

    def before_step(self) -> None:
        wrapper = self.wrapper
        flat = self.flat_grad_tensors()
        param = self.grad_tensors(wrapper)
        now = {
            "trained": nbytes(param + flat),
            "policy": elements_bytes(self.grad_tensors(wrapper.policy)),
            "critic": elements_bytes(self.grad_tensors(wrapper.critic)),
            "flat_partitions": nbytes(flat),
            "param_grads": nbytes(param),
        }
        for key, value in now.items():
            self.grads[key] = max(self.grads[key], value)

    def install_step_probe(self) -> None:
        trainer = self.trainer
        # under DeepSpeed the ZeRO optimizer, which the engine steps inside backward
        target = trainer.model_wrapped.optimizer if trainer.is_deepspeed_enabled else trainer.optimizer
        step = target.step

        def probed_step(*args, **kwargs):
            self.before_step()
            return step(*args, **kwargs)

        target.step = probed_step

    # generation
    def install_generation_probe(self) -> None:
        original = generation_module.generate_responses

        def probed(model, *args, **kwargs):
            wrapper = self.wrapper
            gen = {
                "policy_at_entry": materialised(wrapper.policy),
                "critic_at_entry": materialised(wrapper.critic),
                "policy_peak": 0,
                "critic_peak": 0,
            }

            def peek(module, inputs):
                gen["policy_peak"] = max(gen["policy_peak"], materialised(wrapper.policy))
                gen["critic_peak"] = max(gen["critic_peak"], materialised(wrapper.critic))

            handles = [m.register_forward_pre_hook(peek) for m in wrapper.policy.modules()]
            try:
                return original(model, *args, **kwargs)
            finally:
                for handle in handles:
                    handle.remove()
                self.generation_per_call.append(gen)
                for key, value in gen.items():
                    self.generation[key] = max(self.generation[key], value)

        generation_module.generate_responses = probed

    # after the iteration
    def optimizer_and_master(self) -> dict:
        trainer = self.trainer
        params = storages(param_tensors(self.wrapper))
        zero = trainer.model_wrapped.optimizer if trainer.is_deepspeed_enabled else None
        if zero is not None:
            inner = zero.optimizer
            master = flatten(getattr(zero, "single_partition_of_fp32_groups", None))
            master += flatten(getattr(zero, "fp32_partitioned_groups_flat", None))
        else:
            inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
            master = []
        if hasattr(zero, "sub_group_to_group_id"):  # ZeRO-3 puts a sub-group's partition in its group only to step
            pairs = [
                (inner.param_groups[zero.sub_group_to_group_id[i]], p)
                for i, p in enumerate(zero.fp32_partitioned_groups_flat)
            ]
        else:
            pairs = [(group, p) for group in inner.param_groups for p in group["params"]]
        per_model = {"policy": [], "critic": []}
        for group, p in pairs:
            per_model.setdefault(group.get("model", "unknown"), []).extend(flatten(inner.state.get(p)))
        return {
            "optimizer_states": nbytes(flatten(list(inner.state.values()))),
            "optimizer_states_policy": nbytes(per_model["policy"]),
            "optimizer_states_critic": nbytes(per_model["critic"]),
            "master_weights": nbytes(master, exclude=params),
            "master_weights_aliasing_params": nbytes(master) - nbytes(master, exclude=params),
        }

    def measure(self) -> dict:
        trainer = self.trainer
        wrapper = self.wrapper
        trained = {
            "params": nbytes(param_tensors(wrapper)),
            "params_policy": nbytes(param_tensors(wrapper.policy)),
            "params_critic": nbytes(param_tensors(wrapper.critic)),
            "full_size": full_size(wrapper),
            "grads": self.grads["trained"],
            "grads_policy": self.grads["policy"],
            "grads_critic": self.grads["critic"],
            "grads_flat_partitions": self.grads["flat_partitions"],
            "grads_param": self.grads["param_grads"],
            **self.optimizer_and_master(),
        }
        frozen = {}
        for name in ("ref_model", "reward_model"):
            module = getattr(trainer, name)
            if isinstance(module, nn.Module):
                frozen[name] = {"params": nbytes(param_tensors(unwrap(module))), "full_size": full_size(module)}
        persistent = sum(
            local(p).data.numel() * local(p).element_size()
            for p in wrapper.parameters()
            if hasattr(p, "ds_tensor") and local(p).data.numel()
        )
        return {"trained": trained, "frozen": frozen, "zero3_persistent_params": persistent}


def full_size(module: nn.Module) -> int:
    """Bytes of the module's parameters at full size (what one unsharded copy holds)."""
    total = 0
    for p in module.parameters():
        numel = p.ds_numel if hasattr(p, "ds_numel") else p.numel()  # a DTensor's numel() is the global one
        total += numel * p.element_size()
    return total


class AfterIteration(TrainerCallback):
    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    def on_step_end(self, args, state, control, **kwargs):
        self.probe.after_iterations.append(self.probe.measure())
        return control


# --------------------------------------------------------------------------------------------------------------------


def set_persistence_threshold(threshold: int) -> None:
    """Give the DeepSpeed plugin built from the launcher's settings ``stage3_param_persistence_threshold``."""
    from accelerate.utils import DeepSpeedPlugin

    post_init = DeepSpeedPlugin.__post_init__

    def patched(self):
        post_init(self)
        self.deepspeed_config.setdefault("zero_optimization", {})["stage3_param_persistence_threshold"] = threshold

    DeepSpeedPlugin.__post_init__ = patched


def fsdp_units(trainer) -> list[str]:
    """Names of the modules of the trained wrapper that are FSDP2 units ("" is the root)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    return [name for name, m in trainer.model_wrapped.named_modules() if isinstance(m, FSDPModule)]


def main() -> None:
    options = parse()
    output = options.output_dir
    if options.persistence_threshold is not None:
        set_persistence_threshold(options.persistence_threshold)
    probe = Probe()
    trainer = tiny_trainer(
        output,
        callbacks=[AfterIteration(probe)],
        fsdp_on_cpu=options.fsdp_on_cpu,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        num_mini_batches=2,
        num_ppo_epochs=2,
        total_episodes=16,  # two iterations of 2 processes × 2 prompts × 2 mini-batches
        local_rollout_forward_batch_size=4,
        critic_warmup_steps=0,  # both models step, so both have optimizer states
        ds3_gather_for_generation=not options.no_ds3_gather,
    )
    args = trainer.args
    probe.trainer = trainer
    probe.install_step_probe()
    probe.install_generation_probe()
    trainer.train()
    accelerator = trainer.accelerator
    result = {
        "engine": engine_name(trainer),
        "ds3_gather_for_generation": args.ds3_gather_for_generation,
        "persistence_threshold": options.persistence_threshold,
        "world_size": accelerator.num_processes,
        "rank": accelerator.process_index,
        "global_step": trainer.state.global_step,
        "fsdp_units": fsdp_units(trainer),
        "optimizer_steps": trainer.state.global_step * args.num_ppo_epochs * args.num_mini_batches,
        "generation": probe.generation,  # the largest over the calls
        "generation_per_call": probe.generation_per_call,
        **probe.after_iterations[-1],  # after the last iteration
        "after_iterations": probe.after_iterations,
    }
    output.mkdir(parents=True, exist_ok=True)
    (output / f"rank{accelerator.process_index}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
