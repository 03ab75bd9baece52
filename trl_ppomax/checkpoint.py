"""Checkpoint files: atomic folders, the policy/critic split of one state dict, and loading weights back.

Layout of ``checkpoint-N/``: the policy as a plain transformers (or PEFT adapter) folder at the top, so that
``from_pretrained("checkpoint-N")`` loads it; ``critic/`` with the critic; ``optimizer.pt``/``scheduler.pt`` (or a
DeepSpeed engine checkpoint); ``rng_state*.pth``; ``trainer_state.json``; ``ppo_state.json`` (counters, running
reward moments, data position).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

PPO_STATE_NAME = "ppo_state.json"
CRITIC_DIR = "critic"


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


def sub_state_dict(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Entries of ``state`` under ``prefix`` (e.g. ``"policy."``), with the prefix removed."""
    return {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}


def load_weights(module: nn.Module, folder: str | os.PathLike) -> None:
    """Load the safetensors (or PEFT adapter) weights saved by ``save_pretrained`` in ``folder`` into ``module``."""
    folder = Path(folder)
    if (folder / "adapter_model.safetensors").exists():
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(module, load_file(folder / "adapter_model.safetensors"))
        return
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"No *.safetensors weights in {folder}; is it a trl-ppomax checkpoint?")
    state = {}
    for file in files:
        state.update(load_file(file))
    missing, unexpected = module.load_state_dict(state, strict=False)
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
