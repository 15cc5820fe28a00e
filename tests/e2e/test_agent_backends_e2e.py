"""End to end: the shrunk agent demo (tests/e2e/test_agent_e2e.py SMALL) where its generation is not the colocated hf
copy: hf on a generation rank of its own (1 trainer + 1 generation rank). The trainer's logprobs of the tokens the
endpoint recorded equal the recorded ones (token_mult_prob_error within 1e-3 of 1.0) (slow)."""

from __future__ import annotations

import pytest

from tests.e2e.test_agent_e2e import CONFIG, SMALL
from tests.helpers.e2e import launcher, paths, run, train_rows

SPLIT = ["policy.generation.colocated.enabled=false", "policy.generation.colocated.resources.gpus_per_node=1"]


def check_agent_rows(rows: dict[int, dict]) -> None:
    assert sorted(rows) == [1, 2]
    for step, r in rows.items():
        assert r["train/env/agent/failed_samples"] == 0 and r["train/env/agent/noncontiguous_samples"] == 0, step
        assert abs(r["train/token_mult_prob_error"] - 1.0) < 1e-3, (step, r["train/token_mult_prob_error"])


@pytest.mark.slow  # 25 s alone, 95 s on the shared 2 cores
def test_agent_demo_on_an_hf_generation_rank_trains_on_the_recorded_tokens(tmp_path):
    p = run([*launcher("torchrun"), "--standalone", "--nproc_per_node", "2", "train_grpo.py", "--config", CONFIG,
             *SPLIT, *paths(tmp_path, *SMALL)], timeout=1200, threads=1)
    assert "2 ranks: 1 train, 1 generate (hf" in p.stdout + p.stderr
    check_agent_rows(train_rows(tmp_path))
