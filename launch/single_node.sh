#!/usr/bin/env bash
# One node, N processes (GPUs, or CPU ranks): torchrun sets RANK/LOCAL_RANK/WORLD_SIZE for every rank.
#   NPROC=8 bash launch/single_node.sh --config configs/grpo_math_qwen2.5_1.5b.yaml [dotted.overrides=...]
#   SCRIPT=train_async_grpo.py NPROC=8 bash launch/single_node.sh --config configs/async_grpo_qwen2.5_1.5b.yaml
set -euo pipefail
cd "$(dirname "$0")/.."
exec torchrun --standalone --nproc_per_node "${NPROC:-8}" "${SCRIPT:-train_grpo.py}" "$@"
