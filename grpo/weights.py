"""Weights out of a ZeRO-3 engine: whole decoder layers gathered a bucket at a time (for refitting a
generation engine) and a consolidated Hugging Face export.

Both are collectives: every rank iterates `iter_gathered_params` to the end and calls `export_hf`.
"""

from __future__ import annotations

import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from grpo.engines import release_params

_LAYER_RE = re.compile(r"\.layers\.(\d+)\.")


def _ds_numel(p: torch.nn.Parameter) -> int:
    return getattr(p, "ds_numel", p.numel())


def _param_groups(named_params) -> list[list]:
    """Consecutive runs of parameters: one group per decoder layer, one per run of non-layer params."""
    groups, last_key = [], None
    for name, p in named_params:
        m = _LAYER_RE.search(name)
        key = int(m.group(1)) if m else None
        if not groups or key != last_key:
            groups.append([])
        groups[-1].append((name, p))
        last_key = key
    return groups


def layer_buckets(named_params, bucket_numel: int) -> list[list]:
    """Pack whole groups (decoder layers; runs of non-layer params) into buckets of <= bucket_numel
    elements (by ``ds_numel``); a group larger than that is a bucket of its own; layer and non-layer
    groups never share a bucket."""
    buckets, size, kind = [], 0, None
    for group in _param_groups(named_params):
        n = sum(_ds_numel(p) for _, p in group)
        is_layer = _LAYER_RE.search(group[0][0]) is not None
        if not buckets or size + n > bucket_numel or is_layer != kind or not is_layer:
            buckets.append([])
            size = 0
        buckets[-1].extend(group)
        size, kind = size + n, is_layer
    return buckets


def iter_gathered_params(engine, bucket_numel: int = 2**28) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield lists of ``(hf_name, full_tensor)``, whole decoder layers per list (see `layer_buckets`).

    A collective: every rank iterates to the end. Tensors are views of the gathered parameters and
    are valid only until the next list is requested (copy or consume them at once).
    """
    import deepspeed

    release_params(engine)
    for bucket in layer_buckets(list(engine.module.named_parameters()), bucket_numel):
        params = [p for _, p in bucket]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield [(name, p.data) for name, p in bucket]


def export_hf(engine, out_dir: str, tokenizer) -> None:
    """Consolidated safetensors + config + tokenizer into ``out_dir`` (all ranks call; rank 0 writes).

    Atomic: written to a temporary sibling directory, then renamed over ``out_dir``.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    if engine.zero_optimization_stage() == 3:
        release_params(engine)
        state_dict = engine._zero3_consolidated_16bit_state_dict()  # collective; full dict on rank 0
    else:
        state_dict = engine.module.state_dict() if rank == 0 else None
    if rank == 0:
        out = Path(out_dir)
        tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
        out.parent.mkdir(parents=True, exist_ok=True)
        engine.module.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)  # empties the dict
        tokenizer.save_pretrained(tmp)
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
