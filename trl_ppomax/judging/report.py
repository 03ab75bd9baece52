"""Win / tie / lose counts per category, their win rate with a 95 % interval, the terminal table and the stacked-bar
figure in the style of the paper's Fig. 10."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from trl_ppomax.judging.base import ALL, VERDICTS, Verdict

Z_95 = 1.959963984540054  # the standard normal's 97.5 % quantile


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion p̂ = successes / n:
    ``(p̂ + z²/2n ± z·sqrt(p̂(1−p̂)/n + z²/4n²)) / (1 + z²/n)``; ``(0, 1)`` when n = 0."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    denominator = 1 + z * z / n
    return max(0.0, (centre - spread) / denominator), min(1.0, (centre + spread) / denominator)


def count(verdicts: Sequence[Verdict]) -> dict:
    """``{"win", "tie", "lose", "invalid", "n", "win_rate", "win_rate_ci95"}`` from the policy's side; ``n`` counts
    the valid verdicts (win + tie + lose) and ``win_rate = win / n`` (the paper's win percentage; NaN when n = 0)."""
    counts = {verdict: sum(v == verdict for v in verdicts) for verdict in VERDICTS}
    n = counts["win"] + counts["tie"] + counts["lose"]
    lo, hi = wilson_interval(counts["win"], n)
    return {**counts, "n": n, "win_rate": counts["win"] / n if n else float("nan"), "win_rate_ci95": [lo, hi]}


def tally(verdicts: Sequence[Verdict], categories: Sequence[str]) -> dict[str, dict]:
    """:func:`count` per category (in order of first appearance) and over all prompts (``"all"``, last)."""
    if len(verdicts) != len(categories):
        raise ValueError(f"{len(verdicts)} verdicts for {len(categories)} categories.")
    names = [c for c in dict.fromkeys(categories) if c != ALL]
    result = {name: count([v for v, c in zip(verdicts, categories, strict=True) if c == name]) for name in names}
    return {**result, ALL: count(list(verdicts))}


def format_table(judges: Mapping[str, Mapping[str, dict]]) -> str:
    """One row per judge and category: win / tie / lose (%), invalid, n and the win rate with its interval."""
    header = (
        f"{'judge':<8}{'category':<16}{'win %':>7}{'tie %':>7}{'lose %':>8}{'invalid':>9}{'n':>6}  win rate (95% CI)"
    )
    lines = [header, "-" * len(header)]
    for judge, categories in judges.items():
        for category, c in categories.items():
            share = [100 * c[v] / c["n"] if c["n"] else float("nan") for v in ("win", "tie", "lose")]
            lo, hi = c["win_rate_ci95"]
            lines.append(
                f"{judge:<8}{category:<16}{share[0]:>7.1f}{share[1]:>7.1f}{share[2]:>8.1f}{c['invalid']:>9d}"
                f"{c['n']:>6d}  {c['win_rate']:.3f} [{lo:.3f}, {hi:.3f}]"
            )
    return "\n".join(lines)


COLORS = {"win": "#4c9a4c", "tie": "#b0b0b0", "lose": "#c8504a"}


def plot_win_tie_lose(judges: Mapping[str, Mapping[str, dict]], path: str | Path, title: str | None = None) -> str:
    """Horizontal stacked bars of win / tie / lose (%) per judge and category (the paper's Fig. 10), written to the
    PNG ``path``; returns the path."""
    from matplotlib.figure import Figure

    rows = [(f"{judge} · {category}", c) for judge, categories in judges.items() for category, c in categories.items()]
    figure = Figure(figsize=(8, 0.6 * len(rows) + 1.4))
    axes = figure.add_subplot()
    for y, (_, c) in enumerate(rows):
        left = 0.0
        for verdict in ("win", "tie", "lose"):
            share = 100 * c[verdict] / c["n"] if c["n"] else 0.0
            axes.barh(y, share, left=left, color=COLORS[verdict], label=verdict if y == 0 else None)
            if share >= 6:
                axes.text(left + share / 2, y, f"{share:.0f}", ha="center", va="center", fontsize=9)
            left += share
    axes.set_yticks(range(len(rows)), [label for label, _ in rows])
    axes.invert_yaxis()
    axes.set_xlim(0, 100)
    axes.set_xlabel("% of prompts (policy's side)")
    axes.legend(ncols=3, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    if title:
        figure.suptitle(title, y=0.99)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=100)
    return str(path)
