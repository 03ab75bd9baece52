"""Tiny offline models and tokenizers for the tests: nothing is downloaded."""

from __future__ import annotations

import os

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    GPTNeoXConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

WORDS = [
    "hello",
    "hi",
    "how",
    "are",
    "you",
    "today",
    "the",
    "a",
    "cat",
    "dog",
    "sun",
    "moon",
    "good",
    "bad",
    "great",
    "nice",
    "please",
    "thanks",
    "tell",
    "me",
    "about",
    "write",
    "poem",
    "story",
    "short",
    "long",
    "happy",
    "sad",
    "yes",
    "no",
    "what",
    "why",
    "is",
    "it",
    "very",
    "much",
    "more",
    "less",
    "and",
    "or",
    "but",
    "so",
]
SPECIALS = ["[PAD]", "[UNK]", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate([*SPECIALS, *WORDS, "user:", "assistant:", "system:"])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        unk_token="[UNK]",
        bos_token="<s>",
        eos_token="</s>",
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def model_config(arch: str, vocab_size: int, tokenizer):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    if arch == "llama":
        return LlamaConfig(**common, num_key_value_heads=2)
    if arch == "gpt_neox":
        return GPTNeoXConfig(**common, rotary_pct=0.5)
    raise ValueError(arch)


def build_models(arch: str = "llama", seed: int = 0):
    """(tokenizer, policy, reward_model) with random weights."""
    tokenizer = build_tokenizer()
    config = model_config(arch, len(tokenizer), tokenizer)
    torch.manual_seed(seed)
    policy = AutoModelForCausalLM.from_config(config)
    config.num_labels = 1
    reward = AutoModelForSequenceClassification.from_config(config)
    return tokenizer, policy, reward


def prompt_texts(n: int = 32) -> list[str]:
    g = torch.Generator().manual_seed(1)
    return [
        " ".join(
            WORDS[j]
            for j in torch.randint(len(WORDS), (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        )
        for _ in range(n)
    ]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Saved tiny models per architecture: {arch: {"sft": path, "reward": path}}, plus a prompt dataset folder."""
    root = tmp_path_factory.mktemp("tiny")
    paths = {}
    for arch in ("llama", "gpt_neox"):
        tokenizer, policy, reward = build_models(arch)
        sft, rm = root / arch / "sft", root / arch / "reward"
        policy.save_pretrained(sft)
        tokenizer.save_pretrained(sft)
        reward.save_pretrained(rm)
        tokenizer.save_pretrained(rm)
        paths[arch] = {"sft": str(sft), "reward": str(rm)}
    data = root / "prompts"
    data.mkdir()
    Dataset.from_dict({"prompt": prompt_texts(48)}).to_json(str(data / "train.jsonl"))
    paths["data"] = str(data)
    return paths
