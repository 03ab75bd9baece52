"""``evaluate_policy``: answers from both sides, every judge's verdicts, ``report.json``, the table and the figure.
Everything lands in ``output_dir`` as it is made (``generations.jsonl``, ``verdicts/<judge>.jsonl``), so running it
again resumes without generating or asking a judge twice; a folder made under other settings (models, prompts,
sampling, a judge's model or prompt) is refused rather than mixed."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

from datasets import Dataset

from trl_ppomax.data.files import read_json, write_json, write_text_atomically
from trl_ppomax.judging.answers import GenerationSettings, make_pairs
from trl_ppomax.judging.base import JsonlCache, Judge
from trl_ppomax.judging.report import format_table, plot_win_tie_lose, tally


def evaluate_policy(
    policy,
    baseline,
    prompts: Dataset,
    output_dir: str | os.PathLike,
    judges: Sequence[Judge],
    generation: GenerationSettings | None = None,
    names: dict[str, str] | None = None,
) -> dict:
    """Compare ``policy`` with ``baseline`` (paths, Hub ids or ``(model, tokenizer)``) on ``prompts`` (a ``prompt``
    and a ``category`` column: :func:`~trl_ppomax.judging.answers.load_prompts`) with each judge; returns and
    writes ``report.json``::

        {"policy", "baseline", "num_prompts", "generation": {...},
         "judges": {"<judge>": {"settings": {...}, "categories": {"<category>" | "all":
             {"win", "tie", "lose", "invalid", "n", "win_rate", "win_rate_ci95": [lo, hi]}}}}}

    counted from the policy's side. ``names`` labels the two sides in the report (default: their paths)."""
    generation = generation or GenerationSettings()
    output = Path(output_dir)
    names = names or {"policy": _label(policy), "baseline": _label(baseline)}
    columns = json.dumps(prompts.select_columns(["prompt", "category"]).to_dict(), sort_keys=True)
    fingerprint = hashlib.sha256(columns.encode()).hexdigest()
    claim(output / "settings.json", {**names, "prompts": fingerprint, "generation": generation.as_dict()})
    pairs = make_pairs(policy, baseline, prompts, generation, JsonlCache(output / "generations.jsonl"))
    write_text_atomically(
        output / "pairs.jsonl", "".join(json.dumps(p.as_dict(), ensure_ascii=False) + "\n" for p in pairs)
    )
    report = {**names, "num_prompts": len(pairs), "generation": generation.as_dict(), "judges": {}}
    for judge in judges:  # each judge's verdicts cached in verdicts/<name>.jsonl
        claim(output / "verdicts" / f"{judge.name}.settings.json", judge.settings())
        verdicts = judge.judge(pairs, JsonlCache(output / "verdicts" / f"{judge.name}.jsonl"))
        categories = tally(verdicts, [p.category for p in pairs])
        report["judges"][judge.name] = {"settings": judge.settings(), "categories": categories}
    write_json(output / "report.json", report)
    tables = {name: entry["categories"] for name, entry in report["judges"].items()}
    if tables:
        print(format_table(tables))
        figure = plot_win_tie_lose(tables, output / "report.png", f"{names['policy']} vs {names['baseline']}")
        print(f"\n{output / 'report.json'} and {figure} written.")
    return report


def claim(path: Path, settings: dict) -> None:
    """Write ``settings`` to ``path``, or check that the ones already there are the same: the cached work beside it
    was made under them."""
    settings = json.loads(json.dumps(settings))  # as JSON reads them back (tuples → lists)
    if not path.exists():
        write_json(path, settings)
    elif (saved := read_json(path)) != settings:
        changed = sorted(k for k in saved.keys() | settings.keys() if saved.get(k) != settings.get(k))
        raise ValueError(
            f"{path.parent} holds an evaluation made under other settings ({', '.join(changed)} differ from "
            f"{path.name}); its cached answers or verdicts would be mixed with new ones. Use another --output "
            "folder, or delete that folder (or the judge's files under verdicts/) to start afresh."
        )


def _label(side) -> str:
    if isinstance(side, tuple):
        return getattr(side[0], "name_or_path", None) or type(side[0]).__name__
    return os.fspath(side)
