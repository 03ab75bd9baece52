"""Peak memory of MOSS-RLHF weight recovery on a synthetic multi-shard LLaMA-style model.

Builds a random "raw" model (sharded safetensors) and a "diff" in the release's layout (sharded pytorch .bin,
``tuned − raw`` for layer tensors, whole tensors otherwise), then runs ``trl-ppomax moss recover`` in a child process
and reports its peak resident memory (ru_maxrss) next to the model size. Holding raw and tuned models at once would
need at least twice the model size.

    python benchmarks/recovery_memory.py                 # ~0.9 GB float32 model, 4 diff shards
    python benchmarks/recovery_memory.py --layers 2      # quick check
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

import torch
from safetensors.torch import save_file


def llama_tensors(layers: int, hidden: int, intermediate: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator) * 0.02

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[p + f"self_attn.{name}.weight"] = rand(hidden, hidden)
        tensors[p + "mlp.gate_proj.weight"] = rand(intermediate, hidden)
        tensors[p + "mlp.up_proj.weight"] = rand(intermediate, hidden)
        tensors[p + "mlp.down_proj.weight"] = rand(hidden, intermediate)
        tensors[p + "input_layernorm.weight"] = torch.ones(hidden)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    tensors["lm_head.weight"] = rand(vocab, hidden)
    return tensors


def write_sharded(tensors: dict[str, torch.Tensor], folder: Path, shards: int, fmt: str) -> None:
    folder.mkdir(parents=True)
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        group = names[i * per : (i + 1) * per]
        if fmt == "safetensors":
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: tensors[n].contiguous() for n in group}, str(folder / file))
        else:
            file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
            torch.save({n: tensors[n] for n in group}, folder / file)
        weight_map.update(dict.fromkeys(group, file))
    index = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    (folder / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def write_config_and_tokenizer(folder: Path, layers: int, hidden: int, intermediate: int, vocab: int) -> None:
    from transformers import LlamaConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/user_setups.py
    from user_setups import build_llama_style_tokenizer

    LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(folder)
    build_llama_style_tokenizer().save_pretrained(folder)


PROBE = """
import re, threading, time
peaks = {"VmHWM": 0, "RssAnon": 0, "RssFile": 0}
def read():
    status = open("/proc/self/status").read()
    return {k: int(re.search(k + r":\\s+(\\d+)", status)[1]) * 1024 for k in peaks}
def poll():
    while True:
        for k, v in read().items():
            peaks[k] = max(peaks[k], v)
        time.sleep(0.005)
threading.Thread(target=poll, daemon=True).start()
"""


def peak_memory_of(code: str) -> tuple[dict[str, int], float]:
    """Peak memory (bytes) of a fresh Python process running ``code``: VmHWM (all resident pages), and the peaks of
    anonymous memory (RssAnon: what the process allocated) and of file-backed mapped pages (RssFile: memory-mapped
    checkpoint shards, which the kernel can drop under pressure), sampled every 5 ms. Measured inside the child:
    ru_maxrss would be inherited from this (large) parent process."""
    script = f"{PROBE}\n{code}\ntime.sleep(0.02)\nimport json; print('PEAKS', json.dumps(peaks))"
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", script],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "TQDM_DISABLE": "1"},
    ).stdout
    seconds = time.perf_counter() - start
    return json.loads(out.rsplit("PEAKS", 1)[1]), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--max-shard-size", default="200MB")
    parser.add_argument("--output", help="write the results as JSON here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        raw = llama_tensors(args.layers, args.hidden, args.intermediate, args.vocab, seed=0)
        tuned = llama_tensors(args.layers, args.hidden, args.intermediate, args.vocab, seed=1)
        tuned["reward_head.weight"] = torch.randn(1, args.hidden) * 0.02
        model_bytes = sum(t.numel() * t.element_size() for t in tuned.values())
        expected = sum(t.sum().item() for t in tuned.values())
        diff = {n: (t - raw[n]) if "layers" in n else t for n, t in tuned.items()}
        write_sharded(raw, root / "raw", args.shards, "safetensors")
        write_sharded(diff, root / "diff", args.shards, "bin")
        write_config_and_tokenizer(root / "diff", args.layers, args.hidden, args.intermediate, args.vocab)
        del raw, tuned, diff
        largest_diff_shard = max(p.stat().st_size for p in (root / "diff").glob("*.bin"))

        argv = [
            "moss",
            "recover",
            "--raw",
            str(root / "raw"),
            "--diff",
            str(root / "diff"),
            "--output",
            str(root / "out"),
            "--model-type",
            "reward",
            "--expected-sum",
            repr(expected),
            "--max-shard-size",
            args.max_shard_size,
        ]
        baseline, _ = peak_memory_of("import torch, transformers, trl_ppomax.moss.recovery")
        peak, seconds = peak_memory_of(f"from trl_ppomax.cli import main; assert main({argv!r}) == 0")

    gb = 1e9
    result = {
        "model_gb_float32": model_bytes / gb,
        "two_models_gb": 2 * model_bytes / gb,
        "largest_diff_shard_gb": largest_diff_shard / gb,
        "max_output_shard": args.max_shard_size,
        "import_baseline_anon_gb": baseline["RssAnon"] / gb,
        "peak_anon_gb": peak["RssAnon"] / gb,
        "peak_anon_over_baseline_gb": (peak["RssAnon"] - baseline["RssAnon"]) / gb,
        "peak_file_mapped_gb": peak["RssFile"] / gb,
        "peak_vmhwm_gb": peak["VmHWM"] / gb,
        "seconds": seconds,
    }
    for key, value in result.items():
        print(f"{key:>24}: {value:.3f}" if isinstance(value, float) else f"{key:>24}: {value}")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({"command": " ".join(sys.argv), **result}, indent=2))


if __name__ == "__main__":
    main()
