"""Atomic checkpoints of everything a run needs to resume to the same result.

Layout of ``checkpointing.checkpoint_dir``::

    step_000004/                 one complete checkpoint (only ever appears by a rename)
        ds/                      DeepSpeed checkpoint of the policy (weights, optimizer, scheduler)
        train_state.json         GRPOSaveState: consumed_samples, current_step, current_epoch, ...
        dataloader.pt            StatefulDataLoader state
        rng_rank{r}.pt           python / torch RNG states of each rank
        extra_*.pt               anything else the loop hands in (e.g. the async replay buffer)
        hf/                      consolidated safetensors (when save_consolidated)
    latest_checkpoint_status.json  step and wall time of the last successful save

A checkpoint is written into ``step_N.tmp`` by all ranks, then renamed by rank 0 after a barrier: a
run killed mid-save leaves a ``.tmp`` directory that is ignored and cleaned up, never a half
checkpoint. Tensors are loaded with ``weights_only=True``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from grpo.config import CheckpointingConfig, dhms_seconds


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
        from grpo.engines import any_rank

        now = self.clock()
        self.longest_step_s = max(self.longest_step_s, now - self.last)
        self.last = now
        self.reached = any_rank(now - self.start + self.longest_step_s >= self.limit_s)
        return self.reached


def step_of(path: Path) -> int:
    """The step of a checkpoint directory ``step_000012`` -> 12."""
    return int(Path(path).name[len("step_"):])


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _atomic_write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])


class CheckpointManager:
    def __init__(self, cfg: CheckpointingConfig, rank: int = 0):
        self.cfg = cfg
        self.rank = rank
        self.root = Path(cfg.checkpoint_dir)

    # ---- discovery -------------------------------------------------------------------------
    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.exists():
            return []
        done = [p for p in self.root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")]
        return sorted((p for p in done if (p / "train_state.json").exists()), key=step_of)

    def latest(self) -> Path | None:
        ckpts = self.checkpoints()
        return ckpts[-1] if ckpts else None

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint, or None."""
        latest = self.latest()
        return None if latest is None else step_of(latest)

    # ---- save ------------------------------------------------------------------------------
    def save(self, step: int, engine, state: GRPOSaveState, dataloader_state: dict | None = None,
             extra: dict | None = None, export_fn=None) -> Path:
        """Collective: every rank calls it. Returns the final checkpoint path."""
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f"step_{step:06d}.tmp"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        engine.save_checkpoint(str(tmp / "ds"), tag="ds", save_latest=False)
        torch.save(rng_state(), tmp / f"rng_rank{self.rank}.pt")
        if export_fn is not None:
            export_fn(str(tmp / "hf"))
        if self.rank == 0:
            if dataloader_state is not None:
                torch.save(dataloader_state, tmp / "dataloader.pt")
            for name, obj in (extra or {}).items():
                torch.save(obj, tmp / f"extra_{name}.pt")
            _atomic_write_json(tmp / "train_state.json", asdict(state))
        _barrier()
        if self.rank == 0:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _atomic_write_json(self.root / "latest_checkpoint_status.json",
                               {"step": step, "path": str(final), "wall_time": time.time(),
                                "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
            self._prune(keep=final)
        _barrier()
        return final

    def _metric(self, path: Path) -> float | None:
        with open(path / "train_state.json") as f:
            st = json.load(f)
        name = self.cfg.metric_name
        if name == "val_reward":
            v = st.get("val_reward")
            return None if v is None or v <= -99999999.0 else v
        return st.get("metrics", {}).get(name)

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
                return (m is not None, sign * m if m is not None else 0.0, step_of(p))

            ranked = sorted(ckpts, key=score, reverse=True)
            doomed = ranked[k:]
        latest = ckpts[-1]
        for p in doomed:
            if p != keep and p != latest:  # the newest one always stays: it is what resume needs
                shutil.rmtree(p, ignore_errors=True)

    # ---- load ------------------------------------------------------------------------------
    def load(self, path: Path, engine) -> tuple[GRPOSaveState, dict | None, dict]:
        """Restore engine weights/optimizer/scheduler and this rank's RNG; return the loop state."""
        engine.load_checkpoint(str(path / "ds"), tag="ds", load_module_strict=True)
        with open(path / "train_state.json") as f:
            state = GRPOSaveState(**json.load(f))
        rng_file = path / f"rng_rank{self.rank}.pt"
        if rng_file.exists():
            set_rng_state(torch.load(rng_file, weights_only=True))
        dl = path / "dataloader.pt"
        dataloader_state = torch.load(dl, weights_only=True) if dl.exists() else None
        extra = {p.stem[len("extra_"):]: torch.load(p, weights_only=True) for p in path.glob("extra_*.pt")}
        return state, dataloader_state, extra

    def clean_partial(self) -> None:
        """Remove ``.tmp`` directories left by a run killed mid-save (rank 0)."""
        if self.rank == 0 and self.root.exists():
            for p in self.root.glob("step_*.tmp"):
                shutil.rmtree(p, ignore_errors=True)

