"""PPOMaxTrainer: PPO-max on the current TRL stack, with trl 1.12's ``PPOTrainer`` constructor.

One PPO iteration, phase by phase (``ppo-max.md``): rollout (generate → policy/reference/critic forwards → score) →
experience (reward normalisation and clipping, token KL, GAE, advantage whitening) → update (epochs × minibatches ×
gradient accumulation) → log. The maths lives in :mod:`trl_ppomax.core`; this module only orchestrates.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial

import torch
from accelerate.utils import gather_object, set_seed
from datasets import Dataset
from torch import nn
from transformers import PreTrainedTokenizerBase, Trainer, TrainerCallback, TrainerState
from transformers.trainer import TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, get_last_checkpoint, rotate_checkpoints
from trl.models.utils import prepare_deepspeed, prepare_fsdp, unwrap_model_for_generation
from trl.trainer.utils import disable_dropout_in_model

from . import core
from .checkpoint import (
    CRITIC_DIR,
    PPO_STATE_NAME,
    atomic_directory,
    load_weights,
    read_json,
    sub_state_dict,
    write_json,
)
from .data import (
    PromptCollator,
    ShuffledBatches,
    prepare_prompt_dataset,
    prepare_text_dataset,
    prompt_length_limit,
)
from .hub import create_model_card
from .modeling import PolicyAndCritic, response_logits, sequence_scores, token_values
from .ppo_config import PPOMaxConfig
from .rewards import RewardFunction, call_reward_function, decode_texts, running_moments_from_config
from .rollout import Rollout, concat_rollouts, generate_responses, sequence_inputs

logger = logging.getLogger(__name__)


@dataclass
class Experience:
    """Training targets of one rollout batch (per process), computed once before the PPO epochs."""

    rollout: Rollout
    old_logprobs: torch.Tensor  # (B, T) denominator of the ratio: rollout policy or reference (§5.3.2)
    advantages: torch.Tensor  # (B, T) normalised / clipped
    returns: torch.Tensor  # (B, T)


class PPOMaxTrainer(Trainer):
    """PPO-max trainer with the constructor of trl 1.12's ``PPOTrainer``.

    Args:
        args: a [`PPOMaxConfig`].
        processing_class: the tokenizer (a pad token is required).
        model: the policy, a causal LM (a PEFT model, or wrapped with ``peft_config``).
        ref_model: frozen reference policy; ``None`` copies ``model``, or, for PEFT, disables the adapter.
        reward_model: a sequence-classification model with one label, or a callable
            ``(prompts: list[str], completions: list[str]) -> list[float]``.
        train_dataset: prompts, as ``input_ids`` (trl 1.12 style) or ``prompt`` (text or conversation).
        value_model: the critic; ``None`` initialises it from the reward model (§5.3.3).
        ptx_dataset: texts (``text``/``input_ids``) for the PPO-ptx loss, used when ``args.ptx_coef > 0``.
        rollout_metrics: extra per-response measurements to log, ``{name: f(prompts, completions) -> list[float]}``
            on the decoded texts (e.g. a gold reward, a rule-based check); logged as ``name`` (and ``eval_name``).
    """

    _tag_names = ("trl", "trl-ppomax", "ppo", "ppo-max")

    def __init__(
        self,
        args: PPOMaxConfig,
        processing_class: PreTrainedTokenizerBase,
        model: nn.Module,
        ref_model: nn.Module | None,
        reward_model: nn.Module | RewardFunction,
        train_dataset: Dataset,
        value_model: nn.Module | None = None,
        data_collator: Callable | None = None,
        eval_dataset: Dataset | dict[str, Dataset] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        callbacks: list[TrainerCallback] | None = None,
        peft_config=None,
        *,
        ptx_dataset: Dataset | None = None,
        rollout_metrics: dict[str, RewardFunction] | None = None,
    ) -> None:
        if not isinstance(args, PPOMaxConfig):
            raise TypeError(f"args must be a PPOMaxConfig, got {type(args).__name__}.")
        _check_tokenizer(processing_class)
        if value_model is not None and value_model is reward_model:
            raise ValueError(
                "value_model is the same object as reward_model, so training the critic would change the reward; "
                "pass a separate copy, or value_model=None to initialise the critic from the reward model."
            )
        if ref_model is not None and ref_model is model:
            raise ValueError("ref_model is the same object as model; pass a separate copy, or None to copy it.")
        if args.ptx_coef > 0 and ptx_dataset is None:
            raise ValueError(
                "ptx_coef > 0 needs a ptx_dataset: pass PPOMaxTrainer(..., ptx_dataset=...) or ptx_coef=0."
            )

        self.stop_token_id = processing_class.eos_token_id if args.stop_token == "eos" else args.stop_token_id
        policy, self.ref_model = _policy_and_reference(model, ref_model, peft_config)
        self.is_peft_model = _is_peft(policy)
        if self.is_peft_model and args.model_adapter_name:
            policy.set_adapter(args.model_adapter_name)
        self.reward_model = reward_model
        critic = _critic_from(value_model, reward_model)
        for module in (policy, critic, self.ref_model, reward_model):
            if isinstance(module, nn.Module):
                disable_dropout_in_model(module)
        for scorer in (reward_model, critic):
            _check_single_label(scorer)

        limit = prompt_length_limit(args.max_prompt_length, policy, args.response_length)
        prepare = partial(
            prepare_prompt_dataset,
            tokenizer=processing_class,
            num_proc=args.dataset_num_proc,
            max_prompt_length=limit,
            truncate=args.truncate_long_prompts,
        )
        train_dataset = prepare(train_dataset)
        if isinstance(eval_dataset, Dataset):
            eval_dataset = prepare(eval_dataset)
        if len(train_dataset) < args.batch_size:
            raise ValueError(
                f"The training dataset has {len(train_dataset)} prompts, fewer than one rollout batch "
                f"(per_device_train_batch_size × gradient_accumulation_steps × num_mini_batches × processes = "
                f"{args.batch_size}); add prompts or lower those sizes."
            )
        self.total_episodes, self.num_total_batches = args.num_iterations(len(train_dataset))
        self.ptx_dataset = ptx_dataset
        self.rollout_metrics = dict(rollout_metrics or {})

        super().__init__(
            model=PolicyAndCritic(policy, critic),
            args=args,
            data_collator=data_collator or PromptCollator(processing_class.pad_token_id),
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self.running_reward = self._initial_reward_moments()
        self.counters = {"skipped/iterations": 0, "skipped/updates": 0}  # logged as metrics
        self.ptx_batches_used = 0
        self._prepare_models()

    # ------------------------------------------------------------------------------------------------------------
    # Set-up
    # ------------------------------------------------------------------------------------------------------------
    def _initial_reward_moments(self) -> core.RunningMoments:
        """Empty, or seeded with the statistics PPOMaxRewardTrainer stored in the reward model's config."""
        config = getattr(self.reward_model, "config", None)
        seeded = running_moments_from_config(config) if self.args.reward_norm != "none" else None
        if seeded is not None:
            logger.info("Reward normalisation starts from the reward model's stored statistics: %s", seeded)
        return seeded or core.RunningMoments()

    def _prepare_models(self) -> None:
        num_updates = self.num_total_batches * self.args.num_ppo_epochs * self.args.num_mini_batches
        self.create_optimizer_and_scheduler(num_training_steps=num_updates)
        if self.args.activation_checkpointing:
            self.model.gradient_checkpointing_enable(self.args.activation_checkpointing_kwargs)
        self.model_wrapped, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)
        if self.is_deepspeed_enabled:
            self.deepspeed = self.model_wrapped
        for name in ("ref_model", "reward_model"):
            module = getattr(self, name)
            if isinstance(module, nn.Module):
                setattr(self, name, self._prepare_frozen(module))
        batches = partial(
            ShuffledBatches,
            num_processes=self.accelerator.num_processes,
            process_index=self.accelerator.process_index,
            seed=self.args.data_seed if self.args.data_seed is not None else self.args.seed,
        )
        self.prompt_batches = batches(self.train_dataset, self.args.local_batch_size, collate=self.data_collator)
        self.ptx_batches = None
        if self.ptx_dataset is not None and self.args.ptx_coef > 0:
            ptx = prepare_text_dataset(self.ptx_dataset, self.processing_class, self.args.dataset_num_proc)
            collate = PromptCollator(self.processing_class.pad_token_id, padding_side="right")
            self.ptx_batches = batches(ptx, self.args.per_device_train_batch_size, collate=collate)

    def _prepare_frozen(self, module: nn.Module) -> nn.Module:
        """Reference and reward models: inference only, sharded under DeepSpeed ZeRO-3 or FSDP."""
        module.eval().requires_grad_(False)
        if self.is_deepspeed_enabled:
            return prepare_deepspeed(module, self.accelerator)
        if self.is_fsdp_enabled:
            return prepare_fsdp(module, self.accelerator)
        return module.to(self.accelerator.device)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """AdamW (or ``args.optim``) with separate learning rates for the policy and the critic (§5.4)."""
        if self.optimizer is not None:
            return self.optimizer
        wrapper = self.model
        decay = set(self.get_decay_parameter_names(wrapper))
        rates = {"policy.": self.args.learning_rate, "critic.": self.args.effective_critic_learning_rate}
        groups = []
        for prefix, lr in rates.items():
            named = [(n, p) for n, p in wrapper.named_parameters() if n.startswith(prefix) and p.requires_grad]
            for with_decay in (True, False):
                params = [p for n, p in named if (n in decay) == with_decay]
                if params:
                    groups.append({"params": params, "lr": lr, "weight_decay": self.args.weight_decay * with_decay})
        optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, wrapper)
        optimizer_kwargs.pop("lr", None)
        self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer

    def plan(self) -> str:
        """What this run will do: models, batch sizes, episodes, devices, precision and the PPO-max settings."""
        args, wrapper = self.args, self.accelerator.unwrap_model(self.model_wrapped)

        def size(module) -> str:
            if not isinstance(module, nn.Module):
                return "a Python function" if module is not None else "policy with adapter disabled"
            total = sum(p.numel() for p in module.parameters())
            trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)

            def count(n: int) -> str:
                return f"{n / 1e6:,.1f}M" if n >= 100_000 else f"{n:,}"

            return f"{type(module).__name__}, {count(total)} params" + (
                f" ({count(trainable)} trainable)" if 0 < trainable < total else ""
            )

        precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
        backend = "DeepSpeed" if self.is_deepspeed_enabled else "FSDP" if self.is_fsdp_enabled else "DDP/single"
        return "\n".join(
            [
                "PPO-max plan",
                f"  policy    : {size(wrapper.policy)}",
                f"  reference : {size(self.ref_model)}",
                f"  critic    : {size(wrapper.critic)}",
                f"  reward    : {size(self.reward_model)}",
                f"  devices   : {self.accelerator.num_processes} × {self.accelerator.device.type} ({backend}), {precision}",
                f"  rollout   : {args.batch_size} prompts per iteration ({args.local_batch_size} per process), "
                f"responses ≤ {args.response_length} tokens",
                f"  update    : {args.num_ppo_epochs} epochs × {args.num_mini_batches} minibatches of "
                f"{args.mini_batch_size} ({args.per_device_train_batch_size} per device × "
                f"{args.gradient_accumulation_steps} accumulation)",
                f"  length    : {self.total_episodes} episodes = {self.num_total_batches} iterations",
                f"  ppo-max   : preset={args.preset}, reward_norm={args.reward_norm}, reward_clip={args.reward_clip}, "
                f"kl_coef={args.kl_coef}, critic_warmup_steps={args.critic_warmup_steps}, "
                f"max_grad_norm={args.max_grad_norm}, ptx_coef={args.ptx_coef}",
            ]
        )

    # ------------------------------------------------------------------------------------------------------------
    # The loop
    # ------------------------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs) -> None:
        """Run ``num_total_batches`` PPO-max iterations; ``resume_from_checkpoint`` (a path, or True for the newest
        checkpoint in ``output_dir``) continues an interrupted run exactly where it stopped."""
        args = self.args
        set_seed(args.seed, device_specific=True)  # a different sampling seed on each process
        self._begin_state()
        if resume_from_checkpoint:
            self._resume(resume_from_checkpoint)
        pending: dict[str, list[float]] = defaultdict(list)
        start = (time.time(), self.state.episode)
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        for iteration in range(self.state.global_step + 1, self.num_total_batches + 1):
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            for name, value in self.training_iteration(iteration).items():
                pending[name].append(value)
            self.state.global_step = iteration
            self.state.episode = iteration * args.batch_size
            self.state.epoch = self.state.episode / len(self.train_dataset)
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            self._log_evaluate_save(pending, iteration, start)
            if self.control.should_training_stop:
                break
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        finished = self.state.global_step >= self.num_total_batches
        if args.load_best_model_at_end and self.state.best_model_checkpoint and finished:
            self._load_weights_from(self.state.best_model_checkpoint)

    def training_iteration(self, iteration: int) -> dict[str, float]:
        """One PPO-max iteration on rollout batch ``iteration``; a batch with non-finite numbers is skipped."""
        batch = {k: v.to(self.accelerator.device) for k, v in self.prompt_batches[iteration - 1].items()}
        rollout = self.rollout(batch["input_ids"], batch["attention_mask"])
        experience, metrics = self.make_experience(rollout)
        if experience is None:
            self.counters["skipped/iterations"] += 1
            logger.warning("Iteration %d skipped: non-finite rewards, values or log-probs.", iteration)
        else:
            metrics.update(self.ppo_update(experience, critic_only=iteration <= self.args.critic_warmup_steps))
        metrics.update({name: float(value) for name, value in self.counters.items()})
        return metrics

    def _begin_state(self) -> None:
        self.state.max_steps = self.num_total_batches
        self.state.num_train_epochs = self.total_episodes / len(self.train_dataset)
        self.state.global_step = 0
        self.state.episode = 0
        for attribute in ("logging_steps", "eval_steps", "save_steps"):
            value = getattr(self.args, attribute)
            value = math.ceil(self.num_total_batches * value) if value and value < 1 else value
            setattr(self.state, attribute, value)
        self.sample_every = max(1, self.num_total_batches // max(1, self.args.num_sample_generations))

    def _log_evaluate_save(self, pending: dict[str, list[float]], iteration: int, start: tuple[float, int]) -> None:
        """Log the mean of each metric since the last log (with the current counters and learning rates), then
        evaluate, print samples and save as the callbacks ask."""
        if self.control.should_log or iteration == self.num_total_batches:
            means = {name: sum(values) / len(values) for name, values in pending.items()}
            self.log({**means, **self._schedule_metrics(start)})
            pending.clear()
        if self.control.should_evaluate:
            is_best = self._determine_best_metric(self.evaluate(), trial=None)
            if self.args.save_strategy == SaveStrategy.BEST:
                self.control.should_save = is_best
        if self.args.num_sample_generations > 0 and iteration % self.sample_every == 0:
            self.generate_completions(sampling=True)
        if self.control.should_save:
            self._save_checkpoint(self.model, trial=None)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def _schedule_metrics(self, start: tuple[float, int]) -> dict[str, float]:
        """Counters, speed since ``start = (time, episode)`` of this run (or resume), learning rates, GPU memory."""
        lrs = self.lr_scheduler.get_last_lr()
        metrics = {
            "episode": float(self.state.episode),
            "eps": (self.state.episode - start[1]) / max(time.time() - start[0], 1e-9),
            "lr": lrs[0],
            "critic/lr": lrs[-1],
        }
        if torch.cuda.is_available():
            metrics["memory/peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
        return metrics

    # ------------------------------------------------------------------------------------------------------------
    # Phase 1: rollout
    # ------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def rollout(self, query_ids: torch.Tensor, query_mask: torch.Tensor, sampling: bool = True) -> Rollout:
        """Generate (sampled, or greedy with ``sampling=False``) and score responses for left-padded prompts, in
        chunks of ``local_rollout_forward_batch_size``."""
        chunk = self.args.local_rollout_forward_batch_size
        self.model.eval()
        with unwrap_model_for_generation(
            self.model_wrapped,
            self.accelerator,
            gather_deepspeed3_params=self.args.ds3_gather_for_generation,
            gradient_checkpointing_kwargs=self.args.activation_checkpointing_kwargs,
        ) as wrapper:
            parts = [
                self._rollout_chunk(wrapper, query_ids[i : i + chunk], query_mask[i : i + chunk], sampling)
                for i in range(0, len(query_ids), chunk)
            ]
        self.model.train()
        return concat_rollouts(parts, self.processing_class.pad_token_id)

    def _rollout_chunk(
        self, wrapper: PolicyAndCritic, query_ids: torch.Tensor, query_mask: torch.Tensor, sampling: bool
    ) -> Rollout:
        args, pad_id = self.args, self.processing_class.pad_token_id
        responses, mask = generate_responses(
            wrapper.policy, query_ids, query_mask, self._generation_kwargs(sampling), self.stop_token_id, pad_id
        )
        width = max(int(mask.sum(1).max()), 1)
        responses, mask = responses[:, :width], mask[:, :width]
        inputs = sequence_inputs(query_ids, query_mask, responses, mask)
        logits = response_logits(wrapper.policy, inputs, width)
        with self._reference_policy(wrapper) as reference:
            ref_logits = response_logits(reference, inputs, width)
        logprobs = core.logprobs_from_logits(logits, responses, args.temperature)
        ref_logprobs = core.logprobs_from_logits(ref_logits, responses, args.temperature)
        perplexities = [
            core.sequence_perplexity(core.logprobs_from_logits(x, responses), mask) for x in (logits, ref_logits)
        ]
        del logits, ref_logits
        return Rollout(
            query_ids=query_ids,
            query_mask=query_mask,
            response_ids=responses,
            response_mask=mask,
            logprobs=logprobs * mask,
            ref_logprobs=ref_logprobs * mask,
            values=token_values(wrapper.critic, inputs, width) * mask,
            scores=self._score(inputs, query_ids, query_mask, responses, mask),
            policy_perplexity=perplexities[0],
            ref_perplexity=perplexities[1],
        )

    def _generation_kwargs(self, sampling: bool = True) -> dict:
        args = self.args
        kwargs = {
            "max_new_tokens": args.response_length,
            "eos_token_id": self.stop_token_id,
            "pad_token_id": self.processing_class.pad_token_id,
            "do_sample": sampling,
        }
        if sampling:
            kwargs.update(
                temperature=args.temperature, top_k=0, top_p=args.top_p, repetition_penalty=args.repetition_penalty
            )
        return kwargs

    @contextmanager
    def _reference_policy(self, wrapper: PolicyAndCritic):
        """The reference model, or, for PEFT, the policy with its adapter disabled (or the reference adapter)."""
        if self.ref_model is not None:
            yield self.ref_model
        elif self.args.ref_adapter_name:
            wrapper.policy.set_adapter(self.args.ref_adapter_name)
            try:
                yield wrapper.policy
            finally:
                wrapper.policy.set_adapter(self.args.model_adapter_name or "default")
        else:
            with wrapper.policy.disable_adapter():
                yield wrapper.policy

    def _score(self, inputs, query_ids, query_mask, responses, mask) -> torch.Tensor:
        """Reward (B,) of each truncated response, minus ``missing_eos_penalty`` where it has no stop token."""
        if isinstance(self.reward_model, nn.Module):
            scores = sequence_scores(self.reward_model, inputs, query_ids.shape[1], mask)
        else:
            tokenizer = self.processing_class
            scores = call_reward_function(
                self.reward_model,
                decode_texts(tokenizer, query_ids, query_mask),
                decode_texts(tokenizer, responses, mask),
                query_ids.device,
            )
        if self.args.missing_eos_penalty is not None:
            scores = scores - self.args.missing_eos_penalty * (1.0 - self._ends_with_stop(responses, mask))
        return scores

    def _ends_with_stop(self, responses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """1.0 (B,) where the response holds the stop token (eos when none is configured), else 0.0."""
        stop_id = self.stop_token_id if self.stop_token_id is not None else self.processing_class.eos_token_id
        return ((responses == stop_id) & mask.bool()).any(dim=1).float()

    # ------------------------------------------------------------------------------------------------------------
    # Phase 2: rewards and advantages
    # ------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def make_experience(self, rollout: Rollout) -> tuple[Experience | None, dict[str, float]]:
        """Shape rewards (normalise + clip, token KL) and compute GAE advantages and returns (§5.3).

        Returns ``(None, {})`` on every process when any process saw a non-finite score, log-prob or value, so
        that such a batch neither trains nor enters the running reward moments.
        """
        args, mask = self.args, rollout.response_mask
        reduce = self._reduce_sum
        if not self._all_finite(rollout.scores, rollout.logprobs, rollout.ref_logprobs, rollout.values):
            return None, {}
        self.running_reward.update(rollout.scores, reduce=reduce)
        scores, kl = self._shape_scores(rollout)
        rewards, _ = core.token_rewards(scores, kl, mask, args.kl_coef)
        if args.whiten_rewards:
            rewards = core.masked_whiten(rewards, mask, shift_mean=False, reduce=reduce)
        advantages, returns = core.compute_gae(rewards, rollout.values, mask, args.gamma, args.lam)
        normalised = core.normalize_advantages(
            advantages, mask, whiten=args.whiten_advantages, clip=args.advantage_clip, reduce=reduce
        )
        if not self._all_finite(normalised, returns):
            return None, {}
        old = rollout.ref_logprobs if args.importance_sampling == "reference" else rollout.logprobs
        experience = Experience(rollout=rollout, old_logprobs=old, advantages=normalised, returns=returns)
        return experience, self._rollout_metrics(rollout, scores, kl, advantages, returns)

    def _shape_scores(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised and clipped scores (B,) with the current running moments, and the per-token KL (B, T)."""
        args = self.args
        scores = core.normalize_scores(
            rollout.scores,
            self.running_reward.mean,
            self.running_reward.std,
            args.reward_norm,
            args.reward_clip or None,
        )
        kl = core.kl_penalty(rollout.logprobs, rollout.ref_logprobs, args.kl_estimator) * rollout.response_mask
        return scores, kl

    def _sequence_metrics(self, rollout: Rollout, scores: torch.Tensor, kl: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-response monitoring values (B,) — the collapse signals of §5.2."""
        non_score = -self.args.kl_coef * kl.sum(1)
        return {
            **self._custom_metrics(rollout),
            "objective/kl": kl.sum(1),
            "objective/non_score_reward": non_score,
            "objective/rlhf_reward": scores + non_score,
            "objective/scores": rollout.scores,
            "objective/scores_normalized": scores,
            "policy/perplexity": rollout.policy_perplexity,
            "policy/ref_perplexity": rollout.ref_perplexity,
            "response/length": rollout.response_mask.float().sum(1),
            "response/stop_token_missing": 1.0 - self._ends_with_stop(rollout.response_ids, rollout.response_mask),
        }

    def _custom_metrics(self, rollout: Rollout) -> dict[str, torch.Tensor]:
        """The user's ``rollout_metrics`` on the decoded prompts and responses, (B,) each."""
        if not self.rollout_metrics:
            return {}
        tokenizer, device = self.processing_class, rollout.scores.device
        prompts = decode_texts(tokenizer, rollout.query_ids, rollout.query_mask)
        completions = decode_texts(tokenizer, rollout.response_ids, rollout.response_mask)
        return {
            name: call_reward_function(function, prompts, completions, device)
            for name, function in self.rollout_metrics.items()
        }

    def _all_finite(self, *tensors: torch.Tensor) -> bool:
        """Whether every tensor is finite on every process (one reduction)."""
        bad = sum((~torch.isfinite(t)).sum() for t in tensors).float()
        return self._reduce_sum(bad.reshape(1)).item() == 0

    def _reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction="sum") if self.accelerator.num_processes > 1 else tensor

    def _rollout_metrics(self, rollout, scores, kl, advantages, returns) -> dict[str, float]:
        mask = rollout.response_mask.float()
        per_sequence = self._sequence_metrics(rollout, scores, kl)
        metrics = {name: self._global_mean(value) for name, value in per_sequence.items()}
        all_scores = self.accelerator.gather(rollout.scores).float()
        metrics.update(
            {
                "objective/scores_std": all_scores.std().item() if len(all_scores) > 1 else 0.0,
                "objective/scores_p05": torch.quantile(all_scores, 0.05).item(),
                "objective/scores_p95": torch.quantile(all_scores, 0.95).item(),
                "objective/reward_running_mean": self.running_reward.mean,
                "objective/reward_running_std": self.running_reward.std,
                "critic/values": self._masked_global_mean(rollout.values, mask),
                "critic/returns": self._masked_global_mean(returns, mask),
                "critic/advantages_raw": self._masked_global_mean(advantages, mask),
            }
        )
        return metrics

    def _global_mean(self, per_sequence: torch.Tensor) -> float:
        count = torch.tensor(float(len(per_sequence)), device=per_sequence.device)
        total = self._reduce_sum(torch.stack([per_sequence.float().sum(), count]))
        return (total[0] / total[1]).item()

    def _masked_global_mean(self, values: torch.Tensor, mask: torch.Tensor) -> float:
        return core.masked_mean(values.float(), mask, reduce=self._reduce_sum).item()

    # ------------------------------------------------------------------------------------------------------------
    # Phase 3: PPO update
    # ------------------------------------------------------------------------------------------------------------
    def ppo_update(self, experience: Experience, critic_only: bool = False) -> dict[str, float]:
        """``num_ppo_epochs`` passes over the rollout in ``num_mini_batches`` optimizer steps, each accumulated over
        ``gradient_accumulation_steps`` micro-batches. ``critic_only`` trains the critic alone (§5.3.3)."""
        args = self.args
        stats: dict[str, list[torch.Tensor]] = defaultdict(list)
        device = experience.advantages.device
        for _ in range(args.num_ppo_epochs):
            order = torch.randperm(args.local_batch_size, device=device)
            for minibatch in order.split(args.local_mini_batch_size):
                micro_batches = minibatch.split(args.per_device_train_batch_size)
                for step, micro in enumerate(micro_batches):
                    sync = step == len(micro_batches) - 1
                    self.accelerator.gradient_state._set_sync_gradients(sync)
                    context = nullcontext() if sync else self.accelerator.no_sync(self.model_wrapped)
                    with context:
                        loss, micro_stats = self.micro_batch_loss(experience, micro, critic_only)
                        if not self.is_deepspeed_enabled:
                            loss = loss / len(micro_batches)
                        self.accelerator.backward(loss)
                    for name, value in micro_stats.items():
                        stats[name].append(value)
                for name, value in self._optimizer_step(critic_only).items():
                    stats[name].append(value)
        means = torch.stack([torch.stack(values).float().mean() for values in stats.values()])
        means = self.accelerator.reduce(means, reduction="mean") if self.accelerator.num_processes > 1 else means
        return dict(zip(stats.keys(), means.tolist(), strict=True))

    def micro_batch_loss(
        self, experience: Experience, index: torch.Tensor, critic_only: bool
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """PPO-max loss of one micro-batch: clipped policy loss + vf_coef·clipped value loss (+ entropy, + ptx)."""
        args = self.args
        rollout = experience.rollout.select(index)
        width = max(int(rollout.response_mask.sum(1).max()), 1)  # trim padding to this micro-batch's longest
        mask = rollout.response_mask[:, :width]
        responses = rollout.response_ids[:, :width]
        inputs = sequence_inputs(rollout.query_ids, rollout.query_mask, responses, mask)
        ptx_inputs = self._next_ptx_batch() if self.ptx_batches is not None else None
        logits, values, ptx_logits = self.model_wrapped(inputs, width, ptx_inputs=ptx_inputs)
        logprobs = core.logprobs_from_logits(logits, responses, args.temperature)

        pg_loss, pg_stats = core.clipped_policy_loss(
            logprobs,
            experience.old_logprobs[index, :width],
            experience.advantages[index, :width],
            mask,
            args.cliprange,
        )
        vf_loss, vf_stats = core.clipped_value_loss(
            values, rollout.values[:, :width], experience.returns[index, :width], mask, args.cliprange_value
        )
        entropy = core.entropy_from_logits(logits if args.entropy_coef > 0 else logits.detach(), args.temperature)
        entropy_term, entropy_stats = core.entropy_loss(entropy, mask, args.entropy_target)
        policy_loss = pg_loss + args.entropy_coef * entropy_term
        stats = {
            "loss/policy": pg_loss.detach(),
            "loss/value": vf_loss.detach(),
            "policy/entropy": entropy_stats["entropy"],
            "policy/clipfrac": pg_stats["clipfrac"],
            "policy/approxkl": pg_stats["approxkl"],
            "policy/ratio": pg_stats["ratio"],
            "policy/ratio_var": pg_stats["ratio_var"],
            "critic/vf_clipfrac": vf_stats["clipfrac"],
            "critic/error": vf_stats["error"],
        }
        if ptx_logits is not None:
            ptx_loss, ptx_stats = core.lm_loss(ptx_logits, ptx_inputs["input_ids"], ptx_inputs["attention_mask"])
            policy_loss = policy_loss + args.ptx_coef * ptx_loss
            stats.update({"loss/ptx": ptx_loss.detach(), "policy/ptx_perplexity": ptx_stats["perplexity"]})
        # Critic warm-up keeps the policy in the graph (DDP needs every parameter used) with zero weight.
        loss = (0.0 if critic_only else 1.0) * policy_loss + args.vf_coef * vf_loss
        return loss, stats

    def _next_ptx_batch(self) -> dict[str, torch.Tensor]:
        batch = self.ptx_batches[self.ptx_batches_used]
        self.ptx_batches_used += 1
        return {k: v.to(self.accelerator.device) for k, v in batch.items()}

    def _optimizer_step(self, critic_only: bool) -> dict[str, torch.Tensor]:
        """Clip the policy's and the critic's gradients separately (App. C.2), then step — unless a gradient is
        non-finite, in which case the step is skipped and counted (the gradients are identical on every process)."""
        wrapper = self.accelerator.unwrap_model(self.model_wrapped)
        stats = {}
        if not self.is_deepspeed_enabled:  # DeepSpeed clips (gradient_clipping = max_grad_norm) inside its engine
            if critic_only:
                for parameter in wrapper.policy.parameters():
                    parameter.grad = None  # the optimizer skips parameters without gradients
            max_norm = self.args.max_grad_norm or float("inf")
            for name, module in (("policy", wrapper.policy), ("critic", wrapper.critic)):
                params = [p for p in module.parameters() if p.grad is not None]
                if params:
                    stats[f"{name}/grad_norm"] = self.accelerator.clip_grad_norm_(params, max_norm).detach()
        if stats and not torch.isfinite(torch.stack(list(stats.values()))).all():
            self.counters["skipped/updates"] += 1
            logger.warning("Optimizer step skipped at iteration %d: non-finite gradient.", self.state.global_step + 1)
            stats = {}
        else:
            self.optimizer.step()
            self.lr_scheduler.step()
        self.optimizer.zero_grad()
        return stats

    # ------------------------------------------------------------------------------------------------------------
    # Saving, samples, model card
    # ------------------------------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the policy and tokenizer as a plain transformers (or PEFT adapter) folder, gathering the weights
        from every shard under DeepSpeed ZeRO-3 or FSDP."""
        output_dir = output_dir or self.args.output_dir
        self._save_weights(output_dir, with_critic=False)

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
        """Write ``checkpoint-N`` atomically: everything needed to continue the run exactly (see checkpoint.py)."""
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

    # ------------------------------------------------------------------------------------------------------------
    # Evaluation, samples, model card
    # ------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(
        self, eval_dataset: Dataset | None = None, ignore_keys=None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """Generate on every evaluation prompt (greedy, or sampled with ``eval_do_sample``) and report the mean
        raw and normalised reward, KL, perplexity of policy and reference, and response length (``eval_…``)."""
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if not isinstance(dataset, Dataset):
            raise ValueError("evaluate() needs an eval_dataset of prompts, passed here or to the trainer.")
        if "input_ids" not in dataset.column_names:
            dataset = prepare_prompt_dataset(dataset, self.processing_class, self.args.dataset_num_proc)
        totals: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=self.accelerator.device))
        for rows, weights in _shard_in_chunks(
            len(dataset), self.accelerator, self.args.local_rollout_forward_batch_size
        ):
            batch = self.data_collator([dataset[i] for i in rows])
            batch = {k: v.to(self.accelerator.device) for k, v in batch.items()}
            rollout = self.rollout(batch["input_ids"], batch["attention_mask"], sampling=self.args.eval_do_sample)
            weights = weights.to(self.accelerator.device)
            for name, values in self._sequence_metrics(rollout, *self._shape_scores(rollout)).items():
                totals[name] += (values.float() * weights).sum()
            totals["count"] += weights.sum()
        names = list(totals)
        sums = self._reduce_sum(torch.stack([totals[n] for n in names]))
        count = sums[names.index("count")]
        metrics = {
            f"{metric_key_prefix}_{n}": (v / count).item() for n, v in zip(names, sums, strict=True) if n != "count"
        }
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None, tags=None, **_):
        if not self.is_world_process_zero():
            return
        policy = self.accelerator.unwrap_model(self.model).policy
        card = create_model_card(policy, self.args, self.hub_model_id, model_name, dataset_name, tags, self._tag_names)
        card.save(f"{self.args.output_dir}/README.md")

    @torch.no_grad()
    def generate_completions(self, sampling: bool = False, num_prompts: int = 8) -> list[dict[str, object]]:
        """Generate for a few evaluation (or training) prompts, print a table and return the rows."""
        dataset = self.eval_dataset if isinstance(self.eval_dataset, Dataset) else self.train_dataset
        batch = self.data_collator([dataset[i] for i in range(min(num_prompts, len(dataset)))])
        batch = {k: v.to(self.accelerator.device) for k, v in batch.items()}
        rollout = self.rollout(batch["input_ids"], batch["attention_mask"], sampling=sampling)
        tokenizer = self.processing_class
        rows = [
            {"query": q, "response": r, "score": s}
            for q, r, s in zip(
                decode_texts(tokenizer, rollout.query_ids, rollout.query_mask),
                decode_texts(tokenizer, rollout.response_ids, rollout.response_mask),
                rollout.scores.tolist(),
                strict=True,
            )
        ]
        rows = [row for part in gather_object([rows]) for row in part]
        if self.accelerator.is_main_process:
            _print_table(rows, title=f"Samples at iteration {self.state.global_step}")
        return rows


# ----------------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------------
def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _policy_and_reference(model, ref_model, peft_config) -> tuple[nn.Module, nn.Module | None]:
    if peft_config is not None:
        from peft import get_peft_model

        if _is_peft(model):
            raise ValueError("model is already a PEFT model; do not pass peft_config as well.")
        model = get_peft_model(model, peft_config)
    if _is_peft(model):
        if ref_model is not None:
            raise ValueError(
                "With a PEFT policy the reference is the model with its adapter disabled: pass ref_model=None."
            )
        return model, None
    if ref_model is None:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    return model, ref_model


def _critic_from(value_model: nn.Module | None, reward_model) -> nn.Module:
    if value_model is not None:
        return value_model
    if not isinstance(reward_model, nn.Module):
        raise ValueError(
            "reward_model is a function, so the critic cannot be initialised from it: pass a value_model "
            "(an AutoModelForSequenceClassification with num_labels=1)."
        )
    critic = copy.deepcopy(reward_model)  # critic initialised from the reward model (§5.3.3)
    critic.requires_grad_(True)
    return critic


def _check_single_label(model) -> None:
    config = getattr(model, "config", None)
    if isinstance(model, nn.Module) and config is not None and getattr(config, "num_labels", 1) != 1:
        raise ValueError(
            f"Reward and value models must output one score (num_labels=1); {type(model).__name__} has "
            f"num_labels={config.num_labels}. Load it with num_labels=1."
        )


def _check_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    if getattr(tokenizer, "pad_token_id", None) is None:
        raise ValueError(
            "The tokenizer has no pad token; add one, e.g. tokenizer.add_special_tokens({'pad_token': '[PAD]'}) and "
            "resize the models' embeddings, or set tokenizer.pad_token to an unused token."
        )
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        logger.warning(
            "The pad token is the eos token (%r). Responses are cut after their first stop token, so this is safe "
            "here, but models that find their last token by the pad id misread such sequences; a dedicated pad "
            "token is safer.",
            tokenizer.eos_token,
        )


def _print_table(rows: list[dict[str, object]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=True)
    for column in ("query", "response", "score"):
        table.add_column(column)
    for row in rows:
        table.add_row(str(row["query"]), str(row["response"]), f"{row['score']:.3f}")
    Console().print(table)


def _shard_in_chunks(num_rows: int, accelerator, chunk: int) -> Iterator[tuple[list[int], torch.Tensor]]:
    """This process's rows ``process_index :: num_processes`` in chunks, padded (with weight 0) so that every
    process runs the same number of chunks — generation may be a collective (ZeRO-3)."""
    rows = list(range(accelerator.process_index, num_rows, accelerator.num_processes))
    per_process = math.ceil(num_rows / accelerator.num_processes)
    weights = [1.0] * len(rows) + [0.0] * (per_process - len(rows))
    rows = rows + [rows[-1] if rows else 0] * (per_process - len(rows))
    for start in range(0, per_process, chunk):
        yield rows[start : start + chunk], torch.tensor(weights[start : start + chunk])
