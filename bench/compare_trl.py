#!/usr/bin/env python
"""grpo-ds against TRL's GRPOTrainer on the benchmark workload, side by side: the two alternate run by run.

    python -m venv .venv-trl && .venv-trl/bin/pip install -r bench/requirements-trl.txt
    python bench/compare_trl.py --trl-python .venv-trl/bin/python --model bench --pairs 3
    python bench/compare_trl.py --trl-python .venv-trl/bin/python --model tiny --pairs 3
    python bench/compare_trl.py --trl-python .venv-trl/bin/python --model bench --pairs 3 --lora
    python bench/compare_trl.py --trl-python .venv-trl/bin/python --model bench --pairs 3 --long-tail

Each run is a fresh process: grpo-ds (bench/bench_step.py, this interpreter), then TRL (bench/trl_step.py,
--trl-python), then grpo-ds again, and so on. Every step after each run's first is pooled; the ratios are
grpo-ds / TRL of the pooled medians and mins. A figure from another day is no comparison on a shared
machine (they drift by 1.5x); a ratio measured like this is. Prints each run's own JSON line as it ends, a line per
pair with the load average, then one JSON line.
--lora: both train the same LoRA adapters (bench_step.py's LORA: r 8, alpha 32, all-linear, dropout 0), each with
the base model, adapters off, as the reference.
--long-tail: the long-tail workload (WORKLOAD.md): completions up to 256 tokens instead of 32 on both sides
(4 steps per run by default on bench: one of TRL's steps there takes about a minute on 2 cores).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def run(cmd: list[str]) -> dict:
    proc = subprocess.run(cmd, cwd=BENCH.parent, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    line = proc.stdout.strip().splitlines()[-1]
    print(f"run: {line}", flush=True)   # every run's own line, as it ends (kept if the comparison is stopped)
    r = json.loads(line)
    return {"steps": r["step_s"][1:], "rss_mb": r["peak_rss_mb"], "tok_s": r["completion_tokens_per_s"],
            "first_s": r["time_to_first_step_s"], "phases": r.get("phase_s_median"),
            "tokens": r.get("completion_tokens_per_step")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trl-python", required=True, help="an interpreter with bench/requirements-trl.txt")
    ap.add_argument("--workload", default=str(BENCH.parent / "bench_workload"))
    ap.add_argument("--model", default="bench", choices=["bench", "tiny"])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None, help="default: 6 for bench, 8 for tiny")
    ap.add_argument("--async", dest="async_", action="store_true", help="time train_async_grpo.py")
    ap.add_argument("--lora", action="store_true", help="both sides train the same LoRA adapters")
    ap.add_argument("--long-tail", action="store_true", help="the long-tail workload: 256 new tokens at most")
    ap.add_argument("--ours-extra", nargs="*", default=[], help="more dotted overrides for grpo-ds (bench_step.py)")
    a = ap.parse_args()
    max_new = "256" if a.long_tail else "32"
    steps = str(a.steps or ((4 if a.long_tail else 6) if a.model == "bench" else 8))
    ours_cmd = [sys.executable, "bench/bench_step.py", "--workload", a.workload, "--model", a.model,
                "--steps", steps, "--max-new-tokens", max_new] + (["--async"] if a.async_ else []) + (
        ["--lora"] if a.lora else []) + a.ours_extra
    trl_cmd = [a.trl_python, "bench/trl_step.py", "--workload", a.workload, "--model", a.model, "--steps", steps,
               "--max-completion-length", max_new] + (["--lora"] if a.lora else [])
    ours, trl = [], []
    print(f"load before the pairs: {os.getloadavg()}", flush=True)
    for i in range(a.pairs):
        ours.append(run(ours_cmd))
        trl.append(run(trl_cmd))
        print(f"pair {i + 1}: grpo-ds median {statistics.median(ours[-1]['steps']):.3f} s, "
              f"TRL median {statistics.median(trl[-1]['steps']):.3f} s (load {os.getloadavg()[0]:.2f})", flush=True)
    o = [s for r in ours for s in r["steps"]]
    t = [s for r in trl for s in r["steps"]]
    print(json.dumps({
        "model": a.model, "lora": a.lora, "max_new_tokens": int(max_new), "pairs": a.pairs, "steps_per_run": int(steps),
        "ours_median_s": round(statistics.median(o), 4), "trl_median_s": round(statistics.median(t), 4),
        "ours_min_s": round(min(o), 4), "trl_min_s": round(min(t), 4),
        "ratio_median": round(statistics.median(o) / statistics.median(t), 3),
        "ratio_min": round(min(o) / min(t), 3),
        "ours_tok_s": [round(r["tok_s"], 1) for r in ours], "trl_tok_s": [round(r["tok_s"] or 0, 1) for r in trl],
        "ours_peak_rss_mb": max(r["rss_mb"] for r in ours), "trl_peak_rss_mb": max(r["rss_mb"] for r in trl),
        "ours_first_step_s": [r["first_s"] for r in ours], "trl_first_step_s": [round(r["first_s"], 2) for r in trl],
        "ours_tokens_per_step": [r["tokens"] for r in ours], "trl_tokens_per_step": [r["tokens"] for r in trl],
        "ours_run_medians": [round(statistics.median(r["steps"]), 3) for r in ours],
        "trl_run_medians": [round(statistics.median(r["steps"]), 3) for r in trl],
        "ours_phases_last_run": ours[-1]["phases"],
    }))


if __name__ == "__main__":
    main()
