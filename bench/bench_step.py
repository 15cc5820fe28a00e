#!/usr/bin/env python
"""Time GRPO steps on the benchmark workload (bench/WORKLOAD.md) and print one JSON line.

    python bench/bench_step.py                      # bench model (25.2M), 6 steps
    python bench/bench_step.py --model tiny --steps 4
    python bench/bench_step.py --async              # train_async_grpo.py on the same workload
    python bench/bench_step.py --lora               # LoRA adapters instead of full fine-tuning (LORA below)
    python bench/bench_step.py --long-tail          # the long-tail workload: up to 256 new tokens (WORKLOAD.md)

Builds the workload with bench/make_workload.py (tokenizer, models, data; no download) into
--workload (default ./bench_workload), then runs the trainer as a subprocess with the workload's
settings: 8 prompts x 8 generations, 32 new tokens (--long-tail: 256), temperature 1, a reference model with beta 0.04,
per-sequence loss, AdamW lr 1e-6 linear decay, grad clip 1.0, fp32, 2 threads, no checkpoints, no
validation. Reports median / min step time over steps 2..N, completion tokens/s (generated tokens up to
and including EOS / step time), peak RSS of the trainer, and time to the first step (process start to the
end of optimizer step 1).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LONG_TAIL_MAX_NEW_TOKENS = 256  # the long-tail workload (WORKLOAD.md): the same models and prompts, 256 new tokens


def build_workload(workload: Path) -> None:
    """Build the workload once (deterministic: the same bytes on every machine)."""
    if not (workload / "manifest.json").exists():
        subprocess.run([sys.executable, str(REPO / "bench" / "make_workload.py"), "--dir", str(workload)],
                       check=True)


def trainer_overrides(workload: Path, model: str, steps: int, log_dir: str, max_new_tokens: int = 32) -> list[str]:
    """The workload's settings as dotted overrides; room for the longest prompt (25 tokens) + ``max_new_tokens``."""
    return [
        f"policy.model_name={workload}/models/{model}",
        f"policy.tokenizer.name={workload}/tokenizer",
        "policy.tokenizer.chat_template=null",
        "policy.precision=float32",
        f"policy.max_total_sequence_length={32 + max_new_tokens}",
        "policy.train_global_batch_size=64",
        "policy.train_micro_batch_size=64",
        "policy.logprob_batch_size=64",
        "policy.generation_batch_size=64",
        "policy.max_grad_norm=1.0",
        "policy.optimizer.lr=1.0e-6",
        "policy.optimizer.weight_decay=0.0",
        "policy.optimizer.eps=1.0e-8",
        "policy.scheduler.name=linear",
        "policy.scheduler.warmup_steps=0",
        "policy.generation.backend=hf",
        f"policy.generation.max_new_tokens={max_new_tokens}",
        "policy.generation.temperature=1.0",
        "policy.generation.top_p=1.0",
        "policy.generation.top_k=null",
        f"data.train_data_path={workload}/data/train.jsonl",
        f"data.val_data_path={workload}/data/eval.jsonl",
        "data.input_key=prompt",
        "data.output_key=answer",
        "data.shuffle=true",
        "env.name=arithmetic",
        "grpo.num_prompts_per_step=8",
        "grpo.num_generations_per_prompt=8",
        f"grpo.max_num_steps={steps}",
        "grpo.max_num_epochs=1",
        "grpo.val_period=0",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "grpo.seed=42",
        "loss_fn.reference_policy_kl_penalty=0.04",
        "loss_fn.ratio_clip_min=0.2",
        "loss_fn.ratio_clip_max=0.2",
        "loss_fn.token_level_loss=false",
        "checkpointing.enabled=false",
        f"logger.log_dir={log_dir}",
        "logger.progress_bar=false",
    ]


# --lora: the adapters bench/trl_step.py --lora gives TRL (the same peft LoraConfig): rank 8, alpha 32, every linear
# layer but the output head (peft's "all-linear"), no dropout, A with peft's default init (kaiming uniform). With
# LoRA the reference is the base model with the adapters off, on both sides (no second copy).
LORA = {"r": 8, "alpha": 32, "dropout": 0.0}
LORA_OVERRIDES = ["policy.lora.enabled=true", "policy.lora.match_all_linear=true", f"policy.lora.dim={LORA['r']}",
                  f"policy.lora.alpha={LORA['alpha']}", f"policy.lora.dropout={LORA['dropout']}",
                  "policy.lora.lora_A_init=uniform"]


def trainer_env(threads: int) -> dict:
    """The trainer's environment: ``threads`` OpenMP / MKL threads, DeepSpeed on the CPU, nothing from a hub."""
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), DS_ACCELERATOR="cpu",
                HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default=str(REPO / "bench_workload"))
    ap.add_argument("--model", default="bench", choices=["bench", "tiny"])
    ap.add_argument("--steps", type=int, default=None, help="default: 6 for bench, 4 for tiny")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="completion cap (the bench workload's: 32)")
    ap.add_argument("--long-tail", action="store_true", help="the long-tail workload: --max-new-tokens 256")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--async", dest="async_", action="store_true", help="run train_async_grpo.py")
    ap.add_argument("--lora", action="store_true", help="train LoRA adapters (LORA_OVERRIDES) instead of the model")
    ap.add_argument("overrides", nargs="*", help="more dotted overrides, e.g. policy.shared_prompt_forward=false")
    args = ap.parse_args()

    if args.long_tail:
        args.max_new_tokens = LONG_TAIL_MAX_NEW_TOKENS
    workload = Path(args.workload).resolve()
    build_workload(workload)
    steps = args.steps or (6 if args.model == "bench" else 4)
    log_dir = tempfile.mkdtemp(prefix="grpo_bench_")
    script = "train_async_grpo.py" if args.async_ else "train_grpo.py"
    cmd = [sys.executable, script, "--config", "configs/cpu_demo.yaml",
           *trainer_overrides(workload, args.model, steps, log_dir, args.max_new_tokens),
           *(LORA_OVERRIDES if args.lora else []), *args.overrides]
    if args.async_:
        cmd += ["grpo.async_grpo.enabled=true", "grpo.async_grpo.max_trajectory_age_steps=1",
                "loss_fn.use_importance_sampling_correction=true"]
    env = trainer_env(args.threads)
    t_start = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-5000:])
        raise SystemExit(f"trainer exited {proc.returncode}")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak_rss_mb = usage.ru_maxrss / 1024.0

    with open(Path(log_dir) / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    train = sorted((r for r in rows if "timing/train/total_step_time" in r), key=lambda r: r["step"])
    step_s = [r["timing/train/total_step_time"] for r in train]
    tokens = [r["train/num_completion_tokens"] for r in train]
    timed = list(range(1, len(train))) or [0]
    out = {
        "trainer": script,
        "model": args.model,
        "lora": args.lora,
        "max_new_tokens": args.max_new_tokens,
        "steps": len(train),
        "median_step_s": statistics.median(step_s[i] for i in timed),
        "min_step_s": min(step_s[i] for i in timed),
        "completion_tokens_per_s": sum(tokens[i] for i in timed) / sum(step_s[i] for i in timed),
        "completion_tokens_per_step": tokens,
        "step_s": [round(s, 3) for s in step_s],
        "peak_rss_mb": round(peak_rss_mb, 1),
        "cpu_s": {"user": round(usage.ru_utime, 1), "sys": round(usage.ru_stime, 1)},  # the whole trainer process
        "minor_page_faults": usage.ru_minflt,
        "time_to_first_step_s": round(train[0]["time"] - t_start, 2),
        "phase_s_median": {k: statistics.median(r[k] for r in train[1:] or train)
                           for k in ("timing/train/generate_s", "timing/train/policy_and_reference_logprobs",
                                     "timing/train/policy_training", "timing/train/prepare_for_generation/total")
                           if k in train[0]},
        "threads": args.threads,
        "command": " ".join(cmd[1:]),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
