"""Where datasets come from: a Hub id, a local folder or data file (the MOSS-RLHF release's data files are read on top,
by :func:`trl_ppomax.moss.data.load_dataset_or_release`); a missing local path is named at once, a bad file's line
too."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence

from datasets import Dataset, load_dataset

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
DATA_EXTENSIONS = (*FILE_BUILDERS, ".arrow")


def looks_local(name: str, data: bool = False) -> bool:
    """Whether ``name`` is meant as a local path, not a Hub id: it starts with ``.``, ``/`` or ``~``, has more parts
    than a Hub id's ``org/name``, its first folder exists here, or (a dataset) it ends with a data-file extension."""
    parts = name.replace(os.sep, "/").split("/")
    return (
        name.startswith((".", "/", "~"))
        or len(parts) > 2
        or (len(parts) == 2 and os.path.isdir(parts[0]))
        or (data and name.lower().endswith(DATA_EXTENSIONS))
    )


def check_local_paths(settings: dict[str, str | None], datasets: Sequence[str] = ()) -> None:
    """Fail at once, naming the setting, when a model or dataset setting (``…dataset_name``, or in ``datasets``) is
    a local path that does not exist (a typo), instead of failing on the Hub after retries."""
    for setting, name in settings.items():
        local = name and looks_local(name, data=setting.endswith("dataset_name") or setting in datasets)
        if local and not os.path.exists(os.path.expanduser(name)):
            raise FileNotFoundError(
                f"{setting} not found: {name} (no such local file or folder; a Hub repository is named 'org/name')."
            )


def load_any_dataset(name: str, config: str | None = None, split: str = "train") -> Dataset:
    """A split from a Hub id, a local folder, or a local data file (.json/.jsonl/.parquet/.csv/.txt)."""
    if os.path.isfile(name) and os.path.splitext(name)[1] in FILE_BUILDERS:
        return load_data_file(name, split)
    return load_dataset(name, name=config, split=split)


def load_data_file(path: str, split: str = "train") -> Dataset:
    """The rows of a local data file (:data:`FILE_BUILDERS`) as ``split``; an empty or unreadable file raises a
    ``ValueError`` naming it (and a JSON file's first bad line), not deep in ``datasets`` without it."""
    builder = FILE_BUILDERS[os.path.splitext(path)[1]]
    try:
        dataset = load_dataset(builder, data_files={split: path}, split=split)
    except Exception as err:  # StopIteration, ArrowInvalid, DatasetGenerationError, …: none names the file
        where = _first_bad_json_line(path) if builder == "json" else ""
        raise ValueError(
            f"{path} could not be read as a {builder} data file{where}: {type(err).__name__}: {err}"
        ) from err
    if len(dataset) == 0:
        raise ValueError(f"{path} holds no rows: give a data file with one row per example.")
    return dataset


def _first_bad_json_line(path: str) -> str:
    """`` (line N is not JSON)`` for the first non-blank line of a JSON-lines file that does not parse; `` (the
    file is empty)``; or nothing (a whole-file JSON document, or every line parses)."""
    with open(path, encoding="utf-8-sig", errors="replace") as file:
        text = file.read()
    if not text.strip():
        return " (the file is empty)"
    with contextlib.suppress(json.JSONDecodeError):
        json.loads(text)
        return ""
    for number, line in enumerate(text.splitlines(), 1):
        try:
            if line.strip():
                json.loads(line)
        except json.JSONDecodeError as err:
            return f" (line {number} is not JSON: {err.msg})"
    return ""


def to_prompt_dataset(dataset: Dataset) -> Dataset:
    """The ``prompt`` column of a prompt-only or preference dataset, made from ``messages`` (up to the last user turn)
    or raw HH-RLHF; tokenized ``input_ids`` are kept as they are. Other columns stay for the reward functions."""
    from trl_ppomax.data.hh_rlhf import convert_hh_rlhf, is_hh_rlhf

    columns = dataset.column_names
    if "input_ids" in columns:
        return dataset.remove_columns([c for c in ("prompt",) if c in columns])
    if "prompt" in columns:
        return dataset
    if is_hh_rlhf(dataset):
        return convert_hh_rlhf(dataset).select_columns(["prompt"])
    if "messages" in columns:
        return dataset.map(
            lambda e: {"prompt": _up_to_last_user_turn(e["messages"])}, remove_columns=["messages"], desc="Prompts"
        )
    raise ValueError(
        f"Cannot find prompts in a dataset with columns {columns}: expected 'prompt', 'messages', 'input_ids', or "
        "Anthropic HH-RLHF 'chosen'/'rejected' dialogues."
    )


def _up_to_last_user_turn(messages: list[dict]) -> list[dict]:
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        raise ValueError("A conversation in 'messages' has no user turn to use as a prompt.")
    return messages[: last_user + 1]
