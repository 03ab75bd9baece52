"""The update's options beyond PPO-max (``trl_ppomax.ppo.update``), each in a tiny run: the KL as a loss term, clip-higher
and dual-clip, loss aggregation, more critic than policy epochs, and the critic's explained variance. Their maths is
checked by hand and against verl in tests/test_core.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from datasets import Dataset
from helpers import StopAt, make_trainer

from trl_ppomax import PPOMaxConfig, models
from trl_ppomax.base import metrics as M
from trl_ppomax.base.rollout import Generated
from trl_ppomax.ppo.update import micro_batch_loss

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


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_log_probs_in_chunks_give_the_update_the_same_loss_and_gradients(tmp_path, monkeypatch, entropy_coef):
    """One micro-batch of padded responses with a PPO-ptx batch (its own mask), a trained entropy or a logged one:
    the loss, its statistics and every parameter's gradient equal, to 1e-6 in float32, whatever ``logprob_chunk_size``
    (one position, an uneven split, more than the positions, off)."""
    answers = ["thanks sure", "sure", "thanks sure thanks sure thanks"] * 3  # ptx rows of several lengths: padded
    dialogues = [[{"role": "user", "content": "please tell"}, {"role": "assistant", "content": a}] for a in answers]
    trainer = make_trainer(
        tmp_path,
        ptx_dataset=Dataset.from_dict({"messages": dialogues}),
        ptx_coef=0.5,
        ptx_assistant_only=False,
        entropy_coef=entropy_coef,
        kl_placement="loss",
        kl_estimator="k3",
    )
    prompts = trainer.processing_class(["hello how are you", "tell me a story"], return_tensors="pt", padding=True)
    rollout = trainer.rollout(prompts["input_ids"], prompts["attention_mask"])
    mask = rollout.response_mask.clone()
    mask[1, 3:] = 0  # the second response shorter: padding inside the batch
    experience, _, _ = trainer.make_experience(dataclasses.replace(rollout, response_mask=mask))
    ptx = trainer.updater.next_ptx_batch()
    assert ptx["attention_mask"].min() == 0
    monkeypatch.setattr(models, "CHUNK_VOCABULARY", 1)  # logprob_chunk_size in positions at the tiny vocabulary
    parameters = [p for p in trainer.model.parameters() if p.requires_grad]

    def loss_and_grads(chunk_size):
        args = dataclasses.replace(trainer.args, logprob_chunk_size=chunk_size)
        rows = torch.arange(len(experience.rollout.response_ids))
        loss, stats = micro_batch_loss(trainer.model, experience, rows, False, args, dict(ptx))
        grads = torch.autograd.grad(loss, parameters, allow_unused=True)
        return loss, stats, grads

    loss, stats, grads = loss_and_grads(None)
    assert M.PTX_LOSS in stats and M.ENTROPY in stats
    for chunk_size in (1, 5, 4096):
        chunked_loss, chunked_stats, chunked_grads = loss_and_grads(chunk_size)
        torch.testing.assert_close(chunked_loss, loss, atol=1e-6, rtol=1e-6)
        for name, value in stats.items():
            torch.testing.assert_close(chunked_stats[name], value, atol=1e-6, rtol=1e-6, equal_nan=True)
        for got, want in zip(chunked_grads, grads, strict=True):
            if want is not None:
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


#: TRL GRPO's on-policy shape: one optimizer step per rollout batch, the KL as a loss.
ON_POLICY = dict(
    advantage_estimator="grpo",
    num_samples_per_prompt=2,
    num_mini_batches=1,
    num_ppo_epochs=1,
    kl_placement="loss",
    kl_estimator="k3",
    temperature=1.0,
    logprob_temperature=1.0,
)


@pytest.mark.parametrize(
    "change",
    [
        dict(num_ppo_epochs=2),
        dict(num_mini_batches=2),
        dict(kl_placement="reward"),
        dict(importance_sampling="reference"),
        dict(logprob_temperature=0.7),
        dict(max_staleness=1),
    ],
)
def test_the_old_log_probs_come_from_the_update_only_when_it_is_one_step_on_the_policy_that_generated(
    tmp_path, change
):
    def config(**settings):
        return PPOMaxConfig(output_dir=str(tmp_path), **{**ON_POLICY, **settings})

    assert config().old_logprobs_from_update
    assert config(kl_placement="reward", kl_coef=0.0).old_logprobs_from_update  # a KL penalty of 0: nothing to read
    assert not config(**change).old_logprobs_from_update


def test_old_log_probs_from_the_update_train_and_log_as_the_scoring_forwards_do(tmp_path, monkeypatch):
    """The same rollout batch, once with the policy's no-grad forward at scoring and once without (π_old the update's
    own forward, detached): the same parameters after the update, the same logged KL, rewards and perplexity, and
    one no-grad policy forward fewer."""
    trainers = [make_trainer(tmp_path / name, **ON_POLICY) for name in ("scored", "from_update")]
    scored, from_update = trainers
    assert from_update.args.old_logprobs_from_update
    prompts = scored.rollouts.prompt_batch(1)
    rollout = scored.rollout(prompts.query_ids, prompts.query_mask, samples_per_prompt=2)
    written = Generated(rollout.query_ids, rollout.query_mask, rollout.response_ids, rollout.response_mask)
    forwarded, response_features = [], models.response_features
    monkeypatch.setattr(models, "response_features", lambda m, *a: forwarded.append(m) or response_features(m, *a))
    no_policy = from_update.rollouts.score(lambda: written, policy_logprobs=False)
    assert no_policy.logprobs is None and no_policy.policy_perplexity is None
    assert len(forwarded) == 1  # the reference's forward alone
    torch.testing.assert_close(no_policy.ref_logprobs, rollout.ref_logprobs)
    logged = []
    for trainer, batch in ((scored, rollout), (from_update, dataclasses.replace(rollout, logprobs=None))):
        experience, metrics, _ = trainer.make_experience(batch)
        torch.manual_seed(0)  # the same minibatch order
        update_metrics, _ = trainer.updater.run(experience, iteration=1)
        if experience.policy_metrics is not None:
            metrics |= experience.policy_metrics()
        logged.append({**metrics, **update_metrics})
    for name in (*M.FROM_POLICY_LOGPROBS, M.KL_LOSS, M.POLICY_LOSS):
        assert logged[1][name] == pytest.approx(logged[0][name], rel=1e-5, abs=1e-6), name
    assert logged[1][M.RATIO] == 1.0
    for a, b in zip(scored.model.policy.parameters(), from_update.model.policy.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
