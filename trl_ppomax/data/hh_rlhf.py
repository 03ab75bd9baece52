"""Anthropic HH-RLHF rows to TRL's conversational preference format with an explicit prompt.

A raw row is ``{"chosen": str, "rejected": str}``, two whole ``"\\n\\nHuman: ...\\n\\nAssistant: ..."`` dialogues
sharing every turn but the last assistant reply. The converted row, ``{"prompt": [user, assistant, ..., user
messages], "chosen": [assistant message], "rejected": [assistant message]}``, is what TRL's reward/DPO trainers (and
``trl.apply_chat_template``) take: ``dataset = convert_hh_rlhf(raw) if is_hh_rlhf(raw) else raw``."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from datasets import Dataset, DatasetDict, Features, IterableDataset, IterableDatasetDict, Value

__all__ = ["PREFERENCE_FEATURES", "convert_hh_rlhf", "hh_rlhf_to_preference", "is_hh_rlhf", "parse_hh_dialogue"]

HUMAN_MARKER = "\n\nHuman:"
_TURN_SPLIT = re.compile(r"\n\n(Human|Assistant):")
_ROLES = {"Human": "user", "Assistant": "assistant"}
_MESSAGES = [{"role": Value("string"), "content": Value("string")}]
PREFERENCE_FEATURES = Features({"prompt": _MESSAGES, "chosen": _MESSAGES, "rejected": _MESSAGES})


def _snippet(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def parse_hh_dialogue(text: str) -> list[dict[str, str]]:
    """Split an HH-RLHF dialogue into chat messages: turns start at ``"\\n\\nHuman:"`` (``"user"``) and
    ``"\\n\\nAssistant:"`` (``"assistant"``), content stripped (may be empty); the first ``"Human:"`` may lack
    its ``"\\n\\n"``. A ValueError when there is no Human turn, text before it, roles that do not alternate from
    the human, or no final assistant turn. Example::

        >>> parse_hh_dialogue("\\n\\nHuman: Hi there\\n\\nAssistant: Hello!")
        [{'role': 'user', 'content': 'Hi there'}, {'role': 'assistant', 'content': 'Hello!'}]
    """
    if not isinstance(text, str):
        raise ValueError(f"An HH-RLHF dialogue must be a string, got {type(text).__name__}.")
    parts = _TURN_SPLIT.split("\n\n" + text.lstrip())  # so that a leading "Human:" is a marker too
    if len(parts) == 1 or "Human" not in parts[1::2]:
        raise ValueError(f"No '\\n\\nHuman:' turn in the HH-RLHF dialogue {_snippet(text)}.")
    if parts[0].strip():
        raise ValueError(f"Text before the first 'Human:' turn in the HH-RLHF dialogue: {_snippet(parts[0])}.")
    messages = [
        {"role": _ROLES[marker], "content": content.strip()}
        for marker, content in zip(parts[1::2], parts[2::2], strict=True)
    ]
    for index, message in enumerate(messages):
        expected = "user" if index % 2 == 0 else "assistant"
        if message["role"] != expected:
            raise ValueError(
                f"The roles of the HH-RLHF dialogue do not alternate starting with 'Human': turn {index} is "
                f"{message['role']!r} (content {_snippet(message['content'])}), expected {expected!r}."
            )
    if messages[-1]["role"] != "assistant":
        raise ValueError(
            f"The HH-RLHF dialogue does not end with an assistant turn; its last turn is the human's "
            f"{_snippet(messages[-1]['content'])}."
        )
    return messages


def hh_rlhf_to_preference(example: Mapping[str, Any]) -> dict[str, list[dict[str, str]]]:
    """One raw HH-RLHF row as ``{"prompt", "chosen", "rejected"}`` messages: the shared dialogue up to the last human
    turn, and each dialogue's final assistant reply (other keys dropped). A ValueError when a dialogue does not parse
    (:func:`parse_hh_dialogue`) or the two differ before their final replies, naming the turn that differs."""
    parsed = {}
    for key in ("chosen", "rejected"):
        if key not in example:
            raise ValueError(f"An HH-RLHF row needs 'chosen' and 'rejected' columns; {key!r} is missing.")
        try:
            parsed[key] = parse_hh_dialogue(example[key])
        except ValueError as error:
            raise ValueError(f"{key!r}: {error}") from error
    chosen, rejected = parsed["chosen"], parsed["rejected"]
    prompt, rejected_prompt = chosen[:-1], rejected[:-1]
    if prompt != rejected_prompt:
        detail = f"chosen has {len(prompt)} prompt turns, rejected has {len(rejected_prompt)}"
        for index, (a, b) in enumerate(zip(prompt, rejected_prompt, strict=False)):
            if a != b:
                detail = (
                    f"turn {index} ({a['role']}) differs: chosen has {_snippet(a['content'])}, "
                    f"rejected has {_snippet(b['content'])}"
                )
                break
        raise ValueError(f"'chosen' and 'rejected' do not share the same prompt: {detail}.")
    return {"prompt": prompt, "chosen": chosen[-1:], "rejected": rejected[-1:]}


def _looks_like_hh(text: Any) -> bool:
    return isinstance(text, str) and (HUMAN_MARKER in text or text.lstrip().startswith("Human:"))


def is_hh_rlhf(dataset_or_example: Dataset | IterableDataset | DatasetDict | Mapping[str, Any]) -> bool:
    """Whether a dataset (judged by its first row) or a single row is raw HH-RLHF: ``chosen`` and ``rejected``
    ``"Human:"`` dialogues, no ``prompt``. An empty dataset is not; a ``DatasetDict`` is when all its splits are."""
    if isinstance(dataset_or_example, (DatasetDict, IterableDatasetDict)):
        return len(dataset_or_example) > 0 and all(is_hh_rlhf(split) for split in dataset_or_example.values())
    example = dataset_or_example
    if not isinstance(example, Mapping):
        columns = getattr(example, "column_names", None)
        if columns is not None and ("prompt" in columns or not {"chosen", "rejected"} <= set(columns)):
            return False
        example = next(iter(example), None)
    return (
        isinstance(example, Mapping)
        and "prompt" not in example
        and all(_looks_like_hh(example.get(key)) for key in ("chosen", "rejected"))
    )


def convert_hh_rlhf(dataset: Dataset, num_proc: int | None = None) -> Dataset:
    """Convert a raw HH-RLHF dataset with :func:`hh_rlhf_to_preference` to :data:`PREFERENCE_FEATURES` (also when
    empty), dropping other columns. A row that does not convert raises a ``ValueError`` naming its index.

    Example::

        >>> raw = Dataset.from_dict({"chosen": ["\\n\\nHuman: Hi\\n\\nAssistant: Hello!"],
        ...                          "rejected": ["\\n\\nHuman: Hi\\n\\nAssistant: No."]})
        >>> convert_hh_rlhf(raw).column_names
        ['prompt', 'chosen', 'rejected']
    """

    def convert(example: dict, index: int) -> dict:
        try:
            return hh_rlhf_to_preference(example)
        except ValueError as error:
            raise ValueError(f"HH-RLHF row {index}: {error}") from error

    if len(dataset) == 0:  # `map` skips the function, and so the new columns, on an empty dataset
        return Dataset.from_dict({name: [] for name in PREFERENCE_FEATURES}, features=PREFERENCE_FEATURES)
    return dataset.map(
        convert,
        with_indices=True,
        remove_columns=dataset.column_names,
        features=PREFERENCE_FEATURES,
        num_proc=num_proc,
        desc="Converting HH-RLHF to conversational preference format",
    )
