"""What a checkpoint must hold, and the refusals of one that cannot be resumed (missing, incomplete, damaged or from
other run settings), checked before the first rollout; each message names what to do."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from transformers import TrainerState
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_utils import get_last_checkpoint

from trl_ppomax.data.files import (
    CRITIC_DIR,
    PPO_STATE_NAME,
    checkpoint_number,
    file_problem,
    last_checkpoint_before,
    read_json,
    weight_files,
)

logger = logging.getLogger(__name__)

#: ``ppo_state.json`` keys a resume needs.
PPO_STATE_KEYS = ("episode", "running_reward", "counters", "ptx_batches_used")
#: Why plain weights are missing from the folder ``{path}`` that holds a ``latest`` file, and what to do.
_ENGINE_ONLY = (
    " — it holds only a sharded DeepSpeed engine checkpoint (global_step*/): resume it under DeepSpeed with the same "
    "ZeRO stage and number of processes, or write plain weights into it first with `trl-ppomax consolidate {path}` "
    "(trl_ppomax.ppo.engine_checkpoint.consolidate_engine_checkpoint)"
)


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, damaged or from other settings; the message names what to do."""


def checked_checkpoint(resume_from_checkpoint: str | bool, args, run_settings: dict, engine: str | None) -> str:
    """The checkpoint to resume (a path, or True for the newest in ``args.output_dir``), once it has been checked: its
    states readable, the run settings (``run_settings``, this run's) unchanged, no file missing, none damaged.
    ``engine``: "deepspeed", "fsdp" or None (what holds the optimizer). A :class:`CheckpointError` else."""
    if resume_from_checkpoint is True:
        path = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    else:
        path = os.fspath(resume_from_checkpoint)
    if path is None or not os.path.isfile(os.path.join(path, PPO_STATE_NAME)):
        raise CheckpointError(
            f"No complete trl-ppomax checkpoint at {path or args.output_dir!r}: expected a checkpoint-N folder "
            f"holding {PPO_STATE_NAME}. Pass the path of one, or resume_from_checkpoint=None to start over."
        )
    if not os.path.isfile(os.path.join(path, TRAINER_STATE_NAME)):
        raise CheckpointError(
            f"The checkpoint {path} is incomplete: missing {TRAINER_STATE_NAME}. Resume from a complete checkpoint."
        )
    saved = read_state_files(path)
    check_run_settings(path, saved.get("run"), run_settings, args.resume_allow_changes)
    for file in required_checkpoint_files(path, args, engine):
        problem = file_problem(file)
        if problem:
            raise CheckpointError(damaged_message(path, os.path.relpath(file, path), problem))
    return path


def read_state_files(path: str) -> dict:
    """``ppo_state.json`` (returned) and ``trainer_state.json`` of ``path``, checked to be readable and complete."""
    with reading(path, PPO_STATE_NAME):
        saved = read_json(os.path.join(path, PPO_STATE_NAME))
        if any(key not in saved for key in PPO_STATE_KEYS):
            raise ValueError(f"it must be a JSON object with the keys {list(PPO_STATE_KEYS)}")
    with reading(path, TRAINER_STATE_NAME):
        TrainerState.load_from_json(os.path.join(path, TRAINER_STATE_NAME))
    return saved


def check_run_settings(path: str, saved: dict | None, current: dict, allow_changes: bool) -> None:
    """Refuse (or, with ``allow_changes``, warn about) run settings that differ from the checkpoint's ``saved``.
    Settings ``saved`` lacks (a checkpoint of an earlier trl-ppomax) cannot be compared: a warning names them."""
    if saved is None:
        logger.warning(
            "%s predates stored run settings: cannot check that it was written with the same batch sizes, "
            "episodes, seed, dataset and models; resuming anyway.",
            path,
        )
        return
    unchecked = [name for name in current if name not in saved]
    if unchecked:  # a checkpoint of an earlier trl-ppomax, which did not store these yet
        logger.warning(
            "%s predates the stored run setting(s) %s: cannot check that they are the checkpoint's; resuming with "
            "this run's values (%s). Make sure they are the ones the run was started with.",
            path,
            ", ".join(unchecked),
            ", ".join(f"{name}={current[name]!r}" for name in unchecked),
        )
    changed = {name: (saved[name], current.get(name)) for name in saved if saved[name] != current.get(name)}
    if not changed:
        return
    lines = "\n".join(f"  {name}: checkpoint {old!r}, now {new!r}" for name, (old, new) in changed.items())
    message = f"The settings that define the run differ from those of the checkpoint {path}:\n{lines}\n"
    if allow_changes:
        logger.warning(
            "%sresume_allow_changes=True: resuming anyway; episode counts, the data order, the schedule and the "
            "learning rates follow the new settings.",
            message,
        )
        return
    raise CheckpointError(
        f"{message}Resume with the checkpoint's settings, set resume_allow_changes=True to continue with the new "
        "ones anyway (episode counts, the data order, the schedule and the learning rates then follow them), or start "
        "a fresh run in another output_dir."
    )


def required_checkpoint_files(path: str, args, engine: str | None) -> list[str]:
    """The files a resume from ``path`` reads (to check for damage); a CheckpointError naming the missing ones. With
    ``resume_weights_only`` only the weights (and the JSON states) are required. Under DeepSpeed the weights come from
    the engine checkpoint (:func:`engine_checkpoint_files`), so plain weight files are only checked when present."""
    missing, files = [], []
    if engine == "deepspeed":
        engine_files, engine_missing = engine_checkpoint_files(path, args.world_size)
        files += engine_files
        missing += engine_missing
    for folder in [path] + ([os.path.join(path, CRITIC_DIR)] if args.uses_critic else []):
        try:
            files += [os.fspath(f) for f in weight_files(folder)]
        except FileNotFoundError as err:
            if engine == "deepspeed":
                continue
            only_engine = folder == path and os.path.isfile(os.path.join(path, "latest"))
            why = _ENGINE_ONLY.format(path=path) if only_engine else ""
            missing.append(f"{os.path.relpath(folder, path)} weights ({err}){why}")
    if not args.resume_weights_only:
        needed = [SCHEDULER_NAME, *rng_files(args.world_size)]
        if engine == "fsdp":
            if not any(Path(path).glob("optimizer*")):
                missing.append("optimizer*")
        elif engine != "deepspeed":  # DeepSpeed's optimizer states are in its engine checkpoint, checked above
            needed.insert(0, OPTIMIZER_NAME)
        present = {name for name in needed if os.path.isfile(os.path.join(path, name))}
        files += [os.path.join(path, name) for name in needed if name in present]
        missing += [name for name in needed if name not in present]
    if missing:
        raise CheckpointError(
            f"The checkpoint {path} is incomplete: missing {'; '.join(missing)}. Resuming without these would "
            "silently restart Adam and the learning-rate schedule, or sample with other random numbers. Resume "
            "from a complete checkpoint, or set resume_weights_only=True to load only the weights and the PPO "
            "state (a fresh optimizer and schedule)."
        )
    return files


def engine_checkpoint_files(path: str, world_size: int) -> tuple[list[str], list[str]]:
    """The files of the DeepSpeed engine checkpoint in ``path`` a resume reads, and what of it is missing: ``latest``,
    the ``global_step*/`` it names, the model and (ZeRO) optimizer states of each of the ``world_size`` processes."""
    root = Path(path)
    latest = root / "latest"
    if not latest.is_file():
        return [], ["the DeepSpeed engine checkpoint (global_step*/ and its `latest` file: weights and optimizer)"]
    tag = latest.read_text(errors="replace").strip()
    folder = root / tag
    if not tag or not folder.is_dir():
        return [os.fspath(latest)], [f"the DeepSpeed engine folder {tag or '(empty)'}/ that `latest` names"]
    missing, files = [], [os.fspath(latest)]
    models, optims = sorted(folder.glob("*model_states.pt")), sorted(folder.glob("*optim_states.pt"))
    if not models:
        missing.append(f"{tag}/*model_states.pt")
    for kind, found in (("model states", models), ("optimizer states", optims)):
        ranks = {int(f.name.split("zero_pp_rank_")[1].split("_")[0]) for f in found if "zero_pp_rank_" in f.name}
        absent = [rank for rank in range(world_size) if rank not in ranks]
        if ranks and absent:  # one file per process (data-parallel rank)
            missing.append(f"{tag}/ {kind} of process(es) {absent}")
        files += [os.fspath(f) for f in found]
    return files, missing


def rng_files(world_size: int) -> list[str]:
    """The RNG-state files a checkpoint of ``world_size`` processes holds."""
    return ["rng_state.pth"] if world_size <= 1 else [f"rng_state_{i}.pth" for i in range(world_size)]


@contextmanager
def reading(checkpoint: str, what: str, loading: bool = False) -> Iterator[None]:
    """Turn a failure while reading ``what`` from ``checkpoint`` into a :class:`CheckpointError` naming it; with
    ``loading`` (the files passed the damage checks, loading them failed) it allows for other models or settings."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as err:
        reason = " ".join(str(err).split())[:300]
        raise CheckpointError(damaged_message(checkpoint, what, reason, loading)) from err


def damaged_message(checkpoint: str | os.PathLike, what: str, reason: str, loading: bool = False) -> str:
    previous = last_checkpoint_before(Path(checkpoint).parent, checkpoint_number(checkpoint))
    advice = (
        f"resume from the previous checkpoint instead: resume_from_checkpoint={str(previous)!r}"
        if previous
        else "resume from an earlier copy, or start over in a new output_dir"
    )
    if loading:
        return (
            f"Could not load {what} from the checkpoint {checkpoint} ({reason}): it is damaged (not written "
            f"completely, or changed since) or was written for other models or settings; {advice}."
        )
    return (
        f"The checkpoint {checkpoint} is damaged: {what} could not be read ({reason}). It was not written completely "
        f"(a crash or a full disk) or was changed since; {advice}."
    )
