"""The ``human`` judge, a blind A/B sheet round trip: :func:`export_sheet` writes ``human_sheet.csv`` for annotators
(rows shuffled, sides randomised per row, opaque ids) and ``human_key.json``, kept apart, which says per pair key which
column holds the policy's answer; :func:`import_sheet` turns the filled sheet back into verdicts from the policy's
side; :class:`HumanJudge` serves them like any other judge. The same pairs and seed always give the same files, so a
lost key can be rebuilt by exporting again into another folder."""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import os
import random
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from trl_ppomax.data.files import write_json, write_text_atomically
from trl_ppomax.judging.base import JsonlCache, Pair, Verdict, prompt_text

SHEET_NAME = "human_sheet.csv"
KEY_NAME = "human_key.json"
README_NAME = "HUMAN_SHEET_README.txt"
#: The sheet's columns, in order. Annotators fill ``preferred`` (and may write a ``comment``).
COLUMNS = ("id", "category", "prompt", "response_1", "response_2", "preferred", "comment")
SIDES = ("response_1", "response_2")
KEY_FORMAT = "trl-ppomax human key 1"
ACCEPTED = "'1', '2', 'tie' (any case; 1.0 and 2.0 as a spreadsheet saves numbers) or blank (not judged yet)"

README = f"""\
How to fill {SHEET_NAME}

Each row is one prompt with two responses, written by two different systems. Which system wrote which response is
hidden and changes from row to row; the rows are in random order.

For each row, read the prompt and both responses, then write in the 'preferred' column:
  1    if response_1 is the better answer to the prompt
  2    if response_2 is the better answer to the prompt
  tie  if they are equally good or equally bad
Leave 'preferred' blank for rows you have not judged yet. The 'comment' column is optional and free text.

Do not change the 'id' column. Do not open {KEY_NAME}: it reveals which system wrote which response.
Open the sheet as UTF-8 text, without evaluating formulas, and save it back as CSV (UTF-8).
"""


def export_sheet(
    pairs: Iterable[Pair], folder: str | os.PathLike, seed: int = 0, *, overwrite: bool = False
) -> tuple[Path, Path]:
    """Write ``folder/human_sheet.csv`` (UTF-8 with BOM, columns :data:`COLUMNS`), ``folder/human_key.json`` and
    ``folder/HUMAN_SHEET_README.txt``, each atomically; return ``(sheet, key)``. Rows and sides are shuffled with
    ``random.Random(seed)`` after sorting the pairs by key, so the files depend only on the set of pairs and the seed.
    Raises :class:`ValueError` on duplicate pair keys and :class:`FileExistsError`, unless ``overwrite``, when an
    existing key differs from the new one or the existing sheet has judged rows."""
    pairs = sorted(pairs, key=lambda pair: pair.key)
    duplicates = sorted(pair_key for pair_key, count in Counter(pair.key for pair in pairs).items() if count > 1)
    if duplicates:
        raise ValueError(f"duplicate pair keys: {duplicates}")
    folder = Path(folder)  # created by the first write
    sheet_path, key_path = folder / SHEET_NAME, folder / KEY_NAME
    rows, key = _layout(pairs, seed)
    if not overwrite:
        _guard(sheet_path, key_path, key)
    write_json(key_path, key)
    buffer = io.StringIO()
    csv.writer(buffer).writerows([COLUMNS, *rows])
    write_text_atomically(sheet_path, buffer.getvalue(), encoding="utf-8-sig")
    write_text_atomically(folder / README_NAME, README)
    return sheet_path, key_path


def _layout(pairs: list[Pair], seed: int) -> tuple[list[tuple[str, ...]], dict]:
    """The sheet's rows (cells as :data:`COLUMNS`) and the key for ``pairs`` (sorted by key) under ``seed``."""
    rng = random.Random(seed)
    order = list(pairs)
    rng.shuffle(order)
    width = max(3, len(str(len(order))))
    rows, entries = [], {}
    for number, pair in enumerate(order, start=1):
        row_id = f"h{number:0{width}d}"
        policy_column = SIDES[rng.random() < 0.5]
        first, second = (pair.policy, pair.baseline) if policy_column == "response_1" else (pair.baseline, pair.policy)
        rows.append((row_id, pair.category, prompt_text(pair.prompt), first, second, "", ""))
        entries[pair.key] = {"id": row_id, "policy_column": policy_column, "answers_sha256": answers_digest(pair)}
    about = f"Which column of {SHEET_NAME} holds the policy's answer, per pair key. Keep it from annotators."
    return rows, {"format": KEY_FORMAT, "about": about, "seed": seed, "pairs": entries}


def answers_digest(pair: Pair) -> str:
    """sha256 of the pair's prompt and both answers: tells whether the sheet shows these very answers."""
    payload = json.dumps([pair.prompt, pair.policy, pair.baseline], ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def _guard(sheet_path: Path, key_path: Path, key: dict) -> None:
    """Refuse to replace a different key or a sheet that already holds judgements."""
    old = None
    with contextlib.suppress(OSError, ValueError):  # a missing or unreadable key reads as None
        old = json.loads(key_path.read_text(encoding="utf-8"))
    if key_path.exists() and old != key:
        raise FileExistsError(
            f"{key_path} already exists for other pairs or another seed; replacing it would make a sheet filled "
            "against it worthless. Export into another folder, or pass overwrite=True."
        )
    judged = 0
    with contextlib.suppress(FileNotFoundError, ValueError):  # no sheet, or not a sheet: nothing judged
        judged = sum(bool(preferred) for _, _, preferred in _read_records(sheet_path))
    if judged:
        raise FileExistsError(
            f"{sheet_path} already has {judged} judged rows; exporting again would erase them. Import it, move it "
            "aside, or pass overwrite=True."
        )


def load_key(key: str | os.PathLike) -> dict[str, dict[str, str]]:
    """The key's ``pairs``: pair key → ``{"id", "policy_column", "answers_sha256"}``. Raises :class:`ValueError` if
    the file is not a key written by :func:`export_sheet`."""
    data = json.loads(Path(key).read_text(encoding="utf-8"))
    entries = data.get("pairs") if isinstance(data, dict) else None
    if not isinstance(data, dict) or data.get("format") != KEY_FORMAT or not isinstance(entries, dict):
        raise ValueError(f"{key} is not a human-judge key written by export_sheet")
    for pair_key, entry in entries.items():
        if not isinstance(entry, dict) or entry.get("policy_column") not in SIDES or not entry.get("id"):
            raise ValueError(f"{key}: malformed entry for pair {pair_key!r}: {entry!r}")
    return entries


def import_sheet(sheet: str | os.PathLike, key: str | os.PathLike) -> dict[str, Verdict]:
    """Pair key → verdict from the policy's side (``win``/``lose``/``tie``) for every judged row of a filled sheet.
    Tolerates what a spreadsheet does on saving: BOM or none, ``,``/``;``/tab delimiters, extra, reordered or
    differently cased columns, reordered rows, surrounding whitespace, ``1.0``/``2.0``. Rows with a blank
    ``preferred`` are left out. Raises one :class:`ValueError` listing every unknown value, unknown id and duplicate
    id, with its spreadsheet row number (the header is row 1)."""
    entries = load_key(key)
    by_id = {entry["id"]: (pair_key, entry["policy_column"]) for pair_key, entry in entries.items()}
    verdicts: dict[str, Verdict] = {}
    seen: dict[str, int] = {}
    bad_values, unknown, duplicates = [], [], []
    for row, row_id, raw in _read_records(Path(sheet)):
        if not row_id:
            if raw:
                unknown.append(f"row {row}: no id")
            continue
        if row_id in seen:
            duplicates.append(f"{row_id!r} on rows {seen[row_id]} and {row}")
            continue
        seen[row_id] = row
        if row_id not in by_id:
            unknown.append(f"row {row}: {row_id!r}")
            continue
        choice = _parse_choice(raw)
        if choice is None:
            bad_values.append(f"row {row} (id {row_id}): {raw!r}")
        elif choice:
            pair_key, policy_column = by_id[row_id]
            verdicts[pair_key] = "tie" if choice == "tie" else "win" if choice == policy_column else "lose"
    problems = []
    if bad_values:
        problems.append(f"{len(bad_values)} rows have a 'preferred' other than {ACCEPTED}: " + "; ".join(bad_values))
    if unknown:
        problems.append(f"{len(unknown)} rows have an id that is not in {key}: " + "; ".join(unknown))
    if duplicates:
        problems.append(f"{len(duplicates)} ids appear more than once: " + "; ".join(duplicates))
    if problems:
        raise ValueError(f"{sheet}:\n" + "\n".join(problems))
    return verdicts


def _parse_choice(raw: str) -> str | None:
    """The preferred column (``"response_1"``, ``"response_2"``), ``"tie"``, ``""`` (blank) or ``None`` (other)."""
    value = raw.strip().lower()
    if value in ("", "tie"):
        return value
    with contextlib.suppress(ValueError):
        return {1.0: SIDES[0], 2.0: SIDES[1]}.get(float(value))
    return None


def _read_records(path: Path) -> list[tuple[int, str, str]]:
    """``(spreadsheet row number, id, preferred)`` of each data record, stripped. Raises :class:`ValueError` if no
    delimiter gives a header with both columns."""
    text = _decode(path.read_bytes())
    first_line = text.split("\n", 1)[0]
    for delimiter in (",", ";", "\t"):
        names = next(csv.reader([first_line], delimiter=delimiter))  # one row, [] for an empty line
        header = [name.strip().strip("\ufeff").strip().lower() for name in names]
        if "id" in header and "preferred" in header:
            break
    else:
        raise ValueError(f"{path}: no 'id' and 'preferred' columns in its first line {first_line[:200]!r}")
    try:
        records = list(csv.reader(io.StringIO(text, newline=""), delimiter=delimiter))
    except csv.Error as error:
        raise ValueError(f"{path}: not a readable CSV file ({error})") from error
    i, p = header.index("id"), header.index("preferred")
    padded = (record + [""] * len(header) for record in records[1:])  # short records: blank cells
    return [(row, cells[i].strip(), cells[p].strip()) for row, cells in enumerate(padded, start=2)]


def _decode(data: bytes) -> str:
    """UTF-16 with a BOM, else UTF-8 (BOM or none), else Latin-1: only ``id`` and ``preferred`` are read back, and
    those are ASCII in any of the encodings spreadsheets save CSV in."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return data.decode("utf-16")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return data.decode("latin-1")


class HumanJudge:
    """Verdicts read from a filled blind sheet (:func:`import_sheet`) and its key. :meth:`judge` raises
    :class:`ValueError` for pairs the key does not hold or whose answers differ from those exported, and for pairs not
    judged yet unless ``allow_partial`` (they are then ``"invalid"``). Every judged pair's verdict is stored in the
    cache; the sheet, not the cache, is the source of truth."""

    name = "human"

    def __init__(self, sheet: str | os.PathLike, key: str | os.PathLike, *, allow_partial: bool = False) -> None:
        self.sheet, self.key, self.allow_partial = Path(sheet), Path(key), allow_partial

    def settings(self) -> dict:
        """The key's hash: the sheet may be re-imported from anywhere, more of it filled each time."""
        return {"judge": self.name, "key_sha256": hashlib.sha256(self.key.read_bytes()).hexdigest()}

    def judge(self, pairs: Iterable[Pair], cache: JsonlCache) -> list[Verdict]:
        pairs = list(pairs)
        entries = load_key(self.key)
        missing = [pair.key for pair in pairs if pair.key not in entries]
        changed = [p.key for p in pairs if p.key in entries and entries[p.key]["answers_sha256"] != answers_digest(p)]
        problems = []
        if missing:
            problems.append(f"{len(missing)} pairs are not in {self.key} (exported for other pairs?): {missing[:20]}")
        if changed:
            problems.append(
                f"{len(changed)} pairs have other prompts or answers than the sheet shows (regenerated?): "
                f"{changed[:20]}; export a new sheet"
            )
        if problems:
            raise ValueError("\n".join(problems))
        judged = import_sheet(self.sheet, self.key)
        blank = [entries[pair.key]["id"] for pair in pairs if pair.key not in judged]
        if blank and not self.allow_partial:
            shown = ", ".join(sorted(blank)[:20]) + (", …" if len(blank) > 20 else "")
            raise ValueError(
                f"{len(blank)} of {len(pairs)} pairs are not judged yet in {self.sheet} (blank 'preferred' or row "
                f"missing; ids {shown}). Fill them in, or pass allow_partial=True to count them as invalid."
            )
        for pair in pairs:
            if pair.key in judged and cache.get(pair.key) != judged[pair.key]:
                cache.put(pair.key, judged[pair.key])
        return [judged.get(pair.key, "invalid") for pair in pairs]
