"""The advantage-estimator seam (``trl_ppomax.ppo.advantages``): GAE as the registry's first entry, the name checked by
the config, a registered estimator used by the trainer without any other change, one that needs no critic trained,
saved and resumed without one; the critic-free estimators (RLOO, GRPO, Dr. GRPO, REINFORCE++ and its baseline)
by hand and against verl's and OpenRLHF's numbers, and each in a tiny run."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from helpers import StopAt, changed, make_trainer, snapshot

from trl_ppomax import PPOMaxConfig
from trl_ppomax.base import core
from trl_ppomax.ppo import advantages
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
    with pytest.raises(
        ValueError, match=r"advantage_estimator must be one of \('gae', 'reinforce_pp', .*\), got 'gea'"
    ):
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
    assert told.critic_warmup_steps == 0 and "critic_warmup_steps=3: not applied" in caplog.text


# -- The critic-free estimators -----------------------------------------------------------------------------------------
PEERS = json.loads((Path(__file__).parent / "data" / "peer_estimators.json").read_text())
GROUP_ESTIMATORS = ("rloo", "grpo", "dr_grpo", "reinforce_pp_baseline")


def test_group_baselines_by_hand():
    """Two prompts × 3 samples; the last sample of the second prompt dropped (a non-finite reward)."""
    scores = torch.tensor([1.0, 2.0, 6.0, 4.0, 0.0, 9.0])
    kept = torch.tensor([True, True, True, True, True, False])
    mean_centred = advantages.group_mean_baseline(scores, kept, 3)
    torch.testing.assert_close(mean_centred, torch.tensor([-2.0, -1.0, 3.0, 2.0, -2.0, 0.0]))
    # RLOO: s_i − mean of the others: 1 − (2+6)/2 = −3, 2 − 3.5 = −1.5, 6 − 1.5 = 4.5; 4 − 0 = 4, 0 − 4 = −4
    loo = advantages.leave_one_out_baseline(scores, kept, 3)
    torch.testing.assert_close(loo, torch.tensor([-3.0, -1.5, 4.5, 4.0, -4.0, 0.0]))
    # GRPO: std of (1, 2, 6) is sqrt(7) (unbiased), of (4, 0) sqrt(8)
    grpo = advantages.group_normalized(scores, kept, 3)
    root7, root8 = math.sqrt(7), math.sqrt(8)
    expected = [-2 / root7, -1 / root7, 3 / root7, 2 / root8, -2 / root8, 0.0]
    torch.testing.assert_close(grpo, torch.tensor(expected), atol=1e-5, rtol=1e-5)
    alone = advantages.group_mean_baseline(torch.tensor([5.0, 3.0]), torch.tensor([True, False]), 2)
    assert alone.tolist() == [0.0, 0.0]  # nothing to compare a lone sample with


def test_the_critic_free_advantage_is_the_return_from_each_token():
    """A_t = Σ_{s≥t} γ^{s−t} r_s: score 2 on the last of three tokens, −0.1 KL reward on each; γ = 0.5."""
    rewards = torch.tensor([[-0.1, -0.1, 1.9, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    estimate = advantages.discounted_returns(rewards, torch.zeros_like(rewards), mask, type("A", (), {"gamma": 0.5}))
    torch.testing.assert_close(estimate.advantages, torch.tensor([[-0.1 - 0.05 + 0.475, -0.1 + 0.95, 1.9, 0.0]]))


class PeerArgs:
    gamma, lam, lam_alpha, lam_critic, kl_coef = 1.0, None, None, None, PEERS["inputs"]["kl_coef"]
    whiten_rewards, num_samples_per_prompt = False, PEERS["inputs"]["group_size"]
    group_std_eps, group_scale = 1e-6, "group"  # verl's ε, each prompt's std


def our_advantages(name: str, kl_in_reward: bool) -> torch.Tensor:
    """The experience phase's estimate on the peers' inputs (scores already shaped)."""
    from trl_ppomax.ppo import advantages

    inputs = {k: torch.tensor(v) for k, v in PEERS["inputs"].items() if k in ("scores", "kl", "mask")}
    args = type("A", (PeerArgs,), {"advantage_estimator": name, "kl_placement": "reward" if kl_in_reward else "loss"})
    values = torch.zeros_like(inputs["kl"])
    return advantages.estimate(args, inputs["scores"], inputs["kl"], inputs["mask"], values, lambda t: t).advantages


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_the_critic_free_estimators_equal_verls_with_the_kl_as_a_loss(name):
    """verl's ``core_algos`` (compute_grpo/rloo/reinforce_plus_plus(_baseline)_outcome_advantage, norm_adv_by_std_in_grpo
    False for Dr. GRPO), run on these inputs in a throwaway check; its numbers are in tests/data."""
    expected = torch.tensor(PEERS["verl_kl_in_loss"][name])
    torch.testing.assert_close(our_advantages(name, kl_in_reward=False), expected, atol=1e-5, rtol=1e-5)


def test_reinforce_pp_equals_verls_with_the_kl_in_the_reward():
    expected = torch.tensor(PEERS["verl_kl_in_reward"]["reinforce_pp"])
    torch.testing.assert_close(our_advantages("reinforce_pp", kl_in_reward=True), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["rloo", "dr_grpo", "grpo"])
def test_the_group_estimators_equal_openrlhfs_with_the_kl_in_the_reward(name):
    """OpenRLHF's experience maker (baseline on the score, compute_reward, get_cumulative_returns; group_norm for GRPO,
    whose ε is 1e-9 against verl's 1e-6)."""
    expected = torch.tensor(PEERS["openrlhf_kl_in_reward"][name])
    torch.testing.assert_close(our_advantages(name, kl_in_reward=True), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_a_group_estimator_needs_several_samples_per_prompt(tmp_path, name):
    with pytest.raises(ValueError, match="set num_samples_per_prompt ≥ 2"):
        PPOMaxConfig(output_dir=str(tmp_path), report_to="none", advantage_estimator=name)
    PPOMaxConfig(output_dir=str(tmp_path), report_to="none", advantage_estimator=name, num_samples_per_prompt=2)


def test_the_critics_settings_are_named_when_no_critic_uses_them(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="trl_ppomax.ppo.config"):
        PPOMaxConfig(output_dir=str(tmp_path), report_to="none", advantage_estimator="reinforce_pp", vf_coef=0.5)
    assert "vf_coef=0.5: not applied, advantage_estimator='reinforce_pp' needs no critic" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="trl_ppomax.ppo.config"):
        PPOMaxConfig(output_dir=str(tmp_path), report_to="none", advantage_estimator="reinforce_pp")
    assert caplog.text == ""  # the everyday setup: nothing to say


@pytest.mark.parametrize("name", ["reinforce_pp", *GROUP_ESTIMATORS])
def test_each_critic_free_estimator_trains_a_tiny_policy_without_a_critic(tmp_path, name):
    trainer = make_trainer(tmp_path, advantage_estimator=name, num_samples_per_prompt=2)
    assert trainer.model.critic is None
    before = snapshot(trainer.model.policy)
    trainer.train()
    assert changed(before, trainer.model.policy) > 0
    logged = trainer.state.log_history[-1]
    assert math.isfinite(logged["loss/policy"]) and "loss/value" not in logged
    assert "critic/explained_variance" not in logged


def test_group_advantages_sum_to_zero_within_each_prompt(tmp_path):
    """Dr. GRPO's advantages (KL as a loss: the centred score on every token) cancel over a prompt's samples."""
    trainer = make_trainer(tmp_path, advantage_estimator="dr_grpo", num_samples_per_prompt=2, kl_placement="loss")
    prompts = trainer.processing_class(["hello how are you", "tell me a story"], return_tensors="pt", padding=True)
    rollout = trainer.rollout(prompts["input_ids"], prompts["attention_mask"], samples_per_prompt=2)
    experience, _, _ = trainer.make_experience(rollout)
    first = experience.raw_advantages[:, 0].view(-1, 2)
    torch.testing.assert_close(first.sum(1), torch.zeros(2), atol=1e-5, rtol=0)
    assert (first != 0).any()


@pytest.mark.parametrize("name", ["reinforce_pp", *GROUP_ESTIMATORS])
def test_every_critic_free_estimator_resumes_bit_identically(tmp_path, name):
    """A run stopped after iteration 1 and resumed ends with the weights of the uninterrupted run (GAE's resume is
    tested in test_ppo_trainer.py)."""
    settings = dict(advantage_estimator=name, num_samples_per_prompt=2, save_strategy="steps", save_steps=1)
    whole = make_trainer(tmp_path / "whole", **settings)
    whole.train()
    stopped = make_trainer(tmp_path / "cut", callbacks=[StopAt(1)], **settings)
    stopped.train()
    resumed = make_trainer(tmp_path / "cut", **settings)
    resumed.train(resume_from_checkpoint=True)
    resumed_weights = resumed.model.policy.state_dict()
    for name, weight in whole.model.policy.state_dict().items():
        assert torch.equal(weight, resumed_weights[name]), name
