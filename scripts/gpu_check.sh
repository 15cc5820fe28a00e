#!/usr/bin/env bash
# GPU check of grpo-ds in one call (issues 15, 21), in order of value (scripts/gpu_check.py's CHECKS): tests/gpu
# (ZeRO-3 bf16 with fp32 accumulation, optimizer offload on ZeRO-1/2/3, refit gather = export bit for bit,
# mem_get_info metrics, NCCL collectives and the TP lockstep, bf16 vs fp32), a real 3-step loop with ZeRO-3 on one
# GPU, a checkpoint and a resume, the auto config, LoRA on ZeRO-3 (resume, adapter export), the packed-vs-padded
# logprob canary, the bridge's NCCL broadcast, 2 processes with 2 GPUs, the vLLM tests where vllm is installed, and
# with colocated vLLM (issue 52): endpoint answers equal the engine's own tokens, a chat request to local rank 1's
# endpoint (2 GPUs), the reward model's free-memory reading taken after vLLM's reservation.
# One line per check, a JSON verdict. At most 8 minutes (GPU_CHECK_BUDGET_S, default 480).
#
# How to run it on a lent GPU machine (torch, transformers and accelerate installed; no deepspeed, no
# network; the working tree is copied over, 64 MiB at most):
#   1. here, on a machine with network, once:
#        bash scripts/gpu_check.sh --prepare assets/gpu_wheels
#      builds ~13 MB of wheels (deepspeed, pydantic, torchdata, ...; assets/ is git-ignored)
#      and prints the folder's size;
#   2. there, in one call that carries the folder:
#        run(command="bash scripts/gpu_check.sh", carry=["assets/gpu_wheels"], timeout_s=600)
#      it unpacks the wheels into a private folder put first on PYTHONPATH (the image is not modified), builds
#      the toy model, runs scripts/gpu_check.py and ends with "GPU CHECK: PASS (...)" or "GPU CHECK: FAIL (...)"; the
#      "PEAK_MEMORY {...}" line is the peak memory per phase. Logs, metrics and gpu_check.json go to $OUT
#      when set (the folder a `run` call brings back), else results/gpu_check.
# Each check ends PASS, FAIL, WARN or NOT COVERED with why (no CUDA device, one GPU, no vLLM wheel, flash_attn not
# installed); the verdict line names every check not covered. Exit 0: nothing failed; 1: a check failed; 2: nothing
# ran. Without a CUDA device every check is NOT COVERED and the exit is 2, unless --expect-no-cuda (or
# GPU_CHECK_EXPECT_NO_CUDA=1) says a machine without a GPU is expected (then 0).
#
#   bash scripts/gpu_check.sh                  # the check (GPU_WHEELS=DIR: another wheel folder)
#   bash scripts/gpu_check.sh --prepare DIR    # build the wheel folder (pip; network)
#   PYTHON=/path/to/python bash scripts/...    # the interpreter (default: python3 or python, whichever has torch)
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then  # the first interpreter that has torch
  for candidate in python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import torch' >/dev/null 2>&1; then
      PY="$candidate"
      break
    fi
  done
  PY="${PY:-python3}"
fi

# Pure-Python wheels the GPU image lacks (versions: those installed where --prepare runs). The image (torch 2.11,
# transformers 5.17, accelerate 1.15, peft; the device tool's KINDS.md lists it) has deepspeed's other needs
# (py-cpuinfo, einops, msgpack, ninja, psutil, nvidia-ml-py) and pytest with its plugins: carrying our own pytest
# would shadow the one those plugins were installed for. typing-extensions comes along for pydantic (backward
# compatible). pydantic-core is compiled: its CPython 3.10-3.14 manylinux x86_64 wheels go in (2 MB each).
PURE="deepspeed hjson torchdata pydantic annotated-types typing-inspection typing-extensions"
PY310_ONLY=""
MAX_MIB=64

prepare() {
  local dir="$1"
  mkdir -p "$dir" || return 1
  rm -f "$dir"/*.whl
  local pins
  pins="$("$PY" - $PURE <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
NOT_HERE = {}
out = []
for name in sys.argv[1:]:
    try:
        out.append(f"{name}=={version(name)}")
    except PackageNotFoundError:
        out.append(f"{name}=={NOT_HERE[name]}")
print(" ".join(out))
EOF
)" || { echo "error: $PY cannot read package versions" >&2; return 1; }
  local core
  core="$("$PY" -c 'from importlib.metadata import version; print(version("pydantic-core"))')" || {
    echo "error: pydantic-core is not installed for $PY: install requirements.txt first" >&2; return 1; }
  echo "wheels for: $pins pydantic-core==$core"
  local pure_pins="" p
  for p in $pins; do
    case "$p" in deepspeed*) ;; *) pure_pins="$pure_pins $p" ;; esac
  done
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$dir" $pure_pins || return 1
  if [ -n "$PY310_ONLY" ]; then
    # shellcheck disable=SC2086
    "$PY" -m pip download -q --no-deps --only-binary=:all: --implementation py --abi none --platform any \
      --python-version 3.10 -d "$dir" $PY310_ONLY || return 1
  fi
  for p in $pins; do
    case "$p" in
      deepspeed*) "$PY" -m pip wheel -q --no-deps -w "$dir" "$p" || return 1 ;;  # an sdist: a pure wheel
    esac
  done
  local v
  for v in 3.10 3.11 3.12 3.13 3.14; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 --implementation cp \
      --python-version "$v" -d "$dir" "pydantic-core==$core" || return 1
  done
  local bad
  bad="$(cd "$dir" && ls *.whl | grep -v -e '-none-any\.whl$' -e '^pydantic_core-')"
  if [ -n "$bad" ]; then
    echo "error: compiled wheels in $dir: $bad" >&2
    return 1
  fi
  local kib
  kib="$(du -sk "$dir" | cut -f1)"
  echo "wheel folder $dir: $(ls "$dir"/*.whl | wc -l) wheels, $((kib / 1024)).$(( (kib % 1024) * 10 / 1024 )) MiB"
  if [ "$kib" -ge $((MAX_MIB * 1024)) ]; then
    echo "error: $dir is over $MAX_MIB MiB: the device takes at most $MAX_MIB MiB with the working tree" >&2
    return 1
  fi
}

EXPECT_NO_CUDA=""
if [ "${1:-}" = "--expect-no-cuda" ] || [ "${GPU_CHECK_EXPECT_NO_CUDA:-}" = "1" ]; then
  EXPECT_NO_CUDA=1
  [ "${1:-}" = "--expect-no-cuda" ] && shift
fi
if [ "${1:-}" = "--prepare" ]; then
  [ -n "${2:-}" ] || { echo "usage: $0 --prepare DIR" >&2; exit 2; }
  prepare "$2"
  exit $?
fi
[ $# -eq 0 ] || { echo "usage: $0 [--expect-no-cuda] [--prepare DIR]" >&2; exit 2; }

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    echo "FAIL nvidia-smi lists GPUs but torch in $PY sees no CUDA device: set PYTHON=<the interpreter with CUDA torch>"
    echo "GPU CHECK: FAIL"
    exit 1
  fi
  echo "no CUDA device: no GPU check ran"
  # every check, listed as NOT COVERED (the listing needs no package: any python3 will do); exit 2, or 0 when
  # that is expected (--expect-no-cuda or GPU_CHECK_EXPECT_NO_CUDA=1: a machine without a GPU on purpose)
  for lister in "$PY" python3 python; do
    if command -v "$lister" >/dev/null 2>&1 && "$lister" -c 'import sys' >/dev/null 2>&1; then
      "$lister" scripts/gpu_check.py --skip-all "no CUDA device" ${EXPECT_NO_CUDA:+--expect-no-cuda}
      exit $?
    fi
  done
  echo "GPU CHECK: NOT COVERED: no CUDA device and no python to list the checks"
  [ -n "$EXPECT_NO_CUDA" ] && exit 0
  exit 2
fi

START=$SECONDS
BUDGET="${GPU_CHECK_BUDGET_S:-480}"
WHEELS="${GPU_WHEELS:-$REPO/assets/gpu_wheels}"
OUT_DIR="${OUT:-$REPO/results/gpu_check}"
SITE="${TMPDIR:-/tmp}/grpo_gpu_site"
mkdir -p "$OUT_DIR"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/INFO nvidia-smi: /'

# ---- what the image lacks, from the wheel folder: unpacked into $SITE, first on PYTHONPATH
if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  echo "FAIL no wheels in $WHEELS: run 'bash scripts/gpu_check.sh --prepare assets/gpu_wheels' on a machine with"
  echo "     network and carry that folder (run(..., carry=[\"assets/gpu_wheels\"]))"
  echo "GPU CHECK: FAIL"
  exit 1
fi
rm -rf "$SITE" && mkdir -p "$SITE"
"$PY" - "$SITE" "$WHEELS"/*.whl <<'EOF' || { echo "GPU CHECK: FAIL (could not unpack the wheels)"; exit 1; }
import sys, zipfile
site, wheels = sys.argv[1], sys.argv[2:]
for w in wheels:  # pure wheels unpack to importable folders; pydantic-core's .so files differ per Python
    zipfile.ZipFile(w).extractall(site)
print(f"INFO unpacked {len(wheels)} wheels into {site}")
EOF
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline
if ! "$PY" -c 'import deepspeed, pydantic, torchdata, msgpack, pytest' 2>"$OUT_DIR/import_error.log"; then
  echo "FAIL imports from $SITE:"; tail -5 "$OUT_DIR/import_error.log"
  echo "GPU CHECK: FAIL"
  exit 1
fi

"$PY" scripts/gpu_check.py --out "$OUT_DIR" --budget-s "$((BUDGET - (SECONDS - START)))"
