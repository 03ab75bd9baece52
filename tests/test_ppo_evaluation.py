"""Evaluation of :class:`~trl_ppomax.PPOMaxTrainer` (``trl_ppomax.ppo.evaluation``): a dict of evaluation datasets
evaluated under its prefixes, raw evaluation prompts prepared as training prepares them, and bad ones refused before
generating."""

from __future__ import annotations

import math

import pytest
from datasets import Dataset
from helpers import CONTEXT, make_trainer

from trl_ppomax import data
from trl_ppomax.ppo.rollouts import Rollouts
from trl_ppomax.toyworld.tiny import prompt_texts


def test_a_dict_of_evaluation_datasets_is_evaluated_with_prefixes(tmp_path):
    eval_dataset = {
        "short": Dataset.from_dict({"prompt": prompt_texts(3)}),
        "long": Dataset.from_dict({"prompt": [f"{p} {p}" for p in prompt_texts(2)]}),
    }
    trainer = make_trainer(tmp_path, eval_dataset=eval_dataset, metric_for_best_model="short_objective/scores")
    assert set(trainer.eval_dataset) == {"short", "long"}
    assert all(d.column_names == ["prompt", "input_ids"] for d in trainer.eval_dataset.values())
    metrics = trainer.evaluate()
    for name in ("short", "long"):
        assert math.isfinite(metrics[f"eval_{name}_objective/scores"])
        assert metrics[f"eval_{name}_response/length"] > 0
    assert not any(key.startswith("eval_objective") for key in metrics)
    by_name = trainer.evaluate("short", metric_key_prefix="eval_short")  # as the Trainer's own loop asks for one
    assert {k for k in by_name if k.startswith("eval")} == {k for k in metrics if k.startswith("eval_short_")}
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert "eval_long_objective/kl" in logged


def test_evaluate_prepares_raw_prompts_as_training_does(tmp_path, monkeypatch):
    """Over the prompt budget: kept whole while prompt + response fit the context, skipped beyond; never cut."""
    trainer = make_trainer(tmp_path, max_prompt_length=10, response_length=CONTEXT - 40)
    widths = []
    original = Rollouts.rollout

    def recording(self, query_ids, query_mask, sampling=True, **kwargs):
        widths.append(query_ids.shape[1])
        return original(self, query_ids, query_mask, sampling, **kwargs)

    monkeypatch.setattr(Rollouts, "rollout", recording)
    fits, too_long = " ".join(["hello"] * 30), " ".join(["hello"] * 60)  # 30 tokens ≤ 128 − 88 = 40 < 60
    long_prompts = Dataset.from_dict({"prompt": [fits, too_long, *prompt_texts(2)]})
    metrics = trainer.evaluate(long_prompts)
    assert widths and max(widths) == 30  # kept whole, not cut to 10; the 60-token prompt skipped
    assert metrics["eval_response/length"] > 0


def test_evaluate_refuses_bad_raw_prompts_before_generating(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path)
    monkeypatch.setattr(Rollouts, "rollout", lambda *a, **k: pytest.fail("rollout started"))
    with pytest.raises(ValueError, match=r"eval_dataset holds input_ids outside the policy's vocabulary"):
        trainer.evaluate(Dataset.from_dict({"input_ids": [[1, 2, 500]]}))
    with pytest.raises(ValueError, match=r"eval_dataset: 1 of 2 prompts are empty"):
        trainer.evaluate(Dataset.from_dict({"prompt": ["hello", ""]}))
    with pytest.raises(ValueError, match=r"response_length"):
        data.check_prompt_budget(16, None, 16)
