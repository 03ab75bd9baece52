"""Tiny PPO-max run under any accelerate engine (DDP, DeepSpeed ZeRO-2/3, FSDP2), for ``tests/test_engines.py``.

Usage (under ``accelerate launch --config_file recipes/accelerate/<engine>_cpu.yaml``)::

    engine_run.py OUTPUT_DIR [--stop-at K] [--resume] [--weight-decay W] [--critic-warmup N] [--no-ds3-gather]
                             [--fsdp-on-cpu] [--push-offline]

4 iterations of 16 prompts (2 processes × 4 prompts × 2 accumulation steps), fp32 on CPU, a checkpoint every
2 iterations. Each process writes ``OUTPUT_DIR/rank{r}.json``: the engine, ``global_step``, the running reward
moments, the counters, float64 checksums of the full (gathered) policy and critic weights at the start, after the
critic warm-up (end of iteration N, with Adam's step counts per model then) and at the end, the policy's logits on a fixed input (computed under the engine,
every process calling the forward) and the logged metrics; then the policy is saved to ``OUTPUT_DIR/policy``.
The main process also writes the engine's final critic weights (gathered) to ``OUTPUT_DIR/engine_critic.pt``.
Also the checksums when training begins (after a resume has loaded the checkpoint) and whether the trainer saves
engine checkpoints only (ZeRO-3 without ``stage3_gather_16bit_weights_on_model_save``).

``--push-offline``: ``push_to_hub`` to ``me/x`` with ``hub_strategy="checkpoint"``, every Hub call intercepted (nothing
leaves the machine); the uploads are recorded in ``rank0.json`` (``pushes``: commit message, ``path_in_repo``, files).

``--fsdp-on-cpu``: accelerate (≤ 1.15) enables FSDP only for GPU-like process groups; CPU processes get
``DistributedType.MULTI_CPU`` and the FSDP settings of the launcher are silently dropped (the run is DDP). This flag
presents the CPU (gloo) process group as ``MULTI_GPU`` to accelerate before the trainer builds its ``Accelerator``,
so that FSDP2 really shards the models on CPU (torch's ``fully_shard`` supports CPU and gloo).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import TrainerCallback

from trl_ppomax.models import sub_state_dict
from trl_ppomax.ppo.optim import adam_states

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/helpers.py
from helpers import engine_name, tiny_trainer

#: The fixed input whose logits the test compares with the saved model's.
FIXED_TEXT = "hello how are you today"


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--critic-warmup", type=int, default=0)
    parser.add_argument("--no-ds3-gather", action="store_true")
    parser.add_argument("--fsdp-on-cpu", action="store_true")
    parser.add_argument("--nan-grad-at", type=int, default=None, help="make the gradients of iteration K NaN")
    parser.add_argument("--max-tokens-per-microbatch", type=int, default=None)
    parser.add_argument("--samples-per-prompt", type=int, default=1)
    parser.add_argument("--push-offline", action="store_true")
    parser.add_argument("--estimator", default="gae", help="advantage_estimator (a critic-free one builds no critic)")
    return parser.parse_args()


def poison_gradients(trainer, iteration: int) -> None:
    """During iteration ``iteration`` every micro-batch loss is NaN (on every rank), so every gradient is, and each
    optimizer step of that iteration must be skipped and counted, whatever the engine."""
    loss_of = trainer.updater.micro_batch_loss

    def poisoned(*args, **kwargs):
        loss, stats = loss_of(*args, **kwargs)
        return (loss * float("nan") if trainer.state.global_step + 1 == iteration else loss), stats

    trainer.updater.micro_batch_loss = poisoned


def full_state(trainer) -> dict[str, torch.Tensor] | None:
    """The full (gathered) state dict of the policy + critic wrapper (on the main process; None elsewhere). A
    collective: every process must call it."""
    # accelerate refuses to gather then; the engine itself can (a test only)
    if trainer.checkpointer.engine_checkpoint_only:
        state = trainer.model_wrapped._zero3_consolidated_16bit_state_dict()
    else:
        state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    return state if trainer.accelerator.is_main_process else None


def checksums(trainer) -> dict[str, float] | None:
    """float64 sums of the full policy and critic weights (on the main process; None elsewhere). A collective: every
    process must call it."""
    return state_sums(full_state(trainer))


def state_sums(state: dict[str, torch.Tensor] | None) -> dict[str, float] | None:
    """float64 sums of the policy's and the critic's weights in ``state`` (None: not the main process)."""
    if state is None:
        return None
    sums = {"policy": 0.0, "critic": 0.0}
    for name, tensor in state.items():
        model = name.split(".", 1)[0]
        if model in sums:
            sums[model] += tensor.detach().double().sum().item()
    return sums


class Recorder(TrainerCallback):
    """Stops the run after iteration ``stop_at`` (a simulated pre-emption) and takes the weight checksums at the end
    of iteration ``warmup`` (the last critic-only iteration)."""

    def __init__(self, stop_at: int | None, warmup: int) -> None:
        self.stop_at, self.warmup = stop_at, warmup
        self.trainer = None
        self.at_train_begin = None
        self.after_warmup = None
        self.adam_steps_after_warmup = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.at_train_begin = checksums(self.trainer)  # after a resume loaded the checkpoint

    def on_step_end(self, args, state, control, **kwargs):
        if self.warmup and state.global_step == self.warmup:
            self.after_warmup = checksums(self.trainer)
            self.adam_steps_after_warmup = adam_steps(self.trainer)
        if self.stop_at is not None and state.global_step == self.stop_at:
            control.should_training_stop = True
        return control


def intercept_hub_calls() -> list[dict]:
    """Replace the HfApi methods the Trainer uses (nothing is uploaded); the uploads are recorded in the list."""
    import os
    from concurrent.futures import Future
    from types import SimpleNamespace

    from huggingface_hub import HfApi, RepoUrl

    pushes = []

    def create_repo(self, repo_id, **kwargs):
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, **kwargs):
        folder = Path(kwargs["folder_path"])
        files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        pushes.append({"commit_message": kwargs.get("commit_message"), "path_in_repo": kwargs.get("path_in_repo")})
        pushes[-1]["files"] = files
        done = Future()
        done.set_result(SimpleNamespace(commit_url="https://huggingface.co/me/x/commit/1"))
        return done

    HfApi.create_repo, HfApi.upload_folder = create_repo, upload_folder
    os.environ["HF_HUB_OFFLINE"] = "0"
    return pushes


def adam_steps(trainer) -> dict[str, int]:
    """How many steps Adam has counted for the policy's and the critic's parameters (its bias correction uses them)."""
    steps = {"policy": 0, "critic": 0}
    for model, state in adam_states(trainer.optimizer):
        if "step" in state:
            steps[model] = max(steps[model], int(state["step"]))
    return steps


def fixed_input_logits(trainer) -> torch.Tensor:
    """The policy's logits on :data:`FIXED_TEXT`, computed as the rollout does (under the engine, every process)."""
    from trl.models.utils import unwrap_model_for_generation

    ids = trainer.processing_class(FIXED_TEXT, return_tensors="pt")["input_ids"].to(trainer.accelerator.device)
    trainer.model.eval()
    with (
        torch.no_grad(),
        unwrap_model_for_generation(
            trainer.model_wrapped, trainer.accelerator, gather_deepspeed3_params=trainer.args.ds3_gather_for_generation
        ) as wrapper,
        fsdp_root_unsharded(trainer.model_wrapped),
    ):
        logits = wrapper.policy(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    trainer.model.train()
    return logits.float().cpu()


@contextmanager
def fsdp_root_unsharded(model):
    """Under FSDP2, the parameters of the root unit (``PolicyAndCritic``: embeddings, final norm, heads) gathered, so
    that ``model.policy`` can be called on its own (only the root's ``forward`` gathers them otherwise)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield
        return
    model._get_fsdp_state()._lazy_init()  # as the root's first forward would (a no-op after it)
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def main() -> None:
    options = parse()
    output = options.output_dir
    recorder = Recorder(options.stop_at, options.critic_warmup)
    pushes = intercept_hub_calls() if options.push_offline else []
    hub = dict(push_to_hub=True, hub_model_id="me/x", hub_strategy="checkpoint") if options.push_offline else {}
    trainer = tiny_trainer(
        output,
        callbacks=[recorder],
        fsdp_on_cpu=options.fsdp_on_cpu,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_mini_batches=1,
        num_ppo_epochs=2,
        total_episodes=64,  # 4 iterations of 2 processes × 4 prompts × 2 accumulation steps
        weight_decay=options.weight_decay,
        critic_warmup_steps=options.critic_warmup,
        save_strategy="steps",
        save_steps=2,
        ds3_gather_for_generation=not options.no_ds3_gather,
        max_tokens_per_microbatch=options.max_tokens_per_microbatch,
        num_samples_per_prompt=options.samples_per_prompt,
        advantage_estimator=options.estimator,
        **hub,
    )
    recorder.trainer = trainer
    if options.nan_grad_at is not None:
        poison_gradients(trainer, options.nan_grad_at)
    initial = checksums(trainer)
    trainer.train(resume_from_checkpoint=True if options.resume else None)
    state = full_state(trainer)
    final = state_sums(state)
    if state is not None:  # the engine's trained critic, which a consolidated value_model/ must hold
        torch.save(sub_state_dict(state, "critic."), output / "engine_critic.pt")
    logits = fixed_input_logits(trainer)
    accelerator = trainer.accelerator
    metrics = [entry for entry in trainer.state.log_history if "objective/kl" in entry]
    result = {
        "engine": engine_name(trainer),
        "wrapped": type(trainer.model_wrapped).__name__,
        "world_size": accelerator.num_processes,
        "rank": accelerator.process_index,
        "global_step": trainer.state.global_step,
        "moments": trainer.ppo_state.running_reward.state_dict(),
        "counters": dict(trainer.ppo_state.counters),
        "checksum_initial": initial,
        "checksum_at_train_begin": recorder.at_train_begin,
        "engine_checkpoint_only": trainer.checkpointer.engine_checkpoint_only,
        "checksum_after_warmup": recorder.after_warmup,
        "adam_steps_after_warmup": recorder.adam_steps_after_warmup,
        "checksum": final,
        "fixed_input": FIXED_TEXT,
        "logits": logits.tolist(),
        "logits_sum": logits.double().sum().item(),
        "metrics": metrics,
        "metrics_finite": all(
            math.isfinite(v) for entry in metrics for v in entry.values() if isinstance(v, int | float)
        ),
    }
    trainer.save_model(str(output / "policy"))  # with --push-offline it pushes too, as transformers' Trainer does
    result["pushes"] = pushes
    (output / f"rank{accelerator.process_index}.json").write_text(json.dumps(result))
    # Tear the process group down before exit: left to the interpreter's shutdown, a DeepSpeed process sometimes
    # aborts there ("terminate called without an active exception", SIGABRT) after everything was written.
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
