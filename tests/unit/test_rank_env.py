"""Variables every rank must agree on (grpo.system.dist.RANK_AGREED_ENV): compared through the launch's store before
any NCCL call, and VLLM_BATCH_INVARIANT's NCCL settings applied on every rank when generation has ranks of its own."""

import json
import sys
import types

import pytest
import torch.distributed as dist

from grpo.system.dist import EnvMismatch, check_env_agrees, pin_batch_invariant_nccl


def test_ranks_that_agree_pass_and_one_that_differs_is_named(monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    monkeypatch.setenv("NCCL_PROTO", "Simple")
    store = dist.HashStore()
    store.set("grpo_agreed_env/1", json.dumps({"VLLM_BATCH_INVARIANT": "1", "NCCL_PROTO": "Simple"}))
    store.set("grpo_agreed_env_read/1", "1")
    check_env_agrees(store, 0, 2)
    other = dist.HashStore()
    other.set("grpo_agreed_env/1", json.dumps({"NCCL_PROTO": "LL"}))
    other.set("grpo_agreed_env_read/1", "1")
    with pytest.raises(EnvMismatch, match=r"VLLM_BATCH_INVARIANT differs between ranks: 1 on ranks \[0\], unset on "
                                          r"ranks \[1\]; NCCL_PROTO differs between ranks: Simple on ranks \[0\], LL"):
        check_env_agrees(other, 0, 2)


def test_batch_invariance_sets_vllms_nccl_variables_on_every_rank(monkeypatch):
    """On CUDA with VLLM_BATCH_INVARIANT=1 the trainers set what vLLM's override_envs_for_invariance sets (here a
    stand-in vLLM module: the CPU has no NCCL); without CUDA, or without the variable, nothing is touched."""
    calls = []
    fake = types.ModuleType("vllm.model_executor.determinism.batch_invariant")
    fake.override_envs_for_invariance = lambda: calls.append("pinned")
    monkeypatch.setitem(sys.modules, "vllm.model_executor.determinism.batch_invariant", fake)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    pin_batch_invariant_nccl()
    assert calls == []
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    pin_batch_invariant_nccl()
    assert calls == ["pinned"]
    monkeypatch.setitem(sys.modules, "vllm.model_executor.determinism.batch_invariant", None)  # not importable
    with pytest.raises(EnvMismatch, match="vLLM cannot be imported here"):
        pin_batch_invariant_nccl()
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    pin_batch_invariant_nccl()  # no CUDA, no NCCL: nothing to pin
