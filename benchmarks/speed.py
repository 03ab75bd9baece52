"""Speed and memory: trl 1.12's PPOTrainer vs PPOMaxTrainer (vanilla preset: the same maths) on identical work.

Creates and caches a virtual environment with trl==1.12.0 on top of this environment's packages (same torch and
transformers), builds and caches the shared assets (a 2-layer Llama with a 16k vocabulary SFT-trained on the toy
world's dialogues, so responses end with eos early; a reward/value model from it; tokenized prompts), then runs the
trainers in fresh processes, alternating, and reports medians and ratios.

    python benchmarks/speed.py --runs 3 --output benchmarks/results/speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VOCAB_SIZE = 16_000


def ensure_trl112_env(path: Path) -> Path:
    """A venv with trl 1.12.0 over the system site-packages (so torch/transformers are the same); cached."""
    python = path / "bin" / "python"
    if (
        python.exists()
        and "1.12.0"
        in subprocess.run(
            [str(python), "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True
        ).stdout
    ):
        return python
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(path)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "trl==1.12.0"], check=True)
    return python


def build_assets(folder: Path) -> Path:
    """Tokenizer (toy-world words + filler up to a 16k vocabulary), SFT policy, reward/value model, prompts."""
    if (folder / "prompts" / "dataset_info.json").exists():
        return folder
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    from trl_ppomax.tiny import llama_config, word_level_tokenizer
    from trl_ppomax.toyworld.world import WorldSampler, vocabulary

    words = vocabulary()
    tokenizer = word_level_tokenizer(words + [f"w{i}" for i in range(VOCAB_SIZE - len(words))])
    config = llama_config(tokenizer, hidden_size=128, heads=4)
    model = LlamaForCausalLM(config)
    sampler = WorldSampler(seed=0)
    trainer = SFTTrainer(
        model=model,
        args=SFTConfig(
            output_dir=str(folder / "sft-run"),
            num_train_epochs=1,
            per_device_train_batch_size=32,
            learning_rate=3e-3,
            max_length=64,
            report_to="none",
            save_strategy="no",
            bf16=False,
            use_cpu=True,
            gradient_checkpointing=False,
            disable_tqdm=True,
        ),
        train_dataset=Dataset.from_list(sampler.sft_rows(3000)),
        processing_class=tokenizer,
    )
    trainer.train()
    trainer.save_model(str(folder / "sft"))
    tokenizer.save_pretrained(folder / "sft")
    reward = AutoModelForSequenceClassification.from_pretrained(folder / "sft", num_labels=1)
    reward.config.pad_token_id = tokenizer.pad_token_id
    reward.save_pretrained(folder / "reward")
    prompts = sampler.prompts(512, offset=9)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    Dataset.from_dict({"input_ids": ids}).save_to_disk(str(folder / "prompts"))
    return folder


def run(python: str, impl: str, preset: str, assets: Path, episodes: int, length: int) -> dict:
    """One worker process; ``preset`` may end with ``+vanilla_sampling`` (PPO-max maths, trl's sampling)."""
    name, _, variant = preset.partition("+")
    command = [python, str(HERE / "speed_worker.py"), "--impl", impl, "--preset", name, "--assets", str(assets)]
    command += ["--episodes", str(episodes), "--response-length", str(length)]
    command += ["--vanilla-sampling"] if variant == "vanilla_sampling" else []
    start = time.perf_counter()
    out = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""},
    )
    if out.returncode != 0:
        raise RuntimeError(f"{impl} {preset} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.rsplit("RESULT ", 1)[1].splitlines()[0])
    result["process_seconds"] = time.perf_counter() - start
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--episodes", type=int, default=192)
    parser.add_argument("--response-length", type=int, default=48)
    parser.add_argument("--output", default=str(HERE / "results" / "speed.json"))
    args = parser.parse_args()
    trl112 = str(ensure_trl112_env(HERE / ".venv-trl112"))
    assets = build_assets(HERE / ".cache" / "speed-assets")
    configs = [
        ("trl112", "vanilla", trl112),
        ("ppomax", "vanilla", sys.executable),
        ("ppomax", "ppo_max", sys.executable),
        ("ppomax", "ppo_max+vanilla_sampling", sys.executable),  # PPO-max maths with trl's sampling settings
    ]
    results: dict[str, list[dict]] = {f"{impl}/{preset}": [] for impl, preset, _ in configs}
    for index in range(args.runs):
        for impl, preset, python in configs if index % 2 == 0 else configs[::-1]:  # alternate the order
            result = run(python, impl, preset, assets, args.episodes, args.response_length)
            results[f"{impl}/{preset}"].append(result)
            print(
                f"run {index}: {impl}/{preset}: {result['episodes_per_second']:.2f} episodes/s, "
                f"train {result['train_seconds']:.1f} s, process {result['process_seconds']:.1f} s, "
                f"peak {result['peak_rss_gb']:.2f} GB",
                flush=True,
            )
    keys = [
        "episodes_per_second",
        "train_seconds",
        "process_seconds",
        "generation_seconds",
        "scoring_forwards_seconds",
        "update_and_rest_seconds",
        "peak_rss_gb",
        "mean_response_length",
    ]
    medians = {
        name: {
            k: statistics.median(r[k] for r in runs if r[k] is not None)
            for k in keys
            if any(r[k] is not None for r in runs)
        }
        for name, runs in results.items()
    }
    base, ours, ppo_max = medians["trl112/vanilla"], medians["ppomax/vanilla"], medians["ppomax/ppo_max"]
    maths_only = medians["ppomax/ppo_max+vanilla_sampling"]
    ratios = {
        "episodes_per_second (ppomax vanilla / trl 1.12)": ours["episodes_per_second"] / base["episodes_per_second"],
        "process_seconds (trl 1.12 / ppomax vanilla)": base["process_seconds"] / ours["process_seconds"],
        "peak_rss (ppomax vanilla / trl 1.12)": ours["peak_rss_gb"] / base["peak_rss_gb"],
        "time per episode (ppo_max / vanilla)": ours["episodes_per_second"] / ppo_max["episodes_per_second"],
        "time per episode (ppo_max maths, vanilla sampling / vanilla)": ours["episodes_per_second"]
        / maths_only["episodes_per_second"],
    }
    print(f"\n{'median':<34}" + "".join(f"{name[:28]:>30}" for name in medians))
    for key in keys:
        print(f"{key:<34}" + "".join(f"{m.get(key, float('nan')):>30.3f}" for m in medians.values()))
    print()
    for name, value in ratios.items():
        print(f"{name:<64} {value:6.2f}")
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(
        json.dumps({"command": " ".join(sys.argv), "runs": results, "medians": medians, "ratios": ratios}, indent=1)
    )


if __name__ == "__main__":
    main()
