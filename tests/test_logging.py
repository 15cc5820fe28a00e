"""grpo.logging: metrics.jsonl rows and the optional gpu/* columns (logger.monitor_gpus)."""

from __future__ import annotations

import pytest
import torch

from grpo.config import LoggerConfig
from grpo.logging import MetricsLogger, read_metrics


def _log_one_row(tmp_path, **cfg) -> dict:
    logger = MetricsLogger(LoggerConfig(log_dir=str(tmp_path), progress_bar=False, **cfg))
    logger.log({"train/loss": torch.tensor(0.5), "train/kl": float("nan")}, step=3)
    logger.close()
    (row,) = read_metrics(tmp_path)
    return row


def test_rows_are_flat_json_with_step_and_non_finite_as_null(tmp_path):
    row = _log_one_row(tmp_path)
    assert row["step"] == 3 and row["train/loss"] == 0.5 and row["train/kl"] is None
    assert not any(k.startswith("gpu/") for k in row)


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
