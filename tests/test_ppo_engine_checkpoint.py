"""Engine-only saves (``trl_ppomax.ppo.engine_checkpoint``), without DeepSpeed: which engine saves its sharded
checkpoint only, the folder a consolidation accepts (and what it names when it refuses one), the earlier engine
folders a ``save_model`` drops, the configs written beside the engine checkpoint, and the advice the warnings give.
The consolidation itself, of a real ZeRO-3 run's checkpoint, is in ``test_engines.py``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from transformers import AutoConfig

from trl_ppomax.ppo.engine_checkpoint import (
    GATHER_ON_SAVE,
    check_engine_folder,
    drop_older_engine_folders,
    engine_checkpoint_advice,
    save_configs,
    saves_engine_checkpoint_only,
)
from trl_ppomax.toyworld.tiny import build_models


def engine(stage: int, gather: bool):
    """A stand-in for a DeepSpeed engine: its ZeRO stage and whether it gathers the weights on save."""
    return SimpleNamespace(
        zero_optimization_stage=lambda: stage, zero_gather_16bit_weights_on_model_save=lambda: gather
    )


def test_only_zero3_without_gathering_saves_the_engine_checkpoint_only():
    assert saves_engine_checkpoint_only(engine(3, gather=False))
    assert not saves_engine_checkpoint_only(engine(3, gather=True))
    assert not saves_engine_checkpoint_only(engine(2, gather=False))


def test_a_folder_to_consolidate_is_refused_naming_what_it_lacks(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist: pass a checkpoint-N or save_model folder"):
        check_engine_folder(tmp_path / "absent")
    with pytest.raises(ValueError, match=r"has no config\.json: pass a checkpoint-N or save_model folder"):
        check_engine_folder(tmp_path)
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"has no config\.json \(a PEFT policy"):
        check_engine_folder(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"holds no DeepSpeed engine checkpoint.*nothing to consolidate\.$"):
        check_engine_folder(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"its weights are already plain, from_pretrained loads it"):
        check_engine_folder(tmp_path)
    (tmp_path / "latest").write_text("global_step4")
    assert check_engine_folder(str(tmp_path)) == tmp_path


def test_a_save_model_drops_the_engine_folders_of_earlier_saves_and_keeps_the_latest(tmp_path):
    for step in (2, 4, 6):
        (tmp_path / f"global_step{step}").mkdir()
    assert drop_older_engine_folders(tmp_path) is None  # no `latest`: nothing is known to be stale
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step2", "global_step4", "global_step6"]
    (tmp_path / "latest").write_text("global_step4\n")
    assert drop_older_engine_folders(tmp_path) == "global_step4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step4", "latest"]


def test_the_configs_beside_an_engine_checkpoint_load_as_the_models_they_were(tmp_path):
    tokenizer, policy, critic = build_models()
    wrapper = SimpleNamespace(policy=policy, critic=critic)
    save_configs(wrapper, str(tmp_path), "value_model", tokenizer)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == [type(policy).__name__]
    assert (tmp_path / "generation_config.json").is_file()
    value = AutoConfig.from_pretrained(tmp_path / "value_model")
    assert value.architectures == [type(critic).__name__] and value.num_labels == 1
    assert (tmp_path / "value_model" / "tokenizer_config.json").is_file()  # a model of its own: its tokenizer
    assert not list(tmp_path.rglob("*.safetensors"))  # the weights are the engine's
    save_configs(wrapper, str(tmp_path / "checkpoint"), "critic", tokenizer)
    assert (tmp_path / "checkpoint" / "critic" / "config.json").is_file()
    assert not (tmp_path / "checkpoint" / "critic" / "tokenizer_config.json").exists()


def test_the_advice_names_the_folder_and_both_ways_out():
    advice = engine_checkpoint_advice("out/checkpoint-4")
    assert "`trl-ppomax consolidate out/checkpoint-4`" in advice
    assert "consolidate_engine_checkpoint('out/checkpoint-4')" in advice
    assert GATHER_ON_SAVE in advice and "zero3_save_16bit_model: true" in advice
