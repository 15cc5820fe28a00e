"""Unit tests of grpo/system/replay.py: the async replay deque, the weight stage, groups of trajectories."""

import io
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo.system.data import LoaderMark
from grpo.system.replay import (
    GroupInfo, ReplayBuffer, ReplayClosed, ReplayEntry, ReplayGroup, StopKind, WeightStage, groups_from_trajectories,
    replay_resume, trajectories_from_groups, trajectory_age,
)
from grpo.trajectory import Message, Trajectory


def put_batch(buf, target, versions, tag=""):
    buf.put([f"{tag}{target}/{i}" for i in range(len(versions))], versions, target)  # the buffer never looks inside


def ids(entries):
    return [e.group for e in entries]


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
    assert [e.target_version for e in entries] == [1, 1]
    entries, _ = buf.take(step=2, n=2)  # only the first two of the three meant for step 2
    assert ids(entries) == ["2/0", "2/1"]
    assert ids(buf.entries()) == ["2/2", "3/0", "3/1"]


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
    buf.close(StopKind.FAILURES, "3 generation failures")
    t.join(timeout=5)
    assert result["err"].failed and "3 generation failures" in str(result["err"])
    assert result["err"].kind is StopKind.FAILURES


def test_a_closed_buffer_still_serves_complete_steps_and_refuses_puts():
    buf = ReplayBuffer(max_age_steps=1)
    put_batch(buf, 1, [0, 0])
    buf.close(StopKind.OUT_OF_DATA)
    buf.close(StopKind.CRASHED, "later closes do not replace the first reason")
    assert ids(buf.take(step=1, n=2)[0]) == ["1/0", "1/1"]
    with pytest.raises(ReplayClosed) as e:
        buf.take(step=2, n=2)
    assert not e.value.failed and e.value.kind is StopKind.OUT_OF_DATA and str(e.value) == "out of training data"
    with pytest.raises(ReplayClosed):
        put_batch(buf, 2, [1])


def traj(group_id, version, reward=0.0, components=None):
    return Trajectory(group_id, 10 + group_id, "t", "q", "a",
                      [Message("user", "q", [1, 2]), Message("assistant", "3", [3], [-0.5], ["invalid_tool_call"])],
                      {"answer": "a"}, reward=reward, reward_components=components, generation_version=version)


def test_state_dict_round_trips_through_a_weights_only_load():
    buf = ReplayBuffer(max_age_steps=2)
    info = GroupInfo(loader_mark=LoaderMark(0, {"gen": torch.arange(4), "n": 3}), metrics={"x": 1.0})
    trajs = [traj(0, 0, 1.0, {"a": 1.0}), traj(0, 1)]
    groups = groups_from_trajectories(trajs, info)
    buf.put(groups, [g.version for g in groups], target_version=2)
    buf.take(step=1, n=0)
    f = io.BytesIO()
    torch.save(buf.state_dict(), f)
    f.seek(0)
    state = torch.load(f, weights_only=True)
    other = ReplayBuffer(max_age_steps=2)
    other.load_state_dict(state)
    (e,), _ = other.take(step=2, n=1)
    assert e.generation_version == 0 and e.group.prompt_index == 10
    assert trajectories_from_groups([e.group]) == trajs
    assert torch.equal(e.group.info.loader_mark.loader["gen"], torch.arange(4))


def test_a_replay_buffer_saved_before_the_dataclasses_loads_and_saves_in_the_same_form():
    """Checkpoints hold plain dicts (what the buffer held before it held dataclasses): they load, and groups of
    one prompt batch share one info again, saved once."""
    info = {"loader_mark": {"epoch": 1, "loader": {"n": 3}}, "metrics": {"x": 1.0}, "timing": {"generate_s": 2.0},
            "gen_start_time": 5.0, "gen_end_time": 6.0}
    old = {"entries": [{"generation_version": 1, "target_version": 3,
                        "group": {"prompt_index": i, "trajectories": [traj(0, 1).to_dict()], "version": 1,
                                  "info": info}} for i in (7, 8)], "num_evicted": 2, "max_age_steps": 1}
    f = io.BytesIO()
    torch.save(old, f)
    f.seek(0)
    buf = ReplayBuffer(max_age_steps=1)
    buf.load_state_dict(torch.load(f, weights_only=True))
    a, b = buf.entries()
    assert isinstance(a, ReplayEntry) and isinstance(a.group, ReplayGroup) and a.group.info is b.group.info
    assert a.group.info.loader_mark == LoaderMark(1, {"n": 3}) and buf.num_evicted == 2
    state = buf.state_dict()
    assert state == old and state["entries"][0]["group"]["info"] is state["entries"][1]["group"]["info"]


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
        here = [e for e in buf.entries() if e.target_version == step]
        available = [e for e in here if trajectory_age(step, e.generation_version) <= max_age]
        if len(available) < len(here):  # the step is short: an error, the stale ones are evicted
            with pytest.raises(RuntimeError, match=f"meant for step {step}"):
                buf.take(step, n=len(available), timeout=0)
        entries, _ = buf.take(step, n=len(available), timeout=0)
        assert all(e.target_version == step and trajectory_age(step, e.generation_version) <= max_age
                   for e in entries)
        seen += ids(entries)
    assert len(seen) == len(set(seen))
    assert len(seen) + buf.num_evicted + len(buf) == n_put


# ---------------------------------------------------------------------------------------------
# Groups <-> rollouts
# ---------------------------------------------------------------------------------------------
def test_groups_round_trip_and_renumber_group_ids_by_position():
    trajs = [traj(g, v, float(i % 2)) for i, (g, v) in enumerate([(0, 0), (0, 0), (1, 1), (1, 1), (2, 1), (2, 2)])]
    groups = groups_from_trajectories(trajs)
    assert [g.prompt_index for g in groups] == [10, 11, 12]
    assert [g.version for g in groups] == [0, 1, 1]  # a group is as old as its oldest sample
    back = trajectories_from_groups([groups[2], groups[0]])
    assert [t.group_id for t in back] == [0, 0, 1, 1] and [t.prompt_index for t in back] == [12, 12, 10, 10]
    assert [t.reward for t in back] == [0.0, 1.0, 0.0, 1.0]


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


def test_an_async_checkpoint_of_the_dict_marks_resumes_where_its_loader_marks_say(tmp_path):
    """A checkpoint's replay deque as grpo-ds has always written it (marks as ``{"epoch", "loader"}`` dicts), read
    back as the checkpoint reads it (`grpo.system.checkpoint.safe_load`, weights_only): `replay_resume` gives typed
    marks, and the generation thread's prompts go on after the last buffered batch, the trainer's after the last
    trained one (dataloader.pt)."""
    from types import SimpleNamespace

    from grpo.config.load import apply_overrides, build_config
    from grpo.system.checkpoint import safe_load
    from grpo.system.data import PromptStream, build_dataloader

    def loader():
        return build_dataloader(list(range(24)), 4, shuffle=True, seed=3)

    full = PromptStream(loader(), max_epochs=2)
    batches = [full.next() for _ in range(8)]
    trained_at, buffered_at = PromptStream(loader(), 2), PromptStream(loader(), 2)
    for _ in range(3):
        trained_at.next()
    for _ in range(7):  # into epoch 1: the loader restarted
        buffered_at.next()
    info = {"loader_mark": {"epoch": buffered_at.epoch, "loader": buffered_at.loader.state_dict()},
            "metrics": {}, "timing": {}, "gen_start_time": 0.0, "gen_end_time": 0.0}
    old = {"entries": [{"generation_version": 3, "target_version": 4,
                        "group": {"prompt_index": 0, "trajectories": [traj(0, 3).to_dict()], "version": 3,
                                  "info": info}}], "num_evicted": 0, "max_age_steps": 1}
    torch.save(old, tmp_path / "extra_replay_buffer.pt")
    cfg = build_config(apply_overrides({}, ["grpo.async_grpo.max_trajectory_age_steps=1"]))
    run = SimpleNamespace(cfg=cfg, state=SimpleNamespace(current_epoch=0, current_step=3), loader=loader(),
                          resume=SimpleNamespace(loader_state=trained_at.mark().loader,
                                                 extra={"replay_buffer": safe_load(tmp_path / "extra_replay_buffer.pt")}))
    start = replay_resume(run)
    assert isinstance(start.gen_mark, LoaderMark) and start.gen_mark.epoch == 1
    assert start.trained_mark.epoch == 0 and start.first_target == 5 and len(start.buffer) == 1
    generation = PromptStream(loader(), 2, start.gen_mark.epoch, start.gen_mark.loader)
    trainer = PromptStream(loader(), 2, start.trained_mark.epoch, start.trained_mark.loader)
    assert generation.next() == batches[7] and trainer.next() == batches[3]
    torch.save(start.buffer.state_dict(), tmp_path / "again.pt")  # saved again in the same, plain form
    mark = safe_load(tmp_path / "again.pt")["entries"][0]["group"]["info"]["loader_mark"]
    assert sorted(mark) == ["epoch", "loader"] and mark["epoch"] == 1
