#!/usr/bin/env python
"""The runs and checks of the GPU check (issue 15); scripts/gpu_check.sh installs what the device lacks
and calls this. Everything runs on tests/configs/tiny.yaml (toy:demo policy built locally, arithmetic
env, hf generation backend, ZeRO-3, reference on), NCCL, 3 steps:

  bf16      1 process, checkpoint at step 2, logger.monitor_gpus=true, advantages on the GPU, phase
            peaks (train_grpo.py's memory/<phase>_* on CUDA): gpu/* and memory/* present and plausible
  resume    1 process, bf16: 2 steps, then the same command to 3 resumes from step 2
  fp32      1 process: losses compared with bf16
  bf16_2gpu 2 processes when the device has 2 GPUs: losses compared with 1 process
  pytest    tests/gpu (offload, fp32 gradient accumulation, bf16 vs fp32 on a fixed batch, memory metrics),
            and the vLLM tests on CUDA where vllm is installed

Tolerances. Step 1 of every run generates from the same checkpoint with the same seeds, so its samples
are the same unless bf16 rounding (or another GPU count) flips a sampled token: step-1 losses must agree
within LOSS_TOL (measured on the CPU: bf16 vs fp32 within 1e-5 at all 3 steps). Later steps and the
resumed step only warn beyond LATER_TOL / RESUME_TOL (their samples may differ by one flipped token).
token_mult_prob_error (generation vs training logprobs of the same weights) must stay under
MULT_PROB_MAX[precision]. Prints one line per check, ``PEAK_MEMORY {json}`` (GiB per phase, the most
over steps), writes <out>/gpu_check.json, ends with "GPU CHECK: PASS" (exit 0) or "GPU CHECK: FAIL" (exit 1).

    python scripts/gpu_check.py --out DIR [--budget-s 480] [--cpu]   # --cpu: the same runs on the CPU (gloo)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TINY = str(REPO / "tests" / "configs" / "tiny.yaml")
LOSS_TOL = 0.01
LATER_TOL = 0.05
RESUME_TOL = 1e-3
MULT_PROB_MAX = {"bfloat16": 1.05, "float32": 1.01}
PHASES = ("rollout", "logprobs", "train")
GPU_KEYS = ("gpu/memory_allocated_gib", "gpu/memory_reserved_gib", "gpu/peak_memory_allocated_gib",
            "gpu/device_used_gib", "gpu/device_free_gib")


# --------------------------------------------------------------------------------------------------
# Checks on metrics rows: pure functions (tests/test_gpu_check.py)
# --------------------------------------------------------------------------------------------------
def train_rows(rows: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in rows if "train/loss" in r}


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def compare_losses(a: dict[int, dict], b: dict[int, dict], label: str) -> list[tuple[str, str]]:
    """(level, message) pairs: FAIL when step 1 differs by more than LOSS_TOL or a loss is missing or not
    finite; WARN when a later step differs by more than LATER_TOL."""
    out = []
    for step in sorted(a):
        la, lb = a[step].get("train/loss"), (b.get(step) or {}).get("train/loss")
        if not (finite(la) and finite(lb)):
            out.append(("FAIL", f"{label}: step {step} loss {la} vs {lb}"))
            continue
        tol, level = (LOSS_TOL, "FAIL") if step == 1 else (LATER_TOL, "WARN")
        ok = abs(la - lb) <= tol
        out.append(("OK" if ok else level, f"{label}: step {step} loss {la:.6f} vs {lb:.6f} "
                                           f"(|diff| {abs(la - lb):.2e}, tolerance {tol})"))
    return out


def check_gpu_metrics(rows: list[dict], total_gib: float, phases: tuple = PHASES) -> list[str]:
    """What is missing or implausible in the gpu/* and memory/* columns (empty: all good): every row has
    GPU_KEYS with 0 < allocated <= reserved <= device used, device used + free = total (1%), peak >=
    allocated, utilisation in [0, 100] if present; every step row has memory/<phase>_peak_gb and
    _used_gb with 0 < value <= total."""
    problems = []
    for r in rows:
        where = f"step {r.get('step')}"
        missing = [k for k in GPU_KEYS if not finite(r.get(k))]
        if missing:
            problems.append(f"{where}: missing {missing}")
            continue
        alloc, res = r["gpu/memory_allocated_gib"], r["gpu/memory_reserved_gib"]
        used, free = r["gpu/device_used_gib"], r["gpu/device_free_gib"]
        if not 0 < alloc <= res <= used * 1.01:
            problems.append(f"{where}: expected 0 < allocated {alloc:.3f} <= reserved {res:.3f} <= used {used:.3f}")
        if abs(used + free - total_gib) > 0.01 * total_gib:
            problems.append(f"{where}: used {used:.2f} + free {free:.2f} != total {total_gib:.2f} GiB")
        if r["gpu/peak_memory_allocated_gib"] < alloc:
            problems.append(f"{where}: peak {r['gpu/peak_memory_allocated_gib']:.3f} < allocated {alloc:.3f}")
        util = r.get("gpu/utilization_pct")
        if util is not None and not 0 <= util <= 100:
            problems.append(f"{where}: utilization {util}")
        if "train/loss" in r:
            for phase in phases:
                for key in (f"memory/{phase}_peak_gb", f"memory/{phase}_used_gb"):
                    v = r.get(key)
                    if not (finite(v) and 0 < v <= total_gib):
                        problems.append(f"{where}: {key} = {v}")
    return problems


def peak_memory_report(rows: list[dict], phases: tuple = PHASES) -> dict:
    """GiB per phase, the most over the step rows: {"rollout": {"peak_allocated": .., "used_at_end": ..}, ...}."""
    steps = list(train_rows(rows).values())
    report = {}
    for phase in phases:
        peaks = [r[f"memory/{phase}_peak_gb"] for r in steps if finite(r.get(f"memory/{phase}_peak_gb"))]
        used = [r[f"memory/{phase}_used_gb"] for r in steps if finite(r.get(f"memory/{phase}_used_gb"))]
        report[phase] = {"peak_allocated": round(max(peaks), 4) if peaks else None,
                         "used_at_end": round(max(used), 4) if used else None}
    return report


# --------------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------------
def read_rows(log_dir: Path) -> list[dict]:
    path = log_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def child_env(cpu: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline", PYTHONFAULTHANDLER="1",
               OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "4"))
    env["PYTHONPATH"] = os.pathsep.join([p for p in (env.get("PYTHONPATH"), str(REPO)) if p])
    if cpu:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def train(out: Path, name: str, overrides: list[str], *, nproc: int, cpu: bool, timeout: float,
          log_name: str | None = None) -> dict:
    """One train_grpo.py run (which records memory/<phase>_* on CUDA) into out/name;
    its output goes to out/<log_name or name>.log."""
    script = "train_grpo.py"
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc_per_node", str(nproc)]
    run_dir = out / name
    cmd = [*launcher, script, "--config", TINY, f"logger.log_dir={run_dir}/logs",
           f"checkpointing.checkpoint_dir={run_dir}/ckpt", *overrides]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=REPO, env=child_env(cpu), capture_output=True, text=True, timeout=max(timeout, 1))
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = "timeout", f"{e.stdout or ''}{e.stderr or ''}"
        text = text.decode(errors="replace") if isinstance(text, bytes) else text
    (out / f"{log_name or name}.log").write_text(" ".join(cmd) + "\n" + text)
    return {"rc": rc, "seconds": time.monotonic() - t0, "rows": read_rows(run_dir / "logs"), "text": text}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for logs, metrics and gpu_check.json")
    ap.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget of all runs (default 8 min)")
    ap.add_argument("--cpu", action="store_true", help="run the same sequence on the CPU (checks the script itself)")
    args = ap.parse_args(argv)
    import torch

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    results: list[tuple[str, str]] = []

    def say(level: str, msg: str) -> None:
        results.append((level, msg))
        print(f"{level:4} {msg}", flush=True)

    def left() -> float:
        return deadline - time.monotonic()

    n_gpus = 0 if args.cpu else torch.cuda.device_count()
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if n_gpus else 0.0
    device = "cpu" if args.cpu else torch.cuda.get_device_name(0)
    import deepspeed
    import transformers

    say("INFO", f"{device} x{max(n_gpus, 1)}, torch {torch.__version__} (CUDA {torch.version.cuda}), transformers "
                f"{transformers.__version__}, deepspeed {deepspeed.__version__}, python {sys.version.split()[0]}")

    from grpo.toy import resolve_model_name

    resolve_model_name("toy:demo")  # built locally once, before the timed runs share it
    common = ["grpo.max_num_steps=3", "logger.monitor_gpus=true", "checkpointing.save_period=2"]
    runs: dict[str, dict] = {}

    def start(name: str, overrides: list[str], nproc: int = 1, steps: int = 3,
              log_name: str | None = None) -> dict | None:
        label = log_name or name
        if left() < 30:
            say("FAIL", f"{label}: not run, the {args.budget_s:.0f} s budget is spent")
            return None
        r = train(out, name, overrides, nproc=nproc, cpu=args.cpu, timeout=min(left(), 240),
                  log_name=label)
        got = sorted(train_rows(r["rows"]))
        r["ok"] = r["rc"] == 0 and got == list(range(1, steps + 1))
        say("OK" if r["ok"] else "FAIL", f"{label}: exit {r['rc']} in {r['seconds']:.0f} s, steps {got} "
                                         f"(log: {out / label}.log)")
        if r["rc"] != 0:
            print("\n".join("     | " + line for line in r["text"].splitlines()[-25:]), flush=True)
        runs[label] = r
        return r if r["ok"] else None

    def mult_prob(name: str, precision: str) -> None:
        rows = train_rows(runs[name]["rows"])
        worst = max((r.get("train/token_mult_prob_error") or float("inf") for r in rows.values()), default=float("inf"))
        say("OK" if worst <= MULT_PROB_MAX[precision] else "FAIL",
            f"{name}: token_mult_prob_error max {worst:.5f} (<= {MULT_PROB_MAX[precision]})")

    # ---- bf16, 1 process: the reference of the other runs; metrics; phase peaks
    bf16 = start("bf16", [*common, "policy.precision=bfloat16", "grpo.calculate_advantages_on_gpu=true"])
    if bf16:
        say("OK" if "reference on" in bf16["text"] else "FAIL", "bf16: the reference policy is on (KL penalty 0.01)")
        mult_prob("bf16", "bfloat16")
        if not args.cpu:
            problems = check_gpu_metrics(bf16["rows"], total_gib)
            say("FAIL" if problems else "OK", "bf16: gpu/* and memory/* metrics " +
                ("; ".join(problems[:6]) if problems else f"present and plausible ({total_gib:.1f} GiB device)"))
        peaks = peak_memory_report(bf16["rows"])
        print("PEAK_MEMORY " + json.dumps({"run": "bf16, 1 process", "device": device, "gib": peaks}), flush=True)

    # ---- checkpoint and resume
    part = start("resume", [*common, "policy.precision=bfloat16", "grpo.max_num_steps=2"], steps=2,
                 log_name="resume_first_2_steps")
    if part:
        resumed = start("resume", [*common, "policy.precision=bfloat16"], log_name="resume_to_step_3")
        if resumed:
            ok = "resumed from" in resumed["text"] and "(step 2," in resumed["text"]
            say("OK" if ok else "FAIL", "resume: the second run resumed from the step-2 checkpoint and ran step 3"
                if ok else "resume: the second run did not say 'resumed from ... (step 2, ...'")
            if bf16:
                whole = train_rows(bf16["rows"]).get(3, {}).get("train/loss")
                again = train_rows(resumed["rows"]).get(3, {}).get("train/loss")
                same = finite(whole) and finite(again) and abs(whole - again) <= RESUME_TOL
                say("OK" if same else "WARN", f"resume: step 3 loss {again} resumed vs {whole} uninterrupted "
                                              f"(tolerance {RESUME_TOL}; GPU kernels need not be deterministic)")

    # ---- fp32 vs bf16
    fp32 = start("fp32", [*common, "policy.precision=float32", "checkpointing.enabled=false"])
    if fp32:
        mult_prob("fp32", "float32")
        if bf16:
            for level, msg in compare_losses(train_rows(fp32["rows"]), train_rows(bf16["rows"]), "fp32 vs bf16"):
                say(level, msg)

    # ---- 2 processes
    if n_gpus >= 2 or args.cpu:
        two = start("bf16_2gpu", [*common, "policy.precision=bfloat16"], nproc=2)
        if two and bf16:
            for level, msg in compare_losses(train_rows(two["rows"]), train_rows(bf16["rows"]), "2 vs 1 process"):
                say(level, msg)
    else:
        say("INFO", f"bf16_2gpu: skipped, {n_gpus} GPU")

    # ---- GPU unit tests
    if left() > 30 and not args.cpu:
        t0 = time.monotonic()
        try:
            # the vLLM files skip themselves where vllm is not installed (the lent image has none)
            p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/gpu",
                                "tests/test_generation_vllm.py", "tests/test_generation_vllm_qwen2.py"], cwd=REPO,
                               env=child_env(False), capture_output=True, text=True, timeout=left())
            rc, text = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired:
            rc, text = "timeout", ""
        (out / "pytest_gpu.log").write_text(text)
        tail = [line for line in text.splitlines() if line.strip()][-1:] or ["no output"]
        say("OK" if rc == 0 else "FAIL", f"pytest tests/gpu + vLLM tests: {tail[0]} in {time.monotonic() - t0:.0f} s")
        if rc != 0:
            print("\n".join("     | " + line for line in text.splitlines()[-40:]), flush=True)

    failed = [m for level, m in results if level == "FAIL"]
    summary = {"pass": not failed, "device": device, "gpus": n_gpus, "results": results,
               "losses": {name: {s: r.get("train/loss") for s, r in train_rows(run["rows"]).items()}
                          for name, run in runs.items()}}
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    print(f"GPU CHECK: {'PASS' if not failed else 'FAIL'} ({len(failed)} failed, "
          f"{sum(level == 'WARN' for level, _ in results)} warnings; {out / 'gpu_check.json'})", flush=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
