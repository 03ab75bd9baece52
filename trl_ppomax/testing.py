"""Helpers shared by the launched test scripts (``tests/scripts/engine_run.py``, ``ddp_run.py``) and the engine
benchmark (``benchmarks/engine_memory_worker.py``): the tiny trainer they run, which engine it runs under, and FSDP
on CPU processes."""

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


#: What every launched tiny run shares; each script sets its batch sizes, episodes and what it checks.
TINY_RUN = dict(
    response_length=6,
    stop_token="eos",
    learning_rate=1e-3,
    num_sample_generations=0,
    gradient_checkpointing=False,
    logging_steps=1,
    save_strategy="no",
    use_cpu=True,
    bf16=False,
    report_to="none",
    disable_tqdm=True,
    seed=0,
)


def tiny_trainer(output_dir, callbacks=None, fsdp_on_cpu: bool = False, **settings):
    """A :class:`~trl_ppomax.PPOMaxTrainer` on the tiny Llama models (policy, reward model and critic from it) and
    32 prompts, with :data:`TINY_RUN` and ``settings`` (which win); ``fsdp_on_cpu``: :func:`let_fsdp_run_on_cpu`."""
    from datasets import Dataset

    from .ppo_config import PPOMaxConfig
    from .ppo_trainer import PPOMaxTrainer
    from .tiny import build_models, prompt_texts

    tokenizer, policy, reward = build_models("llama", seed=0)
    args = PPOMaxConfig(output_dir=str(output_dir), **{**TINY_RUN, **settings})
    if fsdp_on_cpu:
        let_fsdp_run_on_cpu()  # after the config, which sets up the process state
    return PPOMaxTrainer(
        args=args,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,
        reward_model=reward,
        train_dataset=Dataset.from_dict({"prompt": prompt_texts(32)}),
        value_model=None,
        callbacks=callbacks,
    )
