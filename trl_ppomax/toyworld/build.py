"""Building the toy world: the SFT policy (trl's SFTTrainer on mediocre dialogues) and the reward model
(PPOMaxRewardTrainer on gold-labelled preference pairs sampled from it), trained once and cached, keyed by the
:class:`WorldSettings`, the source of :data:`BUILD_MODULES` and the versions of :data:`BUILD_LIBRARIES`, so a code
change or an upgrade builds a new world instead of silently reusing a stale one."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, LlamaForCausalLM, PreTrainedTokenizerFast

from trl_ppomax.data.files import atomic_directory, read_json, write_json
from trl_ppomax.toyworld.tiny import llama_config, word_level_tokenizer
from trl_ppomax.toyworld.world import EOS, WorldSampler, bradley_terry_label, gold_reward, vocabulary

QUIET = dict(report_to="none", disable_tqdm=True, save_strategy="no", logging_steps=50, bf16=False, use_cpu=True)
#: The trainer settings both builds share.
TRAINING = dict(QUIET, per_device_train_batch_size=32, max_length=64, gradient_checkpointing=False)

#: Package modules whose code decides what the cached world holds (the world, its trainers and what they call).
BUILD_MODULES = (
    "trl_ppomax.toyworld.world",
    "trl_ppomax.toyworld.build",
    "trl_ppomax.toyworld.tiny",
    "trl_ppomax.reward_modeling.trainer",
    "trl_ppomax.reward_modeling.config",
    "trl_ppomax.rewards.stats",
    "trl_ppomax.models",
    "trl_ppomax.base.core",
)
#: Libraries whose version changes the trained weights (numerics, trainers, tokenization).
BUILD_LIBRARIES = ("torch", "transformers", "trl", "tokenizers", "datasets", "accelerate")


@cache
def build_fingerprint() -> dict[str, str]:
    """``{module: sha256 of its source file[:16], library: version}`` for :data:`BUILD_MODULES` and
    :data:`BUILD_LIBRARIES`: what, besides the settings, determines the world."""
    sources = {name: Path(importlib.util.find_spec(name).origin).read_bytes() for name in BUILD_MODULES}
    versions = {library: importlib.metadata.version(library) for library in BUILD_LIBRARIES}
    return {**{name: hashlib.sha256(source).hexdigest()[:16] for name, source in sources.items()}, **versions}


@dataclass(frozen=True)
class WorldSettings:
    """Everything that determines the cached SFT policy and reward model."""

    seed: int = 0
    hidden_size: int = 64
    layers: int = 2
    sft_dialogues: int = 3000
    sft_epochs: int = 2
    sft_learning_rate: float = 3e-3
    preference_pairs: int = 3000
    reward_epochs: int = 3
    reward_learning_rate: float = 1e-3
    lm_loss_coef: float = 1.0
    label_scale: float = 5.0  # Bradley–Terry sharpness of the gold labels
    label_length_bias: float = 0.15  # labellers' bias per word towards longer answers (a known human bias)

    def key(self) -> str:
        """The cache folder's name: a hash of these settings and of :func:`build_fingerprint`."""
        identity = {"settings": asdict(self), "build": build_fingerprint()}
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class World:
    """Paths of the trained SFT policy and reward model, and what was measured while building them."""

    sft: str
    reward: str
    report: dict = field(default_factory=dict)


def default_cache_dir() -> Path:
    return Path(os.environ.get("TRL_PPOMAX_CACHE", Path.home() / ".cache" / "trl-ppomax")) / "toyworld"


def _stage(folder: Path, build) -> str:
    """Run ``build(tmp)`` into a temporary folder and rename it to ``folder``, unless ``folder`` is already there."""
    if not (folder / "config.json").is_file():
        with atomic_directory(folder) as temporary:
            build(Path(temporary))
    return str(folder)


def train_sft(settings: WorldSettings, output: Path) -> None:
    """trl's SFTTrainer on mediocre dialogues (loss on the completion only), from a Llama of the settings' size over
    the world's word-level vocabulary (pad ≠ eos, left padding)."""
    from trl import SFTConfig, SFTTrainer

    tokenizer = word_level_tokenizer(vocabulary())
    rows = WorldSampler(seed=settings.seed).sft_rows(settings.sft_dialogues)
    torch.manual_seed(settings.seed)
    config = llama_config(tokenizer, settings.hidden_size, settings.layers, heads=4, max_position_embeddings=64)
    trainer = SFTTrainer(
        model=LlamaForCausalLM(config),
        args=SFTConfig(
            output_dir=str(output / "run"),
            num_train_epochs=settings.sft_epochs,
            learning_rate=settings.sft_learning_rate,
            lr_scheduler_type="cosine",
            seed=settings.seed,
            **TRAINING,
        ),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    trainer.train()
    trainer.save_model(str(output))
    tokenizer.save_pretrained(output)
    shutil.rmtree(output / "run", ignore_errors=True)


@torch.no_grad()
def sample_responses(model, tokenizer, prompts: list[str], max_new_tokens: int = 24, batch: int = 64) -> list[str]:
    """Sampled responses (temperature 1), decoded without special tokens."""
    model.eval()
    out = []
    for start in range(0, len(prompts), batch):
        encoded = tokenizer(
            prompts[start : start + batch], return_tensors="pt", padding=True, add_special_tokens=False
        )
        generated = model.generate(
            **encoded, do_sample=True, max_new_tokens=max_new_tokens, top_k=0, pad_token_id=tokenizer.pad_token_id
        )
        out += tokenizer.batch_decode(generated[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
    return out


def preference_pairs(settings: WorldSettings, sft: str) -> Dataset:
    """Two responses of the SFT policy per prompt, the preferred one drawn by Bradley–Terry on the gold reward plus
    the labellers' length bias: the proxy learns that longer is better, which the gold reward caps."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(sft)
    model = AutoModelForCausalLM.from_pretrained(sft)
    torch.manual_seed(settings.seed + 1)
    prompts = WorldSampler(seed=settings.seed).prompts(settings.preference_pairs, offset=2)
    first, second = sample_responses(model, tokenizer, prompts), sample_responses(model, tokenizer, prompts)
    rng = random.Random(settings.seed + 2)
    rows = []
    for prompt, a, b in zip(prompts, first, second, strict=True):
        if a == b:
            continue
        utility_a, utility_b = (gold_reward(prompt, r) + settings.label_length_bias * len(r.split()) for r in (a, b))
        a_wins = bradley_terry_label(utility_a, utility_b, rng, settings.label_scale)
        chosen, rejected = (a, b) if a_wins else (b, a)
        rows.append({"prompt": prompt, "chosen": f" {chosen} {EOS}", "rejected": f" {rejected} {EOS}"})
    return Dataset.from_list(rows)


def train_reward_model(settings: WorldSettings, sft: str, output: Path) -> dict:
    """PPOMaxRewardTrainer (pairwise + imitation loss) from the SFT policy; returns its held-out accuracy."""
    from trl_ppomax.reward_modeling.config import PPOMaxRewardConfig
    from trl_ppomax.reward_modeling.trainer import PPOMaxRewardTrainer

    pairs = preference_pairs(settings, sft).train_test_split(test_size=0.15, seed=settings.seed)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(sft)
    trainer = PPOMaxRewardTrainer(
        model=sft,  # the imitation loss starts from the causal LM; with lm_loss_coef=0 trl loads a classifier
        args=PPOMaxRewardConfig(
            output_dir=str(output / "run"),
            num_train_epochs=settings.reward_epochs,
            learning_rate=settings.reward_learning_rate,
            lm_loss_coef=settings.lm_loss_coef,
            reward_histogram=False,
            seed=settings.seed,
            **TRAINING,
        ),
        train_dataset=pairs["train"],
        eval_dataset=pairs["test"],
        processing_class=tokenizer,
    )
    trainer.train()
    accuracy = trainer.evaluate()["eval_accuracy"]
    trainer.save_model(str(output))
    shutil.rmtree(output / "run", ignore_errors=True)
    report = {"pairs": len(pairs["train"]) + len(pairs["test"]), "held_out_accuracy": accuracy}
    write_json(output / "toyworld_report.json", report)
    return report


def prepare_world(settings: WorldSettings | None = None, cache_dir: str | os.PathLike | None = None) -> World:
    """The SFT policy and the reward model for ``settings``, trained once and cached."""
    settings = settings or WorldSettings()
    root = Path(cache_dir or default_cache_dir()) / settings.key()
    sft = _stage(root / "sft", lambda tmp: train_sft(settings, tmp))
    reward = _stage(root / "reward", lambda tmp: train_reward_model(settings, sft, tmp))
    return World(sft=sft, reward=reward, report=read_json(Path(reward) / "toyworld_report.json"))
