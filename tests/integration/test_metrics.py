"""grpo.metrics: rollout-metric aggregation, validation early stop, global loss normalisers."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from grpo.metrics import aggregate_rollout_metrics, global_valid_counts, validation_early_stop
from tests.helpers.e2e import free_port


def test_aggregate_rules():
    dicts = [
        {"reward": 1.0, "probs_ratio_min": 0.9, "len/max": 10, "min_len": 3, "total_turns": 2, "hist": [1, 2],
         "gen_lengths": torch.tensor([5, 6])},
        {"reward": 0.0, "probs_ratio_min": 0.7, "len/max": 30, "min_len": 5, "total_turns": 3, "hist": [3],
         "gen_lengths": torch.tensor([7])},
        {"reward": 0.5, "extra": torch.tensor(4.0), "total_turns": None},
    ]
    out = aggregate_rollout_metrics(dicts)
    assert out == {
        "reward": pytest.approx(0.5),
        "probs_ratio_min": 0.7,
        "len/max": 30,
        "min_len": 3,
        "total_turns": 5,
        "hist": [1, 2, 3],
        "gen_lengths": [5, 6, 7],
        "extra": 4.0,
    }


def test_min_max_match_whole_name_tokens_only():
    out = aggregate_rollout_metrics([{"admin_score": 1.0, "maximal": 1.0}, {"admin_score": 3.0, "maximal": 5.0}])
    assert out == {"admin_score": 2.0, "maximal": 3.0}  # "admin" / "maximal" are not min / max


def test_aggregate_empty():
    assert aggregate_rollout_metrics([]) == {}


def test_validation_early_stop():
    assert validation_early_stop({"reward_mean": 0.8}, None, None) == (False, None, "")
    stop, value, msg = validation_early_stop({"reward_mean": 0.8}, "reward_mean", 0.75)
    assert stop and value == 0.8 and "stopping" in msg
    stop, value, _ = validation_early_stop({"pass@4": torch.tensor(0.5)}, "pass@4", 0.75)
    assert not stop and value == 0.5
    stop, _, _ = validation_early_stop({"reward_mean": 0.75}, "reward_mean", 0.75)
    assert stop
    with pytest.raises(KeyError, match="reward_mean"):
        validation_early_stop({"reward_mean": 0.8}, "accuracy", 0.5)


def test_global_valid_counts_local():
    tm = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    sm = torch.tensor([1.0, 0.0, 1.0])
    tokens, seqs = global_valid_counts(tm, sm)
    assert tokens.item() == 3.0 and seqs.item() == 2.0
    assert tokens.dtype == torch.float32


def _worker(rank, port, results):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        # rank 0: 3 valid tokens in 2 samples; rank 1: 4 tokens, 1 sample (other sample masked)
        tm = [torch.tensor([[1, 1], [1, 0]]), torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1]])][rank]
        sm = [torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.0])][rank]
        tokens, seqs = global_valid_counts(tm, sm)
        results[rank] = (tokens.item(), seqs.item())
    finally:
        dist.destroy_process_group()


def test_global_valid_counts_all_reduce_two_ranks():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(free_port(), results), nprocs=2, join=True)
        assert dict(results) == {0: (7.0, 3.0), 1: (7.0, 3.0)}


def test_rates_are_averaged_even_with_a_min_or_max_in_their_name():
    """NeMo-RL's aggregate_rollout_metrics (nemo_rl/algorithms/grpo.py at 7ea279a) keeps names ending in ``_rate``
    out of min / max: ``max_turns_reached_rate`` is the share of samples that hit the turn limit, so two halves of
    a batch at 0.25 and 0.75 are 0.5 of it, not 0.75."""
    out = aggregate_rollout_metrics([{"max_turns_reached_rate": 0.25, "min_len_rate": 0.5, "max_len": 3},
                                     {"max_turns_reached_rate": 0.75, "min_len_rate": 0.0, "max_len": 9}])
    assert out == {"max_turns_reached_rate": 0.5, "min_len_rate": 0.25, "max_len": 9}
