#!/usr/bin/env bash
# GPU check for trl-ppomax: runs the tiny PPO-max recipe in bf16 on one GPU, then with DeepSpeed ZeRO-2, and prints
# throughput (episodes per second) and peak GPU memory for each. Takes a few minutes on any CUDA GPU.
#
#   bash scripts/gpu_check.sh            # from the repository root, with trl-ppomax installed (pip install -e ".[deepspeed]")
#
# Results go to gpu_check/ (logs and one JSON line per run in gpu_check/results.jsonl).
set -euo pipefail
cd "$(dirname "$0")/.."
out=gpu_check
mkdir -p "$out"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this check needs a GPU')"
common=(--config recipes/configs/tiny_cpu.yaml --use_cpu False --bf16 True --disable_tqdm True
        --total_episodes 512 --per_device_train_batch_size 16 --local_rollout_forward_batch_size 64
        --response_length 48 --eval_strategy no --save_strategy no --num_sample_generations 0)

run() {  # name, accelerate config, extra launcher args
  local name=$1 config=$2; shift 2
  echo "== $name"
  ( cd "$out" && python -m accelerate.commands.launch --config_file "../recipes/accelerate/$config" "$@" \
      ../recipes/ppo_max.py "${common[@]}" --output_dir "run-$name" ) > "$out/$name.log" 2>&1 \
    || { echo "   failed, see $out/$name.log"; tail -20 "$out/$name.log"; return 1; }
  python - "$out/$name.log" "$name" <<'PY' | tee -a "$out/results.jsonl"
import ast, json, sys
logs = [ast.literal_eval(l[l.index("{"):]) for l in open(sys.argv[1]) if l.lstrip().startswith("{'objective/kl'")]
last = logs[-1]
print(json.dumps({"run": sys.argv[2], "episodes": float(last["episode"]), "episodes_per_s": float(last["eps"]),
                  "peak_gpu_memory_gb": float(last.get("memory/peak_gpu_gb", "nan"))}))
PY
}
run bf16_single_gpu single_gpu.yaml --num_processes 1
if python -c "import deepspeed" 2>/dev/null; then
  run zero2 deepspeed_zero2.yaml --num_processes 1
else
  echo "== zero2 skipped: pip install trl-ppomax[deepspeed]"
fi
