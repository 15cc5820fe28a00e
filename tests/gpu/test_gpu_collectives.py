"""GPU only: grpo's collectives on a real NCCL process group (one rank): the step's counts and flags, the run's
object gathers, and the vLLM tensor-parallel group, a gloo subgroup of the NCCL world whose host-side lockstep
all-reduce crashed on NCCL before (issue 21; its CPU twin runs under tests/helpers/device_rules.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_step_and_run_collectives_on_nccl(nccl_group):
    import torch.distributed as dist

    from grpo import metrics
    from grpo.system.dist import all_gather_objects, any_rank

    assert dist.get_backend() == "nccl"
    assert any_rank(True) and not any_rank(False)
    tokens, seqs = metrics.global_valid_counts(torch.ones(2, 3), torch.ones(2))  # host masks
    assert (float(tokens), float(seqs)) == (6.0, 2.0)
    assert all_gather_objects([("a", 1)]) == [("a", 1)]


def test_tensor_parallel_lockstep_and_gather_on_an_nccl_world(nccl_group):
    import torch.distributed as dist

    from grpo.system.generation.vllm import VllmGeneration, generate_in_group

    gen = VllmGeneration.__new__(VllmGeneration)
    gen.tp, gen.world_size = 1, dist.get_world_size()
    group = gen._make_tp_group(dist)
    gen._tp_group = group
    assert dist.get_backend(group) == "gloo"
    assert gen.lockstep_max(5) == 5
    out = generate_in_group([[1, 2]], [7], group, lambda p, s: [f"{x}/{y}" for x, y in zip(p, s)])
    assert out == ["[1, 2]/7"]
