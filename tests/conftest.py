"""Fixtures for the tests: nothing is downloaded. Shared helpers live in ``helpers``, tiny models and tokenizers in
:mod:`trl_ppomax.toyworld.tiny`."""

from __future__ import annotations

import os
import shutil

import pytest

from trl_ppomax.ppo.rollouts import Rollouts
from trl_ppomax.toyworld import WorldSettings, prepare_world
from trl_ppomax.toyworld.tiny import ARCHITECTURES, build_models, save_tiny_models

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Saved tiny models per architecture, as :func:`trl_ppomax.toyworld.tiny.save_tiny_models` writes them
    ({arch: {"sft": path, "reward": path, ...}}), plus "data": a folder whose train.jsonl holds 48 prompts."""
    root = tmp_path_factory.mktemp("tiny")
    paths = {arch: save_tiny_models(root / arch, arch=arch) for arch in ARCHITECTURES}
    data = root / "prompts"
    data.mkdir()
    shutil.copyfile(paths["llama"]["prompts"], data / "train.jsonl")
    paths["data"] = str(data)
    return paths


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny llama policy and reward model saved with the tokenizer, as ``sft/`` and ``reward/`` under one folder."""
    root = tmp_path_factory.mktemp("models")
    tokenizer, policy, reward = build_models("llama", seed=0)
    for name, model in (("reward", reward), ("sft", policy)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root


@pytest.fixture(scope="session")
def user_folders(tmp_path_factory):
    """Folders as users have them after SFT and reward modelling with TRL (:mod:`user_setups`), per architecture:
    ``{arch: {"sft", "reward", "ppomax_reward", "prompts"}}``; tokenizers without ``[PAD]``, embeddings padded."""
    from user_setups import write_user_folders

    root = tmp_path_factory.mktemp("user")
    return {arch: write_user_folders(root / arch, arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory):
    """What TRL_PPOMAX_CACHE points at; the toy world caches under its ``toyworld/``."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def world_cache(cache_root):
    return cache_root / "toyworld"


@pytest.fixture(scope="session")
def world(world_cache):
    return prepare_world(WorldSettings(), cache_dir=world_cache)


@pytest.fixture
def rollout_forbidden(monkeypatch):
    """Any rollout fails the test: an error must come before it."""

    def forbidden(self, *args, **kwargs):
        raise AssertionError("the first rollout started: the fault was not caught at construction")

    monkeypatch.setattr(Rollouts, "written_by", forbidden)  # every scored rollout, training or sampling
