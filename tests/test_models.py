"""Where a reward model's score is read: the model's own rule, shared by PPO's scorer and the reward trainer.

transformers' ``*ForSequenceClassification`` reads the rightmost token that is not ``config.pad_token_id``; with
``pad == eos`` (LLaMA-style tokenizers, trl's default) that is the token before a trailing eos. PPO must score where
the reward trainer trained (and where the model reads at inference), and the imitation loss must cover the whole
chosen response.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
from user_setups import build_llama_style_tokenizer

from trl_ppomax import PPOMaxRewardConfig, PPOMaxRewardTrainer, models
from trl_ppomax.models import plain_head, response_logprobs, score_position, sequence_inputs, sequence_scores
from trl_ppomax.toyworld.tiny import (
    ARCHITECTURES,
    build_tokenizer,
    model_config,
    preference_rows,
)


def tokenizer_for(padding: str):
    """The tiny word-level tokenizer (dedicated ``[PAD]``), or the LLaMA-style one with ``pad = eos``."""
    if padding == "dedicated":
        return build_tokenizer()
    tokenizer = build_llama_style_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def reward_model(tokenizer, arch: str = "llama"):
    config = model_config(arch, len(tokenizer), tokenizer)
    config.num_labels = 1
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(config).eval()


def rollout_batch(tokenizer, seed: int = 0):
    """Left-padded queries ⊕ right-padded responses as PPO lays them out: responses ending in eos (then padding),
    one truncated without eos, one empty; tokens after the stop token are the pad token."""
    g = torch.Generator().manual_seed(seed)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    low = max(pad, eos, tokenizer.bos_token_id) + 1
    query_lengths, response_lengths, width_q, width_r = [2, 4, 3, 1], [3, 5, 1, 0], 4, 5
    query_ids = torch.full((4, width_q), pad)
    response_ids = torch.full((4, width_r), pad)
    for i, (lq, lr) in enumerate(zip(query_lengths, response_lengths, strict=True)):
        query_ids[i, width_q - lq :] = torch.randint(low, len(tokenizer), (lq,), generator=g)
        response_ids[i, :lr] = torch.randint(low, len(tokenizer), (lr,), generator=g)
    response_ids[0, 2] = eos  # "w w eos pad pad"
    response_ids[2, 0] = eos  # "eos pad pad pad pad"
    query_mask = (torch.arange(width_q) >= width_q - torch.tensor(query_lengths)[:, None]).long()
    response_mask = (torch.arange(width_r) < torch.tensor(response_lengths)[:, None]).long()
    return query_ids, query_mask, response_ids, response_mask


def test_score_position_rule():
    ids = torch.tensor([[0, 0, 5, 6, 2, 0], [5, 6, 7, 2, 2, 2], [0, 0, 0, 0, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]])
    config = type("Model", (), {"config": type("Config", (), {"pad_token_id": 0})()})()
    assert score_position(config, ids, mask).tolist() == [4, 3, 0]  # dedicated pad: the eos (stop token) itself
    config.config.pad_token_id = 2  # pad == eos: the token before the trailing eos(s)
    assert score_position(config, ids, mask).tolist() == [3, 2, 0]
    config.config.pad_token_id = None  # no pad id: the last attended position
    assert score_position(config, ids, mask).tolist() == [4, 3, 0]
    assert score_position(config, ids).tolist() == [5, 5, 5]


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("padding", ["dedicated", "eos"])
def test_ppo_scorer_reads_where_the_model_reads(padding, arch):
    tokenizer = tokenizer_for(padding)
    model = reward_model(tokenizer, arch)
    query_ids, query_mask, response_ids, response_mask = rollout_batch(tokenizer)
    inputs = sequence_inputs(query_ids, query_mask, response_ids, response_mask)
    with torch.no_grad():
        ours = sequence_scores(model, inputs)
        theirs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits.squeeze(-1)
    torch.testing.assert_close(ours, theirs.float())
    last_real = query_ids.shape[1] + (response_mask.sum(1) - 1)
    read = score_position(model, inputs["input_ids"], inputs["attention_mask"])
    if padding == "dedicated":  # unchanged: the last real response token (the stop token when present)
        assert read[:3].tolist() == last_real[:3].tolist()
    else:  # pad == eos: the token before the eos; a response "eos" alone is read at the query's last token
        assert read.tolist() == [last_real[0] - 1, last_real[1], query_ids.shape[1] - 1, query_ids.shape[1] - 1]


def reward_trainer(tmp_path, tokenizer, rows, lm_loss_coef=1.0, **overrides):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config("llama", len(tokenizer), tokenizer))
    args = dict(
        output_dir=str(tmp_path / "rm"),
        per_device_train_batch_size=8,
        num_train_epochs=4,
        learning_rate=3e-3,
        report_to="none",
        logging_steps=1,
        gradient_checkpointing=False,
        bf16=False,
        save_strategy="no",
        max_length=64,
        reward_histogram=False,
        lm_loss_coef=lm_loss_coef,
        seed=0,
    )
    return PPOMaxRewardTrainer(
        model=model,
        args=PPOMaxRewardConfig(**{**args, **overrides}),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )


def test_pad_is_eos_reward_training_with_imitation_loss(tmp_path):
    tokenizer = tokenizer_for("eos")
    trainer = reward_trainer(tmp_path, tokenizer, preference_rows(32))
    trainer.train()
    assert trainer.heads_checked  # the score and LM heads were checked to read the same last hidden state
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 16 and sum(losses[-4:]) / 4 < 0.9 * sum(losses[:4]) / 4
    # The trained model is read at the token before the trailing eos, as PPO's scorer reads it.
    model = trainer.model.eval()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    read = score_position(model, batch["input_ids"], batch["attention_mask"])
    assert (batch["input_ids"][torch.arange(8), read] != tokenizer.eos_token_id).all()


def test_score_head_check_names_the_cause(tmp_path):
    trainer = reward_trainer(tmp_path, tokenizer_for("eos"), preference_rows(8))
    model = trainer.model
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        outputs = model(**inputs, output_hidden_states=True)
    trainer.check_last_hidden_state_feeds_score(model, outputs.hidden_states[-1], inputs, outputs)
    with pytest.raises(RuntimeError, match=r"score head does not read the body's last hidden state.*lm_loss_coef=0"):
        trainer.check_last_hidden_state_feeds_score(model, outputs.hidden_states[-1] + 1, inputs, outputs)


SHARED = [
    {"prompt": "tell me about the cat", "chosen": " the cat is happy please", "rejected": " the cat is sad"},
    {"prompt": "hi", "chosen": " hello how are you", "rejected": " hello"},
]


@pytest.mark.parametrize("padding", ["dedicated", "eos"])
def test_imitation_mask_starts_after_the_prompt(tmp_path, padding):
    tokenizer = tokenizer_for(padding)
    trainer = reward_trainer(tmp_path, tokenizer, SHARED)
    examples = [trainer.train_dataset[i] for i in range(2)]
    batch = trainer.data_collator(examples)
    for row, example, raw in zip(batch["chosen_response_mask"], examples, SHARED, strict=True):
        prompt_length = len(tokenizer(raw["prompt"])["input_ids"])
        chosen = tokenizer(raw["prompt"] + raw["chosen"] + tokenizer.eos_token)["input_ids"]
        assert example["chosen_ids"] == chosen
        # The shared leading response words ("the cat is", "hello") are response tokens; the eos too.
        assert row.tolist()[: len(chosen)] == [0] * prompt_length + [1] * (len(chosen) - prompt_length)
        assert row[len(chosen) :].sum() == 0


def test_imitation_mask_with_a_conversational_prompt(tmp_path):
    tokenizer = build_tokenizer()
    rows = [
        {
            "prompt": [{"role": "user", "content": "tell me about the cat"}],
            "chosen": [{"role": "assistant", "content": "the cat is happy"}],
            "rejected": [{"role": "assistant", "content": "the cat is sad"}],
        }
    ]
    trainer = reward_trainer(tmp_path, tokenizer, rows)
    example = trainer.train_dataset[0]
    prompt = tokenizer.apply_chat_template(
        rows[0]["prompt"], tokenize=True, return_dict=True, add_generation_prompt=True
    )["input_ids"]
    assert example["chosen_ids"][: len(prompt)] == prompt
    assert example["response_start"] == len(prompt)  # "the cat is" after "assistant:" is response


def test_implicit_prompt_falls_back_to_the_common_prefix(tmp_path):
    tokenizer = build_tokenizer()
    rows = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in SHARED]
    trainer = reward_trainer(tmp_path, tokenizer, rows)
    example = trainer.train_dataset[0]
    shared = len(tokenizer("tell me about the cat the cat is")["input_ids"])
    assert example["response_start"] == shared  # documented: shared leading response words count as prompt


def causal_lm_of_vocab(vocab_size: int):
    from transformers import LlamaConfig

    sizes = dict(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    return AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=vocab_size, **sizes))


def causal_lm(config_class, **extra):
    torch.manual_seed(0)
    sizes = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    return AutoModelForCausalLM.from_config(config_class(**sizes, num_key_value_heads=1, head_dim=8, **extra)).eval()


@pytest.mark.parametrize(
    ("arch", "plain"),
    [("llama", True), ("qwen2", True), ("gemma2", False)],  # Gemma 2 soft-caps its logits
)
def test_response_logprobs_from_the_head_in_chunks_equal_the_models_own_logits(arch, plain, monkeypatch):
    """A causal LM whose logits are ``lm_head(last hidden state)`` goes through its head in chunks; one whose logits
    are more (a soft cap, a scale) keeps its own logits. Either way the log-probs are those of ``model(...).logits``."""
    from transformers import Gemma2Config, LlamaConfig, Qwen2Config

    monkeypatch.setattr(models, "CHUNK_VOCABULARY", 1)  # chunk_size in positions at this tiny vocabulary
    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config, "gemma2": Gemma2Config}[arch]
    model = causal_lm(config_class, **({"final_logit_softcapping": 2.0} if arch == "gemma2" else {}))
    assert (plain_head(model) is not None) == plain
    query_ids, query_mask = torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
    responses, mask = torch.tensor([[10, 11, 12, 13], [14, 15, 0, 0]]), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    inputs = sequence_inputs(query_ids, query_mask, responses, mask)
    with torch.no_grad():
        logits = model(**inputs).logits[:, -5:-1]
        expected = torch.log_softmax(logits / 0.7, -1).gather(-1, responses[..., None]).squeeze(-1)
        got, _ = response_logprobs(model, inputs, responses, temperature=0.7, chunk_size=3)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_use_liger_kernel_patches_every_model_with_the_layer_kernels_only(tmp_path, monkeypatch):
    """TRL's ``use_liger_kernel``: Liger's kernels go into the policy, the reference and the critic (transformers'
    ``apply_liger_kernel``), its fused linear cross-entropy off; without ``liger-kernel`` the trainer says so."""
    from helpers import make_trainer
    from transformers.integrations import liger

    patched = []
    monkeypatch.setattr(liger, "apply_liger_kernel", lambda model, config: patched.append((model, config)))
    trainer = make_trainer(tmp_path, use_liger_kernel=True, liger_kernel_config={"rms_norm": True})
    models_patched = [model for model, _ in patched]
    assert trainer.model.policy in models_patched and trainer.model.critic in models_patched and len(patched) == 3
    assert all(config == {"rms_norm": True, "fused_linear_cross_entropy": False} for _, config in patched)
    monkeypatch.undo()
    if importlib.util.find_spec("liger_kernel") is None:
        with pytest.raises(ImportError, match="liger-kernel"):
            make_trainer(tmp_path / "without", use_liger_kernel=True)


def test_a_chunk_holds_as_many_logits_at_any_vocabulary_under_autograd_and_as_many_positions_without():
    """Under autograd ``logprob_chunk_size`` counts positions at Qwen's vocabulary, a smaller one takes
    proportionally more; without it, positions at any vocabulary."""
    qwen, small = causal_lm_of_vocab(151_936), causal_lm_of_vocab(32_000)
    assert models.chunk_positions(128, qwen) == 128 and models.chunk_positions(128, small) == 128 * 151_936 // 32_000
    assert models.chunk_positions(None, small) is None
    with torch.no_grad():  # nothing recomputed: a chunk more costs a loop step only
        assert models.chunk_positions(128, small) == 128 and models.chunk_positions(None, small) is None
