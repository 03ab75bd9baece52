"""Scoring what the generation engine wrote (``trl_ppomax.ppo.scoring``): log-probs at the scoring temperature and
perplexity at temperature 1 by hand, the scorer's log-probs the policy's own forward (and the reference's, before any
update, the same), and the missing-stop-token penalty taken from the unfinished responses only."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import make_trainer
from torch import nn

from trl_ppomax import models
from trl_ppomax.ppo.scoring import logprobs_and_perplexity, policy_logprobs


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    return make_trainer(tmp_path_factory.mktemp("scoring"), missing_eos_penalty=2.0)


def test_logprobs_at_the_temperature_and_perplexity_at_one_over_the_real_tokens():
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]]])  # one response of two tokens, a vocabulary of 3
    responses, mask = torch.tensor([[0, 2]]), torch.tensor([[1, 0]])  # the second token is padding
    at = {t: SimpleNamespace(effective_logprob_temperature=t, logprob_chunk_size=1) for t in (1.0, 2.0)}
    logprobs, perplexity = logprobs_and_perplexity(logits, nn.Identity(), responses, mask, at[2.0])
    at_two = 1.0 - math.log(math.exp(1.0) + math.exp(0.0) + math.exp(-0.5))  # logits / 2
    at_one = 2.0 - math.log(math.exp(2.0) + math.exp(0.0) + math.exp(-1.0))
    assert logprobs[0].tolist() == pytest.approx([at_two, 0.0])
    assert perplexity.tolist() == pytest.approx([math.exp(-at_one)])
    same, _ = logprobs_and_perplexity(logits, nn.Identity(), responses, mask, at[1.0])
    assert same[0].tolist() == pytest.approx([at_one, 0.0])


def test_the_scorers_log_probs_are_the_policys_forward_and_the_references_before_any_update(trainer):
    rollout = trainer.rollouts.training(1)
    with torch.no_grad():
        expected = policy_logprobs(
            trainer.model.policy,
            rollout.query_ids,
            rollout.query_mask,
            rollout.response_ids,
            rollout.response_mask,
            trainer.args,
        )
    torch.testing.assert_close(rollout.logprobs, expected)
    torch.testing.assert_close(rollout.ref_logprobs, rollout.logprobs)  # a copy of the policy, not yet trained
    assert torch.all(rollout.logprobs[rollout.response_mask == 0] == 0)


def test_the_scoring_forwards_take_logprob_chunk_size_positions_at_any_vocabulary(tmp_path):
    """No gradient, nothing to recompute: the scoring forwards' chunks are ``logprob_chunk_size`` positions even at
    a small vocabulary, where the update's grow (``models.chunk_positions``) — the least memory at no recomputation."""
    trainer = make_trainer(tmp_path, logprob_chunk_size=4)
    assert models.chunk_positions(4, trainer.model.policy) > 100  # the update's chunk at the tiny vocabulary
    rows = []
    heads = {trainer.model.policy.get_output_embeddings(), trainer.ref_model.get_output_embeddings()}
    hooks = [head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape)) for head in heads]
    try:
        rollout = trainer.rollouts.training(1)
    finally:
        for hook in hooks:
            hook.remove()
    chunks = [shape[0] for shape in rows if len(shape) == 2]  # the model's own calls keep (B, 1, H)
    assert chunks and max(chunks) == 4
    # every response position once through each head, the policy's and the reference's
    assert sum(chunks) == 2 * rollout.response_ids.numel()


def test_the_missing_stop_token_penalty_is_taken_from_unfinished_responses_only(trainer):
    scorer, prompts = trainer.rollouts.scorer, trainer.rollouts.prompt_batch(1)
    query_ids, query_mask = prompts.query_ids[:2], prompts.query_mask[:2]
    end, pad, word = scorer.end_token_id, trainer.processing_class.pad_token_id, a_word(trainer)
    responses = torch.tensor([[word, word, end, pad], [word, word, word, word]])  # finished, cut at the budget
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    scored = scorer.sample_scores(query_ids, query_mask, responses, mask, {})
    inputs = models.sequence_inputs(query_ids, query_mask, responses, mask)
    raw, _ = trainer.reward_sources.score(trainer.processing_class, inputs, query_mask, mask, {})
    torch.testing.assert_close(scored.scores, raw - torch.tensor([0.0, 2.0]))


def a_word(trainer) -> int:
    """A word of the tiny vocabulary that is no special token."""
    tokenizer = trainer.processing_class
    return next(i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids)
