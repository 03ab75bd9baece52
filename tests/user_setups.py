"""Model folders in the shape users have them, written by the tools users write them with.

Users do not build models in code: they train an SFT policy with ``trl.SFTTrainer``, a reward model with
``trl.RewardTrainer`` (or ``PPOMaxRewardTrainer``), and point a PPO script at the folders those wrote. What is in
such folders differs from ``trl_ppomax.toyworld.tiny``'s in ways that matter to the trainer's checks:

- the tokenizer has **no** ``[PAD]``: like pythia's or llama's, and ``SFTTrainer`` / ``RewardTrainer`` save it with
  ``pad_token = eos_token``; TRL's PPO example then adds ``[PAD]``, one token more than the copy beside the weights;
- the embedding is padded past the tokenizer (pythia: 50304 rows for 50277 tokens, Qwen: 151936 for 151665), so an
  added token fits; ``embedding="exact"`` gives llama's own shape (one row per token), where it does not;
- each folder holds its own copy of the tokenizer beside the weights (``config._name_or_path`` points there).

:func:`write_user_folders` writes, under one root: ``sft/`` (``SFTTrainer.save_model`` after a few steps),
``reward/`` (``RewardTrainer.save_model``, started from ``sft/``), ``ppomax-reward/``
(``PPOMaxRewardTrainer.save_model``) and ``prompts/train.jsonl``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedTokenizerFast,
)

from trl_ppomax.toyworld.tiny import WORDS, model_config, preference_rows, prompt_texts

__all__ = [
    "EMBEDDINGS",
    "LLAMA_STYLE_SPECIALS",
    "build_llama_style_tokenizer",
    "pythia_style_tokenizer",
    "qwen_style_tokenizer",
    "user_tokenizer",
    "write_plain_folders",
    "write_qwen_instruct_folder",
    "write_user_folders",
]

#: Embedding shapes: "padded" past the tokenizer (pythia, Qwen), or "exact", one row per token (llama).
EMBEDDINGS = ("padded", "exact")
#: A few steps of each trainer: enough to write its folder as it writes it, not to learn anything.
STEPS = dict(
    max_steps=2, per_device_train_batch_size=4, report_to="none", save_strategy="no", bf16=False, use_cpu=True
)


def pythia_style_tokenizer() -> PreTrainedTokenizerFast:
    """Shaped like pythia's (GPT-NeoX) tokenizer: one ``<|endoftext|>`` for bos, eos and unknown words at id 0, no pad
    token, no chat template; word-level over :data:`~trl_ppomax.toyworld.tiny.WORDS` and the role words."""
    vocab = {token: i for i, token in enumerate(["<|endoftext|>", *WORDS, "user:", "assistant:", "system:"])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = "<|endoftext|>"
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=special, eos_token=special, unk_token=special)


def qwen_style_tokenizer() -> PreTrainedTokenizerFast:
    """Shaped like Qwen 2.5 Instruct's: byte-level (here every byte a token, no merges), ``<|endoftext|>`` the pad,
    ``<|im_end|>`` the eos, ``<|im_start|>`` special, ``<tool_call>`` / ``</tool_call>`` added tokens, and Qwen 2.5's
    own chat template (tools and tool messages included)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from trl.chat_template_utils import qwen2_5_chat_template

    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(bytes_to_unicode().values())}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.chat_template = qwen2_5_chat_template
    return tokenizer


def write_qwen_instruct_folder(folder: Path) -> Path:
    """``folder`` as a downloaded Qwen 2.5 Instruct checkpoint: a tiny random Qwen2 causal LM, embeddings padded past
    the tokenizer, with :func:`qwen_style_tokenizer` beside the weights."""
    from transformers import Qwen2Config

    tokenizer = qwen_style_tokenizer()
    config = Qwen2Config(
        vocab_size=embedding_rows(tokenizer, "padded"), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def user_tokenizer(arch: str) -> PreTrainedTokenizerFast:
    """The tokenizer a user's ``arch`` model comes with: pythia-style for gpt_neox, llama-style for llama; no pad."""
    return pythia_style_tokenizer() if arch == "gpt_neox" else build_llama_style_tokenizer()


def embedding_rows(tokenizer, embedding: str) -> int:
    """``len(tokenizer)``, or the next multiple of 64 above it (room for added tokens) when ``embedding="padded"``."""
    if embedding not in EMBEDDINGS:
        raise ValueError(f"embedding must be one of {EMBEDDINGS}, got {embedding!r}")
    return len(tokenizer) if embedding == "exact" else 64 * math.ceil((len(tokenizer) + 1) / 64)


def base_model(arch: str, tokenizer, embedding: str, seed: int = 0):
    """A randomly initialised tiny causal LM of ``arch`` for ``tokenizer`` (as a Hub checkpoint would be)."""
    config = model_config(arch, embedding_rows(tokenizer, embedding), tokenizer)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def _texts(n: int = 16) -> list[str]:
    return [
        f"user: {prompt} assistant: {' '.join(WORDS[i % 7 : i % 7 + 4])}" for i, prompt in enumerate(prompt_texts(n))
    ]


def write_sft_folder(folder: Path, arch: str, embedding: str = "padded") -> Path:
    """``folder`` as ``trl.SFTTrainer.save_model`` writes it, after two steps on plain texts."""
    from trl import SFTConfig, SFTTrainer

    tokenizer = user_tokenizer(arch)
    args = SFTConfig(output_dir=str(folder.parent / f".run-{folder.name}"), max_length=32, **STEPS)
    dataset = Dataset.from_dict({"text": _texts()})
    trainer = SFTTrainer(model=base_model(arch, tokenizer, embedding), args=args, train_dataset=dataset,
                         processing_class=tokenizer)  # fmt: skip
    trainer.train()
    trainer.save_model(str(folder))
    return folder


def write_reward_folder(folder: Path, sft: Path, ppomax: bool = False) -> Path:
    """``folder`` as ``trl.RewardTrainer.save_model`` (or ``PPOMaxRewardTrainer.save_model``) writes it, trained for
    two steps from the SFT folder ``sft`` on preference pairs."""
    tokenizer = AutoTokenizer.from_pretrained(sft)
    dataset = Dataset.from_list(preference_rows(16))
    run = str(folder.parent / f".run-{folder.name}")
    if ppomax:
        from trl_ppomax import PPOMaxRewardConfig, PPOMaxRewardTrainer

        # the SFT causal LM itself: the imitation loss (lm_loss_coef 1) needs its LM head
        trainer = PPOMaxRewardTrainer(model=str(sft), args=PPOMaxRewardConfig(output_dir=run, **STEPS),
                                      train_dataset=dataset, processing_class=tokenizer)  # fmt: skip
    else:
        from trl import RewardConfig, RewardTrainer

        model = AutoModelForSequenceClassification.from_pretrained(sft, num_labels=1)
        trainer = RewardTrainer(model=model, args=RewardConfig(output_dir=run, **STEPS), train_dataset=dataset,
                                processing_class=tokenizer)  # fmt: skip
    trainer.train()
    trainer.save_model(str(folder))
    return folder


def write_prompts(folder: Path, n: int = 48) -> Path:
    """``folder/train.jsonl`` with a ``prompt`` column, as ``datasets.load_dataset(folder)`` reads it."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "train.jsonl", "w", encoding="utf-8") as f:
        for prompt in prompt_texts(n):
            f.write(json.dumps({"prompt": prompt}) + "\n")
    return folder


def write_user_folders(root: Path, arch: str, embedding: str = "padded") -> dict[str, str]:
    """The folders a user of ``arch`` has after SFT and reward modelling with TRL: ``{"sft", "reward",
    "ppomax_reward", "prompts"}`` (paths as strings)."""
    root.mkdir(parents=True, exist_ok=True)
    sft = write_sft_folder(root / "sft", arch, embedding)
    paths = {
        "sft": sft,
        "reward": write_reward_folder(root / "reward", sft),
        "ppomax_reward": write_reward_folder(root / "ppomax-reward", sft, ppomax=True),
        "prompts": write_prompts(root / "prompts"),
    }
    return {name: str(path) for name, path in paths.items()}


def write_plain_folders(root: Path, arch: str, embedding: str, pad: str | None = "eos") -> dict[str, str]:
    """``sft/`` and ``reward/`` written by ``save_pretrained`` with the tokenizer beside the weights (no trainer), and
    ``prompts/``; the tokenizer's pad token is eos as the TRL trainers leave it, or none (``pad=None``, as a base
    model's folder from the Hub)."""
    tokenizer = user_tokenizer(arch)
    if pad == "eos":
        tokenizer.pad_token = tokenizer.eos_token
    policy = base_model(arch, tokenizer, embedding)
    policy.config.pad_token_id = tokenizer.pad_token_id
    policy.config.num_labels = 1
    reward = AutoModelForSequenceClassification.from_config(policy.config)
    for name, model in (("sft", policy), ("reward", reward)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return {"sft": str(root / "sft"), "reward": str(root / "reward"), "prompts": str(write_prompts(root / "prompts"))}


#: Special tokens of :func:`build_llama_style_tokenizer`, ids 0-2 as in LLaMA: unknown (also the padding), bos, eos.
LLAMA_STYLE_SPECIALS = ["<unk>", "<s>", "</s>"]
_LLAMA_STYLE_EXTRAS = ["Human", "Assistant", "MOSS", "user", "assistant", "system", "I", "am", "fine", "do", "can"]
# A few common Chinese characters (LLaMA's own vocabulary has a few hundred CJK characters too).
_LLAMA_STYLE_CJK = "你好我是的了吗呢在有不这个人们他她它什么怎样请谢问题回答今天明天猫狗太阳月亮写诗故事很多少"
_LLAMA_STYLE_PUNCT = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~，。？！：；、“”（）"


def build_llama_style_tokenizer(lang: str = "en") -> PreTrainedTokenizerFast:
    """A tiny offline tokenizer shaped like LLaMA's: ``<unk>`` id 0, ``<s>`` id 1, ``</s>`` id 2, bos prepended.

    A case-sensitive WordPiece over about 300 tokens: :data:`WORDS` (lower-case and capitalised), a few extras ("Human",
    "Assistant", "MOSS", ...), every ASCII letter and digit also as a ``##`` continuation piece (so any ASCII word
    encodes without ``<unk>``), ASCII and CJK punctuation, and a few common Chinese characters. Pre-tokenisation splits
    on whitespace, isolates every punctuation mark, digit and CJK character; ``"Human:Hi"`` → ``Human : Hi``.
    ``tokenizer("hi")`` gives ``[1, id("hi")]`` (bos, no eos), like LLaMA. Decoding joins words with spaces, so it does
    not round-trip exactly.

    As in the released tokenizer, nothing is set for padding and no chat template: that is the job of
    :func:`trl_ppomax.moss.prompt.setup_tokenizer` (pad = ``<unk>``, left padding, and for ``lang="zh"`` the
    ``<|Human|>`` / ``<|MOSS|>`` special tokens). The vocabulary is the same for both languages (the Chinese release
    also uses the LLaMA tokenizer); ``lang`` is only checked.
    """
    if lang not in ("en", "zh"):
        raise ValueError(f"Unknown language {lang!r}: use 'en' or 'zh'.")
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    digits = [str(d) for d in range(10)]
    words = [*WORDS, *(w.capitalize() for w in WORDS), *_LLAMA_STYLE_EXTRAS]
    pieces = [*words, *letters, *(f"##{c}" for c in letters + digits), *digits, *_LLAMA_STYLE_PUNCT, *_LLAMA_STYLE_CJK]
    vocab: dict[str, int] = {}
    for token in [*LLAMA_STYLE_SPECIALS, *pieces]:
        vocab.setdefault(token, len(vocab))
    backend = Tokenizer(models.WordPiece(vocab=vocab, unk_token="<unk>", continuing_subword_prefix="##"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Punctuation("isolated"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Split(Regex(r"[\u3400-\u9fff]"), "isolated"),
        ]
    )
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
