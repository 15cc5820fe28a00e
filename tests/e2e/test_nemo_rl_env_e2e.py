"""End to end: an environment written to NeMo-RL's interface (tests/helpers/nemo_rl_envs.py: role "environment",
metadata None on later turns, global_post_process_and_metrics(batch)) trains as it is, its observations tokenised
as NeMo-RL does, its metrics logged. The Qwen2.5 template's side: tests/unit/test_nemo_rl_env_port.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers.e2e import TINY, paths, run, train_rows


@pytest.mark.slow  # ~30 s; the default suite's twin: tests/unit/test_nemo_rl_env_port.py (rollout, batch, loss)
def test_a_nemo_rl_environment_trains_two_steps(tmp_path: Path):
    run([sys.executable, "train_grpo.py", "--config", TINY, "grpo.max_rollout_turns=3", "env.name=class",
         "env.env_class=tests.helpers.nemo_rl_envs:HintEnvironment", "policy.max_total_sequence_length=32",
         "grpo.max_num_steps=2", "checkpointing.enabled=false", *paths(tmp_path)], timeout=600)
    rows = train_rows(tmp_path)
    assert sorted(rows) == [1, 2]
    for r in rows.values():
        assert r["train/avg_turns_per_sample"] > 1 and r["train/mean_env_tokens_per_sample"] > 0, r
        assert abs(r["train/token_mult_prob_error"] - 1.0) < 1e-3, r  # every turn scored as it was generated
        assert 0.0 <= r["train/env/class/success_rate"] <= 1.0 and r["train/env/class/num_problems_in_batch"] == 16
