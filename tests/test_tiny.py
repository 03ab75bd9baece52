import json
import subprocess
import sys

import pytest
import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from trl_ppomax.cli import main
from trl_ppomax.toyworld import tiny
from trl_ppomax.toyworld.tiny import ARCHITECTURES, WORDS, build_models, build_tokenizer, save_tiny_models


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_build_tokenizer():
    tokenizer = build_tokenizer()
    assert tokenizer.padding_side == "left"
    assert (tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        0,
        1,
        2,
        3,
    )
    assert len(tokenizer) == 4 + len(WORDS) + 3
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "user: hello </s> assistant: "
    assert tokenizer("hello zebra")["input_ids"] == [4, 1]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_build_models_same_seed_same_weights(arch):
    _, policy_a, reward_a = build_models(arch, seed=3)
    _, policy_b, reward_b = build_models(arch, seed=3)
    assert_same_weights(policy_a, policy_b)
    assert_same_weights(reward_a, reward_b)
    assert reward_a.config.num_labels == 1
    assert policy_a.config.hidden_size == 32 and policy_a.config.num_hidden_layers == 2
    _, policy_c, _ = build_models(arch, seed=4)
    assert not torch.equal(policy_a.get_input_embeddings().weight, policy_c.get_input_embeddings().weight)


def test_unknown_arch():
    with pytest.raises(ValueError, match="llama"):
        build_models("gpt2")
    with pytest.raises(ValueError, match="llama"):
        save_tiny_models("unused", arch="gpt2")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_save_tiny_models_loadable(tmp_path, arch):
    out = tmp_path / "tiny"
    paths = save_tiny_models(out, arch=arch, seed=0)
    assert set(paths) == {"sft", "reward", "prompts", "preferences"}
    assert sorted(p.name for p in out.iterdir()) == ["preferences.jsonl", "prompts.jsonl", "reward", "sft"]
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]  # no temporary sibling left behind

    _, policy, reward = build_models(arch, seed=0)
    for path in (paths["sft"], paths["reward"]):
        tokenizer = AutoTokenizer.from_pretrained(path)
        assert tokenizer.padding_side == "left" and tokenizer.chat_template == tiny.CHAT_TEMPLATE
        assert tokenizer("hello please")["input_ids"] == build_tokenizer()("hello please")["input_ids"]
    sft = AutoModelForCausalLM.from_pretrained(paths["sft"])
    rm = AutoModelForSequenceClassification.from_pretrained(paths["reward"])
    assert sft.config.model_type == arch and rm.config.num_labels == 1
    assert_same_weights(sft, policy)
    assert_same_weights(rm, reward)
    with torch.no_grad():
        assert rm(torch.tensor([[4, 5, 3]])).logits.shape == (1, 1)

    prompts = load_dataset("json", data_files=paths["prompts"], split="train")
    assert prompts.column_names == ["prompt"] and len(prompts) == 48
    assert prompts["prompt"] == tiny.prompt_texts(48)

    prefs = load_dataset("json", data_files=paths["preferences"], split="train")
    assert prefs.column_names == ["prompt", "chosen", "rejected"] and len(prefs) == 64
    vocab = set(WORDS)
    for row in prefs:
        chosen, rejected = row["chosen"].split(), row["rejected"].split()
        assert row["chosen"].startswith(" ") and row["rejected"].startswith(" ")
        assert "please" in chosen and "thanks" in chosen
        assert "please" not in rejected and "thanks" not in rejected
        assert set(row["prompt"].split() + chosen + rejected) <= vocab


def test_save_same_seed_identical_files(tmp_path):
    a = save_tiny_models(tmp_path / "a", seed=7)
    b = save_tiny_models(tmp_path / "b", seed=7)
    assert_same_weights(AutoModelForCausalLM.from_pretrained(a["sft"]), AutoModelForCausalLM.from_pretrained(b["sft"]))
    assert_same_weights(
        AutoModelForSequenceClassification.from_pretrained(a["reward"]),
        AutoModelForSequenceClassification.from_pretrained(b["reward"]),
    )
    for key in ("prompts", "preferences"):
        with open(a[key]) as fa, open(b[key]) as fb:
            assert fa.read() == fb.read()


def test_refuses_non_empty_folder_unless_overwrite(tmp_path):
    out = tmp_path / "tiny"
    out.mkdir()  # an empty folder is fine
    save_tiny_models(out)
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="overwrite"):
        save_tiny_models(out)
    assert (out / "keep.txt").exists()
    paths = save_tiny_models(out, arch="gpt_neox", overwrite=True)
    assert not (out / "keep.txt").exists()
    assert AutoModelForCausalLM.from_pretrained(paths["sft"]).config.model_type == "gpt_neox"
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]

    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        save_tiny_models(a_file, overwrite=True)


def test_crash_leaves_nothing_half_written(tmp_path, monkeypatch):
    def boom(path, rows):
        raise RuntimeError("disk full")

    monkeypatch.setattr(tiny, "write_jsonl", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        save_tiny_models(tmp_path / "tiny")
    assert list(tmp_path.iterdir()) == []

    # An existing folder being overwritten is left as it was.
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "keep.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="disk full"):
        save_tiny_models(tmp_path / "old", overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["old"]
    assert (tmp_path / "old" / "keep.txt").read_text() == "mine"


def test_cli_tiny(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert main(["tiny", str(out), "--arch", "gpt_neox", "--seed", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    printed = dict(line.split(": ", 1) for line in lines)
    assert set(printed) == {"sft", "reward", "prompts", "preferences"}
    assert printed["sft"] == str(out.absolute() / "sft")
    assert AutoModelForCausalLM.from_pretrained(printed["sft"]).config.model_type == "gpt_neox"
    _, policy, _ = build_models("gpt_neox", seed=1)
    assert_same_weights(AutoModelForCausalLM.from_pretrained(printed["sft"]), policy)

    assert main(["tiny", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["tiny", str(out), "--overwrite"]) == 0
    assert json.loads((out / "prompts.jsonl").read_text().splitlines()[0]).keys() == {"prompt"}


@pytest.mark.slow  # the command line in its own process: 10 s cold (.ci/run runs it)
def test_cli_tiny_subprocess(tmp_path):
    out = tmp_path / "tiny"
    result = subprocess.run(
        [sys.executable, "-m", "trl_ppomax.cli", "tiny", str(out)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "preferences:" in result.stdout and (out / "preferences.jsonl").exists()
