"""Saving, resuming and the best model of :class:`~trl_ppomax.PPOMaxTrainer`, on top of transformers' ``Trainer``
(optimizer, scheduler, RNG and trainer states, checkpoint rotation): the policy/critic split of one state dict, the
PPO state (:class:`~trl_ppomax.ppo.state.PPOState`) and the run's settings.

``checkpoint-N/``: the policy as a plain transformers (or PEFT adapter) folder at the top; ``critic/``;
``optimizer.pt``/``scheduler.pt`` (or a DeepSpeed engine checkpoint); ``rng_state*.pth``; ``trainer_state.json``;
``ppo_state.json``. ``checkpoint-0``, the initial policy, is written when its step-0 evaluation is the best so far.

Under ZeRO-3 without ``stage3_gather_16bit_weights_on_model_save`` the full weights are never gathered (as in
transformers' ``Trainer``): checkpoints and ``save_model`` hold the engine's sharded checkpoint (``global_step*/``),
the configs and the tokenizer; :mod:`~trl_ppomax.ppo.engine_checkpoint` writes them and turns them into plain
folders (``trl-ppomax consolidate``).

Before the first rollout (:meth:`Checkpointer.claim_run`, refusals in :mod:`~trl_ppomax.ppo.checkpoint_files`): a
trainer trains once; one run at a time holds ``output_dir`` (a lock file); a fresh run does not reuse another run's
checkpoints (unless ``overwrite_output_dir``); a checkpoint to resume is complete (unless ``resume_weights_only``),
undamaged and from the same run settings (unless ``resume_allow_changes``). ``training_args.bin`` holds no secrets.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import TrainerCallback, TrainerState
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, HubStrategy, rotate_checkpoints
from transformers.utils import PushInProgress
from transformers.utils.hub import hf_api

from trl_ppomax.base import compat
from trl_ppomax.data.files import (
    CRITIC_DIR,
    PPO_STATE_NAME,
    VALUE_MODEL_DIR,
    DiskFullError,
    OutputDirInUse,
    atomic_directory,
    checkpoint_folders,
    checkpoint_number,
    lock_output_dir,
    read_json,
    unlock_output_dir,
    write_json,
)
from trl_ppomax.models import load_weights, sub_state_dict
from trl_ppomax.ppo import checkpoint_files, engine_checkpoint, optim
from trl_ppomax.ppo.engine_checkpoint import consolidate_engine_checkpoint  # noqa: F401 (its former home)
from trl_ppomax.ppo.state import PPOState
from trl_ppomax.reporting.hub import TAGS, create_model_card, without_secrets

logger = logging.getLogger(__name__)


#: Files of a checkpoint's top level that a push during training does not copy into ``output_dir`` (DeepSpeed's
#: ``latest`` and recovery scripts belong to its engine folder).
PUSH_SKIPPED = (
    "optimizer*",
    "scheduler.pt",
    "scaler.pt",
    "rng_state*",
    TRAINER_STATE_NAME,
    PPO_STATE_NAME,
    "latest",
    "zero_to_*.py",
)


class _OnTrainEnd(TrainerCallback):
    """Calls ``action`` at the end of training (wait for the Hub pushes in flight, release the ``output_dir`` lock)."""

    def __init__(self, action: Callable[[], None]) -> None:
        self.action = action

    def on_train_end(self, args, state, control, **kwargs):
        self.action()


# -- The trainer side --------------------------------------------------------------------------------------------------
class Checkpointer:
    """Save, resume and best-model loading of a :class:`~trl_ppomax.PPOMaxTrainer`: a resumed run continues exactly
    as if it had never stopped.

    Args:
        trainer: the transformers ``Trainer`` whose run this saves and restores, through its public state (``args``,
            ``state``, ``accelerator``, ``model_wrapped``, ``processing_class``, the Hub push in flight, the
            callbacks) and, for the optimizer, scheduler and RNG files, transformers' own writers and readers
            (:mod:`~trl_ppomax.base.compat`); ``trainer.push_to_hub`` and ``save_model`` are called as users call them.
        ppo_state: what a resume restores beyond ``TrainerState`` (:class:`~trl_ppomax.ppo.state.PPOState`).
        producer: the producer of rollouts generated ahead (``max_staleness`` ≥ 1; its queue is saved), else None.
        model_identity: the models' identity (:func:`~trl_ppomax.models.model_identity`), a run setting.

    Public surface: :meth:`claim_run` and :meth:`restore_checkpoint` (``train()``'s start), :meth:`save_checkpoint`,
    :meth:`save_model`, :meth:`push_engine_checkpoint`, :meth:`create_model_card`, :meth:`load_best_model`,
    :meth:`unlock_output_dir`, :attr:`engine_checkpoint_only`. The output-dir lock is released at the end of
    training (a callback added here), after the Hub pushes in flight."""

    #: Settings of ``args`` that define a run: a resume with other values would change which prompts an iteration
    #: reads (the prompt stream, :class:`~trl_ppomax.data.ShuffledBatches`, takes ``batch_size ÷
    #: num_samples_per_prompt`` prompts per iteration over the processes, shuffled by ``data_seed`` or ``seed``), the
    #: episode count or the schedule (``num_processes`` is ``world_size``).
    RUN_SETTINGS = (
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "num_mini_batches",
        "num_samples_per_prompt",
        "num_ppo_epochs",
        "update_epochs",
        "max_staleness",
        "world_size",
        "batch_size",
        "total_episodes",
        "num_total_batches",
        "seed",
        "data_seed",
        "preset",
        "learning_rate",
        "effective_critic_learning_rate",
    )

    def __init__(self, *, trainer, ppo_state: PPOState, producer, model_identity: dict) -> None:
        self.trainer, self.ppo_state, self.producer, self.model_identity = trainer, ppo_state, producer, model_identity
        self.run_started = False
        self.resume_path: str | None = None
        self.lock_owner = object()  # this trainer's token for the output_dir lock
        self.warned_no_model_push = False
        if trainer.args.push_to_hub:  # as transformers' Trainer does
            trainer.add_callback(_OnTrainEnd(functools.partial(compat.finish_current_push, trainer)))
        trainer.add_callback(_OnTrainEnd(self.unlock_output_dir))

    # -- before the first rollout -----------------------------------------------------------------------------------
    def claim_run(self, resume_from_checkpoint: str | bool | None) -> None:
        """``train()``'s checks before its first rollout (see the module docstring); each refusal names the fix."""
        if self.run_started:
            raise RuntimeError(
                f"train() was already called on this trainer (it reached iteration {self.trainer.state.global_step}); its "
                "model, optimizer and counters carry that run. To train again, build a new PPOMaxTrainer; to continue "
                "a stopped run, build a new PPOMaxTrainer and call train(resume_from_checkpoint=True) (or the path of "
                "a checkpoint)."
            )
        self._lock_output_dir()
        try:
            if resume_from_checkpoint:
                self.resume_path = self._checked_checkpoint(resume_from_checkpoint)
            else:
                self._claim_output_dir()
        except BaseException:
            self.unlock_output_dir()
            raise
        self.run_started = True
        if self.engine_checkpoint_only and self.trainer.is_world_process_zero():
            engine_checkpoint.warn_at_start()

    @property
    def engine_checkpoint_only(self) -> bool:
        """Whether saves write the engine's sharded checkpoint, not plain weights
        (:func:`~trl_ppomax.ppo.engine_checkpoint.saves_engine_checkpoint_only`)."""
        return self.trainer.is_deepspeed_enabled and engine_checkpoint.saves_engine_checkpoint_only(
            self.trainer.model_wrapped
        )

    def _lock_output_dir(self) -> None:
        """One run per ``output_dir``: the main process holds its lock (:func:`~trl_ppomax.data.files.lock_output_dir`)
        from here to the end of ``train()`` (or the process); every process raises when another run holds it."""
        from accelerate.utils import broadcast_object_list

        refused = None
        if self.trainer.is_world_process_zero() and self.trainer.args.should_save:
            try:
                lock_output_dir(self.trainer.args.output_dir, self.lock_owner)
            except OutputDirInUse as err:
                refused = str(err)
        refused = broadcast_object_list([refused])[0]
        if refused:
            raise OutputDirInUse(refused)

    def unlock_output_dir(self) -> None:
        if self.trainer.is_world_process_zero():
            unlock_output_dir(self.trainer.args.output_dir, self.lock_owner)

    def _claim_output_dir(self) -> None:
        """Refuse a fresh run in an ``output_dir`` holding checkpoints, or (``overwrite_output_dir``) delete them."""
        args = self.trainer.args
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
            partial = [p for kind in (".tmp", ".old") for p in root.glob(f"{kind}-{PREFIX_CHECKPOINT_DIR}-*")]
            for path in [*found, *partial]:
                shutil.rmtree(path, ignore_errors=True)
        self.trainer.accelerator.wait_for_everyone()

    def _run_settings(self) -> dict:
        """The settings that define this run, stored in ``ppo_state.json`` and compared on resume."""
        settings = {name: getattr(self.trainer.args, name) for name in self.RUN_SETTINGS}
        settings["num_processes"] = settings.pop("world_size")
        settings["train_dataset_size"] = len(self.trainer.train_dataset)
        return {**settings, **self.model_identity}

    def _checked_checkpoint(self, resume_from_checkpoint: str | bool) -> str:
        """:func:`checkpoint_files.checked_checkpoint` for this run's settings and engine."""
        engine = "deepspeed" if self.trainer.is_deepspeed_enabled else "fsdp" if self.trainer.is_fsdp_enabled else None
        return checkpoint_files.checked_checkpoint(
            resume_from_checkpoint, self.trainer.args, self._run_settings(), engine
        )

    # -- saving -----------------------------------------------------------------------------------------------------
    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None, tags=None, **_):
        """README.md in ``output_dir``: the policy's base model, tags, PPO-max settings, final evaluation numbers,
        tracker URLs and the paper's citation (:func:`trl_ppomax.reporting.hub.create_model_card`)."""
        if not self.trainer.is_world_process_zero():
            return
        trainer = self.trainer
        policy = trainer.accelerator.unwrap_model(trainer.model).policy
        card = create_model_card(
            policy, trainer.args, trainer.hub_model_id, model_name, dataset_name, tags, TAGS, trainer.state.log_history
        )
        card.save(f"{trainer.args.output_dir}/README.md")

    def save_model(self, output_dir: str | None = None, push: bool = False) -> None:
        """Save the policy and tokenizer as a plain transformers (or PEFT adapter) folder, and with
        ``save_value_model`` the critic and tokenizer in its ``value_model/`` (``AutoModelForSequenceClassification``
        loads it; ``value_model=`` warm-starts a run from it), gathered from every shard under ZeRO-3 or FSDP,
        atomically (a crash or full disk leaves the folder as it was; ``checkpoint-N`` beside it is kept); a
        ``value_model/`` of an earlier save that this one does not replace is removed, with a warning. Under
        :attr:`_engine_checkpoint_only` the folder gets DeepSpeed's sharded engine checkpoint instead, and a warning
        says how to consolidate it. A collective: every process calls it."""
        final = output_dir or self.trainer.args.output_dir
        engine_only = self.engine_checkpoint_only
        with_critic = (
            self.trainer.args.save_value_model
            and self.trainer.accelerator.unwrap_model(self.trainer.model_wrapped).critic is not None
        )
        if (
            not with_critic
            and self.trainer.is_world_process_zero()
            and os.path.isdir(os.path.join(final, VALUE_MODEL_DIR))
        ):
            logger.warning(
                "save_model: removing %s/%s, an earlier save's critic: this save writes none (%s), and that critic "
                "does not belong to the new policy.",
                final,
                VALUE_MODEL_DIR,
                "save_value_model=False" if self.trainer.args.uses_critic else "this run has no critic",
            )
        # value_model/ belongs to the save: one this save does not write goes with the merge (not the new policy)
        with atomic_directory(final, self.trainer.accelerator, merge=True, owned=(VALUE_MODEL_DIR,)) as folder:
            self._save_weights(folder, VALUE_MODEL_DIR if with_critic else None, write_engine=engine_only)
        if engine_only and self.trainer.is_world_process_zero():
            engine_checkpoint.warn_saved(final)
        if push:  # as transformers' Trainer: a user's save is pushed
            self.trainer.push_to_hub(commit_message="Model save", revision=self.trainer.args.hub_revision)

    def push_engine_checkpoint(self) -> None:
        """``push_to_hub`` under :attr:`engine_checkpoint_only`: ``output_dir`` is saved and a warning says how to
        consolidate and push it, but nothing is uploaded (there is no plain model)."""
        self.trainer.save_model(_internal_call=True)
        if self.trainer.is_world_process_zero():
            hub_model_id = self.trainer.hub_model_id or self.trainer.args.hub_model_id
            engine_checkpoint.warn_not_pushed(self.trainer.args.output_dir, hub_model_id)

    def _save_weights(self, folder: str, critic_dir: str | None, write_engine: bool = False) -> None:
        """The policy (and, in ``folder/critic_dir``, critic) weights, configs and tokenizer; a collective. Under
        :attr:`_engine_checkpoint_only` only the configs: ``write_engine`` also writes the engine's checkpoint."""
        if self.engine_checkpoint_only:
            if write_engine:
                self.trainer.model_wrapped.save_checkpoint(
                    folder
                )  # every process writes its shard of weights and optimizer
            if self.trainer.args.should_save:
                wrapper = self.trainer.accelerator.unwrap_model(self.trainer.model_wrapped)
                engine_checkpoint.save_configs(wrapper, folder, critic_dir, self.trainer.processing_class)
                self._save_tokenizer_and_args(folder)
            return
        try:
            state = self.trainer.accelerator.get_state_dict(
                self.trainer.model_wrapped
            )  # a collective under ZeRO-3 / FSDP
        except ValueError as error:
            raise ValueError(
                f"Could not gather the full weights to save them: {error}. Under DeepSpeed ZeRO-3 set "
                "`zero3_save_16bit_model: true` in the accelerate config."
            ) from error
        if not self.trainer.args.should_save:
            return
        wrapper = self.trainer.accelerator.unwrap_model(self.trainer.model_wrapped)
        wrapper.policy.save_pretrained(folder, state_dict=sub_state_dict(state, "policy."))
        if critic_dir and wrapper.critic is not None:
            critic_folder = os.path.join(folder, critic_dir)
            wrapper.critic.save_pretrained(critic_folder, state_dict=sub_state_dict(state, "critic."))
            if critic_dir == VALUE_MODEL_DIR:  # a model of its own: loadable with its tokenizer
                self.trainer.processing_class.save_pretrained(critic_folder)
        self._save_tokenizer_and_args(folder)

    def _save_tokenizer_and_args(self, folder: str) -> None:
        self.trainer.processing_class.save_pretrained(folder)
        torch.save(
            without_secrets(self.trainer.args), os.path.join(folder, TRAINING_ARGS_NAME)
        )  # never a token on disk

    def save_checkpoint(self) -> None:
        """Write ``checkpoint-N`` atomically: everything needed to continue the run exactly."""
        self._check_finite_weights()
        run_dir, step = self.trainer.args.output_dir, self.trainer.state.global_step
        final = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        if self.trainer.state.best_global_step is not None:  # 0 when the initial policy is the best so far
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.trainer.state.best_global_step}")
            if self.trainer.state.best_global_step == step or os.path.isdir(best):
                self.trainer.state.best_model_checkpoint = best
        try:
            with atomic_directory(final, self.trainer.accelerator) as folder:
                # engine-only saves: the engine folder holds the weights; _save_optimizer_and_scheduler writes it
                self._save_weights(folder, CRITIC_DIR, write_engine=self.trainer.args.save_only_model)
                if not self.trainer.args.save_only_model:
                    compat.save_optimizer_and_scheduler(self.trainer, folder)
                    compat.save_rng_state(self.trainer, folder)
                if self.trainer.args.should_save:
                    self.trainer.state.save_to_json(os.path.join(folder, TRAINER_STATE_NAME))
                    write_json(os.path.join(folder, PPO_STATE_NAME), self._ppo_state())
                if self.producer is not None:  # the rollouts generated ahead, not yet trained on
                    self.producer.save(folder, self.trainer.accelerator.process_index)
        except DiskFullError as err:
            raise DiskFullError(
                f"{err} Training stopped at iteration {step}; the checkpoints written before are complete: once there "
                "is space, continue the run with train(resume_from_checkpoint=True)."
            ) from err.__cause__
        if self.trainer.args.push_to_hub:
            self._push_from_checkpoint(final)
        if self.trainer.args.should_save:
            rotate_checkpoints(run_dir, self.trainer.args.save_total_limit, self.trainer.state.best_model_checkpoint)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Push the policy of ``checkpoint_folder`` with its model card (and, with ``hub_strategy`` "checkpoint" or
        "all_checkpoints", the folder itself) to ``hub_model_id`` in the background, as transformers' Trainer does."""
        if (
            not self.trainer.is_world_process_zero()
            or self.trainer.args.hub_strategy == HubStrategy.END
            or self.trainer.hub_model_id is None
        ):
            return
        if (
            not self.trainer.args.hub_always_push
            and self.trainer.push_in_progress is not None
            and not self.trainer.push_in_progress.is_done()
        ):
            return
        with_checkpoint = self.trainer.args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS)
        if self.engine_checkpoint_only and not with_checkpoint:
            self._warn_no_model_push()
            return
        self.trainer.callback_handler.on_push_begin(self.trainer.args, self.trainer.state, self.trainer.control)
        output_dir, source = self.trainer.args.output_dir, Path(checkpoint_folder)
        message = f"Training in progress, step {self.trainer.state.global_step}"
        upload = functools.partial(
            hf_api().upload_folder,
            repo_id=self.trainer.hub_model_id,
            token=self.trainer.args.hub_token,
            run_as_future=True,
            revision=self.trainer.args.hub_revision,
        )
        jobs = []
        if self.engine_checkpoint_only:  # no plain policy to push: only the checkpoint folder goes
            self._warn_no_model_push()
        else:
            for entry in source.iterdir():  # the policy folder at the top of the checkpoint, not its internals
                if entry.is_file() and not any(fnmatch.fnmatch(entry.name, p) for p in PUSH_SKIPPED):
                    shutil.copy(entry, os.path.join(output_dir, entry.name))
            torch.save(without_secrets(self.trainer.args), os.path.join(output_dir, TRAINING_ARGS_NAME))
            self.create_model_card()
            ignore = ["_*", ".*", f"{PREFIX_CHECKPOINT_DIR}-*"]
            jobs.append(upload(folder_path=output_dir, commit_message=message, ignore_patterns=ignore))
        if with_checkpoint:
            in_repo = "last-checkpoint" if self.trainer.args.hub_strategy == HubStrategy.CHECKPOINT else source.name
            jobs.append(
                upload(folder_path=checkpoint_folder, path_in_repo=in_repo, commit_message=f"{message}, checkpoint")
            )
        if self.trainer.push_in_progress is None or self.trainer.push_in_progress.is_done():
            self.trainer.push_in_progress = PushInProgress(jobs)
        else:
            self.trainer.push_in_progress.jobs.extend(jobs)

    def _warn_no_model_push(self) -> None:
        """Once per trainer: a push during training leaves the model out when only engine checkpoints are saved."""
        if self.warned_no_model_push:
            return
        self.warned_no_model_push = True
        with_checkpoint = self.trainer.args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS)
        engine_checkpoint.warn_no_model_push(self.trainer.hub_model_id, with_checkpoint)

    def _ppo_state(self) -> dict:
        return {
            "global_step": self.trainer.state.global_step,
            "episode": self.trainer.state.episode,
            **self.ppo_state.state_dict(),
            "run": self._run_settings(),
        }

    def _check_finite_weights(self) -> None:
        wrapper = self.trainer.accelerator.unwrap_model(self.trainer.model_wrapped)
        bad = [name for name, p in wrapper.named_parameters() if p.numel() and not torch.isfinite(p).all()]
        if bad:
            raise RuntimeError(
                f"Refusing to write a checkpoint: non-finite weights in {bad[:3]}. Lower the learning rate or "
                "max_grad_norm, and resume from the last checkpoint."
            )

    # -- resuming ---------------------------------------------------------------------------------------------------
    def restore_checkpoint(self, resume_from_checkpoint: str | bool) -> None:
        """Restore the whole run state from the checkpoint :meth:`claim_run` checked (or, called alone, from
        ``resume_from_checkpoint`` after checking it); with ``resume_weights_only`` not optimizer, scheduler, RNG."""
        path = self.resume_path or self._checked_checkpoint(resume_from_checkpoint)
        weights_only = self.trainer.args.resume_weights_only
        saved = read_json(os.path.join(path, PPO_STATE_NAME))
        with checkpoint_files.reading(path, "the weights", loading=True):
            self._load_weights_from(path)
        if not weights_only:
            with checkpoint_files.reading(path, f"{OPTIMIZER_NAME} / {SCHEDULER_NAME}", loading=True):
                compat.load_optimizer_and_scheduler(self.trainer, path)
            if self._learning_rates_changed(saved.get("run") or {}):  # resume_allow_changes: the new rates apply
                optim.rebase_learning_rates(self.trainer.optimizer, self.trainer.lr_scheduler, self.trainer.args)
        planned = self.trainer.state  # this run's plan (max_steps …), which resume_allow_changes may have changed
        self.trainer.state = TrainerState.load_from_json(os.path.join(path, TRAINER_STATE_NAME))
        for name in ("max_steps", "num_train_epochs", "logging_steps", "eval_steps", "save_steps"):
            setattr(self.trainer.state, name, getattr(planned, name))
        with checkpoint_files.reading(path, PPO_STATE_NAME):
            self.trainer.state.episode = saved["episode"]
            self.ppo_state.load_state_dict(saved)
        if weights_only:
            logger.warning(
                "resume_weights_only=True: resumed the weights and PPO state of %s at iteration %d; the optimizer "
                "(Adam moments) and the learning-rate schedule restart from scratch and the sampling RNG is not "
                "restored.",
                path,
                self.trainer.state.global_step,
            )
        else:
            with checkpoint_files.reading(path, "rng_state*.pth", loading=True):
                compat.load_rng_state(self.trainer, path)
        if self.producer is not None:
            with checkpoint_files.reading(path, "lagged_rollouts_*.pt", loading=True):
                self.producer.load(path, self.trainer.accelerator.process_index, self.trainer.state.global_step)
        logger.info("Resumed from %s at iteration %d.", path, self.trainer.state.global_step)

    def _learning_rates_changed(self, saved: dict) -> bool:
        """Whether this run's learning rates differ from those of the checkpoint's run settings ``saved``."""
        current = self._run_settings()
        names = ("learning_rate", "effective_critic_learning_rate")
        return any(name in saved and saved[name] != current[name] for name in names)

    def _load_weights_from(self, path: str) -> None:
        if self.trainer.is_deepspeed_enabled:  # the engine checkpoint holds the weights (and optimizer)
            from transformers.integrations.deepspeed import deepspeed_load_checkpoint

            deepspeed_load_checkpoint(self.trainer.model_wrapped, path)
            return
        if (
            self.trainer.is_fsdp_enabled
        ):  # sharded parameters: the FSDP checkpoint the Trainer wrote beside the weights
            from accelerate.utils import load_fsdp_model

            load_fsdp_model(
                self.trainer.accelerator.state.fsdp_plugin, self.trainer.accelerator, self.trainer.model_wrapped, path
            )
            return
        wrapper = self.trainer.accelerator.unwrap_model(self.trainer.model_wrapped)
        load_weights(wrapper.policy, path)
        if wrapper.critic is not None:
            load_weights(wrapper.critic, os.path.join(path, CRITIC_DIR))

    def load_best_model(self) -> None:
        """Load the best checkpoint's weights (``load_best_model_at_end``), once a run has finished, and say which:
        a warning when it is ``checkpoint-0``, the initial policy that no later evaluation beat."""
        path = self.trainer.state.best_model_checkpoint
        if not (self.trainer.args.load_best_model_at_end and path):
            return
        self._load_weights_from(path)
        metric = self.trainer.args.metric_for_best_model
        metric = metric if metric.startswith("eval_") else f"eval_{metric}"
        if checkpoint_number(path) == 0:
            logger.warning(
                "load_best_model_at_end: the best model is the initial policy (step 0, before any update): no later "
                "evaluation beat its %s = %.6g. The trainer now holds the initial (SFT) weights of %s, not trained "
                "ones.",
                metric,
                self.trainer.state.best_metric,
                path,
            )
        else:
            logger.info(
                "load_best_model_at_end: loaded the best model, %s (%s = %.6g).",
                path,
                metric,
                self.trainer.state.best_metric,
            )
