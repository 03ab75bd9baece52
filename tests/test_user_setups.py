"""The trainer and the commands on the folders users really have (:mod:`user_setups`): written by ``trl.SFTTrainer``,
``trl.RewardTrainer`` and ``PPOMaxRewardTrainer``, tokenizers without ``[PAD]`` (added as TRL's PPO example does, or
pad = eos as the TRL trainers leave it), embeddings padded past the tokenizer or exactly its size.

Every refusal about tokenizers and vocabularies is tested both ways here: the everyday setups pass, the real
mismatches (another vocabulary, an id the model cannot read) are refused, naming the argument the user passed."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset, load_dataset
from helpers import SMOKE, changed, snapshot
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from user_setups import build_llama_style_tokenizer, pythia_style_tokenizer, write_plain_folders

from trl_ppomax import PPOMaxConfig, PPOMaxTrainer
from trl_ppomax.cli import ppo, reward
from trl_ppomax.ppo.checks import tokenizer_mismatch
from trl_ppomax.toyworld.tiny import ARCHITECTURES

ARCHS = ARCHITECTURES


def trl_example_tokenizer(folder):
    """The policy's tokenizer as TRL's PPO example builds it: left padding, ``[PAD]`` added."""
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    return tokenizer


def build(paths, tmp_path, tokenizer=None, **kwargs) -> PPOMaxTrainer:
    """A trainer on the user's folders ``paths``, models loaded as a user loads them; ``kwargs`` override the
    constructor's arguments (``reward_model``, ``value_model``, ``ref_model``, ...)."""
    tokenizer = tokenizer or trl_example_tokenizer(paths["sft"])
    arguments = dict(
        model=AutoModelForCausalLM.from_pretrained(paths["sft"]),
        ref_model=None,
        reward_model=AutoModelForSequenceClassification.from_pretrained(paths["reward"], num_labels=1),
        value_model=None,
        train_dataset=load_dataset(paths["prompts"], split="train"),
    )
    return PPOMaxTrainer(
        args=PPOMaxConfig(output_dir=str(tmp_path / "out"), **SMOKE),
        processing_class=tokenizer,
        **{**arguments, **kwargs},
    )


def trains(trainer: PPOMaxTrainer) -> None:
    """Training moves the policy and logs the PPO metrics."""
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    before = snapshot(policy)
    trainer.train()
    assert changed(before, policy) > 0
    logged = [log for log in trainer.state.log_history if "objective/kl" in log]
    assert len(logged) == 2 and all(torch.isfinite(torch.tensor(log["objective/scores"])) for log in logged)


# ----------------------------------------------------------------------------------------------------------------
# The tokenizer identity: extensions are fine, other vocabularies are not
# ----------------------------------------------------------------------------------------------------------------
def test_an_added_pad_token_is_an_extension_either_way(user_folders):
    saved = AutoTokenizer.from_pretrained(user_folders["gpt_neox"]["sft"])
    extended = trl_example_tokenizer(user_folders["gpt_neox"]["sft"])
    assert len(extended) == len(saved) + 1
    assert tokenizer_mismatch(saved, extended) is None  # the model's copy lacks [PAD]
    assert tokenizer_mismatch(extended, saved) is None  # the model's copy has it, the policy's does not
    other_pad = AutoTokenizer.from_pretrained(user_folders["gpt_neox"]["sft"])
    other_pad.add_special_tokens({"pad_token": "<pad>"})  # another name for the same added id
    assert tokenizer_mismatch(other_pad, extended) is None


def test_another_vocabulary_is_a_mismatch():
    problem = tokenizer_mismatch(build_llama_style_tokenizer(), pythia_style_tokenizer())
    assert problem and "stand for other tokens" in problem


@pytest.mark.parametrize("arch", ARCHS)
def test_trl_example_setup_trains_with_the_policys_copy_as_reference(user_folders, tmp_path, arch):
    """TRL's example tokenizer ([PAD] added) on SFTTrainer / RewardTrainer folders, ref_model=None and
    value_model=None as in the README's quick start."""
    trains(build(user_folders[arch], tmp_path))


def test_trl_example_setup_with_every_model_passed(user_folders, tmp_path):
    """As TRL's example passes them: the reference and the critic loaded from their folders."""
    paths = user_folders["gpt_neox"]
    trainer = build(
        paths,
        tmp_path,
        ref_model=AutoModelForCausalLM.from_pretrained(paths["sft"]),
        value_model=AutoModelForSequenceClassification.from_pretrained(paths["reward"], num_labels=1),
    )
    trains(trainer)


def test_ppomax_reward_folder_and_a_reward_list_mixing_a_function_and_a_model(user_folders, tmp_path):
    paths = user_folders["llama"]
    rm = AutoModelForSequenceClassification.from_pretrained(paths["ppomax_reward"], num_labels=1)

    def length(completions, **_):
        return [len(c) / 10 for c in completions]

    trains(build(paths, tmp_path, reward_model=[length, rm]))


def test_pad_equal_to_eos_as_the_trl_trainers_leave_it(user_folders, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(user_folders["llama"]["sft"], padding_side="left")
    assert tokenizer.pad_token == tokenizer.eos_token  # SFTTrainer saved it so
    trains(build(user_folders["llama"], tmp_path, tokenizer=tokenizer))


def test_a_reward_model_with_another_vocabulary_is_refused_and_accepted_with_its_tokenizer(user_folders, tmp_path):
    paths, foreign = user_folders["gpt_neox"], user_folders["llama"]["reward"]
    rm = AutoModelForSequenceClassification.from_pretrained(foreign, num_labels=1)
    with pytest.raises(ValueError, match=r"reward_model comes with another tokenizer .* stand for other tokens"):
        build(paths, tmp_path, reward_model=rm)
    value = AutoModelForSequenceClassification.from_pretrained(paths["reward"], num_labels=1)
    trainer = build(
        paths,
        tmp_path,
        reward_model=[rm],
        reward_processing_classes=[AutoTokenizer.from_pretrained(foreign)],
        value_model=value,
    )
    trains(trainer)


def test_exact_embeddings_refuse_an_added_pad_until_resized(tmp_path):
    """llama's own shape: [PAD] gets an id no model has a row for. Refused, blaming the policy (not the reference the
    user never passed); once every model is resized as the message says, it trains."""
    paths = write_plain_folders(tmp_path / "exact", "llama", embedding="exact")
    tokenizer = trl_example_tokenizer(paths["sft"])
    with pytest.raises(
        ValueError, match=r"pad token id \d+ is outside the policy's embedding.*resize_token_embeddings"
    ):
        build(paths, tmp_path, tokenizer=tokenizer)
    policy = AutoModelForCausalLM.from_pretrained(paths["sft"])
    policy.resize_token_embeddings(len(tokenizer))
    with pytest.raises(ValueError, match=r"^reward_model has an embedding for \d+ token ids, fewer than"):
        build(paths, tmp_path, tokenizer=tokenizer, model=policy)  # the reward model (and the critic) not resized
    rm = AutoModelForSequenceClassification.from_pretrained(paths["reward"], num_labels=1)
    rm.resize_token_embeddings(len(tokenizer))
    trains(build(paths, tmp_path, tokenizer=tokenizer, model=policy, reward_model=rm))


# ----------------------------------------------------------------------------------------------------------------
# The commands on the same folders
# ----------------------------------------------------------------------------------------------------------------
def ppo_command(paths, output_dir, *extra) -> PPOMaxTrainer:
    argv = [
        "--sft_model_path", paths["sft"], "--reward_model_path", paths["reward"], "--dataset_name", paths["prompts"],
        "--output_dir", str(output_dir), "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
        "--total_episodes", "8", "--response_length", "6", "--num_ppo_epochs", "1", "--critic_warmup_steps", "0",
        "--learning_rate", "1e-3", "--report_to", "none", "--save_strategy", "no", "--num_sample_generations", "0",
        "--eval_strategy", "no", "--logging_steps", "1", "--disable_tqdm", "True", "--bf16", "False", *extra,
    ]  # fmt: skip
    return ppo.main(argv)


@pytest.mark.parametrize("reward_folder", ["reward", "ppomax_reward"])
def test_ppo_command_on_trl_folders(user_folders, tmp_path, monkeypatch, reward_folder):
    """The reward folder's model and a function of the user's own module beside them (``--reward_funcs``)."""
    paths = {**user_folders["gpt_neox"], "reward": user_folders["gpt_neox"][reward_folder]}
    (tmp_path / "my_rewards.py").write_text(
        "def brevity(completions, **kwargs):\n    return [-len(c) for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", list(__import__("sys").path))  # the folder added to it is undone
    trainer = ppo_command(paths, tmp_path / "out", "--reward_funcs", "my_rewards.brevity")
    assert trainer.reward_sources.sources[1].__name__ == "brevity"
    assert trainer.state.global_step == 2
    assert any("objective/kl" in log for log in trainer.state.log_history)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    sft = AutoModelForCausalLM.from_pretrained(paths["sft"]).state_dict()
    assert any(not torch.equal(saved[name], sft[name]) for name in sft)


def test_ppo_command_on_a_folder_without_a_pad_token(tmp_path):
    """A pythia-style folder saved without any pad token: padded with eos, as the TRL trainers do."""
    paths = write_plain_folders(tmp_path / "plain", "gpt_neox", embedding="padded", pad=None)
    assert AutoTokenizer.from_pretrained(paths["sft"]).pad_token is None
    trainer = ppo_command(paths, tmp_path / "out")
    assert trainer.processing_class.pad_token == trainer.processing_class.eos_token
    assert trainer.state.global_step == 2


def test_reward_command_on_an_sft_trainer_folder(user_folders, tmp_path):
    rows = tmp_path / "preferences.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in Dataset.from_list(_preferences()).to_list()))
    reward.main(
        ["--model_name_or_path", user_folders["llama"]["sft"], "--dataset_name", str(rows), "--output_dir",
         str(tmp_path / "rm"), "--max_steps", "2", "--per_device_train_batch_size", "4", "--report_to", "none",
         "--save_strategy", "no", "--eval_strategy", "no", "--bf16", "False", "--disable_tqdm", "True"]
    )  # fmt: skip
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    assert model.config.num_labels == 1 and isinstance(model.config.reward_std, float)


def _preferences():
    from trl_ppomax.toyworld.tiny import preference_rows

    return preference_rows(16)
