"""PPOMaxTrainer: PPO-max on the current TRL stack, with trl 1.12's ``PPOTrainer`` constructor; it only orchestrates.

One iteration (§3.2, §5), each phase a part with its own module: rollout = generate → score
(:class:`~trl_ppomax.ppo.rollouts.Rollouts`) → shape rewards and estimate advantages
(:class:`~trl_ppomax.ppo.experience.ExperienceMaker`) → update (:class:`~trl_ppomax.ppo.update.PPOUpdate`) → log;
evaluation (:class:`~trl_ppomax.ppo.evaluation.Evaluator`) and checkpointing
(:class:`~trl_ppomax.ppo.checkpoint.Checkpointer`) beside them; the maths in :mod:`~trl_ppomax.base.core`."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from accelerate.utils import set_seed
from datasets import Dataset
from torch import nn
from transformers import PreTrainedTokenizerBase, Trainer, TrainerCallback
from transformers.trainer_utils import IntervalStrategy, SaveStrategy, TrainOutput

from trl_ppomax import data, models, rewards
from trl_ppomax.base import compat
from trl_ppomax.base import metrics as M
from trl_ppomax.base.rollout import Rollout
from trl_ppomax.generation import generation_engine
from trl_ppomax.models import PolicyAndCritic
from trl_ppomax.ppo import checks, optim, setup, update
from trl_ppomax.ppo.checkpoint import Checkpointer
from trl_ppomax.ppo.config import PPOMaxConfig
from trl_ppomax.ppo.evaluation import Evaluator
from trl_ppomax.ppo.experience import Experience, ExperienceMaker, process_sum
from trl_ppomax.ppo.rollouts import Rollouts
from trl_ppomax.ppo.scoring import Scorer
from trl_ppomax.ppo.state import PPOState, start_trainer_state
from trl_ppomax.reporting.hub import TAGS
from trl_ppomax.reporting.plotting import DynamicsFigureCallback

logger = logging.getLogger(__name__)


class PPOMaxTrainer(Trainer):
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
        rollout_func: TRL GRPO's ``rollout_func(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs",
            optional "env_mask", ...}`` generating the training rollouts (multi-turn, tools, an environment):
            :mod:`~trl_ppomax.generation.rollout_func`; tokens with ``env_mask`` 0 are never trained on.
        tools: TRL GRPO's tools, Python functions (sync or async, type hints and a Google-style docstring) the policy
            calls through its chat template over several turns (:mod:`~trl_ppomax.generation.agent`; ``max_tool_turns``,
            ``max_completion_tokens``); the tools' results are attended to, never trained on.
        environment_factory: TRL GRPO's: a callable making one environment per trajectory, ``reset(**row)``, its
            public methods as tools, its optional ``get_reward()`` a reward source (then ``reward_model`` may be None).
        rollout_metrics: extra per-response measurements to log, ``{name: f(prompts, completions) -> list[float]}``
            on the decoded texts (e.g. a gold reward, a rule-based check); logged as ``name`` (and ``eval_name``).
    """

    _tag_names = tuple(TAGS)

    def __init__(
        self,
        args: PPOMaxConfig | None = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        model: nn.Module | str | None = None,
        ref_model: nn.Module | None = None,
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
        rollout_func: Callable | None = None,
        tools: list[Callable] | None = None,
        environment_factory: Callable | None = None,
    ) -> None:
        reward_model = reward_funcs if reward_funcs is not None else reward_model
        args = setup.default_config(args, model)  # TRL GRPO's: a config named after the model
        # Arguments checked before anything expensive (each refusal names the fix), models built, prompts prepared
        built = setup.set_up(
            args=args,
            tokenizer=processing_class,
            models=dict(model=model, ref_model=ref_model, reward_model=reward_model, value_model=value_model),
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            ptx_dataset=ptx_dataset,
            peft_config=peft_config,
            reward_processing_classes=reward_processing_classes,
            rollout_metrics=rollout_metrics,
            rollouts=dict(rollout_func=rollout_func, tools=tools, environment_factory=environment_factory),
        )
        processing_class = built.tokenizer
        self._keep_setup(built, ptx_dataset)
        args.set_run_length(len(built.train_dataset))  # total_episodes, num_total_batches (trl 1.12 writes them back)
        self.last_rollout = None  # with log_completions: the latest training rollout, printed at each log
        self.train_started, self.train_summary = time.time(), None
        super().__init__(
            model=PolicyAndCritic(built.policy, built.critic),
            args=args,
            data_collator=data_collator or data.PromptCollator(processing_class.pad_token_id),
            train_dataset=built.train_dataset,
            eval_dataset=built.eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self._assemble(processing_class, rollout_metrics)

    def _assemble(self, processing_class, rollout_metrics) -> None:
        """Once transformers' ``Trainer`` is set up: the PPO state, the prepared models and the phases' parts."""
        self.reduce_sum = process_sum(self.accelerator)  # a tensor summed over every process
        # The training-dynamics figure to the trackers; the live callback list says where TensorBoard writes
        self.add_callback(DynamicsFigureCallback(self.callback_handler.callbacks))
        # The Trainer leaves accumulation to itself (1 in accelerate); PPO's update loop lets accelerate do it.
        self.accelerator.gradient_accumulation_steps = self.args.gradient_accumulation_steps
        # What a resume restores beyond TrainerState (moments, counters, ptx position), saved by checkpointing
        self.ppo_state = PPOState(rewards.initial_reward_moments(self.reward_sources, self.args.reward_norm))
        identity = models.model_identity(self.model)  # counted before accelerator.prepare shards the models
        self._prepare_models()
        self._build_phases(processing_class, rollout_metrics, identity)
        self._offer_run_keywords()

    def _keep_setup(self, built: setup.Setup, ptx_dataset: Dataset | None) -> None:
        """The trainer's public names for what :func:`setup.set_up` built (trl 1.12's and TRL GRPO's)."""
        self.ref_model, self.reward_sources = built.ref_model, built.reward_sources
        self.reward_model = built.reward_model
        self.stop_token_id = built.stop_token_id  # where generation stops (None: response_length tokens)
        self.end_token_id = built.end_token_id  # what a finished response ends with: the stop token, else eos
        self.is_peft_model = models.is_peft(built.policy)
        self.ptx_dataset, self.rollout_func, self.agent = ptx_dataset, built.rollout_func, built.agent

    def _offer_run_keywords(self) -> None:
        """TRL's keywords for every reward function: ``trainer_state`` and ``log_metric`` (logged with the metrics)."""
        self.reward_sources.run_keywords = {"trainer_state": self.state, "log_metric": self.reward_log.log_metric}

    def _build_phases(self, processing_class, rollout_metrics, model_identity: dict) -> None:
        """The phases' parts: generation and scoring (:class:`Rollouts`), experience, the update, evaluation,
        checkpointing; the reward functions' ``log_metric`` log."""
        args, accelerator, sources, state = self.args, self.accelerator, self.reward_sources, self.ppo_state
        metrics = dict(rollout_metrics or {})
        self.experience_maker = ExperienceMaker(
            args=args,
            ppo_state=state,
            accelerator=accelerator,
            tokenizer=processing_class,
            reward_sources=sources,
            rollout_metrics=metrics,
            end_token_id=self.end_token_id,
        )
        self.rollouts = self._rollout_phase()
        self.evaluator = self._evaluator()
        self.updater = update.PPOUpdate(
            model=self.model_wrapped,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            accelerator=accelerator,
            args=args,
            ppo_state=state,
            ptx_batches=self.ptx_batches,
            whiten=self.experience_maker.whitened,
            deepspeed=self.is_deepspeed_enabled,
        )
        self.checkpointer = Checkpointer(
            trainer=self, ppo_state=state, producer=self.lagged, model_identity=model_identity
        )
        self.reward_log = rewards.RewardLog()

    def _rollout_phase(self) -> Rollouts:
        """Generation (the policy's generate, or vLLM; a producer generating ahead with ``max_staleness`` ≥ 1), then
        scoring."""
        args, accelerator, tokenizer = self.args, self.accelerator, self.processing_class
        unwrapped = accelerator.unwrap_model(self.model_wrapped)
        generator = unwrapped.policy if args.use_vllm else unwrapped  # trainer.model.generate (TRL's tests patch it)
        engine = generation_engine(args, accelerator, generator, tokenizer, self.stop_token_id)
        producer = None  # max_staleness ≥ 1: the producer generating ahead (the vLLM engine becomes its own)
        if args.max_staleness:
            producer, engine = setup.rollout_producer(self, unwrapped.policy, engine)
        sampler = producer or engine  # whose importance_weights correct rollouts with sampler log-probs
        sources = self.reward_sources
        scorer = Scorer(
            args=args,
            accelerator=accelerator,
            tokenizer=tokenizer,
            reward_sources=sources,
            ref_model=self.ref_model,
            generation=sampler,
            end_token_id=self.end_token_id,
        )
        return Rollouts(
            args=args,
            accelerator=accelerator,
            tokenizer=tokenizer,
            model=self.model_wrapped,
            engine=engine,
            producer=producer,
            scorer=scorer,
            agent=self.agent,
            rollout_func=self.rollout_func,
            trainer=self,
            prompt_batches=self.prompt_batches,
            frozen_modules=[module for _, module in sources.modules],
            collator=self.data_collator,
        )

    def _evaluator(self) -> Evaluator:
        return Evaluator(
            args=self.args,
            accelerator=self.accelerator,
            tokenizer=self.processing_class,
            rollouts=self.rollouts,
            experience_maker=self.experience_maker,
            reduce_sum=self.reduce_sum,
            datasets=lambda: (self.train_dataset, self.eval_dataset),
            prepare=lambda dataset: setup.prepare_eval_prompts(self, dataset),
            report=self._report_evaluation,
            current_step=lambda: self.state.global_step,
            callbacks=self.callback_handler.callbacks,
        )

    # -- The parts' public names, kept on the trainer ----------------------------------------------------------------
    @property
    def scorer(self) -> Scorer:
        return self.rollouts.scorer

    @property
    def generation(self):
        """The run's generation engine (:mod:`~trl_ppomax.generation`; settable)."""
        return self.rollouts.engine

    @generation.setter
    def generation(self, engine) -> None:
        self.rollouts.engine = engine

    @property
    def lagged(self):
        """The producer of rollouts generated ahead (``max_staleness`` ≥ 1), else None."""
        return self.rollouts.producer

    @property
    def vllm(self):
        """The vLLM engine with ``use_vllm=True`` (:attr:`Rollouts.vllm`), else None."""
        return self.rollouts.vllm

    def rollout(self, query_ids, query_mask, sampling=True, columns=None, samples_per_prompt=1) -> Rollout:
        """Responses to left-padded prompts, scored (:meth:`Rollouts.rollout`)."""
        return self.rollouts.rollout(query_ids, query_mask, sampling, columns, samples_per_prompt)

    def rollout_rows(self, dataset: Dataset, rows: list[int], sampling: bool, scores_only: bool = False) -> Rollout:
        """The rollout of ``rows`` of a prepared prompt dataset (:meth:`Rollouts.rollout_rows`)."""
        return self.rollouts.rollout_rows(dataset, rows, sampling, scores_only)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Generate on every evaluation prompt and log the per-response metrics' means (:meth:`Evaluator.evaluate`)."""
        return self.evaluator.evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def _report_evaluation(self, metrics: dict[str, float]) -> None:
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)

    def generate_completions(self, sampling: bool = False, num_prompts: int = 8) -> list[dict[str, object]]:
        """A table of a few prompts' responses and scores, printed and logged (:meth:`Evaluator.generate_completions`)."""
        return self.evaluator.generate_completions(sampling, num_prompts)

    @property
    def rollout_metrics(self) -> dict[str, rewards.RewardFunction]:
        """The extra per-response measurements logged each rollout and evaluation (settable)."""
        return self.experience_maker.rollout_metrics

    @rollout_metrics.setter
    def rollout_metrics(self, value: dict[str, rewards.RewardFunction]) -> None:
        self.experience_maker.rollout_metrics = dict(value)

    # TRL GRPOTrainer's attributes, read by its users' callbacks and tests
    @property
    def reward_funcs(self) -> list:
        """The reward sources, as TRL's ``reward_funcs`` (an environment's ``get_reward`` last, a callable)."""
        return self.reward_sources.sources

    @property
    def reward_func_names(self) -> list[str]:
        return self.reward_sources.names

    @property
    def reward_weights(self) -> torch.Tensor:
        return torch.tensor(self.reward_sources.weights)

    @property
    def reward_processing_classes(self) -> list:
        """One per reward source: its own tokenizer, or None where it reads the policy's tokens."""
        return self.reward_sources.processing_classes

    @property
    def tools(self) -> list[Callable]:
        """The tools the policy may call: the standalone ones, then the environments' methods ([] without an agent)."""
        return [] if self.agent is None else self.agent.tool_functions

    @property
    def environments(self) -> list | None:
        """The environments of the last rollout's trajectories, in row order (None without ``environment_factory``)."""
        return None if self.agent is None else self.agent.environments

    @property
    def total_episodes(self) -> int:
        return self.args.total_episodes

    @property
    def num_total_batches(self) -> int:
        return self.args.num_total_batches

    @property
    def _episodes_per_epoch(self) -> int:
        return len(self.train_dataset) * self.args.num_samples_per_prompt

    # -- Set-up ----------------------------------------------------------------------------------------------------------
    def _prepare_models(self) -> None:
        num_updates = self.num_total_batches * self.args.update_epochs * self.args.num_mini_batches
        self.create_optimizer_and_scheduler(num_training_steps=num_updates)
        enabled, kwargs = self.args.checkpointing
        if enabled:
            self.model.gradient_checkpointing_enable(kwargs)
        self.model_wrapped, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)
        checks.check_engine(self.is_fsdp_enabled, self.accelerator.distributed_type)
        if self.is_deepspeed_enabled:
            self.deepspeed = self.model_wrapped
            checks.check_deepspeed_epochs(self.args)
        if isinstance(self.ref_model, nn.Module):
            self.ref_model = models.prepare_frozen(self.ref_model, self.accelerator)
        self.reward_sources.prepare(lambda module: models.prepare_frozen(module, self.accelerator))
        streams = (self.train_dataset, self.ptx_dataset, self.processing_class, self.args, self.accelerator)
        self.prompt_batches, self.ptx_batches = data.batch_streams(*streams, self.data_collator)

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

    # -- The loop --------------------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs) -> TrainOutput:
        """Run ``num_total_batches`` PPO-max iterations; ``resume_from_checkpoint`` (a path, or True for the newest
        checkpoint in ``output_dir``) continues an interrupted run exactly where it stopped. Returns transformers'
        ``TrainOutput`` (``training_loss``: the mean policy loss), also logged as ``train_loss`` with the run time."""
        args, self.train_started, self.train_summary = self.args, time.time(), None
        if args.grpo_swap_notice:
            logger.warning(args.grpo_swap_notice)
        try:
            self.checkpointer.claim_run(resume_from_checkpoint)  # once per trainer; output_dir and checkpoint checks
            set_seed(args.seed, device_specific=True)  # a different sampling seed on each process
            start_trainer_state(self.state, args, self._episodes_per_epoch)
            self.sample_every = max(1, self.num_total_batches // max(1, args.num_sample_generations))
            if resume_from_checkpoint:
                self.checkpointer.restore_checkpoint(resume_from_checkpoint)
            self._offer_run_keywords()  # the state a resume restored
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
        finally:
            if self.lagged is not None:  # the producer stopped and joined too (an error, Ctrl-C)
                self.lagged.close()
            if self.agent is not None:  # the async tools' loop thread (started again if evaluate() needs it)
                self.agent.close()
        summary = self.train_summary or self._train_summary()  # stopped early (a callback): returned, not logged
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        if self.state.global_step >= self.num_total_batches:
            self.checkpointer.load_best_model()
        return TrainOutput(self.state.global_step, summary["train_loss"], summary)

    def _train_summary(self, last: dict[str, float] | None = None) -> dict[str, float]:
        """Transformers' end-of-training numbers, ``train_runtime`` and ``train_loss`` (here the mean ``loss/policy``
        of the logs, ``last`` the one being written), in the final iteration's log, as TRL's tests read them from
        ``state.log_history[-1]`` beside the metrics."""
        logs = [*self.state.log_history, last or {}]
        losses = [entry[M.POLICY_LOSS] for entry in logs if M.POLICY_LOSS in entry]
        runtime = time.time() - self.train_started
        return {
            "train_runtime": runtime,
            "train_loss": sum(losses) / len(losses) if losses else float("nan"),
            "train_steps_per_second": self.state.global_step / max(runtime, 1e-9),
        }

    def training_iteration(self, iteration: int) -> dict[str, float]:
        """One PPO-max iteration on rollout batch ``iteration`` (§3.2): rollout (generate → score), experience (shape
        rewards, advantages), update; returns the metrics to log. A batch that cannot train (no finite reward, a
        non-finite number, every optimizer step skipped) is skipped and counted (:meth:`PPOState.count_iteration`)."""
        args, start = self.args, time.perf_counter()
        rollout = self.rollouts.training(iteration)
        self.last_rollout = rollout if args.log_completions else None  # printed at the next log (TRL GRPO's)
        timings = {M.ROLLOUT_SECONDS: time.perf_counter() - start}
        experience, metrics, problem = self.make_experience(rollout)
        if experience is not None:
            start = time.perf_counter()
            update_metrics, problem = self._update_and_sync(experience, iteration)
            metrics.update(update_metrics, **{M.UPDATE_SECONDS: time.perf_counter() - start})
            if experience.policy_metrics is not None:  # π_old's log-probs came from the update
                metrics.update(experience.policy_metrics())
        self.ppo_state.count_iteration(problem, iteration, self.num_total_batches, args.max_skipped_iterations)
        counters = {name: float(value) for name, value in self.ppo_state.counters.items()}
        engines = [e for e in (self.generation, self.lagged, self.agent, self.reward_log) if e is not None]
        measured = {name: value for engine in engines for name, value in engine.pop_metrics().items()}
        return {**metrics, **timings, **measured, **counters}

    def _update_and_sync(self, experience: Experience, iteration: int) -> tuple[dict[str, float], str | None]:
        """The PPO update (:meth:`PPOUpdate.run`), then the generation engine told of the new policy; returns the
        update's metrics and why nothing trained, else None."""
        metrics, problem = self.updater.run(experience, iteration)
        if problem is None and iteration > self.args.critic_warmup_steps:
            self.generation.on_policy_updated()  # e.g. vLLM gets the new weights before the next rollout
        return metrics, problem

    def _log_evaluate_save(self, pending: dict[str, list[float]], iteration: int, start: tuple[float, int]) -> None:
        """Log each metric's mean since the last log, then evaluate, print samples and save as the callbacks ask."""
        if self.control.should_log or iteration == self.num_total_batches:
            means = {name: sum(values) / len(values) for name, values in pending.items()}
            schedule = M.schedule_metrics(self.state, self.lr_scheduler, start, with_critic=self.args.uses_critic)
            if iteration == self.num_total_batches:  # the run's summary in its last log, as transformers' Trainer
                self.train_summary = self._train_summary(means)
            self.log(M.with_trl_names({**means, **schedule, **(self.train_summary or {})}))
            pending.clear()
            if self.last_rollout is not None:
                self.evaluator.show_completions(self.last_rollout, self.args.num_completions_to_print)
        if self.control.should_evaluate:
            is_best = compat.determine_best_metric(self, self.evaluate())
            if self.args.save_strategy == SaveStrategy.BEST:
                self.control.should_save = is_best
        if self.args.num_sample_generations > 0 and iteration % self.sample_every == 0:
            self.generate_completions(sampling=True)
        self._save_if_asked()

    def _evaluate_initial_policy(self) -> None:
        """Step 0 of a fresh run that evaluates (``eval_strategy`` not "no", or ``eval_on_start``), as the paper's
        release does: the first best-model candidate, kept as ``checkpoint-0`` when the best model must be loadable."""
        args = self.args
        if args.eval_strategy == IntervalStrategy.NO and not args.eval_on_start:
            return
        is_best = compat.determine_best_metric(self, self.evaluate())
        keeps_best = args.load_best_model_at_end or args.save_strategy == SaveStrategy.BEST
        self.control.should_save = is_best and keeps_best and args.save_strategy != SaveStrategy.NO
        self._save_if_asked()

    def _save_if_asked(self) -> None:
        if self.control.should_save:
            self.checkpointer.save_checkpoint()
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    # -- Saving (:class:`~trl_ppomax.ppo.checkpoint.Checkpointer`): transformers' hooks ---------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The policy and tokenizer as a plain transformers (or PEFT adapter) folder, with ``save_value_model`` the
        critic in its ``value_model/``, atomically (:meth:`Checkpointer.save_model`); pushed with ``push_to_hub``."""
        self.checkpointer.save_model(output_dir, push=self.args.push_to_hub and not _internal_call)

    def _save_checkpoint(self, model, trial) -> None:
        self.checkpointer.save_checkpoint()

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True, **kwargs):
        """transformers' ``Trainer.push_to_hub``; when only DeepSpeed engine checkpoints are saved, a warning says how
        to consolidate and push ``output_dir`` instead (:meth:`Checkpointer.push_engine_checkpoint`)."""
        if self.checkpointer.engine_checkpoint_only:
            return self.checkpointer.push_engine_checkpoint()
        return super().push_to_hub(commit_message=commit_message, blocking=blocking, **kwargs)

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None, tags=None, **_):
        """README.md in ``output_dir`` (:meth:`Checkpointer.create_model_card`)."""
        self.checkpointer.create_model_card(model_name, dataset_name, tags)

    # -- Phase 2: rewards and advantages ---------------------------------------------------------------------------------
    @torch.no_grad()
    def make_experience(self, rollout: Rollout) -> tuple[Experience | None, dict[str, float], str | None]:
        """Shape rewards, estimate advantages and returns (§5.3, :class:`~trl_ppomax.ppo.experience.ExperienceMaker`):
        ``(experience, metrics, None)``, or ``(None, {}, why)`` on every process when the batch must be skipped."""
        return self.experience_maker.make(rollout, self.state.global_step)

    # -- Phase 3: PPO update (:class:`~trl_ppomax.ppo.update.PPOUpdate`) -----------------------------------------------
    def ppo_update(self, experience: Experience, critic_only: bool = False) -> dict[str, float]:
        """The update's epochs over ``experience`` (:meth:`PPOUpdate.epochs`); ``critic_only``: the critic alone."""
        return self.updater.epochs(experience, critic_only, self.state.global_step + 1)

    def accumulate_gradients(self, experience, minibatch, critic_only: bool, log_entropy: bool = True) -> list[dict]:
        """One minibatch's forwards and backwards (:meth:`PPOUpdate.accumulate_gradients`)."""
        return self.updater.accumulate_gradients(experience, minibatch, critic_only, log_entropy)

    def micro_batch_loss(self, experience, index, critic_only: bool, loss_weights=None, log_entropy: bool = True):
        """One micro-batch's PPO-max loss and stats (:meth:`PPOUpdate.micro_batch_loss`)."""
        return self.updater.micro_batch_loss(experience, index, critic_only, loss_weights, log_entropy)
