"""The estimators' edges against the peers' definitions (issue 43): Dr. GRPO's constant normaliser
(``seq_mean_token_sum_norm`` = TRL's ``loss_type="dr_grpo"`` = verl's ``seq-mean-token-sum-norm``), no second
whitening of group advantages, γ < 1 with a group estimator refused, the optional clamps (verl's ±20 log-ratio,
OpenRLHF's ±10 KL), the KL names verl users type, k1 as a loss, and a clip-higher that cannot act. Each refusal
comes with the everyday setups that still pass."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import changed, make_trainer, snapshot

from trl_ppomax import PPOMaxConfig
from trl_ppomax.base import core
from trl_ppomax.ppo.config import KL_ESTIMATOR_ALIASES


def config(tmp_path, **settings) -> PPOMaxConfig:
    return PPOMaxConfig(output_dir=str(tmp_path), report_to="none", **settings)


def masked_losses(seed: int = 0, rows: int = 8, length: int = 7):
    """Random token losses (B, T) and a response mask with ragged lengths, one row empty."""
    g = torch.Generator().manual_seed(seed)
    losses = torch.randn(rows, length, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, length + 1, (rows,), generator=g)
    lengths[3] = 0
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(torch.float64)
    return losses, mask


# -- Dr. GRPO's constant normaliser -------------------------------------------------------------------------------------
def trl_dr_grpo_loss(per_token_loss, mask, max_completion_length, accumulation_steps):
    """TRL GRPOTrainer, loss_type='dr_grpo', one micro-batch: Σ m·ℓ / (rows · max_completion_length), divided by the
    gradient accumulation steps (trl 1.16, grpo_trainer.py)."""
    return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length) / accumulation_steps


def verl_seq_mean_token_sum_norm(loss_mat, loss_mask, loss_scale_factor):
    """verl's agg_loss, loss_agg_mode='seq-mean-token-sum-norm': Σ of the per-sequence token sums ÷ a constant."""
    return (loss_mat * loss_mask).sum(-1).sum() / loss_scale_factor


@pytest.mark.parametrize("rows_per_micro_batch", [8, 4, 2])
def test_seq_mean_token_sum_norm_is_trls_dr_grpo_and_verls_norm(rows_per_micro_batch):
    losses, mask = masked_losses()
    length = mask.shape[1] + 3  # response_length, the constant: longer than any response here
    weights = core.row_split_loss_weights(mask, rows_per_micro_batch, "seq_mean_token_sum_norm", length)
    ours = (weights * losses).sum()
    chunks = list(zip(losses.split(rows_per_micro_batch), mask.split(rows_per_micro_batch), strict=True))
    trl = sum(trl_dr_grpo_loss(loss, m, length, len(chunks)) for loss, m in chunks)
    verl = sum(
        verl_seq_mean_token_sum_norm(loss, m, rows_per_micro_batch * length) / len(chunks) for loss, m in chunks
    )
    torch.testing.assert_close(ours, trl, rtol=1e-6, atol=0)  # the weights are float32: rounding, not kernels
    torch.testing.assert_close(ours, verl, rtol=1e-6, atol=0)


def test_the_constant_normaliser_ignores_the_lengths_and_seq_mean_token_sum_does_not():
    """Dr. GRPO's point: a response's weight does not depend on how many tokens the others have. The old
    ``seq_mean_token_sum`` is response_length times it when every row has tokens (so it clips differently under
    max_grad_norm, not just scales)."""
    _, mask = masked_losses()
    mask[3, 0] = 1.0  # every row has a token
    norm = core.row_split_loss_weights(mask, 4, "seq_mean_token_sum_norm", 10)
    summed = core.row_split_loss_weights(mask, 4, "seq_mean_token_sum")
    torch.testing.assert_close(summed, 10 * norm)
    shorter = mask.clone()
    shorter[0, 1:] = 0.0
    kept = shorter.bool()
    torch.testing.assert_close(
        core.row_split_loss_weights(shorter, 4, "seq_mean_token_sum_norm", 10)[kept], norm[kept]
    )


def test_seq_mean_token_sum_norm_needs_the_constant():
    _, mask = masked_losses()
    with pytest.raises(ValueError, match="needs the constant response_length"):
        core.row_split_loss_weights(mask, 4, "seq_mean_token_sum_norm")


def test_a_dr_grpo_run_with_the_constant_normaliser_trains(tmp_path):
    trainer = make_trainer(
        tmp_path, advantage_estimator="dr_grpo", num_samples_per_prompt=2, loss_aggregation="seq_mean_token_sum_norm"
    )
    before = snapshot(trainer.model.policy)
    trainer.train()
    assert changed(before, trainer.model.policy) > 0
    assert math.isfinite(trainer.state.log_history[-1]["loss/policy"])


# -- No second whitening of group advantages -----------------------------------------------------------------------------
GROUP = ("grpo", "rloo", "dr_grpo", "reinforce_pp_baseline")


@pytest.mark.parametrize("name", [*GROUP, "reinforce_pp"])
def test_vanilla_does_not_whiten_final_advantages_again(tmp_path, name, caplog):
    with caplog.at_level("WARNING", logger="trl_ppomax.ppo.config"):
        args = config(tmp_path, preset="vanilla", advantage_estimator=name, num_samples_per_prompt=2)
    assert args.whiten_advantages is False and caplog.text == ""  # the preset's True does not apply, silently


def test_gae_is_still_whitened_under_vanilla(tmp_path):
    assert config(tmp_path, preset="vanilla").whiten_advantages is True
    assert config(tmp_path, whiten_advantages=True).whiten_advantages is True


def test_whiten_advantages_set_with_a_group_estimator_is_said_and_not_applied(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="trl_ppomax.ppo.config"):
        args = config(tmp_path, advantage_estimator="grpo", num_samples_per_prompt=2, whiten_advantages=True)
    assert args.whiten_advantages is False
    assert "whiten_advantages=True: not applied, advantage_estimator='grpo'" in caplog.text


def test_grpo_under_vanilla_trains_on_the_group_advantages_themselves(tmp_path):
    """The experience's advantages are the raw group ones (verl's), not whitened over the batch a second time."""
    trainer = make_trainer(tmp_path, preset="vanilla", advantage_estimator="grpo", num_samples_per_prompt=2)
    prompts = trainer.processing_class(["hello how are you", "tell me a story"], return_tensors="pt", padding=True)
    rollout = trainer.rollout(prompts["input_ids"], prompts["attention_mask"], samples_per_prompt=2)
    experience, _, _ = trainer.make_experience(rollout)
    torch.testing.assert_close(experience.advantages, experience.raw_advantages)


# -- γ < 1 with a group estimator ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", GROUP)
def test_gamma_below_one_with_a_group_estimator_is_refused(tmp_path, name):
    with pytest.raises(ValueError, match=rf"gamma=0.99 with advantage_estimator='{name}'.*Set gamma=1.0"):
        config(tmp_path, advantage_estimator=name, num_samples_per_prompt=2, gamma=0.99)
    assert config(tmp_path, advantage_estimator=name, num_samples_per_prompt=2).gamma == 1.0


@pytest.mark.parametrize("name", ["gae", "reinforce_pp"])
def test_gamma_below_one_is_fine_where_it_discounts(tmp_path, name):
    assert config(tmp_path, advantage_estimator=name, gamma=0.99).gamma == 0.99


# -- The optional clamps -------------------------------------------------------------------------------------------------
def test_bounded_clamps_or_passes_through():
    x = torch.tensor([-30.0, -1.0, 0.5, 25.0])
    assert core.bounded(x, None) is x
    assert core.bounded(x, 20.0).tolist() == [-20.0, -1.0, 0.5, 20.0]


def test_logratio_clamp_bounds_the_ratio_of_one_absurd_token():
    """log ρ = 25 on one token: unbounded the loss is −A·e²⁵ ≈ −7.2e10 (and its gradient as large); clamped at 20
    (verl's) it is e²⁰, with no gradient through that token; the other tokens are untouched."""
    old = torch.zeros(1, 3)
    logprobs = torch.tensor([[25.0, 0.1, -0.1]], requires_grad=True)
    advantages, mask = torch.tensor([[1.0, 1.0, 1.0]]), torch.ones(1, 3)

    def loss_and_grad(**clamp):
        loss, stats = core.clipped_policy_loss(logprobs, old, advantages, mask, None, **clamp)
        (grad,) = torch.autograd.grad(loss, logprobs)
        return loss, grad, stats

    unbounded, grad_unbounded, _ = loss_and_grad()
    bounded, grad, stats = loss_and_grad(logratio_clamp=20.0)
    assert unbounded.item() == pytest.approx(-(math.exp(25) + math.exp(0.1) + math.exp(-0.1)) / 3, rel=1e-5)
    assert bounded.item() == pytest.approx(-(math.exp(20) + math.exp(0.1) + math.exp(-0.1)) / 3, rel=1e-5)
    assert grad[0, 0] == 0 and grad_unbounded[0, 0] != 0
    torch.testing.assert_close(grad[0, 1:], grad_unbounded[0, 1:])
    assert stats["ratio"].item() == pytest.approx((math.exp(25) + math.exp(0.1) + math.exp(-0.1)) / 3, rel=1e-5)


def test_logratio_clamp_changes_nothing_in_a_healthy_batch():
    g = torch.Generator().manual_seed(0)
    logprobs, old = 0.05 * torch.randn(4, 6, generator=g), 0.05 * torch.randn(4, 6, generator=g)
    advantages, mask = torch.randn(4, 6, generator=g), torch.ones(4, 6)
    exact, _ = core.clipped_policy_loss(logprobs, old, advantages, mask, 0.2)
    clamped, _ = core.clipped_policy_loss(logprobs, old, advantages, mask, 0.2, logratio_clamp=20.0)
    assert torch.equal(exact, clamped)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_clamp_bounds_every_estimator_with_finite_gradients(estimator):
    """OpenRLHF's compute_approx_kl(..., kl_estimator) clamps each estimate to ±10; verl's low_var_kl is k3 clamped
    the same way. With r = log π_ref − log π = 100 the unclamped k3 is inf and its gradient nan."""
    logprobs = torch.tensor([[-100.0, -0.5, 0.0]], requires_grad=True)
    ref = torch.tensor([[0.0, -0.4, 0.0]])
    kl = core.kl_penalty(logprobs, ref, estimator, clamp=10.0)
    (grad,) = torch.autograd.grad(kl.sum(), logprobs)
    assert kl[0, 0].abs().item() == 10.0 and torch.isfinite(grad).all()
    exact = core.kl_penalty(logprobs.detach(), ref, estimator)
    torch.testing.assert_close(kl[0, 1:].detach(), exact[0, 1:])  # the small ones unchanged
    assert torch.equal(core.kl_penalty(logprobs.detach(), ref, estimator, clamp=None), exact)


def test_kl_clamp_in_k3_equals_verls_low_var_kl():
    """verl's kl_penalty 'low_var_kl': kl = ref − logp; ratio = exp(kl); kld = ratio − kl − 1; clamp(kld, −10, 10)."""
    g = torch.Generator().manual_seed(1)
    logprobs, ref = 4 * torch.randn(5, 7, generator=g), 4 * torch.randn(5, 7, generator=g)
    kl = ref - logprobs
    verl = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    torch.testing.assert_close(core.kl_penalty(logprobs, ref, "k3", clamp=10.0), verl)


@pytest.mark.parametrize("name", ["logratio_clamp", "kl_clamp"])
@pytest.mark.parametrize("value", [0.0, -1.0])
def test_a_clamp_must_be_positive(tmp_path, name, value):
    with pytest.raises(ValueError, match=name):
        config(tmp_path, **{name: value})


def test_a_run_with_both_clamps_trains(tmp_path):
    trainer = make_trainer(tmp_path, logratio_clamp=20.0, kl_clamp=10.0, kl_estimator="k3")
    before = snapshot(trainer.model.policy)
    trainer.train()
    assert changed(before, trainer.model.policy) > 0
    assert math.isfinite(trainer.state.log_history[-1]["loss/policy"])


def test_the_clamps_are_off_by_default(tmp_path):
    args = config(tmp_path)
    assert args.logratio_clamp is None and args.kl_clamp is None


# -- The KL names verl users type, k1 as a loss -------------------------------------------------------------------------
@pytest.mark.parametrize(("alias", "ours"), [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")])
def test_verls_kl_names_are_told_which_of_ours_they_are(tmp_path, alias, ours):
    with pytest.raises(ValueError, match=rf"kl_estimator='{alias}':.*set kl_estimator='{ours}'"):
        config(tmp_path, kl_estimator=alias)


@pytest.mark.parametrize("alias", ["abs", "k3+", "low_var_kl+"])
def test_verls_kl_estimators_we_do_not_offer_are_named(tmp_path, alias):
    with pytest.raises(ValueError, match="is not offered"):
        config(tmp_path, kl_estimator=alias)
    assert alias in KL_ESTIMATOR_ALIASES


def test_an_unknown_kl_estimator_still_gets_the_allowed_names(tmp_path):
    with pytest.raises(ValueError, match="k1"):
        config(tmp_path, kl_estimator="k4")


def test_k1_as_a_loss_is_warned_about_and_k2_k3_or_k1_in_the_reward_are_not(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="trl_ppomax.ppo.config"):
        config(tmp_path, kl_placement="loss", kl_estimator="k1")
    assert "zero expected gradient" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="trl_ppomax.ppo.config"):
        config(tmp_path, kl_placement="loss", kl_estimator="k3")
        config(tmp_path, kl_placement="loss", kl_estimator="k2")
        config(tmp_path, kl_estimator="k1")
    assert caplog.text == ""


# -- Clip-higher that cannot act ---------------------------------------------------------------------------------------
def test_cliprange_high_without_a_clip_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"cliprange_high=0\.28 with cliprange=None"):
        config(tmp_path, cliprange=None, cliprange_high=0.28)


def test_cliprange_high_below_cliprange_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"cliprange_high=0\.1 is below cliprange=0\.2"):
        config(tmp_path, cliprange_high=0.1)


def test_dapos_clip_higher_and_the_symmetric_clip_pass(tmp_path):
    assert config(tmp_path, cliprange_high=0.28).cliprange_high == 0.28  # DAPO: 0.28 over 0.2
    assert config(tmp_path, cliprange_high=0.2).cliprange_high == 0.2
    assert config(tmp_path, cliprange=None).cliprange is None
