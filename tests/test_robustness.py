"""Real runs: exact resume, atomic checkpoints, evaluation and best checkpoint, bad input, non-finite numbers."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from datasets import Dataset
from helpers import StopAt, make_trainer, snapshot
from transformers.trainer_utils import get_last_checkpoint

from trl_ppomax import PPOMaxConfig, PPOMaxTrainer
from trl_ppomax.tiny import build_models, prompt_texts

RESUMABLE = dict(total_episodes=64, ptx_coef=0.5, critic_warmup_steps=1, num_ppo_epochs=2, learning_rate=3e-3)
PTX = Dataset.from_dict({"text": ["hello how are you today", "the cat is very nice and good", "tell me a story"] * 6})


def test_resume_continues_as_if_never_stopped(tmp_path):
    straight = make_trainer(tmp_path / "a", ptx_dataset=PTX, **RESUMABLE)
    straight.train()

    interrupted = make_trainer(tmp_path / "b", ptx_dataset=PTX, save_strategy="steps", save_steps=2, **RESUMABLE)
    interrupted.add_callback(StopAt(2))
    interrupted.train()
    assert interrupted.state.global_step == 2

    resumed = make_trainer(tmp_path / "b", ptx_dataset=PTX, save_strategy="steps", save_steps=2, **RESUMABLE)
    resumed.train(resume_from_checkpoint=True)

    assert resumed.state.global_step == straight.state.global_step == 4
    assert resumed.state.episode == straight.state.episode == 64
    assert resumed.counters == straight.counters
    assert resumed.ptx_batches_used == straight.ptx_batches_used > 0
    assert resumed.running_reward.state_dict() == pytest.approx(straight.running_reward.state_dict(), rel=1e-6)
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    # The resumed run differs from a fresh run: it really continued from iteration 2.
    assert resumed.state.log_history[-1]["episode"] == 64


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    trainer = make_trainer(tmp_path)
    with pytest.raises(ValueError, match="No complete trl-ppomax checkpoint"):
        trainer.train(resume_from_checkpoint=True)


def test_crash_mid_save_leaves_no_valid_looking_checkpoint(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, total_episodes=64, save_strategy="steps", save_steps=2)
    trainer.add_callback(StopAt(2))
    trainer.train()
    trainer.control.should_training_stop = False
    out = tmp_path / "out"

    def crash(folder):
        raise OSError("disk full")

    monkeypatch.setattr(trainer, "_save_optimizer_and_scheduler", crash)
    trainer.state.global_step = 4
    with pytest.raises(OSError, match="disk full"):
        trainer._save_checkpoint(trainer.model, trial=None)
    assert not (out / "checkpoint-4").exists()
    assert not (out / ".tmp-checkpoint-4").exists()  # removed on the exception; a hard kill would leave it
    assert get_last_checkpoint(str(out)).endswith("checkpoint-2")


def test_checkpoint_is_never_written_with_non_finite_weights(tmp_path):
    trainer = make_trainer(tmp_path, save_strategy="steps")
    with torch.no_grad():
        next(trainer.model.policy.parameters())[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite weights"):
        trainer._save_checkpoint(trainer.model, trial=None)
    assert not list((tmp_path / "out").glob("checkpoint-*"))


# ------------------------------------------------------------------------------------------------------------------
# Non-finite numbers during training
# ------------------------------------------------------------------------------------------------------------------
def test_nan_reward_skips_the_iteration(tmp_path):
    calls = []

    def reward(prompts, completions):
        calls.append(1)
        return [math.nan if len(calls) == 1 else 1.0] * len(prompts)

    trainer = make_trainer(tmp_path, reward=reward, value_model=build_models()[2], total_episodes=32)
    policy, critic = snapshot(trainer.model.policy), snapshot(trainer.model.critic)
    trainer.train()
    assert trainer.counters["skipped/iterations"] == 1
    assert trainer.running_reward.count == 16  # only the finite batch entered the moments
    assert trainer.state.log_history[-1]["skipped/iterations"] == 1.0
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert any(not torch.equal(policy[n], p) for n, p in trainer.model.policy.named_parameters())
    assert any(not torch.equal(critic[n], p) for n, p in trainer.model.critic.named_parameters())


def test_nan_loss_never_reaches_the_optimizer(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, total_episodes=16)
    original = trainer.micro_batch_loss

    def poisoned(experience, index, critic_only):
        loss, stats = original(experience, index, critic_only)
        return loss * float("nan"), stats

    monkeypatch.setattr(trainer, "micro_batch_loss", poisoned)
    before = snapshot(trainer.model)
    trainer.train()
    assert trainer.counters["skipped/updates"] == 2  # both minibatches of the only iteration
    for name, p in trainer.model.named_parameters():
        assert torch.equal(before[name], p), name


# ------------------------------------------------------------------------------------------------------------------
# Evaluation and the best checkpoint
# ------------------------------------------------------------------------------------------------------------------
EVAL_MARK = "moon"


def scheduled_reward(schedule, calls_per_evaluation):
    """Training prompts score 0; evaluation prompts (containing EVAL_MARK) score schedule[k] at evaluation k."""
    state = {"calls": 0}

    def reward(prompts, completions):
        if EVAL_MARK in prompts[0]:
            value = schedule[state["calls"] // calls_per_evaluation]
            state["calls"] += 1
            return [value] * len(prompts)
        return [0.0] * len(prompts)

    return reward


def test_evaluation_metrics_and_best_checkpoint(tmp_path):
    eval_prompts = Dataset.from_dict({"prompt": [f"{EVAL_MARK} {p}" for p in prompt_texts(6)]})
    train_prompts = Dataset.from_dict({"prompt": [p.replace(EVAL_MARK, "sun") for p in prompt_texts(32)]})
    trainer = make_trainer(
        tmp_path,
        reward=scheduled_reward([1.0, 5.0, 2.0], calls_per_evaluation=2),
        value_model=build_models()[2],
        dataset=train_prompts,
        eval_dataset=eval_prompts,
        total_episodes=48,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        load_best_model_at_end=True,
        local_rollout_forward_batch_size=4,  # 6 evaluation prompts in two chunks
    )
    trainer.train()
    evals = [entry for entry in trainer.state.log_history if "eval_objective/scores" in entry]
    assert [e["eval_objective/scores"] for e in evals] == pytest.approx([1.0, 5.0, 2.0])
    for name in ("eval_objective/kl", "eval_policy/perplexity", "eval_policy/ref_perplexity", "eval_response/length"):
        assert math.isfinite(evals[-1][name]), name
    assert "eval_objective/scores_normalized" in evals[-1]
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    assert trainer.state.best_metric == pytest.approx(5.0)
    # The policy in memory is the best one, not the last one.
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(trainer.state.best_model_checkpoint)
    for (name, p), q in zip(trainer.model.policy.named_parameters(), saved.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)


def test_evaluate_can_be_called_directly_with_a_raw_dataset(tmp_path):
    trainer = make_trainer(tmp_path)
    metrics = trainer.evaluate(Dataset.from_dict({"prompt": prompt_texts(5)}))
    assert metrics["eval_response/length"] > 0
    assert set(metrics) >= {"eval_objective/scores", "eval_objective/kl", "eval_policy/perplexity"}


# ------------------------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------------------------
def test_long_prompts_are_truncated_with_a_count(tmp_path, caplog):
    long_prompts = [" ".join(["hello"] * 200)] * 3 + prompt_texts(29)
    with caplog.at_level(logging.WARNING):
        trainer = make_trainer(tmp_path, dataset=Dataset.from_dict({"prompt": long_prompts}))
    limit = 128 - 6  # max_position_embeddings − response_length
    assert max(len(ids) for ids in trainer.train_dataset["input_ids"]) == limit
    assert "3 of 32 prompts are longer than 122 tokens" in caplog.text


def test_long_prompts_can_be_an_error(tmp_path):
    long_prompts = [" ".join(["hello"] * 50), *prompt_texts(31)]
    with pytest.raises(ValueError, match="1 of 32 prompts are longer than 20 tokens"):
        make_trainer(
            tmp_path,
            dataset=Dataset.from_dict({"prompt": long_prompts}),
            max_prompt_length=20,
            truncate_long_prompts=False,
        )


def test_more_bad_inputs(tmp_path, caplog):
    with pytest.raises(ValueError, match="empty"):
        make_trainer(tmp_path, dataset=Dataset.from_dict({"prompt": []}))
    with pytest.raises(ValueError, match="per_device_train_batch_size must be"):
        PPOMaxConfig(output_dir=str(tmp_path), per_device_train_batch_size=0)
    trainer = make_trainer(tmp_path, reward=lambda p, c: ["good"] * len(p), value_model=build_models()[2])
    with pytest.raises(ValueError, match="must return numbers"):
        trainer.rollout(*trainer.prompt_batches[0].values())
    tokenizer, policy, reward_model = build_models()
    tokenizer.pad_token = tokenizer.eos_token
    with caplog.at_level(logging.WARNING):
        PPOMaxTrainer(
            args=PPOMaxConfig(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=4),
            processing_class=tokenizer,
            model=policy,
            ref_model=None,
            reward_model=reward_model,
            train_dataset=Dataset.from_dict({"prompt": prompt_texts(8)}),
        )
    assert "pad token is the eos token" in caplog.text
