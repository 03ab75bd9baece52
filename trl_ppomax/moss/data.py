"""The MOSS-RLHF release's data files: JSON lists of samples, each a list of turns, found and read as the release's
``ppo_datahelper.py`` does (which files, which turn is the human's, which samples are dropped)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Literal

from datasets import Dataset

from trl_ppomax.data import is_blank
from trl_ppomax.data.sources import load_any_dataset

logger = logging.getLogger(__name__)


#: Split names read from the files of a release folder whose names end with another word (``*valid.json``).
RELEASE_SPLIT_FILES = {"validation": "valid"}


def release_files(name: str, split: str = "train") -> list[str]:
    """The release's data files that ``name`` holds for ``split``: ``name`` itself when it is one; in a folder, every
    such file named ``*{split}.json`` (``validation`` reads ``*valid.json``), sorted, as ``ppo_datahelper.py``. Empty
    when ``name`` is neither."""
    if os.path.isfile(name):
        return [name] if name.endswith(".json") and _looks_like_release_list(name) else []
    if not os.path.isdir(name):
        return []
    suffix = f"{RELEASE_SPLIT_FILES.get(split, split)}.json"
    files = sorted(os.path.join(name, f) for f in os.listdir(name) if f.endswith(suffix))
    files = [f for f in files if os.path.isfile(f)]
    return files if files and all(_looks_like_release_list(f) for f in files) else []


def _looks_like_release_list(path: str) -> bool:
    """Whether a JSON file opens as a list of lists (``[[``, or ``[]``), not the list of records (``[{``) that the
    ``json`` dataset builder reads."""
    with open(path, encoding="utf-8-sig") as file:
        head = "".join(file.read(4096).split())
    return head.startswith(("[[", "[]"))


def _read_release_list(path: str) -> list[list[str | None]] | None:
    """The samples of a release data file, or None when ``path`` holds something else."""
    with open(path, encoding="utf-8-sig") as file:
        try:
            data = json.load(file)
        except json.JSONDecodeError:
            return None
    turns = isinstance(data, list) and all(isinstance(s, list) for s in data)
    return data if turns and all(t is None or isinstance(t, str) for s in data for t in s) else None


def read_release_files(paths: Sequence[str], kind: Literal["prompts", "ptx"] = "prompts") -> Dataset:
    """The samples of the release's data files, in file order; dropped samples are counted in a warning per file, and
    ValueError is raised when none is left.

    - ``kind="prompts"``: a ``prompt`` column; the **last turn is the human's** (:func:`roles_from_the_end`, the
      release's ``i + (len + 1) % 2``); a sample with no turn or an empty one (None, empty or blank) is dropped, as
      the release's ``all(sample)`` does.
    - ``kind="ptx"``: a ``messages`` column, the human's turn first (:func:`roles_from_the_start`); a sample with
      fewer than two turns or an empty one is dropped, as the release does.
    """
    samples, shortest = [], 2 if kind == "ptx" else 1
    for path in paths:
        data = _read_release_list(path)
        if data is None:
            raise ValueError(f"{path} is not a MOSS-RLHF data file: a JSON list of samples, each a list of turns.")
        kept = [s for s in data if len(s) >= shortest and not any(is_blank(t) for t in s)]
        if dropped := len(data) - len(kept):
            few = "fewer than two" if kind == "ptx" else "no"
            message = "%s: dropped %d of %d samples with %s turns or an empty one, as the MOSS-RLHF release does."
            logger.warning(message, path, dropped, len(data), few)
        samples.extend(kept)
    if not samples:
        raise ValueError(
            f"No sample is left in {', '.join(paths)}: every sample has an empty turn, or the files are empty."
        )
    if kind == "ptx":
        return Dataset.from_dict({"messages": [roles_from_the_start(s) for s in samples]})
    return Dataset.from_dict({"prompt": [roles_from_the_end(s) for s in samples]})


def roles_from_the_end(turns: list[str]) -> list[dict[str, str]]:
    """Messages for a list of turns whose last one is the user's: ``[..., assistant, user]``."""
    return roles_from_the_start(turns[::-1])[::-1]


def roles_from_the_start(turns: list[str]) -> list[dict[str, str]]:
    """Messages for a list of turns whose first one is the user's: ``[user, assistant, user, ...]``."""
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]


def load_dataset_or_release(
    name: str, config: str | None = None, split: str = "train", kind: Literal["prompts", "ptx"] = "prompts"
) -> Dataset:
    """:func:`~trl_ppomax.data.sources.load_any_dataset`, or the release's data files (:func:`release_files`) read as
    the release reads them, as prompts or ptx dialogues."""
    if files := release_files(name, split):
        return read_release_files(files, kind)
    return load_any_dataset(name, config, split)
