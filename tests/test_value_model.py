"""The trained critic as a model of its own: ``save_model`` writes it to ``value_model/`` with the tokenizer, it loads
with ``AutoModelForSequenceClassification``, warm-starts a run as ``value_model=``, and goes to the Hub with the
policy (checkpointing: ``ppo.checkpoint``)."""

from __future__ import annotations

import pytest
import torch
from helpers import SMOKE, make_trainer
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


# ------------------------------------------------------------------------------------------------------------------
# A stale value_model/ (issue 43, bad case 7): a save that writes no critic into a folder holding an earlier save's
# value_model/ removed it with the merge, saying so; the new policy is always written.
# ------------------------------------------------------------------------------------------------------------------
def moved(trainer, model: str):
    """``trainer`` with its ``model`` ("policy" or "critic") weights moved, so that they differ from an earlier
    run's."""
    with torch.no_grad():
        for parameter in getattr(trainer.accelerator.unwrap_model(trainer.model), model).parameters():
            parameter.add_(0.01)
    return trainer


def assert_policy_saved(trainer, folder) -> None:
    """``folder`` holds ``trainer``'s policy (the new one, whole)."""
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    for name, weight in trainer.accelerator.unwrap_model(trainer.model).policy.state_dict().items():
        torch.testing.assert_close(saved[name], weight, msg=name)


@pytest.fixture
def saved_with_critic(tmp_path):
    """A folder holding an earlier run's policy and its critic in value_model/."""
    earlier = make_trainer(tmp_path / "earlier")
    earlier.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "value_model" / "model.safetensors").is_file()
    return tmp_path / "final"


@pytest.mark.parametrize(
    "settings, why",
    [
        (dict(save_value_model=False), "save_value_model=False"),
        (dict(advantage_estimator="rloo", num_samples_per_prompt=2), "this run has no critic"),
    ],
    ids=["save_value_model-off", "critic-free"],
)
def test_a_save_without_a_critic_removes_the_earlier_value_model(tmp_path, saved_with_critic, caplog, settings, why):
    trainer = moved(make_trainer(tmp_path / "new", **settings), "policy")
    with caplog.at_level("WARNING", logger="trl_ppomax.ppo.checkpoint"):
        trainer.save_model(str(saved_with_critic))
    assert not (saved_with_critic / "value_model").exists()
    assert_policy_saved(trainer, saved_with_critic)
    assert "save_model: removing" in caplog.text and "value_model" in caplog.text and why in caplog.text
    assert not list(saved_with_critic.glob(".tmp-*")) and not list(saved_with_critic.glob(".old-*"))


@pytest.mark.slow  # seconds (the README's command stays under 4 minutes; .ci/run runs it)
def test_a_rerun_with_overwrite_output_dir_leaves_no_critic_of_the_first_run(tmp_path):
    """The first run saves its critic into output_dir; a critic-free rerun there (overwrite_output_dir) saves none."""
    out = tmp_path / "out"
    first = make_trainer(tmp_path, base=SMOKE, save_strategy="steps", save_steps=1)
    first.train()
    first.save_model()
    assert (out / "value_model" / "config.json").is_file() and (out / "checkpoint-1").is_dir()
    rerun = make_trainer(
        tmp_path, base=SMOKE, save_strategy="steps", save_steps=1, overwrite_output_dir=True, save_value_model=False
    )
    rerun.train()
    rerun.save_model()
    assert not (out / "value_model").exists()
    assert_policy_saved(rerun, out)


def test_a_save_with_a_critic_replaces_the_earlier_value_model(tmp_path, saved_with_critic, caplog):
    trainer = moved(moved(make_trainer(tmp_path / "new"), "critic"), "policy")
    with caplog.at_level("WARNING", logger="trl_ppomax.ppo.checkpoint"):
        trainer.save_model(str(saved_with_critic))
    critic = AutoModelForSequenceClassification.from_pretrained(saved_with_critic / "value_model")
    for name, weight in trainer.accelerator.unwrap_model(trainer.model).critic.state_dict().items():
        torch.testing.assert_close(critic.state_dict()[name], weight, msg=name)
    assert_policy_saved(trainer, saved_with_critic)
    assert "save_model: removing" not in caplog.text


# ------------------------------------------------------------------------------------------------------------------
# critic/ metrics only where there is a critic (issue 43, a poor case: critic-free runs logged critic/lr, the policy's)
# ------------------------------------------------------------------------------------------------------------------
#: What a critic-free estimator still logs under critic/: its returns and raw advantages (verl logs
#: critic/returns and critic/advantages for GRPO too); nothing about a critic model.
ESTIMATOR_STATISTICS = {"critic/returns", "critic/advantages_raw"}


def logged_names(trainer) -> set[str]:
    return {name for entry in trainer.state.log_history for name in entry}


def test_a_critic_free_run_logs_no_critic_metrics_and_a_gae_run_logs_critic_lr(tmp_path):
    free = make_trainer(tmp_path / "free", base=SMOKE, advantage_estimator="rloo", num_samples_per_prompt=2)
    free.train()
    names = logged_names(free)
    assert "lr" in names and {name for name in names if name.startswith("critic/")} == ESTIMATOR_STATISTICS
    gae = make_trainer(tmp_path / "gae", base=SMOKE, critic_learning_rate=3e-3)
    gae.train()
    assert {"lr", "critic/lr", "critic/values", "critic/grad_norm", *ESTIMATOR_STATISTICS} <= logged_names(gae)
    logged = next(entry for entry in gae.state.log_history if "critic/lr" in entry)
    assert logged["critic/lr"] != logged["lr"]  # the critic's own rate, not the policy's


# ------------------------------------------------------------------------------------------------------------------
# value_model= a policy folder (issue 43, a poor case): its score head would be random with only transformers' load
# report; a warning names the folder and the reward model (the paper's start), and the everyday folders load quietly.
# ------------------------------------------------------------------------------------------------------------------
@pytest.fixture
def tiny_folders(tmp_path):
    from trl_ppomax.toyworld.tiny import save_tiny_models

    return save_tiny_models(tmp_path / "tiny")


def test_value_model_a_policy_folder_warns_that_the_value_head_is_new(tmp_path, tiny_folders, caplog):
    with caplog.at_level("WARNING", logger="trl_ppomax.models"):
        trainer = make_trainer(tmp_path, value_model=tiny_folders["sft"])
    assert f"value_model={tiny_folders['sft']!r} holds no value head (score.weight newly initialised" in caplog.text
    assert "the reward model's folder" in caplog.text and "value_model=None" in caplog.text
    assert trainer.accelerator.unwrap_model(trainer.model).critic is not None  # a deliberate choice still runs


def test_value_model_a_reward_or_saved_value_model_folder_loads_without_the_warning(tmp_path, tiny_folders, caplog):
    trainer = make_trainer(tmp_path / "first")
    trainer.save_model(str(tmp_path / "final"))
    with caplog.at_level("WARNING", logger="trl_ppomax.models"):
        for folder in (tiny_folders["reward"], str(tmp_path / "final" / "value_model")):
            make_trainer(tmp_path / "run", value_model=folder)
        make_trainer(tmp_path / "default")  # value_model=None: a copy of the reward model
    assert "holds no value head" not in caplog.text
