"""Phase 1, second half: **score** what the generation engine wrote (a rollout is generate → score), the same for
every engine: no-grad forwards in micro-batches (:func:`~trl_ppomax.ppo.batching.forward_groups`) of the policy's and
reference's log-probs (the policy gathered under ZeRO-3, the critic left sharded), then the critic's values and the
reward sources' scores, minus the missing-stop-token penalty."""

from __future__ import annotations

import torch
from torch import nn

from trl_ppomax import data, models, rewards
from trl_ppomax.base import core
from trl_ppomax.base.rollout import Rollout, merge_rollouts, take_rows
from trl_ppomax.ppo.batching import forward_groups, forward_queries


class Scorer:
    """Scores rollouts for one trainer.

    Args (keyword-only):
        args: the run's config (forward micro-batch sizes, ``missing_eos_penalty``, the KL estimator's needs).
        accelerator: the run's ``Accelerator``; ``tokenizer``: the policy's.
        reward_sources: the :class:`~trl_ppomax.rewards.RewardSources` that score a response.
        ref_model: the prepared reference policy (None: the PEFT policy with its adapter off).
        generation: the generation engine or the producer of rollouts generated ahead (its ``importance_weights``
            when rollouts come with their sampler's log-probs).
        end_token_id: the token that ends a finished response, which the missing-stop-token penalty looks for.
    """

    def __init__(
        self, *, args, accelerator, tokenizer, reward_sources, ref_model, generation, end_token_id: int
    ) -> None:
        self.args, self.accelerator, self.tokenizer = args, accelerator, tokenizer
        self.reward_sources, self.ref_model = reward_sources, ref_model
        self.generation, self.end_token_id = generation, end_token_id

    def log_probs(
        self, wrapper, query_ids, query_mask, responses, mask, sampler_logprobs, env_mask=None, policy: bool = True
    ) -> tuple[list, int]:
        """The policy's and reference's log-probs of every forward micro-batch: ``(parts, real)``, a ``(rows, fields)``
        pair per forward (:class:`Rollout` fields) and how many are real: every process runs as many forwards as
        the busiest (ZeRO-3 gathers parameters in each), the others repeating a row. ``env_mask`` (B, T): 0 on a
        multi-turn trajectory's environment tokens (kept in the rollout, see :attr:`Rollout.policy_mask`). Without
        ``policy`` the policy's forward is left to the update (its log-probs and perplexity None), unless the sampler
        wrote log-probs of its own to compare them with."""
        groups, count = forward_groups(query_mask, mask, self.args, self.accelerator)
        padded = groups + [groups[0][:1]] * (count - len(groups))
        rows, extra = (query_ids, query_mask, responses, mask), (sampler_logprobs, env_mask)
        parts = []
        for g in padded:
            fields = self._log_probs(wrapper, *(t[g] for t in rows), *(take_rows(t, g) for t in extra), policy)
            parts.append((g, fields))
        return parts, len(groups)

    def values_and_rewards(self, critic: nn.Module | None, parts: list, real: int, columns) -> Rollout:
        """The critic's values (zeros without a critic) and the rewards of every forward of :meth:`log_probs`, merged
        into one :class:`Rollout` in the original row order (the repeated rows dropped)."""
        scored = [self._values_and_rewards(critic, fields, data.rows_of(columns, g.tolist())) for g, fields in parts]
        groups = [g for g, _ in parts[:real]]
        return merge_rollouts(scored[:real], groups, self.tokenizer.pad_token_id)

    def _log_probs(self, wrapper, query_ids, query_mask, responses, mask, sampler_logprobs, env_mask, policy) -> dict:
        width = max(int(mask.sum(1).max()), 1)  # the responses trimmed to this micro-batch's longest
        responses, mask = responses[:, :width], mask[:, :width]
        env_mask = None if env_mask is None else env_mask[:, :width]
        policy_mask = mask if env_mask is None else mask * env_mask  # the sampler wrote these
        inputs = models.sequence_inputs(*forward_queries(query_ids, query_mask, self.args), responses, mask)
        logprobs = policy_perplexity = weights = None
        if policy or sampler_logprobs is not None:
            features, head = models.response_features(wrapper.policy, inputs, width)
            logprobs, policy_perplexity = logprobs_and_perplexity(features, head, responses, mask, self.args)
        if sampler_logprobs is not None:  # another sampler (vLLM, the producer's older copy): the gap to the policy's
            sampler, policy_logits = sampler_logprobs[:, :width], head(features)  # its nucleus needs the whole logits
            weights = self.generation.importance_weights(policy_logits, logprobs, responses, policy_mask, sampler)
        with models.reference_policy(self.ref_model, wrapper.policy, self.args.ref_adapter_name) as reference:
            features, head = models.response_features(reference, inputs, width)
            ref_logprobs, ref_perplexity = logprobs_and_perplexity(features, head, responses, mask, self.args)
        fields = dict(query_ids=query_ids, query_mask=query_mask, response_ids=responses, response_mask=mask)
        fields.update(env_mask=env_mask)
        fields.update(logprobs=logprobs, ref_logprobs=ref_logprobs, sampling_weights=weights)
        return dict(fields, policy_perplexity=policy_perplexity, ref_perplexity=ref_perplexity)

    def _values_and_rewards(self, critic: nn.Module | None, fields: dict, columns: dict) -> Rollout:
        responses, mask = fields["response_ids"], fields["response_mask"]
        query_ids, query_mask = forward_queries(fields["query_ids"], fields["query_mask"], self.args)
        inputs = models.sequence_inputs(query_ids, query_mask, responses, mask)
        scores, source_scores = self._scores(inputs, query_mask, responses, mask, columns)
        if critic is None:  # a critic-free estimator
            values = torch.zeros_like(fields["ref_logprobs"])
        else:
            values = models.token_values(critic, inputs, mask.shape[1]) * mask
        return Rollout(**fields, source_scores=source_scores, values=values, scores=scores)

    def _scores(self, inputs: dict, query_mask, responses, mask, columns) -> tuple[torch.Tensor, torch.Tensor]:
        """The reward sources' scores (B,) after the missing-stop-token penalty, and each source's (B, S)."""
        scores, source_scores = self.reward_sources.score(self.tokenizer, inputs, query_mask, mask, columns)
        penalty = self.args.missing_eos_penalty
        return rewards.apply_missing_eos_penalty(scores, responses, mask, self.end_token_id, penalty), source_scores

    def sample_scores(self, query_ids, query_mask, responses, mask, columns) -> Rollout:
        """Responses and their scores alone (after the missing-stop-token penalty), for sample tables: a
        :class:`Rollout` without the log-prob and value forwards (those fields are None)."""
        inputs = models.sequence_inputs(query_ids, query_mask, responses, mask)
        scores, _ = self._scores(inputs, query_mask, responses, mask, columns)
        unmeasured = dict.fromkeys(("logprobs", "ref_logprobs", "values", "policy_perplexity", "ref_perplexity"))
        return Rollout(query_ids, query_mask, responses, mask, scores=scores, **unmeasured)


def policy_logprobs(model: nn.Module, query_ids, query_mask, responses, mask, args) -> torch.Tensor:
    """Masked log-probs (B, T) of ``responses`` under ``model`` at the scoring temperature, as :class:`Scorer`'s
    forwards compute them (for the behaviour policy of a rollout the producer generated ahead)."""
    inputs = models.sequence_inputs(*forward_queries(query_ids, query_mask, args), responses, mask)
    return models.response_logprobs(model, inputs, responses, **models.logprob_options(args))[0] * mask


def logprobs_and_perplexity(
    features: torch.Tensor, head, responses: torch.Tensor, mask: torch.Tensor, args
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked log-probs (B, T) of ``responses`` at the log-prob temperature and the perplexity (B,) at temperature 1,
    from ``head(features)`` (:func:`~trl_ppomax.models.response_features`), the head run once per chunk for both.
    A chunk is ``logprob_chunk_size`` positions at any vocabulary, as :func:`~trl_ppomax.models.chunk_positions`
    takes it without a gradient."""
    options = models.logprob_options(args)
    temperatures = (options["temperature"], 1.0) if options["temperature"] != 1 else (1.0,)
    logprobs, *rest = core.token_logprobs_at(features, head, responses, temperatures, options["chunk_size"])
    at_one = rest[0] if rest else logprobs
    return logprobs * mask, core.sequence_perplexity(at_one, mask)
