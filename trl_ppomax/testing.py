"""Helpers shared by the engine tests (``tests/scripts/engine_run.py``) and the engine benchmark
(``benchmarks/engine_memory_worker.py``): which engine a trainer runs under, and FSDP on CPU processes."""

from __future__ import annotations


def engine_name(trainer) -> str:
    """``deepspeed-zero2``/``-zero3``, ``fsdp2``, ``ddp`` or ``single``: what the trainer actually runs under."""
    if trainer.is_deepspeed_enabled:
        return f"deepspeed-zero{trainer.model_wrapped.zero_optimization_stage()}"
    if trainer.is_fsdp_enabled:
        return f"fsdp{trainer.accelerator.state.fsdp_plugin.fsdp_version}"
    return "ddp" if trainer.accelerator.num_processes > 1 else "single"


def let_fsdp_run_on_cpu() -> None:
    """Test-only: accelerate (1.15) enables FSDP only for GPU-type process groups and silently runs DDP on CPU
    processes; present the CPU (gloo) group as MULTI_GPU so that FSDP2 really shards. Call it after the config (which
    sets up the process state) and before the trainer."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    state = PartialState()
    if state.distributed_type == DistributedType.MULTI_CPU:
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
