"""PPOMaxTrainer: PPO-max on the current TRL stack, with trl 1.12's ``PPOTrainer`` constructor.

One PPO iteration, phase by phase (the paper's §3.2 and §5): rollout (generate → policy/reference/critic forwards →
score) → experience (reward normalisation and clipping, token KL, GAE, advantage whitening) → update (epochs ×
minibatches × gradient accumulation) → log. The maths lives in :mod:`trl_ppomax.ppo.core`, models in
:mod:`~trl_ppomax.models`, rewards in :mod:`~trl_ppomax.rewards`, saving and resuming in
:mod:`~trl_ppomax.ppo.checkpoint`; this module only orchestrates.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from accelerate.utils import set_seed
from datasets import Dataset
from torch import nn
from transformers import PreTrainedTokenizerBase, Trainer, TrainerCallback
from transformers.trainer_utils import IntervalStrategy, SaveStrategy
from trl.trainer.utils import selective_log_softmax, selective_log_softmax_and_entropy

from trl_ppomax import data, rewards
from trl_ppomax import models as modeling
from trl_ppomax.generation import HFGeneration
from trl_ppomax.generation.vllm import VLLMEngine
from trl_ppomax.models import PolicyAndCritic
from trl_ppomax.ppo import checks, core, optim
from trl_ppomax.ppo import metrics as M
from trl_ppomax.ppo.advantages import ESTIMATORS
from trl_ppomax.ppo.checkpoint import CheckpointMixin
from trl_ppomax.ppo.config import PPOMaxConfig
from trl_ppomax.ppo.evaluation import EvaluationMixin
from trl_ppomax.ppo.experience import (
    Experience,
    Rollout,
    drop_non_finite,
    kept_gather,
    logprobs_and_perplexity,
    merge_rollouts,
    pad_right,
    sequence_inputs,
    take_rows,
    token_budget_batches,
    trim_query_padding,
)
from trl_ppomax.ppo.state import PPOState
from trl_ppomax.reporting.hub import TAGS
from trl_ppomax.reporting.plotting import DynamicsFigureCallback

logger = logging.getLogger(__name__)


class PPOMaxTrainer(CheckpointMixin, EvaluationMixin, Trainer):
    """PPO-max trainer with the constructor of trl 1.12's ``PPOTrainer``.

    Args:
        args: a [`PPOMaxConfig`].
        processing_class: the tokenizer (a pad token is required).
        model: the policy, a causal LM (a PEFT model, or wrapped with ``peft_config``).
        ref_model: frozen reference policy; ``None`` copies ``model``, or, for PEFT, disables the adapter.
        reward_model: a sequence-classification model with one label (or its path / Hub id), a reward function as
            TRL's GRPO takes (``f(prompts=, completions=, completion_ids=, **dataset columns)``, or the old positional
            ``f(prompts, completions)``), or a list mixing them, summed with ``args.reward_weights``.
        reward_funcs: TRL's name for the same; takes precedence over ``reward_model``. ``reward_processing_classes``:
            one tokenizer per source for reward models with their own vocabulary (None: the policy's).
        train_dataset: prompts, as ``input_ids`` (trl 1.12 style) or ``prompt`` (text or conversation).
        value_model: the critic; ``None`` initialises it from the reward model (§5.3.3).
        ptx_dataset: texts (``text``/``input_ids``) for the PPO-ptx loss, used when ``args.ptx_coef > 0``.
        rollout_metrics: extra per-response measurements to log, ``{name: f(prompts, completions) -> list[float]}``
            on the decoded texts (e.g. a gold reward, a rule-based check); logged as ``name`` (and ``eval_name``).
    """

    _tag_names = tuple(TAGS)

    def __init__(
        self,
        args: PPOMaxConfig,
        processing_class: PreTrainedTokenizerBase,
        model: nn.Module,
        ref_model: nn.Module | None,
        reward_model: nn.Module | rewards.RewardFunction | list | None = None,
        train_dataset: Dataset | None = None,
        value_model: nn.Module | None = None,
        data_collator: Callable | None = None,
        eval_dataset: Dataset | dict[str, Dataset] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        callbacks: list[TrainerCallback] | None = None,
        peft_config=None,
        *,
        ptx_dataset: Dataset | None = None,
        rollout_metrics: dict[str, rewards.RewardFunction] | None = None,
        reward_funcs: nn.Module | rewards.RewardFunction | list | None = None,
        reward_processing_classes: list | None = None,
    ) -> None:
        reward_model = reward_funcs if reward_funcs is not None else reward_model
        models = dict(model=model, ref_model=ref_model, reward_model=reward_model, value_model=value_model)
        # Checks that fail before anything expensive, naming the argument and the fix; paths are loaded (checks.py)
        processing_class, model, ref_model, reward_model, value_model = checks.check_inputs(
            args, processing_class, models, train_dataset, eval_dataset, ptx_dataset, peft_config
        )
        self.stop_token_id = processing_class.eos_token_id if args.stop_token == "eos" else args.stop_token_id
        # missing_eos_penalty punishes the absence of the stop token, or of eos when none is configured
        self._stop_id = self.stop_token_id if self.stop_token_id is not None else processing_class.eos_token_id
        self.reward_sources = rewards.RewardSources(reward_model, reward_processing_classes, args.reward_weights)
        reward_model = self.reward_model = self.reward_sources.critic_source(value_model)
        policy, self.ref_model, critic = modeling.build_models(
            args, model, ref_model, reward_model, value_model, peft_config
        )
        self.is_peft_model = modeling.is_peft(policy)
        # The models the user passed, by argument name: a reference or critic copied for None is not theirs to blame
        built = dict(policy=policy, ref_model=self.ref_model if ref_model is not None else None)
        built.update(
            self.reward_sources.shared_vocabulary_models(), value_model=critic if value_model is not None else None
        )
        train_dataset, eval_dataset = checks.prepare_and_check(
            args, processing_class, built, self.stop_token_id, train_dataset, eval_dataset, rollout_metrics
        )
        args.set_run_length(len(train_dataset))  # total_episodes, num_total_batches (trl 1.12 writes them back)
        self.ptx_dataset = ptx_dataset
        self.rollout_metrics = dict(rollout_metrics or {})

        super().__init__(
            model=PolicyAndCritic(policy, critic),
            args=args,
            data_collator=data_collator or data.PromptCollator(processing_class.pad_token_id),
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        # The training-dynamics figure to the trackers; the live callback list says where TensorBoard writes
        self.add_callback(DynamicsFigureCallback(self.callback_handler.callbacks))
        # The Trainer leaves accumulation to itself (1 in accelerate); PPO's update loop lets accelerate do it.
        self.accelerator.gradient_accumulation_steps = args.gradient_accumulation_steps
        # What a resume restores beyond TrainerState (moments, counters, ptx position), saved by checkpointing
        self.ppo_state = PPOState(rewards.initial_reward_moments(self.reward_sources, args.reward_norm))
        self._prepare_models()
        # The rollout's first half, generation (generation.py): the policy's generate, or vLLM (vllm_engine.py)
        policy = self.accelerator.unwrap_model(self.model_wrapped).policy
        if args.use_vllm:
            self.generation = VLLMEngine(args, self.accelerator, policy, processing_class, self.stop_token_id)
        else:
            self.generation = HFGeneration(policy, args, self.stop_token_id, processing_class.pad_token_id)

    @property
    def vllm(self) -> VLLMEngine | None:
        """The vLLM engine when ``use_vllm=True`` (the generation engine then), else None."""
        return self.generation if isinstance(self.generation, VLLMEngine) else None

    @property
    def total_episodes(self) -> int:
        return self.args.total_episodes

    @property
    def num_total_batches(self) -> int:
        return self.args.num_total_batches

    @property
    def _episodes_per_epoch(self) -> int:
        return len(self.train_dataset) * self.args.num_samples_per_prompt

    # ------------------------------------------------------------------------------------------------------------
    # Set-up
    # ------------------------------------------------------------------------------------------------------------
    def _prepare_models(self) -> None:
        num_updates = self.num_total_batches * self.args.num_ppo_epochs * self.args.num_mini_batches
        self.create_optimizer_and_scheduler(num_training_steps=num_updates)
        enabled, kwargs = self.args.checkpointing
        if enabled:
            self.model.gradient_checkpointing_enable(kwargs)
        self.model_wrapped, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)
        checks.check_engine(self.is_fsdp_enabled, self.accelerator.distributed_type)
        if self.is_deepspeed_enabled:
            self.deepspeed = self.model_wrapped
        if isinstance(self.ref_model, nn.Module):
            self.ref_model = modeling.prepare_frozen(self.ref_model, self.accelerator)
        self.reward_sources.prepare(lambda module: modeling.prepare_frozen(module, self.accelerator))
        self.prompt_batches, self.ptx_batches = data.batch_streams(
            self.train_dataset,
            self.ptx_dataset,
            self.processing_class,
            self.args,
            self.accelerator,
            self.data_collator,
        )

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """AdamW (or ``args.optim``) with separate learning rates for the policy and the critic (§5.4)."""
        if self.optimizer is not None:
            return self.optimizer
        wrapper, args = self.model, self.args
        groups = optim.param_groups(wrapper, set(self.get_decay_parameter_names(wrapper)), args)
        optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, wrapper)
        optimizer_kwargs.pop("lr", None)
        self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        """``args.lr_scheduler_type`` over every optimizer step; with critic warm-up, shifted so that it replaces the
        critic's LR warm-up (``critic_warmup_replaces_lr_warmup``, :func:`optim.after_critic_warmup`)."""
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        self.lr_scheduler = optim.schedule_with_critic_warmup(scheduler, self.args, num_training_steps)
        return self.lr_scheduler

    # ------------------------------------------------------------------------------------------------------------
    # The loop
    # ------------------------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs) -> None:
        """Run ``num_total_batches`` PPO-max iterations; ``resume_from_checkpoint`` (a path, or True for the newest
        checkpoint in ``output_dir``) continues an interrupted run exactly where it stopped."""
        args = self.args
        self._start_run(resume_from_checkpoint)  # once per trainer; output_dir and checkpoint checks (checkpoint.py)
        set_seed(args.seed, device_specific=True)  # a different sampling seed on each process
        self._begin_state()
        if resume_from_checkpoint:
            self._resume(resume_from_checkpoint)
        pending: dict[str, list[float]] = defaultdict(list)
        start = (time.time(), self.state.episode)
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        if not resume_from_checkpoint:  # a resumed run evaluated its step 0 before it stopped
            self._evaluate_initial_policy()
        for iteration in range(self.state.global_step + 1, self.num_total_batches + 1):
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            for name, value in self.training_iteration(iteration).items():
                pending[name].append(value)
            self.state.global_step = iteration
            self.state.episode = iteration * args.batch_size
            self.state.epoch = self.state.episode / self._episodes_per_epoch
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            self._log_evaluate_save(pending, iteration, start)
            if self.control.should_training_stop:
                break
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        if self.state.global_step >= self.num_total_batches:
            self._load_best_model()

    def training_iteration(self, iteration: int) -> dict[str, float]:
        """One PPO-max iteration on rollout batch ``iteration``. Samples with a non-finite reward are dropped; a batch
        with none left, or a non-finite value or log-prob, is skipped (:meth:`PPOState.count_iteration`)."""
        batch, columns = data.split_batch(self.prompt_batches[iteration - 1], self.accelerator.device)
        n = self.args.num_samples_per_prompt
        rollout = self.rollout(batch["input_ids"], batch["attention_mask"], columns=columns, samples_per_prompt=n)
        experience, metrics, problem = self.make_experience(rollout)
        args = self.args
        if experience is not None:
            skipped = self.ppo_state.counters[M.SKIPPED_UPDATES]
            metrics.update(self.ppo_update(experience, critic_only=iteration <= args.critic_warmup_steps))
            steps = args.num_ppo_epochs * args.num_mini_batches
            if self.ppo_state.counters[M.SKIPPED_UPDATES] - skipped == steps:  # nothing was trained
                problem = f"non-finite gradients: all {steps} optimizer steps skipped"
            elif iteration > args.critic_warmup_steps:
                self.generation.on_policy_updated()  # e.g. vLLM gets the new weights before the next rollout
        self.ppo_state.count_iteration(problem, iteration, self.num_total_batches, args.max_skipped_iterations)
        metrics.update(self.generation.pop_metrics())
        if iteration == self.args.critic_warmup_steps and self.is_deepspeed_enabled:
            optim.restart_policy_adam(self.optimizer)  # the policy starts training next: a fresh Adam for it
        metrics.update({name: float(value) for name, value in self.ppo_state.counters.items()})
        return metrics

    def _begin_state(self) -> None:
        self.state.max_steps = self.num_total_batches
        self.state.num_train_epochs = self.total_episodes / self._episodes_per_epoch
        self.state.global_step = 0
        self.state.episode = 0
        self.state.epoch = 0.0
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
            self.log({**means, **M.schedule_metrics(self.state, self.lr_scheduler, start)})
            pending.clear()
        if self.control.should_evaluate:
            is_best = self._determine_best_metric(self.evaluate(), trial=None)
            if self.args.save_strategy == SaveStrategy.BEST:
                self.control.should_save = is_best
        if self.args.num_sample_generations > 0 and iteration % self.sample_every == 0:
            self.generate_completions(sampling=True)
        self._save_if_asked()

    def _evaluate_initial_policy(self) -> None:
        """Step 0 of a fresh run that evaluates during training (``eval_strategy`` not "no", or ``eval_on_start``):
        evaluate the initial policy before its first update, as the paper's release does. It is the first candidate
        for the best model, kept as ``checkpoint-0`` when the best model must be loadable (``load_best_model_at_end``
        or ``save_strategy="best"``)."""
        args = self.args
        if args.eval_strategy == IntervalStrategy.NO and not args.eval_on_start:
            return
        is_best = self._determine_best_metric(self.evaluate(), trial=None)
        keeps_best = args.load_best_model_at_end or args.save_strategy == SaveStrategy.BEST
        self.control.should_save = is_best and keeps_best and args.save_strategy != SaveStrategy.NO
        self._save_if_asked()

    def _save_if_asked(self) -> None:
        if self.control.should_save:
            self._save_checkpoint(self.model, trial=None)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    # ------------------------------------------------------------------------------------------------------------
    # Phase 1: rollout
    # ------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def rollout(
        self, query_ids: torch.Tensor, query_mask: torch.Tensor, sampling=True, columns=None, samples_per_prompt=1
    ) -> Rollout:
        """Sample (or, ``sampling=False``, greedily decode) ``samples_per_prompt`` responses to each left-padded prompt,
        in chunks of ``local_rollout_forward_batch_size`` responses, then run the no-grad forwards in micro-batches
        (:meth:`_forward_groups`): the policy's and reference's log-probs, with only the policy gathered under ZeRO-3
        (the critic stays sharded), then the critic's values and the rewards (given the dataset's other ``columns``
        of these prompts, lists). Row ``i·n + j`` holds prompt ``i``'s ``j``-th sample."""
        n, pad_id = samples_per_prompt, self.processing_class.pad_token_id
        size = max(1, self.args.local_rollout_forward_batch_size // n)
        chunks = [(query_ids[i : i + size], query_mask[i : i + size]) for i in range(0, len(query_ids), size)]
        query_ids, query_mask = query_ids.repeat_interleave(n, 0), query_mask.repeat_interleave(n, 0)
        columns = data.repeat_rows(columns, n)
        self.model.eval()
        with modeling.fsdp_unsharded(self.model_wrapped, *(m for _, m in self.reward_sources.modules)):
            with modeling.policy_for_generation(self.model_wrapped, self.accelerator, self.args) as wrapper:
                samples = [self.generation.generate(i, m, sampling, n) for i, m in data.progress(chunks, self.args)]
                responses, mask, sampler = zip(*samples, strict=True)
                responses, mask = pad_right(responses, pad_id), pad_right(mask, 0)
                sampler = None if sampler[0] is None else pad_right(sampler, 0.0)
                groups, count = self._forward_groups(query_mask, mask)
                padded = groups + [groups[0][:1]] * (count - len(groups))  # as many forwards as other processes
                generated = [
                    self._logprobs(wrapper, query_ids[g], query_mask[g], responses[g], mask[g], take_rows(sampler, g))
                    for g in padded
                ]
            critic = self.accelerator.unwrap_model(self.model_wrapped).critic
            parts = [
                self._score(critic, fields, data.rows_of(columns, g.tolist()))
                for g, fields in zip(padded, generated, strict=True)
            ]
        self.model.train()
        return merge_rollouts(parts[: len(groups)], groups, pad_id)

    @torch.no_grad()
    def sample_and_score(self, query_ids, query_mask, sampling=True, columns=None) -> Rollout:
        """Responses to left-padded prompts and their scores (after the missing-stop-token penalty), for sample tables:
        a :class:`Rollout` without the log-prob and value forwards of :meth:`rollout` (those fields are empty)."""
        self.model.eval()
        with modeling.fsdp_unsharded(self.model_wrapped, *(m for _, m in self.reward_sources.modules)):
            with modeling.policy_for_generation(self.model_wrapped, self.accelerator, self.args):
                responses, mask, _ = self.generation.generate(query_ids, query_mask, sampling, 1)
            inputs = sequence_inputs(query_ids, query_mask, responses, mask)
            scores, _ = self.reward_sources.score(self.processing_class, inputs, query_mask, mask, columns)
        self.model.train()
        scores = rewards.apply_missing_eos_penalty(
            scores, responses, mask, self._stop_id, self.args.missing_eos_penalty
        )
        unmeasured = dict.fromkeys(("logprobs", "ref_logprobs", "values", "policy_perplexity", "ref_perplexity"))
        return Rollout(query_ids, query_mask, responses, mask, scores=scores, **unmeasured)

    def _forward_groups(self, query_mask: torch.Tensor, response_mask: torch.Tensor) -> tuple[list[torch.Tensor], int]:
        """Row indices of the no-grad forward micro-batches, and how many forwards every process runs: packed under
        ``max_tokens_per_microbatch`` (:meth:`_token_budget_groups`), else consecutive
        ``local_rollout_forward_batch_size`` rows."""
        if self.args.max_tokens_per_microbatch is not None:
            return self._token_budget_groups(query_mask, response_mask)
        rows = torch.arange(len(query_mask), device=query_mask.device)
        groups = list(rows.split(self.args.local_rollout_forward_batch_size))
        return groups, len(groups)

    def _logprobs(self, wrapper: PolicyAndCritic, query_ids, query_mask, responses, mask, sampler_logprobs) -> dict:
        """The policy's and reference's log-probs and perplexities of one micro-batch: Rollout fields (the prompts as
        given, the responses trimmed to the longest)."""
        width = max(int(mask.sum(1).max()), 1)
        responses, mask = responses[:, :width], mask[:, :width]
        inputs = sequence_inputs(*self._forward_queries(query_ids, query_mask), responses, mask)
        temperature = self.args.effective_logprob_temperature
        policy_logits = modeling.response_logits(wrapper.policy, inputs, width)
        logprobs, policy_perplexity = logprobs_and_perplexity(policy_logits, responses, mask, temperature)
        weights = (  # vLLM sampled: the gap to the HF forward, corrected when configured
            None
            if sampler_logprobs is None
            else self.generation.importance_weights(policy_logits, responses, mask, sampler_logprobs[:, :width])
        )
        with modeling.reference_policy(self.ref_model, wrapper.policy, self.args.ref_adapter_name) as reference:
            ref_logits = modeling.response_logits(reference, inputs, width)
            ref_logprobs, ref_perplexity = logprobs_and_perplexity(ref_logits, responses, mask, temperature)
        return dict(
            query_ids=query_ids,
            query_mask=query_mask,
            response_ids=responses,
            response_mask=mask,
            logprobs=logprobs,
            ref_logprobs=ref_logprobs,
            policy_perplexity=policy_perplexity,
            ref_perplexity=ref_perplexity,
            sampling_weights=weights,
        )

    def _forward_queries(self, query_ids, query_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro-batch's prompts as its forwards see them: under a token budget, without their all-padding columns."""
        if self.args.max_tokens_per_microbatch is None:
            return query_ids, query_mask
        return trim_query_padding(query_ids, query_mask)

    def _score(self, critic: nn.Module, fields: dict, columns: dict) -> Rollout:
        """A generated chunk with the critic's values and its rewards (minus the missing-stop-token penalty)."""
        responses, mask = fields["response_ids"], fields["response_mask"]
        query_ids, query_mask = self._forward_queries(fields["query_ids"], fields["query_mask"])
        inputs = sequence_inputs(query_ids, query_mask, responses, mask)
        tokenizer, penalty = self.processing_class, self.args.missing_eos_penalty
        scores, source_scores = self.reward_sources.score(tokenizer, inputs, query_mask, mask, columns)
        return Rollout(
            **fields,
            source_scores=source_scores,
            values=modeling.token_values(critic, inputs, mask.shape[1]) * mask,
            scores=rewards.apply_missing_eos_penalty(scores, responses, mask, self._stop_id, penalty),
        )

    # ------------------------------------------------------------------------------------------------------------
    # Phase 2: rewards and advantages
    # ------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def make_experience(self, rollout: Rollout) -> tuple[Experience | None, dict[str, float], str | None]:
        """Shape rewards (normalise + clip, token KL) and estimate advantages and returns (§5.3; ``advantage_estimator``,
        :mod:`~trl_ppomax.ppo.advantages`); samples with a non-finite score are masked out
        (:func:`rollout.drop_non_finite`). Returns ``(experience, metrics, None)``, or ``(None, {}, why)`` on every
        process when none is left or a number is non-finite: such a batch leaves the moments unchanged."""
        rollout, keep, dropped, problem = drop_non_finite(rollout, self._reduce_sum)
        args, mask, reduce, moments = self.args, rollout.response_mask, self._reduce_sum, self.ppo_state.running_reward
        self.ppo_state.counters[M.SKIPPED_SAMPLES] += dropped
        if problem:
            return None, {}, problem
        before = moments.state_dict()  # restored if the batch is skipped below
        if not self._reward_moments_frozen():
            moments.update(self._winsorized(rollout.scores, keep)[keep], reduce=reduce)
        scores, kl = self._shape_scores(rollout)
        token_rewards, _ = core.token_rewards(scores, kl, mask, args.kl_coef)
        if args.whiten_rewards:
            token_rewards = core.masked_whiten(token_rewards, mask, shift_mean=False, reduce=reduce)
        estimate = ESTIMATORS[args.advantage_estimator].estimate(token_rewards, rollout.values, mask, args)
        advantages, returns = estimate.advantages, estimate.returns
        normalised = advantages
        if args.advantage_whitening_scope == "batch":  # else per minibatch, in ppo_update
            normalised = core.normalize_advantages(
                advantages, mask, args.whiten_advantages, args.advantage_clip, reduce
            )
        if not self._all_finite(normalised, returns):
            moments.load_state_dict(before)
            return None, {}, "non-finite advantages or returns"
        old = rollout.ref_logprobs if args.importance_sampling == "reference" else rollout.logprobs
        experience = Experience(rollout, old, advantages=normalised, returns=returns, raw_advantages=advantages)
        metrics = self._rollout_metrics(rollout, keep, scores, kl, advantages, returns)
        if isinstance(estimate.lam_policy, torch.Tensor):
            metrics[M.LAM_POLICY] = M.global_mean(estimate.lam_policy[keep], reduce)
        if args.num_samples_per_prompt > 1:
            n = args.num_samples_per_prompt
            metrics[M.SCORES_STD_WITHIN_PROMPT] = M.within_prompt_std(rollout.scores, keep, n, reduce)
        if args.reward_winsorize is not None:
            clipped = self._winsorized(rollout.scores) != rollout.scores
            metrics[M.SCORES_WINSORIZED] = M.global_mean(clipped[keep], reduce)
        return experience, metrics, None

    def _reward_moments_frozen(self) -> bool:
        """With ``reward_norm_freeze``: the moments stop learning after the first ``max(critic_warmup_steps, 1)``
        iterations, whose samples come from the starting policy."""
        seeding = max(self.args.critic_warmup_steps, 1)
        return bool(self.args.reward_norm_freeze) and self.state.global_step >= seeding

    def _winsorized(self, scores: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The raw scores (B,), with ``reward_winsorize`` k clipped to μ ± k·σ of the moments; while those are empty,
        to the kept batch's median ± k·1.4826·MAD over every process when ``keep`` is given (the batch that seeds
        them), else left as they are."""
        moments, k = self.ppo_state.running_reward, self.args.reward_winsorize
        if k is None:
            return scores
        if moments.count > 1:
            return core.winsorize(scores, moments.mean, moments.std, k)
        if keep is None:
            return scores
        center, scale = core.robust_location_scale(kept_gather(keep, self.accelerator.gather)(scores))
        return core.winsorize(scores, center, scale, k)

    def _shape_scores(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised and clipped scores (B,) with the current running moments (the raw scores winsorised first with
        ``reward_winsorize``), and the per-token KL (B, T)."""
        args, moments = self.args, self.ppo_state.running_reward
        raw = self._winsorized(rollout.scores)
        scores = core.normalize_scores(raw, moments.mean, moments.std, args.reward_norm, args.reward_clip)
        kl = core.kl_penalty(rollout.logprobs, rollout.ref_logprobs, args.kl_estimator) * rollout.response_mask
        return scores, kl

    def _response_metrics(self, rollout: Rollout, scores: torch.Tensor, kl: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-response monitoring values (B,): the user's ``rollout_metrics`` and :data:`metrics.PER_RESPONSE`."""
        return {
            **rewards.text_metrics(self.rollout_metrics, self.processing_class, rollout),
            **self.reward_sources.metrics(rollout.source_scores),
            **M.response_metrics(rollout, scores, kl, self.args.kl_coef, self._stop_id),
        }

    def _rollout_metrics(self, rollout, keep, scores, kl, advantages, returns) -> dict[str, float]:
        per_response = self._response_metrics(rollout.select(keep), scores[keep], kl[keep])  # the kept samples only
        metrics = {name: M.global_mean(value, self._reduce_sum) for name, value in per_response.items()}
        gather = kept_gather(keep, self.accelerator.gather)
        batch = M.batch_metrics(rollout, advantages, returns, self.ppo_state.running_reward, self._reduce_sum, gather)
        return {**metrics, **batch}

    def _all_finite(self, *tensors: torch.Tensor) -> bool:
        """Whether every tensor is finite on every process (one reduction)."""
        bad = sum((~torch.isfinite(t)).sum() for t in tensors).float()
        return self._reduce_sum(bad.reshape(1)).item() == 0

    def _reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction="sum") if self.accelerator.num_processes > 1 else tensor

    # ------------------------------------------------------------------------------------------------------------
    # Phase 3: PPO update
    # ------------------------------------------------------------------------------------------------------------
    def ppo_update(self, experience: Experience, critic_only: bool = False) -> dict[str, float]:
        """``num_ppo_epochs`` passes over the rollout in ``num_mini_batches`` optimizer steps, each accumulated over its
        micro-batches (:meth:`accumulate_gradients`). ``critic_only`` trains the critic alone (§5.3.3)."""
        args = self.args
        stats: dict[str, list[torch.Tensor]] = defaultdict(list)
        for epoch in range(args.num_ppo_epochs):
            order = torch.randperm(args.local_batch_size, device=experience.advantages.device)
            for minibatch in order.split(args.local_mini_batch_size):
                step_experience = self._minibatch_advantages(experience, minibatch)
                # H is logged from the first epoch only unless it trains: a full pass over the vocabulary per token
                log_entropy = epoch == 0 or args.entropy_coef > 0
                for micro_stats in self.accumulate_gradients(step_experience, minibatch, critic_only, log_entropy):
                    for name, value in micro_stats.items():
                        stats[name].append(value)
                for name, value in self._optimizer_step(critic_only).items():
                    stats[name].append(value)
        means = torch.stack([torch.stack(values).float().nanmean() for values in stats.values()])
        means = self.accelerator.reduce(means, reduction="mean") if self.accelerator.num_processes > 1 else means
        return dict(zip(stats.keys(), means.tolist(), strict=True))

    def accumulate_gradients(
        self, experience: Experience, minibatch: torch.Tensor, critic_only: bool, log_entropy: bool = True
    ) -> list[dict[str, torch.Tensor]]:
        """Forward and backward of one minibatch's micro-batches (``accelerator.accumulate``; gradients synchronised at
        the last): ``per_device_train_batch_size`` rows each, or packed under ``max_tokens_per_microbatch`` with the
        row split's per-token loss weights (:meth:`_packed_micro_batches`), which leaves the gradients unchanged.
        Returns each micro-batch's stats."""
        if self.args.max_tokens_per_microbatch is None:
            micro_batches = [(micro, None) for micro in minibatch.split(self.args.per_device_train_batch_size)]
        else:
            micro_batches = self._packed_micro_batches(experience, minibatch)
        accelerator, stats = self.accelerator, []
        accelerator.gradient_accumulation_steps, accelerator.step = len(micro_batches), 0  # sync after the last
        for index, loss_weights in micro_batches:
            with accelerator.accumulate(self.model_wrapped):
                loss, micro_stats = self.micro_batch_loss(experience, index, critic_only, loss_weights, log_entropy)
                accelerator.backward(loss)  # divides by gradient_accumulation_steps
            stats.append(micro_stats)
        accelerator.gradient_accumulation_steps = self.args.gradient_accumulation_steps
        return stats

    def _packed_micro_batches(self, experience: Experience, minibatch: torch.Tensor) -> list:
        """``(rows, loss weights)`` of the minibatch packed by length under ``max_tokens_per_microbatch``
        (:func:`~trl_ppomax.ppo.experience.token_budget_batches`), the weights :func:`core.row_split_loss_weights` times the
        divisor ``backward`` applies. Every process gets as many micro-batches as the one with most (ZeRO reduces at
        every micro-step): the others repeat a row with zero weight."""
        rollout = experience.rollout
        mask = rollout.response_mask[minibatch]
        groups, count = self._token_budget_groups(rollout.query_mask[minibatch], mask)
        weights = core.row_split_loss_weights(mask, self.args.per_device_train_batch_size).float()
        engine_divisor = self.model_wrapped.gradient_accumulation_steps() if self.is_deepspeed_enabled else count
        micro_batches = [(minibatch[g], weights[g] * engine_divisor) for g in groups]
        idle = (minibatch[:1], torch.zeros_like(weights[:1]))
        return micro_batches + [idle] * (count - len(groups))

    def _token_budget_groups(self, query_mask, response_mask) -> tuple[list[torch.Tensor], int]:
        """The rows packed under ``max_tokens_per_microbatch`` (:func:`~trl_ppomax.ppo.experience.token_budget_batches`), and
        the most packs any process has: every process must run as many forwards (ZeRO-3 gathers parameters in each)
        and backwards (ZeRO reduces gradients at every micro-step)."""
        budget = self.args.max_tokens_per_microbatch
        groups = token_budget_batches(query_mask.sum(1), response_mask.sum(1), budget)
        if self.accelerator.num_processes == 1:
            return groups, len(groups)
        return groups, int(self.accelerator.gather(torch.tensor([len(groups)], device=query_mask.device)).max())

    def _optimizer_step(self, critic_only: bool) -> dict[str, torch.Tensor]:
        """:func:`optim.optimizer_step`; a step skipped for a non-finite gradient is counted and logged."""
        stats = optim.optimizer_step(
            self.model_wrapped, self.accelerator, self.optimizer, self.lr_scheduler, self.args, critic_only
        )
        if stats is None:
            self.ppo_state.counters[M.SKIPPED_UPDATES] += 1
            logger.warning("Optimizer step skipped at iteration %d: non-finite gradient.", self.state.global_step + 1)
        return stats or {}

    def _minibatch_advantages(self, experience: Experience, minibatch: torch.Tensor) -> Experience:
        """With ``advantage_whitening_scope="minibatch"`` (§5.3.1): the minibatch's rows of the advantages whitened
        (and clipped) over the minibatch of every process; else ``experience`` as it is."""
        args = self.args
        if args.advantage_whitening_scope != "minibatch":
            return experience
        mask, raw = experience.rollout.response_mask[minibatch], experience.raw_advantages[minibatch]
        advantages = experience.advantages.clone()
        advantages[minibatch] = core.normalize_advantages(
            raw, mask, args.whiten_advantages, args.advantage_clip, self._reduce_sum
        )
        return dataclasses.replace(experience, advantages=advantages)

    def micro_batch_loss(
        self,
        experience: Experience,
        index: torch.Tensor,
        critic_only: bool,
        loss_weights: torch.Tensor | None = None,
        log_entropy: bool = True,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """PPO-max loss of one micro-batch: clipped policy loss + vf_coef·clipped value loss (+ entropy, + ptx); token
        means, or sums with ``loss_weights`` (B, T). The entropy (a pass over the vocabulary) is computed when it
        trains or ``log_entropy``."""
        args = self.args
        rollout = experience.rollout.select(index)
        width = max(int(rollout.response_mask.sum(1).max()), 1)  # trim padding to this micro-batch's longest
        mask = rollout.response_mask[:, :width]
        responses = rollout.response_ids[:, :width]
        loss_weights = None if loss_weights is None else loss_weights[:, :width]
        inputs = sequence_inputs(*self._forward_queries(rollout.query_ids, rollout.query_mask), responses, mask)
        ptx_inputs = self._next_ptx_batch() if self.ptx_batches is not None else None
        ptx_mask = ptx_inputs.pop("loss_mask", ptx_inputs["attention_mask"]) if ptx_inputs is not None else None
        logits, values, ptx_logits = self.model_wrapped(inputs, width, ptx_inputs=ptx_inputs)
        temperature, trains_entropy = args.effective_logprob_temperature, args.entropy_coef > 0
        if trains_entropy or log_entropy:  # log π and H in one pass over the vocabulary
            logprobs, entropy = selective_log_softmax_and_entropy(
                logits, responses, entropy_requires_grad=trains_entropy, temperature=temperature
            )
        else:
            logprobs, entropy = selective_log_softmax(logits, responses, temperature=temperature), None
        pg_loss, pg_stats = core.clipped_policy_loss(
            logprobs,
            experience.old_logprobs[index, :width],
            experience.advantages[index, :width],
            mask,
            args.cliprange,
            None if rollout.sampling_weights is None else rollout.sampling_weights[:, :width],
            loss_weights,
        )
        vf_loss, vf_stats = core.clipped_value_loss(
            values,
            rollout.values[:, :width],
            experience.returns[index, :width],
            mask,
            args.cliprange_value,
            loss_weights,
        )
        policy_loss = pg_loss
        stats = {
            M.POLICY_LOSS: pg_loss.detach(),
            M.VALUE_LOSS: vf_loss.detach(),
            M.CLIPFRAC: pg_stats["clipfrac"],
            M.APPROXKL: pg_stats["approxkl"],
            M.RATIO: pg_stats["ratio"],
            M.RATIO_VAR: pg_stats["ratio_var"],
            M.VF_CLIPFRAC: vf_stats["clipfrac"],
            M.VALUE_ERROR: vf_stats["error"],
        }
        if entropy is not None:
            entropy_term, entropy_stats = core.entropy_loss(entropy, mask, args.entropy_target, loss_weights)
            policy_loss = policy_loss + args.entropy_coef * entropy_term
            stats[M.ENTROPY] = entropy_stats["entropy"]
        if ptx_logits is not None:
            ptx_loss, ptx_stats = core.lm_loss(ptx_logits, ptx_inputs["input_ids"], ptx_mask)
            policy_loss = policy_loss + args.ptx_coef * ptx_loss
            stats.update({M.PTX_LOSS: ptx_loss.detach(), M.PTX_PERPLEXITY: ptx_stats["perplexity"]})
        # Critic warm-up keeps the policy in the graph (DDP needs every parameter used) with zero weight.
        loss = (0.0 if critic_only else 1.0) * policy_loss + args.vf_coef * vf_loss
        return loss, stats

    def _next_ptx_batch(self) -> dict[str, torch.Tensor]:
        batch = self.ptx_batches[self.ppo_state.ptx_batches_used]
        self.ppo_state.ptx_batches_used += 1
        return {k: v.to(self.accelerator.device) for k, v in batch.items()}
