"""The trainer's set-up (``trl_ppomax.ppo.setup``): models given as paths loaded, agreeing prompt and input_ids columns
kept, a prompt budget of one token accepted; nothing generated."""

from __future__ import annotations

from datasets import Dataset
from helpers import CONTEXT, TINY, VOCAB, make_trainer

from trl_ppomax import PPOMaxConfig, PPOMaxTrainer
from trl_ppomax.data import tokenize_prompt
from trl_ppomax.toyworld.tiny import (
    build_models,
    prompt_texts,
    save_tiny_models,
)


def test_a_prompt_budget_of_one_token_is_accepted(tmp_path, rollout_forbidden):
    one_token = Dataset.from_dict({"input_ids": [[5 + i % 10] for i in range(32)]})
    trainer = make_trainer(tmp_path, response_length=CONTEXT - 1, dataset=one_token)
    assert max(len(ids) for ids in trainer.train_dataset["input_ids"]) == 1


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
