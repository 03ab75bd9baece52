"""Checkpoint files: atomic folders, the policy/critic split of one state dict, and loading weights back.

Layout of ``checkpoint-N/``: the policy as a plain transformers (or PEFT adapter) folder at the top, so that
``from_pretrained("checkpoint-N")`` loads it; ``critic/`` with the critic; ``optimizer.pt``/``scheduler.pt`` (or a
DeepSpeed engine checkpoint); ``rng_state*.pth``; ``trainer_state.json``; ``ppo_state.json`` (counters, running
reward moments, data position).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import TrainerState
from transformers.trainer import TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_utils import (
    PREFIX_CHECKPOINT_DIR,
    get_last_checkpoint,
    load_sharded_checkpoint,
    rotate_checkpoints,
)
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

logger = logging.getLogger(__name__)

PPO_STATE_NAME = "ppo_state.json"
CRITIC_DIR = "critic"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@contextmanager
def atomic_directory(final: str | os.PathLike, accelerator=None) -> Iterator[str]:
    """Yield a temporary sibling folder ``.tmp-<name>`` to write into; rename it to ``final`` once the block (on every
    process, when an ``accelerator`` is given) has finished. The one place trl-ppomax publishes a folder.

    A crash while writing leaves only ``.tmp-<name>``, which is never mistaken for the real folder and is removed by
    the next write of the same folder; an exception removes it at once. An existing ``final`` is replaced only after
    the new folder is complete.
    """
    final = Path(final)
    temporary = final.with_name(f".tmp-{final.name}")
    is_main = accelerator is None or accelerator.is_main_process
    barrier = accelerator.wait_for_everyone if accelerator is not None else (lambda: None)
    if is_main:
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
    barrier()
    try:
        yield str(temporary)
    except BaseException:
        if is_main:
            shutil.rmtree(temporary, ignore_errors=True)
        raise
    barrier()
    if is_main:
        retired = final.with_name(f".old-{final.name}")
        shutil.rmtree(retired, ignore_errors=True)
        if final.exists():
            os.replace(final, retired)  # kept until the new folder is in place
        os.replace(temporary, final)
        shutil.rmtree(retired, ignore_errors=True)
    barrier()


def checkpoint_number(path: str | os.PathLike) -> int | None:
    """``N`` for a folder named exactly ``checkpoint-N`` (as transformers writes it), else None."""
    number = Path(path).name.removeprefix(f"{PREFIX_CHECKPOINT_DIR}-")
    return int(number) if number.isdecimal() and number != Path(path).name else None


def sub_state_dict(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Entries of ``state`` under ``prefix`` (e.g. ``"policy."``), with the prefix removed."""
    return {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}


def load_weights(module: nn.Module, folder: str | os.PathLike) -> None:
    """Load the weights ``save_pretrained`` wrote in ``folder`` (one safetensors file, a sharded index, or a PEFT
    adapter) into ``module``; tied weights may be absent, anything else missing or unexpected is an error."""
    folder = Path(folder)
    if (folder / ADAPTER_WEIGHTS).exists():
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(module, load_file(folder / ADAPTER_WEIGHTS))
        return
    if (folder / SAFE_WEIGHTS_INDEX_NAME).exists():
        missing, unexpected = load_sharded_checkpoint(module, folder, strict=False)  # one shard in memory at a time
    else:
        if not (folder / SAFE_WEIGHTS_NAME).exists():
            raise FileNotFoundError(f"No {SAFE_WEIGHTS_NAME} in {folder}; is it a trl-ppomax checkpoint?")
        missing, unexpected = module.load_state_dict(load_file(folder / SAFE_WEIGHTS_NAME), strict=False)
    tied = set(getattr(module, "all_tied_weights_keys", None) or getattr(module, "_tied_weights_keys", None) or [])
    missing = [key for key in missing if key not in tied]
    if missing or unexpected:
        raise ValueError(
            f"The weights in {folder} do not match {type(module).__name__}: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}. Resume with the same model architecture the checkpoint was written with."
        )


def write_json(path: str | os.PathLike, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=True))


def read_json(path: str | os.PathLike) -> dict:
    return json.loads(Path(path).read_text())


class CheckpointMixin:
    """Save, resume and best-model loading of :class:`~trl_ppomax.PPOMaxTrainer` (mixed into it).

    The PPO state (``ppo_state.json``) is what ``TrainerState`` does not hold: the episode, the running reward
    moments, the skip counters and the ptx data position. Resuming restores it with the weights, the optimizer and
    scheduler and the RNG states, so a resumed run continues exactly as if it had never stopped.
    """

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the policy and tokenizer as a plain transformers (or PEFT adapter) folder, gathering the weights
        from every shard under DeepSpeed ZeRO-3 or FSDP."""
        self._save_weights(output_dir or self.args.output_dir, with_critic=False)

    def _save_weights(self, folder: str, with_critic: bool) -> None:
        try:
            state = self.accelerator.get_state_dict(self.model_wrapped)  # a collective under ZeRO-3 / FSDP
        except ValueError as error:
            raise ValueError(
                f"Could not gather the full weights to save them: {error}. Under DeepSpeed ZeRO-3 set "
                "`zero3_save_16bit_model: true` in the accelerate config."
            ) from error
        if not self.args.should_save:
            return
        wrapper = self.accelerator.unwrap_model(self.model_wrapped)
        wrapper.policy.save_pretrained(folder, state_dict=sub_state_dict(state, "policy."))
        if with_critic:
            wrapper.critic.save_pretrained(
                os.path.join(folder, CRITIC_DIR), state_dict=sub_state_dict(state, "critic.")
            )
        self.processing_class.save_pretrained(folder)
        torch.save(self.args, os.path.join(folder, TRAINING_ARGS_NAME))

    def _save_checkpoint(self, model, trial) -> None:
        """Write ``checkpoint-N`` atomically: everything needed to continue the run exactly."""
        self._check_finite_weights()
        run_dir, step = self.args.output_dir, self.state.global_step
        final = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        if self.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if self.state.best_global_step == step or os.path.isdir(best):
                self.state.best_model_checkpoint = best
        with atomic_directory(final, self.accelerator) as folder:
            self._save_weights(folder, with_critic=True)
            if not self.args.save_only_model:
                self._save_optimizer_and_scheduler(folder)
                self._save_rng_state(folder)
            if self.args.should_save:
                self.state.save_to_json(os.path.join(folder, TRAINER_STATE_NAME))
                write_json(os.path.join(folder, PPO_STATE_NAME), self._ppo_state())
        if self.args.should_save:
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint)

    def _ppo_state(self) -> dict:
        return {
            "global_step": self.state.global_step,
            "episode": self.state.episode,
            "running_reward": self.running_reward.state_dict(),
            "counters": dict(self.counters),
            "ptx_batches_used": self.ptx_batches_used,
        }

    def _check_finite_weights(self) -> None:
        wrapper = self.accelerator.unwrap_model(self.model_wrapped)
        bad = [name for name, p in wrapper.named_parameters() if p.numel() and not torch.isfinite(p).all()]
        if bad:
            raise RuntimeError(
                f"Refusing to write a checkpoint: non-finite weights in {bad[:3]}. Lower the learning rate or "
                "max_grad_norm, and resume from the last checkpoint."
            )

    def _resume(self, resume_from_checkpoint: str | bool) -> None:
        """Restore weights, optimizer, scheduler, counters, running moments, data position and RNG states."""
        path = get_last_checkpoint(self.args.output_dir) if resume_from_checkpoint is True else resume_from_checkpoint
        if path is None or not os.path.isfile(os.path.join(path, PPO_STATE_NAME)):
            raise ValueError(
                f"No complete trl-ppomax checkpoint at {path or self.args.output_dir!r}: expected a checkpoint-N "
                f"folder holding {PPO_STATE_NAME}. Pass the path of one, or resume_from_checkpoint=None to start over."
            )
        self._load_weights_from(path)
        self._load_optimizer_and_scheduler(path)
        self.state = TrainerState.load_from_json(os.path.join(path, TRAINER_STATE_NAME))
        saved = read_json(os.path.join(path, PPO_STATE_NAME))
        self.state.episode = saved["episode"]
        self.running_reward.load_state_dict(saved["running_reward"])
        self.counters.update(saved["counters"])
        self.ptx_batches_used = saved["ptx_batches_used"]
        self._load_rng_state(path)
        logger.info("Resumed from %s at iteration %d.", path, self.state.global_step)

    def _load_weights_from(self, path: str) -> None:
        if self.is_deepspeed_enabled:  # the engine checkpoint holds the weights (and optimizer)
            from transformers.integrations.deepspeed import deepspeed_load_checkpoint

            deepspeed_load_checkpoint(self.model_wrapped, path)
            return
        wrapper = self.accelerator.unwrap_model(self.model_wrapped)
        load_weights(wrapper.policy, path)
        load_weights(wrapper.critic, os.path.join(path, CRITIC_DIR))

    def _load_best_model(self) -> None:
        """Load the best checkpoint's weights (``load_best_model_at_end``), once a run has finished."""
        if self.args.load_best_model_at_end and self.state.best_model_checkpoint:
            self._load_weights_from(self.state.best_model_checkpoint)
