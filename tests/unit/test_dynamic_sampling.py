"""grpo.dynamic_sampling: DAPO dynamic sampling cache and overlong filtering."""

import pytest
import torch

from grpo.dynamic_sampling import DynamicSamplingCache, overlong_filter_mask
from tests.helpers.batches import train_batch


def gen_batch(tag: str, rewards, num_generations=2, T=3):
    """A generation batch: prompt p repeated num_generations times; std 0 iff the group's rewards are equal."""
    rewards = torch.tensor(rewards, dtype=torch.float32)
    n = rewards.shape[0]
    prompt_ids = torch.arange(n // num_generations).repeat_interleave(num_generations)
    std = torch.zeros(n)
    for p in range(n // num_generations):
        rows = prompt_ids == p
        std[rows] = rewards[rows].std()
    batch = train_batch(rewards_b=rewards, input_ids_bt=torch.arange(n * T).reshape(n, T),
                        task_names=[f"{tag}{p}" for p in prompt_ids.tolist()])
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
    assert out.task_names == ["a0", "a0", "a2", "a2", "b1", "b1"]
    assert out.group_ids_b.tolist() == [0, 0, 1, 1, 2, 2]
    torch.testing.assert_close(out.rewards_b, torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0]))
    assert out.input_ids_bt[4].tolist() == [6, 7, 8]  # row 2 of batch b (first row of b1)
    assert m["dynamic_sampling_num_gen_batches"] == 2
    assert m["dynamic_sampling_num_discarded_zero_std_samples"] == 4
    assert m["dynamic_sampling_num_discarded_valid_samples"] == 2
    # the cache starts over for the next step
    assert cache.num_cached == 0 and cache.num_gen_batches == 0


def test_exact_fill_in_one_batch():
    cache = DynamicSamplingCache(2, 2, 1)
    out, m = cache.add(*gen_batch("a", [1, 0, 0, 1]))
    assert out.task_names == ["a0", "a0", "a1", "a1"]
    assert m["dynamic_sampling_num_discarded_valid_samples"] == 0


def test_pad_values_for_batches_of_different_lengths():
    cache = DynamicSamplingCache(2, 2, 2, pad_values={"input_ids_bt": 7})
    first = train_batch(input_ids_bt=torch.ones(2, 2, dtype=torch.long))
    assert cache.add(first, torch.tensor([0, 0]), torch.ones(2))[0] is None
    out, _ = cache.add(train_batch(input_ids_bt=torch.zeros(2, 3, dtype=torch.long)), torch.tensor([0, 0]),
                       torch.ones(2))
    assert out.input_ids_bt.tolist() == [[1, 1, 7], [1, 1, 7], [0, 0, 0], [0, 0, 0]]
    assert out.attention_mask_bt.tolist() == [[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1]]  # others pad with 0


def test_groups_interleaved_rows_stay_whole():
    cache = DynamicSamplingCache(2, 2, 2)
    batch = train_batch(rewards_b=torch.tensor([1.0, 5.0, 0.0, 5.0]))
    prompt_ids = torch.tensor([7, 3, 7, 3])  # group 7 = rows 0, 2 (mixed); group 3 = rows 1, 3 (equal)
    std = torch.tensor([0.7, 0.0, 0.7, 0.0])
    out, _ = cache.add(batch, prompt_ids, std)
    assert out is None and cache.num_cached == 2
    out, _ = cache.add(train_batch(rewards_b=torch.tensor([2.0, 3.0, 4.0, 4.0])), torch.tensor([0, 0, 1, 1]),
                       torch.tensor([0.7, 0.7, 0.0, 0.0]))
    torch.testing.assert_close(out.rewards_b, torch.tensor([1.0, 0.0, 2.0, 3.0]))
    assert out.group_ids_b.tolist() == [0, 0, 1, 1]


def test_raises_after_max_gen_batches():
    cache = DynamicSamplingCache(2, 2, max_gen_batches=2)
    assert cache.add(*gen_batch("a", [1, 1, 1, 0]))[0] is None
    assert cache.add(*gen_batch("b", [0, 0, 1, 1]))[0] is None  # NeMo-RL still goes on at batch 2 of 2
    with pytest.raises(RuntimeError, match=r"after 3 generation batches \(grpo\.dynamic_sampling_max_gen_batches=2\)"):
        cache.add(*gen_batch("c", [0, 0, 1, 1]))


def nemo_rl_batches_before_giving_up(max_gen_batches: int, fills_at: int | None) -> int:
    """NeMo-RL's grpo_train loop around dynamic_sampling, transcribed: the counter goes up before each
    generation; a batch that does not fill the cache continues while counter <= max, else raises.
    Returns the number of generation batches it ran (the last one filled the cache or raised)."""
    num_gen_batches = 0
    while True:
        num_gen_batches += 1
        if fills_at is not None and num_gen_batches == fills_at:
            return num_gen_batches
        if num_gen_batches <= max_gen_batches:
            continue
        return num_gen_batches  # raise ValueError("Dynamic sampling has reached the maximum ...")


@pytest.mark.parametrize("max_gen_batches", [1, 2, 4])
@pytest.mark.parametrize("fills", [False, True])
def test_max_gen_batches_matches_nemo_rl_loop(max_gen_batches, fills):
    """The first batch brings one varying group of the two needed; later batches bring another (fills) or none."""
    expected = nemo_rl_batches_before_giving_up(max_gen_batches, 2 if fills else None)
    cache = DynamicSamplingCache(2, 2, max_gen_batches)
    ran = 0
    for i in range(10):
        ran += 1
        varies = i == 0 or fills
        try:
            out, _ = cache.add(*gen_batch(f"b{i}", [1, 0, 1, 1] if varies else [1, 1, 0, 0]))
        except RuntimeError:
            assert not fills
            break
        if out is not None:
            assert fills
            break
    assert ran == expected


def test_group_reward_std_rows_and_components():
    from grpo.dynamic_sampling import group_reward_std

    ids = torch.tensor([0, 0, 1, 1])
    torch.testing.assert_close(group_reward_std(ids, torch.tensor([1.0, 1.0, 1.0, 0.0])),
                               torch.tensor([0.0, 0.0, 0.7071, 0.7071]), atol=1e-4, rtol=0)
    comps = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.5], [0.0, 0.5]])
    torch.testing.assert_close(group_reward_std(ids, comps),
                               torch.tensor([[0.0, 0.7071], [0.0, 0.7071], [0.0, 0.0], [0.0, 0.0]]), atol=1e-4, rtol=0)


def test_gdpo_group_kept_when_any_component_varies():
    from grpo.dynamic_sampling import group_reward_std

    cache = DynamicSamplingCache(2, 2, 3)
    ids = torch.tensor([0, 0, 1, 1, 2, 2])
    # group 0: totals equal (1 and 1) but the components differ; group 1: nothing varies; group 2: correctness varies
    comps = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.5], [1.0, 0.5], [1.0, 0.5], [0.0, 0.5]])
    out, m = cache.add(train_batch(rewards_b=comps.sum(1)), ids, group_reward_std(ids, comps))
    assert out.group_ids_b.tolist() == [0, 0, 1, 1]
    torch.testing.assert_close(out.rewards_b, torch.tensor([1.0, 1.0, 1.5, 0.5]))
    assert m["dynamic_sampling_num_discarded_zero_std_samples"] == 2


def test_dapo_filters_on_the_unshaped_reward_the_issue_example():
    """Four wrong answers of 100, 3500, 4000 and 4096 tokens (max 4096, buffer 1024, penalty 1) are shaped
    to [0, -0.418, -0.906, -1]; their group has zero accuracy and must be DROPPED (DAPO, NeMo-RL)."""
    from grpo.config import RewardScalingConfig, RewardShapingConfig
    from grpo.rewards import process_reward_components, scale_rewards, shape_overlong_rewards
    from grpo.dynamic_sampling import group_reward_std

    shaping = RewardShapingConfig(enabled=True, max_response_length=4096, overlong_buffer_length=1024,
                                  overlong_buffer_penalty=1.0)
    lengths = [100, 3500, 4000, 4096, 10, 10, 10, 10]
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    task_b = scale_rewards(torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]), RewardScalingConfig())
    shaped_b = shape_overlong_rewards(task_b, lengths, None, shaping)
    torch.testing.assert_close(shaped_b[:4], torch.tensor([0.0, -0.418, -0.906, -1.0]), atol=1e-3, rtol=0)
    batch = train_batch(rewards_b=shaped_b, task_rewards_b=task_b)

    cache = DynamicSamplingCache(2, 4, max_gen_batches=3)
    out, m = cache.add(batch, ids, group_reward_std(ids, task_b))
    assert out is None and cache.num_cached == 4  # group 0 dropped, group 1 (one correct answer) kept
    assert m["dynamic_sampling_num_discarded_zero_std_samples"] == 4
    torch.testing.assert_close(cache.cached[0].task_rewards_b, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    # the std of the shaped rewards (what the loop took) would have kept the zero-accuracy group
    assert (group_reward_std(ids, shaped_b)[:4] > 0).all()
    # GDPO: the unshaped components decide, not the overlong column shaping adds
    comps = torch.stack([task_b, torch.full((8,), 0.5)], dim=1)
    task_bk, shaped_bk = process_reward_components(comps, {}, lengths, None, RewardScalingConfig(), shaping)
    assert shaped_bk.shape == (8, 3) and (group_reward_std(ids, shaped_bk)[:4] > 0).any()
    gdpo_cache = DynamicSamplingCache(2, 4, max_gen_batches=3)
    out, _ = gdpo_cache.add(train_batch(reward_components_bk=shaped_bk), ids, group_reward_std(ids, task_bk))
    assert out is None and gdpo_cache.num_cached == 4 and gdpo_cache.cached[0].group_ids_b.tolist() == [0] * 4


def test_wrong_group_size_raises():
    cache = DynamicSamplingCache(1, 3, 1)
    with pytest.raises(ValueError, match="num_generations_per_prompt=3"):
        cache.add(*gen_batch("a", [1, 0, 1, 0]))


def test_overlong_filter_mask():
    out = overlong_filter_mask(torch.tensor([True, False, True]), torch.tensor([1.0, 1.0, 0.0]))
    torch.testing.assert_close(out, torch.tensor([0.0, 1.0, 0.0]))
