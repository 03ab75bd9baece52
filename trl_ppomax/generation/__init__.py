"""Generation, the first half of a rollout (**generate → score**; scoring is the trainer's and the same for every
engine and source), behind two contracts, each a ``typing.Protocol``:

- a :class:`GenerationEngine` samples responses to prompts (:class:`HFGeneration`, the policy's ``generate``;
  :class:`~trl_ppomax.generation.vllm.VLLMEngine`; transformers' continuous batching,
  :class:`~trl_ppomax.generation.continuous_batching.ContinuousBatchingEngine`); the bounded-staleness producer
  also needs the optional :class:`SnapshotEngine` part (a copy of the policy it can load an older snapshot into);
- a :class:`RolloutSource` turns a batch of prompts into a :class:`~trl_ppomax.base.rollout.Generated` of ``B·n``
  rows (row ``i·n + j``: prompt ``i``'s ``j``-th sample, the prompts and the dataset's columns repeated), the one
  container that flows to scoring: the engine itself (:class:`EngineSource`), its agent loop (:class:`AgentSource`),
  the user's ``rollout_func`` (:class:`FunctionSource`), or the producer of rollouts generated ahead
  (:class:`~trl_ppomax.generation.lagged.LaggedRollouts`).

The run's engine and its sources are chosen here and nowhere else: :data:`ENGINES` (the first whose setting is on)
and :func:`rollout_sources`. The §6.1 sampling processors (:func:`generation_kwargs`) are here too.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from trl_ppomax import data
from trl_ppomax.base.core import nucleus_threshold, response_mask_from_stop
from trl_ppomax.base.rollout import Generated, pad_right
from trl_ppomax.generation import correction
from trl_ppomax.generation.rollout_func import call_rollout_func

__all__ = [
    "ENGINES",
    "AgentSource",
    "EngineSource",
    "FunctionSource",
    "Generated",
    "GenerationEngine",
    "HFGeneration",
    "PromptBatch",
    "RolloutSource",
    "SnapshotEngine",
    "generate_in_chunks",
    "generate_responses",
    "generation_engine",
    "generation_kwargs",
    "rollout_sources",
]


@dataclass(frozen=True)
class PromptBatch:
    """A batch of prompts: ``query_ids``/``query_mask`` (B, L) left-padded, ``columns`` the dataset's other columns
    (B values each; ``prompt`` the prompts as the dataset gave them, when it did)."""

    query_ids: torch.Tensor
    query_mask: torch.Tensor
    columns: dict[str, list]


@runtime_checkable
class GenerationEngine(Protocol):
    """Samples responses: ``generate(query_ids (B, L), query_mask, sampling, n, max_new_tokens) -> (response_ids,
    response_mask, sampler_logprobs | None)``, each (B·n, T) right-padded, the mask 1 up to and including the stop
    token, the sampler's log-probs None when the sampler is the policy itself. ``on_policy_updated()`` follows every
    update that changed the policy; ``pop_metrics()`` returns what it measured since the last call."""

    def generate(
        self, query_ids: torch.Tensor, query_mask: torch.Tensor, sampling: bool = True, n: int = 1, max_new_tokens=None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...

    def on_policy_updated(self) -> None: ...

    def pop_metrics(self) -> dict[str, float]: ...


@runtime_checkable
class SnapshotEngine(GenerationEngine, Protocol):
    """The optional part the bounded-staleness producer needs: its own copy of the policy, sampled with the batch's
    ``generator``; ``snapshot()`` (the live policy's trainable weights, on the trainer's thread) and
    ``load_snapshot(weights)``; ``behaviour_logprobs`` (log μ of what it sampled) and ``target_logprobs`` (what log μ
    estimates under the scoring policy)."""

    generator: torch.Generator | None
    pad_token_id: int

    def snapshot(self) -> list[torch.Tensor]: ...

    def load_snapshot(self, weights: list[torch.Tensor]) -> None: ...

    def behaviour_logprobs(self, query_ids, query_mask, responses, mask, sampler_logprobs) -> torch.Tensor: ...

    def target_logprobs(self, policy_logits, logprobs, responses) -> torch.Tensor: ...


@runtime_checkable
class RolloutSource(Protocol):
    """Writes a rollout's generated half: ``generate(prompts, iteration=, sampling=, n=) -> Generated`` of B·n rows,
    the prompts and ``prompts.columns`` repeated ``n`` times in its ``query_*`` and ``columns``; ``iteration``: the
    training batch (None outside training), which a producer of rollouts generated ahead reads instead of
    ``prompts``."""

    def generate(self, prompts: PromptBatch | None, *, iteration: int | None, sampling: bool, n: int) -> Generated: ...


class HFGeneration:
    """Rollouts by the policy's own ``generate`` (:func:`generation_kwargs`: the repetition penalty on generated
    tokens only, temperature, top-p, ending at ``stop_token_id``). ``policy``: the unwrapped policy the trainer trains
    (gathered in place under ZeRO-3 while the trainer generates)."""

    def __init__(self, policy: nn.Module, args, stop_token_id: int | None, pad_token_id: int) -> None:
        self.policy, self.args = policy, args
        self.stop_token_id, self.pad_token_id = stop_token_id, pad_token_id
        self.stats: dict[str, list[float]] = defaultdict(list)

    def generation_kwargs(self, sampling: bool = True, prompt_width: int = 0) -> dict:
        """The ``generate()`` arguments of a rollout whose prompts are ``prompt_width`` columns wide."""
        return generation_kwargs(self.args, self.stop_token_id, self.pad_token_id, sampling, prompt_width)

    @torch.no_grad()
    def generate(
        self, query_ids: torch.Tensor, query_mask: torch.Tensor, sampling: bool = True, n: int = 1, max_new_tokens=None
    ):
        """See the module docstring; the sampler's log-probs are None (``generate`` samples from the policy itself)."""
        kwargs = self.generation_kwargs(sampling, query_ids.shape[1])
        if max_new_tokens is not None:
            kwargs["max_new_tokens"] = max_new_tokens
        queries = query_ids.repeat_interleave(n, 0), query_mask.repeat_interleave(n, 0)  # as num_return_sequences=n
        return *generate_responses(self.policy, *queries, kwargs), None

    def on_policy_updated(self) -> None:
        """Nothing to do: ``generate`` reads the trained weights themselves."""

    def importance_weights(self, policy_logits, logprobs, responses, mask, sampler_logprobs) -> torch.Tensor:
        """Truncated importance weights of rollouts another sampler wrote (a ``rollout_func``'s log-probs, with
        ``rollout_func_importance_sampling``): :func:`~trl_ppomax.generation.correction.sampler_weights`."""
        return correction.sampler_weights(self.args, self.stats, policy_logits, responses, mask, sampler_logprobs)

    def pop_metrics(self) -> dict[str, float]:
        """The sampling gap of such rollouts since the last call (nothing for the engine's own)."""
        stats, self.stats = self.stats, defaultdict(list)
        return correction.reduced(stats)


def generate_in_chunks(engine, query_ids, query_mask, sampling: bool, n: int, args, pad_token_id: int):
    """``engine.generate`` on chunks of ``local_rollout_forward_batch_size`` responses (a progress bar when there are
    several), right-padded to the widest: ``(response_ids, response_mask, sampler_logprobs)`` (B·n, T), row ``i·n + j``
    the ``j``-th sample of prompt ``i``."""
    size = max(1, args.local_rollout_forward_batch_size // n)
    chunks = [(query_ids[i : i + size], query_mask[i : i + size]) for i in range(0, len(query_ids), size)]
    samples = [engine.generate(ids, mask, sampling, n) for ids, mask in progress(chunks, args)]
    responses, mask, sampler = zip(*samples, strict=True)
    sampler = None if sampler[0] is None else pad_right(sampler, 0.0)
    return pad_right(responses, pad_token_id), pad_right(mask, 0), sampler


def progress(chunks: list, args, desc: str = "Generating") -> list:
    """``chunks`` with a progress bar on the local main process when there is more than one and ``disable_tqdm`` is
    off (long rollouts and evaluations)."""
    from accelerate import PartialState

    if len(chunks) <= 1 or args.disable_tqdm or not PartialState().is_local_main_process:
        return chunks
    from tqdm.auto import tqdm

    return tqdm(chunks, desc=desc, leave=False)


@torch.no_grad()
def generate_responses(
    model: nn.Module, query_ids: torch.Tensor, query_mask: torch.Tensor, generation_kwargs: dict
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample responses with :func:`generation_kwargs` until every row has the stop token (``eos_token_id``) or
    ``max_new_tokens``: ``(response_ids, response_mask)`` (B, T), pad after the stop token."""
    output = model.generate(input_ids=query_ids, attention_mask=query_mask, **generation_kwargs)
    responses = output[:, query_ids.shape[1] :]
    mask = response_mask_from_stop(responses, generation_kwargs["eos_token_id"])
    return responses.masked_fill(~mask, generation_kwargs["pad_token_id"]), mask


class GeneratedTokensPenalty(LogitsProcessor):
    """CTRL's repetition penalty on the tokens generated so far, the prompt's ``prompt_width`` columns exempt (§6.1 and
    the release): for each id ``y`` already generated, ``s_y ← s_y·θ`` if ``s_y < 0`` else ``s_y/θ``. In place, on the
    (B, t) generated ids only: no copy of the (B, V) scores (transformers' processor pads and scatters two)."""

    def __init__(self, penalty: float, prompt_width: int) -> None:
        self.penalty, self.prompt_width = penalty, prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_width :]
        if generated.shape[1] == 0:
            return scores
        seen = scores.gather(1, generated)
        return scores.scatter_(1, generated, torch.where(seen < 0, seen * self.penalty, seen / self.penalty))


class NucleusFilter(LogitsProcessor):
    """Top-p filtering as :func:`~trl_ppomax.base.core.nucleus_threshold` defines it (the full sort's tokens, found
    without sorting the vocabulary; transformers' ``TopPLogitsWarper`` sorts it at every step): scores below the nucleus
    set to −∞, in place."""

    def __init__(self, top_p: float) -> None:
        self.top_p = top_p

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        probs = scores.float().softmax(dim=-1)
        threshold = nucleus_threshold(probs, self.top_p)
        return scores.masked_fill_(probs < threshold.unsqueeze(-1), float("-inf"))


def generation_kwargs(
    args, stop_token_id: int | None, pad_token_id: int, sampling: bool = True, prompt_width: int = 0
) -> dict:
    """``generate()`` arguments of a rollout: at most ``response_length`` new tokens, ending at the stop token;
    greedy, or sampled through, in this order, the repetition penalty on the tokens **generated so far** (the prompt,
    ``prompt_width`` left-padded columns, is exempt: §6.1 and the release penalise previously generated tokens only,
    whereas ``generate(repetition_penalty=…)`` also penalises the prompt), the temperature, TRL GRPO's ``top_k`` (0 or
    None: off), top-p and ``min_p``; then TRL's ``cache_implementation`` and ``generation_kwargs`` (applied last,
    as TRL applies them)."""
    kwargs = dict(
        max_new_tokens=args.response_length, eos_token_id=stop_token_id, pad_token_id=pad_token_id, do_sample=sampling
    )
    if sampling:
        processors = []
        if args.repetition_penalty != 1.0:
            processors.append(GeneratedTokensPenalty(args.repetition_penalty, prompt_width))
        if args.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(args.temperature))
        if getattr(args, "top_k", None):
            processors.append(TopKLogitsWarper(args.top_k))
        if args.top_p < 1.0:
            processors.append(NucleusFilter(args.top_p))
        if getattr(args, "min_p", None):
            processors.append(MinPLogitsWarper(args.min_p))
        kwargs.update(temperature=1.0, top_k=0, top_p=1.0, logits_processor=LogitsProcessorList(processors))
    if getattr(args, "cache_implementation", None) is not None:
        kwargs["cache_implementation"] = args.cache_implementation
    return {**kwargs, **(getattr(args, "generation_kwargs", None) or {})}


# -- Rollout sources and the registry -----------------------------------------------------------------------------------
class EngineSource:
    """``n`` responses to each prompt by ``engine``, in chunks of ``local_rollout_forward_batch_size`` responses."""

    def __init__(self, *, engine: GenerationEngine, args, pad_token_id: int) -> None:
        self.engine, self.args, self.pad_token_id = engine, args, pad_token_id

    def generate(self, prompts: PromptBatch, *, iteration: int | None, sampling: bool, n: int) -> Generated:
        ids, mask = prompts.query_ids, prompts.query_mask
        written = generate_in_chunks(self.engine, ids, mask, sampling, n, self.args, self.pad_token_id)
        queries = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
        return Generated(*queries, *written, columns=data.repeat_rows(prompts.columns, n))


class AgentSource:
    """``n`` trajectories per prompt of the agent loop (``tools``, ``environment_factory``:
    :class:`~trl_ppomax.generation.agent.AgentRollouts`) on ``engine``; ``prompts_of(batch)`` gives its prompts (the
    dataset's ``prompt`` column, else the decoded ids)."""

    def __init__(self, *, agent, engine: GenerationEngine, pad_token_id: int, prompts_of: Callable) -> None:
        self.agent, self.engine, self.pad_token_id, self.prompts_of = agent, engine, pad_token_id, prompts_of

    def generate(self, prompts: PromptBatch, *, iteration: int | None, sampling: bool, n: int) -> Generated:
        others = {key: values for key, values in prompts.columns.items() if key != "prompt"}
        texts, device = self.prompts_of(prompts), prompts.query_ids.device
        out = self.agent.generate(self.engine, texts, others, sampling, n, self.pad_token_id, device)
        out.columns = {**data.repeat_rows(prompts.columns, n), **out.columns}
        return out


class FunctionSource:
    """The user's ``rollout_func(prompts, trainer)`` (TRL GRPO's, :mod:`~trl_ppomax.generation.rollout_func`), its
    output checked against the policy (``checks``: ``vocab_size``, ``context_length``); its log-probs correct for
    another sampler only with ``rollout_func_importance_sampling`` (else they are checked and dropped)."""

    def __init__(self, *, rollout_func: Callable, trainer, args, pad_token_id: int, prompts_of, checks: dict) -> None:
        self.rollout_func, self.trainer, self.args, self.pad_token_id = rollout_func, trainer, args, pad_token_id
        self.prompts_of, self.checks = prompts_of, checks

    def generate(self, prompts: PromptBatch, *, iteration: int | None, sampling: bool, n: int) -> Generated:
        importance_sampling = self.args.rollout_func_importance_sampling
        out = call_rollout_func(
            self.rollout_func,
            self.prompts_of(prompts),
            self.trainer,
            n,
            self.pad_token_id,
            prompts.query_ids.device,
            columns=set(prompts.columns),
            importance_sampling=importance_sampling,
            **self.checks,
        )
        if not importance_sampling:
            out.sampler_logprobs = None  # checked only: taken to be the policy's own samples
        out.columns = {**data.repeat_rows(prompts.columns, n), **out.columns}
        return out


def _vllm_engine(args, accelerator, policy, tokenizer, stop_token_id):
    from trl_ppomax.generation.vllm import VLLMEngine

    return VLLMEngine(args, accelerator, policy, tokenizer, stop_token_id)


def _continuous_batching_engine(args, accelerator, policy, tokenizer, stop_token_id):
    from trl_ppomax.generation.continuous_batching import ContinuousBatchingEngine

    policy = getattr(policy, "policy", policy)  # generate_batch is the causal LM's, not the policy + critic wrapper's
    return ContinuousBatchingEngine(
        policy=policy,
        args=args,
        stop_token_id=stop_token_id,
        pad_token_id=tokenizer.pad_token_id,
        corrections=HFGeneration(policy, args, stop_token_id, tokenizer.pad_token_id),
    )


def _generate_engine(args, accelerator, policy, tokenizer, stop_token_id):
    return HFGeneration(policy, args, stop_token_id, tokenizer.pad_token_id)


#: The generation engines by name: ``(is_on(args), build(args, accelerator, policy, tokenizer, stop_token_id))``;
#: the first that is on is the run's (``generate``, the policy's own ``generate``, always is).
ENGINES: dict[str, tuple[Callable, Callable]] = {
    "vllm": (lambda args: args.use_vllm, _vllm_engine),
    "continuous_batching": (lambda args: args.use_transformers_continuous_batching, _continuous_batching_engine),
    "generate": (lambda args: True, _generate_engine),
}


def generation_engine(args, accelerator, policy, tokenizer, stop_token_id: int | None) -> GenerationEngine:
    """The run's engine (:data:`ENGINES`) on the unwrapped ``policy``."""
    build = next(build for is_on, build in ENGINES.values() if is_on(args))
    return build(args, accelerator, policy, tokenizer, stop_token_id)


def rollout_sources(
    *,
    engine: GenerationEngine,
    args,
    pad_token_id: int,
    prompts_of,
    producer: RolloutSource | None = None,
    agent=None,
    rollout_func=None,
    **function_kwargs,
) -> tuple[RolloutSource, RolloutSource]:
    """``(training, sampling)``: what writes the training batches — the producer of rollouts generated ahead
    (``max_staleness`` ≥ 1), else the user's ``rollout_func`` (:class:`FunctionSource`, ``function_kwargs``: its
    ``trainer`` and ``checks``), else the sampling source — and what writes evaluation and sample rollouts: the agent
    loop (:class:`AgentSource`), else the engine itself (:class:`EngineSource`)."""
    if agent is not None:
        sampling = AgentSource(agent=agent, engine=engine, pad_token_id=pad_token_id, prompts_of=prompts_of)
    else:
        sampling = EngineSource(engine=engine, args=args, pad_token_id=pad_token_id)
    if producer is not None:
        return producer, sampling
    if rollout_func is not None:
        function = FunctionSource(
            rollout_func=rollout_func, args=args, pad_token_id=pad_token_id, prompts_of=prompts_of, **function_kwargs
        )
        return function, sampling
    return sampling, sampling
