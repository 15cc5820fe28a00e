"""bench/roofline.py runs: two steps of the bench workload's tiny model, each phase timed, counted and set against the
machine's measured peak and bandwidth (a smoke test; the fractions are measured by running it, never asserted beyond
being sane)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_roofline_benchmark_runs_on_the_tiny_model(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "bench" / "roofline.py"), "--workload", str(tmp_path / "workload"),
                          "--model", "tiny", "--steps", "2", "--threads", "1", "--probe-seconds", "0.3"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    keys = {"peak_gflops", "bandwidth_gbs", "ridge_flop_per_byte", "median_step_s", "phases", "load_average"}
    assert keys <= set(result)
    assert result["benchmark"] == "roofline" and result["steps"] == 2 and result["timed_steps"] == 1
    assert result["peak_gflops"] > 0 and result["bandwidth_gbs"] > 0
    phases = result["phases"]
    # the bench workload: no previous-policy pass (one update per batch), a reference, the policy's own module
    # generates (nothing to refit)
    assert {"prefill", "decode", "environment", "logprob_reference", "train_fwd_bwd", "optimizer",
            "refit"} <= set(phases)
    assert "logprob_prev" not in phases
    for name in ("prefill", "decode", "logprob_reference", "train_fwd_bwd", "optimizer"):
        p = phases[name]
        assert set(p) == {"s", "gflop", "gbyte", "bound", "fraction"}
        assert p["bound"] in ("compute", "memory") and 0 < p["fraction"] < 1.5, (name, p)
    assert phases["decode"]["gflop"] > phases["prefill"]["gflop"] > 0  # ~26 tokens decoded per row, a prompt per group
    assert phases["optimizer"]["bound"] == "memory" and phases["train_fwd_bwd"]["bound"] == "compute"
    assert phases["environment"]["bound"] is None and phases["refit"]["fraction"] is None
