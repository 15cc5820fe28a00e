"""Rerun a CPU demo over a grid of seeds and torch thread counts and print the lines README and
docs/measurements.md quote: the machine (CPU model, library versions), one line per run (validation reward at
the first and the last step, the rise, the wall time, every reading) and the rise's min / median / max.

    python scripts/measure_demos.py --demo default --seeds 0 1 2 3 4 --threads 1 2    # README's figure
    python scripts/measure_demos.py --demo multiturn --seeds 0 --threads 2
    python scripts/measure_demos.py --demo agent --jobs 2     # two runs at once (times grow, rewards do not)
    python scripts/measure_demos.py --demo default grpo.max_num_steps=30              # overrides for every run

Each run is the demo's command as README gives it (`python train_grpo.py --config <demo> grpo.seed=<N>`, the async
demo through train_async_grpo.py) with ``OMP_NUM_THREADS=<T>``, in fresh log and checkpoint directories. The demo's
toy models (grpo/tasks/catalogue.py builds them on first use, with one torch thread whatever the setting) are built
first, so a run's time is the run's. The demos learn through sampling, which amplifies float rounding: another CPU,
thread count or library version reads other numbers, so README states a rise below the grid's least, and each
demo's slow test asserts it. Overrides go before ``--seeds`` / ``--threads`` (or after ``--``), which take every
value that follows them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# demo -> (script, config): every CPU demo that learns (the sliding puzzle checks plumbing, vLLM needs its install).
DEMOS = {"default": ("train_grpo.py", "configs/cpu_demo.yaml"),
         "async": ("train_async_grpo.py", "configs/cpu_demo_async.yaml"),
         "multiturn": ("train_grpo.py", "configs/cpu_demo_multiturn.yaml"),
         "tools": ("train_grpo.py", "configs/cpu_demo_tools.yaml"),
         "agent": ("train_grpo.py", "configs/cpu_demo_agent.yaml"),
         "gym": ("train_grpo.py", "configs/cpu_demo_gym.yaml"),
         "reward_model": ("train_grpo.py", "configs/cpu_demo_reward_model.yaml"),
         "lora": ("train_grpo.py", "configs/cpu_demo_lora.yaml"),
         "vlm": ("train_grpo.py", "configs/cpu_demo_vlm.yaml")}


def validation_curve(metrics_path: str, key: str = "validation/accuracy") -> list[tuple[int, float]]:
    """``(step, value)`` of every row of a run's metrics.jsonl that has ``key`` (validation reward by default), in order."""
    rows = [json.loads(line) for line in open(metrics_path) if line.strip()]
    return [(row["step"], row[key]) for row in rows if key in row]


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (``platform.processor()`` elsewhere), and the cores the OS shows."""
    name = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} cores"


def versions() -> str:
    """torch, transformers and deepspeed as installed (read from the package metadata: nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    def one(name: str) -> str:
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            return f"{name} not installed"

    return ", ".join(one(name) for name in ("torch", "transformers", "deepspeed"))


def commit() -> str:
    p = subprocess.run(["git", "log", "-1", "--format=%h"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    return (p.stdout.strip() or "unknown") + (" + uncommitted changes" if dirty else "")


def toy_models(config: str, overrides: list[str]) -> list[str]:
    """The ``toy:`` models the demo loads (the policy, and a reward model's), as its config names them."""
    sys.path.insert(0, REPO)
    from grpo.config.load import load_config

    cfg = load_config(os.path.join(REPO, config), overrides)
    rm = cfg.env.reward_model
    names = [cfg.policy.model_name, rm.model_name if rm is not None else None]
    return [name for name in names if name and name.startswith("toy:")]


def build_toy_models(names: list[str]) -> str:
    """Build the toy models not built yet (in a child process, as a run would); returns a line saying so."""
    if not names:
        return "no toy model"
    code = ("import sys; from grpo.tasks.catalogue import resolve_model_name\n"
            "for name in sys.argv[1:]: print(name, '->', resolve_model_name(name), flush=True)")
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", code, *names], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return f"toy models {', '.join(names)} ready in {time.monotonic() - t0:.0f} s (built on first use, reused after)"


def measure(demo: str, seed: int, threads: int, extra: list[str]) -> tuple[str, float | None, float]:
    """One run of ``demo`` at ``seed`` with ``threads`` torch threads: ``(its line, its rise, its seconds)`` (rise
    None: it failed)."""
    script, config = DEMOS[demo]
    label = f"{demo} seed {seed} threads {threads}"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory(prefix="grpo_demo_") as tmp:
        cmd = [sys.executable, script, "--config", config, f"grpo.seed={seed}", f"logger.log_dir={tmp}/logs",
               f"checkpointing.checkpoint_dir={tmp}/ckpt", "logger.progress_bar=false", *extra]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seconds = time.monotonic() - t0
        if proc.returncode != 0:
            return f"{label}: exit {proc.returncode}\n{proc.stdout[-2000:]}", None, seconds
        metrics = os.path.join(tmp, "logs", "metrics.jsonl")
        curve = validation_curve(metrics)
        turns = validation_curve(metrics, "train/avg_turns_per_sample")
    (s0, r0), (s1, r1) = curve[0], curve[-1]
    readings = " ".join(f"{r:.2f}" for _, r in curve)
    turns_moved = f"; turns per game {turns[0][1]:.1f} -> {turns[-1][1]:.1f}" if demo == "multiturn" else ""
    return (f"{label}: validation reward {r0:.2f} (step {s0}) -> {r1:.2f} (step {s1}), {r1 - r0:+.2f}; "
            f"{seconds:.0f} s; every reading: {readings}{turns_moved}"), r1 - r0, seconds


def summary(demo: str, rises: list[float], seeds: list[int], threads: list[int], seconds: list[float]) -> str:
    """README's line: the rise's min / median / max over the grid, and the runs' wall times."""
    grid = f"seeds {' '.join(map(str, seeds))} x threads {' '.join(map(str, threads))}"
    return (f"{demo}: rise in validation reward min {min(rises):+.2f} / median {statistics.median(rises):+.2f} / "
            f"max {max(rises):+.2f} over {len(rises)} runs ({grid}); {min(seconds):.0f}-{max(seconds):.0f} s a run")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--demo", choices=sorted(DEMOS), default="default")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="OMP_NUM_THREADS of the runs")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (1: times comparable)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every run")
    args = parser.parse_args()

    script, config = DEMOS[args.demo]
    print(f"{args.demo} demo: python {script} --config {config} {' '.join(args.overrides)}".rstrip())
    print(f"machine: {cpu_model()}; {versions()}; Python {platform.python_version()}")
    print(f"commit {commit()}, {datetime.date.today().isoformat()}, {args.jobs} run(s) at once", flush=True)
    print(build_toy_models(toy_models(config, args.overrides)), flush=True)
    grid = [(seed, threads) for threads in args.threads for seed in args.seeds]
    rises, seconds = [], []
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for future in [pool.submit(measure, args.demo, seed, threads, args.overrides) for seed, threads in grid]:
            line, rise, took = future.result()
            print(line, flush=True)
            if rise is not None:
                rises.append(rise)
                seconds.append(took)
    if rises:
        print(summary(args.demo, rises, args.seeds, args.threads, seconds))
    if len(rises) < len(grid):
        print(f"{len(grid) - len(rises)} of {len(grid)} runs failed")
        sys.exit(1)


if __name__ == "__main__":
    main()
