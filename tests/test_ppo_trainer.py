"""PPOMaxTrainer on tiny CPU models: each PPO-max trick shows its effect, bad input gets a clear error."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from datasets import Dataset
from helpers import TINY, changed, make_trainer, snapshot

from trl_ppomax import PPOMaxConfig, PPOMaxTrainer
from trl_ppomax.base import core
from trl_ppomax.cli.plan import plan as run_plan
from trl_ppomax.ppo import checks
from trl_ppomax.toyworld.tiny import build_models, prompt_texts


def first_rollout(trainer):
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(trainer.args.local_batch_size)])
    torch.manual_seed(0)
    return trainer.rollout(batch["input_ids"], batch["attention_mask"])


# ------------------------------------------------------------------------------------------------------------------
# End to end
# ------------------------------------------------------------------------------------------------------------------
def test_train_changes_parameters_and_logs_namespaced_metrics(tmp_path):
    trainer = make_trainer(tmp_path)
    policy_before, critic_before = snapshot(trainer.model.policy), snapshot(trainer.model.critic)
    trainer.train()
    assert changed(policy_before, trainer.model.policy) > 0
    assert changed(critic_before, trainer.model.critic) > 0
    logged = {k for entry in trainer.state.log_history for k in entry}
    for name in [
        "objective/kl",
        "objective/scores",
        "objective/scores_normalized",
        "objective/scores_p05",
        "objective/scores_p95",
        "objective/reward_running_mean",
        "objective/reward_running_std",
        "objective/non_score_reward",
        "policy/perplexity",
        "policy/ref_perplexity",
        "policy/entropy",
        "policy/clipfrac",
        "policy/approxkl",
        "policy/ratio",
        "critic/values",
        "critic/returns",
        "critic/vf_clipfrac",
        "loss/policy",
        "loss/value",
        "response/length",
        "policy/grad_norm",
        "critic/grad_norm",
    ]:
        assert name in logged, name
    assert trainer.state.global_step == trainer.num_total_batches == 2  # 32 episodes / 16 per batch
    assert trainer.state.episode == 32


def test_save_model_writes_a_plain_causal_lm(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = make_trainer(tmp_path, total_episodes=8)
    trainer.train()
    trainer.save_model(str(tmp_path / "policy"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    for (name, p), q in zip(trainer.model.policy.named_parameters(), loaded.parameters(), strict=True):
        assert torch.allclose(p, q), name
    assert AutoTokenizer.from_pretrained(tmp_path / "policy").pad_token == "[PAD]"


def test_model_card_tags_and_cites_the_paper(tmp_path):
    trainer = make_trainer(tmp_path, total_episodes=8)
    trainer.create_model_card(model_name="tiny")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "trl-ppomax" in card and "ppo-max" in card and "2307.04964" in card


def test_peft_policy_uses_adapter_disabled_reference(tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = make_trainer(tmp_path, peft_config=lora)
    assert trainer.ref_model is None
    rollout = first_rollout(trainer)
    # Fresh LoRA (B = 0) makes the policy equal to the reference.
    torch.testing.assert_close(rollout.logprobs, rollout.ref_logprobs)
    lora_before = {n: p.clone() for n, p in trainer.model.policy.named_parameters() if "lora_B" in n}
    trainer.train()
    after = dict(trainer.model.policy.named_parameters())
    assert any(not torch.equal(p, after[n]) for n, p in lora_before.items())


# ------------------------------------------------------------------------------------------------------------------
# Rollout details
# ------------------------------------------------------------------------------------------------------------------
def test_rollout_truncates_at_stop_token_and_masks_after_it(tmp_path):
    trainer = make_trainer(tmp_path)
    rollout = first_rollout(trainer)
    eos, pad = trainer.processing_class.eos_token_id, trainer.processing_class.pad_token_id
    for ids, mask in zip(rollout.response_ids, rollout.response_mask, strict=True):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()
        assert (ids[n:] == pad).all()
        assert eos not in ids[: n - 1].tolist()  # the stop token, if any, is the last real token


def test_reward_callable_scores_decoded_texts_and_missing_eos_penalty(tmp_path):
    seen = {}

    def reward(prompts, completions):
        seen["n"] = len(prompts)
        return [float(len(c)) for c in completions]

    trainer = make_trainer(tmp_path, reward=reward, value_model=build_models()[2], missing_eos_penalty=5.0)
    rollout = first_rollout(trainer)
    assert seen["n"] == len(rollout.scores)
    eos = trainer.processing_class.eos_token_id
    ended = ((rollout.response_ids == eos) & rollout.response_mask).any(1)
    tokenizer = trainer.processing_class
    texts = [
        tokenizer.decode(ids[mask], skip_special_tokens=True)
        for ids, mask in zip(rollout.response_ids, rollout.response_mask, strict=True)
    ]
    expected = torch.tensor([float(len(t)) for t in texts]) - 5.0 * (~ended).float()
    torch.testing.assert_close(rollout.scores, expected)


def test_reward_callable_without_value_model_gets_the_policy_as_critic_and_checked_output(tmp_path):
    trainer = make_trainer(tmp_path, reward=lambda p, c: [0.0] * len(p))
    both = trainer.accelerator.unwrap_model(trainer.model)
    policy, critic = both.policy.state_dict(), both.critic.state_dict()
    shared = [key for key in critic if key in policy]
    assert shared and all(torch.equal(critic[key], policy[key]) for key in shared)  # the policy's backbone
    assert not critic["score.weight"].any()  # a fresh scalar head, V = 0 until the warm-up fits it
    trainer = make_trainer(tmp_path, reward=lambda p, c: [0.0], value_model=build_models()[2])
    with pytest.raises(ValueError, match="one number per completion"):
        first_rollout(trainer)


def test_rollout_logprobs_match_training_forward(tmp_path):
    """Old log-probs from the rollout equal the update's log-probs before any step (ratio 1)."""
    trainer = make_trainer(tmp_path)
    rollout = first_rollout(trainer)
    experience, _, _ = trainer.make_experience(rollout)
    index = torch.arange(4)
    _, stats = trainer.micro_batch_loss(experience, index, critic_only=False)
    torch.testing.assert_close(stats["policy/ratio"], torch.tensor(1.0), atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------------------------
# One test per trick: it changes what it should
# ------------------------------------------------------------------------------------------------------------------
def constant_reward(value):
    return lambda prompts, completions: [value + i for i in range(len(prompts))]


@pytest.mark.parametrize("mode", ["running", "scale", "none"])
def test_reward_normalisation_modes(tmp_path, mode):
    trainer = make_trainer(
        tmp_path, reward=constant_reward(100.0), value_model=build_models()[2], reward_norm=mode, reward_clip=None
    )
    rollout = first_rollout(trainer)
    _, metrics, _ = trainer.make_experience(rollout)
    raw = rollout.scores
    expected = {"running": (raw - raw.mean()) / raw.std(), "scale": raw / raw.std(), "none": raw}[mode]
    assert metrics["objective/scores_normalized"] == pytest.approx(expected.mean().item(), abs=1e-4)
    assert trainer.ppo_state.running_reward.mean == pytest.approx(raw.mean().item())


def test_reward_clip_bounds_normalised_scores(tmp_path):
    trainer = make_trainer(
        tmp_path,
        reward=constant_reward(100.0),
        value_model=build_models()[2],
        reward_norm="none",
        reward_clip=2.0,
        kl_coef=0.0,
    )
    rollout = first_rollout(trainer)
    experience = trainer.make_experience(rollout)[0]
    assert rollout.scores.min() >= 100.0
    last = core.last_token_index(rollout.response_mask)
    # With no KL term, the GAE return at the last real token is the reward there (no bootstrap): the clipped score.
    rows = torch.arange(len(last))
    torch.testing.assert_close(experience.returns[rows, last], torch.full((len(last),), 2.0))


def test_kl_penalty_enters_the_reward(tmp_path):
    off = make_trainer(tmp_path, kl_coef=0.0)
    rollout = first_rollout(off)
    assert off.make_experience(rollout)[1]["objective/non_score_reward"] == 0.0
    on = make_trainer(tmp_path, kl_coef=0.5)
    # Make the policy differ from the reference so the KL is non-zero.
    with torch.no_grad():
        for p in on.model.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rollout = first_rollout(on)
    metrics = on.make_experience(rollout)[1]
    assert metrics["objective/kl"] != 0
    assert metrics["objective/non_score_reward"] == pytest.approx(-0.5 * metrics["objective/kl"], rel=1e-4)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_advantages_whitened_and_clipped(tmp_path, clip):
    trainer = make_trainer(tmp_path, whiten_advantages=True, advantage_clip=clip)
    experience, _, _ = trainer.make_experience(first_rollout(trainer))
    mask = experience.rollout.response_mask
    if clip is None:
        assert core.masked_mean(experience.advantages, mask).abs() < 1e-5
        assert core.masked_var(experience.advantages, mask).item() == pytest.approx(1.0, abs=1e-3)
    else:
        assert experience.advantages.abs().max() <= clip + 1e-6


def test_importance_sampling_against_reference(tmp_path):
    trainer = make_trainer(tmp_path, importance_sampling="reference")
    with torch.no_grad():
        for p in trainer.model.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    experience, _, _ = trainer.make_experience(first_rollout(trainer))
    torch.testing.assert_close(experience.old_logprobs, experience.rollout.ref_logprobs)
    assert not torch.equal(experience.old_logprobs, experience.rollout.logprobs)


def test_critic_warmup_trains_only_the_critic(tmp_path):
    trainer = make_trainer(tmp_path, critic_warmup_steps=4)
    policy_before, critic_before = snapshot(trainer.model.policy), snapshot(trainer.model.critic)
    trainer.train()
    assert changed(policy_before, trainer.model.policy) == 0
    assert changed(critic_before, trainer.model.critic) > 0


def test_separate_critic_learning_rate(tmp_path):
    trainer = make_trainer(tmp_path, total_episodes=8, critic_learning_rate=0.0)
    policy_before, critic_before = snapshot(trainer.model.policy), snapshot(trainer.model.critic)
    trainer.train()
    assert changed(policy_before, trainer.model.policy) > 0
    assert changed(critic_before, trainer.model.critic) == 0
    assert [g["lr"] for g in trainer.optimizer.param_groups][-1] == 0.0


def _distance(before, module):
    """Global L2 norm of the parameter change."""
    return sum(((before[n] - p) ** 2).sum().item() for n, p in module.named_parameters()) ** 0.5


def test_global_gradient_clipping_limits_the_step(tmp_path):
    distances = {}
    for max_norm in (0.0, 1e-4):
        trainer = make_trainer(tmp_path, total_episodes=8, max_grad_norm=max_norm, optim="sgd", learning_rate=1.0)
        before = snapshot(trainer.model.policy)
        trainer.train()
        distances[max_norm] = _distance(before, trainer.model.policy)
        logged = trainer.state.log_history[-1]["policy/grad_norm"]
        assert logged > 1e-4  # the norm is reported before clipping
    # SGD moves by lr · clipped gradient: at most 1e-4 per step (2 steps) with clipping.
    assert distances[1e-4] <= 2 * 1e-4 * 1.01
    assert distances[0.0] > 10 * distances[1e-4]


def test_ptx_loss_lowers_lm_loss_on_pretraining_text(tmp_path):
    text = "hello how are you today the cat is very nice"
    ptx = Dataset.from_dict({"text": [text] * 16})
    ptx_losses = {}
    for coef in (0.0, 1.0):
        trainer = make_trainer(tmp_path, ptx_coef=coef, ptx_dataset=ptx, total_episodes=32, cliprange=None)
        trainer.train()
        ids = torch.tensor([trainer.processing_class(text)["input_ids"]])
        with torch.no_grad():
            logits = trainer.model.policy(input_ids=ids).logits
        ptx_losses[coef] = core.lm_loss(logits, ids, torch.ones_like(ids))[0].item()
        if coef:
            assert "loss/ptx" in trainer.state.log_history[-1]
    assert ptx_losses[1.0] < ptx_losses[0.0]


def test_entropy_bonus_raises_entropy(tmp_path):
    entropies = {}
    for coef in (0.0, 1.0):
        trainer = make_trainer(tmp_path, entropy_coef=coef, total_episodes=32, learning_rate=3e-3, kl_coef=0.0)
        experience, _, _ = trainer.make_experience(first_rollout(trainer))
        trainer.train()
        _, stats = trainer.micro_batch_loss(experience, torch.arange(4), critic_only=False)
        entropies[coef] = stats["policy/entropy"].item()
    assert entropies[1.0] > entropies[0.0]


def test_clipping_disabled_reports_no_clipping(tmp_path):
    trainer = make_trainer(tmp_path, cliprange=None, cliprange_value=None, num_ppo_epochs=2, total_episodes=8)
    trainer.train()
    last = trainer.state.log_history[-1]
    assert last["policy/clipfrac"] == 0.0 and last["critic/vf_clipfrac"] == 0.0


def test_sampling_settings_reach_generate(tmp_path):
    from transformers import TemperatureLogitsWarper

    from trl_ppomax.generation import GeneratedTokensPenalty, NucleusFilter

    trainer = make_trainer(tmp_path)
    kwargs = trainer.generation.generation_kwargs(prompt_width=7)
    penalty, temperature, top_p = kwargs["logits_processor"]  # the penalty first, on the raw logits, as HF orders it
    assert isinstance(penalty, GeneratedTokensPenalty) and penalty.penalty == 1.1
    assert penalty.prompt_width == 7  # the prompt is exempt (§6.1)
    assert isinstance(temperature, TemperatureLogitsWarper) and temperature.temperature == 0.8
    assert isinstance(top_p, NucleusFilter) and top_p.top_p == 0.9
    assert (kwargs["temperature"], kwargs["top_p"], kwargs["top_k"]) == (1.0, 1.0, 0)  # no second warper from generate
    assert kwargs["eos_token_id"] == trainer.processing_class.eos_token_id
    assert trainer.generation.generation_kwargs(sampling=False)["do_sample"] is False


def test_repetition_penalty_spares_the_prompt(tmp_path):
    """A token of the prompt can still be the first response token under a huge penalty; a generated one cannot
    come back."""
    trainer = make_trainer(tmp_path, repetition_penalty=1e6, temperature=1.0, top_p=1.0)
    policy = trainer.model.policy
    prompt = torch.tensor([[trainer.processing_class.pad_token_id, 5, 6, 7]])
    mask = torch.tensor([[0, 1, 1, 1]])
    with torch.no_grad():
        logits = policy(input_ids=prompt, attention_mask=mask).logits[0, -1]
    favourite = int(logits.argmax())
    with torch.no_grad():  # make the model's next-token choice a token of the prompt, far ahead of the rest
        policy.lm_head.weight[6] = policy.lm_head.weight[favourite] * 50
    kwargs = trainer.generation.generation_kwargs(prompt_width=prompt.shape[1])
    kwargs.update(max_new_tokens=3, eos_token_id=None)
    torch.manual_seed(0)
    responses = policy.generate(input_ids=prompt, attention_mask=mask, **kwargs)[0, prompt.shape[1] :]
    assert responses[0].item() == 6  # the prompt's token, not penalised
    assert 6 not in responses[1:].tolist()  # once generated, it is


# ------------------------------------------------------------------------------------------------------------------
# Presets
# ------------------------------------------------------------------------------------------------------------------
def test_presets_and_explicit_override(tmp_path):
    ppo_max = PPOMaxConfig(output_dir=str(tmp_path))
    vanilla = PPOMaxConfig(output_dir=str(tmp_path), preset="vanilla")
    assert (ppo_max.reward_norm, ppo_max.reward_clip, ppo_max.max_grad_norm) == ("running", 10.0, 1.0)
    assert (vanilla.reward_norm, vanilla.reward_clip, vanilla.max_grad_norm) == ("none", None, 0.0)
    assert (vanilla.temperature, vanilla.top_p, vanilla.critic_warmup_steps) == (0.7, 1.0, 0)
    assert PPOMaxConfig(output_dir=str(tmp_path), preset="vanilla", reward_norm="scale").reward_norm == "scale"
    with pytest.raises(ValueError, match="Unknown preset"):
        PPOMaxConfig(output_dir=str(tmp_path), preset="max")


def test_vanilla_preset_leaves_scores_raw(tmp_path):
    trainer = make_trainer(tmp_path, reward=constant_reward(50.0), value_model=build_models()[2], preset="vanilla")
    rollout = first_rollout(trainer)
    metrics = trainer.make_experience(rollout)[1]
    assert metrics["objective/scores_normalized"] == pytest.approx(rollout.scores.mean().item())


def test_trl112_fields_and_defaults():
    """Every trl 1.12 PPOConfig field exists with trl's default (preset 'vanilla' for preset-dependent ones)."""
    trl112 = {
        "dataset_num_proc": None,
        "num_mini_batches": 1,
        "total_episodes": None,
        "local_rollout_forward_batch_size": 64,
        "num_sample_generations": 10,
        "response_length": 53,
        "stop_token": None,
        "stop_token_id": None,
        "temperature": 0.7,
        "missing_eos_penalty": None,
        "sft_model_path": "EleutherAI/pythia-160m",
        "reward_model_path": "EleutherAI/pythia-160m",
        "model_adapter_name": None,
        "ref_adapter_name": None,
        "num_ppo_epochs": 4,
        "whiten_rewards": False,
        "kl_coef": 0.05,
        "kl_estimator": "k1",
        "cliprange": 0.2,
        "vf_coef": 0.1,
        "cliprange_value": 0.2,
        "gamma": 1.0,
        "lam": 0.95,
        "ds3_gather_for_generation": True,
        "push_to_hub": False,
        "learning_rate": 3e-6,
    }
    config = PPOMaxConfig(output_dir="unused", preset="vanilla")
    for name, default in trl112.items():
        assert getattr(config, name) == default, name
    for derived in ("world_size", "batch_size", "mini_batch_size", "local_batch_size", "local_mini_batch_size"):
        assert isinstance(getattr(config, derived), int), derived


# ------------------------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------------------------
def test_bad_inputs_get_clear_errors(tmp_path):
    tokenizer, policy, reward_model = build_models()
    args = PPOMaxConfig(output_dir=str(tmp_path), **TINY)
    data = Dataset.from_dict({"prompt": prompt_texts(32)})

    def build(**kwargs):
        base = dict(
            args=args,
            processing_class=tokenizer,
            model=policy,
            ref_model=None,
            reward_model=reward_model,
            train_dataset=data,
            value_model=None,
        )
        return PPOMaxTrainer(**{**base, **kwargs})

    with pytest.raises(ValueError, match="same object"):
        build(ref_model=policy)
    with pytest.raises(ValueError, match="'input_ids' column"):
        build(train_dataset=Dataset.from_dict({"question": ["hi"] * 32}))
    with pytest.raises(ValueError, match="fewer than one rollout batch"):
        build(train_dataset=Dataset.from_dict({"prompt": ["hi"] * 3}))
    with pytest.raises(ValueError, match="ptx_dataset"):
        build(args=PPOMaxConfig(output_dir=str(tmp_path), **{**TINY, "ptx_coef": 0.5}))
    two_labels = build_models()[2]
    two_labels.config.num_labels = 2
    with pytest.raises(ValueError, match="num_labels=1"):
        build(reward_model=two_labels)
    no_pad = build_models()[0]
    no_pad.pad_token = None
    with pytest.raises(ValueError, match="no pad token"):
        build(processing_class=no_pad)
    with pytest.raises(ValueError, match="response_length"):
        PPOMaxConfig(output_dir=str(tmp_path), response_length=0)


def test_value_model_must_not_be_the_reward_model(tmp_path):
    reward_model = build_models()[2]
    with pytest.raises(ValueError, match="same object as reward_model"):
        make_trainer(tmp_path, reward=reward_model, value_model=reward_model)


def test_checkpoints_hold_a_loadable_policy(tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = make_trainer(tmp_path, save_strategy="steps", save_steps=1, save_total_limit=1)
    trainer.train()
    checkpoints = sorted((tmp_path / "out").glob("checkpoint-*"))
    assert [c.name for c in checkpoints] == ["checkpoint-2"]  # save_total_limit keeps the newest
    assert (checkpoints[0] / "optimizer.pt").exists()
    AutoModelForCausalLM.from_pretrained(checkpoints[0])


@pytest.mark.slow  # seconds (the README's command stays under 4 minutes; .ci/run runs it)
def test_counters_are_logged_as_current_values(tmp_path):
    trainer = make_trainer(tmp_path, total_episodes=64, logging_steps=2)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "episode" in entry]
    assert [entry["episode"] for entry in logs] == [32.0, 64.0]


def test_training_with_activation_checkpointing(tmp_path):
    trainer = make_trainer(tmp_path, total_episodes=16, gradient_checkpointing=True)
    assert trainer.model.is_gradient_checkpointing
    before = snapshot(trainer.model.policy)
    trainer.train()
    assert changed(before, trainer.model.policy) > 0
    assert trainer.model.is_gradient_checkpointing  # restored after generation


def test_plan_summarises_the_run(tmp_path):
    plan = run_plan(make_trainer(tmp_path))
    assert "LlamaForCausalLM" in plan and "32 episodes = 2 iterations" in plan
    assert "16 responses per iteration" in plan and "preset=ppo_max" in plan


def test_rollout_metrics_are_logged_for_training_and_evaluation(tmp_path):
    def words(prompts, completions):
        return [float(len(c.split())) for c in completions]

    trainer = make_trainer(tmp_path, total_episodes=16)
    trainer.rollout_metrics = {"custom/words": words}
    trainer.train()
    assert trainer.state.log_history[-1]["custom/words"] > 0
    assert trainer.evaluate(Dataset.from_dict({"prompt": prompt_texts(4)}))["eval_custom/words"] > 0


def test_model_arguments_that_do_not_fit_together_are_refused():
    from peft import LoraConfig, get_peft_model

    _, policy, reward = build_models()
    lora = LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM")
    models = dict(model=policy, ref_model=None, reward_model=reward, value_model=None)
    checks.check_model_arguments(models, lora)  # a plain policy with a LoRA config: fine
    with pytest.raises(ValueError, match="reference is the model with its adapter disabled"):
        checks.check_model_arguments({**models, "ref_model": build_models()[1]}, lora)
    with pytest.raises(ValueError, match="already a PEFT model"):
        checks.check_model_arguments({**models, "model": get_peft_model(build_models()[1], lora)}, lora)


@pytest.mark.parametrize(
    ("precision", "dtype"), [({}, torch.float32), ({"bf16": True, "use_cpu": True}, torch.bfloat16)]
)
def test_generation_and_scoring_forwards_run_in_the_runs_precision(tmp_path, precision, dtype):
    """Under ``bf16`` the rollout's generation, log-prob, value and reward forwards run in the update's autocast (trl
    1.12 generated in fp32 whatever the precision); in fp32 nothing changes."""
    trainer = make_trainer(tmp_path, **precision)
    seen = defaultdict(set)
    models = {"policy": trainer.model.policy, "critic": trainer.model.critic, "reward": trainer.reward_model}
    for name, module in models.items():
        last = [m for m in module.modules() if isinstance(m, torch.nn.Linear)][-1]  # the head: logits, value or score
        last.register_forward_hook(lambda _m, _i, output, name=name: seen[name].add(output.dtype))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    trainer.rollout(batch["input_ids"], batch["attention_mask"])
    assert dict(seen) == {name: {dtype} for name in models}
