"""The policy's optimizer states off the accelerator while a colocated generation engine (vLLM) holds it.

    moved = offload_optimizer_states(engine)        # before generating
    reload_optimizer_states(engine, moved)          # before training
"""

from __future__ import annotations

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
    optimizer there). No ZeRO: the Adam moments, as under ZeRO-3 (gradients are None between steps).
    Nothing to do under ZeRO's own optimizer/parameter offload. Returns what moved, for
    `reload_optimizer_states`.
    """
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

    stage = engine.zero_optimization_stage()
    if stage > 0 and _zero_offload_configured(engine):
        return []
    pin = torch.cuda.is_available()
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
    for t, device, buf in moved:
        t.data = buf.to(device)
    if stage > 0:
        engine.reload_states()
