"""The generation seam (``trl_ppomax.generation``): a rollout is generate → score, and the trainer talks to its
engine only through ``generate``, ``on_policy_updated`` and ``pop_metrics`` (vLLM's engine: tests/test_vllm.py)."""

from __future__ import annotations

import torch
from helpers import make_trainer

from trl_ppomax.generation import HFGeneration, generate_responses


def prompts(trainer, texts=("hello how are you", "tell me a story")):
    batch = trainer.processing_class(list(texts), return_tensors="pt", padding=True)
    return batch["input_ids"], batch["attention_mask"]


def test_hf_generation_samples_n_in_a_row_per_prompt_as_generate_does(tmp_path):
    trainer = make_trainer(tmp_path, response_length=5)
    engine = trainer.generation
    assert isinstance(engine, HFGeneration) and trainer.vllm is None
    ids, mask = prompts(trainer)
    torch.manual_seed(3)
    responses, response_mask, sampler = engine.generate(ids, mask, sampling=True, n=3)
    assert sampler is None and responses.shape == (6, 5) and response_mask.shape == (6, 5)
    kwargs = {**engine.generation_kwargs(True, ids.shape[1]), "num_return_sequences": 3}
    torch.manual_seed(3)
    expected, expected_mask = generate_responses(engine.policy, ids, mask, kwargs)
    assert torch.equal(responses, expected) and torch.equal(response_mask, expected_mask)
    greedy, _, _ = engine.generate(ids, mask, sampling=False)
    assert greedy.shape == (2, 5)


class Recording:
    """An engine of the user's own: the trainer's HF engine, recording what the trainer asks of it."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def generate(self, query_ids, query_mask, sampling=True, n=1):
        self.calls.append(("generate", len(query_ids), n))
        return self.inner.generate(query_ids, query_mask, sampling, n)

    def on_policy_updated(self) -> None:
        self.calls.append(("on_policy_updated",))

    def pop_metrics(self) -> dict[str, float]:
        return {"generation/calls": float(len(self.calls))}


def test_the_trainer_generates_through_its_engine_and_says_when_the_policy_changed(tmp_path):
    trainer = make_trainer(tmp_path, critic_warmup_steps=1, num_samples_per_prompt=2)
    trainer.generation = engine = Recording(trainer.generation)
    trainer.train()
    generated = [call for call in engine.calls if call[0] == "generate"]
    assert generated and all(n == 2 for _, _, n in generated)
    # two iterations: the first trains the critic only (the policy did not change), the second the policy
    assert engine.calls.count(("on_policy_updated",)) == 1 and engine.calls[-1] == ("on_policy_updated",)
    assert any("generation/calls" in log for log in trainer.state.log_history)
