"""grpo.system.tracking: metrics.jsonl rows (non-finite values as strings), truncation on resume, and the optional gpu/*
columns (logger.monitor_gpus)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from grpo.config import LoggerConfig
from grpo.system.tracking import MetricsLogger, read_metrics, truncate_metrics


def _log_one_row(tmp_path, **cfg) -> dict:
    logger = MetricsLogger(LoggerConfig(log_dir=str(tmp_path), progress_bar=False, **cfg))
    logger.log({"train/loss": torch.tensor(0.5), "train/kl": float("nan")}, step=3)
    logger.close()
    (row,) = read_metrics(tmp_path)
    return row


def test_rows_are_flat_json_with_step_and_non_finite_as_strings(tmp_path):
    row = _log_one_row(tmp_path)
    assert row["step"] == 3 and row["train/loss"] == 0.5 and math.isnan(row["train/kl"])
    assert not any(k.startswith("gpu/") for k in row)


def test_non_finite_values_are_strings_in_the_file_and_floats_when_read(tmp_path):
    logger = MetricsLogger(LoggerConfig(log_dir=str(tmp_path), progress_bar=False))
    logger.log({"train/loss": torch.tensor(float("nan")), "train/grad_norm": float("inf"),
                "train/reward_min": torch.tensor(-1e39, dtype=torch.float64).float(), "train/hist": [1.0, float("nan")],
                "train/ok": 1.5}, step=1)
    logger.close()
    raw = json.loads((tmp_path / "metrics.jsonl").read_text())  # strict JSON: no NaN / Infinity literals, no null
    assert (raw["train/loss"], raw["train/grad_norm"], raw["train/reward_min"], raw["train/hist"]) == \
        ("nan", "inf", "-inf", [1.0, "nan"])
    (row,) = read_metrics(tmp_path)
    assert math.isnan(row["train/loss"]) and row["train/grad_norm"] == math.inf and row["train/reward_min"] == -math.inf
    assert row["train/hist"][0] == 1.0 and math.isnan(row["train/hist"][1]) and row["train/ok"] == 1.5


def test_truncate_metrics_keeps_each_step_once_after_a_resume(tmp_path):
    logger = MetricsLogger(LoggerConfig(log_dir=str(tmp_path), progress_bar=False))
    for step in range(1, 6):  # the killed run got to step 5; its last checkpoint is step 3
        logger.log({"train/loss": float(step)}, step)
    logger.log({"val/reward_mean": 0.5}, 3)
    logger.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "train/lo')  # killed mid-write
    assert truncate_metrics(tmp_path, after_step=3) == 3
    resumed = MetricsLogger(LoggerConfig(log_dir=str(tmp_path), progress_bar=False))
    for step in (4, 5):
        resumed.log({"train/loss": 10.0 + step}, step)
    resumed.close()
    rows = read_metrics(tmp_path)
    assert [(r["step"], r.get("train/loss")) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (3, None), (4, 14.0),
                                                                (5, 15.0)]
    assert truncate_metrics(tmp_path, after_step=5) == 0 and truncate_metrics(tmp_path / "none", 0) == 0
    assert not list(tmp_path.glob("*.tmp"))


def test_monitor_gpus_adds_memory_columns_on_cuda_and_nothing_without(tmp_path, monkeypatch):
    assert "gpu/memory_allocated_gib" not in _log_one_row(tmp_path / "cpu", monitor_gpus=True)
    resets = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 2 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 4 * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: resets.append(1))
    monkeypatch.setattr(torch.cuda, "utilization", lambda: (_ for _ in ()).throw(ModuleNotFoundError("pynvml")))
    row = _log_one_row(tmp_path / "cuda", monitor_gpus=True)
    assert (row["gpu/memory_allocated_gib"], row["gpu/memory_reserved_gib"], row["gpu/peak_memory_allocated_gib"]) \
        == pytest.approx((2.0, 3.0, 4.0))
    assert "gpu/utilization_pct" not in row and resets == [1]  # the peak is per logged row


# ---- issue 25: a log disk that refuses writes, another run's metrics in the log directory ---------------
def test_a_failed_metrics_write_is_cut_off_counted_and_warned_once_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    import errno
    import os

    import grpo.system.tracking as tracking

    logger = MetricsLogger(LoggerConfig(log_dir=str(tmp_path), progress_bar=False))
    logger.log({"train/loss": 1.0}, 1)
    real_write, full = os.write, {"on": True}

    def disk_full(fd, data):  # half a row reaches the disk, then it is full (what a real ENOSPC does)
        if not full["on"]:
            return real_write(fd, data)
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tracking.os, "write", disk_full)
    logger.log({"train/loss": 2.0}, 2)  # no exception: the run goes on
    logger.log({"train/loss": 3.0}, 3)
    full["on"] = False
    logger.log({"train/loss": 4.0}, 4)
    logger.close()
    out = capsys.readouterr().out
    assert out.count("warning: could not write step") == 1 and "No space left" in out and "GiB free" in out
    rows = read_metrics(tmp_path)  # every line parses: the half rows were cut off
    assert [r["step"] for r in rows] == [1, 4] and rows[1]["logger/metrics_write_failures"] == 2


def test_claim_metrics_truncates_only_this_runs_resume_and_keeps_another_runs_file(tmp_path):
    from grpo.system.tracking import claim_metrics

    def log(steps):
        logger = MetricsLogger(LoggerConfig(log_dir=str(tmp_path), progress_bar=False))
        for s in steps:
            logger.log({"train/loss": float(s)}, s)
        logger.close()

    assert claim_metrics(tmp_path, "run-a", 0, resumed=False) is None  # a new directory
    log([1, 2, 3])
    assert "1 rows of this run past step 2" in claim_metrics(tmp_path, "run-a", 2, resumed=True)  # run a resumes
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    note = claim_metrics(tmp_path, "run-b", 0, resumed=False)  # the same command, a fresh checkpoint directory
    assert "kept as" in note and "metrics.run-a.jsonl" in note
    kept = [json.loads(line)["step"] for line in (tmp_path / "metrics.run-a.jsonl").read_text().splitlines()]
    assert kept == [1, 2] and not (tmp_path / "metrics.jsonl").exists()
    log([1, 2])
    assert "2 rows of this run past step 0" in claim_metrics(tmp_path, "run-b", 0, resumed=False)  # killed unsaved
    assert not (tmp_path / "metrics.jsonl").read_text()
    log([1])
    note = claim_metrics(tmp_path, "run-b", 0, resumed=False, checkpointed=False)  # nothing says it is this run
    assert "metrics.run-b.jsonl" in note and (tmp_path / "metrics.run-b.jsonl").exists()
    log([1])
    assert "metrics.run-b.1.jsonl" in claim_metrics(tmp_path, "run-c", 5, resumed=True)  # run c resumes: not its file
    assert (tmp_path / "metrics.run_id").read_text().strip() == "run-c"


def test_printed_samples_show_a_failed_sample_s_failure_not_a_reward(tmp_path, capsys):
    from grpo.trajectory import Failure, Message, Trajectory

    logger = MetricsLogger(LoggerConfig(log_dir=str(tmp_path), progress_bar=False))
    ok = Trajectory(0, 0, "t", "1+1=", "2", [Message("user", "1+1=", [1]), Message("assistant", "2", [2], [0.0])], {},
                    reward=1.0, turns=1, num_prompt_messages=1)
    failed = Trajectory(0, 1, "t", "1+2=", "3", [Message("user", "1+2=", [1])], {}, num_prompt_messages=1)
    failed.fail(Failure.of("reward_timeout", "no score within 5 s"))
    logger.print_samples([ok, failed], 2)
    out = capsys.readouterr().out
    assert "(gold '2', reward 1)" in out and "(gold '3', failed: reward_timeout (infra))" in out
