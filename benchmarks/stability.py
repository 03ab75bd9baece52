"""Stability in the toy world: vanilla PPO vs trl-style PPO vs PPO-max, and single-trick ablations.

Every method starts from the same SFT policy and reward model (the cached toy world), samples the same way and runs
the same number of iterations; the gold reward is known, so over-optimisation of the proxy is measured directly.

    python benchmarks/stability.py --quick --output benchmarks/results/stability_quick.json   # ~5 min on 2 cores
    python benchmarks/stability.py --seed 0 1 2 --output benchmarks/results/stability.json     # the full run

JSON: {"sft": {...}, "methods": {name: {<final fields, mean over seeds>, "seeds": [...], "curves": {...}}}}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from trl_ppomax.metrics import EPISODE
from trl_ppomax.plotting import plot_training_dynamics
from trl_ppomax.toyworld.pipeline import (
    CURVE_KEYS,
    METHODS,
    WorldSettings,
    prepare_world,
    run_method,
    win_tie_lose_vs_sft,
)

FINAL_FIELDS = (
    "gold_reward_final",
    "gold_reward_best",
    "proxy_reward_final",
    "kl_final",
    "response_length_final",
    "perplexity_final",
    "win_rate_vs_sft",
)
SFT_FIELDS = ("gold_reward", "proxy_reward", "response_length", "perplexity")
PLOTTED_CURVES = ("gold_reward", "proxy_reward", "kl", "perplexity", "response_length")


def run_seed(world, method: str, seed: int, iterations: int) -> tuple[dict, dict, dict]:
    with tempfile.TemporaryDirectory() as output:
        trainer, sft, final, curves = run_method(world, method, output, iterations=iterations, seed=seed)
        versus_sft = win_tie_lose_vs_sft(trainer, world, Path(output) / "vs_sft", seed=seed)
    result = {
        "seed": seed,
        "gold_reward_final": final["gold_reward"],
        "gold_reward_best": max(curves["gold_reward"]),
        "proxy_reward_final": final["proxy_reward"],
        "kl_final": final["kl"],
        "response_length_final": final["response_length"],
        "perplexity_final": final["perplexity"],
        "win_rate_vs_sft": versus_sft["win_rate"],  # gold judge, 64 held-out prompts
        "vs_sft": {k: versus_sft[k] for k in ("win", "tie", "lose", "n")},
    }
    return result, {k: sft[k] for k in SFT_FIELDS}, curves


def mean_curves(per_seed: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    length = min(len(c["episode"]) for c in per_seed)
    return {key: [statistics.fmean(c[key][i] for c in per_seed) for i in range(length)] for key in per_seed[0]}


def as_log_history(curves: dict[str, list[float]]) -> list[dict[str, float]]:
    """Mean curves (keyed by the toy world's curve names) as a log history (keyed by metric names) for plotting."""
    keys = {name: CURVE_KEYS[name] for name in PLOTTED_CURVES}
    return [
        {EPISODE: episode, **{key: curves[name][i] for name, key in keys.items()}}
        for i, episode in enumerate(curves["episode"])
    ]


def plot(results: dict, path: Path) -> None:
    """The methods' mean curves overlaid (trl_ppomax.plotting), with the SFT policy's gold reward as a reference."""
    histories = {name: as_log_history(method["curves"]) for name, method in results["methods"].items()}
    first, *others = histories
    plot_training_dynamics(
        histories[first],
        path,
        title=f"Stability in the toy world ({results['iterations']} iterations, seeds {results['seeds']})",
        extra={name: histories[name] for name in others},
        name=first,
        baselines={"SFT": {CURVE_KEYS["gold_reward"]: results["sft"]["gold_reward"]}},
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one seed, 60 iterations: a few minutes on a laptop")
    parser.add_argument("--seed", type=int, nargs="+", help="PPO seeds (default: 0 1 2, or 0 with --quick)")
    parser.add_argument("--iterations", type=int, help="PPO iterations per run (default: 150, or 60 with --quick)")
    parser.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=list(METHODS))
    parser.add_argument("--output", default="benchmarks/results/stability.json")
    parser.add_argument("--cache-dir", help="where the toy world's SFT policy and reward model are cached")
    args = parser.parse_args(argv)
    seeds = args.seed or ([0] if args.quick else [0, 1, 2])
    iterations = args.iterations or (60 if args.quick else 150)
    start = time.time()
    world = prepare_world(WorldSettings(), cache_dir=args.cache_dir)
    results = {
        "command": " ".join(["python benchmarks/stability.py", *(argv if argv is not None else sys.argv[1:])]),
        "iterations": iterations,
        "seeds": seeds,
        "world": world.report,
        "sft": {},
        "methods": {},
    }
    sft_per_seed = []
    for method in args.methods:
        runs, curves = [], []
        for seed in seeds:
            result, sft, curve = run_seed(world, method, seed, iterations)
            runs.append(result)
            curves.append(curve)
            sft_per_seed.append(sft)
            print(f"{method:>20} seed {seed}: " + ", ".join(f"{k} {result[k]:.3f}" for k in FINAL_FIELDS), flush=True)
        summary = {key: statistics.fmean(r[key] for r in runs) for key in FINAL_FIELDS}
        results["methods"][method] = {**summary, "seeds": runs, "curves": mean_curves(curves)}
    results["sft"] = {key: statistics.fmean(s[key] for s in sft_per_seed) for key in SFT_FIELDS}
    results["seconds"] = time.time() - start
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=1))
    plot(results, output.with_suffix(".png"))
    print("\nSFT: " + ", ".join(f"{k} {v:.3f}" for k, v in results["sft"].items()))
    print(f"{'method':>20}" + "".join(f"{k:>23}" for k in FINAL_FIELDS))
    for name, method in results["methods"].items():
        print(f"{name:>20}" + "".join(f"{method[k]:>23.3f}" for k in FINAL_FIELDS))
    print(f"\n{output} and {output.with_suffix('.png')} written in {results['seconds']:.0f} s")
    return results


if __name__ == "__main__":
    main()
