"""Recovering and converting the MOSS-RLHF release, on tiny synthetic checkpoints in the release's layout."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from helpers import SMOKE
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
)
from user_setups import build_llama_style_tokenizer

from trl_ppomax import PPOMaxConfig, PPOMaxTrainer
from trl_ppomax.moss.recovery import (
    CONVERSION_INFO,
    EXPECTED_SUMS,
    IntegrityError,
    TensorFolder,
    check_sum,
    inv_freq,
    recover,
)
from trl_ppomax.toyworld.tiny import llama_config


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


def inv_freq_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"


class Release:
    """A tiny "LLaMA-7B" (raw), a tuned model with a reward head, and the diff made as the authors made it.

    ``buffers`` says which checkpoints hold the rotary ``inv_freq`` buffers, as transformers 4.30.2 saved them
    ("diff", "raw", "both" or "none"); ``release_sum`` is the sum as the release computed it (buffers counted).
    """

    def __init__(self, root: Path, model_type: str = "reward", shards: int = 3, buffers: str = "none") -> None:
        self.tokenizer = build_llama_style_tokenizer()
        config = tiny_config(self.tokenizer)
        torch.manual_seed(0)
        raw = LlamaForCausalLM(config)
        self.raw_dir, self.diff_dir = root / "raw", root / "diff"
        raw.save_pretrained(self.raw_dir, max_shard_size="40KB")  # sharded safetensors
        self.tokenizer.save_pretrained(self.raw_dir)
        layers = range(config.num_hidden_layers)
        self.inv_freq = raw.model.rotary_emb.inv_freq.clone()  # what transformers computes, for every layer
        if buffers in ("raw", "both"):  # a raw LLaMA converted with transformers < 4.31
            save_file({inv_freq_name(i): self.inv_freq.clone() for i in layers}, self.raw_dir / "buffers.safetensors")
            index_file = self.raw_dir / "model.safetensors.index.json"
            index = json.loads(index_file.read_text())
            index["weight_map"].update({inv_freq_name(i): "buffers.safetensors" for i in layers})
            index_file.write_text(json.dumps(index))
        torch.manual_seed(1)
        self.tuned = LlamaForCausalLM(config)  # "fine-tuned" weights
        self.reward_head = torch.randn(1, config.hidden_size) * 0.1
        tuned_state = dict(self.tuned.state_dict())
        if model_type == "reward":
            tuned_state["reward_head.weight"] = self.reward_head
        raw_state = raw.state_dict()
        diff = {k: (v - raw_state[k]) if "layers" in k else v for k, v in tuned_state.items()}
        if buffers in ("diff", "both"):  # diffed as 'layers' keys: tuned − raw = 0
            diff.update({inv_freq_name(i): torch.zeros_like(self.inv_freq) for i in layers})
        self.diff_dir.mkdir()
        save_bin_shards(diff, self.diff_dir, shards)
        config.save_pretrained(self.diff_dir)
        self.tokenizer.save_pretrained(self.diff_dir)
        self.expected_sum = sum(v.float().sum().item() for v in tuned_state.values())
        self.buffers_sum = len(layers) * self.inv_freq.sum().item()
        self.release_sum = self.expected_sum + self.buffers_sum

    def edit_diff(self, edit) -> None:
        """Rewrite the diff after ``edit(state)`` changed its tensors in place."""
        folder = TensorFolder(self.diff_dir)
        state = {name: folder[name].clone() for name in folder.names()}
        edit(state)
        for file in self.diff_dir.glob("pytorch_model*"):
            file.unlink()
        save_bin_shards(state, self.diff_dir, 3)

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
        "<s>Human:hello</s>Assistant:"  # the release's tokenizer(prompt) ids: bos, then the text
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
    policy = Release(tmp_path / "policy", model_type="policy")
    out = recover(policy.raw_dir, policy.diff_dir, tmp_path / "c", "policy", check=False, dtype="bfloat16")
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
    ids = trainer.train_dataset[0]["input_ids"]
    prompt = trainer.processing_class.decode(ids).replace(" ", "")
    assert prompt == "<s>Human:hellohowareyou</s>Assistant:"  # the release's format, through the chat template
    assert ids.count(tokenizer.bos_token_id) == 1  # one bos, as the release's tokenizer(prompt)
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


# --------------------------------------------------------------------------------------------------------------------
# Non-persistent buffers (rotary inv_freq, saved by the release's transformers 4.30.2) and the sum check
# --------------------------------------------------------------------------------------------------------------------
def written_names(folder: Path) -> set[str]:
    names = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            names |= set(handle.keys())
    return names


def assert_nothing_written(tmp_path: Path, output: str = "out") -> None:
    assert not (tmp_path / output).exists() and not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize("buffers", ["diff", "raw", "both", "none"])
def test_inv_freq_is_not_written_and_counts_in_the_published_sum(tmp_path, monkeypatch, caplog, buffers):
    release = Release(tmp_path, buffers=buffers)
    monkeypatch.setitem(EXPECTED_SUMS, ("reward", "en"), release.release_sum)  # counts inv_freq, as published
    with caplog.at_level(logging.INFO, logger="trl_ppomax.moss.recovery"):
        out = recover(release.raw_dir, release.diff_dir, tmp_path / "out", "reward", lang="en")
    tuned = release.tuned.state_dict()
    expected = {name for name in tuned if name.startswith("model.")} | {"score.weight"}
    assert written_names(out) == expected  # no inv_freq, no lm_head
    model = AutoModelForSequenceClassification.from_pretrained(out)
    for name, value in model.state_dict().items():
        if name.startswith("model."):
            torch.testing.assert_close(value, tuned[name], msg=name)
    info = json.loads((out / CONVERSION_INFO).read_text())
    assert info["sum_counts_buffers"] is True
    assert info["buffers_sum"] == pytest.approx(release.buffers_sum, rel=1e-6)
    assert info["recovered_sum"] == pytest.approx(release.expected_sum, rel=1e-6)
    assert "the recovered weights must sum to" in caplog.text
    assert ("Skipping" in caplog.text) == (buffers != "none")
    source = {"diff": "the checkpoints and the config", "raw": "the raw checkpoint", "none": "the config"}
    assert f"from {source.get(buffers, 'the raw checkpoint')}" in caplog.text


def test_published_sum_without_the_buffers_fails(tmp_path, monkeypatch):
    release = Release(tmp_path, buffers="diff")
    monkeypatch.setitem(EXPECTED_SUMS, ("reward", "en"), release.expected_sum)  # inv_freq not counted: wrong
    with pytest.raises(IntegrityError, match="which counts the buffers"):
        recover(release.raw_dir, release.diff_dir, tmp_path / "out", "reward", lang="en")
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("buffers", ["diff", "raw"])
def test_corrupted_weight_fails_the_adjusted_check(tmp_path, monkeypatch, buffers):
    release = Release(tmp_path, buffers=buffers)
    monkeypatch.setitem(EXPECTED_SUMS, ("reward", "en"), release.release_sum)

    def corrupt(state):
        state["model.layers.1.mlp.up_proj.weight"][0, 0] += 0.05  # one weight, far below the buffers' sum

    release.edit_diff(corrupt)
    with pytest.raises(IntegrityError, match="Nothing was written"):
        recover(release.raw_dir, release.diff_dir, tmp_path / "out", "reward", lang="en")
    for expected_sum in (release.expected_sum, release.release_sum):  # either convention of a given sum
        with pytest.raises(IntegrityError, match="the expected sum is"):
            recover(release.raw_dir, release.diff_dir, tmp_path / "out", "reward", expected_sum=expected_sum)
    assert_nothing_written(tmp_path)


def test_a_given_sum_may_count_the_buffers_or_not(tmp_path):
    release = Release(tmp_path, buffers="diff")
    for i, (expected_sum, counted) in enumerate(((release.expected_sum, False), (release.release_sum, True))):
        out = recover(release.raw_dir, release.diff_dir, tmp_path / f"out{i}", "reward", expected_sum=expected_sum)
        assert json.loads((out / CONVERSION_INFO).read_text())["sum_counts_buffers"] is counted


def test_inv_freq_of_llama_7b_explains_the_issue_33_sum():
    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_hidden_layers=32)
    buffers = config.num_hidden_layers * inv_freq(config).sum().item()
    assert buffers == pytest.approx(238.7185, abs=1e-4)
    reported = 49715.3515625  # MOSS-RLHF issue #33: zh reward recovered with transformers ≥ 4.31 (no inv_freq)
    published = EXPECTED_SUMS[("reward", "zh")]
    assert check_sum(reported, buffers, "the config", published, True, "zh reward") is True
    with pytest.raises(IntegrityError):
        check_sum(reported, buffers, "the config", published, False, "zh reward")
    with pytest.raises(IntegrityError):  # one 7B tensor off by 1 in 1000 elements
        check_sum(reported - 1.0, buffers, "the config", published, True, "zh reward")
    theta = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0)
    assert inv_freq(theta).sum().item() < inv_freq(config).sum().item()


def test_keys_missing_from_either_checkpoint_are_errors(tmp_path):
    release = Release(tmp_path, buffers="diff")
    release.edit_diff(lambda state: state.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"raw LLaMA checkpoint has model\.layers\.0\.self_attn\.k_proj\.weight"):
        recover(release.raw_dir, release.diff_dir, tmp_path / "out", "reward", check=False)
    release.edit_diff(lambda state: state.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(32, 32)}))
    release.edit_diff(lambda state: state.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.extra\.weight is a diff tensor"):
        recover(release.raw_dir, release.diff_dir, tmp_path / "out", "reward", check=False)
    assert_nothing_written(tmp_path)


# --------------------------------------------------------------------------------------------------------------------
# A --model-type that contradicts the diff
# --------------------------------------------------------------------------------------------------------------------
def test_model_type_must_match_the_diff(release, tmp_path):
    for model_type in ("sft", "policy"):
        with pytest.raises(
            ValueError, match=r"has reward_head\.weight, so it is a reward model: pass --model-type rew"
        ):
            recover(release.raw_dir, release.diff_dir, tmp_path / "out", model_type, check=False)
    sft = Release(tmp_path / "sft", model_type="sft")
    with pytest.raises(ValueError, match=r"has lm_head\.weight and no reward_head.*--model-type sft"):
        recover(sft.raw_dir, sft.diff_dir, tmp_path / "out", "reward", expected_sum=sft.expected_sum)
    assert_nothing_written(tmp_path)


def test_cli_refuses_a_contradicting_model_type(release, tmp_path, capsys):
    from trl_ppomax.cli import main

    argv = ["moss", "recover", "--raw", str(release.raw_dir), "--diff", str(release.diff_dir)]
    argv += ["--output", str(tmp_path / "out"), "--model-type", "sft", "--skip-integrity-check"]
    assert main(argv) == 2
    assert "so it is a reward model: pass --model-type reward" in capsys.readouterr().err
    assert_nothing_written(tmp_path)
