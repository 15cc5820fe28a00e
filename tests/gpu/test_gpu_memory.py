"""GPU only: the memory metrics on a real device (torch.cuda.mem_get_info, per-phase peaks, vLLM's memory/*_gb)."""

from __future__ import annotations

import pytest
import torch

from grpo.system.generation.vllm import memory_gb
from grpo.system.tracking import cuda_device_memory, gpu_metrics, phase_memory

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
GIB = 2**30


def test_device_memory_sees_an_allocation_and_adds_up():
    total = torch.cuda.get_device_properties(0).total_memory / GIB
    before = cuda_device_memory()
    x = torch.empty(GIB // 2, dtype=torch.uint8, device="cuda")
    after = cuda_device_memory()
    assert after["used_gb"] - before["used_gb"] >= 0.49
    assert after["used_gb"] + after["free_gb"] == pytest.approx(total, rel=1e-3)
    assert memory_gb() == pytest.approx(cuda_device_memory()["used_gb"], abs=0.01)
    assert memory_gb() >= torch.cuda.memory_reserved() / GIB  # the device's view includes torch's cache
    del x


def test_phase_memory_and_gpu_metrics():
    out = {}
    with phase_memory("train", out):
        y = torch.ones(GIB // 4, dtype=torch.float32, device="cuda")  # 1 GiB
        del y
    assert out["memory/train_peak_gb"] >= 1.0 and 0 < out["memory/train_used_gb"]
    total = torch.cuda.get_device_properties(0).total_memory / GIB
    z = torch.ones(GIB // 8, dtype=torch.float32, device="cuda")  # 0.5 GiB held while the gauges are read
    row = gpu_metrics()
    assert row["gpu/memory_allocated_gib"] >= 0.5  # the tensor held now
    assert row["gpu/memory_reserved_gib"] >= row["gpu/memory_allocated_gib"]  # torch's cache holds what it hands out
    assert row["gpu/peak_memory_allocated_gib"] >= row["gpu/memory_allocated_gib"]  # the peak includes now
    assert row["gpu/device_used_gib"] >= row["gpu/memory_reserved_gib"]
    assert row["gpu/device_used_gib"] + row["gpu/device_free_gib"] == pytest.approx(total, rel=1e-3)
    del z
