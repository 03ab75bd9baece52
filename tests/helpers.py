"""Helpers shared by the test modules, the launched ``tests/scripts`` and ``benchmarks/engine_memory_worker.py``: the
one tiny PPO-max trainer builder, which engine a trainer runs under, and parameter snapshots.

Import them with ``from helpers import ...`` (pytest puts ``tests/`` on ``sys.path``, as for ``conftest``; a launched
script puts it there itself). Tiny
models, tokenizers and prompts come from the package itself, :mod:`trl_ppomax.toyworld.tiny`; fixtures live in ``conftest``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from datasets import Dataset
from transformers import TrainerCallback

from trl_ppomax import PPOMaxConfig, PPOMaxTrainer
from trl_ppomax.toyworld.tiny import build_models, prompt_texts

__all__ = [
    "CONTEXT",
    "CPU",
    "SMOKE",
    "TINY",
    "TINY_RUN",
    "VOCAB",
    "PolicyVersions",
    "StopAt",
    "changed",
    "engine_name",
    "exit_code",
    "make_trainer",
    "no_rollout",
    "run_distributed",
    "snapshot",
    "tiny_trainer",
]

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

CONTEXT = 128  # max_position_embeddings of the tiny models
VOCAB = 49  # len(tokenizer) and the tiny models' embedding size
#: The least a config built in a test needs (no GPU, no bf16).
CPU = {"output_dir": "out", "bf16": False, "use_cpu": True}


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


def make_trainer(
    tmp_path,
    reward=None,
    value_model=None,
    ptx_dataset=None,
    dataset=None,
    peft_config=None,
    eval_dataset=None,
    arch="llama",
    *,
    output_dir=None,
    base=TINY,
    callbacks=None,
    fsdp_on_cpu=False,
    rollout_func=None,
    **overrides,
):
    """A :class:`PPOMaxTrainer` on the tiny ``arch`` models with the settings ``base`` (``overrides`` win), writing
    to ``output_dir`` (default ``tmp_path / "out"``); the reward model is the tiny one unless ``reward`` is given, the
    prompts ``prompt_texts(32)`` unless ``dataset`` is. ``fsdp_on_cpu``: :func:`let_fsdp_run_on_cpu`."""
    tokenizer, policy, reward_model = build_models(arch, seed=0)
    args = PPOMaxConfig(output_dir=str(output_dir or tmp_path / "out"), **{**base, **overrides})
    if fsdp_on_cpu:
        let_fsdp_run_on_cpu()  # after the config, which sets up the process state
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
        callbacks=callbacks,
        rollout_func=rollout_func,
    )


def tiny_trainer(output_dir, callbacks=None, fsdp_on_cpu: bool = False, **settings):
    """The launched scripts' trainer: :func:`make_trainer` with :data:`TINY_RUN` and ``settings``."""
    return make_trainer(
        None, output_dir=output_dir, base=TINY_RUN, callbacks=callbacks, fsdp_on_cpu=fsdp_on_cpu, **settings
    )


def engine_name(trainer) -> str:
    """``deepspeed-zero2``/``-zero3``, ``fsdp2``, ``ddp`` or ``single``: what the trainer actually runs under."""
    if trainer.is_deepspeed_enabled:
        return f"deepspeed-zero{trainer.model_wrapped.zero_optimization_stage()}"
    if trainer.is_fsdp_enabled:
        return f"fsdp{trainer.accelerator.state.fsdp_plugin.fsdp_version}"
    return "ddp" if trainer.accelerator.num_processes > 1 else "single"


def let_fsdp_run_on_cpu() -> None:
    """accelerate (1.15) enables FSDP only for GPU-type process groups and silently runs DDP on CPU processes;
    present the CPU (gloo) group as MULTI_GPU so that FSDP2 really shards. Call it after the config (which sets up
    the process state) and before the trainer."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    state = PartialState()
    if state.distributed_type == DistributedType.MULTI_CPU:
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


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


def run_distributed(*fns: Callable[[Callable], object]) -> list[object]:
    """Run ``fns[rank](reduce)`` in one thread per rank; ``reduce`` sums the tensor over all ranks (an all-reduce).

    Every rank sums the contributions in rank order, so all ranks receive bit-identical totals, as with NCCL.
    """
    world = len(fns)
    barrier = threading.Barrier(world, timeout=10)
    slots: list[torch.Tensor | None] = [None] * world
    calls = [0] * world

    def make_reduce(rank: int) -> Callable:
        def reduce(t: torch.Tensor) -> torch.Tensor:
            calls[rank] += 1
            slots[rank] = t.clone()
            barrier.wait()
            total = torch.stack(slots).sum(0)
            barrier.wait()  # nobody overwrites a slot before every rank has read all of them
            return total

        return reduce

    results: list[object] = [None] * world
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = fns[rank](make_reduce(rank))
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=target, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    real_errors = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real_errors or errors:
        raise (real_errors or errors)[0]
    assert len(set(calls)) == 1, f"ranks made different numbers of reduce calls: {calls}"
    return results


class PolicyVersions(TrainerCallback):
    """The policy's weights at every version of a run: ``versions[v]`` after ``v`` iterations (``copy()``: now)."""

    def __init__(self, trainer) -> None:
        self.policy = trainer.accelerator.unwrap_model(trainer.model).policy
        self.versions = [self.copy()]

    def copy(self) -> dict:
        return {name: p.detach().clone() for name, p in self.policy.state_dict().items()}

    def on_step_end(self, args, state, control, **kwargs):
        self.versions.append(self.copy())


def no_rollout(trainer, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a rollout started before the fault was reported")

    monkeypatch.setattr(trainer.rollouts, "written_by", refuse)  # every scored rollout, training or sampling
    return trainer


def exit_code(call) -> int:
    """The status ``call()`` returns, or exits with."""
    try:
        return call()
    except SystemExit as exit_:
        return 0 if exit_.code is None else exit_.code
