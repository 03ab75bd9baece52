"""Options beyond the paper (preset ``ppo_max_robust``): each changes what it should on a tiny run, and the paper's
``ppo_max`` preset has none of them."""

from __future__ import annotations

import pytest
import torch
from helpers import make_trainer

from trl_ppomax import PPOMaxConfig
from trl_ppomax.base import core, metrics
from trl_ppomax.base.rollout import Rollout
from trl_ppomax.ppo.config import PRESETS

NEW_OPTIONS = ("reward_norm_freeze", "reward_winsorize", "lam_critic", "lam_alpha")


def first_rollout(trainer) -> Rollout:
    batch = trainer.prompt_batches[0]
    torch.manual_seed(0)
    return trainer.rollout(batch["input_ids"], batch["attention_mask"])


def with_scores(rollout: Rollout, scores: torch.Tensor) -> Rollout:
    return Rollout(**{**vars(rollout), "scores": scores})


def test_ppo_max_has_none_of_the_options_and_ppo_max_robust_adds_them_to_it():
    paper = PPOMaxConfig(output_dir="unused", report_to="none")
    assert not paper.reward_norm_freeze and paper.reward_winsorize is None
    assert paper.lam_critic is None and paper.lam_alpha is None
    differs = {k for k in PRESETS["ppo_max"] if PRESETS["ppo_max"][k] != PRESETS["ppo_max_robust"][k]}
    assert differs <= set(NEW_OPTIONS)  # everything else is the paper's PPO-max
    robust = PPOMaxConfig(output_dir="unused", preset="ppo_max_robust", report_to="none")
    assert robust.reward_norm_freeze and robust.reward_winsorize == 3.0
    assert robust.lam_critic == 1.0 and robust.lam_alpha == 0.05
    assert (
        PPOMaxConfig(output_dir="unused", preset="ppo_max_robust", lam_critic=None, report_to="none").lam_critic
        is None
    )


@pytest.mark.parametrize("freeze", [False, True])
def test_reward_norm_freeze_stops_the_moments_after_the_seeding_iterations(tmp_path, freeze):
    trainer = make_trainer(tmp_path, reward_norm_freeze=freeze, critic_warmup_steps=2, total_episodes=48)
    rollout, moments = first_rollout(trainer), trainer.ppo_state.running_reward
    counts = []
    for iteration in (1, 2, 3, 4):  # iterations 1 and 2 sample the starting policy (critic warm-up)
        trainer.state.global_step = iteration - 1
        trainer.make_experience(rollout)
        counts.append(moments.count)
    batch = len(rollout.scores)
    assert counts[:2] == [batch, 2 * batch]
    assert counts[2:] == ([2 * batch, 2 * batch] if freeze else [3 * batch, 4 * batch])


@pytest.mark.parametrize("winsorize", [None, 3.0])
def test_reward_winsorize_keeps_one_outlier_from_inflating_sigma(tmp_path, winsorize):
    trainer = make_trainer(tmp_path, reward_winsorize=winsorize)
    rollout = first_rollout(trainer)
    clean_std = rollout.scores.std().item()
    scores = rollout.scores.clone()
    scores[0] = scores.median() + 1e4 * (clean_std + 1e-3)  # one wild score among ordinary ones
    _, logged, _ = trainer.make_experience(with_scores(rollout, scores))
    std = trainer.ppo_state.running_reward.std
    if winsorize is None:
        assert std > 100 * clean_std and metrics.SCORES_WINSORIZED not in logged
    else:
        assert std < 3 * clean_std + 1e-3  # the outlier entered at median + 3·1.4826·MAD at most
        assert logged[metrics.SCORES_WINSORIZED] == pytest.approx(1 / len(scores))


@pytest.mark.parametrize("lam_critic", [None, 1.0])
def test_lam_critic_1_regresses_the_critic_on_monte_carlo_returns(tmp_path, lam_critic):
    """With γ = 1, no KL penalty and λ_critic = 1 every real token's target is the sequence's normalised score,
    whatever the critic says; with the policy's λ (0.9) the targets lean on the critic's values."""
    trainer = make_trainer(tmp_path, lam_critic=lam_critic, kl_coef=0.0)
    rollout = first_rollout(trainer)
    experience, _, _ = trainer.make_experience(rollout)
    mask = rollout.response_mask.bool()
    scores, _ = trainer.experience_maker.shape_scores(rollout)
    monte_carlo = scores[:, None].expand_as(mask)[mask]
    if lam_critic == 1.0:
        torch.testing.assert_close(experience.returns[mask], monte_carlo.to(experience.returns.dtype))
    else:
        assert not torch.allclose(experience.returns[mask], monte_carlo.to(experience.returns.dtype))
    policy_only = make_trainer(tmp_path / "plain", kl_coef=0.0)  # the policy's advantages do not change
    torch.testing.assert_close(experience.advantages, policy_only.make_experience(rollout)[0].advantages)


def test_lam_alpha_gives_each_response_its_own_lambda(tmp_path):
    trainer = make_trainer(tmp_path, lam_alpha=0.5)
    rollout = first_rollout(trainer)
    experience, logged, _ = trainer.make_experience(rollout)
    lengths = rollout.response_mask.sum(1).float()
    expected = (1 - 1 / (0.5 * lengths)).clamp(0, 1)
    assert logged[metrics.LAM_POLICY] == pytest.approx(expected.mean().item(), abs=1e-6)
    assert len(set(expected.tolist())) > 1  # responses of different lengths: different λ
    fixed = make_trainer(tmp_path / "fixed", lam=0.9)
    assert not torch.allclose(experience.advantages, fixed.make_experience(rollout)[0].advantages)
    per_row = core.compute_gae(*_token_rewards(trainer, rollout), trainer.args.gamma, expected)[0]
    torch.testing.assert_close(experience.raw_advantages, per_row.to(experience.raw_advantages.dtype))


def _token_rewards(trainer, rollout):
    scores, kl = trainer.experience_maker.shape_scores(rollout)
    rewards, _ = core.token_rewards(scores, kl, rollout.response_mask, trainer.args.kl_coef)
    return rewards, rollout.values, rollout.response_mask
