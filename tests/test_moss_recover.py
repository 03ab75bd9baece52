"""Recovering and converting the MOSS-RLHF release, on tiny synthetic checkpoints in the release's layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from helpers import SMOKE
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
)

from trl_ppomax import PPOMaxConfig, PPOMaxTrainer
from trl_ppomax.moss.recovery import CONVERSION_INFO, IntegrityError, TensorFolder, recover
from trl_ppomax.tiny import build_llama_style_tokenizer, llama_config


def tiny_config(tokenizer) -> LlamaConfig:
    """A tiny "LLaMA-7B" as the release's checkpoints describe it (no pad id: the release pads with <unk>)."""
    return llama_config(tokenizer, pad_token_id=None, architectures=["LlamaForCausalLM"])


def save_bin_shards(state: dict[str, torch.Tensor], folder: Path, shards: int) -> None:
    """A sharded ``pytorch_model-*.bin`` checkpoint with its index, as the release ships."""
    names = sorted(state)
    groups = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for i, group in enumerate(groups):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        torch.save({name: state[name].clone() for name in group}, folder / file)
        weight_map.update(dict.fromkeys(group, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))


class Release:
    """A tiny "LLaMA-7B" (raw), a tuned model with a reward head, and the diff made as the authors made it."""

    def __init__(self, root: Path, model_type: str = "reward", shards: int = 3) -> None:
        self.tokenizer = build_llama_style_tokenizer()
        config = tiny_config(self.tokenizer)
        torch.manual_seed(0)
        raw = LlamaForCausalLM(config)
        self.raw_dir, self.diff_dir = root / "raw", root / "diff"
        raw.save_pretrained(self.raw_dir, max_shard_size="40KB")  # sharded safetensors
        self.tokenizer.save_pretrained(self.raw_dir)
        torch.manual_seed(1)
        self.tuned = LlamaForCausalLM(config)  # "fine-tuned" weights
        self.reward_head = torch.randn(1, config.hidden_size) * 0.1
        tuned_state = dict(self.tuned.state_dict())
        if model_type == "reward":
            tuned_state["reward_head.weight"] = self.reward_head
        raw_state = raw.state_dict()
        diff = {k: (v - raw_state[k]) if "layers" in k else v for k, v in tuned_state.items()}
        self.diff_dir.mkdir()
        save_bin_shards(diff, self.diff_dir, shards)
        config.save_pretrained(self.diff_dir)
        self.tokenizer.save_pretrained(self.diff_dir)
        self.expected_sum = sum(v.float().sum().item() for v in tuned_state.values())

    @torch.no_grad()
    def release_scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The release's reward: reward_head(last hidden state) at the last position of a left-padded batch."""
        hidden = self.tuned.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return (hidden[:, -1] @ self.reward_head.T).squeeze(-1)


def batch(tokenizer, texts, side):
    tokenizer.padding_side = side
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)


TEXTS = ["Human:hello how are you</s>Assistant:", "Human:hi</s>Assistant:good</s>Human:tell me a story</s>Assistant:"]


@pytest.fixture
def release(tmp_path):
    return Release(tmp_path)


def test_reward_recovery_round_trips_and_converts(release, tmp_path):
    out = recover(release.raw_dir, release.diff_dir, tmp_path / "out", "reward", expected_sum=release.expected_sum)
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert type(model).__name__ == "LlamaForSequenceClassification"
    assert model.config.num_labels == 1 and model.config.pad_token_id == 0
    torch.testing.assert_close(model.score.weight, release.reward_head)
    tuned = release.tuned.state_dict()
    for name, value in model.state_dict().items():
        if name.startswith("model."):
            torch.testing.assert_close(value, tuned[name], msg=name)
    assert not any(name.startswith("lm_head") for name in model.state_dict())
    info = json.loads((out / CONVERSION_INFO).read_text())
    assert info["model_type"] == "reward" and info["recovered_sum"] == pytest.approx(release.expected_sum, rel=1e-6)


@pytest.mark.parametrize("side", ["left", "right"])
def test_converted_scores_equal_the_release_forward(release, tmp_path, side):
    out = recover(release.raw_dir, release.diff_dir, tmp_path / "out", "reward", expected_sum=release.expected_sum)
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.pad_token == "<unk>" and tokenizer.pad_token_id == 0
    inputs = batch(tokenizer, TEXTS, side)
    with torch.no_grad():
        converted = model(**inputs).logits.squeeze(-1)
    reference = release.release_scores(**batch(tokenizer, TEXTS, "left"))
    torch.testing.assert_close(converted, reference, atol=1e-5, rtol=1e-4)


def test_sft_recovery_writes_a_sharded_causal_lm(tmp_path):
    release = Release(tmp_path, model_type="sft")
    out = recover(
        release.raw_dir,
        release.diff_dir,
        tmp_path / "out",
        "sft",
        expected_sum=release.expected_sum,
        max_shard_size="30KB",
    )
    assert (out / "model.safetensors.index.json").exists()
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    model = AutoModelForCausalLM.from_pretrained(out)
    for (name, a), b in zip(model.state_dict().items(), release.tuned.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    tokenizer = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "hello"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        "Human:hello</s>Assistant:"
    )


def test_failed_sum_check_writes_nothing(release, tmp_path):
    shard = sorted(release.diff_dir.glob("pytorch_model-*.bin"))[1]
    state = torch.load(shard, weights_only=True)
    name = next(iter(state))
    state[name] = state[name] + 1.0  # a corrupted shard
    torch.save(state, shard)
    with pytest.raises(IntegrityError, match="Nothing was written"):
        recover(release.raw_dir, release.diff_dir, tmp_path / "out", "reward", expected_sum=release.expected_sum)
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".tmp-*"))


def test_published_sums_and_explicit_skip(release, tmp_path):
    with pytest.raises(IntegrityError):  # the published 7B sum does not match a tiny model
        recover(release.raw_dir, release.diff_dir, tmp_path / "a", "reward", lang="en")
    with pytest.raises(ValueError, match="No published checksum"):
        recover(release.raw_dir, release.diff_dir, tmp_path / "b", "policy", lang="en")
    out = recover(release.raw_dir, release.diff_dir, tmp_path / "c", "policy", check=False, dtype="bfloat16")
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16


def test_refuses_a_non_empty_output(release, tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        recover(release.raw_dir, release.diff_dir, tmp_path / "busy", "reward", check=False)


def test_bad_max_shard_size_is_a_clear_error(release, tmp_path):
    for size in ("lots", "1.5GB", 0):
        with pytest.raises(ValueError, match=r"--max-shard-size .*5GB"):
            recover(release.raw_dir, release.diff_dir, tmp_path / "out", "reward", check=False, max_shard_size=size)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".tmp-*"))


def test_tensor_folder_reads_single_and_sharded_checkpoints(release):
    raw = TensorFolder(release.raw_dir)
    diff = TensorFolder(release.diff_dir)
    assert set(raw.names()) == set(release.tuned.state_dict())
    assert "reward_head.weight" in diff
    with pytest.raises(FileNotFoundError, match="No weights"):
        TensorFolder(release.raw_dir.parent)


def test_converted_models_train_with_ppo(tmp_path):
    reward_release = Release(tmp_path / "r")
    sft_release = Release(tmp_path / "s", model_type="sft")
    reward = recover(reward_release.raw_dir, reward_release.diff_dir, tmp_path / "reward", "reward", check=False)
    sft = recover(sft_release.raw_dir, sft_release.diff_dir, tmp_path / "sft", "sft", check=False)
    tokenizer = AutoTokenizer.from_pretrained(sft)
    prompts = [[{"role": "user", "content": text}] for text in ("hello how are you", "tell me a story", "hi")] * 4
    trainer = PPOMaxTrainer(
        args=PPOMaxConfig(output_dir=str(tmp_path / "ppo"), **SMOKE),
        processing_class=tokenizer,
        model=AutoModelForCausalLM.from_pretrained(sft),
        ref_model=None,
        reward_model=AutoModelForSequenceClassification.from_pretrained(reward),
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        value_model=None,
    )
    prompt = trainer.processing_class.decode(trainer.train_dataset[0]["input_ids"]).replace(" ", "")
    assert prompt == "Human:hellohowareyou</s>Assistant:"  # the release's format, through the chat template
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_cli_recovers_a_multi_shard_diff(release, tmp_path, capsys):
    from trl_ppomax.cli import main

    output = tmp_path / "cli-out"
    argv = [
        "moss",
        "recover",
        "--raw",
        str(release.raw_dir),
        "--diff",
        str(release.diff_dir),
        "--output",
        str(output),
        "--model-type",
        "reward",
        "--expected-sum",
        str(release.expected_sum),
        "--max-shard-size",
        "30KB",
    ]
    assert main(argv) == 0
    assert "Recovered en reward model" in capsys.readouterr().out
    assert AutoModelForSequenceClassification.from_pretrained(output).config.num_labels == 1
    assert main([*argv[:-4], "--output", str(tmp_path / "x"), "--model-type", "policy"]) == 2
    assert "No published checksum" in capsys.readouterr().err
