"""Generation engines behind one interface: the rollout is **generate → score**, and this is the first half.

An engine has ``generate(query_ids, query_mask, sampling=True, n=1) -> (response_ids, response_mask,
sampler_logprobs)``: ``n`` responses (B·n, T) to each left-padded prompt (B, L), in a row per prompt, right-padded, the
mask 1 up to and including the stop token, and the sampler's log-probs of the sampled tokens (None when the engine's
own forward is the policy's, as with ``generate``). ``on_policy_updated()`` is called after every update that changed
the policy; ``pop_metrics()`` returns what the engine measured since the last call. :class:`HFGeneration` samples with
the policy's own ``generate``; :class:`~trl_ppomax.generation.vllm.VLLMEngine` with vLLM (``use_vllm=True``). Scoring (the
policy, reference, critic and reward forwards) is the trainer's next step and the same for every engine.
"""

from __future__ import annotations

import torch
from torch import nn

from trl_ppomax.ppo.experience import generate_responses, generation_kwargs

__all__ = ["HFGeneration"]


class HFGeneration:
    """Rollouts by the policy's own ``generate`` (:func:`~trl_ppomax.ppo.experience.generation_kwargs`: the repetition
    penalty on generated tokens only, temperature, top-p, ending at ``stop_token_id``). ``policy``: the unwrapped
    policy the trainer trains (gathered in place under ZeRO-3 while the trainer generates)."""

    def __init__(self, policy: nn.Module, args, stop_token_id: int | None, pad_token_id: int) -> None:
        self.policy, self.args = policy, args
        self.stop_token_id, self.pad_token_id = stop_token_id, pad_token_id

    def generation_kwargs(self, sampling: bool = True, prompt_width: int = 0) -> dict:
        """The ``generate()`` arguments of a rollout whose prompts are ``prompt_width`` columns wide."""
        return generation_kwargs(self.args, self.stop_token_id, self.pad_token_id, sampling, prompt_width)

    @torch.no_grad()
    def generate(self, query_ids: torch.Tensor, query_mask: torch.Tensor, sampling: bool = True, n: int = 1):
        """See the module docstring; the sampler's log-probs are None (``generate`` samples from the policy itself)."""
        kwargs = {**self.generation_kwargs(sampling, query_ids.shape[1]), "num_return_sequences": n}
        return *generate_responses(self.policy, query_ids, query_mask, kwargs), None

    def on_policy_updated(self) -> None:
        """Nothing to do: ``generate`` reads the trained weights themselves."""

    def pop_metrics(self) -> dict[str, float]:
        return {}
