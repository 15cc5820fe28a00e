"""bench/bench_agents.py runs: 2 agents x 1 turn over the endpoint and in process on the toy model, the same work on
both sides (a smoke test; the benchmark's numbers are measured by running it, never asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_agent_benchmark_runs_on_the_toy_model():
    out = subprocess.run([sys.executable, str(REPO / "bench" / "bench_agents.py"), "--model", "toy", "--prompts", "1",
                          "--generations", "2", "--turns", "1", "--max-tokens", "4", "--rounds", "1", "--warmup", "0",
                          "--threads", "1"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["agents"] == 2 and result["same_work"] and result["ratio_of_medians"] > 0
    (r,) = result["rounds"]
    assert r["endpoint"]["tokens"] == r["in_process"]["tokens"] == 2 * 4
    assert r["in_process"]["batches"] == [2] and sum(r["endpoint"]["batches"]) == 2
