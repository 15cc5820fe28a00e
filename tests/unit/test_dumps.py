"""grpo.system.dumps: rollout dump records, the writer (size bound, rank 0, atomic), reading back, the wandb table."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo.config import LoggerConfig
from grpo.system.dumps import (
    RECORD_KEYS, RolloutDumper, check_record, list_dumps, read_dump, render_messages, representative_indices,
    wandb_table,
)
from grpo.system.tracking import MetricsLogger
from tests.helpers.rollout_records import make_record


def _no_nan_literals(line: str) -> dict:
    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name} in {line!r}")

    return json.loads(line, parse_constant=refuse)


def test_lines_parse_and_round_trip_with_tensors_and_non_finite_floats(tmp_path):
    records = [
        make_record(reward=torch.tensor(0.25), advantage=torch.tensor(-1.5), logprob_error=float("inf"),
                    reward_components={"correct": float("nan"), "format": 1.0}),
        make_record(reward=float("nan"), group_id=1, masked=True, mask_reason="overlong", finish_reason="length",
                    truncated=True, logprob_error=None, reward_components=None),
    ]
    path = RolloutDumper(tmp_path, every=1, max_samples=None, rank=0).write("train", 3, records)
    assert path == tmp_path / "rollouts" / "train_step_3.jsonl"
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    raw = [_no_nan_literals(line) for line in lines]
    assert list(raw[0]) == list(RECORD_KEYS)
    assert raw[0]["logprob_error"] == "inf" and raw[0]["reward_components"]["correct"] == "nan"
    assert raw[1]["reward"] == "nan"

    back = read_dump(path)
    assert back[0]["reward"] == 0.25 and back[0]["advantage"] == -1.5 and back[0]["logprob_error"] == math.inf
    assert math.isnan(back[0]["reward_components"]["correct"]) and back[0]["reward_components"]["format"] == 1.0
    assert math.isnan(back[1]["reward"]) and back[1]["mask_reason"] == "overlong"
    assert back[1]["messages"] == records[1]["messages"] and back[1]["reward_components"] is None


def test_the_dump_keeps_every_reward_when_unbounded(tmp_path):
    """The dumped rewards are the step's rewards: their mean is the step's reward mean."""
    rewards_b = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 0.5])
    records = [make_record(reward=r, group_id=i // 2) for i, r in enumerate(rewards_b)]
    path = RolloutDumper(tmp_path, every=1, max_samples=None, rank=0).write("train", 3, records)
    dumped = [r["reward"] for r in read_dump(path)]
    assert sum(dumped) / len(dumped) == pytest.approx(rewards_b.mean().item())


def test_size_bound_keeps_best_worst_and_is_deterministic(tmp_path):
    rewards = [((i * 37) % 50) / 10 for i in range(50)]
    records = [make_record(reward=r, group_id=i) for i, r in enumerate(rewards)]
    dumper = RolloutDumper(tmp_path, every=1, max_samples=7, rank=0)
    first = read_dump(dumper.write("train", 3, records))
    second = read_dump(dumper.write("train", 3, records))
    assert len(first) == 7 and first == second
    kept = [r["reward"] for r in first]
    assert max(kept) == max(rewards) and min(kept) == min(rewards)
    assert [r["group_id"] for r in first] == sorted(r["group_id"] for r in first)  # original order kept
    assert dumper.select(records) == [records[i] for i in representative_indices(rewards, 7)]
    assert list((tmp_path / "rollouts").iterdir()) == [tmp_path / "rollouts" / "train_step_3.jsonl"]  # no tmp left


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.floats(-5, 5), st.just(float("nan"))), max_size=40), st.integers(1, 12))
def test_representative_indices_properties(rewards, k):
    picked = representative_indices(rewards, k)
    assert len(picked) == min(k, len(rewards))
    assert picked == sorted(set(picked)) and all(0 <= i < len(rewards) for i in picked)
    finite = [r for r in rewards if not math.isnan(r)]
    if finite and k < len(rewards):
        assert max(finite) in [rewards[i] for i in picked]  # the best sample is always kept
    if k >= 2 and rewards:
        key = [(-math.inf if math.isnan(r) else r, i) for i, r in enumerate(rewards)]
        assert min(key)[1] in picked  # and the worst


def test_due_and_ranks(tmp_path):
    dumper = RolloutDumper(tmp_path, every=3, max_samples=4, rank=0)
    assert [s for s in range(10) if dumper.due(s)] == [0, 3, 6, 9]
    assert not RolloutDumper(tmp_path, every=1, max_samples=4, rank=0, enabled=False).due(3)
    assert RolloutDumper(tmp_path, every=1, max_samples=4, rank=0, enabled=False).write("val", 3, []) is None
    other = RolloutDumper(tmp_path / "r1", every=3, max_samples=4, rank=1)
    assert other.due(3)  # the same on every rank ...
    assert other.write("train", 3, [make_record()]) is None and not (tmp_path / "r1").exists()  # ... rank 0 writes
    assert list_dumps(tmp_path, "train") == {}


def test_list_dumps_by_split_and_step(tmp_path):
    dumper = RolloutDumper(tmp_path, every=1, max_samples=None, rank=0)
    for step in (10, 2):
        dumper.write("train", step, [make_record(step=step)])
    dumper.write("val", 0, [make_record(step=0, split="val")])
    assert list(list_dumps(tmp_path, "train")) == [2, 10]
    assert list(list_dumps(tmp_path, "val")) == [0]


@pytest.mark.parametrize("over, field", [
    ({"mask_reason": "tired", "masked": True}, "mask_reason"),
    ({"masked": True}, "mask_reason"),  # masked without a reason
    ({"finish_reason": "eos"}, "finish_reason"),
    ({"split": "val", "advantage": 0.5}, "advantage"),  # validation samples have no advantage
    ({"step": 4}, "step"),  # the record says another step than the file
    ({"turns": 1.0}, "turns"),
    ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
])
def test_schema_errors_name_the_field(tmp_path, over, field):
    dumper = RolloutDumper(tmp_path, every=1, max_samples=None, rank=0)
    rec = make_record(**over)
    with pytest.raises(ValueError, match=field):
        dumper.write(rec["split"], 3, [rec])
    assert not (tmp_path / "rollouts").exists() or not list((tmp_path / "rollouts").iterdir())


def test_missing_or_unknown_keys_are_listed():
    rec = make_record(extra=1)
    del rec["turns"]
    with pytest.raises(ValueError, match=r"missing keys \['turns'\], unknown keys \['extra'\]"):
        check_record(rec)
    with pytest.raises(ValueError, match="split='val', expected 'train', the split being written"):
        check_record(make_record(split="val"), split="train")


@pytest.mark.parametrize("kwargs, key", [({"every": 0, "max_samples": 4}, "logger.dump_rollouts_every"),
                                         ({"every": 1, "max_samples": 0}, "logger.dump_rollouts_max_samples")])
def test_bad_settings_name_the_config_key(tmp_path, kwargs, key):
    with pytest.raises(ValueError, match=key):
        RolloutDumper(tmp_path, rank=0, **kwargs)


def test_wandb_table_has_the_record_columns_and_readable_messages():
    table = wandb_table([make_record(), make_record(reward=float("nan"), reward_components=None)])
    assert table.columns == list(RECORD_KEYS)
    messages = table.data[0][RECORD_KEYS.index("messages")]
    assert messages == render_messages(make_record()["messages"]) and "> 12" in messages and "TRAINED" in messages
    assert json.loads(table.data[0][RECORD_KEYS.index("reward_components")]) == {"correct": 1.0}
    assert math.isnan(table.data[1][RECORD_KEYS.index("reward")])


def test_metrics_logger_logs_rollouts_to_wandb_only_when_on(tmp_path):
    logged = []

    class FakeRun:
        def log(self, data, step):
            logged.append((data, step))

        def finish(self):
            pass

    logger = MetricsLogger(LoggerConfig(log_dir=str(tmp_path), progress_bar=False))
    logger.log_rollouts("train/rollouts", [make_record()], step=3)  # wandb off: nothing, no import needed
    logger._wandb = FakeRun()
    logger.log_rollouts("train/rollouts", [make_record()], step=3)
    logger.close()
    ((data, step),) = logged
    assert step == 3 and data["train/rollouts"].columns == list(RECORD_KEYS)


def test_a_write_the_disk_refuses_leaves_no_file_raises_once_and_turns_the_dumps_off(tmp_path, monkeypatch):
    # issue 25: the loop (grpo.run.run.dump_rollouts) counts and warns about the OSError and goes on training.
    import errno
    import os

    import grpo.system.dumps as dumps

    dumper = RolloutDumper(tmp_path, every=1, max_samples=None, rank=0)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dumps.os, "fsync", full)
    with pytest.raises(OSError):
        dumper.write("train", 1, [make_record(step=1)])
    assert dumper.failed and "No space left" in dumper.failed and list(tmp_path.rglob("*")) == [tmp_path / "rollouts"]
    monkeypatch.setattr(dumps.os, "fsync", os.fsync)
    assert dumper.due(2) and dumper.write("train", 2, [make_record(step=2)]) is None  # off for the rest of the run
    (tmp_path / "blocked").write_text("")  # a file where the directory should be
    other = RolloutDumper(tmp_path / "blocked", every=1, max_samples=None, rank=0)
    with pytest.raises(OSError):
        other.write("val", 0, [make_record(split="val", step=0)])
    assert other.failed is not None


def test_a_step_skipped_for_failures_dumps_without_advantages():
    """A step skipped for failures (grpo.run.step_end.skip_step) dumps its samples before any advantage exists: the failed
    one masked with its reason, the others with no advantage (this crashed the run with dumps on)."""
    from grpo.batch import build_batch
    from grpo.system.dumps import rollout_records
    from grpo.trajectory import Failure, Message, Trajectory

    def traj(i, error=None):
        return Trajectory(0, 0, "t", "q", "a", [Message("user", "q", [1, 2]), Message("assistant", "x", [3], [-0.5])],
                          {}, reward=None if error else 1.0, failure=Failure.of(error, kind="data") if error else None)

    batch = build_batch([traj(0), traj(1, "reward_error")], pad_id=0)
    assert batch.advantages_bt is None
    records = rollout_records(batch.trajectories, "train", 2, batch)
    assert [r["advantage"] for r in records] == [None, None]
    assert [(r["masked"], r["mask_reason"], r["error"]) for r in records] == [
        (False, None, None), (True, "failed", "reward_error")]
