"""Speed and memory: trl 1.12's PPOTrainer vs PPOMaxTrainer (vanilla preset: the same maths) on identical work.

Creates and caches a virtual environment with trl==1.12.0 on top of this environment's packages (same torch and
transformers), builds and caches the shared assets (a 2-layer Llama with a 16k vocabulary SFT-trained on the toy
world's dialogues, so responses end with eos early; a reward/value model from it; tokenized prompts), then runs the
trainers in fresh processes, alternating, and reports medians and ratios.

    python benchmarks/speed.py --runs 3 --output benchmarks/results/speed.json
    python benchmarks/speed.py --vllm --runs 3 --output benchmarks/results/speed_vllm.json   # after bash .ci/vllm.sh
    python benchmarks/speed.py --batching --runs 3 --output benchmarks/results/speed_batching.json
    python benchmarks/speed.py --no-stop-token --flat --runs 3 --output benchmarks/results/speed_no_stop_flat.json
    python benchmarks/speed.py --staleness --runs 3 --output benchmarks/results/speed_staleness.json
    python benchmarks/speed.py --continuous-batching --runs 3 --output benchmarks/results/speed_continuous_batching.json

``--vllm`` compares, in the vLLM environment that ``.ci/vllm.sh`` builds (``--vllm-python``), the same PPO run with
``model.generate`` and with a colocated vLLM engine (``use_vllm=True``): generation time, weight-sync time per
iteration and episodes per second.

``--flat`` builds the assets without SFT (random weights: flat next-token distributions, whose nucleus holds most of
the vocabulary). ``--staleness`` compares ``max_staleness`` 1 and 2 with the synchronous loop.

``--continuous-batching`` compares transformers' continuous batching (``use_transformers_continuous_batching``)
with padded ``model.generate`` at skewed response lengths (the SFT policy stops early, a few responses run to
``--response-length``) and at equal lengths (no stop token), both with trl's sampling settings (no top-p, no
repetition penalty), so the two engines sample the same distribution.

``--batching`` measures ``max_tokens_per_microbatch`` (padded tokens computed, forward and update time) against the row
split on prompts of widely varying lengths, and ``num_samples_per_prompt=4`` against 4× the prompts.
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
#: The fields reported for each config (medians over its runs).
KEYS = [
    "episodes_per_second",
    "train_seconds",
    "process_seconds",
    "generation_seconds",
    "scoring_forwards_seconds",
    "update_and_rest_seconds",
    "peak_rss_gb",
    "mean_response_length",
]


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


def build_assets(folder: Path, flat: bool = False) -> Path:
    """Tokenizer (toy-world words + filler up to a 16k vocabulary), SFT policy, reward/value model, prompts; ``flat``:
    the policy keeps its random weights (no SFT), so its next-token distributions are flat."""
    folder = folder.with_name(folder.name + "-flat") if flat else folder
    if (folder / "prompts" / "dataset_info.json").exists():
        return folder
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    from trl_ppomax.toyworld.tiny import llama_config, word_level_tokenizer
    from trl_ppomax.toyworld.world import WorldSampler, vocabulary

    words = vocabulary()
    tokenizer = word_level_tokenizer(words + [f"w{i}" for i in range(VOCAB_SIZE - len(words))])
    config = llama_config(tokenizer, hidden_size=128, heads=4)
    model = LlamaForCausalLM(config)
    sampler = WorldSampler(seed=0)
    if flat:
        model.save_pretrained(folder / "sft")
    else:
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


def vllm_main(args) -> None:
    """The vLLM column: the same work (vanilla preset) generated by ``model.generate`` and by vLLM, in one env."""
    assets = build_assets(HERE / ".cache" / "speed-assets", args.flat)
    configs = [("ppomax", "vanilla", args.vllm_python), ("ppomax+vllm", "vanilla", args.vllm_python)]
    results = run_alternating(configs, assets, args)
    keys = [
        "episodes_per_second",
        "train_seconds",
        "process_seconds",
        "generation_seconds",
        "weight_sync_seconds",
        "weight_sync_seconds_per_iteration",
        "scoring_forwards_seconds",
        "update_and_rest_seconds",
        "mean_response_length",
    ]
    medians = median_fields(results, keys)
    hf, vllm = medians["ppomax/vanilla"], medians["ppomax+vllm/vanilla"]
    ratios = {
        "generation phase (HF generate / vLLM)": hf["generation_seconds"] / vllm["generation_seconds"],
        "episodes_per_second (vLLM / HF generate)": vllm["episodes_per_second"] / hf["episodes_per_second"],
        "process_seconds (HF generate / vLLM, engine start included)": hf["process_seconds"] / vllm["process_seconds"],
    }
    report(results, medians, ratios, keys, args.output)


def batching_main(args) -> None:
    """Token-budget micro-batches against the row split on prompts of widely varying lengths, and 4 samples per prompt
    against 4× the prompts (the vanilla preset, the same episodes)."""
    assets = build_assets(HERE / ".cache" / "speed-assets", args.flat)
    budget = f"tokens={args.token_budget}"
    presets = ["vanilla+varied", f"vanilla+varied+{budget}", "vanilla", "vanilla+n=4"]
    results = run_alternating([("ppomax", preset, sys.executable) for preset in presets], assets, args)
    keys = [*KEYS, "padded_tokens", "padding_share"]
    m = median_fields(results, keys)
    rows, packed = m["ppomax/vanilla+varied"], m[f"ppomax/vanilla+varied+{budget}"]
    one, four = m["ppomax/vanilla"], m["ppomax/vanilla+n=4"]
    ratios = {
        "padded tokens computed (rows / token budget), varied lengths": rows["padded_tokens"]
        / packed["padded_tokens"],
        "scoring forwards seconds (rows / token budget)": rows["scoring_forwards_seconds"]
        / packed["scoring_forwards_seconds"],
        "update and rest seconds (rows / token budget)": rows["update_and_rest_seconds"]
        / packed["update_and_rest_seconds"],
        "episodes_per_second (token budget / rows)": packed["episodes_per_second"] / rows["episodes_per_second"],
        "episodes_per_second (n=4 / 4x the prompts)": four["episodes_per_second"] / one["episodes_per_second"],
        "generation seconds (4x the prompts / n=4)": one["generation_seconds"] / four["generation_seconds"],
    }
    report(results, m, ratios, keys, args.output)


def critic_free_main(args) -> None:
    """A critic-free estimator (RLOO) against GAE, PPO-max's, at 4 samples per prompt (the group needs them): time per
    episode and peak memory of the same episodes; RLOO builds no critic (one model, its forward and update less)."""
    assets = build_assets(HERE / ".cache" / "speed-assets", args.flat)
    presets = ["ppo_max+n=4", "ppo_max+n=4+estimator=rloo"]
    results = run_alternating([("ppomax", preset, sys.executable) for preset in presets], assets, args)
    m = median_fields(results, KEYS)
    gae, rloo = m["ppomax/ppo_max+n=4"], m["ppomax/ppo_max+n=4+estimator=rloo"]
    ratios = {
        "seconds per episode (rloo / gae)": gae["episodes_per_second"] / rloo["episodes_per_second"],
        "peak_rss (rloo / gae)": rloo["peak_rss_gb"] / gae["peak_rss_gb"],
        "scoring forwards seconds (rloo / gae)": rloo["scoring_forwards_seconds"] / gae["scoring_forwards_seconds"],
        "update and rest seconds (rloo / gae)": rloo["update_and_rest_seconds"] / gae["update_and_rest_seconds"],
    }
    report(results, m, ratios, KEYS, args.output)


def staleness_main(args) -> None:
    """Bounded-staleness rollouts (max_staleness 1 and 2) against the synchronous loop, PPO-max's preset: time per
    episode and the trainer's phase times (``timing/…``): how much of generation the producer hides."""
    assets = build_assets(HERE / ".cache" / "speed-assets", args.flat)
    presets = ["ppo_max", "ppo_max+staleness=1", "ppo_max+staleness=2"]
    results = run_alternating([("ppomax", preset, sys.executable) for preset in presets], assets, args)
    keys = [
        *KEYS,
        "rollout_phase_seconds",
        "update_phase_seconds",
        "rollout_wait_seconds",
        "producer_generation_seconds",
    ]
    m = median_fields(results, keys)
    sync, one, two = m["ppomax/ppo_max"], m["ppomax/ppo_max+staleness=1"], m["ppomax/ppo_max+staleness=2"]
    ratios = {
        "time per episode (k=1 / k=0)": sync["episodes_per_second"] / one["episodes_per_second"],
        "time per episode (k=2 / k=0)": sync["episodes_per_second"] / two["episodes_per_second"],
        "trainer's rollout phase (k=1 / k=0)": one["rollout_phase_seconds"] / sync["rollout_phase_seconds"],
        "trainer's wait for rollouts / producer's generation (k=1)": one["rollout_wait_seconds"]
        / one["producer_generation_seconds"],
        "peak_rss (k=1 / k=0)": one["peak_rss_gb"] / sync["peak_rss_gb"],
    }
    report(results, m, ratios, keys, args.output)


def continuous_batching_main(args) -> None:
    """Continuous batching against padded ``generate``: generation time and time per episode, at skewed lengths
    (responses stop early, a few run to the limit) and at equal lengths (no stop token: nothing to gain)."""
    import copy

    assets = build_assets(HERE / ".cache" / "speed-assets", args.flat)
    presets = ["ppo_max+vanilla_sampling", "ppo_max+vanilla_sampling+cb"]
    results, medians, ratios = {}, {}, {}
    for shape, no_stop in (("skewed", False), ("equal", True)):
        shaped = copy.copy(args)
        shaped.no_stop_token = no_stop
        runs = run_alternating([("ppomax", preset, sys.executable) for preset in presets], assets, shaped)
        m = median_fields(runs, KEYS)
        padded, paged = m["ppomax/ppo_max+vanilla_sampling"], m["ppomax/ppo_max+vanilla_sampling+cb"]
        results.update({f"{shape}/{name}": value for name, value in runs.items()})
        medians.update({f"{shape}/{name}": value for name, value in m.items()})
        ratios[f"generation seconds (generate / continuous batching), {shape} lengths"] = (
            padded["generation_seconds"] / paged["generation_seconds"]
        )
        ratios[f"time per episode (continuous batching / generate), {shape} lengths"] = (
            padded["episodes_per_second"] / paged["episodes_per_second"]
        )
        ratios[f"mean response length (continuous batching / generate), {shape} lengths"] = (
            paged["mean_response_length"] / padded["mean_response_length"]
        )
    report(results, medians, ratios, KEYS, args.output)


def run_alternating(configs: list[tuple[str, str, str]], assets: Path, args) -> dict[str, list[dict]]:
    """``args.runs`` rounds of every ``(impl, preset, python)`` config, the order reversed every other round."""
    results: dict[str, list[dict]] = {f"{impl}/{preset}": [] for impl, preset, _ in configs}
    for index in range(args.runs):
        for impl, preset, python in configs if index % 2 == 0 else configs[::-1]:
            result = run(python, impl, preset, assets, args.episodes, args.response_length, args.no_stop_token)
            results[f"{impl}/{preset}"].append(result)
            print(
                f"run {index}: {impl}/{preset}: {result['episodes_per_second']:.2f} episodes/s, train "
                f"{result['train_seconds']:.1f} s, generation {result['generation_seconds']:.2f} s, process "
                f"{result['process_seconds']:.1f} s, peak {result['peak_rss_gb']:.2f} GB",
                flush=True,
            )
    return results


def median_fields(results: dict[str, list[dict]], keys: list[str]) -> dict[str, dict[str, float]]:
    """Per config, the median of each field over its runs (fields a config never reports are left out)."""
    return {
        name: {
            k: statistics.median(r[k] for r in runs if r.get(k) is not None)
            for k in keys
            if any(r.get(k) is not None for r in runs)
        }
        for name, runs in results.items()
    }


def report(results: dict, medians: dict, ratios: dict, keys: list[str], output: str) -> None:
    """Print the medians and the ratios; write them with every run to the JSON ``output``."""
    print(f"\n{'median':<34}" + "".join(f"{name[:28]:>30}" for name in medians))
    for key in keys:
        print(f"{key:<34}" + "".join(f"{m.get(key, float('nan')):>30.3f}" for m in medians.values()))
    print()
    for name, value in ratios.items():
        print(f"{name:<64} {value:6.2f}")
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"command": " ".join(sys.argv), "runs": results, "medians": medians, "ratios": ratios}, indent=1)
    )


#: Variants a config's preset may carry after ``+``, as the worker's flags.
VARIANTS = {
    "vanilla_sampling": ["--vanilla-sampling"],  # PPO-max maths with trl's sampling settings
    "varied": ["--varied-lengths"],  # prompts of widely varying lengths
    "n": ["--samples-per-prompt"],  # n=K: K samples per prompt
    "tokens": ["--max-tokens"],  # tokens=K: micro-batches under a K-token budget
    "estimator": ["--estimator"],  # estimator=NAME: advantage_estimator (a critic-free one builds no critic)
    "staleness": ["--max-staleness"],  # staleness=K: max_staleness (rollouts from a producer thread)
    "cb": ["--continuous-batching"],  # transformers' continuous batching as the engine
}


def run(python: str, impl: str, preset: str, assets: Path, episodes: int, length: int, no_stop: bool = False) -> dict:
    """One worker process; ``preset`` may carry :data:`VARIANTS`, e.g. ``vanilla+varied+tokens=1024``; with
    ``no_stop`` every response is ``length`` tokens (identical work for every config)."""
    name, *variants = preset.split("+")
    command = [python, str(HERE / "speed_worker.py"), "--impl", impl, "--preset", name, "--assets", str(assets)]
    command += ["--episodes", str(episodes), "--response-length", str(length)]
    for variant in variants:
        key, _, value = variant.partition("=")
        command += VARIANTS[key] + ([value] if value else [])
    command += ["--no-stop-token"] if no_stop else []
    start = time.perf_counter()
    out = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "TRL_EXPERIMENTAL_SILENCE": "1",
            "HF_HUB_OFFLINE": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        },
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
    parser.add_argument(
        "--no-stop-token", action="store_true", help="no stop token: every response is --response-length tokens"
    )
    parser.add_argument(
        "--flat",
        action="store_true",
        help="random-weight models (flat distributions: nuclei of most of the vocabulary)",
    )
    parser.add_argument("--output", default=str(HERE / "results" / "speed.json"))
    parser.add_argument("--token-budget", type=int, default=1024, help="--batching: max_tokens_per_microbatch")
    parser.add_argument("--vllm", action="store_true", help="HF generation vs a colocated vLLM engine")
    parser.add_argument(
        "--batching",
        action="store_true",
        help="token-budget vs row micro-batches on prompts of varied lengths; n=4 samples per prompt vs 4× the prompts",
    )
    parser.add_argument("--critic-free", action="store_true", help="RLOO (no critic) vs GAE, n=4 samples per prompt")
    parser.add_argument("--staleness", action="store_true", help="max_staleness 1 and 2 vs the synchronous loop")
    parser.add_argument(
        "--continuous-batching", action="store_true", help="transformers' continuous batching vs padded generate"
    )
    parser.add_argument("--vllm-python", default=str(HERE.parent / ".venv-vllm" / "bin" / "python"))
    args = parser.parse_args()
    if args.critic_free:
        return critic_free_main(args)
    if args.staleness:
        return staleness_main(args)
    if args.continuous_batching:
        return continuous_batching_main(args)
    if args.vllm:
        return vllm_main(args)
    if args.batching:
        return batching_main(args)
    trl112 = str(ensure_trl112_env(HERE / ".venv-trl112"))
    assets = build_assets(HERE / ".cache" / "speed-assets", args.flat)
    configs = [
        ("trl112", "vanilla", trl112),
        ("ppomax", "vanilla", sys.executable),
        ("ppomax", "ppo_max", sys.executable),
        ("ppomax", "ppo_max+vanilla_sampling", sys.executable),  # PPO-max maths with trl's sampling settings
    ]
    results = run_alternating(configs, assets, args)
    keys = KEYS
    medians = median_fields(results, keys)
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
    report(results, medians, ratios, keys, args.output)


if __name__ == "__main__":
    main()
