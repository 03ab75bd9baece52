"""Peak memory of a PPO-max iteration at Qwen's vocabulary (151,936), with the log-probs computed in chunks through
the LM head (``logprob_chunk_size``, the default 128) and from the whole logits (``None``), and the vocabulary's share
of it: the same run at a vocabulary of 1,024 is the baseline.

    python benchmarks/vocab_memory.py --output benchmarks/results/vocab_memory.json           # CPU, tiny llama
    python benchmarks/vocab_memory.py --gpu --output /tmp/vocab_memory_gpu.json                 # a Qwen2-0.5B shape, bf16

Each run is a fresh process of this script (``--worker``): ``PPOMaxTrainer(preset="ppo_max")`` for ``--iterations``
iterations of ``--rows`` responses of exactly ``--response-length`` tokens (no stop token), one minibatch, one micro-batch
of all the rows, the critic trained from the first iteration. Measured: the peak resident memory of the process (VmHWM;
on a GPU ``torch.cuda.max_memory_allocated``), the time of ``train()`` and of the update phase. The runs alternate over
``--runs`` rounds; the JSON has every run and the medians. See benchmarks/README.md for the reading.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Model shapes: a tiny llama (CPU) and Qwen2-0.5B's (GPU: hidden 896, 24 layers, 14 heads, 2 KV heads, tied head).
SHAPES = {
    "cpu": dict(arch="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2),
    "gpu": dict(
        arch="qwen2",
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        tie_word_embeddings=True,
    ),
}
QWEN_VOCAB = 151_936
BASELINE_VOCAB = 1_024


def peak_memory_mib(cuda: bool) -> float:
    import torch

    if cuda:
        return torch.cuda.max_memory_allocated() / 2**20
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def build(shape: dict, vocab_size: int, context: int, device: str):
    """``(tokenizer, policy, reward model)``: a word-level tokenizer of ``vocab_size`` tokens and random models."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig, Qwen2Config

    from trl_ppomax.toyworld.tiny import word_level_tokenizer

    specials = ["[PAD]", "[UNK]", "<s>", "</s>"]
    tokenizer = word_level_tokenizer(specials + [f"w{i}" for i in range(vocab_size - len(specials))])
    fields = {k: v for k, v in shape.items() if k != "arch"}
    fields.setdefault("intermediate_size", 2 * fields["hidden_size"])
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config}[shape["arch"]]
    config = config_class(vocab_size=vocab_size, max_position_embeddings=context, **fields, **ids)
    torch.manual_seed(0)
    with torch.device(device):
        policy = AutoModelForCausalLM.from_config(config)
        reward_config = copy.deepcopy(config)
        reward_config.num_labels = 1
        reward = AutoModelForSequenceClassification.from_config(reward_config)
    return tokenizer, policy, reward


def worker(args) -> None:
    """One run; prints ``RESULT {json}``."""
    import torch
    from datasets import Dataset

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import speed_worker

    from trl_ppomax import PPOMaxConfig, PPOMaxTrainer

    cuda = args.gpu
    speed_worker.instrument("ppomax")
    shape = SHAPES["gpu" if cuda else "cpu"]
    context = args.prompt_length + args.response_length
    tokenizer, policy, reward = build(shape, args.vocab_size, context, "cuda" if cuda else "cpu")
    prompts = torch.randint(4, args.vocab_size, (args.rows * args.iterations, args.prompt_length)).tolist()
    chunk_size = None if args.chunk_size == 0 else args.chunk_size
    with tempfile.TemporaryDirectory() as output_dir:
        config = PPOMaxConfig(
            output_dir=output_dir,
            preset="ppo_max",
            critic_warmup_steps=0,
            per_device_train_batch_size=args.rows,
            gradient_accumulation_steps=1,
            num_mini_batches=1,
            local_rollout_forward_batch_size=args.rows,
            total_episodes=args.rows * args.iterations,
            response_length=args.response_length,
            stop_token=None,
            logprob_chunk_size=chunk_size,
            use_liger_kernel=args.use_liger_kernel,
            gradient_checkpointing=False,
            bf16=cuda,
            use_cpu=not cuda,
            report_to="none",
            save_strategy="no",
            num_sample_generations=0,
            disable_tqdm=True,
            logging_steps=1,
            seed=0,
        )
        trainer = PPOMaxTrainer(
            args=config,
            processing_class=tokenizer,
            model=policy,
            reward_model=reward,
            value_model=copy.deepcopy(reward),
            train_dataset=Dataset.from_dict({"input_ids": prompts}),
        )
        before = policy.lm_head.weight.detach().clone()
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    update = sum(entry.get("timing/update", 0.0) for entry in trainer.state.log_history)
    result = {
        "vocab_size": args.vocab_size,
        "logprob_chunk_size": chunk_size,
        "peak_memory_mib": peak_memory_mib(cuda),
        "train_seconds": seconds,
        "update_seconds": update,
        "phases": dict(speed_worker.PHASES),
        "policy_changed": bool((policy.lm_head.weight.detach() != before).any()),
        "use_liger_kernel": args.use_liger_kernel,
        "liger_patched_modules": sum("liger" in getattr(m.forward, "__module__", "") for m in policy.modules()),
        "iterations": trainer.state.global_step,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
    }
    print("RESULT " + json.dumps(result), flush=True)


def launch(args, vocab_size: int, chunk_size: int) -> dict:
    command = [sys.executable, __file__, "--worker", "--vocab-size", str(vocab_size), "--chunk-size", str(chunk_size)]
    command += ["--rows", str(args.rows), "--response-length", str(args.response_length)]
    command += ["--prompt-length", str(args.prompt_length), "--iterations", str(args.iterations)]
    command += ["--gpu"] if args.gpu else []
    command += ["--use-liger-kernel"] if args.use_liger_kernel else []
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"run failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def summarise(runs: list[dict], chunk_sizes: list[int]) -> dict:
    """Medians per setting, the vocabulary's share of the peak (peak − the baseline vocabulary's peak) and the
    ratios of each chunk size against the whole logits (``None``)."""

    def median(key: str, vocab: int, chunk) -> float:
        return statistics.median(r[key] for r in runs if r["vocab_size"] == vocab and r["logprob_chunk_size"] == chunk)

    settings = [None if c == 0 else c for c in chunk_sizes]
    baseline = median("peak_memory_mib", BASELINE_VOCAB, None)
    rows = {}
    for chunk in settings:
        peak = median("peak_memory_mib", QWEN_VOCAB, chunk)
        rows[str(chunk)] = {
            "peak_memory_mib": peak,
            "vocabulary_share_mib": peak - baseline,
            "train_seconds": median("train_seconds", QWEN_VOCAB, chunk),
            "update_seconds": median("update_seconds", QWEN_VOCAB, chunk),
        }
    whole = rows["None"]
    for row in rows.values():
        row["vocabulary_share_whole_over_this"] = whole["vocabulary_share_mib"] / row["vocabulary_share_mib"]
        row["train_time_this_over_whole"] = row["train_seconds"] / whole["train_seconds"]
        row["update_time_this_over_whole"] = row["update_seconds"] / whole["update_seconds"]
    return {"baseline_vocab_peak_memory_mib": baseline, "by_chunk_size": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "vocab_memory.json"))
    parser.add_argument("--gpu", action="store_true", help="Qwen2-0.5B's shape in bf16 on the GPU")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=384)
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--chunk-sizes", default="0,256", help="logprob_chunk_size values; 0 = None (whole logits)")
    parser.add_argument("--no-baseline", action="store_true", help="only the listed chunk sizes, no ratios")
    parser.add_argument("--use-liger-kernel", action="store_true", help="Liger's layer kernels (a GPU path)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--vocab-size", type=int, default=QWEN_VOCAB, help=argparse.SUPPRESS)
    parser.add_argument("--chunk-size", type=int, default=256, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    chunk_sizes = [int(c) for c in args.chunk_sizes.split(",")]
    if 0 not in chunk_sizes and not args.no_baseline:
        chunk_sizes.insert(0, 0)
    start, runs = time.monotonic(), []
    for round_ in range(args.runs):
        order = [] if args.no_baseline else [(BASELINE_VOCAB, 0)]
        order += [(QWEN_VOCAB, c) for c in chunk_sizes]
        for vocab, chunk in order if round_ % 2 == 0 else order[::-1]:
            run = launch(args, vocab, chunk)
            runs.append(run)
            print(
                json.dumps(
                    {k: run[k] for k in ("vocab_size", "logprob_chunk_size", "peak_memory_mib", "train_seconds")}
                )
            )
    settings = {k: getattr(args, k) for k in ("gpu", "runs", "rows", "response_length", "prompt_length", "iterations")}
    report = {"settings": {**settings, "shape": SHAPES["gpu" if args.gpu else "cpu"]}, "runs": runs}
    if not args.no_baseline:
        report |= summarise(runs, chunk_sizes)
    report["wall_seconds"] = time.monotonic() - start
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report.get("by_chunk_size", runs), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
