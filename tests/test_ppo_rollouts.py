"""The rollout phase (``trl_ppomax.ppo.rollouts``): rollout = generate → score, row ``i·n + j`` holding prompt
``i``'s ``j``-th sample; training batch ``i`` read from prompt batch ``i``; a batch's prompts as the dataset gave
them; a sample table's rollout the same responses and scores as the full rollout, without its log-prob and value
forwards."""

from __future__ import annotations

import pytest
import torch
from helpers import make_trainer

from trl_ppomax.generation import PromptBatch


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    return make_trainer(tmp_path_factory.mktemp("rollouts"), num_samples_per_prompt=2)


def test_a_training_rollout_holds_each_prompt_of_its_batch_n_times_in_a_row(trainer):
    prompts = trainer.rollouts.prompt_batch(1)
    rollout = trainer.rollouts.training(1)
    assert rollout.query_ids.shape[0] == 2 * prompts.query_ids.shape[0]
    assert torch.equal(rollout.query_ids, prompts.query_ids.repeat_interleave(2, dim=0))
    assert torch.equal(rollout.query_mask, prompts.query_mask.repeat_interleave(2, dim=0))
    assert rollout.scores.shape == (rollout.query_ids.shape[0],) and torch.isfinite(rollout.scores).all()
    assert rollout.logprobs.shape == rollout.values.shape == rollout.response_ids.shape


def test_samples_per_prompt_are_laid_out_row_i_n_plus_j(trainer):
    prompts = trainer.rollouts.prompt_batch(2)
    rollout = trainer.rollouts.rollout(prompts.query_ids[:3], prompts.query_mask[:3], samples_per_prompt=3)
    assert rollout.query_ids.shape[0] == 9
    for i in range(3):
        for j in range(3):
            assert torch.equal(rollout.query_ids[3 * i + j], prompts.query_ids[i]), (i, j)


def test_a_batchs_prompts_are_the_prompt_column_or_else_decoded(trainer):
    prompts = trainer.rollouts.prompt_batch(1)
    texts = trainer.rollouts.prompts_of(prompts)
    assert texts == prompts.columns["prompt"] and len(texts) == prompts.query_ids.shape[0]
    without_column = PromptBatch(prompts.query_ids, prompts.query_mask, {})
    assert trainer.rollouts.prompts_of(without_column) == texts  # the tiny tokenizer decodes them back


def test_a_sample_table_gets_the_full_rollouts_responses_and_scores_without_its_forwards(trainer):
    prompts = trainer.rollouts.prompt_batch(1)
    full = trainer.rollouts.rollout(prompts.query_ids, prompts.query_mask, sampling=False)
    table = trainer.rollouts.sample_and_score(prompts.query_ids, prompts.query_mask, sampling=False)
    assert torch.equal(full.response_ids, table.response_ids)
    assert torch.equal(full.response_mask, table.response_mask)
    torch.testing.assert_close(full.scores, table.scores)
    assert full.logprobs is not None and full.values is not None
    assert table.logprobs is None and table.ref_logprobs is None and table.values is None
