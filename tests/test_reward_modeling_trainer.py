"""PPOMaxRewardTrainer: imitation loss, plain saved artefact, reward statistics, trl parity, bad input."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from helpers import SMOKE
from transformers import AutoModelForSequenceClassification, pipeline
from trl import RewardConfig, RewardTrainer

from trl_ppomax import PPOMaxConfig, PPOMaxRewardConfig, PPOMaxRewardTrainer, PPOMaxTrainer
from trl_ppomax.base import core
from trl_ppomax.reward_modeling.trainer import HISTOGRAM_NAME, with_lm_head
from trl_ppomax.rewards.stats import fold_reward_stats, reward_statistics
from trl_ppomax.toyworld.tiny import WORDS, build_models, prompt_texts

FILLER = [w for w in WORDS if w not in ("please", "thanks")]


def preference_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """A clear rule: the chosen response is polite ("please … thanks"), the rejected one is not."""
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(rng.choice(FILLER) for _ in range(k))

    return [{"prompt": words(3), "chosen": f" please {words(3)} thanks", "rejected": f" {words(5)}"} for _ in range(n)]


def reward_args(tmp_path, **overrides) -> PPOMaxRewardConfig:
    defaults = dict(
        output_dir=str(tmp_path / "rm"),
        per_device_train_batch_size=8,
        num_train_epochs=3,
        learning_rate=1e-3,
        report_to="none",
        logging_steps=1,
        gradient_checkpointing=False,
        bf16=False,
        save_strategy="no",
        eval_strategy="no",
        max_length=64,
        seed=0,
    )
    return PPOMaxRewardConfig(**{**defaults, **overrides})


def train_reward_model(tmp_path, lm_loss_coef=1.0, model=None, **overrides):
    tokenizer, policy, _ = build_models()
    data = Dataset.from_list(preference_rows(64))
    trainer = PPOMaxRewardTrainer(
        model=policy if model is None else model,
        args=reward_args(tmp_path, lm_loss_coef=lm_loss_coef, **overrides),
        train_dataset=data.select(range(48)),
        eval_dataset=data.select(range(48, 64)),
        processing_class=tokenizer,
    )
    trainer.train()
    return trainer


def chosen_perplexity(trainer) -> float:
    """Perplexity of the LM head on the chosen responses of the evaluation set."""
    model = trainer.model.eval()
    batch = trainer.data_collator([trainer.eval_dataset[i] for i in range(len(trainer.eval_dataset))])
    with torch.no_grad():
        hidden = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True
        ).hidden_states[-1]
        half = len(batch["chosen_response_mask"])
        loss, _ = core.lm_loss(model.lm_head(hidden[:half]), batch["input_ids"][:half], batch["chosen_response_mask"])
    return loss.exp().item()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_reward_model(tmp_path_factory.mktemp("reward"), lm_loss_coef=1.0)


def test_learns_the_rule_and_logs_metrics(trained):
    evals = [e for e in trained.state.log_history if "eval_accuracy" in e]
    assert evals[-1]["eval_accuracy"] >= 0.9  # well above chance (0.5)
    logged = {k for e in trained.state.log_history for k in e}
    for name in ("accuracy", "margin", "lm_loss", "lm_token_accuracy", "chosen_reward", "rejected_reward"):
        assert name in logged, name
    assert (Path(trained.args.output_dir) / HISTOGRAM_NAME).stat().st_size > 0


@pytest.mark.slow  # seconds (the README's command stays under 4 minutes; .ci/run runs it)
def test_imitation_loss_lowers_chosen_perplexity(tmp_path):
    perplexity = {}
    for coef in (0.0, 1.0):
        _, policy, _ = build_models()
        trainer = train_reward_model(tmp_path / str(coef), lm_loss_coef=coef, model=with_lm_head(policy))
        perplexity[coef] = chosen_perplexity(trainer)
    assert perplexity[1.0] < 0.9 * perplexity[0.0]


def test_saved_model_is_a_plain_sequence_classifier_with_the_same_scores(trained, tmp_path):
    trained.save_model(str(tmp_path / "saved"))
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "saved").eval()
    assert type(loaded).__name__ == "LlamaForSequenceClassification"
    assert loaded.config.num_labels == 1 and loaded.config.pad_token_id == trained.processing_class.pad_token_id
    assert not any("lm_head" in name for name, _ in loaded.named_parameters())
    batch = trained.data_collator([trained.eval_dataset[i] for i in range(8)])
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, trained.model.eval()(**inputs).logits)
    scorer = pipeline("text-classification", model=str(tmp_path / "saved"), function_to_apply="none")
    assert isinstance(scorer("hello please tell me thanks")[0]["score"], float)


def test_reward_statistics_are_stored_and_correct(trained, tmp_path):
    trained.save_model(str(tmp_path / "saved"))
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "saved").eval()
    batch = trained.data_collator([trained.eval_dataset[i] for i in range(len(trained.eval_dataset))])
    with torch.no_grad():
        scores = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
    assert loaded.config.reward_stats_count == len(scores) == 32
    assert loaded.config.reward_mean == pytest.approx(scores.mean().item(), abs=1e-5)
    assert loaded.config.reward_std == pytest.approx(scores.std().item(), abs=1e-5)


def test_folding_gives_unit_std(tmp_path):
    trainer = train_reward_model(tmp_path, fold_reward_stats=True, num_train_epochs=1)
    batch = trainer.data_collator([trainer.eval_dataset[i] for i in range(len(trainer.eval_dataset))])
    with torch.no_grad():
        scores = trainer.model.eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    scores = scores.logits.squeeze(-1)
    assert scores.std().item() == pytest.approx(1.0, abs=1e-4)
    # Llama's score head has no bias: the mean is scaled, not removed, and the config says so.
    assert trainer.model.config.reward_std == 1.0
    assert trainer.model.config.reward_mean == pytest.approx(scores.mean().item(), abs=1e-4)


def test_folding_with_a_bias_gives_zero_mean_unit_std():
    torch.manual_seed(0)
    head = torch.nn.Linear(4, 1)
    hidden = torch.randn(100, 4)
    before = head(hidden).squeeze(-1).detach()
    stats = reward_statistics(torch.stack([before[:50], before[50:]], dim=1))
    folded = fold_reward_stats(head, stats)
    after = head(hidden).squeeze(-1).detach()
    assert after.mean().item() == pytest.approx(0.0, abs=1e-5)
    assert after.std().item() == pytest.approx(1.0, abs=1e-5)
    assert (folded["reward_mean"], folded["reward_std"]) == (0.0, 1.0)


def test_lm_loss_coef_zero_matches_trl_reward_trainer(tmp_path):
    tokenizer, _, reward_model = build_models()
    data = Dataset.from_list(preference_rows(32))
    common = dict(
        per_device_train_batch_size=8,
        num_train_epochs=1,
        learning_rate=1e-3,
        report_to="none",
        gradient_checkpointing=False,
        bf16=False,
        save_strategy="no",
        max_length=64,
        seed=0,
    )
    ours = PPOMaxRewardTrainer(
        model=copy.deepcopy(reward_model),
        args=PPOMaxRewardConfig(output_dir=str(tmp_path / "a"), lm_loss_coef=0.0, reward_histogram=False, **common),
        train_dataset=data,
        processing_class=tokenizer,
    )
    theirs = RewardTrainer(
        model=copy.deepcopy(reward_model),
        args=RewardConfig(output_dir=str(tmp_path / "b"), **common),
        train_dataset=data,
        processing_class=copy.deepcopy(tokenizer),
    )
    ours.train()
    theirs.train()
    for (name, a), b in zip(ours.model.named_parameters(), theirs.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_trained_reward_model_serves_ppo_as_reward_and_critic(trained, tmp_path):
    trained.save_model(str(tmp_path / "saved"))
    reward_model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "saved")
    tokenizer, policy, _ = build_models()
    ppo = PPOMaxTrainer(
        args=PPOMaxConfig(output_dir=str(tmp_path / "ppo"), **SMOKE),
        processing_class=tokenizer,
        model=policy,
        ref_model=None,
        reward_model=reward_model,
        train_dataset=Dataset.from_dict({"prompt": prompt_texts(8)}),
        value_model=None,
    )
    # The running reward moments start from the statistics the reward trainer stored.
    assert ppo.ppo_state.running_reward.count == reward_model.config.reward_stats_count
    assert ppo.ppo_state.running_reward.mean == pytest.approx(reward_model.config.reward_mean)
    assert ppo.ppo_state.running_reward.std == pytest.approx(reward_model.config.reward_std)
    before = {n: p.clone() for n, p in ppo.model.critic.named_parameters()}
    ppo.train()
    assert any(not torch.equal(before[n], p) for n, p in ppo.model.critic.named_parameters())
    assert ppo.ppo_state.running_reward.count == reward_model.config.reward_stats_count + 8  # 2 iterations × 4


def test_peft_reward_model_with_imitation_loss(tmp_path):
    from peft import LoraConfig

    tokenizer, policy, _ = build_models()
    data = Dataset.from_list(preference_rows(16))
    trainer = PPOMaxRewardTrainer(
        model=policy,
        args=reward_args(tmp_path, num_train_epochs=1),
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS"),
    )
    trainer.train()
    assert any("lm_loss" in entry for entry in trainer.state.log_history)


def test_bad_inputs(tmp_path):
    tokenizer, policy, reward_model = build_models()
    with pytest.raises(ValueError, match="'chosen' and 'rejected' columns"):
        PPOMaxRewardTrainer(
            model=policy,
            args=reward_args(tmp_path),
            train_dataset=Dataset.from_dict({"prompt": ["hi"], "answer": ["hello"]}),
            processing_class=tokenizer,
        )
    with pytest.raises(ValueError, match="lm_loss_coef"):
        reward_args(tmp_path, lm_loss_coef=-1.0)
    with pytest.raises(ValueError, match="needs a model with a language-model head"):
        PPOMaxRewardTrainer(
            model=reward_model,
            args=reward_args(tmp_path),
            train_dataset=Dataset.from_list(preference_rows(8)),
            processing_class=tokenizer,
        )


def test_margin_histogram_leaves_the_matplotlib_backend_alone(tmp_path, monkeypatch):
    import matplotlib

    from trl_ppomax.reward_modeling.trainer import save_margin_histogram

    def refuse(*args, **kwargs):
        raise AssertionError("matplotlib.use() changes a notebook user's backend")

    monkeypatch.setattr(matplotlib, "use", refuse)
    path = tmp_path / "sub" / HISTOGRAM_NAME
    save_margin_histogram(torch.linspace(-1.0, 2.0, 40), str(path))
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
