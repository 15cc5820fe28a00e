"""GPU only: the weight bridge's NCCL path in one process (a smoke test: one GPU cannot hold two NCCL ranks). The
weight group is a real ``ProcessGroupNCCL`` built over a prefix of a store, a device tensor broadcast through it
arrives, the acknowledgment synchronises the device, and aborting the group (what a failed bridge does) works."""

import datetime

import torch
import torch.distributed as dist

from grpo.system.bridge import Bridge


def test_one_process_nccl_weight_broadcast():
    store = dist.HashStore()
    device = torch.device("cuda", torch.cuda.current_device())
    bridge = Bridge(store, 0, 1, timeout_s=60, device=device)
    assert type(bridge.tensors).__name__ == "ProcessGroupNCCL"
    weights = torch.arange(1 << 20, dtype=torch.bfloat16, device=device)
    got = bridge.broadcast(weights.clone())
    torch.cuda.current_stream(device).synchronize()
    assert torch.equal(got, weights)
    bridge.wait_acknowledged()  # no generation rank: nothing to wait for, and nothing raised
    bridge._abort_tensors()  # what a failed bridge does: ends the group's pending work
    bridge.close()
    assert datetime.timedelta(seconds=bridge.timeout_s) == datetime.timedelta(seconds=60)
