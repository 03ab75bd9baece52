"""What every judge shares: a :class:`Pair` of answers to one prompt, verdicts counted from the policy's side, and
the append-only :class:`JsonlCache` that keeps every generation and every verdict on disk as it arrives (nothing paid
for is asked twice: an interrupted evaluation resumes from it)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Protocol

Verdict = Literal["win", "tie", "lose", "invalid"]
#: Every verdict, from the policy's side: its answer is better (win), as good (tie), worse (lose), or the judge gave
#: no usable answer (invalid).
VERDICTS: tuple[Verdict, ...] = ("win", "tie", "lose", "invalid")
ALL = "all"  # the category of prompts that have none


@dataclass(frozen=True)
class Pair:
    """One held-out prompt with the policy's and the baseline's answers. ``prompt`` is the text or conversation (list
    of ``{"role", "content"}``) the models saw; ``key`` is stable across runs (index and prompt hash), so cached
    verdicts are found again."""

    key: str
    prompt: str | list[dict[str, str]]
    policy: str
    baseline: str
    category: str = ALL
    finished: tuple[bool, bool] = (True, True)  # whether each answer (policy, baseline) ended with the stop token

    def as_dict(self) -> dict:
        return asdict(self)


def prompt_key(index: int, prompt) -> str:
    """``"<index>-<first 12 hex of sha256(prompt)>"``: stable for the same prompt at the same position."""
    digest = hashlib.sha256(json.dumps(prompt, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    return f"{index}-{digest[:12]}"


def prompt_text(prompt) -> str:
    """A prompt as plain text for a judge: the text itself, or a conversation's turns as ``Role: content`` lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in prompt)


def margin_verdict(policy_score: float, baseline_score: float, tie_threshold: float = 0.0) -> Verdict:
    """``win`` if ``policy − baseline > tie_threshold``, ``lose`` if ``< −tie_threshold``, else ``tie``; a non-finite
    score gives ``invalid``."""
    margin = policy_score - baseline_score
    if not math.isfinite(margin):
        return "invalid"
    return "win" if margin > tie_threshold else "lose" if margin < -tie_threshold else "tie"


def combine_swapped(first: Verdict, second: Verdict) -> Verdict:
    """One verdict from a pair judged twice with the answers swapped (both from the policy's side): the same verdict
    twice stands, two that disagree are a tie (position bias, as LLM-as-a-judge recommends), any invalid is invalid."""
    if "invalid" in (first, second):
        return "invalid"
    return first if first == second else "tie"


class JsonlCache:
    """A dict on disk: one JSON line ``{"key": …, "value": …}`` appended, flushed and fsynced per :meth:`put`, so a
    crash loses at most the line being written (a truncated last line is ignored when the file is read back).
    Thread-safe. The later of two lines with the same key wins."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._values: dict[str, object] = {}
        if self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                with contextlib.suppress(json.JSONDecodeError):  # the line a crash cut short
                    record = json.loads(line)
                    self._values[record["key"]] = record["value"]

    def __contains__(self, key: str) -> bool:
        return key in self._values

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key: str, default=None):
        return self._values.get(key, default)

    def put(self, key: str, value) -> None:
        line = json.dumps({"key": key, "value": value}, ensure_ascii=False) + "\n"
        with self._lock, self.path.open("a", encoding="utf-8") as file:
            torn = file.tell() and not self._ends_with_newline()  # a crash cut the last line short
            file.write("\n" + line if torn else line)
            file.flush()
            os.fsync(file.fileno())
            self._values[key] = value

    def _ends_with_newline(self) -> bool:
        with self.path.open("rb") as file:
            file.seek(-1, os.SEEK_END)
            return file.read(1) == b"\n"


class Judge(Protocol):
    """A judge: ``name`` (the key in ``report.json``) and ``judge(pairs, cache)`` → one verdict per pair, from the
    policy's side, in order. It looks every pair up in ``cache`` first and stores what it decides there at once."""

    name: str

    def settings(self) -> dict:
        """What decides its verdicts (model, prompt, threshold; never a secret): a cache made under other settings is
        not reused."""

    def judge(self, pairs: Iterable[Pair], cache: JsonlCache) -> list[Verdict]: ...
