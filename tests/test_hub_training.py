"""Pushing to the Hub during PPO-max training (``push_to_hub``/``hub_strategy``) and the trainer's model card, with
every HfApi call intercepted: nothing reaches the network."""

from __future__ import annotations

import sys
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest
from datasets import Dataset
from helpers import make_trainer
from huggingface_hub import HfApi, RepoUrl

from trl_ppomax.reporting import hub


@pytest.fixture
def hub_calls(monkeypatch):
    """Replace the HfApi methods the Trainer uses; each call is recorded as ``(name, kwargs)``."""
    calls = []

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, **kwargs):
        folder = kwargs["folder_path"]
        files = sorted(p.relative_to(folder).as_posix() for p in Path(folder).rglob("*"))
        calls.append(("upload_folder", {**kwargs, "files": files}))
        done = Future()
        done.set_result(SimpleNamespace(commit_url="https://huggingface.co/me/x/commit/1"))
        return done

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    return calls


def test_every_save_pushes_policy_and_card(tmp_path, hub_calls):
    trainer = make_trainer(
        tmp_path,
        push_to_hub=True,
        hub_model_id="me/x",
        hub_strategy="every_save",
        hub_token="hf_SECRETtokenNeverOnDisk123",
        save_strategy="steps",
        save_steps=1,
        eval_dataset=Dataset.from_dict({"prompt": ["a b", "c d"]}),
        eval_strategy="steps",
        eval_steps=2,
    )
    assert hub_calls[0][0] == "create_repo" and hub_calls[0][1]["repo_id"] == "me/x"
    trainer.train()
    pushes = [kw for name, kw in hub_calls if name == "upload_folder"]
    assert [kw["commit_message"] for kw in pushes] == ["Training in progress, step 1", "Training in progress, step 2"]
    for kw in pushes:
        assert kw["repo_id"] == "me/x" and kw["run_as_future"]
        assert "checkpoint-*" in kw["ignore_patterns"]
        assert {"config.json", "model.safetensors", "README.md", "training_args.bin"} <= set(kw["files"])
        assert "optimizer.pt" not in kw["files"] and "ppo_state.json" not in kw["files"]
    out = tmp_path / "out"
    assert b"hf_SECRETtoken" not in (out / "training_args.bin").read_bytes()
    card = (out / "README.md").read_text()
    assert "## PPO-max settings" in card and "`preset` | `'ppo_max'`" in card
    assert "## Final evaluation" in card and "eval_" in card
    assert "base_model:" not in card  # the tiny models are built in memory: no Hub id to name

    trainer.save_model()  # a user's save is pushed, as with transformers' Trainer
    last = [kw for name, kw in hub_calls if name == "upload_folder"][-1]
    assert last["commit_message"] == "Model save" and "README.md" in last["files"]


def test_checkpoint_strategy_pushes_the_checkpoint_and_end_pushes_nothing(tmp_path, hub_calls):
    trainer = make_trainer(
        tmp_path, push_to_hub=True, hub_model_id="me/x", hub_strategy="checkpoint", save_strategy="steps", save_steps=2
    )
    trainer.train()
    pushes = [kw for name, kw in hub_calls if name == "upload_folder"]
    assert [kw.get("path_in_repo") for kw in pushes] == [None, "last-checkpoint"]
    assert "optimizer.pt" in pushes[1]["files"]

    hub_calls.clear()
    trainer = make_trainer(
        tmp_path / "end",
        push_to_hub=True,
        hub_model_id="me/x",
        hub_strategy="end",
        save_strategy="steps",
        save_steps=1,
    )
    trainer.train()
    assert not [name for name, _ in hub_calls if name == "upload_folder"]


def test_card_never_names_a_local_base_model(tmp_path):
    local = tmp_path / "me" / "model"
    local.mkdir(parents=True)
    args = SimpleNamespace(output_dir="out/run", preset="ppo_max", kl_coef=0.05)
    for name_or_path, expected in ((str(local), None), ("org/sft-model", "org/sft-model")):
        model = SimpleNamespace(config=SimpleNamespace(_name_or_path=name_or_path))
        card = hub.create_model_card(model, args, "me/run", None, None, [], [], [{"eval_score": 1.5}, {"loss": 1}])
        assert card.data.base_model == expected
        assert str(local) not in str(card)
        assert "| `eval_score` | 1.5 |" in str(card) and "| `kl_coef` | `0.05` |" in str(card)


def test_card_carries_the_wandb_run_url(monkeypatch):
    monkeypatch.setitem(
        sys.modules, "wandb", SimpleNamespace(run=SimpleNamespace(url="https://wandb.ai/me/p/runs/abc"))
    )
    model = SimpleNamespace(config=SimpleNamespace(_name_or_path="org/sft"))
    card = str(hub.create_model_card(model, SimpleNamespace(output_dir="o"), "me/run", None, None, [], []))
    assert "https://wandb.ai/me/p/runs/abc" in card
