"""The advantage-estimator seam (``trl_ppomax.ppo.advantages``): GAE as the registry's first entry, the name checked by
the config, a registered estimator used by the trainer without any other change, and one that needs no critic
trained, saved and resumed without one."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import StopAt, changed, make_trainer, snapshot

from trl_ppomax import PPOMaxConfig
from trl_ppomax.ppo import advantages, core
from trl_ppomax.toyworld.tiny import build_models


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
    runs = {name: make_trainer(tmp_path / name, advantage_estimator=name, whiten_advantages=False)
            for name in ("gae", "negated")}  # fmt: skip
    prompts = runs["gae"].processing_class(["hello how are you", "tell me a story"], return_tensors="pt", padding=True)
    rollout = runs["gae"].rollout(prompts["input_ids"], prompts["attention_mask"])
    plain, _, _ = runs["gae"].make_experience(rollout)
    negated, _, _ = runs["negated"].make_experience(rollout)
    torch.testing.assert_close(negated.advantages, -plain.advantages)
    torch.testing.assert_close(negated.returns, plain.returns)


def reinforce_returns(token_rewards, values, mask, args):
    """A critic-free estimator of the test's own: the advantage is the reward-to-go, Σ_{l≥t} r_l."""
    to_go = token_rewards.flip(1).cumsum(1).flip(1) * mask
    return advantages.AdvantageEstimate(to_go, to_go)


@pytest.fixture
def critic_free(monkeypatch):
    estimator = advantages.AdvantageEstimator("reward_to_go", needs_critic=False, estimate=reinforce_returns)
    monkeypatch.setattr(advantages, "ESTIMATORS", {**advantages.ESTIMATORS, "reward_to_go": estimator})
    return "reward_to_go"


def test_an_estimator_that_needs_no_critic_trains_without_one(tmp_path, critic_free):
    settings = dict(advantage_estimator=critic_free, save_strategy="steps", save_steps=1)
    trainer = make_trainer(tmp_path, callbacks=[StopAt(1)], **settings)
    assert trainer.model.critic is None and trainer.model.value_model is None
    assert trainer.reward_model is trainer.reward_sources.sources[0]  # trl 1.12's name: the reward model still
    assert {group["model"] for group in trainer.optimizer.param_groups} == {"policy"}
    before = snapshot(trainer.model.policy)
    trainer.train()
    assert changed(before, trainer.model.policy) > 0
    logged = trainer.state.log_history[-1]
    assert math.isfinite(logged["loss/policy"]) and "loss/value" not in logged and "critic/values" not in logged
    assert "policy/grad_norm" in logged and "critic/grad_norm" not in logged
    checkpoint = tmp_path / "out" / "checkpoint-1"
    assert (checkpoint / "model.safetensors").is_file() and not (checkpoint / "critic").exists()
    resumed = make_trainer(tmp_path, **settings)  # the stopped run continued from its checkpoint
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 2 and resumed.model.critic is None


def test_a_value_model_beside_a_critic_free_estimator_is_refused(tmp_path, critic_free):
    with pytest.raises(ValueError, match="needs no critic and builds none: pass value_model=None"):
        make_trainer(tmp_path, value_model=build_models()[2], advantage_estimator=critic_free)


def test_a_reward_function_needs_no_value_model_without_a_critic(tmp_path, critic_free):
    trainer = make_trainer(
        tmp_path, reward=lambda prompts, completions, **_: [1.0] * len(prompts), advantage_estimator=critic_free
    )
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.reward_model is trainer.reward_sources.sources[0]


def test_a_critic_free_estimator_skips_the_presets_critic_warmup(tmp_path, critic_free, caplog):
    assert PPOMaxConfig(output_dir=str(tmp_path), report_to="none").critic_warmup_steps == 4  # ppo_max pre-trains
    free = PPOMaxConfig(output_dir=str(tmp_path), report_to="none", advantage_estimator=critic_free)
    assert free.critic_warmup_steps == 0
    with caplog.at_level("WARNING", logger="trl_ppomax.ppo.config"):
        told = PPOMaxConfig(
            output_dir=str(tmp_path), report_to="none", advantage_estimator=critic_free, critic_warmup_steps=3
        )
    assert told.critic_warmup_steps == 0 and "critic_warmup_steps=3 does not apply" in caplog.text
