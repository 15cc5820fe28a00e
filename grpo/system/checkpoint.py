"""Atomic, self-verifying checkpoints of everything a run needs to resume to the same result.

Layout of ``checkpointing.checkpoint_dir``::

    step_000004/                 one complete checkpoint (only ever appears by a rename)
        ds/                      DeepSpeed checkpoint of the policy (weights, optimizer, scheduler; with LoRA
                                 the adapters and their optimizer states only: the base is policy.model_name)
        train_state.json         GRPOSaveState: consumed_samples, current_step, current_epoch, ...
        dataloader.pt            StatefulDataLoader state
        rng_rank{r}.pt           python / torch RNG states of each rank
        extra_*.pt               anything else the loop hands in (e.g. the async replay buffer)
        hf/                      consolidated safetensors (when save_consolidated)
        weight_config.json       the config keys that shape the weights (model, precision, tokenizer, LoRA), which
                                 --export-hf / --export-adapter check their own config against
        lora.json                the LoRA settings the policy's trainable state was made with (`lora_record`):
                                 a resume or export with others is refused before DeepSpeed reads anything
        manifest.json            every file above with its size and sha256; written last
    latest_checkpoint_status.json  step and wall time of the last successful save

A checkpoint is written into ``step_N.tmp`` by all ranks, its manifest is written last, then rank 0
renames it: a run killed mid-save leaves a ``.tmp`` directory that is ignored and cleaned up, never a
half checkpoint. A save that fails (a full disk) removes its ``.tmp`` and keeps the earlier checkpoints.
`CheckpointManager.latest` returns the newest checkpoint whose files match its manifest and warns about
each newer one it skips.

No code from checkpoints: every file is read with ``torch.load(weights_only=True)`` (`safe_load`),
DeepSpeed's own files included (`use_safe_loading` replaces its checkpoint engine's loader, which
would unpickle with ``weights_only=False``). A file holding anything but tensors, containers, numbers,
strings and the few plain DeepSpeed types of `_deepspeed_safe_globals` is refused with a `CheckpointError`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pickle
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from grpo.config import CheckpointingConfig, dhms_seconds

logger = logging.getLogger(__name__)
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"step_(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or used; the message names the file or directory and what to do."""


@dataclass
class GRPOSaveState:
    """NeMo-RL's GRPOSaveState: the loop counters saved with each checkpoint."""

    consumed_samples: int = 0
    current_step: int = 0
    current_epoch: int = 0
    total_steps: int = 0
    total_valid_tokens: int = 0
    val_reward: float = -99999999.0
    metrics: dict = field(default_factory=dict)
    # grpo-ds: the step budget's counters (`grpo.system.health.RolloutBudget.state_dict`: skipped steps, the
    # current streak of them, failed samples per reason, retries), restored on resume
    rollout_failures: dict = field(default_factory=dict)


class SaveDeadline:
    """`checkpointing.checkpoint_must_save_by`: stop, with a checkpoint, before a job's time limit.

    Time counts from ``started_at`` (the start of the run; default: now) and steps from when the
    deadline is made (just before the first step). After each step, `due()` says whether another step
    would not fit: the time used plus the longest step so far (validation and saving included) reaches
    the limit. Every rank calls `due()` together; one rank due makes all due.

        >>> clock = iter([5.0, 10.0, 20.0, 30.0])
        >>> deadline = SaveDeadline("00:00:00:35", clock=lambda: next(clock), started_at=0.0)
        >>> deadline.due(), deadline.due(), deadline.due(), deadline.reached
        (False, False, True, True)
    """

    def __init__(self, spec: str | None, clock=time.monotonic, started_at: float | None = None):
        self.spec = spec
        self.limit_s = None if spec is None else dhms_seconds(spec)
        self.clock = clock
        self.last = clock()
        self.start = self.last if started_at is None else started_at
        self.longest_step_s = 0.0
        self.reached = False

    def due(self) -> bool:
        if self.limit_s is None:
            return False
        from grpo.system.dist import any_rank

        now = self.clock()
        self.longest_step_s = max(self.longest_step_s, now - self.last)
        self.last = now
        self.reached = any_rank(now - self.start + self.longest_step_s >= self.limit_s)
        return self.reached


# --------------------------------------------------------------------------------------------------
# Loading without running code
# --------------------------------------------------------------------------------------------------
def _deepspeed_safe_globals() -> list:
    """The non-tensor types DeepSpeed 0.19 pickles into its checkpoints (ZeRO-1/2/3; fp32, bf16, fp16), found
    with ``torch.serialization.get_unsafe_globals_in_checkpoint``: an int enum, two loss-scaler records and a
    dataclass of two ints. Allowing them lets an unpickler build only these plain objects."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def safe_load(path: str | os.PathLike, map_location="cpu"):
    """``torch.load(path, weights_only=True)`` with DeepSpeed's few plain types allowed; a file that would run
    code, or cannot be read, raises a `CheckpointError` naming it."""
    try:
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
        what = found.group(1) if found else str(err).splitlines()[-1][:200]
        raise CheckpointError(
            f"{path}: refused to load: it references Python code ({what}), and checkpoints are only loaded with "
            "torch.load(weights_only=True), so that a checkpoint can never run code. Do not use a checkpoint you "
            "did not write; if grpo-ds wrote it with another DeepSpeed version that stores a new type, add that "
            "type to grpo.system.checkpoint._deepspeed_safe_globals") from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot be read ({type(err).__name__}: {str(err)[:300]}); the file is "
                              "truncated or corrupt: move this checkpoint away to resume from an earlier one") from None


def use_safe_loading(engine) -> None:
    """Make ``engine.load_checkpoint`` read every file with `safe_load`.

    DeepSpeed reads model, optimizer and scheduler states through ``engine.checkpoint_engine.load(path,
    map_location)`` (``TorchCheckpointEngine.load`` calls ``torch.load(weights_only=False)``); this replaces
    that method on the engine's instance, for whichever checkpoint engine the config chose. Universal
    checkpoints are refused: ZeRO-3 reads them with its own ``torch.load(weights_only=False)`` calls.
    """
    if engine.load_universal_checkpoint():
        raise CheckpointError("DeepSpeed config checkpoint.load_universal=true: universal checkpoints are read with "
                              "torch.load(weights_only=False), which can run code; remove that setting")
    engine.checkpoint_engine.load = lambda path, map_location=None: safe_load(path, map_location)


# --------------------------------------------------------------------------------------------------
# Manifests
# --------------------------------------------------------------------------------------------------
def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def build_manifest(ckpt: Path, world_size: int | None = None) -> dict:
    """``{"files": {relative path: {"size", "sha256"}}, "world_size": ranks that saved it}`` of every file under
    ``ckpt`` but the manifest (``world_size`` None: not recorded; `saved_world_size` counts the RNG files)."""
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.relative_to(ckpt).as_posix() != MANIFEST)
    manifest = {"version": 1, "files": {p.relative_to(ckpt).as_posix(): {"size": p.stat().st_size,
                                                                         "sha256": file_sha256(p)} for p in files}}
    if world_size is not None:
        manifest["world_size"] = world_size
    return manifest


def saved_world_size(manifest: dict) -> int | None:
    """The number of ranks that saved a checkpoint: its manifest's ``world_size``, or for a manifest without one
    (older checkpoints) the number of ``rng_rank{r}.pt`` files it lists (each rank saves its own); None when
    neither says."""
    recorded = manifest.get("world_size")
    if type(recorded) is int and recorded > 0:
        return recorded
    return sum(1 for f in manifest["files"] if re.fullmatch(r"rng_rank\d+\.pt", f)) or None


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _gather(obj) -> list:
    """Every rank's ``obj``, in rank order (a collective; ``[obj]`` without torch.distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def manifest_problem(ckpt: Path, checksums: bool = True) -> str | None:
    """What is wrong with ``ckpt`` against its manifest (missing, resized or changed files), or None."""
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())
    except FileNotFoundError:
        return f"no {MANIFEST}: the save did not finish"
    except (ValueError, OSError) as err:
        return f"{MANIFEST} is unreadable ({type(err).__name__}: {str(err)[:200]})"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return f"{MANIFEST} is malformed (no mapping of files)"
    for rel, entry in files.items():
        if not (isinstance(entry, dict) and type(entry.get("size")) is int and isinstance(entry.get("sha256"), str)):
            return f"{MANIFEST} is malformed (the entry of {rel[:200]!r} has no integer size and sha256 string)"
        if rel.startswith("/") or ".." in rel.split("/"):
            return f"{MANIFEST} is malformed (it lists {rel[:200]!r}, outside the checkpoint)"
    if "train_state.json" not in files:
        return f"{MANIFEST} lists no train_state.json"
    for rel, entry in files.items():
        path = ckpt / rel
        if not path.is_file():
            return f"{rel} is missing"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{rel} has {size} bytes, the manifest says {entry['size']} (truncated or overwritten)"
        if checksums and file_sha256(path) != entry["sha256"]:
            return f"{rel} does not match its sha256 in the manifest (corrupt or changed)"
    return None


def state_json(state: GRPOSaveState) -> dict:
    """``state`` as strict JSON: metrics that are not finite numbers are left out (a checkpoint's metric then
    ranks lowest for ``keep_top_k``) and a non-finite ``val_reward`` reads as "no validation yet".

    >>> state_json(GRPOSaveState(val_reward=float("nan"), metrics={"train/loss": float("inf"), "a": 1.0}))["metrics"]
    {'a': 1.0}
    """
    out = asdict(state)
    out["metrics"] = {k: v for k, v in out["metrics"].items()
                      if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    if not math.isfinite(out["val_reward"]):
        out["val_reward"] = GRPOSaveState.val_reward
    return out


def _atomic_write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, allow_nan=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_failed(err: BaseException) -> bool:
    """An error that means the disk would not take the bytes (full, over quota, torch's stream errors)."""
    from grpo.system.write_errors import NO_ROOM_ERRNOS

    if isinstance(err, OSError) and err.errno in NO_ROOM_ERRNOS:
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(s in text for s in (
        "No space left", "basic_ios::clear", "iostream error", "PytorchStreamWriter", "inline_container.cc"))


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _any_rank(flag: bool) -> bool:
    from grpo.system.dist import any_rank

    return any_rank(flag)


def _is_lora(engine) -> bool:
    from grpo.system.engines import is_lora

    return is_lora(getattr(engine, "module", None))


def _check_adapters_loaded(ds_dir: Path, engine) -> None:
    """A LoRA checkpoint loads without strict module keys (it lacks the frozen base): check instead that it held
    every trainable parameter of the engine (another lora.dim or target_modules would load nothing silently)."""
    files = sorted(ds_dir.glob("ds/mp_rank_*_model_states.pt")) or sorted(ds_dir.glob("ds/*model_states.pt"))
    if not files:
        return
    saved = set(safe_load(files[0]).get("module") or {})
    if not saved:  # ZeRO-3 keeps the weights in its optimizer partitions, which DeepSpeed checks itself
        return
    trainable = {name for name, p in engine.module.named_parameters() if p.requires_grad}
    missing = sorted(trainable - saved)
    if missing:
        raise CheckpointError(f"{ds_dir} holds no {missing[:3]} ({len(missing)} adapter tensors): it was saved with "
                              "other LoRA settings (policy.lora) or without LoRA; resume with the same policy.lora")


LORA_RECORD = "lora.json"


def lora_record(engine) -> dict:
    """What shapes the policy's trainable state, under ``policy.lora``'s names: ``{"enabled": False}`` (the whole
    model trains) or ``{"enabled": True, "dim", "alpha", "adapted": [the adapted modules' names]}`` (what
    target_modules, exclude_modules and match_all_linear resolved to), read from the engine's peft model."""
    module = getattr(engine, "module", None)
    if not _is_lora(engine):
        return {"enabled": False}
    from peft.tuners.lora import LoraLayer

    peft_cfg = module.peft_config["default"]
    adapted = sorted(n.removeprefix("base_model.model.") for n, m in module.named_modules() if isinstance(m, LoraLayer))
    return {"enabled": True, "dim": peft_cfg.r, "alpha": peft_cfg.lora_alpha, "adapted": adapted}


def lora_changes(saved: dict, now: dict) -> list[str]:
    """Each ``policy.lora`` setting that differs between a checkpoint's `lora_record` and this run's, with both values.

    >>> lora_changes({"enabled": True, "dim": 8, "alpha": 32, "adapted": ["a.q_proj", "a.v_proj"]},
    ...              {"enabled": True, "dim": 16, "alpha": 32, "adapted": ["a.q_proj"]})  # doctest: +NORMALIZE_WHITESPACE
    ['policy.lora.dim=8 in the checkpoint, 16 in this run',
     'policy.lora.target_modules / exclude_modules / match_all_linear: the checkpoint adapts 2 modules, this run 1
      (only in the checkpoint: a.v_proj)']
    """
    if bool(saved.get("enabled")) != bool(now.get("enabled")):
        return [f"policy.lora.enabled={str(bool(saved.get('enabled'))).lower()} in the checkpoint, "
                f"{str(bool(now.get('enabled'))).lower()} in this run"]
    if not now.get("enabled"):
        return []
    def show(v) -> str:
        return f"{v:g}" if isinstance(v, float) else str(v)

    out = [f"policy.lora.{k}={show(saved.get(k))} in the checkpoint, {show(now.get(k))} in this run"
           for k in ("dim", "alpha") if saved.get(k) != now.get(k)]
    a, b = set(saved.get("adapted") or []), set(now.get("adapted") or [])
    if a != b:
        only = [f"only in {where}: {', '.join(sorted(names)[:3])}" + (f" and {len(names) - 3} more" if len(names) > 3
                                                                       else "")
                for where, names in (("the checkpoint", a - b), ("this run", b - a)) if names]
        out.append(f"policy.lora.target_modules / exclude_modules / match_all_linear: the checkpoint adapts {len(a)} "
                   f"modules, this run {len(b)} ({'; '.join(only)})")
    return out


def rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])


def _step_of(path: Path) -> int:
    return int(_STEP_DIR.fullmatch(path.name).group(1))


class CheckpointManager:
    """``weight_config``: the run's settings that shape its weights (`grpo.system.rundir.weight_config`), recorded in
    each checkpoint as ``weight_config.json`` for the exports to check against (None: not recorded)."""

    def __init__(self, cfg: CheckpointingConfig, rank: int = 0, weight_config: dict | None = None):
        self.cfg = cfg
        self.rank = rank
        self.weight_config = weight_config
        self.root = Path(cfg.checkpoint_dir)
        self._checksummed: Path | None = None  # what `latest` last verified with checksums: `load` need not again

    # ---- discovery -------------------------------------------------------------------------
    def checkpoints(self) -> list[Path]:
        """``step_N`` directories (intact or not), oldest first; ``.tmp`` ones are never checkpoints."""
        if not self.root.exists():
            return []
        return sorted((p for p in self.root.iterdir() if p.is_dir() and _STEP_DIR.fullmatch(p.name)), key=_step_of)

    def verify(self, path: Path, checksums: bool = True) -> str | None:
        """The problem with the checkpoint at ``path`` (missing, truncated or changed files), or None."""
        path = Path(path)
        if not path.is_dir():
            return "not a directory"
        problem = manifest_problem(path, checksums)
        if problem is None:
            try:
                GRPOSaveState(**json.loads((path / "train_state.json").read_text()))
            except (ValueError, TypeError) as err:
                problem = f"train_state.json is not a saved GRPOSaveState ({err})"
        return problem

    def latest(self, checksums: bool = True) -> Path | None:
        """The newest intact checkpoint (None when there is none at all); each newer broken one is skipped with a
        warning saying what is wrong. Checkpoints that are all broken raise: resuming from nothing would mix runs."""
        problems = []
        for path in reversed(self.checkpoints()):
            problem = self.verify(path, checksums)
            if problem is None:
                self._checksummed = path if checksums else None
                return path
            logger.warning("checkpoint %s is not intact, skipping it: %s", path, problem)
            problems.append(f"{path.name}: {problem}")
        if problems:
            raise CheckpointError(f"{self.root}: no intact checkpoint ({'; '.join(problems)}). Move the broken ones "
                                  "away to start over, or set checkpointing.checkpoint_dir to a new directory")
        return None

    def latest_step(self, checksums: bool = True) -> int | None:
        """The step of the newest intact checkpoint (`latest`), or None."""
        latest = self.latest(checksums)
        return None if latest is None else _step_of(latest)

    # ---- save ------------------------------------------------------------------------------
    def save(self, step: int, engine, state: GRPOSaveState, dataloader_state: dict | None = None,
             extra: dict | None = None, export_fn=None) -> Path:
        """Collective: every rank calls it. Returns the final checkpoint path.

        A rank that fails to write (full disk) makes every rank raise a `CheckpointError`; the ``.tmp``
        directory is removed and the earlier checkpoints stay as they were."""
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f"step_{step:06d}.tmp"
        error = None
        try:
            if self.rank == 0:
                self.root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            _barrier()
            # LoRA: the adapters and their optimizer states only; the frozen base comes from policy.model_name
            frozen_out = {"exclude_frozen_parameters": True} if _is_lora(engine) else {}
            engine.save_checkpoint(str(tmp / "ds"), tag="ds", save_latest=False, **frozen_out)
            torch.save(rng_state(), tmp / f"rng_rank{self.rank}.pt")
            if export_fn is not None:
                export_fn(str(tmp / "hf"))
            if self.rank == 0:
                if dataloader_state is not None:
                    torch.save(dataloader_state, tmp / "dataloader.pt")
                for name, obj in (extra or {}).items():
                    torch.save(obj, tmp / f"extra_{name}.pt")
                _atomic_write_json(tmp / LORA_RECORD, lora_record(engine))
                if self.weight_config is not None:
                    from grpo.system.rundir import WEIGHT_CONFIG_FILE

                    _atomic_write_json(tmp / WEIGHT_CONFIG_FILE, self.weight_config)
                _atomic_write_json(tmp / "train_state.json", state_json(state))
        except Exception as err:  # noqa: BLE001 - every rank must learn that the save failed
            error = err
        self._agree_or_raise(error, step, tmp)
        if self.rank == 0:
            try:
                _atomic_write_json(tmp / MANIFEST, build_manifest(tmp, _world_size()))  # last: it vouches for the rest
                if final.exists():  # the same step saved again (e.g. a resumed run stopping at once)
                    os.replace(final, self.root / f"{final.name}.old.tmp")
                os.replace(tmp, final)
                shutil.rmtree(self.root / f"{final.name}.old.tmp", ignore_errors=True)
                _atomic_write_json(self.root / "latest_checkpoint_status.json",
                                   {"step": step, "path": str(final), "wall_time": time.time(),
                                    "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
                self._prune(keep=final)
            except Exception as err:  # noqa: BLE001
                error = err
        self._agree_or_raise(error, step, tmp)
        return final

    def _agree_or_raise(self, error: BaseException | None, step: int, tmp: Path) -> None:
        """Collective: when any rank failed, rank 0 removes the partial checkpoint and every rank raises."""
        if not _any_rank(error is not None):
            return
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is None:
            raise CheckpointError(f"saving checkpoint step {step} in {self.root} failed on another rank (see its "
                                  "error); the partial checkpoint was removed, the earlier ones are kept")
        if not _write_failed(error):
            raise error
        from grpo.system.write_errors import write_failure_hint  # full disk, quota, or a file-size limit (ulimit -f)

        hint = write_failure_hint(error, self.root)
        raise CheckpointError(
            f"could not write checkpoint step {step} in {self.root}: {hint} "
            f"({type(error).__name__}: {str(error)[:200]}). The partial checkpoint was removed and the earlier ones "
            "are kept" + ("" if "file-size limit" in hint else " (lowering checkpointing.keep_top_k leaves more room)")
            + ": rerun the same command to resume"
        ) from error

    def _metric(self, path: Path) -> float | None:
        try:
            st = json.loads((path / "train_state.json").read_text())
        except (OSError, ValueError):
            return None
        from grpo.metrics import checkpoint_metric_keys

        name, metrics = self.cfg.metric_name, st.get("metrics", {})
        for key in checkpoint_metric_keys(name):  # NeMo-RL's "val:accuracy", then where older checkpoints had it
            if isinstance(metrics.get(key), (int, float)):
                return metrics[key]
        if name == "val:accuracy":  # a checkpoint saved before the metrics were kept: its val_reward
            v = st.get("val_reward")
            return None if v is None or v <= -99999999.0 else v
        return None

    def _prune(self, keep: Path) -> None:
        """Keep the top k by metric (missing metric ranks lowest), or the last k without a metric."""
        k = self.cfg.keep_top_k
        ckpts = self.checkpoints()
        if k is None or len(ckpts) <= k:
            return
        if self.cfg.metric_name is None:
            doomed = ckpts[:-k]
        else:
            sign = 1.0 if self.cfg.higher_is_better else -1.0

            def score(p: Path):
                m = self._metric(p)
                return (m is not None, sign * m if m is not None else 0.0, _step_of(p))

            ranked = sorted(ckpts, key=score, reverse=True)
            doomed = ranked[k:]
        latest = ckpts[-1]
        for p in doomed:
            if p != keep and p != latest:  # the newest one always stays: it is what resume needs
                shutil.rmtree(p, ignore_errors=True)

    # ---- load ------------------------------------------------------------------------------
    def load(self, path: Path, engine, need_dataloader: bool = True,
             export_flag: str | None = None) -> tuple[GRPOSaveState, dict | None, dict]:
        """Restore engine weights/optimizer/scheduler and this rank's RNG; return the loop state, the dataloader
        state and the extras. Every file is read with ``weights_only=True``. A missing ``rng_rank{r}.pt`` (or
        ``dataloader.pt`` with ``need_dataloader``) is an error naming it, never a silent restart.

        A collective: every rank checks the checkpoint (intact, saved by as many ranks as this run has, the
        same one on every rank) before DeepSpeed reads any of it, and every rank raises the same
        `CheckpointError` when one rank finds a problem. ``export_flag``: the load is for that export
        (``--export-hf`` / ``--export-adapter``), whose advice differs (another number of ranks: rerun the export with
        the checkpoint's)."""
        path = Path(path)
        problem = self._load_problem(path, need_dataloader, engine, export_flag)
        found = _gather([str(path), problem])
        problem = next((p for _, p in found if p is not None), None)
        if problem is None and len({p for p, _ in found}) > 1:
            problem = (f"the ranks found different newest checkpoints ({sorted({p for p, _ in found})}): a save "
                       "is still being written or the ranks see different files; rerun once they agree")
        if problem is not None:
            raise CheckpointError(problem)
        files = json.loads((path / MANIFEST).read_text())["files"]
        rng_file = path / f"rng_rank{self.rank}.pt"
        use_safe_loading(engine)
        lora = _is_lora(engine)  # the checkpoint holds the adapters; the base weights are policy.model_name's
        loaded, _ = engine.load_checkpoint(str(path / "ds"), tag="ds", load_module_strict=not lora)
        if lora:
            _check_adapters_loaded(path / "ds", engine)
        if loaded is None:
            raise CheckpointError(f"{path / 'ds'}: DeepSpeed found no checkpoint to load")
        state = GRPOSaveState(**json.loads((path / "train_state.json").read_text()))
        set_rng_state(safe_load(rng_file))
        dataloader_state = safe_load(path / "dataloader.pt") if "dataloader.pt" in files else None
        extra = {name[len("extra_"):-len(".pt")]: safe_load(path / name)  # only files the manifest vouches for
                 for name in sorted(files) if name.startswith("extra_") and name.endswith(".pt") and "/" not in name}
        return state, dataloader_state, extra

    def _load_problem(self, path: Path, need_dataloader: bool, engine=None, export_flag: str | None = None
                      ) -> str | None:
        """What keeps this rank from loading ``path`` into ``engine`` (the whole message), or None: a broken
        checkpoint, another number of ranks, missing files, other LoRA settings (`lora_changes`)."""
        problem = self.verify(path, checksums=path != self._checksummed)
        if problem is not None:
            return f"{path}: {problem}"
        manifest = json.loads((path / MANIFEST).read_text())
        files, saved, world = manifest["files"], saved_world_size(manifest), _world_size()
        if saved is not None and saved != world and export_flag is not None:
            return (f"{export_flag}: {path} was saved by {saved} rank(s) and this export runs on {world}: the ZeRO "
                    f"checkpoint is read back by as many ranks as wrote it. Run the same export command on {saved} "
                    f"ranks (e.g. torchrun --nproc_per_node {saved} train_grpo.py <the same arguments>); rank 0 "
                    "writes the result")
        if saved is not None and saved != world:
            return (f"{path} was saved by {saved} rank(s) and this run has {world}: resume with the same number "
                    f"of ranks ({saved}: e.g. torchrun --nproc_per_node {saved}); the ZeRO optimizer state is "
                    "sharded per rank. To go on with another number of ranks, start a new run from the weights "
                    "(--export-hf, then policy.model_name=<that directory>)")
        rng_file = path / f"rng_rank{self.rank}.pt"
        if rng_file.name not in files:
            rng_saved = sorted(f for f in files if f.startswith("rng_rank"))
            return (f"{rng_file} is missing (the checkpoint has {rng_saved}): it was saved by "
                    f"{len(rng_saved)} rank(s); resume with the same number of ranks")
        if need_dataloader and "dataloader.pt" not in files:
            return f"{path / 'dataloader.pt'} is missing: without it the data order would restart"
        if engine is not None and LORA_RECORD in files:  # (checkpoints written before the record: checked after)
            try:
                saved = json.loads((path / LORA_RECORD).read_text())
            except ValueError as err:
                return f"{path / LORA_RECORD} is unreadable ({err})"
            changes = lora_changes(saved if isinstance(saved, dict) else {}, lora_record(engine))
            if changes:
                return (f"{path} was trained with other LoRA settings than this run's ({'; '.join(changes)}): its "
                        "adapters and optimizer states only fit the settings they were made with, and "
                        "checkpointing.allow_config_change does not cover these. Resume (or export) with the "
                        "checkpoint's policy.lora, or start a new run from its weights (--export-hf with its "
                        "settings, then policy.model_name=<that directory>)")
        return None

    def clean_partial(self) -> None:
        """Remove ``.tmp`` directories left by a run killed mid-save (rank 0)."""
        if self.rank == 0 and self.root.exists():
            for p in self.root.glob("step_*.tmp"):
                shutil.rmtree(p, ignore_errors=True)
