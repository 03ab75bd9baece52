"""``accelerate launch recipes/ppo_max.py`` with no arguments: the toy world end to end on a CPU in a few minutes."""

from __future__ import annotations

import time
from pathlib import Path

from transformers import TrainerCallback

from trl_ppomax.data.files import write_json
from trl_ppomax.toyworld.build import WorldSettings, prepare_world
from trl_ppomax.toyworld.pipeline import run_method, win_tie_lose_vs_sft
from trl_ppomax.toyworld.world import gold_reward


def format_table(rows: dict[str, dict[str, float]]) -> str:
    columns = ["gold_reward", "proxy_reward", "kl", "perplexity", "response_length"]
    lines = [f"{'policy':<10}" + "".join(f"{c:>17}" for c in columns)]
    for name, values in rows.items():
        lines.append(f"{name:<10}" + "".join(f"{values[c]:>17.3f}" for c in columns))
    return "\n".join(lines)


#: The columns of the demo's per-log table: header and metric.
LOG_COLUMNS = (
    ("step", None),
    ("gold", "gold/reward"),
    ("proxy", "objective/scores"),
    ("KL", "objective/kl"),
    ("length", "response/length"),
    ("ppl", "policy/perplexity"),
)


class CompactLogCallback(TrainerCallback):
    """Print one row per logging step (step, gold reward, proxy reward, KL, length, perplexity) in place of the raw
    metric dict; :func:`~trl_ppomax.toyworld.pipeline.run_method` removes the PrinterCallback when it is given."""

    replaces_printer = True

    def __init__(self) -> None:
        self.rows = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if not state.is_world_process_zero or "objective/scores" not in logs:
            return
        if self.rows % 20 == 0:
            print("".join(f"{name:>9}" for name, _ in LOG_COLUMNS), flush=True)
        cells = [f"{state.global_step:>9d}"]
        for _, key in LOG_COLUMNS[1:]:
            value = logs.get(key)
            cells.append(f"{value:>9.3f}" if isinstance(value, (int, float)) else f"{'-':>9}")
        print("".join(cells), flush=True)
        self.rows += 1


def run_demo(output_dir: str = "output/toyworld", iterations: int = 100, seed: int = 0, cache_dir=None) -> dict:
    """Train the SFT policy and reward model (cached), then PPO-max; print SFT vs PPO-max and samples, and write
    ``training_dynamics.png`` and ``summary.json`` into ``output_dir``."""
    from trl_ppomax.ppo.monitor import CollapseMonitor
    from trl_ppomax.reporting.plotting import plot_training_dynamics

    start = time.time()
    print("Toy world: SFT policy and reward model (trained once, then cached) …", flush=True)
    world = prepare_world(WorldSettings(seed=seed), cache_dir=cache_dir)
    print(f"  reward model: held-out accuracy {world.report['held_out_accuracy']:.2f} on gold-labelled pairs")
    print(f"PPO-max, {iterations} iterations of 32 prompts …", flush=True)
    monitor = CollapseMonitor()
    trainer, sft, final, _ = run_method(
        world, "ppo_max", output_dir, iterations=iterations, seed=seed, callbacks=[monitor, CompactLogCallback()]
    )
    print("\n" + format_table({"SFT": sft, "PPO-max": final}))
    for row in trainer.generate_completions(sampling=True, num_prompts=4):
        print(f"  gold {gold_reward(row['query'], row['response']):+.2f}  {row['query']!r} → {row['response']!r}")
    print("\nPPO-max against SFT on 64 held-out prompts, judged by the gold reward:")
    versus_sft = win_tie_lose_vs_sft(trainer, world, Path(output_dir) / "eval_vs_sft", seed=seed)
    figure = plot_training_dynamics(
        trainer.state.log_history, Path(output_dir) / "training_dynamics.png", title="PPO-max in the toy world"
    )
    summary = dict(world=world.report, sft=sft, ppo_max=final, collapse_events=monitor.events, vs_sft=versus_sft)
    summary["seconds"] = time.time() - start
    write_json(Path(output_dir, "summary.json"), summary)
    print(f"\nFigure: {figure}\nSummary: {Path(output_dir, 'summary.json')}  ({summary['seconds']:.0f} s)")
    return summary
