"""Rerun the CPU demos and print the lines README and docs/measurements.md quote: each demo at each seed, its
validation reward at the start and at the end of the run, and the wall time.

    python scripts/measure_demos.py                       # the default demo (configs/cpu_demo.yaml), seeds 0 1 2
    python scripts/measure_demos.py --demo multiturn --seeds 0 1 2
    python scripts/measure_demos.py --demo agent --seeds 0   # the agent demo (the endpoint and an openai agent)
    python scripts/measure_demos.py --demo reward_model  # validation reward = the reward model's score

Each run is `python train_grpo.py --config <demo> grpo.seed=<N>` as README's first command runs it, in fresh
log and checkpoint directories; one at a time (on a shared machine prefix `nice`: times grow, rewards do not).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMOS = {"default": "configs/cpu_demo.yaml", "multiturn": "configs/cpu_demo_multiturn.yaml",
         "tools": "configs/cpu_demo_tools.yaml", "agent": "configs/cpu_demo_agent.yaml",
         "reward_model": "configs/cpu_demo_reward_model.yaml", "vlm": "configs/cpu_demo_vlm.yaml"}


def validation_curve(metrics_path: str, key: str = "validation/accuracy") -> list[tuple[int, float]]:
    """``(step, value)`` of every row of a run's metrics.jsonl that has ``key`` (validation reward by default), in order."""
    rows = [json.loads(line) for line in open(metrics_path) if line.strip()]
    return [(row["step"], row[key]) for row in rows if key in row]


def measure(demo: str, seed: int, extra: list[str]) -> str:
    with tempfile.TemporaryDirectory(prefix="grpo_demo_") as tmp:
        cmd = [sys.executable, "train_grpo.py", "--config", DEMOS[demo], f"grpo.seed={seed}",
               f"logger.log_dir={tmp}/logs", f"checkpointing.checkpoint_dir={tmp}/ckpt", *extra]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seconds = time.monotonic() - t0
        if proc.returncode != 0:
            return f"{demo} seed {seed}: exit {proc.returncode}\n{proc.stdout[-2000:]}"
        curve = validation_curve(os.path.join(tmp, "logs", "metrics.jsonl"))
        turns = validation_curve(os.path.join(tmp, "logs", "metrics.jsonl"), "train/avg_turns_per_sample")
    (s0, r0), (s1, r1) = curve[0], curve[-1]
    readings = " ".join(f"{r:.2f}" for _, r in curve)
    turns_moved = f"; turns per game {turns[0][1]:.1f} -> {turns[-1][1]:.1f}" if demo == "multiturn" else ""
    return (f"{demo} seed {seed}: validation reward {r0:.2f} (step {s0}) -> {r1:.2f} (step {s1}), {r1 - r0:+.2f}; "
            f"{seconds:.0f} s; every reading: {readings}{turns_moved}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--demo", choices=sorted(DEMOS), default="default")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every run")
    args = parser.parse_args()
    for seed in args.seeds:
        print(measure(args.demo, seed, args.overrides), flush=True)


if __name__ == "__main__":
    main()
