"""The trained critic as a model of its own: ``save_model`` writes it to ``value_model/`` with the tokenizer, it loads
with ``AutoModelForSequenceClassification``, warm-starts a run as ``value_model=``, and goes to the Hub with the
policy (checkpointing: ``ppo.checkpoint``)."""

from __future__ import annotations

import torch
from helpers import make_trainer
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from trl_ppomax.reporting import hub


def test_save_model_writes_the_trained_critic_and_a_run_warm_starts_from_it(tmp_path):
    trainer = make_trainer(tmp_path / "first")
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    folder = tmp_path / "final" / "value_model"
    critic = AutoModelForSequenceClassification.from_pretrained(folder)
    assert AutoTokenizer.from_pretrained(folder).get_vocab() == trainer.processing_class.get_vocab()
    trained = trainer.accelerator.unwrap_model(trainer.model).critic.state_dict()
    for name, weight in critic.state_dict().items():
        torch.testing.assert_close(weight, trained[name], msg=name)
    assert "value_model/model.safetensors" in hub.upload_plan(tmp_path / "final")[0]  # pushed as a subfolder

    warm = make_trainer(tmp_path / "second", value_model=str(folder))
    started = warm.accelerator.unwrap_model(warm.model).critic.state_dict()
    for name, weight in critic.state_dict().items():
        torch.testing.assert_close(started[name], weight, msg=name)


def test_no_value_model_folder_when_switched_off_or_without_a_critic(tmp_path):
    off = make_trainer(tmp_path / "off", save_value_model=False)
    off.save_model(str(tmp_path / "off-final"))
    free = make_trainer(tmp_path / "free", advantage_estimator="reinforce_pp")
    free.save_model(str(tmp_path / "free-final"))
    for final in ("off-final", "free-final"):
        assert (tmp_path / final / "model.safetensors").is_file() and not (tmp_path / final / "value_model").exists()
