"""The advantage-estimator seam (``trl_ppomax.ppo.advantages``): GAE as the registry's first entry, the name checked by
the config, and a registered estimator used by the trainer without any other change."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import make_trainer

from trl_ppomax import PPOMaxConfig
from trl_ppomax.ppo import advantages, core


def tokens(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rewards, values = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    return rewards * mask, values * mask, mask


@pytest.mark.parametrize(
    "settings",
    [
        dict(gamma=1.0, lam=0.95, lam_alpha=None, lam_critic=None),
        dict(gamma=0.99, lam=0.9, lam_alpha=None, lam_critic=1.0),
        dict(gamma=1.0, lam=0.95, lam_alpha=0.5, lam_critic=1.0),
    ],
)
def test_gae_is_the_core_definition(settings):
    rewards, values, mask = tokens()
    args = type("Args", (), settings)
    estimate = advantages.ESTIMATORS["gae"].estimate(rewards, values, mask, args)
    lam = settings["lam"] if settings["lam_alpha"] is None else core.length_adaptive_lam(mask, settings["lam_alpha"])
    expected = core.decoupled_gae(rewards, values, mask, settings["gamma"], lam, settings["lam_critic"])
    torch.testing.assert_close((estimate.advantages, estimate.returns), expected)
    assert advantages.ESTIMATORS["gae"].needs_critic


def test_an_unknown_estimator_is_refused_with_the_registered_names(tmp_path):
    with pytest.raises(ValueError, match=r"advantage_estimator must be one of \('gae',\), got 'gea'"):
        PPOMaxConfig(output_dir=str(tmp_path), advantage_estimator="gea", report_to="none")


def test_a_registered_estimator_is_the_one_the_trainer_uses(tmp_path, monkeypatch):
    def negated_gae(token_rewards, values, mask, args):
        estimate = advantages.gae(token_rewards, values, mask, args)
        return dataclasses.replace(estimate, advantages=-estimate.advantages)

    registry = {**advantages.ESTIMATORS, "negated": advantages.AdvantageEstimator("negated", True, negated_gae)}
    monkeypatch.setattr(advantages, "ESTIMATORS", registry)
    monkeypatch.setattr("trl_ppomax.ppo.config.ESTIMATORS", registry)
    monkeypatch.setattr("trl_ppomax.ppo.experience.ESTIMATORS", registry)
    runs = {name: make_trainer(tmp_path / name, advantage_estimator=name, whiten_advantages=False)
            for name in ("gae", "negated")}  # fmt: skip
    prompts = runs["gae"].processing_class(["hello how are you", "tell me a story"], return_tensors="pt", padding=True)
    rollout = runs["gae"].rollout(prompts["input_ids"], prompts["attention_mask"])
    plain, _, _ = runs["gae"].make_experience(rollout)
    negated, _, _ = runs["negated"].make_experience(rollout)
    torch.testing.assert_close(negated.advantages, -plain.advantages)
    torch.testing.assert_close(negated.returns, plain.returns)
