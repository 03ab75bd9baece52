"""Tiny offline models, tokenizer and datasets, all built in code (nothing is downloaded), for smoke tests, recipes
and docs that must run without the Hub. The tokenizer is word-level over :data:`SPECIALS`, :data:`WORDS` and the chat
role markers, pads on the left and has a plain ``role: content </s>`` chat template; the models are random 2-layer
Llama or GPT-NeoX networks of hidden size 32::

    tokenizer, policy, reward_model = build_models("llama", seed=0)  # in memory
    paths = save_tiny_models("tiny")  # on disk: {"sft", "reward", "prompts", "preferences"}
    # shell: trl-ppomax tiny tiny/ --arch gpt_neox --seed 1

The folders load with ``AutoTokenizer`` / ``AutoModelForCausalLM`` (``sft/``) and
``AutoModelForSequenceClassification`` (``reward/``); the datasets with ``datasets.load_dataset("json", ...)``.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    GPTNeoXConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from trl_ppomax.data.files import atomic_directory
from trl_ppomax.models import without_zero3_init

__all__ = [
    "ARCHITECTURES",
    "CHAT_TEMPLATE",
    "SPECIALS",
    "WORDS",
    "build_models",
    "build_tokenizer",
    "model_config",
    "preference_rows",
    "prompt_texts",
    "save_tiny_models",
    "write_jsonl",
]

#: The plain words of the tokenizer's vocabulary (after the specials, before the role markers).
WORDS = [
    "hello", "hi", "how", "are", "you", "today", "the", "a", "cat", "dog", "sun", "moon", "good", "bad", "great",
    "nice", "please", "thanks", "tell", "me", "about", "write", "poem", "story", "short", "long", "happy", "sad",
    "yes", "no", "what", "why", "is", "it", "very", "much", "more", "less", "and", "or", "but", "so",
]  # fmt: skip
#: Special tokens, ids 0-3: padding, unknown, beginning and end of sequence.
SPECIALS = ["[PAD]", "[UNK]", "<s>", "</s>"]
#: ``role: content </s>`` per message, then ``assistant:`` when a generation prompt is asked for.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
#: The architectures :func:`build_models` knows.
ARCHITECTURES = ("llama", "gpt_neox")

_ROLES = ["user:", "assistant:", "system:"]
_POLITE = ("please", "thanks")


def word_level_tokenizer(tokens: list[str]) -> PreTrainedTokenizerFast:
    """A whitespace-split, word-level tokenizer over ``tokens`` (which hold ``[PAD] [UNK] <s> </s>``), left padding;
    unknown words map to ``[UNK]``."""
    backend = Tokenizer(models.WordLevel(vocab={token: i for i, token in enumerate(tokens)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        unk_token="[UNK]",
        bos_token="<s>",
        eos_token="</s>",
        padding_side="left",
    )


def build_tokenizer() -> PreTrainedTokenizerFast:
    """:func:`word_level_tokenizer` over ``SPECIALS + WORDS + role markers``, with :data:`CHAT_TEMPLATE`."""
    tokenizer = word_level_tokenizer([*SPECIALS, *WORDS, *_ROLES])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def llama_config(tokenizer, hidden_size: int = 32, layers: int = 2, heads: int = 2, **extra) -> LlamaConfig:
    """A small Llama config for ``tokenizer``: intermediate size 2 × hidden, 128 positions, special ids from the
    tokenizer (``extra`` overrides any field)."""
    fields = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    return LlamaConfig(**{**fields, **extra})


def model_config(arch: str, vocab_size: int, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """The tiny config for ``arch`` ("llama" or "gpt_neox"): hidden 32, 2 layers, 2 heads, intermediate 64."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"Unknown tiny architecture {arch!r}: use one of {', '.join(ARCHITECTURES)}.")
    llama = llama_config(tokenizer, vocab_size=vocab_size)
    if arch == "llama":
        return llama
    shared = (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "max_position_embeddings", "pad_token_id", "eos_token_id", "bos_token_id",
    )  # fmt: skip
    values = llama.to_dict()
    return GPTNeoXConfig(**{k: values[k] for k in shared}, rotary_pct=0.5)


def build_models(
    arch: str = "llama", seed: int = 0
) -> tuple[PreTrainedTokenizerFast, PreTrainedModel, PreTrainedModel]:
    """``(tokenizer, causal_lm, reward_model)`` with random weights (``num_labels=1``), torch's global generator
    seeded with ``seed`` just before, so a seed always gives the same weights."""
    tokenizer = build_tokenizer()
    config = model_config(arch, len(tokenizer), tokenizer)
    torch.manual_seed(seed)
    with without_zero3_init():  # whole models, even under a ZeRO-3 launch: one process writes them
        policy = AutoModelForCausalLM.from_config(config)
        config.num_labels = 1
        reward = AutoModelForSequenceClassification.from_config(config)
    return tokenizer, policy, reward


def prompt_texts(n: int = 32) -> list[str]:
    """``n`` prompts of 2-5 random :data:`WORDS`, always the same for a given ``n`` (own generator, seed 1)."""
    g = torch.Generator().manual_seed(1)
    prompts = []
    for _ in range(n):
        length = int(torch.randint(2, 6, (1,), generator=g))
        prompts.append(" ".join(WORDS[j] for j in torch.randint(len(WORDS), (length,), generator=g).tolist()))
    return prompts


def preference_rows(n: int = 64, seed: int = 0) -> list[dict[str, str]]:
    """``n`` rows of ``{"prompt", "chosen", "rejected"}`` with one learnable rule: ``chosen`` is " please BODY
    thanks", ``rejected`` " BODY" (random :data:`WORDS`, drawn by ``random.Random(seed)``, not torch)."""
    rng = random.Random(seed)
    plain = [w for w in WORDS if w not in _POLITE]
    rows = []
    for prompt in prompt_texts(n):
        body = " ".join(rng.choice(plain) for _ in range(rng.randint(2, 5)))
        rows.append({"prompt": prompt, "chosen": f" please {body} thanks", "rejected": f" {body}"})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    """Write ``rows`` to ``path`` as JSON lines, one object a line (UTF-8)."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def _write_all(root: Path, arch: str, seed: int) -> None:
    tokenizer, policy, reward = build_models(arch, seed)
    for folder, model in (("sft", policy), ("reward", reward)):
        model.save_pretrained(root / folder)
        tokenizer.save_pretrained(root / folder)
    write_jsonl(root / "prompts.jsonl", [{"prompt": p} for p in prompt_texts(48)])
    write_jsonl(root / "preferences.jsonl", preference_rows(64, seed))


def save_tiny_models(
    output_dir: str | os.PathLike, arch: str = "llama", seed: int = 0, overwrite: bool = False
) -> dict[str, str]:
    """Write ``sft/`` (causal LM + tokenizer), ``reward/`` (``num_labels=1`` classifier + tokenizer),
    ``prompts.jsonl`` (48 rows) and ``preferences.jsonl`` (64 rows, :func:`preference_rows`) into ``output_dir``,
    atomically (:func:`~trl_ppomax.data.files.atomic_directory`: a crash never leaves a half-written folder); returns
    their paths, ``{"sft", "reward", "prompts", "preferences"}``. A ``ValueError`` when ``arch`` is unknown, or
    ``output_dir`` is a file or a non-empty folder without ``overwrite``."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"Unknown tiny architecture {arch!r}: use one of {', '.join(ARCHITECTURES)}.")
    out = Path(output_dir).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder: pick another output folder.")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(
            f"{out} exists and is not empty: pick another output folder, empty it, or pass overwrite=True "
            "(--overwrite on the command line) to replace it."
        )
    with atomic_directory(out) as tmp:
        _write_all(Path(tmp), arch, seed)
    names = {"sft": "sft", "reward": "reward", "prompts": "prompts.jsonl", "preferences": "preferences.jsonl"}
    return {key: str(out / name) for key, name in names.items()}
