"""Memory metrics: device-wide used / free memory from ``torch.cuda.mem_get_info`` (gpu/*, memory/*), per-phase
peaks, and the vLLM backend's ``memory/*_gb``. CUDA is replaced by stand-ins; without them everything is empty."""

from __future__ import annotations

import pytest
import torch

from grpo.system.generation.vllm import memory_gb
from grpo.system.tracking import cuda_device_memory, device_memory_gb, gpu_metrics, phase_memory

GIB = 2**30


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA device of 80 GiB with ``state["free"]`` free and ``state["peak"]`` allocated at the peak."""
    state = {"free": 30 * GIB, "peak": 7 * GIB, "resets": 0, "syncs": 0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (state["free"], 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 2 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 3 * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: state["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda *a: state.__setitem__("resets", state["resets"] + 1))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: state.__setitem__("syncs", state["syncs"] + 1))
    monkeypatch.setattr(torch.cuda, "utilization", lambda *a: 55)
    return state


def test_device_memory_is_total_minus_free():
    assert device_memory_gb(free_bytes=0, total_bytes=GIB) == {"used_gb": 1.0, "free_gb": 0.0, "total_gb": 1.0}
    used = device_memory_gb(free_bytes=int(1.5 * GIB), total_bytes=4 * GIB)["used_gb"]
    assert used == pytest.approx(2.5)


def test_without_cuda_there_is_nothing_to_report():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert cuda_device_memory() == {} and gpu_metrics() == {}
    out = {}
    with phase_memory("train", out):
        pass
    assert out == {}
    assert 0 < memory_gb() < 64  # the process's resident memory instead


def test_with_cuda_memory_comes_from_mem_get_info(fake_cuda):
    assert cuda_device_memory() == {"used_gb": 50.0, "free_gb": 30.0, "total_gb": 80.0}
    assert memory_gb() == 50.0  # vLLM's memory/after_sleep_gb etc.: not memory_reserved() (3 GiB)
    fake_cuda["free"] = 75 * GIB  # vLLM asleep: its pools are released, which only mem_get_info sees
    assert memory_gb() == 5.0
    row = gpu_metrics()
    assert row["gpu/device_used_gib"] == 5.0 and row["gpu/device_free_gib"] == 75.0
    assert row["gpu/memory_reserved_gib"] == 3.0 and row["gpu/utilization_pct"] == 55.0


def test_phase_memory_records_the_peak_and_the_used_memory_at_the_end(fake_cuda):
    out = {"train/loss": 1.0}
    with phase_memory("generation", out):
        fake_cuda["peak"] = 9 * GIB
        fake_cuda["free"] = 20 * GIB
    assert out == {"train/loss": 1.0, "memory/generation_peak_gb": 9.0, "memory/generation_used_gb": 60.0}
    assert fake_cuda["resets"] == 1 and fake_cuda["syncs"] == 2
    with pytest.raises(ValueError), phase_memory("train", out):  # recorded even when the phase fails
        raise ValueError("boom")
    assert out["memory/train_peak_gb"] == 9.0
