"""Samples per prompt (``num_samples_per_prompt``) and token-budget micro-batches (``max_tokens_per_microbatch``)."""

from __future__ import annotations

import pytest
import torch
from helpers import changed, make_trainer, snapshot

from trl_ppomax import PPOMaxConfig
from trl_ppomax.base import metrics
from trl_ppomax.base.rollout import Rollout, merge_rollouts
from trl_ppomax.generation import generate_responses
from trl_ppomax.ppo.batching import forward_groups, token_budget_batches


def first_rollout(trainer, n: int = 1) -> Rollout:
    batch = trainer.prompt_batches[0]
    torch.manual_seed(0)
    return trainer.rollout(batch["input_ids"], batch["attention_mask"], samples_per_prompt=n)


# ---- the pieces ------------------------------------------------------------------------------------------------------
def test_token_budget_batches_hold_every_row_once_within_the_budget():
    queries = torch.tensor([3, 7, 2, 7, 5, 1, 4, 6])
    responses = torch.tensor([10, 2, 30, 4, 9, 1, 12, 3])
    batches = token_budget_batches(queries, responses, budget=40)
    assert sorted(torch.cat(batches).tolist()) == list(range(8))
    for batch in batches:
        cost = len(batch) * int(queries[batch].max() + responses[batch].max())
        assert cost <= 40 or len(batch) == 1  # row 2 (32 tokens) fits alone; none exceeds 40 here
    totals = [int((queries[b] + responses[b]).max()) for b in batches]
    assert totals == sorted(totals, reverse=True)  # longest first: neighbours in length share a batch
    assert len(token_budget_batches(queries, responses, budget=10_000)) == 1
    assert [len(b) for b in token_budget_batches(queries, responses, budget=1)] == [1] * 8


def test_merge_rollouts_puts_packed_micro_batches_back_in_order(tmp_path):
    rollout = first_rollout(make_trainer(tmp_path))
    groups = [torch.tensor([5, 0, 9]), torch.tensor([1, 2, 3, 4]), torch.tensor([15, 14, 13, 12, 11, 10, 8, 7, 6])]
    parts = [rollout.select(g) for g in groups]
    merged = merge_rollouts(parts, groups, pad_token_id=0)
    for name, value in vars(rollout).items():
        if value is not None:
            assert torch.equal(
                getattr(merged, name)[:, : value.shape[1]] if value.dim() == 2 else getattr(merged, name), value
            ), name


def test_within_prompt_std_is_the_mean_spread_of_each_prompts_samples():
    scores = torch.tensor([1.0, 3.0, 5.0, 5.0, 0.0, 100.0])
    keep = torch.tensor([True, True, True, True, True, False])
    # prompt 0: std of (1, 3) = 1; prompt 1: (5, 5) = 0; prompt 2: one kept sample, left out
    spread, zero_spread = metrics.within_prompt_std(scores, keep, 2, reduce=lambda t: t)
    assert spread == pytest.approx(0.5) and zero_spread == pytest.approx(0.5)  # prompt 1's answers all scored alike


def test_settings_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="num_samples_per_prompt=3 must divide"):
        PPOMaxConfig(output_dir="unused", per_device_train_batch_size=4, num_samples_per_prompt=3)
    with pytest.raises(ValueError, match="num_samples_per_prompt must be a finite number ≥ 1"):
        PPOMaxConfig(output_dir="unused", num_samples_per_prompt=0)
    with pytest.raises(ValueError, match="ptx_coef"):
        PPOMaxConfig(output_dir="unused", max_tokens_per_microbatch=512, ptx_coef=0.5)
    with pytest.raises(ValueError, match="entropy_target"):
        PPOMaxConfig(output_dir="unused", max_tokens_per_microbatch=512, entropy_coef=0.01, entropy_target=1.0)


# ---- samples per prompt ----------------------------------------------------------------------------------------------
def test_samples_per_prompt_sample_each_prompt_n_times_and_count_episodes(tmp_path):
    trainer = make_trainer(tmp_path, num_samples_per_prompt=4, total_episodes=None, num_train_epochs=0.5)
    args = trainer.args
    assert args.local_batch_size == 16 and args.local_prompt_batch_size == 4
    assert args.total_episodes == 64 and args.num_total_batches == 4  # ½ epoch × 32 prompts × 4 samples
    assert len(trainer.prompt_batches[0]["input_ids"]) == 4
    rollout = first_rollout(trainer, n=4)
    assert rollout.response_ids.shape[0] == rollout.scores.shape[0] == 16
    queries = rollout.query_ids.view(4, 4, -1)
    assert torch.equal(queries, queries[:, :1].expand_as(queries))  # rows 4i … 4i+3 answer prompt i
    assert len({tuple(r.tolist()) for r in rollout.response_ids}) > 4  # sampled, not copied
    before = snapshot(trainer.model)
    trainer.train()
    assert changed(before, trainer.model) > 0
    logged = [entry for entry in trainer.state.log_history if metrics.SCORES in entry]
    assert len(logged) == 4 and all(metrics.SCORES_STD_WITHIN_PROMPT in entry for entry in logged)
    assert trainer.state.episode == 64 and trainer.state.epoch == pytest.approx(0.5)


def test_one_sample_per_prompt_is_the_rollout_of_one_generate_call(tmp_path):
    trainer = make_trainer(tmp_path)
    assert metrics.SCORES_STD_WITHIN_PROMPT not in trainer.make_experience(first_rollout(trainer))[1]
    rollout = first_rollout(trainer)
    batch = trainer.prompt_batches[0]
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    torch.manual_seed(0)
    kwargs = trainer.generation.generation_kwargs(True, prompt_width=batch["input_ids"].shape[1])
    responses, mask = generate_responses(policy, batch["input_ids"], batch["attention_mask"], kwargs)
    width = rollout.response_ids.shape[1]
    assert torch.equal(rollout.response_ids, responses[:, :width]) and torch.equal(
        rollout.response_mask, mask[:, :width]
    )


# ---- token-budget micro-batches --------------------------------------------------------------------------------------
def gradients(trainer) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize(
    "settings",
    [
        dict(loss_aggregation="token_mean"),
        dict(loss_aggregation="seq_mean_token_sum", kl_placement="loss"),
        dict(loss_aggregation="seq_mean_token_mean", dual_clip=3.0, cliprange_high=0.28),
    ],
)
def test_token_budget_micro_batches_give_the_row_split_loss_and_gradients(tmp_path, monkeypatch, settings):
    sizes = dict(response_length=12, per_device_train_batch_size=2, gradient_accumulation_steps=4)
    trainer = make_trainer(tmp_path, **sizes, **settings)
    rollout = first_rollout(trainer)
    lengths = rollout.response_mask.sum(1)
    assert lengths.min() < lengths.max()  # varied lengths: packing differs from the row split
    torch.manual_seed(1)
    experience, _, _ = trainer.make_experience(rollout)
    minibatch = torch.randperm(trainer.args.local_batch_size)[: trainer.args.local_mini_batch_size]
    losses, original = [], trainer.updater.micro_batch_loss

    def record(*args):
        loss, stats = original(*args)
        losses.append(loss.detach() / trainer.accelerator.gradient_accumulation_steps)  # what backward() applies
        return loss, stats

    monkeypatch.setattr(trainer.updater, "micro_batch_loss", record)
    trainer.model.zero_grad(set_to_none=True)
    trainer.accumulate_gradients(experience, minibatch, critic_only=False)
    row_split, row_loss, row_count = gradients(trainer), sum(losses), len(losses)
    losses.clear()
    trainer.args.max_tokens_per_microbatch = 70  # about 3 rows a pack, not the row split's 2
    trainer.accumulate_gradients(experience, minibatch, critic_only=False)
    packed, packed_loss = gradients(trainer), sum(losses)
    assert row_count == 4 and len(losses) != row_count
    torch.testing.assert_close(packed_loss, row_loss)
    assert row_split.keys() == packed.keys() and len(row_split) > 0
    for name, grad in row_split.items():
        torch.testing.assert_close(packed[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert trainer.accelerator.gradient_accumulation_steps == trainer.args.gradient_accumulation_steps


def test_token_budget_rollout_forwards_match_the_row_split(tmp_path):
    trainer = make_trainer(tmp_path, response_length=12)
    rows = first_rollout(trainer)
    trainer.args.max_tokens_per_microbatch = 30  # several packs of a few rows, prompts trimmed of padding
    assert len(forward_groups(rows.query_mask, rows.response_mask, trainer.args, trainer.accelerator)[0]) > 2
    packed = first_rollout(trainer)
    assert torch.equal(packed.response_ids, rows.response_ids) and torch.equal(packed.query_ids, rows.query_ids)
    for name in ("logprobs", "ref_logprobs", "values", "scores", "policy_perplexity"):
        torch.testing.assert_close(getattr(packed, name), getattr(rows, name), rtol=1e-4, atol=1e-5, msg=name)


def test_a_token_budget_run_trains(tmp_path):
    trainer = make_trainer(tmp_path, max_tokens_per_microbatch=40, num_samples_per_prompt=2)
    before = snapshot(trainer.model)
    trainer.train()
    assert changed(before, trainer.model) > 0
    assert trainer.ppo_state.counters[metrics.SKIPPED_UPDATES] == 0
    assert all(metrics.POLICY_LOSS in e for e in trainer.state.log_history if metrics.SCORES in e)
