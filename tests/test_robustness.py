"""Real runs: exact resume, atomic checkpoints, evaluation and best checkpoint, bad input, non-finite numbers."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from datasets import Dataset
from helpers import StopAt, changed, make_trainer, snapshot
from transformers import AutoModelForCausalLM, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from trl_ppomax import PPOMaxConfig, PPOMaxTrainer
from trl_ppomax.toyworld.tiny import build_models, prompt_texts

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
    assert resumed.ppo_state.counters == straight.ppo_state.counters
    assert resumed.ppo_state.ptx_batches_used == straight.ppo_state.ptx_batches_used > 0
    assert resumed.ppo_state.running_reward.state_dict() == pytest.approx(
        straight.ppo_state.running_reward.state_dict(), rel=1e-6
    )
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
        trainer.checkpointer.save_checkpoint()
    assert not (out / "checkpoint-4").exists()
    assert not (out / ".tmp-checkpoint-4").exists()  # removed on the exception; a hard kill would leave it
    assert get_last_checkpoint(str(out)).endswith("checkpoint-2")


def test_checkpoint_is_never_written_with_non_finite_weights(tmp_path):
    trainer = make_trainer(tmp_path, save_strategy="steps")
    with torch.no_grad():
        next(trainer.model.policy.parameters())[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite weights"):
        trainer.checkpointer.save_checkpoint()
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
    assert trainer.ppo_state.counters["skipped/iterations"] == 1
    assert trainer.ppo_state.running_reward.count == 16  # only the finite batch entered the moments
    assert trainer.state.log_history[-1]["skipped/iterations"] == 1.0
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert any(not torch.equal(policy[n], p) for n, p in trainer.model.policy.named_parameters())
    assert any(not torch.equal(critic[n], p) for n, p in trainer.model.critic.named_parameters())


def poison_losses(trainer, monkeypatch, iterations=None) -> None:
    """Every micro-batch loss NaN (in ``iterations`` only, when given)."""
    original = trainer.updater.micro_batch_loss

    def poisoned(*args):
        loss, stats = original(*args)
        hit = iterations is None or trainer.state.global_step + 1 in iterations
        return (loss * float("nan") if hit else loss), stats

    monkeypatch.setattr(trainer.updater, "micro_batch_loss", poisoned)


def test_nan_loss_never_reaches_the_optimizer(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, total_episodes=48)
    poison_losses(trainer, monkeypatch, iterations={2})
    before = snapshot(trainer.model)
    trainer.train()
    assert trainer.ppo_state.counters["skipped/updates"] == 2  # both minibatches of iteration 2
    assert trainer.ppo_state.counters["skipped/iterations"] == 1  # nothing of iteration 2 was trained
    assert changed(before, trainer.model) > 0  # iterations 1 and 3 were


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


EVAL_PROMPTS = Dataset.from_dict({"prompt": [f"{EVAL_MARK} {p}" for p in prompt_texts(6)]})
TRAIN_PROMPTS = Dataset.from_dict({"prompt": [p.replace(EVAL_MARK, "sun") for p in prompt_texts(32)]})


def scheduled_run(tmp_path, schedule, **overrides):
    """A trainer whose evaluation k (k = 0 before the first update) scores ``schedule[k]``, evaluating and saving
    every iteration."""
    settings = {**dict(eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1), **overrides}
    return make_trainer(
        tmp_path,
        reward=scheduled_reward(schedule, calls_per_evaluation=1),
        value_model=build_models()[2],
        dataset=TRAIN_PROMPTS,
        eval_dataset=EVAL_PROMPTS,
        **settings,
    )


class EvaluatedAt(TrainerCallback):
    """Records the iteration of every evaluation."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_evaluate(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def test_evaluation_metrics_and_best_checkpoint(tmp_path):
    trainer = make_trainer(
        tmp_path,
        reward=scheduled_reward([0.5, 1.0, 5.0, 2.0], calls_per_evaluation=2),
        value_model=build_models()[2],
        dataset=TRAIN_PROMPTS,
        eval_dataset=EVAL_PROMPTS,
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
    assert [e["eval_objective/scores"] for e in evals] == pytest.approx([0.5, 1.0, 5.0, 2.0])
    for name in ("eval_objective/kl", "eval_policy/perplexity", "eval_policy/ref_perplexity", "eval_response/length"):
        assert math.isfinite(evals[-1][name]), name
    assert "eval_objective/scores_normalized" in evals[-1]
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    assert trainer.state.best_metric == pytest.approx(5.0)
    # The policy in memory is the best one, not the last one.
    saved = AutoModelForCausalLM.from_pretrained(trainer.state.best_model_checkpoint)
    for (name, p), q in zip(trainer.model.policy.named_parameters(), saved.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)


def test_the_initial_policy_is_evaluated_first_and_can_be_the_best_model(tmp_path, caplog):
    trainer = scheduled_run(tmp_path, [5.0, 1.0, 2.0], save_total_limit=1, load_best_model_at_end=True)
    initial = snapshot(trainer.model)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    history = trainer.state.log_history
    evals = [i for i, entry in enumerate(history) if "eval_objective/scores" in entry]
    assert [history[i]["step"] for i in evals] == [0, 1, 2]
    assert evals[0] < min(i for i, entry in enumerate(history) if "objective/kl" in entry)  # before any update
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-0")
    assert trainer.state.best_metric == pytest.approx(5.0)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-0", "checkpoint-2"]  # the best is kept
    trained = AutoModelForCausalLM.from_pretrained(out / "checkpoint-2")
    assert changed(snapshot(trainer.model.policy), trained) > 0  # training did move the policy
    assert changed(initial, trainer.model) == 0  # policy and critic are back at their initial weights
    assert "the best model is the initial policy (step 0, before any update)" in caplog.text


def test_evaluation_leaves_the_training_random_stream_unchanged(tmp_path):
    plain = make_trainer(tmp_path / "a", eval_do_sample=True)
    plain.train()
    evaluated = make_trainer(
        tmp_path / "b", eval_do_sample=True, eval_dataset=EVAL_PROMPTS, eval_strategy="steps", eval_steps=1
    )
    evaluated.train()
    assert [e["step"] for e in evaluated.state.log_history if "eval_objective/scores" in e] == [0, 1, 2]
    sampled = make_trainer(tmp_path / "c", eval_do_sample=True, num_sample_generations=2)  # sample tables in training
    sampled.train()
    for other in (evaluated, sampled):
        for (name, a), b in zip(plain.model.named_parameters(), other.model.parameters(), strict=True):
            assert torch.equal(a, b), name


def test_a_resumed_run_does_not_evaluate_step_0_again(tmp_path):
    first = scheduled_run(tmp_path, [1.0, 2.0, 3.0, 4.0], total_episodes=48)
    first.add_callback(StopAt(1))
    first.train()
    resumed = scheduled_run(tmp_path, [2.0, 3.0, 4.0], total_episodes=48)
    evaluated = EvaluatedAt()
    resumed.add_callback(evaluated)
    resumed.train(resume_from_checkpoint=True)
    assert evaluated.steps == [2, 3]
    assert [e["step"] for e in resumed.state.log_history if "eval_objective/scores" in e] == [0, 1, 2, 3]


def test_resuming_from_checkpoint_0_continues_exactly(tmp_path):
    best = dict(save_strategy="best", metric_for_best_model="objective/scores")  # saves the initial policy only
    straight = scheduled_run(tmp_path / "a", [2.0, 1.0, 1.0], **best)
    straight.train()
    checkpoint_0 = tmp_path / "a" / "out" / "checkpoint-0"
    assert sorted(p.name for p in checkpoint_0.parent.glob("checkpoint-*")) == ["checkpoint-0"]
    resumed = scheduled_run(tmp_path / "b", [1.0, 1.0], **best)
    evaluated = EvaluatedAt()
    resumed.add_callback(evaluated)
    resumed.train(resume_from_checkpoint=str(checkpoint_0))
    assert evaluated.steps == [1, 2]
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_evaluate_can_be_called_directly_with_a_raw_dataset(tmp_path):
    trainer = make_trainer(tmp_path)
    metrics = trainer.evaluate(Dataset.from_dict({"prompt": prompt_texts(5)}))
    assert metrics["eval_response/length"] > 0
    assert set(metrics) >= {"eval_objective/scores", "eval_objective/kl", "eval_policy/perplexity"}


# ------------------------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------------------------
def test_long_prompts_are_kept_whole_or_skipped_with_a_count(tmp_path, caplog):
    # Budget 20 tokens; a prompt that cannot be shortened (no turns to drop) is never cut: kept whole while it and a
    # full response fit the policy's 128 positions (128 − response_length 6 = 122 tokens), skipped beyond.
    tokenizer = build_models()[0]
    extra = len(tokenizer("hello")["input_ids"]) - 1  # special tokens around the text

    def hellos(n_tokens):
        return " ".join(["hello"] * (n_tokens - extra))

    prompts = [hellos(122), hellos(123), hellos(200), hellos(50), *prompt_texts(32)]
    with caplog.at_level(logging.WARNING):
        trainer = make_trainer(tmp_path, dataset=Dataset.from_dict({"prompt": prompts}), max_prompt_length=20)
    assert len(trainer.train_dataset) == 34 and trainer.train_dataset["prompt"][:2] == [hellos(122), hellos(50)]
    assert [len(ids) for ids in trainer.train_dataset["input_ids"][:2]] == [122, 50]
    assert "4 of 36 prompts are longer than 20 tokens" in caplog.text
    assert "2 kept whole (at most 122 tokens" in caplog.text and "2 skipped" in caplog.text
    query = torch.tensor(trainer.train_dataset["input_ids"][:1])
    rollout = trainer.rollout(query, torch.ones_like(query))  # the longest kept prompt still gets a full response
    assert query.shape[1] + rollout.response_ids.shape[1] <= 128


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
