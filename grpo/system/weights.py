"""Weights out of a ZeRO-3 engine: whole decoder layers gathered a bucket at a time (for refitting a
generation engine) and a consolidated Hugging Face export; for a LoRA policy, its adapters alone
(`adapter_state_dict`, `peft_config_dict`, `export_adapter`) and the merged export.

Both are collectives: every rank iterates `iter_gathered_params` to the end and calls `export_hf`. An export never
deletes what the run did not write (see `export_hf`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from grpo.system.engines import is_lora, release_params
from grpo.system.dist import any_rank
from grpo.system.vision import save_processor

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


def iter_gathered_params(engine, bucket_numel: int = 2**28, trainable_only: bool = False,
                         ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield lists of ``(hf_name, full_tensor)``, whole decoder layers per list (see `layer_buckets`);
    ``trainable_only``: only the parameters that require grad (a LoRA run's adapters).

    A collective: every rank iterates to the end. Tensors are views of the gathered parameters and
    are valid only until the next list is requested (copy or consume them at once).
    """
    import deepspeed

    release_params(engine)
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad or not trainable_only]
    for bucket in layer_buckets(named, bucket_numel):
        params = [p for _, p in bucket]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield [(name, p.data) for name, p in bucket]


EXPORT_MARKER = ".grpo_export.json"


class ExportError(RuntimeError):
    """An export directory this run may not write into; the message names it and says what to do."""


def _earlier_export(out: Path) -> dict | None:
    try:
        marker = json.loads((out / EXPORT_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("files"), list) else None


def export_refusal(out_dir: str | os.PathLike, run_id: str | None, overwrite: bool = False) -> str | None:
    """Why ``out_dir`` may not receive an export of run ``run_id``, or None. Fine: a missing or empty directory,
    an earlier export of the same run (its marker holds the run id), or any directory with ``overwrite``.

    >>> export_refusal("/nonexistent/dir", run_id=None) is None
    True
    """
    out = Path(out_dir)
    if overwrite or not out.exists():
        return None
    if not out.is_dir():
        return f"{out} is a file, not a directory"
    if not any(out.iterdir()):
        return None
    marker = _earlier_export(out)
    if marker is not None and run_id is not None and marker.get("run_id") == run_id:
        return None
    whose = "an export of another run" if marker is not None else "not an export of this run"
    return (f"{out} is not empty and is {whose}: exporting there would replace files this run did not write. "
            "Choose a new or empty directory, or ask for it explicitly (--export-hf-overwrite); even then only "
            "files of the names an export writes are replaced")


def _install(tmp: Path, out: Path, marker: dict | None) -> None:
    """Move the export in ``tmp`` into ``out``, deleting nothing this run did not write (``marker``: that of an
    earlier export of this run in ``out``, listing what it wrote; None otherwise).

    ``out`` missing or empty, or holding only an earlier export of this run: one rename (the earlier export is
    removed after). Otherwise (``overwrite`` into a directory with other files): file by file, each replacing
    a file of the same name; files of an earlier export of this run that the new one lacks are removed.
    """
    ours = set(marker["files"]) | {EXPORT_MARKER} if marker is not None else set()
    present = {p.relative_to(out).as_posix() for p in out.rglob("*") if not p.is_dir()} if out.exists() else set()
    if out.exists() and present <= ours:
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
        return
    (out / EXPORT_MARKER).unlink(missing_ok=True)  # until the last file is in, this is no export of the run
    new = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if not p.is_dir() and p.name != EXPORT_MARKER)
    for rel in sorted(ours - set(new) - {EXPORT_MARKER}):
        (out / rel).unlink(missing_ok=True)
    for rel in new + [EXPORT_MARKER]:  # the marker last
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp / rel, out / rel)


def export_hf(engine, out_dir: str, tokenizer, overwrite: bool = False, run_id: str | None = None) -> None:
    """Consolidated safetensors + config + tokenizer into ``out_dir`` (all ranks call; rank 0 writes).

    Never deletes what the run did not write: a non-empty ``out_dir`` that is not an earlier export of run
    ``run_id`` (the ``.grpo_export.json`` marker each export writes, listing its files) raises `ExportError` on
    every rank before anything is gathered, unless ``overwrite``; even then only files of the same names are
    replaced. Written to a temporary sibling directory first, then moved in (`_install`). A LoRA policy exports
    its merged weights (`merged_lora_state_dict`): a plain checkpoint that ``from_pretrained`` loads without peft.
    A vision-language model's export holds its processor too (`grpo.system.vision.save_processor`).
    """
    rank = _check_export_dir(out_dir, run_id, overwrite)
    if engine.zero_optimization_stage() == 3:
        release_params(engine)
        state_dict = engine._zero3_consolidated_16bit_state_dict()  # collective; full dict on rank 0
    else:
        state_dict = engine.module.state_dict() if rank == 0 else None
    if rank == 0:
        model = engine.module
        if is_lora(model):  # the base weights with B @ A folded in: a plain model, loadable without peft
            state_dict, model = merged_lora_state_dict(model, state_dict), model.get_base_model()

        def write(tmp: Path) -> None:
            model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)  # empties the dict
            save_processor(model.config, tmp)  # a vision-language model's image processor and template
            tokenizer.save_pretrained(tmp)

        _write_export(out_dir, run_id, write)
    if dist.is_initialized():
        dist.barrier()


def _check_export_dir(out_dir, run_id: str | None, overwrite: bool) -> int:
    """This rank; raises `ExportError` on every rank when rank 0 may not export into ``out_dir`` (a collective)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    refusal = export_refusal(out_dir, run_id, overwrite) if rank == 0 else None
    if any_rank(refusal is not None):
        raise ExportError(refusal or f"{out_dir}: rank 0 refused the export (see its error)")
    return rank


def _write_export(out_dir, run_id: str | None, write) -> None:
    """Rank 0: ``write(tmp)`` into a temporary sibling of ``out_dir``, add the marker, move it in (`_install`)."""
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        write(tmp)
        files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if not p.is_dir())
        (tmp / EXPORT_MARKER).write_text(json.dumps({"run_id": run_id, "files": files,
                                                     "time": time.strftime("%Y-%m-%dT%H:%M:%S")}))
        earlier = _earlier_export(out) if out.exists() else None
        same_run = earlier is not None and run_id is not None and earlier.get("run_id") == run_id
        _install(tmp, out, earlier if same_run else None)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# LoRA: the adapters out of the engine (vLLM's adapter loading, --export-adapter) and the merged weights
# --------------------------------------------------------------------------------------------------
def adapter_state_dict(engine) -> dict[str, torch.Tensor]:
    """The policy's LoRA adapters under peft's ``get_peft_model_state_dict`` names
    (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``: no adapter name), whole tensors (gathered
    under ZeRO-3), detached copies on the CPU, ON EVERY RANK. A collective: every rank calls it. Only the adapters
    move: a few MB where the model is GB."""
    from peft import get_peft_model_state_dict

    full = {name: t.detach().to("cpu", copy=True)
            for bucket in iter_gathered_params(engine, trainable_only=True) for name, t in bucket}
    return get_peft_model_state_dict(engine.module, state_dict=full)


def peft_config_dict(engine) -> dict:
    """The peft ``LoraConfig`` of the policy as a JSON-ready dict (what ``adapter_config.json`` holds): r,
    lora_alpha, target_modules (the module names peft resolved, a sorted list; or a regex string), ... Local."""
    config = engine.module.peft_config["default"].to_dict()
    return json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))


def merged_lora_state_dict(model, state_dict: dict, adapter: str = "default") -> dict:
    """``state_dict`` of the peft ``model`` (all its tensors, whole) as the plain model's: every adapted linear
    weight W becomes W + (B @ A) * scaling (in fp32, back to W's dtype; scaling = alpha / r, the layer's), the
    adapters are dropped, and the names lose peft's ``base_model.model.`` prefix and ``.base_layer``. What
    peft's ``merge_and_unload`` computes, without touching the training model (merging and unmerging it in
    place would drift its weights)."""
    from peft.tuners.lora import LoraLayer

    scalings = {name: m.scaling[adapter] for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    a_suffix, b_suffix = f".lora_A.{adapter}.weight", f".lora_B.{adapter}.weight"
    for layer, scaling in scalings.items():
        a, b = state_dict.pop(layer + a_suffix), state_dict.pop(layer + b_suffix)
        w = state_dict[layer + ".base_layer.weight"]
        state_dict[layer + ".base_layer.weight"] = (w.float() + (b.float() @ a.float()) * scaling).to(w.dtype)
    left = [k for k in state_dict if ".lora_" in k]
    if left:
        raise ValueError(f"merged export: adapter tensors of no known LoRA layer: {left[:5]}")
    prefix = "base_model.model."
    return {k.removeprefix(prefix).replace(".base_layer.", "."): v for k, v in state_dict.items()}


def export_adapter(engine, out_dir: str, overwrite: bool = False, run_id: str | None = None) -> None:
    """The LoRA adapter in peft's ``save_pretrained`` layout (``adapter_config.json`` +
    ``adapter_model.safetensors``), loadable by ``PeftModel.from_pretrained(base, out_dir)`` and by vLLM's LoRA
    support. A collective (the adapters are gathered under ZeRO-3); rank 0 writes, with `export_hf`'s rules for
    ``out_dir``."""
    from safetensors.torch import save_file

    if not is_lora(engine.module):
        raise ExportError("--export-adapter: this run trains no adapter (policy.lora.enabled=false); --export-hf "
                          "writes its weights")
    rank = _check_export_dir(out_dir, run_id, overwrite)
    tensors = adapter_state_dict(engine)
    if rank == 0:
        def write(tmp: Path) -> None:
            engine.module.peft_config["default"].save_pretrained(str(tmp))
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "adapter_model.safetensors"),
                      metadata={"format": "pt"})

        _write_export(out_dir, run_id, write)
    if dist.is_initialized():
        dist.barrier()
