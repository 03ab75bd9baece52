"""Stability in the toy world: vanilla PPO vs trl-style PPO vs PPO-max, and single-trick ablations.

Every method starts from the same SFT policy and reward model (the cached toy world), samples the same way and runs
the same number of iterations; the gold reward is known, so over-optimisation of the proxy is measured directly.

    python benchmarks/stability.py --quick --output benchmarks/results/stability_quick.json   # ~5 min on 2 cores
    python benchmarks/stability.py --seed 0 1 2 --output benchmarks/results/stability.json     # the full run
    python benchmarks/stability.py --stress                                                    # the stress test

JSON: {"sft": {...}, "methods": {name: {<final fields, mean over seeds>, "seeds": [...], "curves": {...}}}}.

--stress: every method (default: STRESS_METHODS: trl_ppo, ppo_max, ppo_max_robust, the critic-free estimators, the
KL as a k2 loss, clip-higher) under every condition of CONDITIONS (default: all; each applied
identically to every method through the trainer's reward sources and config: baseline, reward_scale_10,
reward_scale_0.1, reward_offset_5, reward_outliers, lr_x3, long, long_responses, reward_drift), seeds 0 1 2,
60 iterations (`long`: 3×). Every finished (condition, method, seed) run is appended at once to <output
stem>.runs.jsonl and not run again when the command is repeated (--fresh starts over); the runs' own output goes to
<output stem>.runs.log. JSON (default benchmarks/results/stability_stress.json): {"sft": {...}, "conditions":
{condition: {"description", "iterations", "sft", "methods": {name: {<final fields, mean over seeds>,
"gold_reward_final_std", "seeds", "failed", "curves"}}}}}; figures <output stem>_<condition>.png and
<output stem>_summary.png.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from transformers import TrainerCallback

from trl_ppomax.base.metrics import EPISODE
from trl_ppomax.data.files import atomic_file, write_json
from trl_ppomax.reporting.plotting import training_dynamics_figure
from trl_ppomax.toyworld.build import WorldSettings, prepare_world
from trl_ppomax.toyworld.pipeline import CURVE_KEYS, METHODS, ppo_config, run_method, win_tie_lose_vs_sft

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
QUICK_METHODS = (
    "vanilla_ppo",
    "trl_ppo",
    "ppo_max",
    "ppo_max_whitened",
    "reward_norm_only",
    "critic_warmup_only",
    "ptx_only",
)
STRESS_METHODS = (
    "trl_ppo",
    "ppo_max",
    "ppo_max_robust",
    # Issue 33: critic-free estimators, the KL as a loss (k2) and clip-higher
    "rloo",
    "reinforce_pp_baseline",
    "grpo",
    "ppo_max_kl_loss_k2",
    "ppo_max_clip_higher",
)
#: The robust preset minus one option at a time (issue 24's grid): run them with --methods.
ROBUST_ABLATIONS = (
    "ppo_max_robust_no_freeze",
    "ppo_max_robust_no_winsorize",
    "ppo_max_robust_no_lam_critic",
    "ppo_max_robust_no_lam_alpha",
)
#: The paper's ablations (issue 22's grid): run them with --methods.
PAPER_ABLATIONS = (
    "vanilla_ppo",
    "ppo_max_no_reward_norm",
    "ppo_max_no_reward_clip",
    "ppo_max_no_critic_warmup",
    "ppo_max_no_grad_clip",
    "ppo_max_no_kl",
    "ppo_max_whitened",
)
STRESS_ITERATIONS = 60  # the quick benchmark's


# --------------------------------------------------------------------------------------------------------------------
# Stress conditions, applied through the trainer's public API (reward sources and weights, config fields)
# --------------------------------------------------------------------------------------------------------------------
def offset_reward(offset: float = 5.0):
    """A reward function adding ``offset`` to every score (a second source with weight 1)."""

    def reward_offset(prompts, completions, **kwargs) -> list[float]:
        return [float(offset)] * len(completions)

    return reward_offset


def outlier_value(seed: int, prompt, completion, rate: float = 0.03, scale: float = 3.0, cap: float = 300.0) -> float:
    """0, or for a share ``rate`` of (prompt, completion) pairs a Cauchy(0, ``scale``) draw clipped to ±``cap``; both
    decided by a hash of (seed, prompt, completion), so the same response always gets the same perturbation."""
    digest = hashlib.sha256(f"{seed}\0{prompt}\0{completion}".encode()).digest()
    hit, draw = (int.from_bytes(digest[i : i + 8], "big") / 2**64 for i in (0, 8))
    if hit >= rate:
        return 0.0
    return max(-cap, min(cap, scale * math.tan(math.pi * (draw - 0.5))))


def outlier_reward(seed: int, rate: float = 0.03, scale: float = 3.0, cap: float = 300.0):
    """A reward function that leaves most scores alone and perturbs ~``rate`` of them by a heavy-tailed amount
    (:func:`outlier_value`): added to the reward model's score, a reward model with sporadic wild scores."""

    def reward_outliers(prompts, completions, **kwargs) -> list[float]:
        return [outlier_value(seed, p, c, rate, scale, cap) for p, c in zip(prompts, completions, strict=True)]

    return reward_outliers


class StyleDrift(TrainerCallback):
    """A reward source whose preference between two gold-neutral styles flips halfway through the run: +``size`` for a
    response using the word "very", −``size`` for one using "so" (0 for both or neither) until iteration
    ``flip_at``, the opposite after. Added to the reward model's score, a reward model that drifts; also a callback,
    which tells it the iteration."""

    def __init__(self, flip_at: int, size: float = 1.0) -> None:
        self.flip_at, self.size, self.flipped = flip_at, size, False
        self.__name__ = "reward_drift"

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        sign = -self.size if self.flipped else self.size
        return [sign * (("very" in c.split()) - ("so" in c.split())) for c in completions]

    def on_step_begin(self, args, state, control, **kwargs):
        self.flipped = state.global_step >= self.flip_at


class Condition(NamedTuple):  # not a dataclass: the tests load this script without registering it as a module
    """A stress applied identically to every method."""

    description: str
    reward_weight: float = 1.0  # weight of the reward model: its scores × this
    # (seed, iterations) → a reward function added with weight 1 (also registered as a callback if it is one)
    extra_reward: Callable[[int, int], Callable] | None = None
    lr_factor: float = 1.0  # the policy's and the critic's learning rates × this
    iterations_factor: int = 1
    config: dict | None = None  # further config overrides

    @property
    def changes_reward(self) -> bool:
        return self.reward_weight != 1.0 or self.extra_reward is not None


CONDITIONS: dict[str, Condition] = {
    "baseline": Condition("no stress (the reference for the others)"),
    "reward_scale_10": Condition("the reward model's score × 10 (reward_weights=[10])", reward_weight=10.0),
    "reward_scale_0.1": Condition("the reward model's score × 0.1 (reward_weights=[0.1])", reward_weight=0.1),
    "reward_offset_5": Condition(
        "the reward model's score + 5 (a constant second source)", extra_reward=lambda s, n: offset_reward(5.0)
    ),
    "reward_outliers": Condition(
        "+ Cauchy(0, 3) clipped to ±300 on ~3 % of responses, fixed by a hash of (seed, prompt, response)",
        extra_reward=lambda s, n: outlier_reward(s),
    ),
    "lr_x3": Condition("the policy's and the critic's learning rates × 3", lr_factor=3.0),
    "long": Condition("3× the iterations", iterations_factor=3),
    "long_responses": Condition(
        "no stop token: every response is 32 tokens, scored only at its end (4× the SFT policy's length)",
        config={"stop_token": None, "response_length": 32},
    ),
    "reward_drift": Condition(
        "+1 for 'very', −1 for 'so' (gold-neutral words), the sign flipping halfway: a reward model that drifts",
        extra_reward=lambda s, n: StyleDrift(flip_at=n // 2),
    ),
}


def condition_iterations(condition: str, iterations: int) -> int:
    return iterations * CONDITIONS[condition].iterations_factor


def condition_arguments(condition: str, method: str, seed: int, iterations: int = STRESS_ITERATIONS) -> dict:
    """``run_method``'s ``config_overrides``, ``extra_rewards`` and ``callbacks`` for ``method`` under ``condition``
    in a run of ``iterations``."""
    spec = CONDITIONS[condition]
    overrides, extra = dict(spec.config or {}), []
    if spec.extra_reward is not None:
        extra = [spec.extra_reward(seed, iterations)]
        overrides["reward_weights"] = [spec.reward_weight, 1.0]
    elif spec.reward_weight != 1.0:
        overrides["reward_weights"] = [spec.reward_weight]
    if spec.lr_factor != 1.0:
        base = ppo_config("unused", method, seed=seed)  # the method's rates; the critic's defaults to the policy's
        overrides["learning_rate"] = base.learning_rate * spec.lr_factor
        overrides["critic_learning_rate"] = base.effective_critic_learning_rate * spec.lr_factor
    callbacks = [f for f in extra if isinstance(f, TrainerCallback)]
    return {"config_overrides": overrides, "extra_rewards": extra, "callbacks": callbacks}


class _Quiet(TrainerCallback):
    """Removes the trainer's per-iteration metric printing (run_method's hook), so the progress bar stays readable."""

    replaces_printer = True


# --------------------------------------------------------------------------------------------------------------------
# One run, and the mean over seeds
# --------------------------------------------------------------------------------------------------------------------
def run_seed(
    world, method: str, seed: int, iterations: int, condition: str | None = None, callbacks=None
) -> tuple[dict, dict, dict]:
    """Train ``method`` (under the stress ``condition``, if any) for ``iterations``: ``(result, sft, curves)``."""
    arguments = condition_arguments(condition, method, seed, iterations) if condition else {}
    callbacks = [*(callbacks or []), *arguments.pop("callbacks", [])]
    with tempfile.TemporaryDirectory() as output:
        trainer, sft, final, curves = run_method(
            world, method, output, iterations=iterations, seed=seed, callbacks=callbacks, **arguments
        )
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


def method_summary(runs: list[dict], curves: list[dict]) -> dict:
    """Mean of the final fields over the seeds' ``runs``, the runs themselves and the mean ``curves``."""
    summary = {key: statistics.fmean(r[key] for r in runs) for key in FINAL_FIELDS}
    return {**summary, "seeds": runs, "curves": mean_curves(curves)}


def mean_sft(per_run: list[dict]) -> dict:
    return {key: statistics.fmean(s[key] for s in per_run) for key in SFT_FIELDS}


# --------------------------------------------------------------------------------------------------------------------
# Figures and files
# --------------------------------------------------------------------------------------------------------------------
def save_figure(fig, path: Path) -> None:
    with atomic_file(path) as temporary:
        fig.savefig(temporary, format="png", dpi=100)


def as_log_history(curves: dict[str, list[float]]) -> list[dict[str, float]]:
    """Mean curves (keyed by the toy world's curve names) as a log history (keyed by metric names) for plotting."""
    keys = {name: CURVE_KEYS[name] for name in PLOTTED_CURVES}
    return [
        {EPISODE: episode, **{key: curves[name][i] for name, key in keys.items()}}
        for i, episode in enumerate(curves["episode"])
    ]


def plot(results: dict, path: Path, title: str | None = None) -> None:
    """The methods' mean curves overlaid (trl_ppomax.reporting.plotting), with the SFT policy's gold reward as a reference."""
    histories = {name: as_log_history(m["curves"]) for name, m in results["methods"].items() if m["curves"]}
    if not histories:
        return
    first, *others = histories
    fig = training_dynamics_figure(
        histories[first],
        title=title or f"Stability in the toy world ({results['iterations']} iterations, seeds {results['seeds']})",
        extra={name: histories[name] for name in others},
        name=first,
        baselines={"SFT": {CURVE_KEYS["gold_reward"]: results["sft"]["gold_reward"]}},
    )
    save_figure(fig, path)


def plot_summary(results: dict, path: Path) -> None:
    """Final gold reward by condition (groups) and method (bars): the mean over seeds, the seeds' spread (std) as
    error bars and each seed as a dot; the SFT policy's gold reward as a dashed line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    conditions = list(results["conditions"])
    methods = list(dict.fromkeys(m for c in conditions for m in results["conditions"][c]["methods"]))
    width = 0.8 / max(len(methods), 1)
    fig = Figure(figsize=(max(9.0, (0.6 + 0.14 * len(methods)) * len(conditions) + 1.5), 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for j, method in enumerate(methods):
        xs, means, spreads = [], [], []
        for i, condition in enumerate(conditions):
            entry = results["conditions"][condition]["methods"].get(method)
            if entry is None or entry["gold_reward_final"] is None:
                continue
            x = i - 0.4 + width * (j + 0.5)
            xs.append(x)
            means.append(entry["gold_reward_final"])
            spreads.append(entry["gold_reward_final_std"])
            seeds = [run["gold_reward_final"] for run in entry["seeds"]]
            ax.plot([x] * len(seeds), seeds, linestyle="none", marker=".", markersize=3, color="black", alpha=0.6)
        ax.bar(xs, means, width, yerr=spreads, capsize=2, color=f"C{j % 10}", label=method)
    if results["sft"]:
        ax.axhline(results["sft"]["gold_reward"], color="black", linestyle="--", linewidth=1.0, label="SFT")
    ax.axhline(0.0, color="grey", linewidth=0.5)
    ax.set_xticks(range(len(conditions)), conditions)
    ax.set_ylabel("gold reward, final (mean ± std over seeds)")
    ax.set_title(f"Stress test in the toy world: final gold reward (seeds {results['seeds']})")
    ax.grid(True, axis="y", alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncols=min(5, len(methods) + 1))
    save_figure(fig, path)


# --------------------------------------------------------------------------------------------------------------------
# --stress: resumable runs over (condition, method, seed)
# --------------------------------------------------------------------------------------------------------------------
def runs_path(output: Path) -> Path:
    """The sidecar with one JSON line per finished run."""
    return output.with_suffix(".runs.jsonl")


def run_key(record: dict) -> tuple:
    return record["world"], record["condition"], record["method"], record["seed"], record["iterations"]


def load_runs(path: Path) -> dict[tuple, dict]:
    """Finished runs by :func:`run_key` (the last line wins; an unreadable line, e.g. cut by a crash, is skipped)."""
    runs = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
                runs[run_key(record)] = record
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return runs


def append_run(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as file:
        file.write(json.dumps(record) + "\n")
        file.flush()
        os.fsync(file.fileno())


def stress_run(world, world_key: str, condition: str, method: str, seed: int, iterations: int) -> dict:
    """One (condition, method, seed) run as a sidecar record. A run the trainer stops (too many iterations skipped for
    non-finite numbers) is a result too: it is recorded with its error instead of its numbers."""
    record = {"world": world_key, "condition": condition, "method": method, "seed": seed, "iterations": iterations}
    record["run_iterations"] = condition_iterations(condition, iterations)
    start = time.time()
    try:
        result, sft, curves = run_seed(world, method, seed, record["run_iterations"], condition, callbacks=[_Quiet()])
        record.update(result=result, sft=sft, curves=curves)
    except RuntimeError as error:
        if not str(error).startswith("Stopped at iteration"):
            raise
        record["error"] = str(error)
    record["seconds"] = time.time() - start
    return record


def stress_method_summary(records: list[dict]) -> dict:
    finished = [r for r in records if "error" not in r]
    failed = [{"seed": r["seed"], "error": r["error"]} for r in records if "error" in r]
    if not finished:
        return {
            **dict.fromkeys(FINAL_FIELDS),
            "gold_reward_final_std": None,
            "seeds": [],
            "failed": failed,
            "curves": {},
        }
    summary = method_summary([r["result"] for r in finished], [r["curves"] for r in finished])
    golds = [r["result"]["gold_reward_final"] for r in finished]
    spread = statistics.stdev(golds) if len(golds) > 1 else 0.0
    curves = summary.pop("curves")
    return {**summary, "gold_reward_final_std": spread, "failed": failed, "curves": curves}


def stress_results(records: dict[tuple, dict], world_key, conditions, methods, seeds, iterations) -> dict:
    """The --stress JSON from the finished runs ``records`` of the requested conditions, methods and seeds."""
    out = {"conditions": {}}
    unchanged_sft, all_sft, seconds = [], [], 0.0
    for condition in conditions:
        entry = {
            "description": CONDITIONS[condition].description,
            "iterations": condition_iterations(condition, iterations),
            "sft": {},
            "methods": {},
        }
        sft = []
        for method in methods:
            found = [records[k] for s in seeds if (k := (world_key, condition, method, s, iterations)) in records]
            if not found:
                continue
            seconds += sum(r["seconds"] for r in found)
            sft += [r["sft"] for r in found if "sft" in r]
            entry["methods"][method] = stress_method_summary(found)
        entry["sft"] = mean_sft(sft) if sft else {}
        all_sft += sft
        if not CONDITIONS[condition].changes_reward:
            unchanged_sft += sft
        out["conditions"][condition] = entry
    # The SFT policy's numbers; its proxy reward from the conditions that leave the reward model's score alone
    out["sft"] = mean_sft(unchanged_sft or all_sft) if all_sft else {}
    out["seconds"] = seconds
    return out


def stress(args, argv, world) -> dict:
    conditions = args.conditions or list(CONDITIONS)
    methods = args.methods or list(STRESS_METHODS)
    seeds = args.seed or [0, 1, 2]
    iterations = args.iterations or STRESS_ITERATIONS
    output = Path(args.output or "benchmarks/results/stability_stress.json")
    sidecar, log = runs_path(output), output.with_suffix(".runs.log")
    if args.fresh:
        sidecar.unlink(missing_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    world_key = WorldSettings().key()
    records = load_runs(sidecar)
    wanted = [(c, m, s) for c in conditions for m in methods for s in seeds]
    todo = [(c, m, s) for c, m, s in wanted if (world_key, c, m, s, iterations) not in records]
    from tqdm.auto import tqdm

    bar = tqdm(total=len(wanted), initial=len(wanted) - len(todo), desc="stress runs", unit="run", dynamic_ncols=True)
    for condition, method, seed in todo:
        bar.set_postfix_str(f"{condition} / {method} / seed {seed}")
        with log.open("a") as file, contextlib.redirect_stdout(file), contextlib.redirect_stderr(file):
            print(f"=== {condition} / {method} / seed {seed}", flush=True)  # the run's own output and bars go here
            record = stress_run(world, world_key, condition, method, seed, iterations)
        append_run(sidecar, record)
        records[run_key(record)] = record
        bar.update(1)
        numbers = record.get("result")
        line = ", ".join(f"{k} {numbers[k]:.3f}" for k in FINAL_FIELDS) if numbers else f"failed: {record['error']}"
        bar.write(f"{condition:>16} {method:>24} seed {seed}: {line}")
    bar.close()
    results = {
        "command": " ".join(["python benchmarks/stability.py", *(argv if argv is not None else sys.argv[1:])]),
        "iterations": iterations,
        "seeds": seeds,
        "world": world.report,
        "runs_file": str(sidecar),
        **stress_results(records, world_key, conditions, methods, seeds, iterations),
    }
    write_json(output, results)
    for condition, entry in results["conditions"].items():
        figure = {"methods": entry["methods"], "sft": entry["sft"] or results["sft"]}
        title = f"Stress '{condition}': {entry['description']} ({entry['iterations']} iterations, seeds {seeds})"
        if figure["sft"]:
            plot(figure, output.with_name(f"{output.stem}_{condition}.png"), title=title)
    plot_summary(results, output.with_name(f"{output.stem}_summary.png"))
    print(
        f"\n{'condition':>16}{'method':>26}" + "".join(f"{k:>23}" for k in ("gold_reward_final", "± std", "kl_final"))
    )
    for condition, entry in results["conditions"].items():
        for name, m in entry["methods"].items():
            if m["gold_reward_final"] is None:
                print(f"{condition:>16}{name:>26}{'failed':>23}")
                continue
            numbers = (m["gold_reward_final"], m["gold_reward_final_std"], m["kl_final"])
            print(f"{condition:>16}{name:>26}" + "".join(f"{v:>23.3f}" for v in numbers))
    print(
        f"\n{output}, {sidecar} and {output.stem}_*.png written ({results['seconds']:.0f} s of runs in all); the runs'"
    )
    print(f"own output is in {log}")
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one seed, 60 iterations: a few minutes on a laptop")
    parser.add_argument("--stress", action="store_true", help="every method under every stress condition (resumable)")
    parser.add_argument("--seed", type=int, nargs="+", help="PPO seeds (default: 0 1 2, or 0 with --quick)")
    parser.add_argument(
        "--iterations", type=int, help="PPO iterations per run (default: 150, or 60 with --quick or --stress)"
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=sorted(METHODS),
        help=f"default: {' '.join(QUICK_METHODS)}; with --stress: {' '.join(STRESS_METHODS)}",
    )
    parser.add_argument("--conditions", nargs="+", choices=list(CONDITIONS), help="--stress: default all")
    parser.add_argument("--fresh", action="store_true", help="--stress: forget the finished runs and start over")
    parser.add_argument(
        "--output",
        help="default: benchmarks/results/stability.json, or benchmarks/results/stability_stress.json with --stress",
    )
    parser.add_argument("--cache-dir", help="where the toy world's SFT policy and reward model are cached")
    args = parser.parse_args(argv)
    if args.stress and args.quick:
        parser.error("--stress and --quick exclude each other (--stress runs 60 iterations by default)")
    if not args.stress and (args.conditions or args.fresh):
        parser.error("--conditions and --fresh need --stress")
    if args.stress:
        return stress(args, argv, prepare_world(WorldSettings(), cache_dir=args.cache_dir))
    seeds = args.seed or ([0] if args.quick else [0, 1, 2])
    iterations = args.iterations or (60 if args.quick else 150)
    methods = args.methods or list(QUICK_METHODS)
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
    for method in methods:
        runs, curves = [], []
        for seed in seeds:
            result, sft, curve = run_seed(world, method, seed, iterations)
            runs.append(result)
            curves.append(curve)
            sft_per_seed.append(sft)
            print(f"{method:>20} seed {seed}: " + ", ".join(f"{k} {result[k]:.3f}" for k in FINAL_FIELDS), flush=True)
        results["methods"][method] = method_summary(runs, curves)
    results["sft"] = mean_sft(sft_per_seed)
    results["seconds"] = time.time() - start
    output = Path(args.output or "benchmarks/results/stability.json")
    write_json(output, results)
    plot(results, output.with_suffix(".png"))
    print("\nSFT: " + ", ".join(f"{k} {v:.3f}" for k, v in results["sft"].items()))
    print(f"{'method':>20}" + "".join(f"{k:>23}" for k in FINAL_FIELDS))
    for name, method in results["methods"].items():
        print(f"{name:>20}" + "".join(f"{method[k]:>23.3f}" for k in FINAL_FIELDS))
    print(f"\n{output} and {output.with_suffix('.png')} written in {results['seconds']:.0f} s")
    return results


if __name__ == "__main__":
    main()
