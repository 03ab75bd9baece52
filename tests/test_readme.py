"""Every Python block of the README runs, on tiny models built here, so the README cannot drift from the code.

The blocks of one ``##`` section run in order in one namespace, in a temporary folder that holds tiny models under
the names the README uses (``cleanrl/…`` Hub ids as local folders, the MOSS-RLHF models as ``moss-*-7b-en``), and
with a few settings shortened (:data:`SHORTER`)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from trl_ppomax.moss import setup_tokenizer
from trl_ppomax.tiny import build_llama_style_tokenizer, save_tiny_models

README = Path(__file__).resolve().parents[1] / "README.md"
#: Settings made shorter for the test (the README shows real values).
SHORTER = {"iterations=60": "iterations=2", "total_episodes=128_000": "total_episodes=64"}


def sections() -> list[tuple[str, list[str]]]:
    """``(heading, [python blocks])`` for every ``##`` section with Python blocks, in README order."""
    found = []
    for part in re.split(r"^## ", README.read_text(), flags=re.M)[1:]:
        heading = part.splitlines()[0]
        blocks = re.findall(r"```python\n(.*?)```", part, re.S)
        if blocks:
            found.append((heading, blocks))
    return found


def save_moss_models(folder: Path) -> None:
    """A tiny LLaMA-style policy and reward model with the MOSS-RLHF tokenizer set-up, as `moss recover` writes."""
    tokenizer = setup_tokenizer(build_llama_style_tokenizer("en"), "en")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    for name, cls in (("moss-sft-7b-en", LlamaForCausalLM), ("moss-reward-7b-en", LlamaForSequenceClassification)):
        cls(LlamaConfig(**config.to_dict(), num_labels=1)).save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("readme-models")
    tiny = save_tiny_models(folder / "tiny", arch="gpt_neox")
    for kind in ("sft", "reward"):
        shutil.copytree(tiny[kind], folder / "cleanrl" / f"EleutherAI_pythia-1b-deduped__{kind}__tldr")
    save_moss_models(folder)
    return folder


@pytest.mark.parametrize(("heading", "blocks"), sections(), ids=[heading for heading, _ in sections()])
def test_readme_section_runs(heading, blocks, models, tmp_path, monkeypatch, cache_root):
    for entry in models.iterdir():
        (tmp_path / entry.name).symlink_to(entry)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRL_PPOMAX_CACHE", str(cache_root))  # the toy world built once per test session
    namespace: dict = {"__name__": "__readme__"}
    for block in blocks:
        for real, short in SHORTER.items():
            block = block.replace(real, short)
        exec(compile(block, f"README.md: {heading}", "exec"), namespace)
