"""The update's options beyond PPO-max (``trl_ppomax.ppo.update``), each in a tiny run: the KL as a loss term, clip-higher
and dual-clip, loss aggregation, more critic than policy epochs, and the critic's explained variance. Their maths is
checked by hand and against verl in tests/test_core.py."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import StopAt, make_trainer

from trl_ppomax import PPOMaxConfig
from trl_ppomax.base import metrics as M

#: Large steps, so that ratios leave [1 − ε, 1 + ε] within the epochs of one batch.
LOUD = dict(learning_rate=3e-2, num_ppo_epochs=4)


def trained(tmp_path, name, **settings):
    trainer = make_trainer(tmp_path / name, callbacks=[StopAt(1)], **settings)
    trainer.train()
    return trainer


def same_weights(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.slow  # seconds (the README's command stays under 4 minutes; .ci/run runs it)
def test_the_kl_as_a_loss_is_trained_and_logged_under_the_same_names(tmp_path):
    in_loss = make_trainer(tmp_path / "loss", kl_placement="loss", kl_estimator="k2", kl_coef=0.5)
    in_reward = make_trainer(tmp_path / "reward", kl_coef=0.5)
    prompts = in_loss.processing_class(["hello how are you", "tell me a story"], return_tensors="pt", padding=True)
    with torch.no_grad():  # a policy away from its reference: KL_t ≠ 0
        for parameter in in_reward.model.policy.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    rollout = in_reward.rollout(prompts["input_ids"], prompts["attention_mask"])
    kl_free, logged, _ = in_loss.make_experience(rollout)
    penalised, _, _ = in_reward.make_experience(rollout)
    assert not torch.allclose(kl_free.returns, penalised.returns)  # no −η·KL_t in the loss run's rewards
    assert M.KL in logged and M.NON_SCORE_REWARD in logged  # the KL is measured the same way
    in_loss.train()
    last = in_loss.state.log_history[-1]
    assert math.isfinite(last[M.KL_LOSS]) and last[M.KL_LOSS] >= 0 and M.KL in last


@pytest.mark.slow  # seconds (the README's command stays under 4 minutes; .ci/run runs it)
def test_clip_higher_changes_the_update_once_ratios_pass_one_plus_epsilon(tmp_path):
    plain = trained(tmp_path, "plain", **LOUD)
    assert plain.state.log_history[0][M.CLIPFRAC] > 0  # the symmetric clip was active
    higher = trained(tmp_path, "higher", cliprange_high=5.0, **LOUD)
    assert not same_weights(plain.model.policy, higher.model.policy)
    assert same_weights(plain.model.policy, trained(tmp_path, "same", cliprange_high=0.2, **LOUD).model.policy)


@pytest.mark.slow  # seconds (the README's command stays under 4 minutes; .ci/run runs it)
def test_dual_clip_bounds_negative_advantages_and_logs_its_share(tmp_path):
    dual = trained(tmp_path, "dual", dual_clip=1.01, **LOUD)
    logged = dual.state.log_history[0]
    assert logged[M.CLIPFRAC_LOWER] > 0
    assert not same_weights(trained(tmp_path, "plain", **LOUD).model.policy, dual.model.policy)
    assert M.CLIPFRAC_LOWER not in trained(tmp_path, "off").state.log_history[0]


@pytest.mark.parametrize("aggregation", ["seq_mean_token_sum", "seq_mean_token_mean"])
def test_each_loss_aggregation_trains_otherwise_than_the_token_mean(tmp_path, aggregation):
    token = trained(tmp_path, "token", response_length=10)
    other = trained(tmp_path, aggregation, response_length=10, loss_aggregation=aggregation)
    assert not same_weights(token.model.policy, other.model.policy)
    assert math.isfinite(other.state.log_history[0][M.POLICY_LOSS])


def test_extra_critic_epochs_train_the_critic_alone(tmp_path):
    constant = dict(num_ppo_epochs=1, lr_scheduler_type="constant")  # a linear decay would span other step counts
    one = trained(tmp_path, "one", **constant)
    extra = trained(tmp_path, "two", num_critic_epochs=3, **constant)
    assert same_weights(one.model.policy, extra.model.policy)  # the policy's epoch is the same one
    assert not same_weights(one.model.critic, extra.model.critic)
    assert extra.lr_scheduler.last_epoch == 3 * one.lr_scheduler.last_epoch  # every epoch an optimizer step


def test_fewer_critic_than_policy_epochs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="set num_critic_epochs ≥ num_ppo_epochs"):
        PPOMaxConfig(output_dir=str(tmp_path), report_to="none", num_ppo_epochs=4, num_critic_epochs=2)
    PPOMaxConfig(output_dir=str(tmp_path), report_to="none", num_ppo_epochs=4, num_critic_epochs=4)


def test_the_critics_explained_variance_is_logged(tmp_path):
    logged = trained(tmp_path, "gae").state.log_history[0]
    assert math.isfinite(logged[M.EXPLAINED_VARIANCE]) and logged[M.EXPLAINED_VARIANCE] <= 1.0


@pytest.mark.parametrize("name", ["cliprange_high", "dual_clip"])
def test_bad_clip_values_are_refused(tmp_path, name):
    with pytest.raises(ValueError, match=f"{name} must be a finite number"):
        PPOMaxConfig(output_dir=str(tmp_path), report_to="none", **{name: -1.0 if name == "cliprange_high" else 0.5})
