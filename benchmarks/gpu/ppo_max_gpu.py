"""PPO-max on one GPU in one short call: a 1.06B-parameter Llama policy, timed phase by phase, with its MFU.

    python benchmarks/gpu/ppo_max_gpu.py --output benchmarks/results/gpu.json
    python benchmarks/gpu/ppo_max_gpu.py --dry-run --output /tmp/gpu.json   # the same code path on CPU, in seconds

Everything is built in code (random weights, a word-level tokenizer of 32,000 filler words, random prompt token
ids): nothing is downloaded or installed. Each run is a fresh process of this script (``--impl``): PPOMaxTrainer with
``model.generate``, the same with ``max_staleness=1`` (generation overlapped with the update), then PPOMaxTrainer with
a colocated vLLM engine if ``vllm`` is importable, then, given
``--trl112-python``, trl 1.12's PPOTrainer on the same work. A time guard skips a run that would not finish within
``--budget-s`` (kept under 8 minutes) and stops one that overruns; what was skipped, and why, goes into the JSON.
See benchmarks/gpu/README.md for what is measured and the formulas.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

#: Model shapes, lengths, batch sizes and iterations of a GPU run and of a dry run. One minibatch per rollout batch:
#: trl 1.12's rollout batch leaves ``num_mini_batches`` out (per_device × accumulation), PPOMaxConfig's multiplies it in.
SIZES = {
    "gpu": {
        "policy": {"hidden_size": 2048, "layers": 18, "heads": 16, "intermediate_size": 5632},
        "reward_and_value": {"hidden_size": 1024, "layers": 16, "heads": 16, "intermediate_size": 2816},
        "vocab_size": 32000,
        "prompt_length": 128,
        "response_length": 256,
        "per_device_train_batch_size": 32,
        "gradient_accumulation_steps": 4,
        "num_mini_batches": 1,
        "local_rollout_forward_batch_size": 128,
        "num_ppo_epochs": 2,
        "iterations": 5,
        "warmup_iterations": 1,
    },
    "dry_run": {
        "policy": {"hidden_size": 32, "layers": 2, "heads": 2, "intermediate_size": 64},
        "reward_and_value": {"hidden_size": 32, "layers": 2, "heads": 2, "intermediate_size": 64},
        "vocab_size": 300,
        "prompt_length": 8,
        "response_length": 8,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "num_mini_batches": 1,
        "local_rollout_forward_batch_size": 8,
        "num_ppo_epochs": 2,
        "iterations": 3,
        "warmup_iterations": 1,
    },
}
#: Dense bf16 tensor-core peak in FLOP/s, by a substring of the device name (first match wins).
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("B200", 2250e12),
)
#: Issue 46's rows, run first, each a driver of its own in ``benchmarks/`` writing a JSON that joins this one:
#: name → (script and its GPU arguments, its dry-run arguments, the seconds it may take at most on the GPU). Sized
#: from the first H200 run (2026-12-04): HF ``generate`` at this shape takes about 80 ms a step at 64 rows.
#: ``head_to_head``: ours with ``advantage_estimator="grpo"``, TRL's GRPOTrainer (its fused log-prob head, Triton on
#: the GPU) and the same with a plain head, at Qwen2-0.5B's width and vocabulary, bf16, 64 tokens per completion.
#: ``vocab_memory``: a PPO-max iteration at that shape, 4 × 384 tokens, the log-probs in chunks (256) and whole (0).
#: ``liger``: ``use_liger_kernel=True`` trains (Liger's layer kernels in the models) where liger-kernel is installed.
QWEN_05B = "--hidden 896 --layers 24 --heads 14 --intermediate 4864 --vocab-size 151936"
SECTIONS = {
    "head_to_head": (
        f"head_to_head.py --device cuda --bf16 {QWEN_05B} --completion-length 64 --prompts 16 --generations 4 "
        "--micro-batch 16 --steps 2 --runs 1 --impls ppomax_grpo trl_grpo trl_grpo_plain",
        "head_to_head.py --quick --impls trl_grpo ppomax_grpo",
        170.0,
    ),
    "vocab_memory": (
        "vocab_memory.py --gpu --runs 1 --rows 4 --response-length 384 --iterations 1 --chunk-sizes 0,256",
        "vocab_memory.py --runs 1 --rows 2 --response-length 8 --iterations 1",
        190.0,
    ),
    "liger": (
        "vocab_memory.py --gpu --runs 1 --rows 8 --response-length 128 --iterations 1 --chunk-sizes 256 "
        "--no-baseline --use-liger-kernel",
        "vocab_memory.py --runs 1 --rows 2 --response-length 8 --iterations 1 --chunk-sizes 256 --no-baseline",
        60.0,
    ),
}
#: Optional runs after the first: (name, cost as a multiple of the first run's wall time, extra start-up seconds).
EXTRA_RUNS = (("ppomax+staleness1", 1.0, 0.0), ("ppomax+vllm", 1.0, 150.0), ("trl112", 1.2, 0.0))
#: Fields of :data:`SIZES` that are trainer config fields (the same in both trainers).
TRAINER_FIELDS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "num_mini_batches",
    "local_rollout_forward_batch_size",
    "num_ppo_epochs",
    "response_length",
)
MARGIN_S = 15.0  # kept free for writing the results
GENERATED = {"tokens": 0}


# ---------------------------------------------------------------------------------------------------------------------
# Worker: one timed training run in this process
# ---------------------------------------------------------------------------------------------------------------------
def peak_flops(device_name: str, override_tflops: float | None) -> float | None:
    """Dense bf16 peak FLOP/s: ``--peak-tflops`` if given, else from :data:`PEAK_BF16_FLOPS` (None if unknown)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in device_name), None)


def synced_timers(speed_worker, sync) -> None:
    """Make speed_worker's phase timers wait for the device before and after each phase, so that asynchronous CUDA
    work is billed to the phase that queued it."""
    plain = speed_worker.timed

    @contextlib.contextmanager
    def timed(phase: str):
        sync()
        with plain(phase):
            yield
            sync()

    speed_worker.timed = timed


def count_generated(owner, name: str, tokens_of) -> None:
    """Add ``tokens_of(args, output)`` to the generated-token count after each call of ``owner.name``."""
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        output = original(*args, **kwargs)
        GENERATED["tokens"] += int(tokens_of(args, output))
        return output

    setattr(owner, name, counted)


def count_generation(impl: str) -> None:
    """Count generated response tokens where each implementation generates."""
    if impl == "trl112":
        import trl.experimental.ppo.ppo_trainer as module

        count_generated(module, "batch_generation", lambda a, out: out[0].shape[0] * (out[0].shape[1] - a[1].shape[1]))
    elif impl == "ppomax+vllm":
        from trl_ppomax.generation.vllm import VLLMEngine

        count_generated(VLLMEngine, "generate", lambda a, out: out[1].sum())
    else:
        import trl_ppomax.generation as module

        count_generated(module, "generate_responses", lambda a, out: out[1].sum())


def build_inputs(sizes: dict, device: str, seed: int = 0):
    """``(tokenizer, models, dataset)``: random-weight policy, reference (its copy), reward and value models (the
    value model a copy of the reward model, §5.3.3), built on ``device``, and random prompts of ``prompt_length``."""
    import copy

    import torch
    from datasets import Dataset
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    from trl_ppomax.toyworld.tiny import llama_config, word_level_tokenizer

    specials = ["[PAD]", "[UNK]", "<s>", "</s>"]
    tokenizer = word_level_tokenizer(specials + [f"w{i}" for i in range(sizes["vocab_size"] - len(specials))])

    def config(shape: dict, **extra):
        extra.update(intermediate_size=shape["intermediate_size"], max_position_embeddings=context_of(sizes))
        return llama_config(tokenizer, shape["hidden_size"], shape["layers"], shape["heads"], **extra)

    torch.manual_seed(seed)
    with torch.device(device):
        policy = LlamaForCausalLM(config(sizes["policy"]))
        reward = LlamaForSequenceClassification(config(sizes["reward_and_value"], num_labels=1))
    models = {"policy": policy, "ref": copy.deepcopy(policy), "reward": reward, "value": copy.deepcopy(reward)}
    episodes = sizes["iterations"] * batch_size(sizes)
    prompts = torch.randint(len(specials), sizes["vocab_size"], (episodes, sizes["prompt_length"]))
    return tokenizer, models, Dataset.from_dict({"input_ids": prompts.tolist()})


def batch_size(sizes: dict) -> int:
    return sizes["per_device_train_batch_size"] * sizes["gradient_accumulation_steps"] * sizes["num_mini_batches"]


def training_settings(sizes: dict, impl: str, output_dir: str, cuda: bool) -> dict:
    """The config fields both trainers share, plus PPO-max's for ours."""
    common = dict(
        output_dir=output_dir,
        **{key: sizes[key] for key in TRAINER_FIELDS},
        total_episodes=sizes["iterations"] * batch_size(sizes),
        stop_token=None,
        learning_rate=3e-6,
        num_sample_generations=0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        gradient_checkpointing=False,
        bf16=cuda,
        tf32=True if cuda else None,
        use_cpu=not cuda,
        disable_tqdm=True,
        seed=0,
    )
    if impl == "trl112":
        return common
    ours = dict(preset="ppo_max", critic_warmup_steps=0)  # every timed iteration updates policy and critic
    if impl == "ppomax+vllm":
        ours.update(use_vllm=True, vllm_gpu_memory_utilization=0.3, vllm_max_model_length=context_of(sizes))
    if impl == "ppomax+staleness1":  # the next batch generated by a one-iteration-old copy while the update runs
        ours.update(max_staleness=1)
    return {**common, **ours}


def context_of(sizes: dict) -> int:
    return sizes["prompt_length"] + sizes["response_length"]


def make_trainer(impl: str, settings: dict, tokenizer, models: dict, dataset, callback):
    if impl == "trl112":
        from trl.experimental.ppo import PPOConfig, PPOTrainer
    else:
        from trl_ppomax import PPOMaxConfig as PPOConfig
        from trl_ppomax import PPOMaxTrainer as PPOTrainer
    return PPOTrainer(
        args=PPOConfig(**settings),
        processing_class=tokenizer,
        model=models["policy"],
        ref_model=models["ref"],
        reward_model=models["reward"],
        value_model=models["value"],
        train_dataset=dataset,
        callbacks=[callback],
    )


def stopwatch(warmup: int, sync, phases: dict):
    """A trainer callback that starts the clocks (phase times, generated tokens, training time) once ``warmup``
    iterations are done; ``.seconds()`` is the time since."""
    from transformers import TrainerCallback

    class Stopwatch(TrainerCallback):
        start = None

        def restart(self) -> None:
            sync()
            phases.clear()
            GENERATED["tokens"] = 0
            self.start = time.perf_counter()

        def on_train_begin(self, args, state, control, **kwargs):
            if warmup == 0:
                self.restart()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == warmup:
                self.restart()

        def seconds(self) -> float:
            sync()
            return time.perf_counter() - self.start

    return Stopwatch()


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def throughput(iterations: int, rollout_batch: int, seconds: float, phases: dict) -> dict:
    """Episodes and generated tokens per second of the timed ``iterations``, and the time split."""
    episodes = iterations * rollout_batch
    generation, scoring = phases.get("generation", 0.0), phases.get("scoring_forwards", 0.0)
    return {
        "timed_iterations": iterations,
        "episodes": episodes,
        "generated_tokens": GENERATED["tokens"],
        "mean_response_length": GENERATED["tokens"] / episodes,
        "train_seconds": seconds,
        "episodes_per_second": episodes / seconds,
        "generated_tokens_per_second": GENERATED["tokens"] / seconds,
        "generation_seconds": generation,
        "weight_sync_seconds": phases.get("weight_sync", 0.0),  # vLLM: part of generation_seconds
        "scoring_forwards_seconds": scoring,
        "update_and_rest_seconds": seconds - generation - scoring,
    }


def update_mfu(sizes: dict, counts: dict, split: dict, peak: float | None) -> dict:
    """MFU of the update: (6·N_policy + 6·N_critic) × trained tokens / update seconds / peak."""
    trained_tokens = (split["episodes"] * sizes["prompt_length"] + split["generated_tokens"]) * sizes["num_ppo_epochs"]
    flops = 6 * (counts["policy"] + counts["value"]) * trained_tokens
    achieved = flops / split["update_and_rest_seconds"]
    return {
        "trained_tokens": trained_tokens,
        "update_flops": flops,
        "update_tflops_per_second": achieved / 1e12,
        "peak_bf16_tflops": None if peak is None else peak / 1e12,
        "mfu": None if peak is None else achieved / peak,
    }


def run_worker(args) -> None:
    """One timed run of ``args.impl``; prints ``RESULT {json}``."""
    import tempfile

    import torch

    sys.path.insert(0, str(HERE.parent))  # benchmarks/: speed_worker's phase timers
    import speed_worker

    cuda = torch.cuda.is_available() and not args.dry_run
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sizes = SIZES["dry_run" if args.dry_run else "gpu"]
    synced_timers(speed_worker, sync)
    speed_worker.instrument(args.impl)
    count_generation(args.impl)
    tokenizer, models, dataset = build_inputs(sizes, "cuda" if cuda else "cpu")
    counts = {name: parameter_count(model) for name, model in models.items()}
    clock = stopwatch(sizes["warmup_iterations"], sync, speed_worker.PHASES)
    with tempfile.TemporaryDirectory() as output_dir:
        settings = training_settings(sizes, args.impl, output_dir, cuda)
        trainer = make_trainer(args.impl, settings, tokenizer, models, dataset, clock)
        before = models["policy"].lm_head.weight.detach().clone()
        trainer.train()
        seconds = clock.seconds()
    change = float((models["policy"].lm_head.weight.detach() - before).abs().max())
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    timed_iterations = trainer.state.global_step - sizes["warmup_iterations"]
    split = throughput(timed_iterations, trainer.args.batch_size, seconds, speed_worker.PHASES)
    metrics = {
        **split,
        **update_mfu(sizes, counts, split, peak_flops(device, args.peak_tflops)),
        "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "policy_lm_head_max_abs_change": change,
        "policy_parameters_changed": change > 0,
    }
    result = {
        "device": device,
        "parameters": counts,
        "settings": {**sizes, "batch_size": batch_size(sizes)},
        "trainer": {k: v for k, v in settings.items() if k not in ("output_dir", "report_to", "disable_tqdm")},
        "metrics": metrics,
    }
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# Orchestrator: the runs in fresh processes, within the time budget
# ---------------------------------------------------------------------------------------------------------------------
def extra_run_python(name: str, args) -> tuple[str | None, str | None]:
    """``(python, None)`` to run ``name``, or ``(None, why not)``."""
    if name == "trl112":
        return (args.trl112_python, None) if args.trl112_python else (None, "no --trl112-python given")
    if name == "ppomax+staleness1":
        return sys.executable, None
    if args.dry_run:
        return None, "dry run: the vLLM run needs a GPU"
    if importlib.util.find_spec("vllm") is None:
        return None, "vllm is not importable"
    return sys.executable, None


def time_guard(estimate: float, left: float, budget: float) -> str | None:
    """Why a run estimated to take ``estimate`` seconds must be skipped with ``left`` seconds left, or None."""
    if estimate <= left:
        return None
    return f"time guard: about {estimate:.0f} s needed, {max(left, 0):.0f} s left of the {budget:.0f} s budget"


def launch(name: str, python: str, args, timeout: float) -> tuple[dict | None, str | None, float]:
    """Run ``--impl name`` in a fresh process; ``(result, error, seconds)``, the process killed at ``timeout``."""
    command = [python, str(Path(__file__).resolve()), "--impl", name]
    if args.dry_run:
        command.append("--dry-run")
    if args.peak_tflops is not None:
        command += ["--peak-tflops", str(args.peak_tflops)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if name == "trl112" and not args.dry_run:  # trl 1.12 builds its own Accelerator, deaf to bf16=True
        env["ACCELERATE_MIXED_PRECISION"] = "bf16"  # as `accelerate launch --mixed_precision bf16` sets it
    start = time.monotonic()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, _ = process.communicate(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return None, f"stopped by the time guard after {timeout:.0f} s", time.monotonic() - start
    seconds = time.monotonic() - start
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if process.returncode != 0 or not lines:
        return None, f"exit code {process.returncode}; stdout tail: {stdout[-1500:]}", seconds
    return json.loads(lines[-1].removeprefix("RESULT ")), None, seconds


def run_section(name: str, args, left: float) -> tuple[dict | None, str | None]:
    """Issue 46's row ``name`` (:data:`SECTIONS`): its driver in a fresh process, stopped at ``left`` seconds;
    ``(its JSON, None)`` or ``(None, why)``."""
    gpu_command, dry_command, most = SECTIONS[name]
    argv = (dry_command if args.dry_run else gpu_command).split()
    timeout = min(most, left)
    if timeout < 30:
        return None, f"time guard: {max(left, 0):.0f} s left of the {args.budget_s:.0f} s budget"
    output = Path(args.output).with_name(f"{Path(args.output).stem}_{name}.json")
    command = [sys.executable, str(HERE.parent / argv[0]), *argv[1:], "--output", str(output)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        stdout, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, _ = process.communicate()
        return None, f"stopped by the time guard after {timeout:.0f} s; output tail: {stdout[-1500:]}"
    if process.returncode != 0 or not output.exists():
        return None, f"exit code {process.returncode}; output tail: {stdout[-3000:]}"
    return json.loads(output.read_text()), None


def orchestrate(args) -> int:
    """Issue 46's rows (:data:`SECTIONS`), then ppomax, then the optional runs while the budget allows; write one
    JSON file."""
    start = time.monotonic()
    report = {"dry_run": args.dry_run, "budget_seconds": args.budget_s, "runs": {}, "skipped": [], "failed": []}
    for name in args.sections:
        left = args.budget_s - MARGIN_S - (time.monotonic() - start)
        section_start = time.monotonic()
        result, error = run_section(name, args, left)
        if result is None:
            report["failed"].append({"run": name, "error": error, "process_seconds": time.monotonic() - section_start})
        else:
            report[name] = {**result, "process_seconds": time.monotonic() - section_start}
    left = args.budget_s - MARGIN_S - (time.monotonic() - start)
    result, error, first_seconds = launch("ppomax", sys.executable, args, left)
    record_run(report, "ppomax", result, error, first_seconds)
    for name, factor, startup in EXTRA_RUNS:
        left = args.budget_s - MARGIN_S - (time.monotonic() - start)
        python, why_not = extra_run_python(name, args)
        why_not = why_not or time_guard(factor * first_seconds + startup, left, args.budget_s)
        if why_not:
            report["skipped"].append({"run": name, "reason": why_not})
            continue
        record_run(report, name, *launch(name, python, args, left))
    report["wall_seconds"] = time.monotonic() - start
    add_comparison(report)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print_summary(report, args.output)
    return 0 if "ppomax" in report["runs"] else 1


def record_run(report: dict, name: str, result: dict | None, error: str | None, seconds: float) -> None:
    """File a run's metrics under ``runs`` (the first successful run also gives device, parameters, settings)."""
    if result is None:
        report["failed"].append({"run": name, "error": error, "process_seconds": seconds})
        return
    for key in ("device", "parameters", "settings"):
        report.setdefault(key, result[key])
    report["runs"][name] = {**result["metrics"], "process_seconds": seconds, "trainer": result["trainer"]}
    if result["settings"]["reward_and_value"] != result["settings"]["policy"]:
        report["note"] = "The reward and value models are smaller Llamas than the policy, to save memory and time."


def add_comparison(report: dict) -> None:
    runs = report["runs"]
    if "ppomax" in runs and "ppomax+staleness1" in runs:
        report["staleness"] = {
            "episodes_per_second_k1_over_k0": runs["ppomax+staleness1"]["episodes_per_second"]
            / runs["ppomax"]["episodes_per_second"]
        }
    if "ppomax" in runs and "trl112" in runs:
        ours, theirs = runs["ppomax"], runs["trl112"]
        report["comparison"] = {
            "episodes_per_second_ppomax_over_trl112": ours["episodes_per_second"] / theirs["episodes_per_second"],
            "peak_memory_ppomax_over_trl112": None
            if ours["peak_gpu_memory_gib"] is None
            else ours["peak_gpu_memory_gib"] / theirs["peak_gpu_memory_gib"],
        }


def print_summary(report: dict, output: str) -> None:
    print(f"device: {report.get('device')}; parameters: {report.get('parameters')}")
    for name in SECTIONS:
        if name in report:
            summary = report[name].get("ratios") or report[name].get("by_chunk_size") or report[name]["runs"]
            print(f"{name} ({report[name]['process_seconds']:.0f} s): {json.dumps(summary)[:1500]}")
    for name, run in report["runs"].items():
        mfu = "n/a" if run["mfu"] is None else f"{100 * run['mfu']:.1f}%"
        print(
            f"{name:12s} {run['episodes_per_second']:8.2f} episodes/s {run['generated_tokens_per_second']:10.0f} tok/s"
            f"  generation {run['generation_seconds']:.1f} s, scoring {run['scoring_forwards_seconds']:.1f} s, "
            f"update+rest {run['update_and_rest_seconds']:.1f} s  peak {run['peak_gpu_memory_gib']} GiB  MFU {mfu}"
        )
    for entry in report["skipped"] + report["failed"]:
        print(f"{entry['run']}: {entry.get('reason') or entry.get('error')}")
    print(f"wrote {output} ({report['wall_seconds']:.0f} s)")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "gpu.json"))
    parser.add_argument("--dry-run", action="store_true", help="tiny fp32 models on CPU, same code path, seconds")
    parser.add_argument("--peak-tflops", type=float, default=None, help="peak dense bf16 TFLOP/s for the MFU")
    parser.add_argument("--trl112-python", default=None, help="a python with trl==1.12.0: also run its PPOTrainer")
    parser.add_argument("--budget-s", type=float, default=450.0, help="stop adding runs beyond this many seconds")
    parser.add_argument(
        "--sections", nargs="*", default=list(SECTIONS), choices=list(SECTIONS), help="issue 46's rows to run first"
    )
    parser.add_argument(
        "--impl", choices=["ppomax", "ppomax+staleness1", "ppomax+vllm", "trl112"], help=argparse.SUPPRESS
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.impl:
        run_worker(args)
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
