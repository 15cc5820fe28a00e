"""grpo/packing.py: bin packing and token-budget micro-batches (properties), the packed row layout, and the
policy.sequence_packing / policy.dynamic_batching config sections."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo.config import MasterConfig
from grpo.packing import (PACKING_ALGORITHMS, dynamic_micro_batches, pack_bins, packed_layout, round_up, unpack)
from grpo.system.packed import packed_rows

lengths_and_capacity = st.integers(1, 64).flatmap(
    lambda cap: st.tuples(st.lists(st.integers(1, cap), max_size=40), st.just(cap)))


@settings(max_examples=150, deadline=None)
@given(lengths_and_capacity, st.sampled_from(sorted(PACKING_ALGORITHMS)), st.sampled_from(["packer", "largest_first"]))
def test_every_row_in_exactly_one_bin_within_capacity(lc, algorithm, order):
    lengths, cap = lc
    bins = pack_bins(lengths, cap, algorithm, order)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(b and sum(lengths[i] for i in b) <= cap for b in bins)
    # no algorithm needs more than twice the optimum (first fit's bound; every bin but one is over half full)
    assert len(bins) <= max(1, 2 * -(-sum(lengths) // cap)) or not lengths
    if order == "largest_first":
        loads = [sum(lengths[i] for i in b) for b in bins]
        assert loads == sorted(loads, reverse=True)


@settings(max_examples=100, deadline=None)
@given(lengths_and_capacity)
def test_decreasing_algorithms_beat_or_match_concatenation(lc):
    """First-fit decreasing uses at most 11/9 OPT + 6/9 bins (Dosa 2007), and OPT <= concatenation's count. It can
    lose to concatenation on a lucky order: [5, 9, 16, 7, 13, 13] in 33 concatenates into 2 bins (30, 33), while
    FFD opens 3 (16+13, 13+9+7, 5)."""
    lengths, cap = lc
    n_concat = len(pack_bins(lengths, cap, "concatenative"))
    assert len(pack_bins(lengths, cap, "first_fit_decreasing")) <= (11 * n_concat + 6) // 9
    assert len(pack_bins(lengths, cap, "modified_first_fit_decreasing")) <= max(n_concat, 1) + 1


def test_packers_refuse_a_row_over_capacity_and_a_bad_name():
    with pytest.raises(ValueError, match="10 tokens exceeds the micro-batch budget of 8"):
        pack_bins([3, 10], 8)
    with pytest.raises(ValueError, match="expected one of"):
        pack_bins([3], 8, "best_fit")
    with pytest.raises(ValueError, match="largest_first"):
        pack_bins([3], 8, order="smallest_first")


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 30), max_size=40), st.sampled_from([1, 4, 8]), st.integers(32, 200))
def test_dynamic_micro_batches_keep_the_padded_budget_and_sort_by_length(lengths, rnd, budget):
    groups = dynamic_micro_batches(lengths, budget, rnd)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) * max(round_up(lengths[i], rnd) for i in g) <= budget
    flat = [lengths[i] for g in groups for i in g]
    assert flat == sorted(flat)
    # greedy: the next group's first row would have broken the budget of the group before it
    for a, b in zip(groups, groups[1:]):
        assert (len(a) + 1) * round_up(lengths[b[0]], rnd) > budget


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=8), st.sampled_from([1, 5, 16]), st.integers(0, 3),
       st.sampled_from(["sdpa", "flash_attention_2"]))
def test_packed_layout_round_trips_and_restarts_positions(lengths, rnd, extra_cols, attention):
    lengths_b = torch.tensor(lengths)
    T = max(lengths) + extra_cols
    rows, row_len = packed_rows(lengths, attention, rnd)
    assert row_len % rnd == 0 and (len(rows) == 1 or attention == "sdpa") and row_len >= max(lengths)
    source_kr, positions_kr = packed_layout(lengths_b, rows, row_len, seq_len=T)
    values_bt = torch.arange(len(lengths) * T, dtype=torch.float32).reshape(len(lengths), T) + 1
    packed_kr = torch.where(source_kr >= 0, values_bt.reshape(-1)[source_kr.clamp(min=0)], 0.0)
    mask_bt = torch.arange(T)[None] < lengths_b[:, None]
    assert torch.equal(unpack(packed_kr.reshape(-1), source_kr.reshape(-1), (len(lengths), T)), values_bt * mask_bt)
    for k, row in enumerate(rows):   # positions restart at every sample and at the row's padding
        expected = [t for b in row for t in range(lengths[b])]
        expected += list(range(row_len - len(expected)))
        assert positions_kr[k].tolist() == expected


def policy(**kw):
    return MasterConfig.model_validate({"policy": {"max_total_sequence_length": 256, "train_micro_batch_size": 4,
                                                   "logprob_batch_size": 8, "generation": {"max_new_tokens": 64}, **kw}}).policy


def test_budgets_default_to_nemo_rls_products():
    p = policy(sequence_packing={"enabled": True})
    assert (p.mb_tokens("train"), p.mb_tokens("logprob")) == (1024, 2048)
    p = policy(dynamic_batching={"enabled": True, "logprob_mb_tokens": 300})
    assert (p.mb_tokens("train"), p.mb_tokens("logprob")) == (1024, 300)
    assert policy(sequence_packing={"enabled": False}).mb_tokens("train") is None


def test_packing_is_on_by_default_and_gives_way_to_dynamic_batching_only_when_left_at_its_default():
    assert policy().sequence_packing.enabled and policy().mb_tokens("train") == 1024
    p = policy(dynamic_batching={"enabled": True})  # asked for dynamic batching: the default packing steps aside
    assert not p.sequence_packing.enabled and p.dynamic_batching.enabled
    p = policy(sequence_packing={"train_mb_tokens": 512}, dynamic_batching={"enabled": True})
    assert not p.sequence_packing.enabled
    with pytest.raises(ValueError, match="exclusive"):  # both asked for: an error, as in NeMo-RL
        policy(sequence_packing={"enabled": True}, dynamic_batching={"enabled": True})


@pytest.mark.parametrize("kw, match", [
    ({"sequence_packing": {"enabled": True}, "dynamic_batching": {"enabled": True}}, "exclusive"),
    ({"sequence_packing": {"enabled": True, "train_mb_tokens": 255}},
     "policy.sequence_packing.train_mb_tokens=255: a sample of policy.max_total_sequence_length=256"),
    ({"dynamic_batching": {"enabled": True, "sequence_length_round": 100, "logprob_mb_tokens": 256}},
     "logprob_mb_tokens=256.*300 rounded"),
    ({"sequence_packing": {"algorithm": "best_fit"}}, "modified_first_fit_decreasing"),
    ({"sequence_packing": {"train_mb_token": 5}}, "train_mb_token"),
    ({"dynamic_batching": {"algorithm": "concatenative"}}, "algorithm"),
    ({"dynamic_batching": {"sequence_length_round": 0}}, "sequence_length_round"),
])
def test_bad_settings_fail_naming_the_key(kw, match):
    with pytest.raises(ValueError, match=match):
        policy(**kw)
