"""Metrics sinks: ``metrics.jsonl`` always; wandb and tensorboard when enabled; a console progress bar.

Every row of ``<logger.log_dir>/metrics.jsonl`` is one JSON object with ``step`` and flat keys
in NeMo-RL's names (``train/mean_total_reward``, ``validation/accuracy``, ``timing/train/total_step_time``, ...),
as the phases that compute them name them. Only rank 0 writes. A value that went
non-finite is written as the string "nan", "inf" or "-inf" (`read_metrics` reads them back as floats).
On resume, `truncate_metrics` drops the rows past the checkpoint's step.

A write that fails (a full log disk, a file-size limit) never stops the run: the row is lost (a partly written
line is cut off again), the failure is counted in ``logger/metrics_write_failures`` of the rows that make it to
the file, and one warning per outage says why (`grpo.system.write_errors`). Rollout dumps that fail the same way are
turned off for the rest of the run (``logger/dump_write_failures``). Checkpoints, on their own disk perhaps,
go on being saved.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo.config import LoggerConfig


NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _scalar(v):
    """Tensors and numpy numbers -> Python numbers (lists for tensors of several elements); others as they are."""
    if hasattr(v, "item") and callable(v.item):
        try:
            return v.item()
        except (ValueError, RuntimeError):
            return v.tolist()
    return v


def _plain(v):
    """JSON-safe value: tensors and numpy numbers become numbers; NaN and infinities become the strings "nan",
    "inf" and "-inf" (JSON has no such numbers, and null would hide that a value went non-finite).

    >>> _plain(float("nan")), _plain([1.0, float("-inf")]), _plain(2)
    ('nan', [1.0, '-inf'], 2)
    """
    v = _scalar(v)
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _from_json(v):
    """`_plain` undone: "nan" / "inf" / "-inf" back to floats."""
    if isinstance(v, str):
        return NONFINITE.get(v, v)
    if isinstance(v, list):
        return [_from_json(x) for x in v]
    return v


def device_memory_gb(free_bytes: int, total_bytes: int) -> dict[str, float]:
    """What ``torch.cuda.mem_get_info()`` says about the whole device, in GiB: used = total - free.

    Unlike ``memory_reserved()`` (this process's caching allocator) this sees every process on the
    device and memory torch does not manage: vLLM's sleep-mode pools (released on sleep), NCCL buffers.

        >>> device_memory_gb(free_bytes=3 * 2**30, total_bytes=8 * 2**30)
        {'used_gb': 5.0, 'free_gb': 3.0, 'total_gb': 8.0}
    """
    gib = float(2**30)
    return {"used_gb": (total_bytes - free_bytes) / gib, "free_gb": free_bytes / gib, "total_gb": total_bytes / gib}


def cuda_device_memory() -> dict[str, float]:
    """`device_memory_gb` of the current CUDA device; empty without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return {}
    try:
        free, total = torch.cuda.mem_get_info()
    except (RuntimeError, AssertionError):  # no usable device after all (a CPU build told otherwise)
        return {}
    return device_memory_gb(free, total)


def gpu_metrics() -> dict:
    """`logger.monitor_gpus`: this rank's CUDA memory in GiB: torch's allocator (allocated, reserved, the
    peak allocated since the previous call), the whole device's used and free memory
    (`cuda_device_memory`), and, where pynvml is installed, the device's utilisation. Empty without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return {}
    gib = float(2**30)
    out = {"gpu/memory_allocated_gib": torch.cuda.memory_allocated() / gib,
           "gpu/memory_reserved_gib": torch.cuda.memory_reserved() / gib,
           "gpu/peak_memory_allocated_gib": torch.cuda.max_memory_allocated() / gib}
    device = cuda_device_memory()
    if device:
        out.update({"gpu/device_used_gib": device["used_gb"], "gpu/device_free_gib": device["free_gb"]})
    torch.cuda.reset_peak_memory_stats()
    try:
        out["gpu/utilization_pct"] = float(torch.cuda.utilization())
    except Exception:  # pynvml missing or NVML unavailable: memory only
        pass
    return out


@contextmanager
def phase_memory(phase: str, out: dict) -> Iterator[None]:
    """Peak memory of one phase of a step (CUDA only; nothing without it): on exit
    ``out["memory/<phase>_peak_gb"]`` is the most torch allocated during the block and
    ``out["memory/<phase>_used_gb"]`` the device's used memory (`cuda_device_memory`) at its end.
    Resets torch's peak counter on entry (so `gpu_metrics`' peak then covers the step's last phase only).
    """
    import torch

    if not torch.cuda.is_available():
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    try:
        yield
    finally:
        torch.cuda.synchronize()
        out[f"memory/{phase}_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
        device = cuda_device_memory()
        if device:
            out[f"memory/{phase}_used_gb"] = device["used_gb"]


# A timed phase -> NeMo-RL's Timer label of it (grpo_train in nemo_rl/algorithms/grpo.py, logged under
# "timing/train/"): "generation" is the whole multi-turn rollout, environment steps included.
PHASE_TIMERS = {"rollout": "timing/train/generation", "logprobs": "timing/train/policy_and_reference_logprobs",
                "train": "timing/train/policy_training"}


def phase_timer(phase: str) -> str:
    """The metric a timed ``phase`` adds its seconds to: NeMo-RL's label (`PHASE_TIMERS`), else
    ``timing/train/<phase>_s``.

        >>> phase_timer("train"), phase_timer("reward_model")
        ('timing/train/policy_training', 'timing/train/reward_model_s')
    """
    return PHASE_TIMERS.get(phase, f"timing/train/{phase}_s")


@contextmanager
def timed(metrics: dict, phase: str) -> Iterator[None]:
    """Time the block: adds its seconds to the phase's timer in ``metrics`` (`phase_timer`: ``train`` ->
    ``timing/train/policy_training``) and records, on CUDA, the phase's peak memory (``memory/<phase>_peak_gb``,
    ``memory/<phase>_used_gb``: `phase_memory`). The loops write each phase's call first and its measurement
    around it::

        with timed(timing, "train"):
            results = train_step(cfg, run.policy, batch, run.rank, run.world_size, loss_fn=clipped_pg_loss_fn)
    """
    t0 = time.perf_counter()
    with phase_memory(phase, metrics):
        yield
    key = phase_timer(phase)
    metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - t0


def interactive() -> bool:
    """Whether this process writes to a terminal (stdout and stderr both): progress bars only then."""
    return sys.stdout.isatty() and sys.stderr.isatty()


def quiet_library_progress_bars() -> None:
    """Turn off the progress bars of huggingface_hub, transformers (its model writes and loads), datasets and any
    other tqdm (``TQDM_DISABLE``, read by tqdm >= 4.66 at each bar) when the output is not a terminal: in a log file
    their carriage returns interleave with the run's own lines. Environment variables, so that libraries imported
    later and child processes (reward workers, generation ranks) inherit it; already imported libraries are told
    directly. Nothing changes on a terminal."""
    if interactive():
        return
    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS", "TQDM_DISABLE"):
        os.environ[name] = "1"
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()


class MetricsLogger:
    def __init__(self, cfg: LoggerConfig, rank: int = 0, run_config: dict | None = None, total_steps: int | None = None,
                 resume_step: int = 0):
        self.cfg = cfg
        self.enabled = rank == 0
        self.log_dir = Path(cfg.log_dir)
        self._wandb = None
        self._tb = None
        self._bar = None
        self.write_failures = {"metrics": 0, "dump": 0}  # failed writes of metrics rows and rollout dumps
        self._writing = True  # False during an outage of metrics.jsonl: one warning each
        self._fd = None
        if not self.enabled:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.log_dir / "metrics.jsonl"
        self._fd = os.open(self.metrics_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if run_config is not None:
            with open(self.log_dir / "config.json", "w") as f:
                json.dump(run_config, f, indent=2)
        if cfg.wandb_enabled:
            import wandb

            # Without an API key wandb would prompt or fail: go offline (sync later with `wandb sync`).
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            self._wandb = wandb.init(project=cfg.wandb.project, name=cfg.wandb.name, entity=cfg.wandb.entity,
                                     dir=str(self.log_dir), config=run_config, mode=mode, resume="allow")
        if cfg.tensorboard_enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.log_dir / "tensorboard"))
        # On a terminal, a bar; in a log (not a terminal), one line every tenth of the run instead.
        self._total_steps, self._line_every = total_steps, max(1, (total_steps or 0) // 10)
        if cfg.progress_bar and total_steps and interactive():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=resume_step, desc="grpo", unit="step",
                             dynamic_ncols=True, file=sys.stderr, disable=False)

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        if self.cfg.monitor_gpus:  # rank 0's device
            metrics = {**metrics, **gpu_metrics()}
        values = {k: _scalar(v) for k, v in metrics.items()}
        values.update({f"logger/{k}_write_failures": n for k, n in self.write_failures.items() if n})
        row = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in values.items()}}
        try:
            self._append(json.dumps(row, allow_nan=False) + "\n")
        except OSError as err:
            self.record_write_failure("metrics", f"step {step} of {self.metrics_path}", err, warn=self._writing,
                                      then="the run goes on; rows are lost until the disk takes writes again")
            self._writing = False
        else:
            self._writing = True
        numeric = {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)

    def _append(self, line: str) -> None:
        """Append ``line`` to metrics.jsonl whole or not at all: a write that fails part-way is cut off again,
        so the next row does not land on a broken line."""
        data = memoryview(line.encode())
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            while data:
                data = data[os.write(self._fd, data):]
        except OSError:
            try:
                os.ftruncate(self._fd, start)
            except OSError:
                pass
            raise

    def record_write_failure(self, kind: str, what: str, err: OSError, warn: bool = True, then: str = "") -> None:
        """Count a failed write (``kind``: "metrics" or "dump", shown as ``logger/<kind>_write_failures`` in the
        next rows) and, with ``warn``, say what failed, why (`grpo.system.write_errors`) and ``then`` what happens."""
        from grpo.system.write_errors import NO_ROOM_ERRNOS, write_failure_hint

        self.write_failures[kind] += 1
        if warn and self.enabled:
            why = (f"{err.strerror}: {write_failure_hint(err, self.log_dir)}"
                   if err.errno in NO_ROOM_ERRNOS else str(err))
            self.write(f"warning: could not write {what} ({type(err).__name__}: {why})" + (f"; {then}" if then else ""))

    def log_rollouts(self, key: str, records: list[dict], step: int) -> None:
        """Log rollout records (``grpo.system.dumps`` schema) to wandb as a table under ``key`` (e.g.
        ``train/rollouts``); nothing when wandb is off or on ranks other than 0."""
        if not self.enabled or self._wandb is None:
            return
        from grpo.system.dumps import wandb_table

        self._wandb.log({key: wandb_table(records)}, step=step)

    def progress(self, step: int, metrics: dict) -> None:
        """Advance the console bar to ``step`` with reward, KL and tokens/s (tqdm shows the ETA); without a terminal,
        print one line with the same numbers every tenth of the run (and at its last step)."""
        if not self.enabled or not self.cfg.progress_bar or not self._total_steps:
            return
        post = {}
        for key, short in (("train/mean_total_reward", "reward"), ("train/kl_penalty", "kl"),
                           ("train/tokens_per_s", "tok/s"), ("validation/accuracy", "val")):
            v = metrics.get(key)
            if v is not None:
                post[short] = f"{_scalar(v):.3g}"
        if self._bar is not None:
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(step - self._bar.n)
        elif step % self._line_every == 0 or step == self._total_steps:
            print(f"step {step}/{self._total_steps}: " + ", ".join(f"{k} {v}" for k, v in post.items()), flush=True)

    def write(self, text: str) -> None:
        """Print without breaking the progress bar (rank 0 only)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def print_samples(self, trajectories: list, n: int, title: str = "validation samples") -> None:
        """Print ``n`` samples (`grpo.trajectory.Trajectory`) as conversations: a single-turn sample as its
        question and completion, a multi-turn one message by message; then the gold answer and reward (a failed
        sample's failure instead: it has no reward)."""
        if not self.enabled or n <= 0 or not trajectories:
            return
        lines = [f"---- {title} ({min(n, len(trajectories))} of {len(trajectories)}) ----"]
        for t in trajectories[:n]:
            if t.turns <= 1:
                lines.append(f"Q: {t.question!r}\nA: {t.completion_text()!r}")
            else:
                lines.append(f"Q: {t.question!r}")
                lines += [f"  [{m.role}] {m.content!r}" for m in t.messages[t.num_prompt_messages:]]
            score = f"reward {t.reward:.3g}" if t.scored else f"failed: {t.failure.reason} ({t.failure.kind})"
            lines[-1] += f"  (gold {t.answer!r}, {score}" + (f", {t.turns} turns)" if t.turns > 1 else ")")
        self.write("\n".join(lines))

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()


def read_metrics(log_dir: str | os.PathLike) -> list[dict]:
    """All rows of ``metrics.jsonl`` (used by tests, benchmarks and notebooks); "nan" / "inf" / "-inf" are floats."""
    path = Path(log_dir) / "metrics.jsonl"
    with open(path) as f:
        return [{k: _from_json(v) for k, v in json.loads(line).items()} for line in f if line.strip()]


def truncate_metrics(log_dir: str | os.PathLike, after_step: int) -> int:
    """Drop the rows of ``metrics.jsonl`` with ``step > after_step`` (call it on resume, with the checkpoint's
    step, before logging again: every step then appears once). Atomic: the kept lines are written to a
    temporary file that replaces the original. A last line cut short by a kill is dropped too. Returns the
    number of rows dropped; no file is no rows.
    """
    path = Path(log_dir) / "metrics.jsonl"
    if not path.exists():
        return 0
    kept, dropped = [], 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:  # the half-written last line of a killed run
                dropped += 1
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > after_step:
                dropped += 1
            else:
                kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped


METRICS_OWNER = "metrics.run_id"  # beside metrics.jsonl: the id (`grpo.system.rundir`) of the run that writes it


def claim_metrics(log_dir: str | os.PathLike, run_id: str | None, resume_step: int, resumed: bool,
                  checkpointed: bool = True) -> str | None:
    """Make ``<log_dir>/metrics.jsonl`` this run's before it logs (rank 0, at setup); returns what to tell the
    user, or None. ``run_id``: the run's id (`grpo.system.rundir`, the checkpoint directory's when ``checkpointed``);
    ``resumed``: a checkpoint was restored, at step ``resume_step``.

    - This run again (the file's recorded owner, ``metrics.run_id``, is ``run_id`` and the run resumes or
      keeps its checkpoint directory, e.g. killed before its first save; or no owner recorded, a file written
      before owners were, and a resume): `truncate_metrics` to ``resume_step``, so every step appears once.
    - Anything else with rows in it (a fresh start, e.g. the same command with a new or disabled checkpoint
      directory, or another run's file): nothing is deleted; the file is renamed aside to
      ``metrics.<its run id>.jsonl`` (``metrics.previous.jsonl`` when unknown; ``.1``, ``.2``... when taken) and
      this run starts a new one.

    Then ``run_id`` is recorded as the owner.
    """
    d = Path(log_dir)
    path, owner_path = d / "metrics.jsonl", d / METRICS_OWNER
    try:
        owner = owner_path.read_text().strip() or None
    except FileNotFoundError:
        owner = None
    note = None
    same_run = ((run_id is not None and owner == run_id and (resumed or checkpointed))
                or (owner is None and resumed))
    if same_run:
        dropped = truncate_metrics(d, resume_step)
        if dropped:
            note = (f"metrics.jsonl: {dropped} rows of this run past step {resume_step} dropped (steps not checkpointed: "
                    "they run again)")
    elif path.exists() and path.stat().st_size > 0:
        base = f"metrics.{owner or 'previous'}"
        aside, n = d / f"{base}.jsonl", 0
        while aside.exists():
            n += 1
            aside = d / f"{base}.{n}.jsonl"
        os.replace(path, aside)
        why = "a fresh start" if not resumed else f"this run ({run_id}) resumes, the file is run {owner}'s"
        note = (f"{path} held another run's metrics ({why}): kept as {aside}; this run writes a new metrics.jsonl "
                "(use another logger.log_dir to keep runs apart)")
    if run_id is not None and owner != run_id:
        tmp = owner_path.with_name(owner_path.name + ".tmp")
        tmp.write_text(run_id + "\n")
        os.replace(tmp, owner_path)
    return note
