"""End to end: a harness that rewrites its history (examples/compacting_agent.py: a sub-agent, a rebuilt
conversation; configs/cpu_demo_agent_tree.yaml) trains as trees: its samples are several rows each, and the trainer's
logprobs of every row's tokens equal the ones recorded when they were generated (token_mult_prob_error within 1e-3 of
1.0, hf backend, colocated): each branch row is the context its calls were given (slow)."""

from __future__ import annotations

import sys

import pytest

from tests.e2e.test_agent_e2e import SMALL
from tests.helpers.e2e import REPO, paths, run, train_rows

CONFIG = str(REPO / "configs" / "cpu_demo_agent_tree.yaml")


@pytest.mark.slow
def test_a_harness_that_rewrites_its_history_trains_as_trees_on_the_recorded_tokens(tmp_path):
    run([sys.executable, "train_grpo.py", "--config", CONFIG, *paths(tmp_path, *SMALL)], timeout=1200)
    rows = train_rows(tmp_path)
    assert sorted(rows) == [1, 2]
    for r in rows.values():
        assert r["train/env/agent/failed_samples"] == 0 and r["train/env/agent/noncontiguous_samples"] == 0
        assert r["train/env/agent/branches_per_sample"] > 1.0  # the sub-agent's and the rebuilt conversations
        assert r["train/env/agent/trained_tokens_per_sample"] > 0
        assert abs(r["train/token_mult_prob_error"] - 1.0) < 1e-3  # every row scores the very tokens recorded
