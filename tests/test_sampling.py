"""grpo.sampling: DAPO dynamic sampling cache and overlong filtering."""

import pytest
import torch

from grpo.sampling import DynamicSamplingCache, overlong_filter_mask


def gen_batch(tag: str, rewards, num_generations=2, T=3):
    """A generation batch: prompt p repeated num_generations times; std 0 iff the group's rewards are equal."""
    rewards = torch.tensor(rewards, dtype=torch.float32)
    n = rewards.shape[0]
    prompt_ids = torch.arange(n // num_generations).repeat_interleave(num_generations)
    std = torch.zeros(n)
    for p in range(n // num_generations):
        rows = prompt_ids == p
        std[rows] = rewards[rows].std()
    batch = {
        "rewards": rewards,
        "tokens": torch.arange(n * T).reshape(n, T),
        "name": [f"{tag}{p}" for p in prompt_ids.tolist()],
    }
    return batch, prompt_ids, std


def test_fills_across_batches_in_arrival_order_and_discards_overflow():
    cache = DynamicSamplingCache(num_prompts_per_step=3, num_generations_per_prompt=2, max_gen_batches=5)
    # batch a: groups a0 (std>0), a1 (zero std), a2 (std>0) -> 4 rows cached
    out, m = cache.add(*gen_batch("a", [1, 0, 1, 1, 0, 1]))
    assert out is None
    assert m == {"dynamic_sampling_num_gen_batches": 1, "dynamic_sampling_num_discarded_zero_std_samples": 2,
                 "dynamic_sampling_num_discarded_valid_samples": 0, "dynamic_sampling_num_cached_samples": 4}
    # batch b: b0 zero std, b1 and b2 std>0 -> 8 cached, 6 needed: b2 is discarded
    out, m = cache.add(*gen_batch("b", [0, 0, 0, 1, 1, 0]))
    assert out["name"] == ["a0", "a0", "a2", "a2", "b1", "b1"]
    assert out["group_ids"].tolist() == [0, 0, 1, 1, 2, 2]
    torch.testing.assert_close(out["rewards"], torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0]))
    assert out["tokens"][4].tolist() == [6, 7, 8]  # row 2 of batch b (first row of b1)
    assert m["dynamic_sampling_num_gen_batches"] == 2
    assert m["dynamic_sampling_num_discarded_zero_std_samples"] == 4
    assert m["dynamic_sampling_num_discarded_valid_samples"] == 2
    # the cache starts over for the next step
    assert cache.num_cached == 0 and cache.num_gen_batches == 0


def test_exact_fill_in_one_batch():
    cache = DynamicSamplingCache(2, 2, 1)
    out, m = cache.add(*gen_batch("a", [1, 0, 0, 1]))
    assert out["name"] == ["a0", "a0", "a1", "a1"]
    assert m["dynamic_sampling_num_discarded_valid_samples"] == 0


def test_pad_values_for_batches_of_different_lengths():
    cache = DynamicSamplingCache(2, 2, 2, pad_values={"ids": 7})
    assert cache.add({"ids": torch.ones(2, 2, dtype=torch.long)}, torch.tensor([0, 0]), torch.ones(2))[0] is None
    out, _ = cache.add({"ids": torch.zeros(2, 3, dtype=torch.long)}, torch.tensor([0, 0]), torch.ones(2))
    assert out["ids"].tolist() == [[1, 1, 7], [1, 1, 7], [0, 0, 0], [0, 0, 0]]


def test_groups_interleaved_rows_stay_whole():
    cache = DynamicSamplingCache(2, 2, 2)
    batch = {"r": torch.tensor([1.0, 5.0, 0.0, 5.0])}
    prompt_ids = torch.tensor([7, 3, 7, 3])  # group 7 = rows 0, 2 (mixed); group 3 = rows 1, 3 (equal)
    std = torch.tensor([0.7, 0.0, 0.7, 0.0])
    out, _ = cache.add(batch, prompt_ids, std)
    assert out is None and cache.num_cached == 2
    out, _ = cache.add({"r": torch.tensor([2.0, 3.0, 4.0, 4.0])}, torch.tensor([0, 0, 1, 1]),
                       torch.tensor([0.7, 0.7, 0.0, 0.0]))
    torch.testing.assert_close(out["r"], torch.tensor([1.0, 0.0, 2.0, 3.0]))
    assert out["group_ids"].tolist() == [0, 0, 1, 1]


def test_raises_after_max_gen_batches():
    cache = DynamicSamplingCache(2, 2, max_gen_batches=2)
    assert cache.add(*gen_batch("a", [1, 1, 1, 0]))[0] is None
    with pytest.raises(RuntimeError, match=r"grpo\.dynamic_sampling_max_gen_batches=2"):
        cache.add(*gen_batch("b", [0, 0, 1, 1]))


def test_wrong_group_size_raises():
    cache = DynamicSamplingCache(1, 3, 1)
    with pytest.raises(ValueError, match="num_generations_per_prompt=3"):
        cache.add(*gen_batch("a", [1, 0, 1, 0]))


def test_overlong_filter_mask():
    out = overlong_filter_mask(torch.tensor([True, False, True]), torch.tensor([1.0, 1.0, 0.0]))
    torch.testing.assert_close(out, torch.tensor([0.0, 1.0, 0.0]))
