"""What each rank holds under DeepSpeed ZeRO-2, ZeRO-3 and FSDP2: a tiny PPO-max run on 2 CPU processes per engine.

For every engine config in ``recipes/accelerate/*_cpu.yaml`` this launches ``engine_memory_worker.py`` with
``accelerate launch --num_processes 2`` (fp32, gloo, no GPU), reads what each rank measured after its training
iterations (parameters, gradients, optimizer states and fp32 master weights of the policy+critic engine; the
parameters of the frozen reference and reward models; the parameter bytes materialised during generation), prints a
table and writes everything as JSON. It also prints, next to each measurement, what the formulas of
``docs/scaling.md`` ("Measured on CPU") predict for fp32 on N = 2 ranks, so that the scaling rules themselves are
checked, not only the numbers.

    python benchmarks/engine_memory.py --output benchmarks/results/engine_memory.json

About 20 s per run on 2 cores; seven runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "engine_memory_worker.py"
RECIPES = ROOT / "recipes" / "accelerate"
FALLBACK = Path("/tmp/ds")  # where the CPU configs were drafted before they were added to recipes/accelerate

#: (name, config file, fallback file, worker options, extra environment, what it shows)
ZERO3_ALL_PARTITIONED = ["--persistence-threshold", "0"]
LAYER_UNITS = {"FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer"}
RUNS = [
    ("zero2", "deepspeed_zero2_cpu.yaml", "zero2_cpu.yaml", [], {}, "DeepSpeed ZeRO-2"),
    (
        "zero3",
        "deepspeed_zero3_cpu.yaml",
        "zero3_cpu.yaml",
        ZERO3_ALL_PARTITIONED,
        {},
        "ZeRO-3, gather on, stage3_param_persistence_threshold 0 (every parameter partitioned)",
    ),
    (
        "zero3_no_gather",
        "deepspeed_zero3_cpu.yaml",
        "zero3_cpu.yaml",
        [*ZERO3_ALL_PARTITIONED, "--no-ds3-gather"],
        {},
        "ZeRO-3, gather off, persistence threshold 0",
    ),
    (
        "zero3_default_persistence",
        "deepspeed_zero3_cpu.yaml",
        "zero3_cpu.yaml",
        [],
        {},
        "ZeRO-3 as the config gives it: DeepSpeed's default persistence threshold (1e5 elements) keeps every tiny "
        "tensor whole on every rank",
    ),
    (
        "fsdp2",
        "fsdp2_cpu.yaml",
        "fsdp2_cpu.yaml",
        ["--fsdp-on-cpu"],
        {},
        "FSDP2 as the config gives it (accelerate's CPU check bypassed): the wrapper has no _no_split_modules, so "
        "the whole policy+critic is one FSDP unit",
    ),
    (
        "fsdp2_layer_units",
        "fsdp2_cpu.yaml",
        "fsdp2_cpu.yaml",
        ["--fsdp-on-cpu"],
        LAYER_UNITS,
        "FSDP2 with FSDP_TRANSFORMER_CLS_TO_WRAP=LlamaDecoderLayer: one unit per decoder layer",
    ),
    (
        "ddp",
        "fsdp2_cpu.yaml",
        "fsdp2_cpu.yaml",
        [],
        {},
        "fsdp2_cpu.yaml launched as it is: accelerate drops FSDP on CPU processes and runs DDP",
    ),
]


def config_path(name: str, fallback: str) -> Path:
    path = RECIPES / name
    return path if path.exists() else FALLBACK / fallback


def launch(config: Path, options: list[str], extra_env: dict, output: Path, processes: int, timeout: int) -> float:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **extra_env}
    command = [  # accelerate of this interpreter: `accelerate` on PATH is not there in a venv that is not activated
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        "--num_processes",
        str(processes),
        str(WORKER),
        str(output),
        *options,
    ]
    start = time.perf_counter()
    with open(output.with_suffix(".log"), "w") as log:
        done = subprocess.run(command, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if done.returncode:
        tail = output.with_suffix(".log").read_text().splitlines()[-30:]
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n" + "\n".join(tail))
    return time.perf_counter() - start


# --------------------------------------------------------------------------------------------------------------------
# The formulas (fp32 training; bytes per rank; P = bytes of one full fp32 copy, N = ranks)
# --------------------------------------------------------------------------------------------------------------------
def expected(engine: str, gather: bool, n: int, trained: int, policy: int, frozen: int) -> dict[str, float]:
    """What docs/scaling.md's rules predict per rank for fp32 (4 bytes per element): P = ``trained`` bytes (policy +
    critic), ``policy`` bytes, F = ``frozen`` bytes (reference + reward)."""
    if engine == "deepspeed-zero2":
        return {
            "params": trained,  # replicated
            "grads": trained / n,  # flat partition
            "master": trained / n,  # fp32 copy of the partition (a clone even in fp32)
            "optimizer": 2 * trained / n,  # Adam m, v
            "frozen": frozen,  # prepare_deepspeed uses stage 0: full copies
            "gen_policy": policy,  # resident, nothing gathered
        }
    if engine == "deepspeed-zero3":
        return {
            "params": trained / n,
            "grads": trained / n,
            "master": trained / n,  # a clone even in fp32 (DeepSpeed 0.19's aliasing test never matches)
            "optimizer": 2 * trained / n,
            "frozen": frozen / n,
            "gen_policy": policy if gather else None,  # gather off: one layer at a time
        }
    if engine == "fsdp2":
        return {
            "params": trained / n,
            "grads": trained / n,
            "master": 0,
            "optimizer": 2 * trained / n,
            "frozen": frozen / n,
            "gen_policy": None,  # layer by layer
        }
    return {  # DDP
        "params": trained,
        "grads": trained,
        "master": 0,
        "optimizer": 2 * trained,
        "frozen": frozen,
        "gen_policy": policy,
    }


def summarise(name: str, description: str, ranks: list[dict]) -> dict:
    first = ranks[0]
    trained, frozen = first["trained"], first["frozen"]
    full = trained["full_size"]
    policy_full = frozen["ref_model"]["full_size"]  # the reference is a copy of the policy
    frozen_full = sum(model["full_size"] for model in frozen.values())
    n = first["world_size"]

    def worst(get) -> int:  # the largest over the ranks
        return max(get(rank) for rank in ranks)

    measured = {
        "params": worst(lambda r: r["trained"]["params"]),
        "grads": worst(lambda r: r["trained"]["grads"]),
        "master": worst(lambda r: r["trained"]["master_weights"]),
        "optimizer": worst(lambda r: r["trained"]["optimizer_states"]),
        "frozen": worst(lambda r: sum(model["params"] for model in r["frozen"].values())),
        "gen_policy": worst(lambda r: r["generation"]["policy_at_entry"]),
        "gen_critic": worst(lambda r: r["generation"]["critic_at_entry"]),
        "gen_policy_peak": worst(lambda r: r["generation"]["policy_peak"]),
        "gen_critic_peak": worst(lambda r: r["generation"]["critic_peak"]),
    }
    predicted = expected(first["engine"], first["ds3_gather_for_generation"], n, full, policy_full, frozen_full)
    return {
        "name": name,
        "description": description,
        "engine": first["engine"],
        "world_size": n,
        "fsdp_units": first.get("fsdp_units", []),
        "ds3_gather_for_generation": first["ds3_gather_for_generation"],
        "full_size": {"trained": full, "policy": policy_full, "frozen": frozen_full},
        "measured_max_over_ranks": measured,
        "expected": predicted,
        "ranks_identical": all(
            rank["trained"] == first["trained"] and rank["frozen"] == first["frozen"] for rank in ranks
        ),
        "same_after_each_iteration": all(
            after == rank["after_iterations"][0] for rank in ranks for after in rank["after_iterations"]
        ),
    }


def fmt(measured: float, full: int, predicted: float | None) -> str:
    text = f"{measured / 1e3:.1f} ({measured / full:.2f})"
    if predicted is not None:
        text += f" [{predicted / full:.2f}]"
    return text


def table(summaries: list[dict]) -> str:
    lines = [
        "bytes per rank in kB (in units of one full fp32 copy: policy+critic for the trained columns, reference+reward "
        "for 'frozen', the policy for the generation columns) [what the formula predicts]",
        "| run | engine | params | grads | fp32 master | Adam states | frozen ref+reward | policy at generate() "
        "| critic at generate() | policy peak in generate() |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        m, e, full = s["measured_max_over_ranks"], s["expected"], s["full_size"]
        cells = [
            fmt(m["params"], full["trained"], e["params"]),
            fmt(m["grads"], full["trained"], e["grads"]),
            fmt(m["master"], full["trained"], e["master"]),
            fmt(m["optimizer"], full["trained"], e["optimizer"]),
            fmt(m["frozen"], full["frozen"], e["frozen"]),
            fmt(m["gen_policy"], full["policy"], e["gen_policy"]),
            fmt(m["gen_critic"], full["trained"] - full["policy"], None),
            fmt(m["gen_policy_peak"], full["policy"], None),
        ]
        lines.append(f"| {s['name']} | {s['engine']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=None, help="write the results here as JSON")
    parser.add_argument("--runs", nargs="*", default=[run[0] for run in RUNS], help="subset of the runs")
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    options = parser.parse_args()

    summaries, raw = [], {}
    with tempfile.TemporaryDirectory(prefix="engine_memory_") as tmp:
        for name, config_name, fallback, worker_options, extra_env, description in RUNS:
            if name not in options.runs:
                continue
            config = config_path(config_name, fallback)
            output = Path(tmp) / name
            seconds = launch(config, worker_options, extra_env, output, options.num_processes, options.timeout)
            ranks = [json.loads((output / f"rank{r}.json").read_text()) for r in range(options.num_processes)]
            summary = summarise(name, description, ranks)
            summary.update(config=str(config.relative_to(ROOT) if config.is_relative_to(ROOT) else config))
            summary.update(worker_options=worker_options, environment=extra_env, seconds=round(seconds, 1))
            summaries.append(summary)
            raw[name] = ranks
            print(f"{name}: {summary['engine']}, {seconds:.0f} s", file=sys.stderr)
    print(table(summaries))
    if options.output:
        options.output.parent.mkdir(parents=True, exist_ok=True)
        result = {"num_processes": options.num_processes, "summary": summaries, "ranks": raw}
        options.output.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
