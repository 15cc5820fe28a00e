"""The CPU demos' numbers, step by step: what a refactor must leave unchanged (a dev tool).

    python scripts/demo_fingerprint.py --out /tmp/before.json              # every demo, 10 steps each
    python scripts/demo_fingerprint.py --demos default gym --out /tmp/x.json
    python scripts/demo_fingerprint.py --compare /tmp/before.json /tmp/after.json   # exit 1 above 1e-6

Each demo runs as README runs it (`python train_grpo.py --config configs/cpu_demo*.yaml`; the async demo with
`train_async_grpo.py`) for ``--steps`` steps, one at a time, with ``OMP_NUM_THREADS=1`` (float sums in one fixed
order) in fresh log and checkpoint directories. The fingerprint keeps, per demo and step, every number of the run's
metrics.jsonl whose key names a loss, a reward or an accuracy (``train/loss``, ``train/reward``,
``validation/accuracy``, ...): the values a change of code layout must not move. Timings, throughputs and memory
are left out (they move from run to run). The toy models are built on first use under assets/ and reused.

``--compare`` prints, per demo, the largest absolute difference and the key and step where it is; a step or key
present in one file and not the other counts as an infinite difference.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure_demos import DEMOS  # noqa: E402  (name -> (script, config): the one list of the CPU demos)

KEPT = re.compile(r"loss|reward|accuracy")
DROPPED = re.compile(r"timing|time|per_s|throughput|memory|_mb$|_gb$")


def fingerprint_rows(rows: list[dict]) -> dict[str, dict[str, float]]:
    """metrics.jsonl rows -> ``{step: {key: value}}``: the numeric losses, rewards and accuracies of each step.

    >>> fingerprint_rows([{"step": 1, "train/loss": 0.5, "train/reward": 1, "timing/total_step_s": 3.0,
    ...                    "train/reward_hist": [1, 2]}, {"step": 1, "validation/accuracy": 0.25}])
    {'1': {'train/loss': 0.5, 'train/reward': 1.0, 'validation/accuracy': 0.25}}
    """
    out: dict[str, dict[str, float]] = {}
    for row in rows:
        if "step" not in row:
            continue
        kept = {k: float(v) for k, v in row.items()
                if KEPT.search(k) and not DROPPED.search(k) and isinstance(v, (int, float)) and not isinstance(v, bool)}
        out.setdefault(str(row["step"]), {}).update(kept)
    return {step: dict(sorted(values.items())) for step, values in out.items() if values}


def run_demo(name: str, steps: int, extra: list[str]) -> dict[str, dict[str, float]]:
    """One demo for ``steps`` steps in fresh directories -> its fingerprint; a failed run raises with its tail."""
    script, config = DEMOS[name]
    with tempfile.TemporaryDirectory(prefix=f"fingerprint_{name}_") as tmp:
        cmd = [sys.executable, script, "--config", config, f"grpo.max_num_steps={steps}",
               f"logger.log_dir={tmp}/logs", f"checkpointing.checkpoint_dir={tmp}/ckpt", *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{name}: {' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}")
        with open(os.path.join(tmp, "logs", "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    print(f"{name}: {len(rows)} metric rows, {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return fingerprint_rows(rows)


def largest_difference(a: dict, b: dict) -> tuple[float, str]:
    """Two fingerprints of one demo -> (the largest |a - b| over every step and key, where it is).

    >>> largest_difference({"1": {"x": 1.0}}, {"1": {"x": 1.5}})
    (0.5, 'step 1 x')
    >>> largest_difference({"1": {"x": 1.0}}, {"1": {"x": 1.0}, "2": {"x": 0.0}})
    (inf, 'step 2 only in one')
    """
    worst, where = 0.0, "-"
    for step in sorted(set(a) | set(b), key=int):
        if step not in a or step not in b:
            return math.inf, f"step {step} only in one"
        for key in sorted(set(a[step]) | set(b[step])):
            if key not in a[step] or key not in b[step]:
                return math.inf, f"step {step} {key} only in one"
            x, y = a[step][key], b[step][key]
            diff = 0.0 if (math.isnan(x) and math.isnan(y)) else abs(x - y)
            if math.isnan(diff) or diff > worst:
                worst, where = (math.inf if math.isnan(diff) else diff), f"step {step} {key}"
    return worst, where


def compare(path_a: str, path_b: str, tolerance: float) -> int:
    with open(path_a) as f:
        a = json.load(f)
    with open(path_b) as f:
        b = json.load(f)
    failed = False
    for demo in sorted(set(a) | set(b)):
        if demo not in a or demo not in b:
            print(f"{demo}: only in {path_a if demo in a else path_b}")
            failed = True
            continue
        worst, where = largest_difference(a[demo], b[demo])
        keys = len({k for step in a[demo].values() for k in step})
        print(f"{demo}: largest difference {worst:.3g} ({where}); {len(a[demo])} steps, {keys} keys")
        failed |= worst > tolerance
    print(f"{'FAIL' if failed else 'ok'}: tolerance {tolerance:g}")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--demos", nargs="+", choices=sorted(DEMOS), default=list(DEMOS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", help="write the fingerprint JSON here (default: stdout)")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two fingerprint files")
    parser.add_argument("--tolerance", type=float, default=1e-6)
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every run")
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare, args.tolerance)
    result = {name: run_demo(name, args.steps, args.overrides) for name in args.demos}
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
