"""Rollouts by transformers' continuous batching (``use_transformers_continuous_batching``, TRL GRPO's third engine):
``model.generate_batch`` keeps a paged KV cache and a queue of requests, each leaving the batch at its stop token,
so a short response never waits for the longest one, and no row is padded while it is generated.

Sampling follows the run's settings through a ``GenerationConfig`` (temperature, top-k, top-p, min-p, the stop
token, ``response_length``); transformers applies them itself, so two of ours differ: the repetition penalty is
transformers' processor (§6.1's penalises generated tokens only; transformers' may count the prompt's too), and top-p
is transformers' warper. The trainer scores the responses with its own forwards, as for every engine, so the sampler's
log-probs are not needed (None)."""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from trl_ppomax.base.rollout import pad_right

__all__ = ["ContinuousBatchingEngine"]

logger = logging.getLogger(__name__)
#: transformers' request ids are ``req_<index>`` in the order of the prompts given.
REQUEST_INDEX = re.compile(r"^req_(\d+)$")


class ContinuousBatchingEngine:
    """A :class:`~trl_ppomax.generation.GenerationEngine` on ``policy.generate_batch`` (the unwrapped policy the
    trainer trains, so every rollout samples the current weights).

    Args (keyword-only):
        policy: the causal LM (its ``generate_batch``).
        args: the run's config (sampling settings, ``response_length``, ``transformers_continuous_batching_config``:
            transformers' ``ContinuousBatchingConfig`` arguments, ``max_memory_percent`` 0.5 unless set, as TRL
            leaves memory for the update).
        stop_token_id: the token a response ends at (None: ``response_length`` tokens); ``pad_token_id`` pads rows.
        corrections: the policy's own-``generate`` engine (:class:`~trl_ppomax.generation.HFGeneration`), which
            corrects a ``rollout_func``'s log-probs (``importance_weights``) and measures that sampling gap
            (``pop_metrics``) for every engine that samples from the policy itself.
    """

    def __init__(self, *, policy: nn.Module, args, stop_token_id: int | None, pad_token_id: int, corrections) -> None:
        from transformers.generation import ContinuousBatchingConfig

        self.policy, self.args, self.corrections = policy, args, corrections
        self.stop_token_id, self.pad_token_id = stop_token_id, pad_token_id
        settings = {"max_memory_percent": 0.5, **(args.transformers_continuous_batching_config or {})}
        self.batching_config = ContinuousBatchingConfig(**settings)
        if args.repetition_penalty != 1.0:
            logger.warning(
                "use_transformers_continuous_batching: repetition_penalty=%g is applied by transformers' processor, "
                "not the paper's generated-tokens-only penalty (the default engine's).",
                args.repetition_penalty,
            )

    def on_policy_updated(self) -> None:
        """Nothing to do: ``generate_batch`` reads the trained weights themselves."""

    def importance_weights(self, policy_logits, logprobs, responses, mask, sampler_logprobs) -> torch.Tensor:
        return self.corrections.importance_weights(policy_logits, logprobs, responses, mask, sampler_logprobs)

    def pop_metrics(self) -> dict[str, float]:
        return self.corrections.pop_metrics()

    def generation_config(self, sampling: bool, max_new_tokens: int | None):
        """The rollout's ``GenerationConfig``: greedy, or sampled with the run's settings; at most ``max_new_tokens``
        (None: ``response_length``) tokens, ending at the stop token."""
        from transformers import GenerationConfig

        args = self.args
        config = dict(
            max_new_tokens=max_new_tokens or args.response_length,
            eos_token_id=self.stop_token_id,
            pad_token_id=self.pad_token_id,
            do_sample=sampling,
        )
        if sampling:
            config.update(
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=getattr(args, "top_k", None) or 0,
                min_p=getattr(args, "min_p", None),
                repetition_penalty=args.repetition_penalty,
            )
        return GenerationConfig(**config)

    @torch.no_grad()
    def generate(
        self, query_ids: torch.Tensor, query_mask: torch.Tensor, sampling: bool = True, n: int = 1, max_new_tokens=None
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        """``n`` responses (B·n, T) to each left-padded prompt, row ``i·n + j`` prompt ``i``'s ``j``-th, right-padded,
        the mask 1 on the generated tokens (the stop token included)."""
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(query_ids, query_mask, strict=True)]
        requests = [prompt for prompt in prompts for _ in range(n)]  # one request per row: ids in row order
        outputs = self.policy.generate_batch(
            requests,
            generation_config=self.generation_config(sampling, max_new_tokens),
            continuous_batching_config=self.batching_config,
            progress_bar=False,
        )
        rows = sorted(outputs.items(), key=lambda item: int(REQUEST_INDEX.match(item[0]).group(1)))
        if len(rows) != len(requests) or any(output.error for _, output in rows):
            errors = [output.error for _, output in rows if output.error]
            raise RuntimeError(f"generate_batch answered {len(rows)} of {len(requests)} requests: {errors[:1]}")
        device = query_ids.device
        tokens = [torch.tensor(output.generated_tokens, dtype=torch.long, device=device) for _, output in rows]
        tokens = [row.view(1, -1) for row in tokens]
        masks = [torch.ones_like(row) for row in tokens]
        return pad_right(tokens, self.pad_token_id), pad_right(masks, 0), None
