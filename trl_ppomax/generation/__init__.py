"""Generation engines behind one interface, the first half of the rollout (**generate → score**; scoring is the
trainer's and the same for every engine).

An engine has ``generate(query_ids, query_mask, sampling=True, n=1, max_new_tokens=None) -> (response_ids,
response_mask, sampler_logprobs)``: ``n`` responses (B·n, T) to each left-padded prompt (B, L), in a row per prompt,
right-padded, the mask 1 up to and including the stop token, and the sampler's log-probs of the sampled tokens (None
when the sampler is the policy itself); at most ``max_new_tokens`` (None: ``response_length``) tokens each.
``on_policy_updated()`` is called after every update that changed the policy; ``pop_metrics()`` returns what the
engine measured since the last call. :class:`HFGeneration` samples with the policy's ``generate``;
:class:`~trl_ppomax.generation.vllm.VLLMEngine` with vLLM (``use_vllm=True``).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from trl_ppomax.base.core import nucleus_threshold, response_mask_from_stop
from trl_ppomax.base.rollout import Generated, pad_right
from trl_ppomax.generation import correction

__all__ = [
    "Generated",
    "HFGeneration",
    "generate_in_chunks",
    "generate_responses",
    "generation_engine",
    "generation_kwargs",
]


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


def generation_engine(args, accelerator, policy: nn.Module, tokenizer, stop_token_id: int | None):
    """The run's engine: :class:`~trl_ppomax.generation.vllm.VLLMEngine` with ``use_vllm``, else
    :class:`HFGeneration` on the (unwrapped) ``policy``."""
    if args.use_vllm:
        from trl_ppomax.generation.vllm import VLLMEngine

        return VLLMEngine(args, accelerator, policy, tokenizer, stop_token_id)
    return HFGeneration(policy, args, stop_token_id, tokenizer.pad_token_id)


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
