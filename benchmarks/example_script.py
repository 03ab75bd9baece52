"""Whole-process speed on TRL's own PPO example workload: trl 1.12's PPOTrainer vs PPOMaxTrainer, import swapped.

``example_script_worker.py`` follows the structure of ``examples/scripts/ppo/ppo.py`` in huggingface/trl; every setting
not named below stays at each config class's default (so trl 1.12 and PPO-max each run with their own defaults).
Three configs, each in fresh processes, the order reversed every other round: trl 1.12, PPO-max with its default
preset, and PPO-max with ``--preset vanilla`` (trl 1.12's maths). The time is the wall clock around the whole
subprocess, interpreter start and imports included.

Assets, built once and cached under ``benchmarks/.cache/example-assets``: a word-level tokenizer with 8192 tokens, a
randomly initialised 2-layer Llama (hidden 128, 4 heads) as the SFT model, a reward/value model from it, and 420 prompts
of 8-24 random words (320 train rows after the 100 eval rows) as a local parquet dataset.

    python benchmarks/example_script.py --runs 3 --output benchmarks/results/example_script.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from speed import ensure_trl112_env, median_fields, report

HERE = Path(__file__).resolve().parent
VOCAB_SIZE = 8192
PROMPTS = 420
ENV = {"HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "TRL_EXPERIMENTAL_SILENCE": "1"}
KEYS = [
    "process_seconds",
    "in_script_seconds",
    "import_seconds",
    "setup_seconds",
    "init_seconds",
    "train_seconds",
    "save_seconds",
    "completions_seconds",
    "cpu_seconds",
    "peak_rss_gb",
    "mean_response_length",
    "mean_eos_tokens_per_batch",
]


def build_assets(folder: Path) -> Path:
    """Tokenizer and SFT model (``sft/``), reward/value model (``reward/``), prompt dataset (``prompts/``); cached."""
    if (folder / "prompts" / "train.parquet").exists():
        return folder
    from datasets import Dataset, load_dataset
    from transformers import AutoModelForSequenceClassification, LlamaForCausalLM

    from trl_ppomax.toyworld.tiny import SPECIALS, WORDS, llama_config, word_level_tokenizer

    words = WORDS + [f"w{i}" for i in range(VOCAB_SIZE - len(SPECIALS) - len(WORDS))]
    tokenizer = word_level_tokenizer(SPECIALS + words)
    assert len(tokenizer) == VOCAB_SIZE, len(tokenizer)
    model = LlamaForCausalLM(llama_config(tokenizer, hidden_size=128, heads=4))
    model.save_pretrained(folder / "sft")
    tokenizer.save_pretrained(folder / "sft")
    reward = AutoModelForSequenceClassification.from_pretrained(folder / "sft", num_labels=1)
    reward.config.pad_token_id = tokenizer.pad_token_id
    reward.save_pretrained(folder / "reward")
    rng = random.Random(0)
    prompts = [" ".join(rng.choices(words, k=rng.randint(8, 24))) for _ in range(PROMPTS)]
    staging = folder / "prompts.tmp"
    staging.mkdir(parents=True, exist_ok=True)
    Dataset.from_dict({"prompt": prompts}).to_parquet(staging / "train.parquet")
    staging.rename(folder / "prompts")
    load_dataset(str(folder / "prompts"), split="train")  # fills the datasets cache, as a first download would
    return folder


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(python: str, impl: str, extra: list[str], assets: Path, args) -> dict:
    """One worker process, timed from outside; returns its RESULT fields plus ``process_seconds`` (wall clock) and
    ``cpu_seconds`` (user + system time of the process, all threads: less sensitive to other load on the machine), and
    the machine's 1-minute load average at its end (other work running shows as a load above torch's threads)."""
    output_dir = tempfile.mkdtemp(prefix="example-script-")
    command = [python, str(HERE / "example_script_worker.py"), "--impl", impl, *extra]
    command += ["--dataset_name", str(assets / "prompts"), "--model_name_or_path", str(assets / "sft")]
    command += ["--sft_model_path", str(assets / "sft"), "--reward_model_path", str(assets / "reward")]
    command += ["--total_episodes", str(args.episodes), "--output_dir", output_dir, "--report_to", "none"]
    command += ["--use_cpu", "True", "--bf16", "False"]
    try:
        start, cpu = time.perf_counter(), children_cpu_seconds()
        out = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **ENV})
        seconds, cpu = time.perf_counter() - start, children_cpu_seconds() - cpu
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)
    if out.returncode != 0 or "RESULT " not in out.stdout:
        raise RuntimeError(f"{impl} {extra} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.rsplit("RESULT ", 1)[1].splitlines()[0])
    result.update(process_seconds=seconds, cpu_seconds=cpu, load_average_1min=os.getloadavg()[0])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="rounds; every round runs each config once")
    parser.add_argument("--episodes", type=int, default=320)
    parser.add_argument("--output", default=str(HERE / "results" / "example_script.json"))
    args = parser.parse_args()
    trl112 = str(ensure_trl112_env(HERE / ".venv-trl112"))
    assets = build_assets(HERE / ".cache" / "example-assets")
    configs = [
        ("trl112/default", trl112, "trl112", []),
        ("ppomax/default", sys.executable, "ppomax", []),
        ("ppomax/vanilla", sys.executable, "ppomax", ["--preset", "vanilla"]),
    ]
    results: dict[str, list[dict]] = {name: [] for name, *_ in configs}
    for index in range(args.runs):
        for name, python, impl, extra in configs if index % 2 == 0 else configs[::-1]:
            result = run(python, impl, extra, assets, args)
            results[name].append(result)
            print(
                f"run {index}: {name}: process {result['process_seconds']:.1f} s, train {result['train_seconds']:.1f} s, "
                f"cpu {result['cpu_seconds']:.1f} s, peak {result['peak_rss_gb']:.2f} GB",
                flush=True,
            )
    medians = median_fields(results, KEYS)
    base, ours, vanilla = medians["trl112/default"], medians["ppomax/default"], medians["ppomax/vanilla"]
    ratios = {
        "process_seconds (trl 1.12 / ppomax default)": base["process_seconds"] / ours["process_seconds"],
        "process_seconds (trl 1.12 / ppomax vanilla)": base["process_seconds"] / vanilla["process_seconds"],
        "cpu_seconds (trl 1.12 / ppomax default)": base["cpu_seconds"] / ours["cpu_seconds"],
        "cpu_seconds (trl 1.12 / ppomax vanilla)": base["cpu_seconds"] / vanilla["cpu_seconds"],
        "train_seconds (trl 1.12 / ppomax default)": base["train_seconds"] / ours["train_seconds"],
        "train_seconds (trl 1.12 / ppomax vanilla)": base["train_seconds"] / vanilla["train_seconds"],
        "peak_rss (ppomax default / trl 1.12)": ours["peak_rss_gb"] / base["peak_rss_gb"],
        "peak_rss (ppomax vanilla / trl 1.12)": vanilla["peak_rss_gb"] / base["peak_rss_gb"],
    }
    report(results, medians, ratios, KEYS, args.output)


if __name__ == "__main__":
    main()
