"""Checkpoint files: the policy/critic split of one state dict, and loading weights back.

Layout of ``checkpoint-N/``: the policy as a plain transformers (or PEFT adapter) folder at the top, so that
``from_pretrained("checkpoint-N")`` loads it; ``critic/`` with the critic; ``optimizer.pt``/``scheduler.pt`` (or a
DeepSpeed engine checkpoint); ``rng_state*.pth``; ``trainer_state.json``; ``ppo_state.json`` (counters, running
reward moments, data position, and the settings that define the run). ``checkpoint-0`` is the initial policy, written
when its step-0 evaluation is the best so far and the best model must be loadable (``load_best_model_at_end`` or
``save_strategy="best"``); it is rotated, resumed and checked like any other.

What a run checks before its first rollout (:meth:`CheckpointMixin._start_run`), so that nothing is lost or mixed:
``output_dir`` is writable (at init); a trainer trains once; a fresh run does not reuse a folder holding another run's
checkpoints (unless ``overwrite_output_dir``); a checkpoint to resume is complete (unless ``resume_weights_only``),
undamaged, and was written with the same run settings (unless ``resume_allow_changes``). No file written here holds a
token: ``training_args.bin`` is written with every secret field cleared.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import logging
import os
import re
import shutil
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from transformers import PreTrainedModel, TrainerCallback, TrainerState
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_utils import (
    PREFIX_CHECKPOINT_DIR,
    HubStrategy,
    get_last_checkpoint,
    load_sharded_checkpoint,
    rotate_checkpoints,
)
from transformers.utils import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    PushInProgress,
)
from transformers.utils.hub import hf_api

from .files import (
    atomic_directory,
    checkpoint_folders,
    checkpoint_number,
    last_checkpoint_before,
    read_json,
    write_json,
)

logger = logging.getLogger(__name__)

PPO_STATE_NAME = "ppo_state.json"
CRITIC_DIR = "critic"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_WEIGHTS_BIN = "adapter_model.bin"
#: ``ppo_state.json`` keys a resume needs.
PPO_STATE_KEYS = ("episode", "running_reward", "counters", "ptx_batches_used")
#: Field names (or parts of them) that hold secrets; never written to disk.
SECRET_NAME = re.compile(r"(^|_)(token|api_key|password|secret)$")
NOT_SECRETS = frozenset({"stop_token"})


#: Files of a checkpoint's top level that a push during training does not copy into ``output_dir``.
PUSH_SKIPPED = ("optimizer*", "scheduler.pt", "scaler.pt", "rng_state*", TRAINER_STATE_NAME, PPO_STATE_NAME)


class _WaitForHubPush(TrainerCallback):
    """At the end of training, wait for the checkpoint pushes still in flight (as transformers' Trainer does)."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer._finish_current_push()


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed as it is: missing, incomplete, damaged, or from a run with other
    settings. The message names the file or the settings and what to do."""


# ----------------------------------------------------------------------------------------------------------------
# Folders
# ----------------------------------------------------------------------------------------------------------------
def probe_writable(folder: str | os.PathLike) -> None:
    """Create ``folder`` and write and delete a small file in it; a ValueError naming the folder if that fails, so
    that a run is not lost at its first or final save."""
    folder = Path(folder)
    probe = folder / f".trl-ppomax-write-test-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"trl-ppomax")
        probe.unlink()
    except OSError as err:
        raise ValueError(
            f"output_dir {str(folder)!r} is not writable ({type(err).__name__}: {err.strerror or err}); the run would "
            "be lost at its first save. Set output_dir to a folder you can write to, or fix its permissions."
        ) from err


# ----------------------------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------------------------
def weight_files(folder: str | os.PathLike) -> list[Path]:
    """The weight files of the model (or PEFT adapter) in ``folder``: one safetensors/bin file, or the shards a
    ``*.index.json`` lists. A FileNotFoundError naming what is missing when there are none or a shard is absent."""
    folder = Path(folder)
    for name in (ADAPTER_WEIGHTS, ADAPTER_WEIGHTS_BIN, SAFE_WEIGHTS_NAME, WEIGHTS_NAME):
        if (folder / name).is_file():
            return [folder / name]
    for index in (SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME):
        if (folder / index).is_file():
            try:
                shards = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                raise FileNotFoundError(f"{folder / index} is damaged ({err}); its shards cannot be found.") from err
            missing = [shard for shard in shards if not (folder / shard).is_file()]
            if missing:
                raise FileNotFoundError(f"{folder} lacks the weight shards {missing[:5]} listed in {index}.")
            return [folder / shard for shard in shards]
    raise FileNotFoundError(
        f"No weights in {folder}: none of {SAFE_WEIGHTS_NAME}, {SAFE_WEIGHTS_INDEX_NAME}, {WEIGHTS_NAME}, "
        f"{ADAPTER_WEIGHTS}."
    )


def file_problem(path: str | os.PathLike) -> str | None:
    """Why the file at ``path`` is unreadable (truncated, empty, not what its name says), or None if it looks whole.

    Cheap checks, never a full load: a safetensors header must cover the file exactly; a ``.pt``/``.pth``/``.bin``
    written by ``torch.save`` must be a zip archive with its central directory (what a truncation cuts off); a JSON
    file must parse to an object."""
    path = Path(path)
    try:
        if path.stat().st_size == 0:
            return "the file is empty"
        if path.suffix == ".safetensors":
            with safe_open(path, "pt"):
                pass
        elif path.suffix in (".pt", ".pth", ".bin"):
            if not zipfile.is_zipfile(path):
                return "not a complete torch.save archive (truncated?)"
        elif path.suffix == ".json" and not isinstance(json.loads(path.read_text(encoding="utf-8")), dict):
            return "not a JSON object"
    except Exception as err:  # any reason the file cannot be read is the answer
        return " ".join(f"{type(err).__name__}: {err}".split())
    return None


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
    if isinstance(module, PreTrainedModel):
        # through from_pretrained, which maps the saved names back (e.g. GPT-NeoX saves its head as embed_out)
        if not any((folder / name).exists() for name in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME)):
            raise FileNotFoundError(f"No {SAFE_WEIGHTS_NAME} in {folder}; is it a trl-ppomax checkpoint?")
        dtype = next(module.parameters()).dtype
        saved = type(module).from_pretrained(folder, dtype=dtype).state_dict()
        missing, unexpected = module.load_state_dict(saved, strict=False)
    elif (folder / SAFE_WEIGHTS_INDEX_NAME).exists():
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


def secret_fields(args) -> list[str]:
    """The names of the fields of ``args`` that hold a secret (``hub_token``, any ``*_token``/``*_api_key``/
    ``*_password``/``*_secret`` string field; not ``stop_token``) and are set."""
    return [
        name
        for name, value in vars(args).items()
        if SECRET_NAME.search(name) and name not in NOT_SECRETS and isinstance(value, str) and value
    ]


def without_secrets(args):
    """A shallow copy of the training arguments with every :func:`secret_fields` field set to None: what is
    written to ``training_args.bin``. ``args`` itself is not changed."""
    clean = copy.copy(args)
    for name in secret_fields(args):
        object.__setattr__(clean, name, None)
    return clean


def _parameter_count(module: nn.Module) -> int:
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())  # ZeRO-3 partitions report ds_numel


def model_identity(wrapper) -> dict:
    """What identifies the models of a run: the policy's ``_name_or_path`` and the parameter counts of policy and
    critic (counted before ``accelerator.prepare`` shards them)."""
    config = getattr(wrapper.policy, "config", None)
    return {
        "policy": getattr(config, "_name_or_path", None) or None,
        "policy_parameters": _parameter_count(wrapper.policy),
        "critic_parameters": _parameter_count(wrapper.critic),
    }


@contextmanager
def _reading(checkpoint: str, what: str, loading: bool = False) -> Iterator[None]:
    """Turn a failure while reading ``what`` from ``checkpoint`` into a :class:`CheckpointError` naming it. With
    ``loading`` (the files passed the damage checks; loading them into the models failed) the message also allows
    for a checkpoint written for other models or settings."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as err:
        reason = " ".join(str(err).split())[:300]
        raise CheckpointError(_damaged_message(checkpoint, what, reason, loading)) from err


def _damaged_message(checkpoint: str | os.PathLike, what: str, reason: str, loading: bool = False) -> str:
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


# ----------------------------------------------------------------------------------------------------------------
# The trainer side
# ----------------------------------------------------------------------------------------------------------------
class CheckpointMixin:
    """Save, resume and best-model loading of :class:`~trl_ppomax.PPOMaxTrainer` (mixed into it).

    The PPO state (``ppo_state.json``) is what ``TrainerState`` does not hold: the episode, the running reward
    moments, the skip counters, the ptx data position and the settings that define the run. Resuming restores it
    with the weights, the optimizer and scheduler and the RNG states, so a resumed run continues exactly as if it had
    never stopped; :meth:`_start_run` refuses, before the first rollout, whatever would make it otherwise.
    """

    #: Settings of ``args`` that define a run: a resume with other values would change the data order, the episode
    #: count or the schedule (``num_processes`` is ``world_size``).
    RUN_SETTINGS = (
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "num_mini_batches",
        "num_ppo_epochs",
        "world_size",
        "batch_size",
        "total_episodes",
        "num_total_batches",
        "seed",
        "data_seed",
        "preset",
    )

    def __init__(self, *args, **kwargs) -> None:
        training_args, model = kwargs.get("args"), kwargs.get("model")
        if training_args is not None and training_args.should_save:
            probe_writable(training_args.output_dir)
        self._model_identity = model_identity(model) if hasattr(model, "policy") else {}
        self._run_started = False
        self._resume_path: str | None = None
        super().__init__(*args, **kwargs)
        if self.args.push_to_hub:
            self.add_callback(_WaitForHubPush(self))  # end of training waits for the checkpoint pushes in flight

    # -- before the first rollout -----------------------------------------------------------------------------------
    def _start_run(self, resume_from_checkpoint: str | bool | None) -> None:
        """Everything ``train()`` checks before its first rollout: a trainer trains once; a fresh run does not mix
        with another run's checkpoints in ``output_dir``; a checkpoint to resume is complete, undamaged and from a
        run with the same settings (each refusal names the fix)."""
        if self._run_started:
            raise RuntimeError(
                f"train() was already called on this trainer (it reached iteration {self.state.global_step}); its "
                "model, optimizer and counters carry that run. To train again, build a new PPOMaxTrainer; to continue "
                "a stopped run, build a new PPOMaxTrainer and call train(resume_from_checkpoint=True) (or the path of "
                "a checkpoint)."
            )
        if resume_from_checkpoint:
            self._resume_path = self._checked_checkpoint(resume_from_checkpoint)
        else:
            self._claim_output_dir()
        self._run_started = True

    def _claim_output_dir(self) -> None:
        """Refuse a fresh run in an ``output_dir`` holding checkpoints, or (``overwrite_output_dir``) delete them."""
        args = self.args
        found = checkpoint_folders(args.output_dir)
        if not found:
            return
        names = ", ".join(p.name for p in found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        if not args.overwrite_output_dir:
            raise ValueError(
                f"output_dir {args.output_dir!r} already holds checkpoints of a run ({names}); a fresh run there would "
                "mix with them (rotation, resume). Pass train(resume_from_checkpoint=True) to continue that run, set "
                "overwrite_output_dir=True to delete them and start over, or choose another output_dir."
            )
        logger.warning(
            "overwrite_output_dir=True: deleting the checkpoints of the previous run in %s: %s.",
            args.output_dir,
            names,
        )
        if args.should_save:
            root = Path(args.output_dir)
            for path in [
                *found,
                *root.glob(f".tmp-{PREFIX_CHECKPOINT_DIR}-*"),
                *root.glob(f".old-{PREFIX_CHECKPOINT_DIR}-*"),
            ]:
                shutil.rmtree(path, ignore_errors=True)
        self.accelerator.wait_for_everyone()

    def _run_settings(self) -> dict:
        """The settings that define this run, stored in ``ppo_state.json`` and compared on resume."""
        settings = {name: getattr(self.args, name) for name in self.RUN_SETTINGS}
        settings["num_processes"] = settings.pop("world_size")
        settings["train_dataset_size"] = len(self.train_dataset)
        return {**settings, **self._model_identity}

    def _checked_checkpoint(self, resume_from_checkpoint: str | bool) -> str:
        """The checkpoint to resume (a path, or True for the newest in ``output_dir``), once it has been checked:
        its states readable, the run settings unchanged, no file missing, none damaged. A CheckpointError else."""
        args = self.args
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
        saved = self._read_state_files(path)
        self._check_run_settings(path, saved.get("run"))
        checked = self._required_files(path)
        for file in checked:
            problem = file_problem(file)
            if problem:
                raise CheckpointError(_damaged_message(path, os.path.relpath(file, path), problem))
        return path

    def _read_state_files(self, path: str) -> dict:
        """``ppo_state.json`` (returned) and ``trainer_state.json``, checked to be readable and complete."""
        with _reading(path, PPO_STATE_NAME):
            saved = read_json(os.path.join(path, PPO_STATE_NAME))
            if any(key not in saved for key in PPO_STATE_KEYS):
                raise ValueError(f"it must be a JSON object with the keys {list(PPO_STATE_KEYS)}")
        with _reading(path, TRAINER_STATE_NAME):
            TrainerState.load_from_json(os.path.join(path, TRAINER_STATE_NAME))
        return saved

    def _check_run_settings(self, path: str, saved: dict | None) -> None:
        if saved is None:
            logger.warning(
                "%s predates stored run settings: cannot check that it was written with the same batch sizes, "
                "episodes, seed, dataset and models; resuming anyway.",
                path,
            )
            return
        current = self._run_settings()
        changed = {name: (saved[name], current.get(name)) for name in saved if saved[name] != current.get(name)}
        if not changed:
            return
        lines = "\n".join(f"  {name}: checkpoint {old!r}, now {new!r}" for name, (old, new) in changed.items())
        message = f"The settings that define the run differ from those of the checkpoint {path}:\n{lines}\n"
        if self.args.resume_allow_changes:
            logger.warning(
                "%sresume_allow_changes=True: resuming anyway; episode counts, the data order and the schedule "
                "follow the new settings.",
                message,
            )
            return
        raise CheckpointError(
            f"{message}Resume with the checkpoint's settings, set resume_allow_changes=True to continue with the new "
            "ones anyway (episode counts, the data order and the schedule then follow them), or start a fresh run in "
            "another output_dir."
        )

    def _required_files(self, path: str) -> list[str]:
        """The files a resume from ``path`` reads (to check for damage); a CheckpointError naming the missing ones.
        With ``resume_weights_only`` only the weights (and the JSON states) are required."""
        missing, files = [], []
        for folder in (path, os.path.join(path, CRITIC_DIR)):
            try:
                files += [os.fspath(f) for f in weight_files(folder)]
            except FileNotFoundError as err:
                missing.append(f"{os.path.relpath(folder, path)} weights ({err})")
        if not self.args.resume_weights_only:
            needed = [SCHEDULER_NAME, *self._rng_files()]
            if self.is_deepspeed_enabled:
                if not any(Path(path).glob("global_step*")):
                    missing.append("the DeepSpeed engine folder global_step*/ (weights and optimizer)")
            elif self.is_fsdp_enabled:
                if not any(Path(path).glob("optimizer*")):
                    missing.append("optimizer*")
            else:
                needed.insert(0, OPTIMIZER_NAME)
            for name in needed:
                if os.path.isfile(os.path.join(path, name)):
                    files.append(os.path.join(path, name))
                else:
                    missing.append(name)
        if missing:
            raise CheckpointError(
                f"The checkpoint {path} is incomplete: missing {'; '.join(missing)}. Resuming without these would "
                "silently restart Adam and the learning-rate schedule, or sample with other random numbers. Resume "
                "from a complete checkpoint, or set resume_weights_only=True to load only the weights and the PPO "
                "state (a fresh optimizer and schedule)."
            )
        return files

    def _rng_files(self) -> list[str]:
        world = self.args.world_size
        return ["rng_state.pth"] if world <= 1 else [f"rng_state_{i}.pth" for i in range(world)]

    # -- saving -----------------------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the policy and tokenizer as a plain transformers (or PEFT adapter) folder, gathering the weights
        from every shard under DeepSpeed ZeRO-3 or FSDP.

        The files are written into ``<folder>/.tmp-save`` first and moved into the folder only once all are written
        (:func:`atomic_directory` with ``merge``): a crash or full disk leaves the folder as it was, and the
        ``checkpoint-N`` folders or logs beside the model are kept."""
        with atomic_directory(output_dir or self.args.output_dir, self.accelerator, merge=True) as folder:
            self._save_weights(folder, with_critic=False)
        if self.args.push_to_hub and not _internal_call:  # as transformers' Trainer: a user's save is pushed
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

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
        torch.save(without_secrets(self.args), os.path.join(folder, TRAINING_ARGS_NAME))  # never a token on disk

    def _save_checkpoint(self, model, trial) -> None:
        """Write ``checkpoint-N`` atomically: everything needed to continue the run exactly."""
        self._check_finite_weights()
        run_dir, step = self.args.output_dir, self.state.global_step
        final = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        if self.state.best_global_step is not None:  # 0 when the initial policy is the best so far
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
        if self.args.push_to_hub:
            self._push_from_checkpoint(final)
        if self.args.should_save:
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Push the policy of ``checkpoint_folder`` (and, with ``hub_strategy`` "checkpoint"/"all_checkpoints", the
        folder itself) to ``hub_model_id``, as transformers' Trainer does, in the background; the model card comes
        along, and ``training_args.bin`` is written without secrets."""
        if not self.is_world_process_zero() or self.args.hub_strategy == HubStrategy.END or self.hub_model_id is None:
            return
        if not self.args.hub_always_push and self.push_in_progress is not None and not self.push_in_progress.is_done():
            return
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        output_dir, source = self.args.output_dir, Path(checkpoint_folder)
        for entry in source.iterdir():  # the policy folder at the top of the checkpoint, not its internals
            if entry.is_file() and not any(fnmatch.fnmatch(entry.name, p) for p in PUSH_SKIPPED):
                shutil.copy(entry, os.path.join(output_dir, entry.name))
        torch.save(without_secrets(self.args), os.path.join(output_dir, TRAINING_ARGS_NAME))
        self.create_model_card()
        message = f"Training in progress, step {self.state.global_step}"
        jobs = [
            hf_api().upload_folder(
                repo_id=self.hub_model_id,
                folder_path=output_dir,
                commit_message=message,
                token=self.args.hub_token,
                run_as_future=True,
                ignore_patterns=["_*", ".*", f"{PREFIX_CHECKPOINT_DIR}-*"],
                revision=self.args.hub_revision,
            )
        ]
        if self.args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS):
            jobs.append(
                hf_api().upload_folder(
                    repo_id=self.hub_model_id,
                    folder_path=checkpoint_folder,
                    path_in_repo="last-checkpoint"
                    if self.args.hub_strategy == HubStrategy.CHECKPOINT
                    else source.name,
                    commit_message=f"{message}, checkpoint",
                    token=self.args.hub_token,
                    run_as_future=True,
                    revision=self.args.hub_revision,
                )
            )
        if self.push_in_progress is None or self.push_in_progress.is_done():
            self.push_in_progress = PushInProgress(jobs)
        else:
            self.push_in_progress.jobs.extend(jobs)

    def _ppo_state(self) -> dict:
        return {
            "global_step": self.state.global_step,
            "episode": self.state.episode,
            **self.ppo_state.state_dict(),
            "run": self._run_settings(),
        }

    def _check_finite_weights(self) -> None:
        wrapper = self.accelerator.unwrap_model(self.model_wrapped)
        bad = [name for name, p in wrapper.named_parameters() if p.numel() and not torch.isfinite(p).all()]
        if bad:
            raise RuntimeError(
                f"Refusing to write a checkpoint: non-finite weights in {bad[:3]}. Lower the learning rate or "
                "max_grad_norm, and resume from the last checkpoint."
            )

    # -- resuming ---------------------------------------------------------------------------------------------------
    def _resume(self, resume_from_checkpoint: str | bool) -> None:
        """Restore weights, optimizer, scheduler, counters, running moments, data position and RNG states from the
        checkpoint :meth:`_start_run` checked (or, called alone, from ``resume_from_checkpoint`` after checking it).
        With ``resume_weights_only`` the optimizer, scheduler and RNG states are not restored."""
        path = self._resume_path or self._checked_checkpoint(resume_from_checkpoint)
        weights_only = self.args.resume_weights_only
        with _reading(path, "the weights", loading=True):
            self._load_weights_from(path)
        if not weights_only:
            with _reading(path, f"{OPTIMIZER_NAME} / {SCHEDULER_NAME}", loading=True):
                self._load_optimizer_and_scheduler(path)
        planned = self.state  # this run's plan (max_steps …), which resume_allow_changes may have changed
        self.state = TrainerState.load_from_json(os.path.join(path, TRAINER_STATE_NAME))
        for name in ("max_steps", "num_train_epochs", "logging_steps", "eval_steps", "save_steps"):
            setattr(self.state, name, getattr(planned, name))
        saved = read_json(os.path.join(path, PPO_STATE_NAME))
        with _reading(path, PPO_STATE_NAME):
            self.state.episode = saved["episode"]
            self.ppo_state.load_state_dict(saved)
        if weights_only:
            logger.warning(
                "resume_weights_only=True: resumed the weights and PPO state of %s at iteration %d; the optimizer "
                "(Adam moments) and the learning-rate schedule restart from scratch and the sampling RNG is not "
                "restored.",
                path,
                self.state.global_step,
            )
        else:
            with _reading(path, "rng_state*.pth", loading=True):
                self._load_rng_state(path)
        logger.info("Resumed from %s at iteration %d.", path, self.state.global_step)

    def _load_weights_from(self, path: str) -> None:
        if self.is_deepspeed_enabled:  # the engine checkpoint holds the weights (and optimizer)
            from transformers.integrations.deepspeed import deepspeed_load_checkpoint

            deepspeed_load_checkpoint(self.model_wrapped, path)
            return
        if self.is_fsdp_enabled:  # sharded parameters: the FSDP checkpoint the Trainer wrote beside the weights
            from accelerate.utils import load_fsdp_model

            load_fsdp_model(self.accelerator.state.fsdp_plugin, self.accelerator, self.model_wrapped, path)
            return
        wrapper = self.accelerator.unwrap_model(self.model_wrapped)
        load_weights(wrapper.policy, path)
        load_weights(wrapper.critic, os.path.join(path, CRITIC_DIR))

    def _load_best_model(self) -> None:
        """Load the best checkpoint's weights (``load_best_model_at_end``), once a run has finished, and say which:
        a warning when it is ``checkpoint-0``, the initial policy that no later evaluation beat."""
        path = self.state.best_model_checkpoint
        if not (self.args.load_best_model_at_end and path):
            return
        self._load_weights_from(path)
        metric = self.args.metric_for_best_model
        metric = metric if metric.startswith("eval_") else f"eval_{metric}"
        if checkpoint_number(path) == 0:
            logger.warning(
                "load_best_model_at_end: the best model is the initial policy (step 0, before any update): no later "
                "evaluation beat its %s = %.6g. The trainer now holds the initial (SFT) weights of %s, not trained "
                "ones.",
                metric,
                self.state.best_metric,
                path,
            )
        else:
            logger.info(
                "load_best_model_at_end: loaded the best model, %s (%s = %.6g).", path, metric, self.state.best_metric
            )
