"""The policy's optimizer states off the accelerator while a colocated generation engine (vLLM) holds it.

    moved = offload_optimizer_states(engine)        # before generating
    reload_optimizer_states(engine, moved)          # before training

Between the two, ``engine.save_checkpoint`` still writes the true states (validation and checkpoints run
while vLLM holds the accelerator): tensors moved by replacing ``.data`` are host tensors then, and tensors
parked in place (`park`: BF16_Optimizer's) are shown from their host copies for the duration of the save.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

# torch.optim.AdamW stays the optimizer: ZeRO-3's own `engine.offload_states` asserts DeepSpeed's
# FusedAdam for the master weights and Adam moments (deepspeed 0.19.8 runtime/zero/stage3.py), whose
# op needs nvcc, ninja and a minutes-long JIT build; moving those tensors needs nothing of FusedAdam.
Moved = list[tuple[torch.Tensor, torch.device, torch.Tensor]]  # (tensor, its device, host buffer)


def optimizer_state_tensors(engine) -> list[torch.Tensor]:
    """What the optimizer holds besides the model: under ZeRO-3 the fp32 master partitions (unless
    DeepSpeed reuses the model's own fp32 partitions as masters), and every non-scalar optimizer state
    (Adam's exp_avg and exp_avg_sq; without ZeRO, the only ones). Moving one means replacing its ``.data``:
    these are the optimizer's objects."""
    if engine.zero_optimization_stage() == 0:
        return [v for state in engine.optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0]
    zero = engine.optimizer
    model_parts = {id(t) for t in zero.fp16_partitioned_groups_flat}
    masters = [t for t in zero.fp32_partitioned_groups_flat if id(t) not in model_parts]
    moments = [v for state in zero.optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0]
    return masters + moments


def has_own_offload(engine) -> bool:
    """Whether DeepSpeed's optimizer defines ``offload_states`` (ZeRO-1/2's and ZeRO-3's do; BF16_Optimizer,
    which one rank in bf16 with fp32 gradient accumulation gets under ZeRO-1, does not)."""
    return hasattr(engine.optimizer, "offload_states")


def bf16_optimizer_tensors(engine) -> list[torch.Tensor]:
    """What DeepSpeed's BF16_Optimizer (ZeRO-1 in bf16 with fp32 gradient accumulation) holds besides the bf16
    model: the fp32 master partitions, the flat fp32 gradient-accumulation buffers, the bf16 gradients and the
    inner optimizer's non-scalar states (Adam's moments). The masters and buffers are viewed by per-parameter
    tensors (gradient views, the ``_hp_mapping`` fragments), so they are parked in place, never replaced."""
    opt = engine.optimizer
    lp_grads = [p.grad for group in opt.bf16_groups for p in group if p.grad is not None]
    moments = [v for state in opt.optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0]
    return [*opt.fp32_groups_flat_partition, *opt.fp32_groups_gradients_flat, *lp_grads, *moments]


def park(tensors: list[torch.Tensor], previous: "Moved | None" = None, pin: bool = False) -> "Moved":
    """Copy each tensor into a host buffer (those of ``previous`` are reused) and free its storage in place
    (``untyped_storage().resize_(0)``): the tensor object, its views and their offsets stay valid, and
    `unpark` gives the storage back with the same contents. On the CPU it frees and restores host memory the
    same way (what the CPU tests check). Each must own its whole storage (a view of part of a storage cannot free it)."""
    reuse = {id(t): buf for t, _, buf in previous or []}
    moved: Moved = []
    for t in tensors:
        if t.numel() == 0 or t.untyped_storage().nbytes() == 0:
            continue
        if t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            raise ValueError(f"park: a tensor of shape {tuple(t.shape)} does not own its whole storage")
        buf = reuse.get(id(t))
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty_like(t, device="cpu", pin_memory=pin)
        buf.copy_(t)
        moved.append((t, t.device, buf))
    for t, _, _ in moved:
        t.untyped_storage().resize_(0)
    return moved


def unpark(moved: "Moved") -> None:
    """Undo `park` (and the ``.data`` moves of `offload_optimizer_states`)."""
    with torch.no_grad():  # masters are leaves that require grad
        for t, device, buf in moved:
            if t.device == device and t.untyped_storage().nbytes() == 0:  # parked in place
                t.untyped_storage().resize_(buf.numel() * buf.element_size())
                t.copy_(buf)
            else:
                t.data = buf.to(device)


@contextmanager
def host_data(moved: "Moved") -> Iterator[None]:
    """Within the block, every parked tensor of ``moved`` holds its host copy (``.data`` points there), so
    whatever reads it (a checkpoint save) reads the true values; afterwards it is parked again (its freed
    storage and views untouched)."""
    parked = [(t, t.data, buf) for t, device, buf in moved if t.device == device and t.untyped_storage().nbytes() == 0]
    for t, _, buf in parked:
        t.data = buf
    try:
        yield
    finally:
        for t, original, _ in parked:
            t.data = original


def _zero_offload_configured(engine) -> bool:
    """ZeRO's own CPU/NVMe offload keeps the optimizer off the accelerator already."""
    return any(c is not None and c.device != "none" for c in (engine.zero_offload_optimizer(),
                                                                engine.zero_offload_param()))


def offload_optimizer_states(engine, previous: Moved | None = None) -> Moved:
    """Move the optimizer's accelerator memory to (pinned) host memory; undo with
    `reload_optimizer_states`. A collective-free, per-rank operation.

    ZeRO-3: `optimizer_state_tensors` are copied into host buffers (those of ``previous``, the
    value of the last call, are reused) and DeepSpeed's `offload_states` takes the gradient
    partitions and buckets. ZeRO-1/2: DeepSpeed's `offload_states` for all four (it accepts any
    optimizer there). BF16_Optimizer (ZeRO-1 in bf16 with fp32 gradient accumulation: one rank in bf16
    under ``deepspeed_config: auto``) has no `offload_states`: `bf16_optimizer_tensors` are parked in place
    (`park`), and until the reload ``engine.save_checkpoint`` saves them from their host copies. No ZeRO: the Adam moments, as under ZeRO-3 (gradients are None between steps).
    Nothing to do under ZeRO's own optimizer/parameter offload. Returns what moved, for
    `reload_optimizer_states`.
    """
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

    stage = engine.zero_optimization_stage()
    if stage > 0 and _zero_offload_configured(engine):
        return []
    pin = torch.cuda.is_available()
    if stage > 0 and not has_own_offload(engine):  # BF16_Optimizer
        moved = park(bf16_optimizer_tensors(engine), previous, pin)
        _save_from_host(engine, moved)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return moved
    if stage in (1, 2):
        engine.offload_states(include=[S.optim_states, S.hp_params, S.lp_grads, S.contiguous_grad_buffer],
                              pin_memory=pin)
        return []
    if stage == 3:
        engine.offload_states(include=[S.lp_grads, S.contiguous_grad_buffer], pin_memory=pin)
    reuse = {id(t): buf for t, _, buf in previous or []}
    moved: Moved = []
    for t in optimizer_state_tensors(engine):
        if t.device.type == "cpu":
            continue
        buf = reuse.get(id(t))
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty_like(t, device="cpu", pin_memory=pin)
        buf.copy_(t)
        moved.append((t, t.device, buf))
        t.data = buf
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return moved


def reload_optimizer_states(engine, moved: Moved) -> None:
    """Undo `offload_optimizer_states` (``moved`` is its return value; keep it for the next call)."""
    stage = engine.zero_optimization_stage()
    if stage > 0 and _zero_offload_configured(engine):
        return
    engine.__dict__.pop("save_checkpoint", None)  # `_save_from_host`'s wrapper
    unpark(moved)
    if stage > 0 and has_own_offload(engine):
        engine.reload_states()


def _save_from_host(engine, moved: Moved) -> None:
    """Until `reload_optimizer_states`, ``engine.save_checkpoint`` saves the parked tensors from their host
    copies (a save reads ``.data``; a parked tensor has no storage)."""
    save = type(engine).save_checkpoint

    def save_checkpoint(*args, **kwargs):
        with host_data(moved):
            return save(engine, *args, **kwargs)

    engine.__dict__["save_checkpoint"] = save_checkpoint
