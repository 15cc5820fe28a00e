"""Unit tests of grpo/replay.py (the async replay deque and weight stage) and of the generation
thread's rollout, grpo.phases.generate_and_score."""

import io
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo.generation.base import GenerationOutput
from grpo.replay import (
    ReplayBuffer, ReplayClosed, WeightStage, groups_from_rollout, rollout_from_groups, trajectory_age,
)


def put_batch(buf, target, versions, tag=""):
    buf.put([{"id": f"{tag}{target}/{i}"} for i in range(len(versions))], versions, target)


def ids(entries):
    return [e["group"]["id"] for e in entries]


# ---------------------------------------------------------------------------------------------
# ReplayBuffer
# ---------------------------------------------------------------------------------------------
def test_trajectory_age_is_trained_version_minus_generation_version():
    # step t trains version t - 1
    assert trajectory_age(step=1, generation_version=0) == 0
    assert trajectory_age(step=4, generation_version=1) == 2


def test_take_returns_the_steps_groups_fifo_and_leaves_the_rest():
    buf = ReplayBuffer(max_age_steps=2)
    put_batch(buf, 2, [0, 0, 0])
    put_batch(buf, 1, [0, 0])
    put_batch(buf, 3, [1, 1])
    entries, wait_s = buf.take(step=1, n=2)
    assert ids(entries) == ["1/0", "1/1"] and wait_s < 0.5
    assert [e["target_version"] for e in entries] == [1, 1]
    entries, _ = buf.take(step=2, n=2)  # only the first two of the three meant for step 2
    assert ids(entries) == ["2/0", "2/1"]
    assert [e["group"]["id"] for e in buf.entries()] == ["2/2", "3/0", "3/1"]


def test_take_evicts_groups_meant_for_earlier_steps_and_groups_over_the_age_bound():
    buf = ReplayBuffer(max_age_steps=1)
    put_batch(buf, 2, [1])          # leftover for step 2: gone at step 3
    put_batch(buf, 3, [1, 2])       # at step 3 (version 2): ages 1, 0
    put_batch(buf, 4, [0])          # age 2 at step 3 already: can never be trained -> evicted now
    put_batch(buf, 5, [3])
    entries, _ = buf.take(step=3, n=2)
    assert ids(entries) == ["3/0", "3/1"]
    assert buf.num_evicted == 2 and ids(buf.entries()) == ["5/0"]


def test_evicting_a_group_meant_for_the_step_being_taken_is_an_error():
    buf = ReplayBuffer(max_age_steps=1)
    put_batch(buf, 3, [0, 1])  # at step 3 (version 2) the first is 2 versions old
    with pytest.raises(RuntimeError, match="groups meant for step 3 were older than max_age_steps=1"):
        buf.take(step=3, n=2)
    assert buf.num_evicted == 1 and ids(buf.entries()) == ["3/1"]


def test_take_waits_on_the_condition_without_spinning():
    buf = ReplayBuffer(max_age_steps=1)
    out = {}

    def consumer():
        cpu0 = time.thread_time()
        out["entries"], out["wait_s"] = buf.take(step=1, n=2)
        out["cpu_s"] = time.thread_time() - cpu0

    t = threading.Thread(target=consumer)
    t.start()
    time.sleep(0.2)
    put_batch(buf, 1, [0])  # one of two: still waiting
    time.sleep(0.4)
    assert t.is_alive()
    put_batch(buf, 1, [0], tag="b")
    t.join(timeout=5)
    assert ids(out["entries"]) == ["1/0", "b1/0"]
    assert 0.55 <= out["wait_s"] < 3.0
    assert out["cpu_s"] < 0.1, out  # blocked in wait(), not polling


def test_take_times_out_and_close_wakes_the_waiter():
    buf = ReplayBuffer(max_age_steps=1)
    with pytest.raises(TimeoutError):
        buf.take(step=1, n=1, timeout=0.05)
    result = {}

    def consumer():
        try:
            buf.take(step=1, n=1)
        except ReplayClosed as e:
            result["err"] = e

    t = threading.Thread(target=consumer)
    t.start()
    time.sleep(0.1)
    buf.close("3 generation failures", failed=True)
    t.join(timeout=5)
    assert result["err"].failed and "3 generation failures" in str(result["err"])


def test_a_closed_buffer_still_serves_complete_steps_and_refuses_puts():
    buf = ReplayBuffer(max_age_steps=1)
    put_batch(buf, 1, [0, 0])
    buf.close("out of training data")
    assert ids(buf.take(step=1, n=2)[0]) == ["1/0", "1/1"]
    with pytest.raises(ReplayClosed) as e:
        buf.take(step=2, n=2)
    assert not e.value.failed and e.value.reason == "out of training data"
    with pytest.raises(ReplayClosed):
        put_batch(buf, 2, [1])


def test_state_dict_round_trips_through_a_weights_only_load():
    buf = ReplayBuffer(max_age_steps=2)
    o = GenerationOutput(prompt_ids=[1, 2], completion_ids=[3], logprobs=[-0.5], finish_reason="stop", text="3")
    rollout = {"outputs": [o, o], "rewards": [1.0, 0.0], "component_dicts": [{"a": 1.0}, None], "versions": [0, 1]}
    info = {"loader_mark": {"epoch": 0, "loader": {"gen": torch.arange(4), "n": 3}}, "metrics": {"x": 1.0}}
    groups = groups_from_rollout(rollout, [{"index": 9}], num_generations=2, extra={"batch": info})
    buf.put(groups, [0], target_version=2)
    buf.take(step=1, n=0)
    f = io.BytesIO()
    torch.save(buf.state_dict(), f)
    f.seek(0)
    state = torch.load(f, weights_only=True)
    other = ReplayBuffer(max_age_steps=2)
    other.load_state_dict(state)
    (e,), _ = other.take(step=2, n=1)
    assert e["generation_version"] == 0 and e["group"]["prompt_index"] == 9
    assert e["group"]["outputs"][0] == {"prompt_ids": [1, 2], "completion_ids": [3], "logprobs": [-0.5],
                                        "finish_reason": "stop", "text": "3"}
    assert torch.equal(e["group"]["batch"]["loader_mark"]["loader"]["gen"], torch.arange(4))


@settings(max_examples=60, deadline=None)
@given(max_age=st.integers(1, 3), plan=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 5), st.integers(1, 3)),
                                                min_size=1, max_size=12))
def test_taken_groups_are_never_too_old_and_never_taken_twice(max_age, plan):
    """Random puts (target, generation version, size): every group is taken at most once, taken ones
    are meant for the step and within the age bound, and taken + evicted + left = put."""
    buf = ReplayBuffer(max_age_steps=max_age)
    n_put = 0
    for i, (target, version, size) in enumerate(plan):
        put_batch(buf, target, [version] * size, tag=f"{i}:")
        n_put += size
    seen = []
    for step in range(1, 8):
        here = [e for e in buf.entries() if e["target_version"] == step]
        available = [e for e in here if trajectory_age(step, e["generation_version"]) <= max_age]
        if len(available) < len(here):  # the step is short: an error, the stale ones are evicted
            with pytest.raises(RuntimeError, match=f"meant for step {step}"):
                buf.take(step, n=len(available), timeout=0)
        entries, _ = buf.take(step, n=len(available), timeout=0)
        assert all(e["target_version"] == step and trajectory_age(step, e["generation_version"]) <= max_age
                   for e in entries)
        seen += ids(entries)
    assert len(seen) == len(set(seen))
    assert len(seen) + buf.num_evicted + len(buf) == n_put


# ---------------------------------------------------------------------------------------------
# Groups <-> rollouts
# ---------------------------------------------------------------------------------------------
def test_groups_round_trip_to_the_synchronous_rollout_lists():
    outs = [GenerationOutput([1], [10 + i], [-0.1 * i], "stop", str(i)) for i in range(6)]
    comps = [{"format": 0.5, "correct": float(i % 2)} for i in range(6)]
    rollout = {"outputs": outs, "rewards": [float(i % 2) for i in range(6)], "component_dicts": comps,
               "versions": [0, 0, 1, 1, 1, 2]}
    groups = groups_from_rollout(rollout, [{"index": 4}, {"index": 1}, {"index": 7}], num_generations=2)
    assert [g["prompt_index"] for g in groups] == [4, 1, 7]
    assert [min(g["versions"]) for g in groups] == [0, 1, 1]
    back = rollout_from_groups(groups)
    assert back["outputs"] == outs
    assert back["prompt_idx"] == [0, 0, 1, 1, 2, 2] and back["prompt_indices"] == [4, 1, 7]
    assert back["texts"] == [str(i) for i in range(6)]
    # components sorted by key, one row per sample: [correct, format]
    assert back["components"].tolist() == [[float(i % 2), 0.5] for i in range(6)]


# ---------------------------------------------------------------------------------------------
# WeightStage
# ---------------------------------------------------------------------------------------------
def test_weight_stage_publishes_a_copy_and_loads_only_newer_versions():
    src = torch.nn.Linear(3, 2)
    dst = torch.nn.Linear(3, 2)
    stage = WeightStage()
    stage.publish([list(src.named_parameters())], version=0)
    published = src.weight.detach().clone()
    with torch.no_grad():
        src.weight.add_(1.0)  # the stage holds a copy, not a view of the trainer's tensors
    assert stage.load_into(dst) == 0
    assert torch.equal(dst.weight, published) and torch.equal(dst.bias, src.bias)
    with torch.no_grad():
        dst.weight.zero_()
    assert stage.load_into(dst, have_version=0) == 0 and dst.weight.abs().sum() == 0  # nothing newer
    stage.publish([[("weight", src.weight)], [("bias", src.bias)]], version=1)
    assert stage.load_into(dst, have_version=0) == 1 and torch.equal(dst.weight, src.weight)
    with pytest.raises(KeyError, match="not staged"):
        stage.load_into(torch.nn.Sequential(torch.nn.Linear(3, 2)))  # "0.weight", "0.bias"


def test_weight_stage_wait_for_blocks_until_the_version_or_close():
    stage = WeightStage()
    stage.publish([[("w", torch.zeros(1))]], version=0)
    assert stage.wait_for(0)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("ok", stage.wait_for(2)))
    t.start()
    stage.publish([[("w", torch.ones(1))]], version=1)
    time.sleep(0.1)
    assert t.is_alive()
    stage.publish([[("w", torch.ones(1))]], version=2)
    t.join(timeout=5)
    assert result["ok"] is True
    t = threading.Thread(target=lambda: result.__setitem__("ok", stage.wait_for(5)))
    t.start()
    stage.close()
    t.join(timeout=5)
    assert result["ok"] is False and stage.wait_for(0) is False


# ---------------------------------------------------------------------------------------------
# The generation thread's rollout: chunks, versions, failures
# ---------------------------------------------------------------------------------------------
class FakeGenerator:
    """Completion = the sample's seed mod 7 as text; records the chunk sizes it was called with."""

    def __init__(self, fail_on_call=None):
        self.calls, self.fail_on_call, self.events = [], fail_on_call, []

    def generate(self, prompt_ids, seeds, **kw):
        self.events.append("generate")
        self.calls.append(len(prompt_ids))
        if self.fail_on_call == len(self.calls):
            raise ValueError("prompt 0 has 99 tokens")
        return [GenerationOutput(list(p), [s % 7], [-0.25], "stop", str(s % 7)) for p, s in zip(prompt_ids, seeds)]

    def wake_up(self):
        self.events.append("wake_up")

    def sleep(self):
        self.events.append("sleep")


class FakeEnv:
    def score(self, samples):
        from grpo.envs import ScoreResult

        return ScoreResult([float(s["completion"] == s["answer"]) for s in samples], None, 0, 0)


@pytest.fixture
def small_cfg():
    from grpo.config_load import load_config

    return load_config(None, ["grpo.num_generations_per_prompt=3", "policy.generation_batch_size=4",
                              "policy.train_global_batch_size=96",
                              "policy.train_micro_batch_size=4"])


def prompts(n):
    return [{"index": i, "question": f"q{i}", "answer": "3", "meta": {}, "prompt_ids": [i, i]} for i in range(n)]


def test_chunked_rollout_matches_the_synchronous_rollout_and_tags_chunk_versions(small_cfg):
    from grpo.phases import generate_and_score

    versions = iter([5, 6, 7])
    gen = FakeGenerator()
    r = generate_and_score(small_cfg, gen, FakeEnv(), prompts(3), step=4, gen_batch=0, rank=0, world_size=1,
                           timing={}, before_chunk=lambda: next(versions))
    assert gen.calls == [4, 4, 1]  # 9 samples in chunks of policy.generation_batch_size
    assert gen.events == ["wake_up", "generate", "generate", "generate", "sleep"]  # vLLM: asleep while training
    assert r["versions"] == [5] * 4 + [6] * 4 + [7]
    ref = generate_and_score(small_cfg, FakeGenerator(), FakeEnv(), prompts(3), step=4, gen_batch=0, rank=0,
                             world_size=1, timing={})
    assert r["outputs"] == ref["outputs"] and r["rewards"] == ref["rewards"]  # same seeds as train_grpo.py
    assert r["prompt_idx"] == ref["prompt_idx"] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    groups = groups_from_rollout(r, prompts(3), num_generations=3)
    assert [min(g["versions"]) for g in groups] == [5, 5, 6]  # a group is as old as its oldest sample


def test_chunked_rollout_turns_a_failure_into_rollout_error(small_cfg):
    from grpo.phases import RolloutError, generate_and_score

    with pytest.raises(RolloutError, match="rank 0: ValueError: prompt 0 has 99 tokens"):
        generate_and_score(small_cfg, FakeGenerator(fail_on_call=2), FakeEnv(), prompts(3), step=1, gen_batch=0,
                           rank=0, world_size=1, timing={})
