"""Head to head: ``PPOMaxTrainer`` against TRL 1.16's own ``GRPOTrainer`` and ``RLOOTrainer`` on identical work.

Seven runs, each in a fresh process of ``head_to_head_worker.py``, alternating the order every other round:

- ``trl_grpo`` / ``trl_rloo``: ``trl.GRPOTrainer`` + ``GRPOConfig`` / ``trl.RLOOTrainer`` + ``RLOOConfig``, as shipped
  (TRL's fused log-prob head, which runs in torch tiles off Triton devices);
- ``trl_grpo_plain`` / ``trl_rloo_plain``: the same with a plain completion-only log-softmax head in place of the
  fused one (the worker's ``add_plain_lm_head``; ``--check-plain-head`` shows it agrees with TRL's);
- ``ppomax_grpo`` / ``ppomax_rloo`` / ``ppomax_gae``: ``PPOMaxTrainer`` with the same GRPOConfig names and
  ``advantage_estimator`` "grpo" / "rloo" / "gae" (GAE: a critic built from the policy).

The work is the same for every run: a random Llama saved as a user's folder (tokenizer beside it), the reference a
copy of it, ``--prompts`` prompts × ``--generations`` completions per generation batch, every completion exactly
``--completion-length`` tokens (eos and pad suppressed), one reward function (characters ÷ 100), k3 KL with β 0.04,
one optimizer step per generation batch (one iteration, on-policy), ``--steps`` steps, temperature 1, top-p 1, the
same learning rate and seed. Each run proves it: completions, generated and prompt tokens, generate calls, logged
steps and mean completion length, optimizer steps, training-forward rows; the driver fails loudly when they differ.

    python benchmarks/head_to_head.py --runs 3 --output benchmarks/results/head_to_head.json
    python benchmarks/head_to_head.py --vocab-size 151936 --runs 3 --output benchmarks/results/head_to_head_qwen_vocab.json
    python benchmarks/head_to_head.py --quick --output /tmp/head_to_head_quick.json   # a smoke run
    # on a GPU, 0.5B-ish sizes:
    python benchmarks/head_to_head.py --device cuda --bf16 --hidden 896 --layers 24 --heads 14 --intermediate 4864 \\
        --vocab-size 151936 --runs 1 --output benchmarks/results/head_to_head_gpu.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "head_to_head_worker.py"
IMPLS = (
    "trl_grpo",
    "trl_grpo_plain",
    "trl_rloo",
    "trl_rloo_plain",
    "ppomax_grpo",
    "ppomax_rloo",
    "ppomax_gae",
)
#: The timed fields, medians over the runs of each impl.
KEYS = [
    "train_seconds",
    "process_seconds",
    "generation_seconds",
    "scoring_forwards_seconds",
    "reward_seconds",
    "update_and_rest_seconds",
    "peak_memory_gb",
    "peak_memory_before_train_gb",
    "peak_memory_growth_in_train_gb",
]
#: Ours against TRL's: (ours, theirs).
PAIRS = [
    ("ppomax_grpo", "trl_grpo"),
    ("ppomax_grpo", "trl_grpo_plain"),
    ("ppomax_rloo", "trl_rloo"),
    ("ppomax_rloo", "trl_rloo_plain"),
    ("ppomax_gae", "trl_grpo"),
    ("ppomax_gae", "trl_grpo_plain"),
    ("ppomax_gae", "ppomax_grpo"),  # what the critic costs
    ("trl_grpo", "trl_grpo_plain"),  # TRL's fused head against a plain one
    ("trl_rloo", "trl_rloo_plain"),
]
#: Size flags passed through to the worker.
SIZES = (
    "vocab_size",
    "hidden",
    "layers",
    "heads",
    "intermediate",
    "completion_length",
    "prompts",
    "generations",
    "micro_batch",
    "steps",
    "learning_rate",
    "seed",
    "device",
    "threads",
)
QUICK = dict(vocab_size=256, hidden=32, layers=1, completion_length=8, prompts=2, generations=4, steps=2, runs=1)


def work_proof(result: dict) -> dict:
    """The work a run did, as the trainer logged it and as wrapping counted it (equal for every impl)."""
    counts = result["counts"]
    return {
        "completions": result["completions"],
        "generated_tokens": result["generated_tokens"],
        "prompt_tokens": counts.get("prompt_tokens", 0),
        "completions_ended_by_eos": counts.get("completions_ended_by_eos", 0),
        "generate_calls": counts.get("generate_calls", 0),
        "rewarded_completions": counts.get("rewarded_completions", 0),
        "global_step": result["global_step"],
        "optimizer_steps": counts.get("optimizer_steps", 0),
        "logged_steps": result["logged_steps"],
        "logged_mean_completion_length": result["logged_mean_completion_length"],
        "policy_training_forward_rows": counts.get("forward_rows/policy/grad", 0),
        "reference_forward_rows": counts.get("forward_rows/reference/no_grad", 0),
    }


def forward_counts(result: dict) -> dict:
    """Rows of the forwards that may differ by design: the no-grad policy forward (old log-probs; TRL skips it when
    on-policy, GRPO only), the critic's forwards (GAE only)."""
    counts = result["counts"]
    return {
        "policy_no_grad_forward_rows": counts.get("forward_rows/policy/no_grad", 0),
        "critic_no_grad_forward_rows": counts.get("forward_rows/critic/no_grad", 0),
        "critic_training_forward_rows": counts.get("forward_rows/critic/grad", 0),
        "optimizers_stepped": counts.get("optimizers_stepped", 0),
    }


def worker_command(args, impl: str | None, assets: Path) -> list[str]:
    command = [args.python, str(WORKER)]
    command += ["--check-plain-head"] if impl is None else ["--impl", impl]
    command += ["--assets", str(assets)]
    for name in SIZES:
        value = getattr(args, name)
        if value is not None:
            command += [f"--{name.replace('_', '-')}", str(value)]
    command += ["--bf16"] if args.bf16 else []
    command += ["--gradient-checkpointing"] if args.gradient_checkpointing else []
    return command


def run_worker(args, impl: str | None, assets: Path) -> dict:
    """One fresh worker process: its ``RESULT`` line, with ``process_seconds`` as the driver measured it (interpreter
    start and imports included)."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "WANDB_DISABLED": "true",
        "TOKENIZERS_PARALLELISM": "false",
        "TRL_EXPERIMENTAL_SILENCE": "1",
    }
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    start = time.perf_counter()
    out = subprocess.run(worker_command(args, impl, assets), capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if out.returncode != 0 or "RESULT " not in out.stdout:
        raise RuntimeError(f"{impl or 'check-plain-head'} failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.rsplit("RESULT ", 1)[1].splitlines()[0])
    if impl is not None:
        result["worker_seconds"], result["process_seconds"] = result["process_seconds"], seconds
    return result


def assets_folder(args) -> Path:
    """The cached model folder for these sizes (its name holds every size that shapes the model)."""
    shape = dict(vocab=args.vocab_size, hidden=args.hidden, layers=args.layers, heads=args.heads)
    shape.update(intermediate=args.intermediate, seed=args.seed, version=1)
    key = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:10]
    return Path(args.cache) / f"head-to-head-v{args.vocab_size}-h{args.hidden}-l{args.layers}-{key}"


def build(args) -> Path:
    sys.path.insert(0, str(HERE))
    from head_to_head_worker import build_assets

    folder = assets_folder(args)
    return build_assets(
        folder,
        vocab_size=args.vocab_size,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        intermediate=args.intermediate,
        seed=args.seed,
    )


def run_alternating(args, assets: Path) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {impl: [] for impl in args.impls}
    for index in range(args.runs):
        for impl in args.impls if index % 2 == 0 else args.impls[::-1]:
            result = run_worker(args, impl, assets)
            results[impl].append(result)
            print(
                f"run {index}: {impl:<15} train {result['train_seconds']:7.2f} s (generation "
                f"{result['generation_seconds']:6.2f}, scoring {result['scoring_forwards_seconds']:5.2f}, update+rest "
                f"{result['update_and_rest_seconds']:6.2f}), process {result['process_seconds']:6.1f} s, peak "
                f"{result['peak_memory_gb']:.2f} GB, policy no-grad rows "
                f"{forward_counts(result)['policy_no_grad_forward_rows']}",
                flush=True,
            )
    return results


def check_work(results: dict[str, list[dict]]) -> tuple[bool, dict]:
    """Every run's work proof against the first one's: ``(equal, {"expected": proof, "differences": [...]})``."""
    proofs = {impl: [work_proof(r) for r in runs] for impl, runs in results.items()}
    first_impl = next(iter(proofs))
    expected = proofs[first_impl][0]
    differences = []
    for impl, runs in proofs.items():
        for index, proof in enumerate(runs):
            for key, value in proof.items():
                if value != expected[key] and not (
                    isinstance(value, float) and math.isclose(value, expected[key], rel_tol=1e-9)
                ):
                    differences.append(f"{impl} run {index}: {key} = {value}, {first_impl}: {expected[key]}")
    return not differences, {"expected": expected, "differences": differences}


def check_plain_head_in_training(results: dict[str, list[dict]], tolerance: float) -> dict:
    """TRL with its fused head and with the plain one train on the same first batch (same seed, the head draws no
    random numbers): the first step's logged loss and grad norm must agree."""
    report = {}
    for fused, plain in (("trl_grpo", "trl_grpo_plain"), ("trl_rloo", "trl_rloo_plain")):
        if fused not in results or plain not in results:
            continue
        rows = []
        for a, b in zip(results[fused], results[plain], strict=False):
            values = {k: (a[f"first_step_{k}"], b[f"first_step_{k}"]) for k in ("loss", "grad_norm")}
            agree = all(math.isclose(x, y, rel_tol=tolerance, abs_tol=tolerance) for x, y in values.values())
            rows.append({**values, "agree": agree})
        report[f"{fused} vs {plain}"] = rows
    return report


def median_fields(results: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    return {impl: {k: statistics.median(r[k] for r in runs) for k in KEYS} for impl, runs in results.items() if runs}


def ratios_of(medians: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    ratios = {}
    for ours, theirs in PAIRS:
        if ours in medians and theirs in medians:
            a, b = medians[ours], medians[theirs]
            ratios[f"{ours} / {theirs}"] = {k: a[k] / b[k] if b[k] else None for k in KEYS if k != "reward_seconds"}
    return ratios


def print_table(medians: dict, ratios: dict, forwards: dict) -> None:
    names = list(medians)
    print(f"\n{'median':<26}" + "".join(f"{n:>16}" for n in names))
    for key in KEYS:
        print(f"{key:<26}" + "".join(f"{medians[n][key]:>16.3f}" for n in names))
    print(f"{'policy no-grad rows':<26}" + "".join(f"{forwards[n]['policy_no_grad_forward_rows']:>16}" for n in names))
    print()
    for name, values in ratios.items():
        print(
            f"{name:<34} train {values['train_seconds']:5.2f}  process {values['process_seconds']:5.2f}  "
            f"peak memory {values['peak_memory_gb']:5.2f} (growth in train "
            f"{values['peak_memory_growth_in_train_gb'] or 0:5.2f})  generation {values['generation_seconds']:5.2f}  "
            f"update+rest {values['update_and_rest_seconds']:5.2f}"
        )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--output", default=str(HERE / "results" / "head_to_head.json"))
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes, 2 steps, 1 run")
    parser.add_argument("--vocab-size", type=int, default=1024, help="151936: Qwen's vocabulary")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=None, help="default max(2, hidden // 64)")
    parser.add_argument("--intermediate", type=int, default=None, help="default 2 × hidden")
    parser.add_argument("--completion-length", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per generation batch")
    parser.add_argument("--generations", type=int, default=4, help="num_generations")
    parser.add_argument("--micro-batch", type=int, default=8, help="per_device_train_batch_size (completions)")
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps (= generation batches)")
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: torch's)")
    parser.add_argument("--cache", default=str(HERE / ".cache"), help="where the model folders are built once")
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args(argv)
    if args.quick:
        explicit = {
            a.split("=")[0].lstrip("-").replace("-", "_") for a in (argv or sys.argv[1:]) if a.startswith("--")
        }
        for name, value in QUICK.items():
            if name not in explicit:
                setattr(args, name, value)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    assets = build(args)
    head_check = run_worker(args, None, assets)
    print(f"plain head against TRL's fused head, one batch: {head_check}", flush=True)
    results = run_alternating(args, assets)
    equal, work = check_work(results)
    exact = args.device == "cpu" and not args.bf16
    in_training = check_plain_head_in_training(results, tolerance=1e-5 if exact else 1e-2)
    medians = median_fields(results)
    ratios = ratios_of(medians)
    forwards = {impl: forward_counts(runs[0]) for impl, runs in results.items()}
    print_table(medians, ratios, forwards)
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "settings": {name: getattr(args, name) for name in (*SIZES, "bf16", "gradient_checkpointing", "runs")},
        "work_equal": equal,
        "work": work,
        "forwards_by_design": forwards,
        "plain_head_check": {"one_batch": head_check, "first_training_step": in_training},
        "medians": medians,
        "ratios": ratios,
        "runs": results,
    }
    path = Path(args.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"\nwritten: {path}")
    failures = list(work["differences"])
    if not head_check.get("agree_1e-5"):
        failures.append(f"the plain head disagrees with TRL's fused head on one batch: {head_check}")
    for pair, rows in in_training.items():
        failures += [f"{pair}: first step differs: {row}" for row in rows if not row["agree"]]
    if failures:
        raise SystemExit("NOT THE SAME WORK / HEADS DISAGREE:\n  " + "\n  ".join(failures))
    print("work identical across impls: " + json.dumps(work["expected"]))


if __name__ == "__main__":
    main()
