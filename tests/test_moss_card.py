"""The model card ``trl-ppomax push`` writes (``trl_ppomax.moss.card``): a generic card for a model trained here, the
MOSS-RLHF card drawn from the conversion record, and explicit arguments over that record."""

import json
import shutil

import pytest

from trl_ppomax.moss.card import moss_model_card
from trl_ppomax.moss.recovery import CONVERSION_INFO


def test_generic_card_for_trained_model(saved):
    card = moss_model_card(saved / "sft", "me/ppo-max-policy")
    text = str(card)
    assert "agpl" not in text.lower() and card.data.license is None
    assert card.data.pipeline_tag == "text-generation"
    assert {"trl-ppomax", "ppo-max", "rlhf", "text-generation"} <= set(card.data.tags)
    assert "moss-rlhf" not in card.data.tags
    assert "AutoModelForCausalLM" in text and "2307.04964" in text and "No licence is set" in text

    card = moss_model_card(saved / "reward", "me/rm")
    assert card.data.pipeline_tag == "text-classification" and "reward-model" in card.data.tags
    assert "agpl" not in str(card).lower() and "PPOMaxTrainer" in str(card)


def test_explicit_arguments_override_conversion_info(saved, tmp_path):
    folder = tmp_path / "sft"
    shutil.copytree(saved / "sft", folder)
    (folder / CONVERSION_INFO).write_text(json.dumps({"model_type": "reward", "lang": "en"}))
    card = moss_model_card(folder, "me/m")
    assert card.data.base_model == "fnlp/moss-rlhf-reward-model-7B-en"

    card = moss_model_card(folder, "me/m", model_type="sft")
    assert card.data.base_model == "fnlp/moss-rlhf-sft-model-7B-en"
    assert card.data.pipeline_tag == "text-generation" and card.data.license == "agpl-3.0"
    assert "--model-type sft" in str(card) and "AutoModelForCausalLM" in str(card)

    card = moss_model_card(folder, "me/m", model_type="reward", lang="zh", base_model="someone/base")
    assert card.data.base_model == "someone/base" and card.data.language == ["zh"]
    assert "<|Human|>" in str(card) and "<|MOSS|>" in str(card)

    with pytest.raises(ValueError, match="Unknown model type"):
        moss_model_card(folder, "me/m", model_type="critic")
    (folder / CONVERSION_INFO).write_text("{not json")
    with pytest.raises(ValueError, match=CONVERSION_INFO):
        moss_model_card(folder, "me/m")
