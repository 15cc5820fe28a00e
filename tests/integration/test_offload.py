"""grpo/system/offload.py on the CPU: the optimizer states of every engine the runs build (no ZeRO, ZeRO-1 in bf16 =
DeepSpeed's BF16_Optimizer, ZeRO-1/3) go off and come back with training unchanged, and a checkpoint saved while
they are off (validation and saving run between the refit and the next sleep) holds the true states."""

from __future__ import annotations

import pytest
import torch

from grpo.system import engines, offload, weights
from grpo.system.dist import init_distributed
from grpo.system.training import train_on_batch
from grpo.tasks.toy import save_tiny_model
from tests.helpers.batches import train_batch
from tests.integration.test_engines import make_cfg


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny")), seed=3)


@pytest.fixture(scope="module")
def dist_group():
    init_distributed()


IDS = torch.randint(3, 80, (2, 7), generator=torch.Generator().manual_seed(5))


def step(engine) -> dict:
    mbs = [train_batch(input_ids_bt=IDS, attention_mask_bt=torch.ones_like(IDS))]
    return train_on_batch(engine, mbs, lambda lp, mb: (-(lp.float() ** 2).sum() / 12, {}))


def build(model_dir, **policy):
    cfg = make_cfg(model_dir, train_global_batch_size=2, optimizer={"lr": 1e-2}, **policy)
    return engines.build_policy_engine(cfg, 1, total_optimizer_steps=6)


def full_weights(engine) -> dict:
    return {n: t.float().clone() for b in weights.iter_gathered_params(engine) for n, t in b}


def test_bf16_zero1_offload_parks_the_states_and_training_goes_on_unchanged(model_dir, dist_group):
    """Issue 21, bug 2: one rank in bf16 gets zero1.json, DeepSpeed builds BF16_Optimizer (no offload_states),
    and offload_optimizer_during_generation raised AttributeError at the first refit."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    engine, twin = (build(model_dir, precision="bfloat16", deepspeed_config="auto") for _ in range(2))
    assert isinstance(engine.optimizer, BF16_Optimizer) and not offload.has_own_offload(engine)
    assert step(engine) == step(twin)
    tensors = offload.bf16_optimizer_tensors(engine)
    opt = engine.optimizer
    n = sum(p.numel() for p in engine.module.parameters())
    # the fp32 masters, the fp32 gradient buffer, Adam's two moments (and bf16 gradients, None between steps here)
    assert len(tensors) == 4 + sum(p.grad is not None for g in opt.bf16_groups for p in g)
    assert opt.fp32_groups_flat_partition[0].numel() >= n and opt.fp32_groups_gradients_flat[0].dtype == torch.float32
    before = [t.clone() for t in tensors]
    moved = []
    for _ in range(2):  # the second round reuses the first one's host buffers
        again = offload.offload_optimizer_states(engine, moved)
        assert len(again) == len(tensors) and all(t.untyped_storage().nbytes() == 0 for t in tensors)
        if moved:
            assert [b.data_ptr() for _, _, b in again] == [b.data_ptr() for _, _, b in moved]
        moved = again
        offload.reload_optimizer_states(engine, moved)
        assert all(torch.equal(t, b) for t, b in zip(tensors, before))
    assert [step(engine) for _ in range(2)] == [step(twin) for _ in range(2)]
    got, want = full_weights(engine), full_weights(twin)
    assert all(torch.equal(got[k], want[k]) for k in want)


def _same(a, b, where="") -> list[str]:
    """Where two loaded checkpoints differ (tensors compared exactly, on the CPU)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a.cpu(), b.cpu())
        return [] if ok else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in _same(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: lengths {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _same(x, y, f"{where}[{i}]")]
    return []  # other values (versions, mappings) are not states


@pytest.mark.parametrize("policy", [
    {"precision": "bfloat16", "deepspeed_config": "auto"},         # ZeRO-1 -> BF16_Optimizer: parked in place
    {"precision": "float32", "deepspeed_config": "auto"},          # no ZeRO
    {"precision": "float32", "deepspeed_config": "ds_configs/zero1.json"},
    {"precision": "float32", "deepspeed_config": "ds_configs/zero3.json"},
], ids=["bf16-zero1", "fp32-zero0", "fp32-zero1", "fp32-zero3"])
def test_a_checkpoint_saved_while_the_states_are_offloaded_holds_the_true_states(model_dir, dist_group, tmp_path,
                                                                                  policy):
    engine, twin = (build(model_dir, **policy) for _ in range(2))
    step(engine), step(twin)
    moved = offload.offload_optimizer_states(engine)
    engine.save_checkpoint(str(tmp_path / "offloaded"), tag="t")
    twin.save_checkpoint(str(tmp_path / "resident"), tag="t")
    assert all(t.untyped_storage().nbytes() == 0 for t, device, _ in moved if t.device == device)  # still off
    files = sorted(p.name for p in (tmp_path / "resident" / "t").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "offloaded" / "t").iterdir())
    for name in files:
        a, b = (torch.load(tmp_path / d / "t" / name, weights_only=False) for d in ("offloaded", "resident"))
        assert _same(a, b, name) == []
    offload.reload_optimizer_states(engine, moved)
    assert "save_checkpoint" not in engine.__dict__
    assert step(engine) == step(twin)
