"""Faults and misuse a new user hits (issue 13): every bad setting or input fails early with a clear error that names
the setting (or file) and the fix, before the first rollout; handled faults lose nothing.

Three parts: bad input and settings; folders, checkpoints, resume and secrets; faults during a run.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import logging
import math
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from datasets import Dataset, DatasetDict, IterableDataset
from helpers import TINY, StopAt, changed, make_trainer, snapshot
from safetensors.torch import load_file
from test_core import run_distributed
from transformers import AutoModelForSequenceClassification, TrainerCallback

from trl_ppomax import PPOMaxConfig, PPOMaxRewardTrainer, PPOMaxTrainer, data, rewards
from trl_ppomax.cli import main
from trl_ppomax.data import looks_local, tokenize_prompt
from trl_ppomax.data.files import LOCK_NAME, DiskFullError, OutputDirInUse, file_problem
from trl_ppomax.moss.recovery import TensorFolder, recover
from trl_ppomax.ppo import core
from trl_ppomax.ppo import metrics as M
from trl_ppomax.ppo.checkpoint_files import CheckpointError, required_checkpoint_files
from trl_ppomax.ppo.experience import Rollout, drop_non_finite, kept_gather
from trl_ppomax.ppo.state import PPOState
from trl_ppomax.reporting import hub
from trl_ppomax.rewards import call_reward_function
from trl_ppomax.toyworld.tiny import (
    build_llama_style_tokenizer,
    build_models,
    llama_config,
    prompt_texts,
    save_tiny_models,
)

# ==================================================================================================================
# Bad input and settings: each fails before the first rollout, naming the setting and the fix.
# ==================================================================================================================
CONTEXT = 128  # max_position_embeddings of the tiny models
VOCAB = 49  # len(tokenizer) and the tiny models' embedding size


@pytest.fixture
def rollout_forbidden(monkeypatch):
    """Any rollout fails the test: an error must come before it."""

    def forbidden(self, *args, **kwargs):
        raise AssertionError("the first rollout started: the fault was not caught at construction")

    monkeypatch.setattr(PPOMaxTrainer, "rollout", forbidden)


# ------------------------------------------------------------------------------------------------------------------
# Builders used by the table
# ------------------------------------------------------------------------------------------------------------------
def config(**overrides):
    return lambda tmp_path: PPOMaxConfig(output_dir=str(tmp_path / "out"), **{**TINY, **overrides})


def trainer(**overrides):
    """A trainer on the tiny models with constructor arguments (``tokenizer``, ``model``, …) and config fields
    (everything else) overridden; a :func:`lazy` value is built first, with ``tmp_path`` (fresh models each time)."""
    constructor = {"processing_class", "model", "ref_model", "reward_model", "value_model", "train_dataset"}
    constructor |= {"eval_dataset", "ptx_dataset", "rollout_metrics"}

    def build(tmp_path):
        tokenizer, policy, reward_model = build_models()
        arguments = dict(
            processing_class=tokenizer,
            model=policy,
            ref_model=None,
            reward_model=reward_model,
            train_dataset=Dataset.from_dict({"prompt": prompt_texts(32)}),
        )
        fields = {}
        for name, value in overrides.items():
            value = value(tmp_path) if getattr(value, "lazy", False) else value
            (arguments if name in constructor else fields)[name] = value
        args = PPOMaxConfig(output_dir=str(tmp_path / "out"), **{**TINY, **fields})
        return PPOMaxTrainer(args=args, **arguments)

    return build


def lazy(build):
    """Mark a builder whose result :func:`trainer` passes (rather than the builder itself)."""
    build.lazy = True
    return build


@lazy
def tokenizer_without_eos(_):
    tokenizer = build_models()[0]
    tokenizer.eos_token = None
    return tokenizer


@lazy
def tokenizer_with_unresized_pad(_):
    tokenizer = build_models()[0]
    tokenizer.add_special_tokens({"pad_token": "[NEWPAD]"})  # one more token than the policy's embedding
    return tokenizer


def scorer_with_vocab(size: int):
    def build(_):
        model = build_models()[2]
        model.resize_token_embeddings(size)
        return model

    return lazy(build)


def causal_with_vocab(size: int):
    def build(_):
        model = build_models()[1]
        model.resize_token_embeddings(size)
        return model

    return lazy(build)


def prompts(*special: tuple[int, object], n: int = 32, column: str = "prompt"):
    """``prompt_texts(n)`` (or their conversations / ids) with rows replaced: ``(index, value)``."""

    def build(_):
        tokenizer = build_models()[0]
        rows: list = prompt_texts(n)
        if column == "conversation":
            rows = [[{"role": "user", "content": text}] for text in rows]
        elif column == "input_ids":
            rows = [tokenize_prompt(text, tokenizer) for text in rows]
        for index, value in special:
            rows[index] = value
        return Dataset.from_dict({"input_ids" if column == "input_ids" else "prompt": rows})

    return lazy(build)


@lazy
def prompt_and_disagreeing_ids(_):
    tokenizer = build_models()[0]
    texts = prompt_texts(32)
    ids = [tokenize_prompt(text, tokenizer) for text in texts]
    ids[5] = ids[5][:-1]  # one row's ids lost a token
    return Dataset.from_dict({"prompt": texts, "input_ids": ids})


@lazy
def eval_dict(_):
    return {"val": Dataset.from_dict({"prompt": prompt_texts(4)})}


@lazy
def iterable_prompts(_):
    return IterableDataset.from_generator(lambda: iter({"prompt": text} for text in prompt_texts(8)))


@lazy
def dataset_dict(_):
    return DatasetDict({"train": Dataset.from_dict({"prompt": prompt_texts(32)})})


def foreign_scorer(tmp_path, saved: bool):
    """A reward model built for a larger LLaMA-style tokenizer: loaded from a folder holding that tokenizer, or in
    memory with no tokenizer beside it."""
    other = build_llama_style_tokenizer()
    model = AutoModelForSequenceClassification.from_config(llama_config(other, num_labels=1, pad_token_id=0))
    assert model.get_input_embeddings().num_embeddings > VOCAB
    if not saved:
        return model
    model.save_pretrained(tmp_path / "foreign-rm")
    other.save_pretrained(tmp_path / "foreign-rm")
    return AutoModelForSequenceClassification.from_pretrained(tmp_path / "foreign-rm")


@lazy
def causal_reward_model(_):
    return build_models()[1]


# ------------------------------------------------------------------------------------------------------------------
# The table
# ------------------------------------------------------------------------------------------------------------------
CASES = [
    # 1. PPO hyperparameters, at config time
    ("learning_rate<0", config(learning_rate=-1e-5), ValueError, r"learning_rate must be .*≥ 0.*gradient ascent"),
    ("kl_coef<0", config(kl_coef=-0.1), ValueError, r"kl_coef must be .*≥ 0"),
    ("cliprange<0", config(cliprange=-0.2), ValueError, r"cliprange must be .*≥ 0, or None.*None disables"),
    ("cliprange_value<0", config(cliprange_value=-0.2), ValueError, r"cliprange_value must be .*≥ 0, or None"),
    ("gamma>1", config(gamma=1.5), ValueError, r"gamma must be .*in \[0, 1\]; got 1.5"),
    ("gamma<0", config(gamma=-0.1), ValueError, r"gamma must be .*in \[0, 1\]"),
    ("lam>1", config(lam=2.0), ValueError, r"lam must be .*in \[0, 1\]"),
    ("lam=nan", config(lam=math.nan), ValueError, r"lam must be a finite number"),
    ("vf_coef<0", config(vf_coef=-0.1), ValueError, r"vf_coef must be .*≥ 0"),
    ("critic_learning_rate<0", config(critic_learning_rate=-1.0), ValueError, r"critic_learning_rate must be"),
    ("total_episodes=0", config(total_episodes=0), ValueError, r"total_episodes must be .*> 0, or None; got 0"),
    ("total_episodes<0", config(total_episodes=-8), ValueError, r"total_episodes must be .*got -8"),
    ("num_train_epochs=0", config(num_train_epochs=0), ValueError, r"num_train_epochs must be .*> 0"),
    ("missing_eos_penalty=inf", config(missing_eos_penalty=math.inf), ValueError, r"missing_eos_penalty must be a"),
    ("missing_eos_penalty=nan", config(missing_eos_penalty=math.nan), ValueError, r"missing_eos_penalty must be a"),
    ("temperature=0", config(temperature=0.0), ValueError, r"temperature must be .*> 0"),
    ("top_p=0", config(top_p=0.0), ValueError, r"top_p must be .*in \(0, 1\]"),
    ("top_p>1", config(top_p=1.5), ValueError, r"top_p must be .*in \(0, 1\]"),
    ("critic_adam_epsilon=0", config(critic_adam_epsilon=0.0), ValueError, r"critic_adam_epsilon must be .*> 0"),
    ("max_skipped_iterations=0", config(max_skipped_iterations=0), ValueError, r"max_skipped_iterations must be"),
    ("stop_token_id<0", config(stop_token=None, stop_token_id=-1), ValueError, r"stop_token_id must be .*≥ 0"),
    ("ptx_coef=nan", config(ptx_coef=math.nan), ValueError, r"ptx_coef must be a finite number ≥ 0; got nan"),
    ("entropy_coef=inf", config(entropy_coef=math.inf), ValueError, r"entropy_coef must be a finite number ≥ 0"),
    ("response_length=0", config(response_length=0), ValueError, r"response_length must be .*≥ 1; got 0"),
    ("stop_token='</s>'", config(stop_token="</s>"), ValueError, r"stop_token must be one of \('eos', None\)"),
    # 2. the stop token, at trainer construction
    (
        "stop_token=eos-without-eos",
        trainer(processing_class=tokenizer_without_eos),
        ValueError,
        r"stop_token='eos' but the tokenizer has no eos token.*stop_token_id",
    ),
    (
        "stop_token_id-outside-vocab",
        trainer(stop_token=None, stop_token_id=10_000),
        ValueError,
        rf"stop_token_id=10000 is outside the vocabulary \(the tokenizer has {VOCAB} tokens",
    ),
    (
        "missing_eos_penalty-without-stop-token",
        trainer(processing_class=tokenizer_without_eos, stop_token=None, missing_eos_penalty=1.0),
        ValueError,
        r"missing_eos_penalty=1.0 needs a stop token.*stop_token_id",
    ),
    # 3. the prompt budget
    (
        "response_length=context",
        trainer(response_length=CONTEXT),
        ValueError,
        rf"response_length={CONTEXT} does not fit the policy's context of {CONTEXT} tokens.*0 tokens would be left",
    ),
    (
        "response_length>context",
        trainer(response_length=200),
        ValueError,
        rf"response_length=200 does not fit .*context of {CONTEXT} tokens.*-72 tokens.*Lower response_length",
    ),
    (
        "max_prompt_length+response_length>context",
        trainer(max_prompt_length=100, response_length=40),
        ValueError,
        rf"max_prompt_length=100 \+ response_length=40 = 140 tokens exceed .*{CONTEXT}.*max_prompt_length to 88",
    ),
    # 5. vocabularies and prompt ids
    (
        "reward_model-vocab-smaller",
        trainer(reward_model=scorer_with_vocab(VOCAB - 9)),
        ValueError,
        rf"reward_model has an embedding for {VOCAB - 9} token ids.*resize_token_embeddings\({VOCAB}\)",
    ),
    (
        "value_model-vocab-smaller",
        trainer(value_model=scorer_with_vocab(VOCAB - 9)),
        ValueError,
        r"value_model has an embedding for 40 token ids",
    ),
    (
        "ref_model-vocab-smaller",
        trainer(ref_model=causal_with_vocab(VOCAB - 9)),
        ValueError,
        r"ref_model has an embedding for 40 token ids",
    ),
    (
        "pad-id-outside-policy",
        trainer(processing_class=tokenizer_with_unresized_pad),
        ValueError,
        rf"pad token id {VOCAB} is outside the policy's embedding.*resize_token_embeddings",
    ),
    (
        "train-input_ids-too-large",
        trainer(train_dataset=prompts((3, [4, 5, 10_000]), column="input_ids")),
        ValueError,
        rf"train_dataset holds input_ids outside the policy's vocabulary \[0, {VOCAB}\).*to 10000.*row: 3",
    ),
    (
        "train-input_ids-negative",
        trainer(train_dataset=prompts((7, [4, -100, 6]), column="input_ids")),
        ValueError,
        r"train_dataset holds input_ids outside .*from -100 .*row: 7.*-100",
    ),
    (
        "eval-input_ids-too-large",
        trainer(eval_dataset=prompts((1, [4, 99]), n=4, column="input_ids")),
        ValueError,
        r"eval_dataset holds input_ids outside the policy's vocabulary",
    ),
    # 6. a model path that does not exist
    ("model-path-missing", trainer(model="/nonexistent/sft"), OSError, r"model='/nonexistent/sft' could not be"),
    # 7. missing arguments and wrong types
    ("reward_model=None", trainer(reward_model=None), ValueError, r"reward_model is None: pass a reward model"),
    ("processing_class=None", trainer(processing_class=None), ValueError, r"processing_class is None: pass"),
    ("model=None", trainer(model=None), ValueError, r"model is None: pass the policy"),
    ("train_dataset=None", trainer(train_dataset=None), ValueError, r"train_dataset is None"),
    (
        "train_dataset-DatasetDict",
        trainer(train_dataset=dataset_dict),
        TypeError,
        r"train_dataset must be a datasets.Dataset, got DatasetDict: pass one split.*\['train'\]",
    ),
    (
        "eval_dataset-iterable",
        trainer(eval_dataset=iterable_prompts),
        TypeError,
        r"eval_dataset must be a datasets.Dataset, got IterableDataset",
    ),
    (
        "reward_model-causal-lm",
        trainer(reward_model=causal_reward_model),
        ValueError,
        r"LlamaForCausalLM is not a sequence-classification model.*num_labels=1",
    ),
    # 8. empty prompts
    (
        "empty-prompt-text",
        trainer(train_dataset=prompts((3, ""), (9, "   "))),
        ValueError,
        r"train_dataset: 2 of 32 prompts are empty in the 'prompt' column \(the first at row 3\)",
    ),
    (
        "empty-conversation",
        trainer(train_dataset=prompts((4, []), column="conversation")),
        ValueError,
        r"train_dataset: 1 of 32 prompts are empty .*row 4",
    ),
    (
        "empty-input_ids",
        trainer(train_dataset=prompts((2, []), column="input_ids")),
        ValueError,
        r"train_dataset: 1 of 32 prompts are empty in the 'input_ids' column \(the first at row 2\)",
    ),
    (
        "empty-eval-prompt",
        trainer(eval_dataset=prompts((0, ""), n=4)),
        ValueError,
        r"eval_dataset: 1 of 4 prompts are empty",
    ),
    # 9. both columns, disagreeing
    (
        "prompt-and-input_ids-disagree",
        trainer(train_dataset=prompt_and_disagreeing_ids),
        ValueError,
        r"both a 'prompt' and an 'input_ids' column.*1 of 32 rows \(the first: row 5\).*'input_ids' column would be "
        r"used.*remove_columns\('prompt'\).*remove_columns\('input_ids'\)",
    ),
    # 10. metric_for_best_model
    (
        "metric_for_best_model-typo",
        trainer(metric_for_best_model="objective/score"),
        ValueError,
        r"metric_for_best_model='objective/score' is never logged.*Close names: eval_objective/scores",
    ),
    (
        "metric_for_best_model-loss",
        trainer(metric_for_best_model="loss"),
        ValueError,
        r"metric_for_best_model='loss' is never logged.*evaluate\(\) logs: eval_objective/kl",
    ),
    (
        "metric_for_best_model-with-eval-dict",
        trainer(eval_dataset=eval_dict, metric_for_best_model="objective/scores"),
        ValueError,
        r"metric_for_best_model='objective/scores' is never logged.*Close names: eval_val_objective/scores",
    ),
    # 9. issue 26: a reward model or critic built for another tokenizer, without reward_processing_classes
    (
        "reward_model-saved-with-another-tokenizer",
        trainer(reward_model=lazy(lambda tmp_path: foreign_scorer(tmp_path, saved=True))),
        ValueError,
        r"reward_model comes with another tokenizer .*: \d+ tokens; the policy's has 49.*reward_processing_classes",
    ),
    (
        "reward_model-larger-vocabulary-no-tokenizer",
        trainer(reward_model=lazy(lambda tmp_path: foreign_scorer(tmp_path, saved=False))),
        ValueError,
        r"reward_model reads \d+ token ids, more than the policy's 49: it was built for another tokenizer.*"
        r"reward_processing_classes",
    ),
    (
        "value_model-saved-with-another-tokenizer",
        trainer(value_model=lazy(lambda tmp_path: foreign_scorer(tmp_path, saved=True))),
        ValueError,
        r"value_model comes with another tokenizer.*Use a value_model built on the policy's tokenizer",
    ),
    # 9. issue 26: conversations with unknown roles or no user turn; a critic warm-up as long as the run
    (
        "conversation-role-usr",
        trainer(train_dataset=prompts((3, [{"role": "usr", "content": "hi"}]), column="conversation")),
        ValueError,
        r"row 3 has a message with the role 'usr'; a conversation's roles must be one of \('system', 'user'",
    ),
    (
        "conversations-without-a-user-turn",
        trainer(
            train_dataset=lazy(lambda _: Dataset.from_dict({"prompt": [[{"role": "system", "content": "x"}]] * 32}))
        ),
        ValueError,
        r"32 of 32 conversations have an empty message .* or no user turn: no prompt is left",
    ),
    # 10. issue 26, poor cases: a setting, argument or column named before anything runs
    (
        "repetition_penalty=0",
        config(repetition_penalty=0.0),
        ValueError,
        r"repetition_penalty must be a finite number > 0; got 0.0\. .*1.0 disables it",
    ),
    ("repetition_penalty<0", config(repetition_penalty=-1.1), ValueError, r"repetition_penalty must be .*> 0"),
    (
        "policy-vocab-smaller-than-tokenizer",  # not blamed on the ref_model the user never passed
        trainer(model=causal_with_vocab(VOCAB - 9)),
        ValueError,
        rf"^The policy \(model\) has an embedding for 40 token ids, fewer than the tokenizer's \(processing_class\) "
        rf"{VOCAB} tokens.*processing_class.*model\.resize_token_embeddings\({VOCAB}\)",
    ),
    (
        "model-local-path-missing",
        trainer(model="./no/such/dir"),
        FileNotFoundError,
        r"^model='\./no/such/dir' could not be loaded: the local path /.*/no/such/dir does not exist",
    ),
    (
        "model-local-path-missing-no-tokenizer",  # the tokenizer would be loaded from it first
        trainer(model="./no/such/dir", processing_class=None),
        FileNotFoundError,
        r"^model='\./no/such/dir' could not be loaded: the local path .* does not exist",
    ),
    (
        "reward_model-local-path-missing",
        trainer(reward_model=["../rm-typo/final"]),
        FileNotFoundError,
        r"^reward_model='\.\./rm-typo/final' could not be loaded: the local path .* does not exist",
    ),
    (
        "reward-function-p-c-kwargs",
        trainer(reward_model=lambda p, c, **k: [0.0] * len(p)),
        TypeError,
        r"The reward function '<lambda>'\(p, c, \*\*k\) cannot be called: its parameters p, c would get no value\. "
        r".*f\(prompts=\.\.\., completions=\.\.\., completion_ids=\.\.\., \*\*dataset columns \(none here\)\).*"
        r"f\(prompts, completions\), and no \*\*kwargs",
    ),
    (
        "reward-function-one-argument",
        trainer(reward_model=lambda a: [0.0] * len(a)),
        TypeError,
        r"The reward function '<lambda>'\(a\) cannot be called: its parameter a would get no value",
    ),
    (
        "reward-function-unknown-column",
        trainer(
            reward_model=lambda prompts, completions, answer: [0.0] * len(prompts),
            train_dataset=lazy(lambda _: Dataset.from_dict({"prompt": prompt_texts(32), "solution": ["x"] * 32})),
        ),
        TypeError,
        r"its parameter answer would get no value.*dataset columns \(here: solution\)",
    ),
    (
        "rollout-metric-one-argument",
        trainer(rollout_metrics={"gold": lambda texts: [0.0] * len(texts)}),
        TypeError,
        r"The rollout metric '<lambda>'\(texts\) cannot be called",
    ),
    (
        "model-sequence-classifier",
        trainer(model=lazy(lambda _: build_models()[2])),
        TypeError,
        r"^model is a LlamaForSequenceClassification, which cannot generate text: the policy must be a causal "
        r"language model with generate\(\).*AutoModelForCausalLM.*reward_model= or value_model=",
    ),
    (
        "ref_model-sequence-classifier",
        trainer(ref_model=lazy(lambda _: build_models()[2])),
        TypeError,
        r"^ref_model is a LlamaForSequenceClassification, which cannot generate text: the reference policy",
    ),
    (
        "prompt-column-of-integers",
        trainer(train_dataset=lazy(lambda _: Dataset.from_dict({"prompt": list(range(32))}))),
        ValueError,
        r"^train_dataset: row 0 of the 'prompt' column holds int 0; each row must be a text \(str\) or a "
        r"conversation.*'input_ids' column",
    ),
    (
        "prompt-column-of-token-ids",
        trainer(eval_dataset=lazy(lambda _: Dataset.from_dict({"prompt": [[5, 6, 7]] * 4}))),
        ValueError,
        r"^eval_dataset: row 0 of the 'prompt' column holds list \[5, 6, 7\]; each row must be a text",
    ),
    (
        "input_ids-column-of-integers",
        trainer(train_dataset=lazy(lambda _: Dataset.from_dict({"input_ids": list(range(1, 33))}))),
        ValueError,
        r"^train_dataset: row 0 of the 'input_ids' column holds int 1; each row must be a list of token ids",
    ),
]


@pytest.mark.parametrize(("build", "error", "pattern"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_fails_before_the_first_rollout(tmp_path, rollout_forbidden, build, error, pattern):
    with pytest.raises(error, match=pattern):
        build(tmp_path)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(cliprange=None, cliprange_value=None),
        dict(critic_learning_rate=None, critic_adam_epsilon=None, missing_eos_penalty=None),
        dict(gamma=0.0, lam=1.0, kl_coef=0.0, vf_coef=0.0, top_p=1.0),
        dict(total_episodes=None, num_train_epochs=0.5),
    ],
    ids=["clipping-off", "defaults-None", "bounds-inclusive", "fractional-epochs"],
)
def test_valid_edge_values_are_accepted(tmp_path, overrides):
    config(**overrides)(tmp_path)


def test_a_reward_model_with_its_tokenizer_given_is_accepted(tmp_path):
    """Issue 26, bad 7: with reward_processing_classes the foreign reward model re-tokenizes the texts."""
    trainer, other = trainer_with_foreign_reward_model(tmp_path, saved=True)
    assert trainer.reward_sources.processing_classes[0] is other


def trainer_with_foreign_reward_model(tmp_path, saved: bool):
    """A trainer whose reward model reads a LLaMA-style tokenizer, given as ``reward_processing_classes``; and that
    tokenizer."""
    tokenizer, policy, critic = build_models()
    other = build_llama_style_tokenizer()
    other.pad_token = other.unk_token
    trainer = PPOMaxTrainer(
        args=PPOMaxConfig(output_dir=str(tmp_path / "out"), **TINY),
        processing_class=tokenizer,
        model=policy,
        ref_model=None,
        reward_model=foreign_scorer(tmp_path, saved=saved),
        reward_processing_classes=[other],
        value_model=critic,
        train_dataset=Dataset.from_dict({"prompt": prompt_texts(32)}),
    )
    return trainer, other


def test_a_critic_warmup_as_long_as_the_run_is_said_loudly(tmp_path, caplog):
    """Issue 26, bad 6: the policy never moved, and nothing said so."""
    with caplog.at_level(logging.WARNING, logger="trl_ppomax.ppo.config"):
        make_trainer(tmp_path, critic_warmup_steps=2)
    assert (
        "critic_warmup_steps=2 is not below the run's 2 iterations (total_episodes=32 ÷ batch_size=16" in caplog.text
    )
    assert "the policy will not change" in caplog.text


def test_a_reward_model_with_its_own_tokenizer_reads_the_policys_words_on_text_prompts(tmp_path, monkeypatch):
    """Issue 26, item 11: prompt and completion were decoded apart and joined with nothing between them; a word-level
    policy tokenizer decodes a completion without its leading space, so the last prompt word and the first
    completion word fused (0 of 8 rows reached the reward model as the policy's words)."""
    seen: list[str] = []
    original = rewards.score_with_own_tokenizer

    def spy(model, reward_tokenizer, sequences, device):
        seen.extend(sequences)
        return original(model, reward_tokenizer, sequences, device)

    monkeypatch.setattr(rewards, "score_with_own_tokenizer", spy)
    trainer, _ = trainer_with_foreign_reward_model(tmp_path, saved=False)
    tokenizer = trainer.processing_class
    batch = trainer.prompt_batches[0]
    rollout = trainer.rollout(batch["input_ids"], batch["attention_mask"])
    vocabulary = set(tokenizer.get_vocab())
    assert len(seen) == len(rollout.scores) == 16
    for text, ids, mask, response, response_mask in zip(
        seen, rollout.query_ids, rollout.query_mask, rollout.response_ids, rollout.response_mask, strict=True
    ):
        words = tokenizer.decode(
            torch.cat([ids[mask.bool()], response[response_mask.bool()]]), skip_special_tokens=True
        )
        assert text == words and set(text.split()) <= vocabulary, text


def test_a_prompt_budget_of_one_token_is_accepted(tmp_path, rollout_forbidden):
    one_token = Dataset.from_dict({"input_ids": [[5 + i % 10] for i in range(32)]})
    trainer = make_trainer(tmp_path, response_length=CONTEXT - 1, dataset=one_token)
    assert max(len(ids) for ids in trainer.train_dataset["input_ids"]) == 1


# ------------------------------------------------------------------------------------------------------------------
# 4. The reward function's output
# ------------------------------------------------------------------------------------------------------------------
REWARD_OUTPUTS = [
    ("dict", lambda n: {"a": 1.0, "b": 2.0}, r"did not return a sequence of scores\. It returned dict \{'a': 1.0"),
    ("None", lambda n: None, r"did not return a sequence of scores\. It returned NoneType None"),
    ("scalar", lambda n: 1.5, r"did not return a sequence of scores\. It returned float 1.5"),
    ("string", lambda n: "1.0", r"did not return a sequence of scores\. It returned str '1.0'"),
    ("too-few", lambda n: [0.0] * (n - 1), r"it returned 3 scores for 4 completions.*one number per completion"),
    ("too-many", lambda n: np.zeros(n + 1), r"it returned 5 scores for 4 completions"),
    ("texts", lambda n: ["good"] * n, r"must return numbers, but 4 of its 4 scores are not \(e.g. str 'good'\)"),
    ("2-D", lambda n: torch.zeros(n, 1), r"did not return a sequence of scores\. It returned Tensor"),
]


@pytest.mark.parametrize(("make", "pattern"), [r[1:] for r in REWARD_OUTPUTS], ids=[r[0] for r in REWARD_OUTPUTS])
def test_reward_function_output_is_checked(make, pattern):
    def judge(prompts, completions):
        return make(len(prompts))

    with pytest.raises(ValueError, match=r"The reward function 'judge' is at fault: .*" + pattern):
        call_reward_function(judge, ["p"] * 4, ["c"] * 4, torch.device("cpu"))


@pytest.mark.parametrize(
    "returned",
    [[1, 2.5], (True, 0.5), np.array([1.0, 2.5]), torch.tensor([1.0, 2.5]), [torch.tensor(1.0), np.float32(2.5)]],
    ids=["list", "tuple", "numpy", "tensor", "scalars"],
)
def test_reward_function_accepts_sequences_of_numbers(returned):
    scores = call_reward_function(lambda p, c: returned, ["p"] * 2, ["c"] * 2, torch.device("cpu"))
    assert scores.shape == (2,) and scores.dtype == torch.float32


def test_reward_function_fault_stops_the_first_rollout_before_any_update(tmp_path):
    """A reward function can only be judged by calling it: the first rollout calls it, and fails before any update."""
    trainer = make_trainer(tmp_path, reward=lambda p, c: {"score": 1.0}, value_model=build_models()[2])
    before = snapshot(trainer.model.policy)
    with pytest.raises(ValueError, match=r"reward function '<lambda>' is at fault.*returned dict"):
        trainer.train()
    assert all(torch.equal(before[name], p) for name, p in trainer.model.policy.named_parameters())


# ------------------------------------------------------------------------------------------------------------------
# Handled: models as paths, agreeing columns, a dict of evaluation datasets, evaluation prompts within the budget
# ------------------------------------------------------------------------------------------------------------------
def test_models_given_as_paths_are_loaded(tmp_path, rollout_forbidden):
    paths = save_tiny_models(tmp_path / "tiny")
    args = PPOMaxConfig(output_dir=str(tmp_path / "out"), **TINY)
    trainer = PPOMaxTrainer(
        args=args,
        processing_class=None,  # loaded from the model's path
        model=paths["sft"],
        ref_model=paths["sft"],
        reward_model=paths["reward"],
        train_dataset=Dataset.from_dict({"prompt": prompt_texts(32)}),
        value_model=paths["reward"],
    )
    assert type(trainer.model.policy).__name__ == "LlamaForCausalLM"
    assert type(trainer.ref_model).__name__ == "LlamaForCausalLM"
    for scorer in (trainer.reward_model, trainer.model.critic):
        assert type(scorer).__name__ == "LlamaForSequenceClassification" and scorer.config.num_labels == 1
    assert len(trainer.processing_class) == VOCAB and trainer.processing_class.pad_token == "[PAD]"


def test_agreeing_prompt_and_input_ids_columns_are_accepted(tmp_path, rollout_forbidden):
    tokenizer = build_models()[0]
    texts = prompt_texts(32)
    ids = [tokenize_prompt(text, tokenizer) for text in texts]
    trainer = make_trainer(tmp_path, dataset=Dataset.from_dict({"prompt": texts, "input_ids": ids}))
    assert trainer.train_dataset.column_names == ["prompt", "input_ids"]  # prompt kept for the reward functions
    assert trainer.train_dataset["input_ids"] == ids


def test_a_dict_of_evaluation_datasets_is_evaluated_with_prefixes(tmp_path):
    eval_dataset = {
        "short": Dataset.from_dict({"prompt": prompt_texts(3)}),
        "long": Dataset.from_dict({"prompt": [f"{p} {p}" for p in prompt_texts(2)]}),
    }
    trainer = make_trainer(tmp_path, eval_dataset=eval_dataset, metric_for_best_model="short_objective/scores")
    assert set(trainer.eval_dataset) == {"short", "long"}
    assert all(d.column_names == ["prompt", "input_ids"] for d in trainer.eval_dataset.values())
    metrics = trainer.evaluate()
    for name in ("short", "long"):
        assert math.isfinite(metrics[f"eval_{name}_objective/scores"])
        assert metrics[f"eval_{name}_response/length"] > 0
    assert not any(key.startswith("eval_objective") for key in metrics)
    by_name = trainer.evaluate("short", metric_key_prefix="eval_short")  # as the Trainer's own loop asks for one
    assert {k for k in by_name if k.startswith("eval")} == {k for k in metrics if k.startswith("eval_short_")}
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert "eval_long_objective/kl" in logged


def test_evaluate_prepares_raw_prompts_as_training_does(tmp_path, monkeypatch):
    """Over the prompt budget: kept whole while prompt + response fit the context, skipped beyond; never cut."""
    trainer = make_trainer(tmp_path, max_prompt_length=10, response_length=CONTEXT - 40)
    widths = []
    original = PPOMaxTrainer.rollout

    def recording(self, query_ids, query_mask, sampling=True, **kwargs):
        widths.append(query_ids.shape[1])
        return original(self, query_ids, query_mask, sampling, **kwargs)

    monkeypatch.setattr(PPOMaxTrainer, "rollout", recording)
    fits, too_long = " ".join(["hello"] * 30), " ".join(["hello"] * 60)  # 30 tokens ≤ 128 − 88 = 40 < 60
    long_prompts = Dataset.from_dict({"prompt": [fits, too_long, *prompt_texts(2)]})
    metrics = trainer.evaluate(long_prompts)
    assert widths and max(widths) == 30  # kept whole, not cut to 10; the 60-token prompt skipped
    assert metrics["eval_response/length"] > 0


def test_evaluate_refuses_bad_raw_prompts_before_generating(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path)
    monkeypatch.setattr(PPOMaxTrainer, "rollout", lambda *a, **k: pytest.fail("rollout started"))
    with pytest.raises(ValueError, match=r"eval_dataset holds input_ids outside the policy's vocabulary"):
        trainer.evaluate(Dataset.from_dict({"input_ids": [[1, 2, 500]]}))
    with pytest.raises(ValueError, match=r"eval_dataset: 1 of 2 prompts are empty"):
        trainer.evaluate(Dataset.from_dict({"prompt": ["hello", ""]}))
    with pytest.raises(ValueError, match=r"response_length"):
        data.check_prompt_budget(16, None, 16)


# ==================================================================================================================
# Output folders, checkpoints, resume and secrets: nothing a user paid for is lost or mixed.
# ==================================================================================================================
SENTINEL = "hf_SENTINELsecretTokenDoNotPersist987654"
#: Three iterations of 16 episodes, a checkpoint after each.
RUN = dict(total_episodes=48, save_strategy="steps", save_steps=1)


class PolicyAtStart(TrainerCallback):
    """Records the policy's parameters when training begins (after a resume has loaded them)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.params = {name: p.detach().clone() for name, p in model.policy.named_parameters()}


def no_rollout(trainer, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a rollout started before the fault was reported")

    monkeypatch.setattr(trainer, "rollout", refuse)
    return trainer


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """The output_dir of a run of 3 iterations stopped after 2: checkpoint-1 and checkpoint-2 (copied per test)."""
    root = tmp_path_factory.mktemp("stopped")
    trainer = make_trainer(root, **RUN)
    trainer.add_callback(StopAt(2))
    trainer.train()
    return root / "out"


@pytest.fixture
def run_dir(stopped_run, tmp_path):
    """A copy of :func:`stopped_run` at ``tmp_path / "out"``, where ``make_trainer(tmp_path)`` writes."""
    shutil.copytree(stopped_run, tmp_path / "out")
    return tmp_path / "out"


def all_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------------------------------
# 1. Reusing an output_dir
# ------------------------------------------------------------------------------------------------------------------
def test_fresh_run_refuses_an_output_dir_holding_checkpoints(run_dir, tmp_path, monkeypatch):
    before = all_bytes(run_dir)
    trainer = no_rollout(make_trainer(tmp_path, **RUN), monkeypatch)
    with pytest.raises(ValueError) as caught:
        trainer.train()
    message = str(caught.value)
    for text in (
        str(run_dir),
        "checkpoint-1, checkpoint-2",
        "resume_from_checkpoint=True",
        "overwrite_output_dir=True",
    ):
        assert text in message, text
    assert all_bytes(run_dir) == before  # nothing touched


def test_overwrite_output_dir_deletes_the_old_checkpoints(run_dir, tmp_path, caplog):
    (run_dir / "checkpoint-2" / "other-run.txt").write_text("x")
    trainer = make_trainer(tmp_path, **{**RUN, "total_episodes": 16}, overwrite_output_dir=True)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-1"]  # only this run's
    assert json.loads((run_dir / "checkpoint-1" / "ppo_state.json").read_text())["run"]["total_episodes"] == 16
    assert "deleting the checkpoints of the previous run" in caplog.text


# ------------------------------------------------------------------------------------------------------------------
# 2. Partial and 8. damaged checkpoints
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "missing",
    [
        "optimizer.pt",
        "scheduler.pt",
        "rng_state.pth",
        "model.safetensors",
        "critic/model.safetensors",
        "trainer_state.json",
    ],
)
def test_incomplete_checkpoint_is_refused(run_dir, tmp_path, monkeypatch, missing):
    (run_dir / "checkpoint-2" / missing).unlink()
    trainer = no_rollout(make_trainer(tmp_path, **RUN), monkeypatch)
    with pytest.raises(CheckpointError) as caught:
        trainer.train(resume_from_checkpoint=True)
    message = str(caught.value)
    assert "incomplete" in message and "checkpoint-2" in message
    assert (Path(missing).name if "/" not in missing else "critic") in message
    if missing != "trainer_state.json":  # needed even for a weights-only resume
        assert "resume_weights_only=True" in message


def test_weights_only_resume_loads_the_weights_and_warns(run_dir, tmp_path, caplog):
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        (run_dir / "checkpoint-2" / name).unlink()
    trainer = make_trainer(tmp_path, **RUN, resume_weights_only=True)
    trainer.add_callback(start := PolicyAtStart())
    with caplog.at_level(logging.WARNING):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 3 and trainer.state.episode == 48  # continued from iteration 2
    saved = load_file(run_dir / "checkpoint-2" / "model.safetensors")
    for name, value in start.params.items():
        torch.testing.assert_close(value, saved[name], msg=name)
    assert "resume_weights_only=True" in caplog.text and "restart" in caplog.text


def test_a_checkpoint_without_config_json_resumes_into_the_existing_models(run_dir, tmp_path):
    """Issue 26, bad 1: without config.json, from_pretrained on the folder used to build a default-size (7B) Llama."""
    for name in ("config.json", "critic/config.json"):
        (run_dir / "checkpoint-2" / name).unlink()
    trainer = make_trainer(tmp_path, **RUN)
    trainer.add_callback(start := PolicyAtStart())
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 3
    saved = load_file(run_dir / "checkpoint-2" / "model.safetensors")
    for name, value in start.params.items():
        assert torch.equal(value, saved[name]), name


def engine_only_checkpoint(folder: Path) -> Path:
    """A checkpoint of 2 processes as a ZeRO-3 run without stage3_gather_16bit_weights_on_model_save writes it: the
    engine folder (named by ``latest``) holds the weights; configs, states, no plain weight files."""
    engine = folder / "global_step4"
    (folder / "critic").mkdir(parents=True)
    engine.mkdir()
    for name in ("config.json", "critic/config.json"):
        (folder / name).write_text("{}")
    for name in ("scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"):
        torch.save({}, folder / name)
    (folder / "latest").write_text("global_step4")
    for rank in (0, 1):
        for kind in ("model", "optim"):
            torch.save({}, engine / f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt")
    return folder


@pytest.mark.parametrize("weights_only", [False, True])
def test_an_engine_only_checkpoint_is_complete_under_deepspeed(tmp_path, weights_only):
    """Issue 31, item 4: no consolidated weights, the engine checkpoint holds them (read even by a weights-only
    resume): required, and its files checked for damage."""
    path = engine_only_checkpoint(tmp_path / "checkpoint-2")
    args = SimpleNamespace(resume_weights_only=weights_only, world_size=2, uses_critic=True)
    files = required_checkpoint_files(str(path), args, "deepspeed")
    engine = sorted(str(f) for f in (path / "global_step4").iterdir())
    assert set(engine) <= set(files) and str(path / "latest") in files
    (path / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"PK\x03\x04 cut")
    assert file_problem(path / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")  # a truncation shows


@pytest.mark.parametrize(
    "missing, named",
    [
        ("latest", "the DeepSpeed engine checkpoint"),
        ("global_step4", "global_step4/ that `latest` names"),
        (
            "global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt",
            "global_step4/ optimizer states of process(es) [1]",
        ),
        ("global_step4/zero_pp_rank_0_mp_rank_00_model_states.pt", "global_step4/ model states of process(es) [0]"),
        ("scheduler.pt", "scheduler.pt"),
    ],
)
def test_an_incomplete_engine_only_checkpoint_is_refused(tmp_path, missing, named):
    path = engine_only_checkpoint(tmp_path / "checkpoint-2")
    target = path / missing
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    with pytest.raises(CheckpointError) as caught:
        required_checkpoint_files(
            str(path), SimpleNamespace(resume_weights_only=False, world_size=2, uses_critic=True), "deepspeed"
        )
    assert "incomplete" in str(caught.value) and named in str(caught.value)


def test_an_engine_only_checkpoint_resumed_without_deepspeed_says_how(tmp_path):
    path = engine_only_checkpoint(tmp_path / "checkpoint-2")
    with pytest.raises(CheckpointError) as caught:
        required_checkpoint_files(
            str(path), SimpleNamespace(resume_weights_only=True, world_size=2, uses_critic=True), None
        )
    message = str(caught.value)
    assert "only a sharded DeepSpeed engine checkpoint" in message and "consolidate_engine_checkpoint" in message


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "model.safetensors": truncate,
    "critic/model.safetensors": truncate,
    "optimizer.pt": truncate,
    "scheduler.pt": truncate,
    "rng_state.pth": truncate,
    "ppo_state.json": lambda path: path.write_text(""),
    "trainer_state.json": lambda path: path.write_text("{not json"),
}


@pytest.mark.parametrize("damaged", [*DAMAGE, "ppo_state.json without keys"])
def test_damaged_checkpoint_names_the_file_and_the_previous_checkpoint(run_dir, tmp_path, monkeypatch, damaged):
    if damaged == "ppo_state.json without keys":
        (run_dir / "checkpoint-2" / "ppo_state.json").write_text("{}")
        damaged = "ppo_state.json"
    else:
        DAMAGE[damaged](run_dir / "checkpoint-2" / damaged)
    trainer = no_rollout(make_trainer(tmp_path, **RUN), monkeypatch)
    with pytest.raises(CheckpointError) as caught:
        trainer.train(resume_from_checkpoint=True)
    message = str(caught.value)
    assert damaged in message and "damaged" in message
    assert f"resume_from_checkpoint={str(run_dir / 'checkpoint-1')!r}" in message


# ------------------------------------------------------------------------------------------------------------------
# 1./3. A resume with other settings
# ------------------------------------------------------------------------------------------------------------------
CHANGES = {
    "batch size": (dict(per_device_train_batch_size=2), ["per_device_train_batch_size: checkpoint 4, now 2"]),
    "episodes": (dict(total_episodes=32), ["total_episodes: checkpoint 48, now 32", "num_total_batches"]),
    "seed": (dict(seed=1), ["seed: checkpoint 0, now 1"]),
    "samples per prompt": (dict(num_samples_per_prompt=2), ["num_samples_per_prompt: checkpoint 1, now 2"]),
    "preset": (dict(preset="vanilla"), ["preset: checkpoint 'ppo_max', now 'vanilla'"]),
    "learning rate": (dict(learning_rate=5e-4), ["learning_rate: checkpoint 0.001, now 0.0005"]),
    "dataset": (
        dict(dataset=Dataset.from_dict({"prompt": prompt_texts(40)})),
        ["train_dataset_size: checkpoint 32, now 40"],
    ),
    "model": (dict(arch="gpt_neox"), ["policy_parameters: checkpoint 23776, now 20288"]),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_resume_with_other_run_settings_is_refused(run_dir, tmp_path, monkeypatch, change):
    overrides, expected = CHANGES[change]
    trainer = no_rollout(make_trainer(tmp_path, **{**RUN, **overrides}), monkeypatch)
    with pytest.raises(CheckpointError) as caught:
        trainer.train(resume_from_checkpoint=True)
    message = str(caught.value)
    for text in [*expected, "checkpoint-2", "resume_allow_changes=True"]:
        assert text in message, text


def test_resume_allow_changes_continues_with_a_warning(run_dir, tmp_path, caplog):
    trainer = make_trainer(tmp_path, **{**RUN, "total_episodes": 64}, resume_allow_changes=True)
    with caplog.at_level(logging.WARNING):
        trainer.train(resume_from_checkpoint=True)
    assert "total_episodes: checkpoint 48, now 64" in caplog.text
    assert trainer.state.global_step == 4 and trainer.state.episode == 64


def test_a_resume_with_fewer_samples_per_prompt_is_refused_and_an_unchanged_one_continues(tmp_path, monkeypatch):
    """Issue 31, item 6: num_samples_per_prompt 2 -> 1 keeps the batch size (episodes) but reads twice the prompts per
    iteration, so a resume would read prompts already trained on again and never reach the rest of the dataset."""
    first = make_trainer(tmp_path, **RUN, num_samples_per_prompt=2)
    first.add_callback(StopAt(1))
    first.train()
    changed_run = no_rollout(make_trainer(tmp_path, **RUN, num_samples_per_prompt=1), monkeypatch)
    with pytest.raises(CheckpointError) as caught:
        changed_run.train(resume_from_checkpoint=True)
    message = str(caught.value)
    for text in ("num_samples_per_prompt: checkpoint 2, now 1", "checkpoint-1", "resume_allow_changes=True"):
        assert text in message, text
    same = make_trainer(tmp_path, **RUN, num_samples_per_prompt=2)
    same.add_callback(StopAt(2))
    same.train(resume_from_checkpoint=True)
    assert same.state.global_step == 2 and same.state.episode == 32


def test_a_checkpoint_predating_a_run_setting_resumes_with_a_warning_naming_it(run_dir, tmp_path, caplog):
    """A checkpoint of an earlier trl-ppomax lacks num_samples_per_prompt in its run settings: not compared (its value
    is unknown), and the warning says so with this run's value."""
    path = run_dir / "checkpoint-2" / "ppo_state.json"
    state = json.loads(path.read_text())
    del state["run"]["num_samples_per_prompt"]
    path.write_text(json.dumps(state))
    trainer = make_trainer(tmp_path, **RUN)
    with caplog.at_level(logging.WARNING):
        trainer.train(resume_from_checkpoint=True)
    assert "predates the stored run setting(s) num_samples_per_prompt" in caplog.text
    assert "num_samples_per_prompt=1" in caplog.text
    assert trainer.state.global_step == 3


class LearningRates(TrainerCallback):
    """Records each parameter group's learning rate, by model, when an iteration begins."""

    def __init__(self, trainer) -> None:
        self.trainer, self.at_start = trainer, []

    def on_step_begin(self, args, state, control, **kwargs):
        self.at_start.append({group["model"]: group["lr"] for group in self.trainer.optimizer.param_groups})


def test_a_changed_learning_rate_applies_on_resume_when_changes_are_allowed(run_dir, tmp_path, caplog):
    """Issue 26, bad 4: the saved schedule used to restore the old base rate silently."""
    trainer = make_trainer(tmp_path, **RUN, learning_rate=2e-4, critic_learning_rate=3e-4, resume_allow_changes=True)
    trainer.add_callback(rates := LearningRates(trainer))
    with caplog.at_level(logging.WARNING):
        trainer.train(resume_from_checkpoint=True)
    assert "learning_rate: checkpoint 0.001, now 0.0002" in caplog.text
    policy, critic = trainer.lr_scheduler.base_lrs[0], trainer.lr_scheduler.base_lrs[-1]
    assert (policy, critic) == (2e-4, 3e-4)
    step = trainer.lr_scheduler.last_epoch - trainer.args.num_ppo_epochs * trainer.args.num_mini_batches
    fraction = trainer.lr_scheduler.lr_lambdas[0](step)  # the schedule's position when iteration 3 began
    assert rates.at_start[0] == pytest.approx({"policy": 2e-4 * fraction, "critic": 3e-4 * fraction})


def test_old_checkpoint_without_run_settings_resumes_with_a_warning(run_dir, tmp_path, caplog):
    path = run_dir / "checkpoint-2" / "ppo_state.json"
    state = json.loads(path.read_text())
    del state["run"]
    path.write_text(json.dumps(state))
    trainer = make_trainer(tmp_path, **RUN)
    with caplog.at_level(logging.WARNING):
        trainer.train(resume_from_checkpoint=True)
    assert "predates stored run settings" in caplog.text
    assert trainer.state.global_step == 3


# ------------------------------------------------------------------------------------------------------------------
# 4. Secrets and checkpoint internals
# ------------------------------------------------------------------------------------------------------------------
def test_hub_token_is_never_written(tmp_path):
    trainer = make_trainer(tmp_path, **RUN, hub_token=SENTINEL)
    trainer.train()
    trainer.save_model()
    trainer.save_model(str(tmp_path / "final"))
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "training_args.bin" for p in written)
    assert not [p for p in written if SENTINEL.encode() in p.read_bytes()]
    assert trainer.args.hub_token == SENTINEL  # the live arguments are untouched
    saved = torch.load(tmp_path / "final" / "training_args.bin", weights_only=False)
    assert saved.hub_token is None and saved.output_dir == trainer.args.output_dir


INTERNALS = ["critic/", "optimizer.pt", "ppo_state.json", "rng_state.pth", "scheduler.pt", "trainer_state.json"]


def test_push_leaves_checkpoint_internals_out_unless_asked(stopped_run, monkeypatch, capsys):
    checkpoint = stopped_run / "checkpoint-2"
    files, excluded = hub.upload_plan(checkpoint)
    assert excluded == sorted([*INTERNALS, "training_args.bin"])
    assert not set(files) & set(excluded) and "model.safetensors" in files
    everything = hub.upload_files(checkpoint, include_internals=True)
    assert {"optimizer.pt", "training_args.bin", "critic/model.safetensors"} <= set(everything)

    assert main(["push", str(checkpoint), "--repo-id", "me/m", "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert "optimizer.pt" not in captured.out and "training_args.bin" not in captured.out
    assert "optimizer.pt" in captured.err and "--include-checkpoint-files" in captured.err
    assert main(["push", str(checkpoint), "--repo-id", "me/m", "--dry-run", "--include-checkpoint-files"]) == 0
    captured = capsys.readouterr()
    assert "optimizer.pt" in captured.out and "not uploading" not in captured.err


# ------------------------------------------------------------------------------------------------------------------
# 5. An unwritable output_dir
# ------------------------------------------------------------------------------------------------------------------
def _under_a_file(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("a regular file")
    return tmp_path / "file"


def _read_only(tmp_path, monkeypatch):
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    if os.access(folder, os.W_OK):
        folder.chmod(0o700)
        pytest.skip("permissions do not apply (running as root)")
    return folder


def _write_fails(tmp_path, monkeypatch):
    original = Path.write_bytes

    def write_bytes(self, data):
        if self.name.startswith(".trl-ppomax-write-test"):
            raise OSError(errno.EROFS, "Read-only file system")
        return original(self, data)

    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    return tmp_path


@pytest.mark.parametrize("make_parent", [_under_a_file, _read_only, _write_fails], ids=lambda f: f.__name__[1:])
def test_unwritable_output_dir_fails_at_init(tmp_path, monkeypatch, make_parent):
    parent = make_parent(tmp_path, monkeypatch)
    try:
        with pytest.raises(ValueError) as caught:
            make_trainer(parent, **RUN)
    finally:
        parent.chmod(0o700)
    message = str(caught.value)
    assert "output_dir" in message and str(parent / "out") in message and "not writable" in message


# ------------------------------------------------------------------------------------------------------------------
# 6. train() twice
# ------------------------------------------------------------------------------------------------------------------
def test_train_twice_is_a_clear_error(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, total_episodes=16)
    trainer.train()
    no_rollout(trainer, monkeypatch)
    with pytest.raises(RuntimeError) as caught:
        trainer.train()
    message = str(caught.value)
    assert "train() was already called" in message
    assert "new PPOMaxTrainer" in message and "resume_from_checkpoint=True" in message


# ------------------------------------------------------------------------------------------------------------------
# 7. A full disk during save_model; push of a folder without weights
# ------------------------------------------------------------------------------------------------------------------
def disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_save_model_is_atomic_on_a_full_disk(tmp_path, monkeypatch):
    import transformers.modeling_utils

    trainer = make_trainer(tmp_path)
    final = tmp_path / "final"
    trainer.save_model(str(final))
    before = all_bytes(final)
    with torch.no_grad():
        next(trainer.model.policy.parameters()).add_(1.0)
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        trainer.save_model(str(final))
    assert all_bytes(final) == before  # the previous save is intact, no half-written file, no temporary folder

    with pytest.raises(OSError, match="No space left"):
        trainer.save_model(str(tmp_path / "fresh"))
    assert not (tmp_path / "fresh" / "config.json").exists()
    assert not list((tmp_path / "fresh").iterdir())


def test_save_model_into_output_dir_keeps_checkpoints_and_replaces_stale_weights(run_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    checkpoints = {p.name: all_bytes(p) for p in run_dir.glob("checkpoint-*")}
    (run_dir / "model.safetensors.index.json").write_text('{"weight_map": {}}')  # an earlier sharded save
    (run_dir / "model-00001-of-00002.safetensors").write_bytes(b"old")
    make_trainer(tmp_path).save_model()
    assert {p.name: all_bytes(p) for p in run_dir.glob("checkpoint-*")} == checkpoints
    assert not (run_dir / "model.safetensors.index.json").exists()
    assert not (run_dir / "model-00001-of-00002.safetensors").exists()
    assert not list(run_dir.glob(".tmp*"))
    AutoModelForCausalLM.from_pretrained(run_dir)


def _no_weights(folder: Path) -> None:
    (folder / "model.safetensors").unlink()


def _truncated_weights(folder: Path) -> None:
    truncate(folder / "model.safetensors")


def _missing_shard(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"x")


@pytest.mark.parametrize(
    ("break_folder", "named"),
    [(_no_weights, "no complete weights"), (_truncated_weights, "damaged"), (_missing_shard, "model-00002-of-00002")],
    ids=["no-weights", "truncated", "missing-shard"],
)
def test_push_refuses_a_folder_without_whole_weights(tmp_path, capsys, break_folder, named):
    folder = tmp_path / "final"
    make_trainer(tmp_path).save_model(str(folder))
    hub.push_folder(folder, "me/m", dry_run=True)  # whole: accepted
    break_folder(folder)
    with pytest.raises(ValueError, match=named):
        hub.upload_files(folder)
    assert main(["push", str(folder), "--repo-id", "me/m", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert named in err and "Save the model again" in err


def test_allowed_change_of_model_still_fails_clearly_when_the_weights_do_not_fit(run_dir, tmp_path, monkeypatch):
    trainer = no_rollout(make_trainer(tmp_path, **RUN, arch="gpt_neox", resume_allow_changes=True), monkeypatch)
    with pytest.raises(CheckpointError) as caught:
        trainer.train(resume_from_checkpoint=True)
    message = str(caught.value)
    assert "Could not load the weights" in message and "other models or settings" in message


# ==================================================================================================================
# Faults during a run: non-finite rewards, path typos in the recipes, damaged release shards, bad preference rows.
# ==================================================================================================================
RECIPES = Path(__file__).resolve().parents[1] / "recipes"
NAN, INF = math.nan, math.inf


def nan_reward(positions, calls: list[int] | None = None):
    """A reward function scoring a completion by its length, NaN at ``positions`` of each call (all: ``"all"``)."""

    def reward(prompts, completions):
        scores = [float(len(c)) for c in completions]
        for i in range(len(scores)) if positions == "all" else positions:
            scores[i] = NAN
        if calls is not None:
            calls.append(len(scores))
        return scores

    return reward


def critic():
    return build_models()[2]


# ------------------------------------------------------------------------------------------------------------------
# Non-finite rewards: dropped per sample, skipped per batch, stopped after max_skipped_iterations in a row
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        # one sample per micro-batch: a dropped sample leaves its micro-batch empty, which must add nothing
        {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 8},
    ],
    ids=["micro-batch-4", "micro-batch-1"],
)
def test_one_nan_reward_per_batch_still_trains_and_counts_the_dropped_samples(tmp_path, overrides):
    calls: list[int] = []
    trainer = make_trainer(tmp_path, reward=nan_reward([0], calls), value_model=critic(), **overrides)
    before = snapshot(trainer.model.policy), snapshot(trainer.model.critic)
    trainer.train()
    dropped = len(calls)  # one NaN per call of the reward function
    assert trainer.ppo_state.counters[M.SKIPPED_SAMPLES] == dropped > 0
    assert trainer.ppo_state.counters[M.SKIPPED_ITERATIONS] == 0 and trainer.ppo_state.counters[M.SKIPPED_UPDATES] == 0
    assert (
        trainer.ppo_state.running_reward.count == sum(calls) - dropped
    )  # the dropped scores never entered the moments
    assert changed(before[0], trainer.model.policy) > 0 and changed(before[1], trainer.model.critic) > 0
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    last = trainer.state.log_history[-1]
    assert last[M.SKIPPED_SAMPLES] == dropped
    logged = [value for entry in trainer.state.log_history for value in entry.values() if isinstance(value, float)]
    assert all(math.isfinite(value) for value in logged)  # no NaN leaks into any metric


def test_minibatch_whitening_survives_a_minibatch_with_no_sample_left(tmp_path):
    # 15 of 16 samples dropped: at least one of the two minibatches has no real token to whiten over
    trainer = make_trainer(
        tmp_path, reward=nan_reward(range(1, 16)), value_model=critic(), advantage_whitening_scope="minibatch"
    )
    before = snapshot(trainer.model.critic)
    trainer.train()
    assert trainer.ppo_state.counters[M.SKIPPED_SAMPLES] == 30 and trainer.ppo_state.counters[M.SKIPPED_UPDATES] == 0
    assert changed(before, trainer.model.critic) > 0


def first_rollout(trainer) -> Rollout:
    batch = trainer.prompt_batches[0]
    return trainer.rollout(batch["input_ids"], batch["attention_mask"])


@pytest.mark.parametrize("whiten_rewards", [False, True])
def test_dropped_samples_leave_the_same_experience_as_a_batch_without_them(tmp_path, whiten_rewards):
    trainer = make_trainer(tmp_path, whiten_rewards=whiten_rewards, reward_norm="running")
    rollout = first_rollout(trainer)
    poisoned = Rollout(**{**vars(rollout), "scores": rollout.scores.clone()})
    poisoned.scores[[1, 5]] = torch.tensor([NAN, -INF])
    keep = torch.isfinite(poisoned.scores)
    start = trainer.ppo_state.running_reward.state_dict()

    masked, masked_metrics, _ = trainer.make_experience(poisoned)
    moments = trainer.ppo_state.running_reward.state_dict()
    trainer.ppo_state.running_reward.load_state_dict(start)
    clean, clean_metrics, _ = trainer.make_experience(rollout.select(keep))

    assert moments == pytest.approx(trainer.ppo_state.running_reward.state_dict())
    assert moments["count"] == start["count"] + keep.sum().item()
    for name in ("advantages", "returns", "raw_advantages"):
        torch.testing.assert_close(getattr(masked, name)[keep], getattr(clean, name), msg=name)
        assert torch.all(getattr(masked, name)[~keep] == 0), name
    assert masked.rollout.response_mask[~keep].sum() == 0 and torch.all(masked.rollout.scores[~keep] == 0)
    assert masked_metrics == pytest.approx(clean_metrics)
    assert trainer.ppo_state.counters[M.SKIPPED_SAMPLES] == 2


def test_an_all_nan_reward_stops_after_max_skipped_iterations(tmp_path):
    calls: list[int] = []
    trainer = make_trainer(
        tmp_path, reward=nan_reward("all", calls), value_model=critic(), total_episodes=64, max_skipped_iterations=2
    )
    before = snapshot(trainer.model)
    with pytest.raises(RuntimeError, match=r"max_skipped_iterations=2") as error:
        trainer.train()
    assert "iteration 2" in str(error.value) and "no finite reward (None, NaN or inf)" in str(error.value)
    assert len(calls) == 2  # stopped at once: no third rollout
    assert (
        trainer.ppo_state.counters[M.SKIPPED_ITERATIONS] == 2 and trainer.ppo_state.counters[M.SKIPPED_SAMPLES] == 32
    )
    assert trainer.ppo_state.running_reward.count == 0  # never updated from a skipped batch
    assert changed(before, trainer.model) == 0


def test_the_run_of_skipped_iterations_survives_a_resume(tmp_path):
    settings = dict(total_episodes=64, max_skipped_iterations=2, save_strategy="steps", save_steps=1)
    first = make_trainer(tmp_path, reward=nan_reward("all"), value_model=critic(), **settings)
    first.add_callback(StopAt(1))
    first.train()  # iteration 1 skipped and saved
    checkpoint = tmp_path / "out" / "checkpoint-1"
    assert json.loads((checkpoint / "ppo_state.json").read_text())["counters"][M.SKIPPED_IN_A_ROW] == 1
    resumed = make_trainer(tmp_path, reward=nan_reward("all"), value_model=critic(), **settings)
    with pytest.raises(RuntimeError, match="max_skipped_iterations=2"):
        resumed.train(resume_from_checkpoint=str(checkpoint))  # the 2nd skip in a row, across the resume
    assert resumed.state.global_step == 1


@pytest.mark.parametrize(
    "pattern, limit, total, stops_at, message",
    [
        ("SSS", 3, 10, 3, "3 iterations in a row"),
        ("SST", 3, 10, None, None),  # a trained iteration resets the run
        ("STSTST", 2, 10, None, None),
        ("STSS", 2, 10, 4, "2 iterations in a row"),
        ("S", 1, 10, 1, "1 iterations in a row"),
        ("TTT", 1, 3, None, None),
        ("SS", 3, 2, 2, "every one of the run's 2 iterations"),  # a short run that never trained
        ("TS", 3, 2, None, None),
    ],
)
def test_skips_in_a_row_are_counted_and_stop_the_run(pattern, limit, total, stops_at, message):
    state = PPOState()
    counters = state.counters
    for iteration, kind in enumerate(pattern, start=1):
        problem = "non-finite values (1)" if kind == "S" else None
        if iteration == stops_at:
            with pytest.raises(RuntimeError, match=rf"max_skipped_iterations={limit}\b") as error:
                state.count_iteration(problem, iteration, total, limit)
            assert message in str(error.value) and "the last had non-finite values (1)" in str(error.value)
            return
        state.count_iteration(problem, iteration, total, limit)
    assert stops_at is None
    assert counters[M.SKIPPED_ITERATIONS] == pattern.count("S")
    assert counters[M.SKIPPED_IN_A_ROW] == len(pattern) - len(pattern.rstrip("S"))


def test_a_run_whose_every_optimizer_step_is_skipped_stops_with_an_error(tmp_path, monkeypatch):
    """Issue 26, bad 5: skipped updates used to end the run normally, untrained; they count as skipped iterations."""
    trainer = make_trainer(tmp_path, total_episodes=64, max_skipped_iterations=2)
    original = trainer.micro_batch_loss

    def poisoned(*args):
        loss, stats = original(*args)
        return loss * math.nan, stats

    monkeypatch.setattr(trainer, "micro_batch_loss", poisoned)
    before = snapshot(trainer.model)
    with pytest.raises(RuntimeError, match=r"Stopped at iteration 2: 2 iterations in a row .*all 2 optimizer steps"):
        trainer.train()
    assert changed(before, trainer.model) == 0


def test_a_short_run_whose_every_iteration_is_skipped_fails(tmp_path):
    trainer = make_trainer(tmp_path, reward=nan_reward("all"), value_model=critic(), max_skipped_iterations=3)
    with pytest.raises(RuntimeError, match=r"every one of the run's 2 iterations .*max_skipped_iterations=3"):
        trainer.train()  # 2 iterations, both skipped: fewer than max_skipped_iterations, but nothing trained


def fake_rollout(scores, values=None) -> Rollout:
    batch = len(scores)
    mask = torch.ones(batch, 3, dtype=torch.long)
    return Rollout(
        query_ids=torch.zeros(batch, 2, dtype=torch.long),
        query_mask=torch.ones(batch, 2, dtype=torch.long),
        response_ids=torch.ones(batch, 3, dtype=torch.long),
        response_mask=mask,
        logprobs=-torch.ones(batch, 3),
        ref_logprobs=-torch.ones(batch, 3),
        values=torch.ones(batch, 3) if values is None else torch.tensor(values),
        scores=torch.tensor(scores),
        policy_perplexity=torch.ones(batch),
        ref_perplexity=torch.ones(batch),
    )


@pytest.mark.parametrize(
    "rank0, rank1, dropped, problem",
    [
        (fake_rollout([NAN, NAN]), fake_rollout([1.0, 2.0]), 2, None),  # one process keeps nothing: masked only
        (
            fake_rollout([NAN, INF]),
            fake_rollout([-INF, NAN]),
            4,
            "no finite reward (None, NaN or inf) for all 4 samples",
        ),
        (fake_rollout([1.0, NAN]), fake_rollout([1.0, 2.0], [[1, 1, 1], [1, NAN, 1]]), 1, "non-finite values (1)"),
    ],
    ids=["masked", "all-dropped", "bad-value"],
)
def test_the_masking_is_per_process_and_the_skip_decision_global(rank0, rank1, dropped, problem):
    results = run_distributed(lambda r: drop_non_finite(rank0, r), lambda r: drop_non_finite(rank1, r))
    for original, (rollout, keep, n, reason) in zip((rank0, rank1), results, strict=True):
        assert (n, reason) == (dropped, problem)  # the same on every process
        torch.testing.assert_close(keep, torch.isfinite(original.scores))
        if problem is None:
            assert torch.all(rollout.response_mask[~keep] == 0) and torch.all(rollout.scores[~keep] == 0)
            assert torch.equal(rollout.response_mask[keep], original.response_mask[keep])
            assert all(torch.isfinite(t).all() for t in (rollout.scores, rollout.logprobs, rollout.values))


def test_kept_gather_returns_the_kept_values_of_every_process():
    keep = torch.tensor([True, False, True])
    gather = kept_gather(keep, lambda t: torch.cat([t, t]))  # two processes holding the same rows
    assert gather(torch.tensor([1.0, NAN, 3.0])).tolist() == [1.0, 3.0, 1.0, 3.0]


@pytest.mark.parametrize(
    "stats, named",
    [
        ({"reward_mean": NAN}, "reward_mean=nan"),
        ({"reward_std": INF}, "reward_std=inf"),
        ({"reward_stats_count": NAN}, "reward_stats_count=nan"),
        ({"reward_std": -1.0}, "reward_std=-1.0"),
        ({"reward_mean": NAN, "reward_std": NAN}, "reward_mean=nan, reward_std=nan"),
    ],
)
@pytest.mark.parametrize("reward_norm", ["running", "none"])
def test_non_finite_stored_reward_statistics_are_rejected_at_init(tmp_path, stats, named, reward_norm):
    reward_model = build_models()[2]
    for key, value in {"reward_mean": 0.5, "reward_std": 2.0, "reward_stats_count": 100.0, **stats}.items():
        setattr(reward_model.config, key, value)
    with pytest.raises(ValueError, match=named) as error:
        make_trainer(tmp_path, reward=reward_model, reward_norm=reward_norm)
    assert "config.json" in str(error.value)


def test_valid_stored_reward_statistics_still_seed_the_moments(tmp_path):
    reward_model = build_models()[2]
    for key, value in {"reward_mean": 0.5, "reward_std": 2.0, "reward_stats_count": 100.0}.items():
        setattr(reward_model.config, key, value)
    moments = make_trainer(tmp_path, reward=reward_model).ppo_state.running_reward
    assert (moments.count, moments.mean, moments.std) == pytest.approx((100.0, 0.5, 2.0))


# ------------------------------------------------------------------------------------------------------------------
# Core: losses and whitening with nothing left to average over
# ------------------------------------------------------------------------------------------------------------------
def test_losses_on_an_empty_mask_are_zero_with_a_zero_gradient():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    empty, half = torch.zeros(2, 2), torch.tensor([[1, 1], [0, 0]])
    assert core._masked_loss_mean(x, half).item() == pytest.approx(1.5)  # = masked_mean where the mask is not empty
    loss = core._masked_loss_mean(x, empty)
    loss.backward()
    assert loss.item() == 0.0 and torch.all(x.grad == 0)
    pg_loss, _ = core.clipped_policy_loss(x, x.detach(), torch.ones(2, 2), empty, 0.2)
    vf_loss, _ = core.clipped_value_loss(x, x.detach(), torch.ones(2, 2), empty, 0.2)
    entropy, stats = core.entropy_loss(x, empty)
    assert (pg_loss.item(), vf_loss.item(), entropy.item()) == (0.0, 0.0, 0.0)
    assert math.isnan(stats["entropy"])  # a statistic of nothing stays NaN (the trainer averages with nanmean)


@pytest.mark.parametrize(
    "mask, shift_mean, expected",
    [
        ([[0, 0, 0]], True, [[0.0, 0.0, 0.0]]),
        ([[0, 0, 0]], False, [[0.0, 0.0, 0.0]]),
        ([[0, 1, 0]], True, [[0.0, 0.0, 0.0]]),  # one element: centred, nothing to scale
        ([[0, 1, 0]], False, [[0.0, 5.0, 0.0]]),
    ],
)
def test_masked_whiten_with_fewer_than_two_elements(mask, shift_mean, expected):
    x = torch.tensor([[NAN, 5.0, 7.0]])
    out = core.masked_whiten(x, torch.tensor(mask), shift_mean=shift_mean)
    assert out.tolist() == expected


# ------------------------------------------------------------------------------------------------------------------
# Recipes: a local path that does not exist fails at once, naming the setting
# ------------------------------------------------------------------------------------------------------------------
def load_recipe(name: str):
    """The module behind recipes/<name>.py (a thin wrapper): trl_ppomax.cli.ppo or trl_ppomax.cli.reward."""
    return importlib.import_module({"ppo_max": "trl_ppomax.cli.ppo", "reward_modeling": "trl_ppomax.cli.reward"}[name])


class NoLoading:
    """Stands in for the Auto classes: the path check must fail before any model or tokenizer is loaded."""

    @staticmethod
    def from_pretrained(*args, **kwargs):
        raise AssertionError(f"loaded {args[0]!r} before checking the local paths")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A working folder with existing local models and prompt files, and no model loading."""
    for folder in ("tiny/sft", "tiny/reward"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "tiny" / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "tiny" / "preferences.jsonl").write_text('{"chosen": "a", "rejected": "b"}\n')
    monkeypatch.chdir(tmp_path)
    return tmp_path


PPO_VALID = {
    "--sft_model_path": "tiny/sft",
    "--reward_model_path": "tiny/reward",
    "--dataset_name": "tiny/prompts.jsonl",
}


@pytest.mark.parametrize(
    "setting, value",
    [
        ("sft_model_path", "./missing-sft"),
        ("sft_model_path", "tiny/sfft"),  # a typo in a folder that exists
        ("model_name_or_path", "~/no/such/model"),
        ("reward_model_path", "output/typo/reward"),  # more parts than a Hub id
        ("value_model_path", "/nonexistent/critic"),
        ("dataset_name", "prompts.jsonl"),  # a data file
        ("dataset_name", "tiny/promts.jsonl"),
        ("eval_dataset_name", "data/ppo_data/valid.json"),
        ("ptx_dataset_name", "./ptx_texts"),
    ],
)
def test_ppo_recipe_fails_fast_on_a_missing_local_path(workdir, monkeypatch, setting, value):
    recipe = load_recipe("ppo_max")
    for name in ("AutoModelForCausalLM", "AutoModelForSequenceClassification", "AutoTokenizer"):
        monkeypatch.setattr(recipe, name, NoLoading)
    args = {**PPO_VALID, f"--{setting}": value}
    argv = [item for pair in args.items() for item in pair] + ["--output_dir", str(workdir / "out")]
    with pytest.raises(FileNotFoundError, match=f"^{setting} not found: {re.escape(value)} "):
        recipe.main([*argv, "--report_to", "none", "--bf16", "False"])


def test_ppo_recipe_passes_the_check_with_existing_paths(workdir, monkeypatch):
    recipe = load_recipe("ppo_max")
    monkeypatch.setattr(recipe, "AutoModelForCausalLM", NoLoading)
    argv = [item for pair in PPO_VALID.items() for item in pair] + ["--output_dir", str(workdir / "out")]
    with pytest.raises(AssertionError, match="loaded 'tiny/sft'"):  # got as far as loading the policy
        recipe.main([*argv, "--report_to", "none", "--bf16", "False"])


@pytest.mark.parametrize(
    "setting, value",
    [("model_name_or_path", "./missing-sft"), ("model_name_or_path", "tiny/sfft"), ("dataset_name", "prefs.jsonl")],
)
def test_reward_recipe_fails_fast_on_a_missing_local_path(workdir, monkeypatch, setting, value):
    recipe = load_recipe("reward_modeling")
    for name in ("AutoModelForCausalLM", "AutoModelForSequenceClassification", "AutoTokenizer"):
        monkeypatch.setattr(recipe, name, NoLoading)
    args = {"--model_name_or_path": "tiny/sft", "--dataset_name": "tiny/preferences.jsonl", f"--{setting}": value}
    argv = [item for pair in args.items() for item in pair] + ["--output_dir", str(workdir / "out")]
    with pytest.raises(FileNotFoundError, match=f"^{setting} not found: {re.escape(value)} "):
        recipe.main([*argv, "--report_to", "none", "--bf16", "False"])


@pytest.mark.parametrize(
    "name, data, local",
    [
        ("Anthropic/hh-rlhf", True, False),
        ("EleutherAI/pythia-160m", False, False),
        ("gpt2", False, False),
        ("./model", False, True),
        ("/abs/model", False, True),
        ("~/model", False, True),
        ("a/b/c", False, True),
        ("train.json", True, True),
        ("train.json", False, False),  # a model id ending in .json is not a data file
    ],
)
def test_what_looks_like_a_local_path(tmp_path, monkeypatch, name, data, local):
    monkeypatch.chdir(tmp_path)
    assert looks_local(name, data) is local


@pytest.mark.parametrize(
    "content, named",
    [
        ("", r"(\(the file is empty\)|holds no rows)"),
        ("\n\n", r"(\(the file is empty\)|holds no rows)"),
        ('{"prompt": "hi", "chosen": "a", "rejected": "b"}\n{"prompt": "a\n', r"\(line 2 is not JSON: "),
    ],
    ids=["empty", "blank-lines", "broken-line"],
)
@pytest.mark.parametrize("command", ["ppo", "reward", "evaluate"])
def test_an_empty_or_broken_jsonl_through_the_cli_names_the_file(
    workdir, monkeypatch, capsys, command, content, named
):
    """`trl-ppomax ppo|reward|evaluate` on an empty or broken JSONL file: an error naming the file (and the bad line),
    before any model or tokenizer loads (not StopIteration / ArrowInvalid from inside datasets)."""
    for recipe in map(load_recipe, ("ppo_max", "reward_modeling")):
        for name in ("AutoModelForCausalLM", "AutoModelForSequenceClassification", "AutoTokenizer"):
            monkeypatch.setattr(recipe, name, NoLoading)
    file = "tiny/preferences.jsonl" if command == "reward" else "tiny/prompts.jsonl"
    (workdir / file).write_text(content)
    pattern = f"^{re.escape(file)} .*{named}"
    common = ["--output_dir", str(workdir / "out"), "--report_to", "none", "--bf16", "False"]
    if command == "evaluate":
        argv = ["--policy", "tiny/sft", "--baseline", "tiny/sft", "--prompts", file, "--judges", "gold"]
        assert main(["evaluate", *argv, "--output", str(workdir / "eval")]) == 2
        error = capsys.readouterr().err.splitlines()[-1]  # after the progress bars of datasets
        assert re.search(pattern, error.removeprefix("trl-ppomax evaluate: error: "))
        return
    argv = [item for pair in PPO_VALID.items() for item in pair]
    if command == "reward":
        argv = ["--model_name_or_path", "tiny/sft", "--dataset_name", file]
    with pytest.raises(ValueError, match=pattern):
        main([command, *argv, *common])


@pytest.mark.parametrize(
    "written, named",
    [
        ({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}, "train_micro_batch_size_per_gpu=8"),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}, "gradient_accumulation_steps=1"),
        ({"train_micro_batch_size_per_gpu": 4}, r"gradient_accumulation_steps=1 \(accelerate's value"),
    ],
    ids=["micro-batch", "accumulation", "accumulation-missing"],
)
def test_a_deepspeed_json_whose_batch_is_not_the_runs_is_refused(tmp_path, monkeypatch, written, named):
    """A user's DeepSpeed JSON with other batch numbers than the run's: DeepSpeed would step the optimizer after its
    own accumulation count (accelerate only warns), silently changing every update. Refused when the config is made."""
    pytest.importorskip("deepspeed")
    from transformers.integrations import unset_hf_deepspeed_config

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**written, "zero_optimization": {"stage": 2}}))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
    try:
        with pytest.raises(ValueError, match=f"The DeepSpeed config says {named}.*set them equal"):
            PPOMaxConfig(output_dir=str(tmp_path / "out"), use_cpu=True, **TINY)  # 4 per device × 2 accumulation
        run = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 8}
        path.write_text(json.dumps({**run, "zero_optimization": {"stage": 2}}))
        PPOMaxConfig(output_dir=str(tmp_path / "out"), use_cpu=True, **TINY)  # the run's numbers: accepted
    finally:
        unset_hf_deepspeed_config()


def test_the_engine_memory_benchmark_launches_accelerate_of_this_interpreter(tmp_path, monkeypatch):
    """From a virtual environment that is not activated, `accelerate` on PATH is another install or none: the
    benchmark (and tests/test_engines.py through it) runs `python -m accelerate.commands.launch` of its interpreter."""
    import subprocess
    import sys
    from types import SimpleNamespace

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "engine_memory.py"
    spec = importlib.util.spec_from_file_location("engine_memory", path)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    commands = []
    monkeypatch.setattr(
        subprocess, "run", lambda command, **_: commands.append(command) or SimpleNamespace(returncode=0)
    )
    benchmark.launch(tmp_path / "zero3.yaml", [], {}, tmp_path / "run.json", 2, 60)
    (command,) = commands
    assert command[:3] == [sys.executable, "-m", "accelerate.commands.launch"]


# ------------------------------------------------------------------------------------------------------------------
# moss recover: a truncated .bin shard is named
# ------------------------------------------------------------------------------------------------------------------
def truncate_file(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("keep", [0.5, 0.99, 0.0])
def test_a_truncated_single_bin_file_is_named(tmp_path, keep):
    torch.save({"a": torch.ones(64, 64), "b": torch.zeros(8)}, tmp_path / "pytorch_model.bin")
    truncate_file(tmp_path / "pytorch_model.bin", keep)
    with pytest.raises(ValueError, match=r"pytorch_model\.bin .*truncated or corrupt.*Re-download"):
        TensorFolder(tmp_path)


def test_an_old_format_bin_file_still_loads(tmp_path):
    torch.save({"a": torch.ones(3)}, tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    assert torch.equal(TensorFolder(tmp_path)["a"], torch.ones(3))


def test_moss_recover_names_a_truncated_diff_shard_and_writes_nothing(tmp_path):
    from test_moss_recover import Release

    release = Release(tmp_path)
    shard = sorted(release.diff_dir.glob("pytorch_model-*.bin"))[1]
    truncate_file(shard)
    with pytest.raises(ValueError, match=rf"{shard.name} .*truncated or corrupt") as error:
        recover(release.raw_dir, release.diff_dir, tmp_path / "out", "reward", check=False, progress=False)
    assert str(error.value).startswith(f"Shard {shard} ")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".tmp-*"))


def test_moss_recover_cli_reports_a_truncated_shard_in_one_line(tmp_path, capsys):
    from test_moss_recover import Release

    from trl_ppomax.cli import main

    release = Release(tmp_path)
    shard = sorted(release.diff_dir.glob("pytorch_model-*.bin"))[0]
    truncate_file(shard)
    argv = ["moss", "recover", "--raw", str(release.raw_dir), "--diff", str(release.diff_dir)]
    code = main([*argv, "--output", str(tmp_path / "out"), "--model-type", "reward", "--skip-integrity-check"])
    assert code == 2
    assert shard.name in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------------
# Reward trainer: a preference row without a chosen or rejected response
# ------------------------------------------------------------------------------------------------------------------
GOOD = {"prompt": "say hi", "chosen": " hi there", "rejected": " go away"}


@pytest.mark.parametrize(
    "bad_row, column, what",
    [
        ({**GOOD, "chosen": None}, "chosen", "no 'chosen' (None)"),
        ({**GOOD, "rejected": None}, "rejected", "no 'rejected' (None)"),
        ({**GOOD, "chosen": ""}, "chosen", "an empty 'chosen'"),
        ({**GOOD, "rejected": ""}, "rejected", "an empty 'rejected'"),
    ],
)
@pytest.mark.parametrize("split", ["train", "eval"])
def test_reward_trainer_rejects_a_row_without_a_response(tmp_path, bad_row, column, what, split):
    from test_reward_trainer import reward_args

    tokenizer, policy, _ = build_models()
    rows = [GOOD, GOOD, bad_row, GOOD]
    datasets = {"train": Dataset.from_list([GOOD] * 4), "eval": Dataset.from_list([GOOD] * 4)}
    datasets[split] = Dataset.from_list(rows)
    with pytest.raises(ValueError, match=rf"Row 2 of the {split} dataset has {re.escape(what)}") as error:
        PPOMaxRewardTrainer(
            model=policy,
            args=reward_args(tmp_path, eval_strategy="no"),
            train_dataset=datasets["train"],
            eval_dataset=datasets["eval"],
            processing_class=tokenizer,
        )
    assert column in str(error.value)


@pytest.mark.parametrize(
    "rows, message",
    [
        (
            [{"chosen_ids": [5, 6], "rejected_ids": [7]}, {"chosen_ids": [], "rejected_ids": [7]}],
            "Row 1 .* 'chosen_ids'",
        ),
        (
            [
                {"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]},
                {"chosen": [{"role": "user", "content": "a"}], "rejected": []},
            ],
            "Row 1 .* an empty 'rejected'",
        ),
    ],
    ids=["token-ids", "conversation"],
)
def test_preference_row_check_covers_ids_and_conversations(rows, message):
    from trl_ppomax.reward_modeling.trainer import check_preference_rows

    with pytest.raises(ValueError, match=message):
        check_preference_rows(Dataset.from_list(rows), "train")
    check_preference_rows(Dataset.from_list(rows[:1]), "train")  # a complete row passes


# ==================================================================================================================
# Issue 26, poor cases: what was late, raw or misleading now fails early, naming the setting, file or argument
# (the construction-time ones are in CASES, section 10)
# ==================================================================================================================
HOLD_LOCK = """
import fcntl, os, socket, sys, time
lock = open(sys.argv[1], "a+")
fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
lock.seek(0); lock.truncate(); lock.write(f"{os.getpid()} on {socket.gethostname()}\\n"); lock.flush()
print("locked", flush=True)
time.sleep(120)
"""


def test_a_second_run_in_the_same_output_dir_is_refused_naming_the_holder(tmp_path, monkeypatch):
    """Two runs at once in one output_dir: the second crashed with a raw error. Now it is refused before its first
    rollout, naming the folder and the PID holding the lock; once that process is gone, the lock is free."""
    pytest.importorskip("fcntl")
    import subprocess
    import sys

    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, "-c", HOLD_LOCK, str(out / LOCK_NAME)]
    holder = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        trainer = no_rollout(make_trainer(tmp_path), monkeypatch)
        with pytest.raises(OutputDirInUse) as caught:
            trainer.train()
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    message = str(caught.value)
    for text in (repr(str(out)), f"process {holder.pid} on ", LOCK_NAME, "another output_dir", "no file needs"):
        assert text in message, text
    with pytest.raises(AssertionError, match="a rollout started"):  # the holder is gone: the same trainer starts
        trainer.train()
    assert (out / LOCK_NAME).read_text().startswith(f"{os.getpid()} on ")
    trainer._unlock_output_dir()


def test_the_output_dir_lock_is_released_when_training_ends(tmp_path):
    fcntl = pytest.importorskip("fcntl")
    make_trainer(tmp_path, total_episodes=16).train()
    with open(tmp_path / "out" / LOCK_NAME) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if the finished run still held it


def _basic_ios(*args, **kwargs):
    raise RuntimeError("basic_ios::clear: iostream error")


def _file_write_failed(*args, **kwargs):
    raise RuntimeError(
        "[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing file data/0: file write failed"
    )


@pytest.mark.parametrize(
    ("module", "name", "fail"),
    [
        ("transformers.modeling_utils", "safe_save_file", disk_full),
        ("torch", "save", _basic_ios),
        ("torch", "save", _file_write_failed),
    ],
    ids=["ENOSPC", "basic_ios", "file-write-failed"],
)
def test_a_full_disk_is_said_with_the_folder_and_its_free_space(tmp_path, monkeypatch, module, name, fail):
    """A full disk gave "basic_ios::clear: iostream error" (data safe, but nothing said so)."""
    trainer = make_trainer(tmp_path)
    final = tmp_path / "final"
    trainer.save_model(str(final))
    before = all_bytes(final)
    monkeypatch.setattr(importlib.import_module(module), name, fail)
    with pytest.raises(DiskFullError) as caught:
        trainer.save_model(str(final))
    message = str(caught.value)
    assert message.startswith(f"The disk is full: writing {final} failed"), message
    assert re.search(r"; [\d.]+ [KMGT]?B free on the disk of ", message), message
    assert "Nothing was overwritten" in message and "save again" in message
    assert isinstance(caught.value, OSError) and caught.value.errno == errno.ENOSPC
    assert all_bytes(final) == before


def test_a_full_disk_at_a_checkpoint_stops_the_run_saying_how_to_resume(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, **RUN)
    monkeypatch.setattr(torch, "save", _basic_ios)
    with pytest.raises(DiskFullError) as caught:
        trainer.train()
    message, out = str(caught.value), tmp_path / "out"
    assert f"The disk is full: writing {out / 'checkpoint-1'} failed (RuntimeError: basic_ios::clear" in message
    assert "Training stopped at iteration 1" in message and "train(resume_from_checkpoint=True)" in message
    assert not list(out.glob("*checkpoint-1"))  # neither the checkpoint nor its temporary folder


def test_save_model_onto_a_file_is_refused_naming_it(tmp_path):
    trainer = make_trainer(tmp_path)
    file = tmp_path / "policy.safetensors"
    file.write_bytes(b"keep me")
    with pytest.raises(NotADirectoryError, match=rf"^Cannot save to {re.escape(str(file))}: it is an existing file"):
        trainer.save_model(str(file))
    with pytest.raises(NotADirectoryError, match=rf"it is under {re.escape(str(file))}, which is an existing file"):
        trainer.save_model(str(file / "policy"))
    assert file.read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "policy.safetensors"]


@pytest.mark.parametrize(("total", "rounded"), [(20, True), (32, False)])
def test_total_episodes_rounded_up_to_whole_batches_is_said(tmp_path, caplog, total, rounded):
    with caplog.at_level(logging.WARNING, logger="trl_ppomax.ppo.config"):
        trainer = make_trainer(tmp_path, total_episodes=total)
    assert trainer.args.num_total_batches == 2
    said = (
        "total_episodes=20 is not a multiple of the rollout batch, batch_size=16 (per_device_train_batch_size × "
        "gradient_accumulation_steps × num_mini_batches × processes): the run trains 2 iterations = 32 episodes, 12 "
        "more than asked. Set total_episodes to a multiple of 16 (e.g. 16 or 32)"
    )
    assert (said in caplog.text) is rounded
    assert ("not a multiple of the rollout batch" in caplog.text) is rounded


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0])
def test_reward_config_refuses_a_non_finite_or_negative_lm_loss_coef(tmp_path, value):
    from trl_ppomax import PPOMaxRewardConfig

    with pytest.raises(ValueError, match=rf"^lm_loss_coef \(β_rm\) must be a finite number ≥ 0, got {value!r}:"):
        PPOMaxRewardConfig(output_dir=str(tmp_path), lm_loss_coef=value, report_to="none")


@pytest.mark.parametrize(
    "function", [lambda p, c, **k: [0.0] * len(p), lambda a: [0.0] * len(a)], ids=["p-c-kwargs", "one-argument"]
)
def test_a_reward_function_that_cannot_be_called_is_told_how_reward_functions_are_called(function):
    """Old-style fn(p, c, **k) and fn(a) gave a raw TypeError naming a lambda (from inside the call)."""
    with pytest.raises(TypeError) as caught:
        call_reward_function(function, ["p"] * 2, ["c"] * 2, torch.device("cpu"), completion_ids=[[1], [2]])
    message = str(caught.value)
    assert re.match(r"The reward function '<lambda>'\(.+\) cannot be called: its parameters? .+ would get no", message)
    assert "f(prompts=..., completions=..., completion_ids=..., **dataset columns" in message
    assert "f(prompts, completions), and no **kwargs" in message


def test_reward_functions_callable_either_way_are_accepted_and_their_own_type_errors_kept():
    def solution_reward(prompts, completions, solution, **kwargs):
        return [0.0] * len(prompts)

    accepted = [solution_reward, lambda p, c: [0.0], lambda completions, **kw: [0.0], lambda prompts, x=1: [0.0]]
    rewards.check_reward_functions(accepted, ["prompt", "input_ids", "solution"])

    def buggy(prompts, completions):
        raise TypeError("unsupported operand type(s) inside the function")

    with pytest.raises(TypeError, match=r"^unsupported operand type"):  # its own error, not ours
        call_reward_function(buggy, ["p"], ["c"], torch.device("cpu"))


@pytest.mark.parametrize("flag", ["--raw", "--diff"])
def test_moss_recover_names_a_local_folder_that_does_not_exist(tmp_path, capsys, flag):
    """`moss recover --diff ./typo` was reported as a malformed Hub repo id."""
    paths = {"--raw": str(tmp_path), "--diff": str(tmp_path), flag: "./no/such/release"}
    argv = [item for pair in paths.items() for item in pair]
    code = main(["moss", "recover", *argv, "--output", str(tmp_path / "out"), "--model-type", "reward"])
    assert code == 2
    err = capsys.readouterr().err
    assert f"{flag} ./no/such/release: the local folder " in err and "does not exist" in err
    assert "Repo id" not in err and "repo_id" not in err


def test_the_card_of_an_in_memory_policy_links_no_base_model(tmp_path):
    """Reported as `[None](…/None)`; the trainer's card (as create_model_card and push_to_hub write it) of a policy
    built in memory must name no base model at all (a regression guard: not reproduced on the current code)."""
    trainer = make_trainer(tmp_path)
    trainer.create_model_card()
    card = (tmp_path / "out" / "README.md").read_text()
    assert "None](" not in card and "huggingface.co/None" not in card and "base_model" not in card
    assert "starting from" not in card and "on the Hugging Face stack." in card
