"""PPOMaxTrainer: PPO-max on the current TRL stack, with trl 1.12's ``PPOTrainer`` constructor.

One PPO iteration, phase by phase (``ppo-max.md``): rollout (generate → policy/reference/critic forwards → score) →
experience (reward normalisation and clipping, token KL, GAE, advantage whitening) → update (epochs × minibatches ×
gradient accumulation) → log. The maths lives in :mod:`trl_ppomax.core`; this module only orchestrates.
"""

from __future__ import annotations

import copy
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from accelerate.utils import gather_object, set_seed
from datasets import Dataset
from torch import nn
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase, Trainer, TrainerCallback
from transformers.trainer_utils import SaveStrategy
from trl import maybe_apply_chat_template
from trl.models.utils import prepare_deepspeed, unwrap_model_for_generation
from trl.trainer.utils import disable_dropout_in_model, pad

from . import core
from .hub import create_model_card
from .ppo_config import PPOMaxConfig
from .rollout import (
    RewardFunction,
    Rollout,
    call_reward_function,
    concat_rollouts,
    decode_texts,
    generate_responses,
    response_logits,
    sequence_inputs,
    sequence_scores,
    token_values,
)


class PolicyAndCritic(nn.Module):
    """Policy and critic behind one ``forward`` so that one ``accelerator.prepare`` (DDP, DeepSpeed) wraps both.

    ``forward`` returns the response logits (B, T, V), the values (B, T) and, when ``ptx_inputs`` is given, the
    policy's logits on that pre-training batch.
    """

    def __init__(self, policy: nn.Module, critic: nn.Module) -> None:
        super().__init__()
        self.policy = policy
        self.critic = critic

    def forward(self, inputs: dict, response_width: int, ptx_inputs: dict | None = None):
        logits = response_logits(self.policy, inputs, response_width)
        values = token_values(self.critic, inputs, response_width)
        ptx_logits = self.policy(**ptx_inputs, use_cache=False).logits if ptx_inputs is not None else None
        return logits, values, ptx_logits

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        kwargs = gradient_checkpointing_kwargs or {"use_reentrant": False}
        for model in (self.policy, self.critic):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    @property
    def is_gradient_checkpointing(self) -> bool:
        flag = getattr(type(self.policy), "is_activation_checkpointing", None)
        name = "is_activation_checkpointing" if flag is not None else "is_gradient_checkpointing"
        return bool(getattr(self.policy, name, False))

    def gradient_checkpointing_disable(self) -> None:
        self.policy.gradient_checkpointing_disable()
        self.critic.gradient_checkpointing_disable()


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

        train_dataset = prepare_prompt_dataset(train_dataset, processing_class, args.dataset_num_proc)
        if isinstance(eval_dataset, Dataset):
            eval_dataset = prepare_prompt_dataset(eval_dataset, processing_class, args.dataset_num_proc)
        if len(train_dataset) < args.local_batch_size:
            raise ValueError(
                f"The training dataset has {len(train_dataset)} prompts, fewer than one rollout batch per process "
                f"(per_device_train_batch_size × gradient_accumulation_steps × num_mini_batches = "
                f"{args.local_batch_size}); add prompts or lower those sizes."
            )
        self.total_episodes, self.num_total_batches = args.num_iterations(len(train_dataset))
        self.ptx_dataset = ptx_dataset

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
        self.running_reward = core.RunningMoments()
        self._prepare_models()

    # ------------------------------------------------------------------------------------------------------------
    # Set-up
    # ------------------------------------------------------------------------------------------------------------
    def _prepare_models(self) -> None:
        num_updates = self.num_total_batches * self.args.num_ppo_epochs * self.args.num_mini_batches
        self.create_optimizer_and_scheduler(num_training_steps=num_updates)
        if self.args.activation_checkpointing:
            self.model.gradient_checkpointing_enable(self.args.activation_checkpointing_kwargs)
        self.dataloader = self.get_train_dataloader()
        self.model_wrapped, self.optimizer, self.dataloader = self.accelerator.prepare(
            self.model, self.optimizer, self.dataloader
        )
        if self.is_deepspeed_enabled:
            self.deepspeed = self.model_wrapped
        for name in ("ref_model", "reward_model"):
            module = getattr(self, name)
            if isinstance(module, nn.Module):
                module.eval()
                if self.is_deepspeed_enabled:
                    setattr(self, name, prepare_deepspeed(module, self.accelerator))
                else:
                    module.to(self.accelerator.device)
        self.ptx_batches = self._ptx_batches() if self.ptx_dataset is not None and self.args.ptx_coef > 0 else None

    def get_train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_dataset,
            batch_size=self.args.local_batch_size,
            shuffle=True,
            collate_fn=self.data_collator,
            drop_last=True,
        )

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

    def _ptx_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        dataset = prepare_text_dataset(self.ptx_dataset, self.processing_class, self.args.dataset_num_proc)
        loader = self.accelerator.prepare(
            DataLoader(
                dataset,
                batch_size=self.args.per_device_train_batch_size,
                shuffle=True,
                collate_fn=PromptCollator(self.processing_class.pad_token_id, padding_side="right"),
                drop_last=True,
            )
        )
        while True:
            yield from loader

    # ------------------------------------------------------------------------------------------------------------
    # The loop
    # ------------------------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs) -> None:
        """Run ``num_total_batches`` PPO-max iterations."""
        if resume_from_checkpoint:
            raise NotImplementedError("Resuming a PPO-max run is not supported yet; start a new run.")
        args = self.args
        set_seed(args.seed, device_specific=True)  # a different sampling seed on each process
        self._begin_state()
        prompts = _forever(self.dataloader)
        pending: dict[str, list[float]] = defaultdict(list)
        start = time.time()
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        for iteration in range(1, self.num_total_batches + 1):
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            batch = next(prompts)
            rollout = self.rollout(batch["input_ids"], batch["attention_mask"])
            experience, metrics = self.make_experience(rollout)
            metrics.update(self.ppo_update(experience, critic_only=iteration <= args.critic_warmup_steps))
            self.state.global_step = iteration
            self.state.episode = iteration * args.batch_size
            self.state.epoch = self.state.episode / len(self.train_dataset)
            for name, value in metrics.items():
                pending[name].append(value)
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            self._maybe_log_save(pending, iteration, start)
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        if self.control.should_save:
            self._save_checkpoint(self.model, trial=None)

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

    def _maybe_log_save(self, pending: dict[str, list[float]], iteration: int, start: float) -> None:
        """Log the mean of each metric since the last log, with the current counters and learning rates."""
        if self.control.should_log or iteration == self.num_total_batches:
            means = {name: sum(values) / len(values) for name, values in pending.items()}
            self.log({**means, **self._schedule_metrics(start)})
            pending.clear()
        if self.args.num_sample_generations > 0 and iteration % self.sample_every == 0:
            self.generate_completions(sampling=True)
        if self.control.should_save:
            self._save_checkpoint(self.model, trial=None)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def _schedule_metrics(self, start: float) -> dict[str, float]:
        lrs = self.lr_scheduler.get_last_lr()
        return {
            "episode": float(self.state.episode),
            "eps": self.state.episode / max(time.time() - start, 1e-9),
            "lr": lrs[0],
            "critic/lr": lrs[-1],
        }

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
    def make_experience(self, rollout: Rollout) -> tuple[Experience, dict[str, float]]:
        """Shape rewards (normalise + clip, token KL) and compute GAE advantages and returns (§5.3)."""
        args, mask = self.args, rollout.response_mask
        reduce = self._reduce_sum
        self.running_reward.update(rollout.scores, reduce=reduce)
        scores = core.normalize_scores(
            rollout.scores,
            self.running_reward.mean,
            self.running_reward.std,
            args.reward_norm,
            clip=args.reward_clip or None,
        )
        kl = core.kl_penalty(rollout.logprobs, rollout.ref_logprobs, args.kl_estimator) * mask
        rewards, non_score = core.token_rewards(scores, kl, mask, args.kl_coef)
        if args.whiten_rewards:
            rewards = core.masked_whiten(rewards, mask, shift_mean=False, reduce=reduce)
        advantages, returns = core.compute_gae(rewards, rollout.values, mask, args.gamma, args.lam)
        normalised = core.normalize_advantages(
            advantages, mask, whiten=args.whiten_advantages, clip=args.advantage_clip, reduce=reduce
        )
        old = rollout.ref_logprobs if args.importance_sampling == "reference" else rollout.logprobs
        experience = Experience(rollout=rollout, old_logprobs=old, advantages=normalised, returns=returns)
        return experience, self._rollout_metrics(rollout, scores, kl, non_score, advantages, returns)

    def _reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction="sum") if self.accelerator.num_processes > 1 else tensor

    def _rollout_metrics(self, rollout, scores, kl, non_score, advantages, returns) -> dict[str, float]:
        mask = rollout.response_mask.float()
        kl_sum, non_score_sum = kl.sum(1), non_score.sum(1)
        per_sequence = {
            "objective/kl": kl_sum,
            "objective/non_score_reward": non_score_sum,
            "objective/rlhf_reward": scores + non_score_sum,
            "objective/scores": rollout.scores,
            "objective/scores_normalized": scores,
            "policy/perplexity": rollout.policy_perplexity,
            "policy/ref_perplexity": rollout.ref_perplexity,
            "response/length": mask.sum(1),
            "response/stop_token_missing": 1.0 - self._ends_with_stop(rollout.response_ids, rollout.response_mask),
        }
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
        total = self._reduce_sum(torch.stack([per_sequence.float().sum(), torch.tensor(float(len(per_sequence)))]))
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
        ptx_inputs = next(self.ptx_batches) if self.ptx_batches is not None else None
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

    def _optimizer_step(self, critic_only: bool) -> dict[str, torch.Tensor]:
        """Clip the policy's and the critic's gradients separately (App. C.2), then step."""
        wrapper = self.accelerator.unwrap_model(self.model_wrapped)
        stats = {}
        if not self.is_deepspeed_enabled:
            if critic_only:
                for parameter in wrapper.policy.parameters():
                    parameter.grad = None  # the optimizer skips parameters without gradients
            max_norm = self.args.max_grad_norm or float("inf")
            for name, module in (("policy", wrapper.policy), ("critic", wrapper.critic)):
                params = [p for p in module.parameters() if p.grad is not None]
                if params:
                    stats[f"{name}/grad_norm"] = self.accelerator.clip_grad_norm_(params, max_norm).detach()
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad()
        return stats

    # ------------------------------------------------------------------------------------------------------------
    # Saving, samples, model card
    # ------------------------------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the policy (and tokenizer) as a plain transformers (or PEFT adapter) checkpoint."""
        wrapper, wrapped = self.model, self.model_wrapped
        self.model = self.accelerator.unwrap_model(wrapper).policy
        engine = getattr(self, "deepspeed", None)
        if self.is_deepspeed_enabled:
            self.deepspeed = self.model  # state dict of the policy alone, not of the policy-and-critic engine
        try:
            super().save_model(output_dir, _internal_call)
        finally:
            self.model, self.model_wrapped = wrapper, wrapped
            if self.is_deepspeed_enabled:
                self.deepspeed = engine

    def _save_checkpoint(self, model, trial) -> None:
        if self.args.save_strategy == SaveStrategy.BEST and self.args.metric_for_best_model is None:
            return
        super()._save_checkpoint(model, trial)

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
class PromptCollator:
    """Pads ``input_ids`` (left by default, as generation needs) and builds the attention mask."""

    def __init__(self, pad_token_id: int, padding_side: str = "left") -> None:
        self.pad_token_id, self.padding_side = pad_token_id, padding_side

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        ids = [torch.as_tensor(e["input_ids"], dtype=torch.long) for e in examples]
        masks = [torch.ones_like(i) for i in ids]
        return {
            "input_ids": pad(ids, padding_value=self.pad_token_id, padding_side=self.padding_side),
            "attention_mask": pad(masks, padding_value=0, padding_side=self.padding_side),
        }


def prepare_prompt_dataset(dataset: Dataset, tokenizer: PreTrainedTokenizerBase, num_proc: int | None) -> Dataset:
    """Keep a tokenized ``input_ids`` column, or tokenize ``prompt`` (text, or a conversation with the chat template)."""
    if len(dataset) == 0:
        raise ValueError("The prompt dataset is empty.")
    columns = dataset.column_names
    if "input_ids" in columns:
        return dataset.select_columns(["input_ids"])
    if "prompt" not in columns:
        raise ValueError(
            f"A prompt dataset needs an 'input_ids' column (tokenized, trl 1.12 style) or a 'prompt' column (text or "
            f"conversation); this one has {columns}."
        )

    def tokenize(example: dict) -> dict:
        text = maybe_apply_chat_template({"prompt": example["prompt"]}, tokenizer)["prompt"]
        return {"input_ids": tokenizer(text, add_special_tokens=False)["input_ids"]}

    return dataset.map(tokenize, remove_columns=columns, num_proc=num_proc, desc="Tokenizing prompts")


def prepare_text_dataset(dataset: Dataset, tokenizer: PreTrainedTokenizerBase, num_proc: int | None) -> Dataset:
    """Tokenized ``input_ids`` for the ptx loss, from ``input_ids`` or ``text`` columns."""
    if "input_ids" in dataset.column_names:
        return dataset.select_columns(["input_ids"])
    if "text" not in dataset.column_names:
        raise ValueError(f"ptx_dataset needs an 'input_ids' or 'text' column; it has {dataset.column_names}.")
    return dataset.map(
        lambda e: {"input_ids": tokenizer(e["text"])["input_ids"]},
        remove_columns=dataset.column_names,
        num_proc=num_proc,
        desc="Tokenizing ptx texts",
    )


def _forever(loader: DataLoader) -> Iterator[dict[str, torch.Tensor]]:
    while True:
        yield from loader


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


def _print_table(rows: list[dict[str, object]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=True)
    for column in ("query", "response", "score"):
        table.add_column(column)
    for row in rows:
        table.add_row(str(row["query"]), str(row["response"]), f"{row['score']:.3f}")
    Console().print(table)
