#!/usr/bin/env bash
# Several nodes through DeepSpeed's own launcher (pdsh/ssh to each host in the hostfile).
# hostfile lines: "<hostname> slots=<gpus>" (see launch/hostfile.example). Run on the first host:
#   HOSTFILE=launch/hostfile NUM_NODES=2 GPUS=8 bash launch/multi_node.sh --config configs/X.yaml
set -euo pipefail
cd "$(dirname "$0")/.."
exec deepspeed --hostfile "${HOSTFILE:-launch/hostfile}" --num_nodes "${NUM_NODES:-2}" \
    --num_gpus "${GPUS:-8}" --master_port "${MASTER_PORT:-29500}" "${SCRIPT:-train_grpo.py}" "$@"
