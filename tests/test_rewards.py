"""The reward-source seam (``trl_ppomax.rewards``): every kind a user passes scores through one protocol,
``score(ScoringBatch) -> (B,)``, and a source of the user's own trains PPO-max without any other change."""

from __future__ import annotations

import torch
from helpers import changed, make_trainer, snapshot

from trl_ppomax import rewards
from trl_ppomax.models import sequence_inputs, sequence_scores
from trl_ppomax.toyworld.tiny import build_models


def batch_of(tokenizer, prompts, responses):
    encode = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    answer = tokenizer(responses, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    inputs = sequence_inputs(
        encode["input_ids"], encode["attention_mask"], answer["input_ids"], answer["attention_mask"]
    )
    return rewards.ScoringBatch(tokenizer, inputs, encode["attention_mask"], answer["attention_mask"])


def test_every_kind_of_source_scores_through_the_protocol():
    tokenizer, _, reward_model = build_models()
    batch = batch_of(tokenizer, ["tell me a", "hello how"], ["story", "are you today"])

    def words(completions, **_):
        return [float(len(c.split())) for c in completions]

    async def letters(completions, **_):
        return [float(len(c)) for c in completions]

    model, function, coroutine = (rewards.as_source(s) for s in (reward_model, words, letters))
    assert isinstance(model, rewards.ModelSource) and isinstance(function, rewards.FunctionSource)
    torch.testing.assert_close(model.score(batch), sequence_scores(reward_model, batch.inputs))
    assert function.score(batch).tolist() == [1.0, 3.0]
    assert rewards.awaited([coroutine.score(batch)])[0].tolist() == [5.0, 13.0]
    own = rewards.as_source(reward_model, tokenizer)  # the same vocabulary, re-encoded from the decoded texts
    assert isinstance(own, rewards.OwnTokenizerModelSource) and own.score(batch).shape == (2,)
    combined, each = rewards.RewardSources([words, letters], weights=[2.0, 0.5]).score(
        tokenizer, batch.inputs, batch.query_mask, batch.response_mask
    )
    assert each.tolist() == [[1.0, 5.0], [3.0, 13.0]] and combined.tolist() == [4.5, 12.5]


class Brevity(rewards.RewardSource):
    """A source of the user's own: shorter responses score higher, read from the token ids alone."""

    name = "brevity"

    def __init__(self) -> None:
        self.batches = 0

    def score(self, batch: rewards.ScoringBatch) -> torch.Tensor:
        self.batches += 1
        return -batch.response_mask.sum(1).float()


def test_a_source_of_ones_own_trains_ppo_max(tmp_path):
    source = Brevity()
    trainer = make_trainer(tmp_path, reward=[source], value_model=build_models()[2])
    before = snapshot(trainer.model.policy)
    trainer.train()
    assert changed(before, trainer.model.policy) > 0 and source.batches >= 2
    assert trainer.state.log_history[-1]["rewards/brevity/mean"] < 0
