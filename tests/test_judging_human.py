"""The human judge's blind A/B sheet: export, fill (as an annotator or a spreadsheet would), import."""

from __future__ import annotations

import csv
import hashlib
import json

import pytest

from trl_ppomax.judging.base import JsonlCache, Pair, prompt_key, prompt_text
from trl_ppomax.judging.human import COLUMNS, HumanJudge, export_sheet, import_sheet

CONVERSATION = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Say hi, politely."},
]
TRICKY = 'Line one, with a comma\nLine "two" with quotes\r\nand "", done'
CHINESE = "你好，世界！这是一个中文回答。"


def make_pairs(n: int = 40) -> list[Pair]:
    pairs = [
        Pair(prompt_key(0, CONVERSATION), CONVERSATION, "Hello there!", "hi", "chat"),
        Pair(prompt_key(1, "用中文打招呼"), "用中文打招呼", CHINESE, "Hello", "zh"),
        Pair(prompt_key(2, 'Tricky, "quoted"\nprompt'), 'Tricky, "quoted"\nprompt', TRICKY, "=1+1", "edge"),
    ]
    for i in range(3, n):
        prompt = f"Question {i}?"
        pairs.append(Pair(prompt_key(i, prompt), prompt, f"Sure, {i}.", f"Maybe {i}."))
    return pairs


def intended_verdicts(pairs: list[Pair]) -> dict[str, str]:
    return {pair.key: ("win", "lose", "tie")[i % 3] for i, pair in enumerate(pairs)}


def read_sheet(sheet) -> tuple[list[str], list[dict[str, str]]]:
    with open(sheet, encoding="utf-8-sig", newline="") as file:
        reader = csv.DictReader(file)
        return list(reader.fieldnames), list(reader)


def write_sheet(sheet, header, rows, encoding="utf-8-sig", delimiter=",") -> None:
    with open(sheet, "w", encoding=encoding, newline="") as file:
        writer = csv.DictWriter(file, fieldnames=header, delimiter=delimiter, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def fill(sheet, key, verdicts: dict[str, str], one="1", two="2", tie="tie", skip=()) -> None:
    """Fill the sheet as an annotator would, choosing the column that gives each pair its intended verdict."""
    entries = json.loads(key.read_text(encoding="utf-8"))["pairs"]
    by_id = {entry["id"]: (pair_key, entry["policy_column"]) for pair_key, entry in entries.items()}
    header, rows = read_sheet(sheet)
    for row in rows:
        pair_key, policy_column = by_id[row["id"]]
        if pair_key in skip:
            continue
        verdict = verdicts[pair_key]
        policy_is_1 = policy_column == "response_1"
        row["preferred"] = tie if verdict == "tie" else one if (verdict == "win") == policy_is_1 else two
    write_sheet(sheet, header, rows)


def test_round_trip(tmp_path):
    pairs = make_pairs()
    sheet, key = export_sheet(pairs, tmp_path / "eval")
    intended = intended_verdicts(pairs)
    fill(sheet, key, intended)
    assert import_sheet(sheet, key) == intended

    cache = JsonlCache(tmp_path / "cache.jsonl")
    judge = HumanJudge(sheet, key)
    assert judge.name == "human"
    assert judge.judge(pairs, cache) == [intended[pair.key] for pair in pairs]
    assert {pair.key: cache.get(pair.key) for pair in pairs} == intended
    lines = cache.path.read_text(encoding="utf-8").count("\n")
    judge.judge(reversed(pairs), cache)
    assert cache.path.read_text(encoding="utf-8").count("\n") == lines  # unchanged verdicts are not stored twice
    assert judge.settings() == {"judge": "human", "key_sha256": hashlib.sha256(key.read_bytes()).hexdigest()}


def test_sheet_format_and_readme(tmp_path):
    pairs = make_pairs(5)
    sheet, key = export_sheet(pairs, tmp_path)
    assert sheet.read_bytes().startswith(b"\xef\xbb\xbf")
    header, rows = read_sheet(sheet)
    assert tuple(header) == COLUMNS
    assert len(rows) == len(pairs)
    entries = json.loads(key.read_text(encoding="utf-8"))["pairs"]
    by_id = {row["id"]: row for row in rows}
    for pair in pairs:
        row = by_id[entries[pair.key]["id"]]
        assert row["prompt"] == prompt_text(pair.prompt)
        assert row["category"] == pair.category
        assert row["preferred"] == row["comment"] == ""
        policy_column = entries[pair.key]["policy_column"]
        other = "response_2" if policy_column == "response_1" else "response_1"
        assert (row[policy_column], row[other]) == (pair.policy, pair.baseline)  # newlines, quotes, Chinese intact
    assert by_id[entries[pairs[0].key]["id"]]["prompt"] == "System: You are helpful.\nUser: Say hi, politely."
    readme = (tmp_path / "HUMAN_SHEET_README.txt").read_text(encoding="utf-8")
    assert "tie" in readme and "human_key.json" in readme
    assert not list(tmp_path.glob(".*.tmp"))


def test_sides_randomised_and_seeded(tmp_path):
    pairs = make_pairs()
    _, key = export_sheet(pairs, tmp_path / "a", seed=3)
    columns = [entry["policy_column"] for entry in json.loads(key.read_text(encoding="utf-8"))["pairs"].values()]
    assert {"response_1", "response_2"} == set(columns)

    same_sheet, same_key = export_sheet(list(reversed(pairs)), tmp_path / "b", seed=3)  # input order is irrelevant
    assert same_sheet.read_bytes() == (tmp_path / "a" / "human_sheet.csv").read_bytes()
    assert same_key.read_bytes() == key.read_bytes()
    other_sheet, _ = export_sheet(pairs, tmp_path / "c", seed=4)
    assert other_sheet.read_bytes() != same_sheet.read_bytes()


def test_sheet_does_not_reveal_the_policy(tmp_path):
    pairs = make_pairs()
    sheet, key = export_sheet(pairs, tmp_path)
    text = sheet.read_text(encoding="utf-8-sig").lower()
    assert "policy" not in text and "baseline" not in text
    assert not any(pair.key in text for pair in pairs)
    _, rows = read_sheet(sheet)
    entries = json.loads(key.read_text(encoding="utf-8"))["pairs"]
    row_of = {row["id"]: number for number, row in enumerate(rows)}
    assert [row_of[entries[pair.key]["id"]] for pair in pairs] != list(range(len(pairs)))  # rows are shuffled
    assert [row["id"] for row in rows] == sorted(row["id"] for row in rows)  # ids follow the shuffled order only


@pytest.mark.parametrize("delimiter", [",", ";"])
def test_spreadsheet_resave(tmp_path, delimiter):
    pairs = make_pairs()
    sheet, key = export_sheet(pairs, tmp_path)
    intended = intended_verdicts(pairs)
    fill(sheet, key, intended, one="1.0", two=" 2 ", tie=" TIE ")
    header, rows = read_sheet(sheet)
    for row in rows:
        row["id"] = f"  {row['id']} "
        row["Reviewer"] = "ann"
    header = ["Reviewer", "Preferred ", *reversed(header[:-2]), "comment"]
    rows = [{**row, "Preferred ": row["preferred"]} for row in reversed(rows)]
    write_sheet(sheet, header, rows, encoding="utf-8", delimiter=delimiter)  # no BOM
    assert not sheet.read_bytes().startswith(b"\xef\xbb\xbf")
    assert import_sheet(sheet, key) == intended


def test_blank_rows_are_not_judged(tmp_path):
    pairs = make_pairs(12)
    sheet, key = export_sheet(pairs, tmp_path)
    intended = intended_verdicts(pairs)
    blank = {pairs[1].key, pairs[5].key}
    fill(sheet, key, intended, skip=blank)
    judged = import_sheet(sheet, key)
    assert judged == {k: v for k, v in intended.items() if k not in blank}

    cache = JsonlCache(tmp_path / "cache.jsonl")
    with pytest.raises(ValueError, match="2 of 12 pairs are not judged yet") as error:
        HumanJudge(sheet, key).judge(pairs, cache)
    assert "allow_partial" in str(error.value)
    assert len(cache) == 0
    verdicts = HumanJudge(sheet, key, allow_partial=True).judge(pairs, cache)
    assert verdicts == [("invalid" if pair.key in blank else intended[pair.key]) for pair in pairs]
    assert not any(key in cache for key in blank) and len(cache) == 10


def test_bad_values_are_listed(tmp_path):
    pairs = make_pairs(6)
    sheet, key = export_sheet(pairs, tmp_path)
    header, rows = read_sheet(sheet)
    rows[1]["preferred"], rows[4]["preferred"], rows[2]["preferred"] = "A", "3", "tie"
    write_sheet(sheet, header, rows)
    with pytest.raises(ValueError) as error:
        import_sheet(sheet, key)
    message = str(error.value)
    assert f"row 3 (id {rows[1]['id']}): 'A'" in message
    assert f"row 6 (id {rows[4]['id']}): '3'" in message
    assert "2 rows" in message and "'1', '2', 'tie'" in message


def test_unknown_and_duplicate_ids(tmp_path):
    pairs = make_pairs(4)
    sheet, key = export_sheet(pairs, tmp_path)
    header, rows = read_sheet(sheet)
    rows.append({**rows[0], "preferred": "1"})
    rows.append({**rows[1], "id": "h999", "preferred": "2"})
    write_sheet(sheet, header, rows)
    with pytest.raises(ValueError) as error:
        import_sheet(sheet, key)
    message = str(error.value)
    assert f"{rows[0]['id']!r} on rows 2 and 6" in message
    assert "row 7: 'h999'" in message and "not in" in message


def test_judge_rejects_foreign_or_changed_pairs(tmp_path):
    pairs = make_pairs(4)
    sheet, key = export_sheet(pairs, tmp_path)
    fill(sheet, key, intended_verdicts(pairs))
    cache = JsonlCache(tmp_path / "cache.jsonl")
    changed = Pair(pairs[3].key, pairs[3].prompt, "a regenerated answer", pairs[3].baseline)
    with pytest.raises(ValueError, match="other prompts or answers"):
        HumanJudge(sheet, key).judge([*pairs[:3], changed], cache)
    with pytest.raises(ValueError, match="not in"):
        HumanJudge(sheet, key).judge([*pairs, Pair("99-x", "new", "a", "b")], cache)


def test_key_overwrite_guard(tmp_path):
    pairs = make_pairs(6)
    sheet, key = export_sheet(pairs, tmp_path)
    original = key.read_bytes()
    export_sheet(pairs, tmp_path)  # same pairs, same seed, blank sheet: the same files again
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_sheet(pairs[:5], tmp_path)
    with pytest.raises(FileExistsError):
        export_sheet(pairs, tmp_path, seed=1)
    assert key.read_bytes() == original

    fill(sheet, key, intended_verdicts(pairs))
    with pytest.raises(FileExistsError, match="6 judged rows"):
        export_sheet(pairs, tmp_path)
    assert import_sheet(sheet, key) == intended_verdicts(pairs)

    export_sheet(pairs[:5], tmp_path, overwrite=True)
    assert len(json.loads(key.read_text(encoding="utf-8"))["pairs"]) == 5
    assert import_sheet(sheet, key) == {}


def test_duplicate_pair_keys_are_refused(tmp_path):
    pairs = make_pairs(3)
    with pytest.raises(ValueError, match="duplicate pair keys"):
        export_sheet([*pairs, pairs[0]], tmp_path)
