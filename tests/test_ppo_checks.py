"""The constructor's refusals and what they let through (``trl_ppomax.ppo.checks``, ``PPOMaxConfig``): every bad
setting or input a new user hits fails before the first rollout, naming the setting (or file) and the fix; the
everyday setups beside each still train. The set-up's own tests are in ``test_ppo_setup.py``, the reward functions'
refusals in ``test_rewards_functions.py``."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset, DatasetDict, IterableDataset
from helpers import CONTEXT, TINY, VOCAB
from transformers import AutoModelForSequenceClassification
from user_setups import build_llama_style_tokenizer

from trl_ppomax import PPOMaxConfig, PPOMaxTrainer, rewards
from trl_ppomax.data import tokenize_prompt
from trl_ppomax.toyworld.tiny import (
    build_models,
    llama_config,
    prompt_texts,
)


# ==================================================================================================================
# Bad input and settings: each fails before the first rollout, naming the setting and the fix.
# ==================================================================================================================
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


def with_vocab(which: int, size: int):
    """One of :func:`build_models`' models (1: the causal LM, 2: the scorer) resized to ``size`` embedding rows."""

    def build(_):
        model = build_models()[which]
        model.resize_token_embeddings(size)
        return model

    return lazy(build)


def scorer_with_vocab(size: int):
    return with_vocab(2, size)


def causal_with_vocab(size: int):
    return with_vocab(1, size)


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


def test_extra_critic_epochs_are_refused_under_deepspeed_and_the_everyday_setups_pass(tmp_path):
    from trl_ppomax import PPOMaxConfig
    from trl_ppomax.ppo import checks

    def config(**settings):
        return PPOMaxConfig(output_dir=str(tmp_path), report_to="none", **settings)

    with pytest.raises(ValueError, match="set num_critic_epochs=None, or train without DeepSpeed"):
        checks.check_deepspeed_epochs(config(num_ppo_epochs=2, num_critic_epochs=4))
    for everyday in (
        config(),
        config(num_ppo_epochs=2, num_critic_epochs=2),
        config(advantage_estimator="reinforce_pp"),
    ):
        checks.check_deepspeed_epochs(everyday)
