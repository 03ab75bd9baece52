"""``trl-ppomax push`` / :mod:`trl_ppomax.reporting.hub`: model cards and uploads, offline (a fake ``HfApi`` records calls)."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest

from trl_ppomax.cli import main
from trl_ppomax.moss.card import moss_model_card
from trl_ppomax.moss.recovery import CONVERSION_INFO
from trl_ppomax.reporting import hub

SENTINEL = "hf_SENTINELtokenDoNotLeak1234567890"
MODEL_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


class FakeApi:
    """Records the HfApi calls ``push_folder`` makes; contacts nothing."""

    instances: ClassVar[list["FakeApi"]] = []

    def __init__(self, *args, **kwargs):
        assert "token" not in kwargs
        self.calls = []
        FakeApi.instances.append(self)

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def create_branch(self, repo_id, **kwargs):
        self.calls.append(("create_branch", repo_id, kwargs))

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        """Records the staged folder as it is during the call: each file's content, and where a link points."""
        root = Path(folder_path)
        files = {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}
        staged = {rel: (p.resolve() if p.is_symlink() else p.read_bytes()) for rel, p in files.items()}
        self.calls.append(("upload_folder", repo_id, {**kwargs, "folder_path": folder_path, "files": staged}))
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/abc123", oid="abc123")

    def named(self, name):
        return [call for call in self.calls if call[0] == name]


@pytest.fixture
def converted(saved, tmp_path):
    """A fake converted MOSS reward model, plus files push must skip."""
    folder = tmp_path / "moss-reward-7B-en"
    shutil.copytree(saved / "reward", folder)
    conversion = {
        "model_type": "reward",
        "lang": "en",
        "source_diff": "fnlp/moss-rlhf-reward-model-7B-en",
        "source_raw": "/data/llama-7b-hf",
        "expected_sum": 50810.703125,
    }
    (folder / CONVERSION_INFO).write_text(json.dumps(conversion))
    (folder / ".hidden").write_text("x")
    (folder / ".tmp-123").mkdir()
    (folder / ".tmp-123" / "partial.bin").write_text("x")
    (folder / "checkpoint-2").mkdir()
    (folder / "checkpoint-2" / "optimizer.pt").write_text("x")
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "a.pyc").write_text("x")
    (folder / "training_args.bin").write_bytes(b"args")
    (folder / "README.md").write_text("old card")  # replaced by the generated card
    return folder


@pytest.fixture
def fake_hfapi(monkeypatch):
    FakeApi.instances = []
    monkeypatch.setattr(hub, "HfApi", FakeApi)
    return FakeApi


EXPECTED = sorted([*MODEL_FILES, "chat_template.jinja", CONVERSION_INFO])  # training_args.bin: left out


def test_upload_files_skips_hidden_checkpoints_and_readme(converted):
    files = hub.upload_files(converted)
    assert set(files) >= MODEL_FILES
    assert files == sorted(set(EXPECTED) | set(files))
    assert not [f for f in files if f.startswith((".", "checkpoint-", "__pycache__")) or f == "README.md"]
    assert hub.upload_plan(converted)[1] == ["checkpoint-2/", "training_args.bin"]  # left out, and reported
    assert "training_args.bin" in hub.upload_files(converted, include_internals=True)


def test_dry_run_prints_files_and_card(converted, fake_hfapi, capsys):
    assert main(["push", str(converted), "--repo-id", "me/moss-reward", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert not fake_hfapi.instances  # nothing on the Hub, not even an HfApi
    for name in [*EXPECTED, "README.md"]:
        assert name in out
    for skipped in ("checkpoint-2", "optimizer.pt", ".tmp-123", ".hidden", "__pycache__"):
        assert skipped not in out
    for text in (
        "license: agpl-3.0",
        "base_model: fnlp/moss-rlhf-reward-model-7B-en",
        "pipeline_tag: text-classification",
        "reward-model",
        "moss-rlhf",
        "2307.04964",
        hub.PAPER_TITLE,
        "Human:Hi</s>Assistant:",
        "apply_chat_template",
        "AutoModelForSequenceClassification",
        "PPOMaxTrainer",
        "CC BY-NC 4.0",
        "trl-ppomax moss recover --raw /data/llama-7b-hf --diff fnlp/moss-rlhf-reward-model-7B-en",
        "--model-type reward --lang en",
        "50810.703125",
        "@article{zheng2023secrets",
    ):
        assert text in out, text


def test_push_folder_one_commit(converted):
    api = FakeApi()
    card = moss_model_card(converted, "me/moss-reward")
    paths = hub.push_folder(converted, "me/moss-reward", card=card, api=api).files
    assert paths == [*EXPECTED, "README.md"]
    assert [c[0] for c in api.calls] == ["create_repo", "upload_folder"]  # one upload_folder call: one commit
    _, repo_id, kwargs = api.named("create_repo")[0]
    assert repo_id == "me/moss-reward"
    assert kwargs == {"private": False, "exist_ok": True, "repo_type": "model"}
    _, repo_id, upload = api.named("upload_folder")[0]
    assert repo_id == "me/moss-reward" and upload["revision"] is None and upload["repo_type"] == "model"
    assert upload["commit_message"]
    staged = upload["files"]
    assert sorted(staged) == sorted(paths)  # the planned files and the card, nothing else
    assert staged["config.json"] == (converted / "config.json").resolve()  # linked, not copied
    card = staged["README.md"].decode()
    assert "license: agpl-3.0" in card and "PPOMaxTrainer" in card and "old card" not in card
    assert (converted / "README.md").read_text() == "old card"  # the folder is left alone
    assert not Path(upload["folder_path"]).exists()  # the staging folder is gone
    assert converted not in Path(upload["folder_path"]).parents


def test_private_and_revision_passed_through(converted):
    api = FakeApi()
    hub.push_folder(converted, "me/m", private=True, revision="v1", commit_message="first", api=api)
    assert [c[0] for c in api.calls] == ["create_repo", "create_branch", "upload_folder"]
    assert api.named("create_repo")[0][2]["private"] is True
    assert api.named("create_branch")[0][2] == {"branch": "v1", "repo_type": "model", "exist_ok": True}
    commit = api.named("upload_folder")[0][2]
    assert commit["revision"] == "v1" and commit["commit_message"] == "first"

    api = FakeApi()
    hub.push_folder(converted, "me/m", revision="main", api=api)
    assert not api.named("create_branch")


def test_cli_push_prints_repo_and_commit(converted, fake_hfapi, capsys):
    args = ["push", str(converted), "--repo-id", "me/m", "--private", "--revision", "dev", "--commit-message", "hi"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "https://huggingface.co/me/m" in out and "commit/abc123" in out
    (api,) = fake_hfapi.instances
    assert api.named("create_repo")[0][2]["private"] is True
    assert api.named("upload_folder")[0][2]["revision"] == "dev"
    assert api.named("upload_folder")[0][2]["commit_message"] == "hi"


def test_missing_folder_and_folder_without_config(tmp_path, saved, capsys):
    with pytest.raises(ValueError, match="does not exist"):
        hub.push_folder(tmp_path / "nope", "me/m", dry_run=True)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"no config\.json or adapter_config\.json"):
        hub.push_folder(tmp_path, "me/m", dry_run=True)
    shutil.copytree(saved / "sft", tmp_path / "sft")
    with pytest.raises(ValueError, match=r"did you mean .*sft"):
        moss_model_card(tmp_path, "me/m")
    with pytest.raises(ValueError, match="Invalid --repo-id"):
        hub.push_folder(tmp_path / "sft", "not a repo id!", dry_run=True)

    assert main(["push", str(tmp_path / "nope"), "--repo-id", "me/m", "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("trl-ppomax push: error:") and "does not exist" in captured.err
    assert captured.err.count("\n") == 1


def test_hub_errors_are_one_line(converted, monkeypatch, capsys):
    class Failing(FakeApi):
        def create_repo(self, repo_id, **kwargs):
            raise RuntimeError("401 Unauthorized\nInvalid credentials")

    monkeypatch.setattr(hub, "HfApi", Failing)
    assert main(["push", str(converted), "--repo-id", "me/m"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "RuntimeError: 401 Unauthorized Invalid credentials" in err


def test_token_never_printed_or_written(converted, fake_hfapi, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", SENTINEL)
    assert main(["push", str(converted), "--repo-id", "me/m", "--dry-run"]) == 0
    assert main(["push", str(converted), "--repo-id", "me/m"]) == 0
    assert main(["push", str(converted.parent / "nope"), "--repo-id", "me/m"]) == 2
    captured = capsys.readouterr()
    assert SENTINEL not in captured.out + captured.err
    (api,) = fake_hfapi.instances
    readme = api.named("upload_folder")[0][2]["files"]["README.md"]
    assert SENTINEL not in readme.decode()
    assert SENTINEL not in str(moss_model_card(converted, "me/m"))

    # Even a token that slipped into the conversion info is redacted from the card.
    (converted / CONVERSION_INFO).write_text(
        json.dumps({"model_type": "reward", "recovery_command": f"HF_TOKEN={SENTINEL} trl-ppomax moss recover"})
    )
    card = str(moss_model_card(converted, "me/m"))
    assert SENTINEL not in card and "HF_TOKEN=<redacted>" in card


def test_create_model_card_still_works(saved):
    from transformers import AutoConfig

    model = SimpleNamespace(config=AutoConfig.from_pretrained(saved / "sft"))
    args = SimpleNamespace(output_dir="out/run")
    card = hub.create_model_card(model, args, "me/run", None, None, ["x"], ["trl"])
    assert "ppo-max" in card.data.tags and "x" in card.data.tags


def test_push_carries_the_trainers_card(saved, tmp_path):
    """A folder the trainer saved keeps its card's settings, final evaluation and tracker URLs on the Hub; the
    rest of the card is drawn for the repo pushed to."""
    from transformers import AutoConfig

    folder = tmp_path / "run"
    shutil.copytree(saved / "sft", folder)
    model = SimpleNamespace(config=AutoConfig.from_pretrained(folder))
    args = SimpleNamespace(output_dir=str(folder), preset="ppo_max", kl_coef=0.01)
    history = [{"step": 2, "eval_objective/scores": 0.25}]
    written = hub.create_model_card(model, args, None, None, None, None, ["trl"], history)
    written.save(folder / "README.md")
    assert "## PPO-max settings" in str(written) and 'REPO = "run"' in str(written)

    api = FakeApi()
    result = hub.push_folder(folder, "me/pushed", card=moss_model_card(folder, "me/pushed"), api=api)
    card = api.named("upload_folder")[0][2]["files"]["README.md"].decode()
    assert card == str(result.card)
    assert "## PPO-max settings" in card and "| `kl_coef` | `0.01` |" in card
    assert "## Final evaluation" in card and "eval_objective/scores" in card
    assert 'REPO = "me/pushed"' in card and "# pushed" in card and "No licence is set" in card
    assert "## PPO-max settings" in str(hub.model_card(folder, "me/pushed"))  # push_folder's default card too

    (folder / "README.md").write_text("# my own notes\n\n## PPO-max settings\n\nnot from trl-ppomax\n")
    assert "not from trl-ppomax" not in str(moss_model_card(folder, "me/pushed"))
