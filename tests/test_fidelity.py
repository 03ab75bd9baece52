"""Settings that make a run faithful to the paper or to the MOSS-RLHF release (docs/fidelity.md): each one changes
what it should."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from helpers import make_trainer
from user_setups import build_llama_style_tokenizer

from trl_ppomax import PPOMaxConfig
from trl_ppomax.base import core, metrics
from trl_ppomax.data import prepare_text_dataset
from trl_ppomax.models import response_logits, sequence_inputs
from trl_ppomax.moss import setup_tokenizer


def first_rollout(trainer):
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(trainer.args.local_batch_size)])
    torch.manual_seed(0)
    return trainer.rollout(batch["input_ids"], batch["attention_mask"])


@pytest.mark.parametrize(
    ("preset", "logprob_temperature", "expected"), [("vanilla", None, 0.7), ("ppo_max", None, 1.0)]
)
def test_logprob_temperature_defaults(preset, logprob_temperature, expected):
    config = PPOMaxConfig(output_dir="unused", preset=preset, report_to="none")
    assert config.logprob_temperature == (None if preset == "vanilla" else 1.0)
    assert config.effective_logprob_temperature == expected


# Fig. 5 (p. 12) of the paper: the tricks PPO-max uses (starred) and those it does not, as resolved config values.
FIG_5_STARRED = {
    "1 token-level KL penalty": lambda c: c.kl_coef > 0 and c.kl_estimator == "k1",
    "5 reward normalisation and clipping": lambda c: c.reward_norm == "running" and c.reward_clip is not None,
    "7 value-function loss clipping": lambda c: c.cliprange_value == 0.2,
    "8 critic initialisation and pre-training": lambda c: c.critic_warmup_steps > 0,  # value_model=None: from the RM
    "10 GAE (λ 0.9, App. C.3)": lambda c: c.gamma == 1.0 and c.lam == 0.9,
    "11 clipped surrogate": lambda c: c.cliprange == 0.2 and c.importance_sampling == "old_policy",
    "12 global gradient clipping": lambda c: c.max_grad_norm > 0,
}
FIG_5_UNSTARRED = {
    "6 advantage normalisation and clipping": lambda c: not c.whiten_advantages and c.advantage_clip is None,
    "entropy bonus (App. B.3)": lambda c: c.entropy_coef == 0,
}


@pytest.mark.parametrize("trick", [*FIG_5_STARRED, *FIG_5_UNSTARRED])
def test_default_preset_is_figure_5(trick):
    config = PPOMaxConfig(output_dir="unused", report_to="none")
    assert config.preset == "ppo_max"
    assert {**FIG_5_STARRED, **FIG_5_UNSTARRED}[trick](config)


def test_vanilla_preset_keeps_trl_112_whitening_and_lambda():
    config = PPOMaxConfig(output_dir="unused", preset="vanilla", report_to="none")
    assert config.whiten_advantages and config.lam == 0.95
    assert PPOMaxConfig(output_dir="unused", whiten_advantages=True, lam=0.95, report_to="none").whiten_advantages


@pytest.mark.parametrize("preset", ["ppo_max", "vanilla"])
def test_advantages_are_whitened_only_under_vanilla(tmp_path, preset):
    trainer = make_trainer(tmp_path, preset=preset)
    experience, _, _ = trainer.make_experience(first_rollout(trainer))
    mask = experience.rollout.response_mask.bool()
    if preset == "ppo_max":
        torch.testing.assert_close(experience.advantages, experience.raw_advantages)
    else:
        whitened = experience.advantages[mask]
        assert abs(whitened.mean().item()) < 1e-4 and abs(whitened.std().item() - 1) < 0.05
        assert not torch.allclose(experience.advantages, experience.raw_advantages)


@pytest.mark.parametrize("logprob_temperature", [None, 1.0])
def test_rollout_logprobs_use_the_logprob_temperature(tmp_path, logprob_temperature):
    trainer = make_trainer(tmp_path, temperature=0.5, logprob_temperature=logprob_temperature)
    rollout = first_rollout(trainer)
    inputs = sequence_inputs(rollout.query_ids, rollout.query_mask, rollout.response_ids, rollout.response_mask)
    width = rollout.response_ids.shape[1]
    with torch.no_grad():
        logits = response_logits(trainer.model.policy, inputs, width)
    temperature = 0.5 if logprob_temperature is None else 1.0
    expected = core.logprobs_from_logits(logits, rollout.response_ids, temperature) * rollout.response_mask
    torch.testing.assert_close(rollout.logprobs, expected)
    experience, _, _ = trainer.make_experience(rollout)
    _, stats = trainer.micro_batch_loss(experience, torch.arange(4), critic_only=False)
    torch.testing.assert_close(stats[metrics.RATIO], torch.tensor(1.0), atol=1e-5, rtol=0)  # same temperature


def test_advantages_whitened_per_minibatch(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, whiten_advantages=True, advantage_whitening_scope="minibatch", num_mini_batches=2)
    experience, _, _ = trainer.make_experience(first_rollout(trainer))
    torch.testing.assert_close(experience.advantages, experience.raw_advantages)  # nothing normalised yet
    seen = []
    original = trainer.updater.micro_batch_loss

    def record(step_experience, index, *args):
        seen.append((step_experience.advantages, index))
        return original(step_experience, index, *args)

    monkeypatch.setattr(trainer.updater, "micro_batch_loss", record)
    trainer.ppo_update(experience)
    for start in range(0, len(seen), trainer.args.gradient_accumulation_steps):  # the micro-batches of a minibatch
        advantages = seen[start][0]
        rows = torch.cat([index for _, index in seen[start : start + trainer.args.gradient_accumulation_steps]])
        mask = experience.rollout.response_mask[rows]
        assert core.masked_mean(advantages[rows], mask).abs() < 1e-5
        assert core.masked_var(advantages[rows], mask).item() == pytest.approx(1.0, abs=1e-3)


def test_critic_adam_epsilon_and_joint_gradient_clipping(tmp_path):
    trainer = make_trainer(
        tmp_path, adam_epsilon=1e-6, critic_adam_epsilon=1e-8, grad_clip_scope="joint", max_grad_norm=1e-3
    )
    eps = {group["model"]: group["eps"] for group in trainer.optimizer.param_groups}
    assert eps == {"policy": 1e-6, "critic": 1e-8}
    trainer.train()
    logged = trainer.state.log_history[0]
    assert metrics.GRAD_NORM in logged and metrics.POLICY_GRAD_NORM not in logged


def test_trl112_names_of_the_models(tmp_path):
    trainer = make_trainer(tmp_path)
    assert trainer.model.value_model is trainer.model.critic
    assert trainer.model.policy is not None


def test_ptx_on_dialogues_counts_assistant_turns_only():
    tokenizer = setup_tokenizer(build_llama_style_tokenizer("en"), "en")
    dialogue = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "I am fine"},
        {"role": "user", "content": "do"},
        {"role": "assistant", "content": "can"},
    ]
    row = prepare_text_dataset(Dataset.from_dict({"messages": [dialogue]}), tokenizer, None)[0]
    tokens = tokenizer.convert_ids_to_tokens(row["input_ids"])
    counted = [t for t, m in zip(tokens, row["loss_mask"], strict=True) if m]
    # the release's mask: each assistant turn with its tag and its closing eos; BOS and human turns excluded
    assert counted == ["Assistant", ":", "I", "am", "fine", "</s>", "Assistant", ":", "can", "</s>"]
    every = prepare_text_dataset(Dataset.from_dict({"messages": [dialogue]}), tokenizer, None, assistant_only=False)
    assert all(every[0]["loss_mask"])


def test_ptx_on_dialogues_needs_generation_markers(tmp_path):
    tokenizer = build_llama_style_tokenizer("en")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="generation"):
        prepare_text_dataset(Dataset.from_dict({"messages": [[{"role": "user", "content": "Hi"}]]}), tokenizer, None)


def test_ptx_loss_mask_reaches_the_loss(tmp_path, monkeypatch):
    from helpers import TINY

    from trl_ppomax import PPOMaxTrainer
    from trl_ppomax.toyworld.tiny import build_models, prompt_texts

    tokenizer, policy, reward_model = build_models()
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }} {% else %}{% generation %}"
        "{{ m['content'] }} {% endgeneration %}{% endif %}{% endfor %}"
    )
    dialogues = [[{"role": "user", "content": "please tell"}, {"role": "assistant", "content": "thanks sure"}]] * 8
    trainer = PPOMaxTrainer(
        args=PPOMaxConfig(output_dir=str(tmp_path), **{**TINY, "ptx_coef": 0.5}),
        processing_class=tokenizer,
        model=policy,
        ref_model=None,
        reward_model=reward_model,
        train_dataset=Dataset.from_dict({"prompt": prompt_texts(32)}),
        ptx_dataset=Dataset.from_dict({"messages": dialogues}),
    )
    masks = []
    original = core.next_token_loss

    def spy(logprobs, mask):
        masks.append(mask)
        return original(logprobs, mask)

    monkeypatch.setattr(core, "next_token_loss", spy)
    trainer.train()
    assert masks and all(0 < m.sum() < m.numel() for m in masks)  # only the assistant's tokens count
    ptx_losses = [entry[metrics.PTX_LOSS] for entry in trainer.state.log_history if metrics.PTX_LOSS in entry]
    assert ptx_losses and all(torch.isfinite(torch.tensor(ptx_losses)))


def test_evaluation_samples_like_training_when_asked(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, eval_do_sample=True, eval_dataset=Dataset.from_dict({"prompt": ["hi"] * 4}))
    calls = []
    original = trainer.rollouts.rollout

    def spy(query_ids, query_mask, sampling=True, **kwargs):
        calls.append(sampling)
        return original(query_ids, query_mask, sampling=sampling, **kwargs)

    monkeypatch.setattr(trainer.rollouts, "rollout", spy)
    trainer.evaluate()
    assert calls == [True]
