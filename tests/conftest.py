"""Tiny offline models and tokenizers for the tests: nothing is downloaded.

The builders live in :mod:`trl_ppomax.tiny`; they are re-exported here so test modules and ``tests/scripts`` can
keep doing ``from conftest import build_models, prompt_texts``.
"""

from __future__ import annotations

import os

import pytest
from datasets import Dataset

from trl_ppomax.tiny import (  # noqa: F401  (re-exported for the test modules and tests/scripts)
    CHAT_TEMPLATE,
    SPECIALS,
    WORDS,
    build_models,
    build_tokenizer,
    model_config,
    prompt_texts,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")


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
