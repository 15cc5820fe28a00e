"""One run per directory: an exclusive lock for the life of the run, and a fingerprint that a resume must match.

At setup, rank 0, before anything is written to ``checkpointing.checkpoint_dir`` or ``logger.log_dir``::

    locks, run_id = claim_run_dirs(cfg.checkpointing.checkpoint_dir, cfg.logger.log_dir, cfg.model_dump(mode="json"),
                                   resume=cfg.checkpointing.resume, allow_change=...)
    ...
    for lock in locks: lock.release()     # at the very end (the kernel releases them if the process dies)

which is `RunLock` on each distinct directory, `check_fresh_start` when not resuming, then `check_fingerprint`
and `write_fingerprint` of `run_fingerprint` in each.

Why a lock and not a PID file alone: ``fcntl.flock`` is released by the kernel when its holder dies, however
it dies (kill -9 included), so a crashed run never leaves a stale lock behind; the PID, host and start time
in the file only say who holds it.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import re
import socket
import time
import uuid
from pathlib import Path

LOCK_FILE = ".grpo_run.lock"
FINGERPRINT_FILE = "run_fingerprint.json"

# Config fields that may change when a run resumes; each changes when or how a run is observed or stored,
# never what one optimizer step computes from the state a checkpoint restores:
RESUME_MUTABLE = (
    "grpo.max_num_steps",       # train longer (or stop earlier) than first planned
    "grpo.max_num_epochs",      # the same, counted in epochs
    "grpo.val_period",          # when to validate: validation does not change the weights
    "grpo.val_at_start",        # only ever used at step 0
    "grpo.val_at_end",
    "grpo.val_start_at",        # the same: the first step periodic validation may run
    "policy.generation.val_temperature",     # validation's own sampling: validation never changes the weights
    "policy.generation.val_top_p",
    "policy.generation.val_top_k",
    "logger.",                  # where and how metrics are shown (log_dir, wandb, tensorboard, progress bar)
    "checkpointing.save_period",             # how often to save
    "checkpointing.keep_top_k",              # how many to keep
    "checkpointing.checkpoint_must_save_by",  # a new job gets a new time limit
    "checkpointing.resume",
    "checkpointing.checkpoint_dir",          # a run directory moved to another disk
    "cluster.",                 # where it runs: the update is invariant to the world size (grpo.system.engines); the
                                # RNG state per rank is checked on load (rng_rank{r}.pt)
    "grpo.stop_at_validation_metric",        # when to stop early: it stops the run, never changes an update
    "grpo.stop_at_validation_threshold",
    "grpo.max_val_samples",                  # validation reads the weights, never changes them
    "grpo.val_batch_size",
    "grpo.val_num_generations_per_prompt",
    "checkpointing.load_replay_buffer",      # how to resume (the deque is regenerated exactly otherwise)
    "checkpointing.allow_config_change",
    "checkpointing.save_consolidated",       # extra copies of the weights
    "checkpointing.metric_name",             # which checkpoints to keep
    "checkpointing.higher_is_better",
    "policy.max_nonfinite_steps",            # when to stop a failing run
    "grpo.async_grpo.max_generation_failures",
    "grpo.rollout_failure.max_consecutive_skipped_steps",  # when an outage stops the run
)


class RunDirError(RuntimeError):
    """A run directory that this run may not use; the message names it and says what to do."""


class DirInUse(RunDirError):
    """`RunLock` found the directory locked: ``holder`` is what its holder wrote (pid, host, started)."""

    def __init__(self, message: str, directory: Path, holder: dict):
        super().__init__(message)
        self.directory, self.holder = directory, holder

    def who(self) -> str:
        h = self.holder
        return f"PID {h.get('pid', '?')} on {h.get('host', '?')}, started {h.get('started', '?')}"


# --------------------------------------------------------------------------------------------------
# Lock
# --------------------------------------------------------------------------------------------------
def _read_holder(path: Path) -> dict:
    for _ in range(20):  # the holder writes its details right after taking the lock
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
    return {}


class RunLock:
    """An exclusive ``fcntl.flock`` on ``<directory>/.grpo_run.lock`` (PID, host, start time inside) from
    construction until `release` or the death of the process. A second holder, in any process, fails at
    once with a `RunDirError` naming the holder's PID and host. Creates the directory."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / LOCK_FILE
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = None
            err = DirInUse("", self.directory, _read_holder(self.path))
            err.args = (f"{self.directory} is in use by another run ({err.who()}): two runs in one directory would "
                        "mix their checkpoints and metrics. Wait for it to end, stop it, or give this run another "
                        "checkpointing.checkpoint_dir / logger.log_dir",)
            raise err from None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(info).encode(), 0)
        os.fsync(self._fd)

    def release(self) -> None:
        """Unlock (the file stays: removing it would let a third run lock a file a second one still holds)."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def distinct_dirs(*dirs: str | os.PathLike) -> list[Path]:
    """The directories once each (a log_dir equal to the checkpoint_dir is locked once), resolved, in order.

    >>> [p.name for p in distinct_dirs("/tmp/run", "/tmp/run/", "/tmp/logs")]
    ['run', 'logs']
    """
    out: list[Path] = []
    for d in dirs:
        p = Path(d).expanduser().resolve()
        if p not in out:
            out.append(p)
    return out


# --------------------------------------------------------------------------------------------------
# Fingerprint
# --------------------------------------------------------------------------------------------------
def flatten(cfg: dict, prefix: str = "") -> dict:
    """Nested config -> ``{"dotted.key": value}``.

    >>> flatten({"a": {"b": 1, "c": {"d": [2]}}, "e": None})
    {'a.b': 1, 'a.c.d': [2], 'e': None}
    """
    out = {}
    for k, v in cfg.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _mutable(key: str) -> bool:
    return any(key == m or (m.endswith(".") and key.startswith(m)) for m in RESUME_MUTABLE)


# Config keys that may name local files whose content a run trains on (fingerprinted by content, not path).
DATA_FILE_KEYS = ("data.dataset_name", "data.train_data_path", "data.val_data_path", "data.prompt_file",
                  "data.system_prompt_file")
FULL_HASH_BYTES = 64 << 20   # files up to this size are hashed whole; larger ones by size, head and tail
HEAD_TAIL_BYTES = 4 << 20
MAX_DIR_FILES = 1000


def file_fingerprint(path: str | os.PathLike) -> dict:
    """``{"size", "sha256"}`` of a file: the sha256 of its content up to `FULL_HASH_BYTES`, else of its first and
    last `HEAD_TAIL_BYTES` (``"hashed": "head+tail"``; with the size, a change anywhere but the middle shows).
    Read once per process for a given (path, size, mtime, inode): the claim and the record at setup hash it once."""
    st = Path(path).stat()
    return dict(_file_fingerprint(str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ino, FULL_HASH_BYTES,
                                  HEAD_TAIL_BYTES))


@functools.lru_cache(maxsize=64)
def _file_fingerprint(path: str, size: int, mtime_ns: int, inode: int, full_hash_bytes: int,
                      head_tail_bytes: int) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= full_hash_bytes:
            while chunk := f.read(1 << 20):
                h.update(chunk)
            return {"size": size, "sha256": h.hexdigest()}
        h.update(f.read(head_tail_bytes))
        f.seek(size - head_tail_bytes)
        h.update(f.read(head_tail_bytes))
    return {"size": size, "sha256": h.hexdigest(), "hashed": "head+tail"}


def data_fingerprint(cfg_flat: dict) -> dict:
    """``{"data.train_data_path": {"path", "size", "sha256"}, ...}`` for each of `DATA_FILE_KEYS` naming a local
    file; a local directory gets ``{"path", "files": {relative path: print}}`` of the files under it (the first
    `MAX_DIR_FILES`). Names that are not on disk (built-in tasks, hub names) are left out."""
    out = {}
    for key in DATA_FILE_KEYS:
        value = cfg_flat.get(key)
        if not isinstance(value, str) or not value:
            continue
        path = Path(value).expanduser()
        try:
            if path.is_file():
                out[key] = {"path": str(path.resolve()), **file_fingerprint(path)}
            elif path.is_dir():
                files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
                out[key] = {"path": str(path.resolve()), "files": {
                    p.relative_to(path).as_posix(): file_fingerprint(p) for p in files[:MAX_DIR_FILES]}}
        except OSError as err:  # unreadable: the data loader names it
            out[key] = {"path": str(path), "error": err.strerror or type(err).__name__}
    return out


def run_fingerprint(cfg_dict: dict) -> dict:
    """What makes a run this run: model, data, seed, and a sha256 of the config without `RESUME_MUTABLE`
    (``cfg.model_dump(mode="json")`` as given, before ``toy:`` model names are resolved to a directory).
    The reduced config itself rides along, so a mismatch can name the fields that differ. ``data_files``: the
    content of the local data files (`data_fingerprint`): the same path with other content is another run."""
    flat = {k: v for k, v in flatten(cfg_dict).items() if not _mutable(k)}
    data = {k[len("data."):]: flat.get(k) for k in ("data.dataset_name", "data.dataset_config", "data.train_data_path",
                                                    "data.val_data_path")}
    digest = hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()
    return {"model": flat.get("policy.model_name"), "data": data, "seed": flat.get("grpo.seed"),
            "config_sha256": digest, "config": flat, "data_files": data_fingerprint(flat)}


def data_diff(old: dict, new: dict) -> list[str]:
    """``"key path: what changed"`` for every local data file whose content differs between two fingerprints
    (none when ``old`` predates data fingerprints).

    >>> data_diff({"data_files": {"data.train_data_path": {"path": "/d.jsonl", "size": 10, "sha256": "a"}}},
    ...           {"data_files": {"data.train_data_path": {"path": "/d.jsonl", "size": 7, "sha256": "b"}}})
    ['data.train_data_path /d.jsonl: 10 bytes -> 7 bytes, other content']
    """
    if "data_files" not in old:
        return []
    a, b = old["data_files"], new.get("data_files", {})

    def show(d: dict) -> str:
        if "files" in d:
            return f"a directory of {len(d['files'])} files"
        return f"{d.get('size', '?')} bytes" if "size" in d else d.get("error", "?")

    out = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if x == y or (x is not None and y is not None and {**x, "path": ""} == {**y, "path": ""}):
            continue  # unchanged (a data directory that moved with its run is the same data)
        where = f"{key} {(y or x).get('path')}"
        if x is None or y is None:
            out.append(f"{where}: {'(not a local file)' if x is None else show(x)} -> "
                       f"{'(not a local file)' if y is None else show(y)}")
        elif show(x) != show(y):
            out.append(f"{where}: {show(x)} -> {show(y)}, other content")
        else:
            changed = ([f for f in sorted(set(x["files"]) | set(y["files"]))
                        if x["files"].get(f) != y["files"].get(f)] if "files" in x and "files" in y else [])
            out.append(f"{where}: other content" + (f" ({', '.join(changed[:3])})" if changed else ""))
    return out


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise RunDirError(f"{path}: unreadable ({err}); remove it if this directory is yours") from None


def write_fingerprint(directory: str | os.PathLike, fp: dict, run_id: str | None = None) -> str:
    """Record ``fp`` in ``<directory>/run_fingerprint.json`` (atomically); returns the run id: ``run_id`` when
    given, else the one recorded there, else a new one (the marker of this run's HF exports:
    `grpo.system.weights.export_hf`)."""
    path = Path(directory) / FINGERPRINT_FILE
    old = _read_json(path) or {}
    run_id = run_id or old.get("run_id") or uuid.uuid4().hex
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({**fp, "run_id": run_id}, indent=2, sort_keys=True))
    os.replace(tmp, path)
    return run_id


def recorded_run_id(directory: str | os.PathLike) -> str | None:
    """The run id recorded in ``directory`` (None: no fingerprint there), e.g. for ``--export-hf`` of its checkpoints.
    """
    fp = _read_json(Path(directory) / FINGERPRINT_FILE)
    return None if fp is None else fp.get("run_id")


def fingerprint_diff(old: dict, new: dict) -> list[str]:
    """``"key: old -> new"`` for every field of the reduced configs that differs, sorted by key.

    >>> fingerprint_diff({"config": {"a": 1, "b": 2}}, {"config": {"a": 1, "b": 3, "c": 0}})
    ['b: 2 -> 3', 'c: (absent) -> 0']
    """
    import reprlib

    a, b = old.get("config", {}), new.get("config", {})
    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxdict, short.maxstring, short.maxother = 2, 4, 4, 60, 60

    def show(d: dict, k: str) -> str:  # bounded: a long value never makes a long message
        return short.repr(d[k]) if k in d else "(absent)"

    missing = object()
    return [f"{k}: {show(a, k)} -> {show(b, k)}" for k in sorted(set(a) | set(b))
            if repr(a.get(k, missing)) != repr(b.get(k, missing))]


def has_run_output(directory: str | os.PathLike) -> bool:
    """Whether a run left something behind in ``directory``: a checkpoint (``step_N``) or logged steps."""
    d = Path(directory)
    if not d.is_dir():
        return False
    metrics = d / "metrics.jsonl"
    return (any(p.is_dir() and re.fullmatch(r"step_\d+", p.name) for p in d.iterdir())
            or (metrics.exists() and metrics.stat().st_size > 0))


def check_fingerprint(directory: str | os.PathLike, fp: dict, allow_change: bool = False) -> None:
    """Raise a `RunDirError` when ``directory`` holds the output of a run with another config (the first
    differing dotted fields named), unless ``allow_change`` (a deliberate change). No fingerprint yet, or a
    run that stopped before writing anything (a config error found at startup, then fixed): fine."""
    old = _read_json(Path(directory) / FINGERPRINT_FILE)
    if old is None or allow_change or not has_run_output(directory):
        return
    if old.get("config_sha256") == fp["config_sha256"]:
        changed = data_diff(old, fp)
        if changed:
            shown = "; ".join(changed[:3]) + (f"; and {len(changed) - 3} more" if len(changed) > 3 else "")
            raise RunDirError(
                f"{directory} belongs to a run that trained on other data under the same path ({shown}). Resuming "
                "would continue its data order over other prompts. Restore the data it trained on, use another "
                "checkpointing.checkpoint_dir / logger.log_dir, or, if the change is deliberate, set "
                "checkpointing.allow_config_change=true")
        return
    diff = fingerprint_diff(old, fp) + data_diff(old, fp)
    shown = "; ".join(diff[:5]) + (f"; and {len(diff) - 5} more" if len(diff) > 5 else "")
    raise RunDirError(
        f"{directory} belongs to a run with another config ({shown}). Resuming it with this config would mix two "
        "runs. Use another checkpointing.checkpoint_dir / logger.log_dir, or, if the change is deliberate, set "
        "checkpointing.allow_config_change=true")


def check_fresh_start(checkpoint_dir: str | os.PathLike) -> None:
    """``checkpointing.resume=false``: refuse a checkpoint directory that already holds checkpoints (a later
    resume would take whichever step is highest, this run's or the other's)."""
    d = Path(checkpoint_dir)
    found = d.iterdir() if d.is_dir() else []
    steps = sorted(p.name for p in found if p.is_dir() and re.fullmatch(r"step_\d+", p.name))
    if steps:
        raise RunDirError(
            f"checkpointing.resume=false but {d} holds checkpoints ({', '.join(steps[-3:])}): starting over there "
            "would mix two runs. Give this run a new checkpointing.checkpoint_dir, move the old checkpoints away, or "
            "set checkpointing.resume=true to continue that run")


def claim_run_dirs(checkpoint_dir: str | os.PathLike | None, log_dir: str | os.PathLike, cfg_dict: dict,
                   resume: bool, allow_change: bool = False) -> tuple[list[RunLock], str]:
    """Rank 0 at setup, before anything is written: lock the run's directories (``checkpoint_dir`` None: checkpointing
    is off), refuse a fresh start over checkpoints and check the fingerprint. Returns the locks (release them at the
    very end) and the run id (of the checkpoint directory, else of the log directory; new for a new run). On any
    error the locks taken are released and the error is raised. Nothing is written: `record_run_dirs` records the
    fingerprint once the run has really started (its newest checkpoint loaded), so that a resume refused after the
    claim (other LoRA settings under ``allow_change``, a checkpoint of another world size) leaves no config that
    never trained recorded as the run's."""
    dirs = distinct_dirs(*([checkpoint_dir] if checkpoint_dir is not None else []), log_dir)
    locks: list[RunLock] = []
    try:
        for d in dirs:
            locks.append(RunLock(d))
        if not resume and checkpoint_dir is not None:
            check_fresh_start(checkpoint_dir)
        fp = run_fingerprint(cfg_dict)
        for d in dirs:
            check_fingerprint(d, fp, allow_change)
        run_id = recorded_run_id(dirs[0]) or uuid.uuid4().hex
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks, run_id


def record_run_dirs(checkpoint_dir: str | os.PathLike | None, log_dir: str | os.PathLike, cfg_dict: dict,
                    run_id: str) -> None:
    """Record the fingerprint of ``cfg_dict`` (the config `claim_run_dirs` checked) in the run's directories: the
    first takes ``run_id``, the others keep the id they have (a new one takes ``run_id`` too)."""
    fp = run_fingerprint(cfg_dict)
    dirs = distinct_dirs(*([checkpoint_dir] if checkpoint_dir is not None else []), log_dir)
    for i, d in enumerate(dirs):
        write_fingerprint(d, fp, run_id if i == 0 else recorded_run_id(d) or run_id)


# Config keys that shape the weights an export writes from a checkpoint (`check_export_config`): the base model and
# its config, the dtype, the tokenizer saved beside the weights, and the LoRA settings the adapters were trained with
# (alpha scales the merged adapters; the others decide which tensors exist). Dropout, lora_A_init and everything
# else only change how the run trained, which the checkpoint already holds.
EXPORT_KEYS = ("policy.model_name", "policy.precision", "policy.hf_config_overrides", "policy.tokenizer.",
               "policy.trust_remote_code", "policy.lora.enabled", "policy.lora.dim", "policy.lora.alpha",
               "policy.lora.target_modules", "policy.lora.exclude_modules", "policy.lora.match_all_linear")


def _export_key(key: str) -> bool:
    return any(key == k or key.startswith(k if k.endswith(".") else k + ".") for k in EXPORT_KEYS)


WEIGHT_CONFIG_FILE = "weight_config.json"


def weight_config(cfg_dict: dict) -> dict:
    """The `EXPORT_KEYS` fields of a config (``cfg.model_dump(mode="json")`` as given, before ``toy:`` names are
    resolved), flattened: what each checkpoint records as ``weight_config.json`` (`grpo.system.checkpoint`).

    >>> weight_config({"policy": {"lora": {"alpha": 32, "dropout": 0.0}}, "grpo": {"seed": 1}})
    {'policy.lora.alpha': 32}
    """
    return {k: v for k, v in flatten(cfg_dict).items() if _export_key(k)}


def recorded_weight_config(checkpoint_dir: str | os.PathLike) -> tuple[dict, str] | None:
    """``(weight settings, where they were read)`` of the checkpoints in ``checkpoint_dir``: the newest ``step_N``'s
    ``weight_config.json`` (what those weights were trained with: a later run that failed at startup may have
    rewritten the fingerprint), else the run fingerprint's (checkpoints written before the record); None: neither."""
    d = Path(checkpoint_dir)
    steps = sorted((p for p in d.iterdir() if p.is_dir() and re.fullmatch(r"step_\d+", p.name)),
                   key=lambda p: int(p.name[5:])) if d.is_dir() else []
    for step in reversed(steps):
        recorded = _read_json(step / WEIGHT_CONFIG_FILE)
        if isinstance(recorded, dict):
            return recorded, str(step / WEIGHT_CONFIG_FILE)
    fp = _read_json(d / FINGERPRINT_FILE)
    if fp is None:
        return None
    return {k: v for k, v in fp.get("config", {}).items() if _export_key(k)}, str(d / FINGERPRINT_FILE)


def export_config_diff(directory: str | os.PathLike, cfg_dict: dict) -> list[str] | None:
    """``"key: checkpoint's value -> this config's value"`` for every `EXPORT_KEYS` field where the weight settings
    recorded in ``directory`` (`recorded_weight_config`) differ from ``cfg_dict`` (the export command's config);
    None when nothing is recorded.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> _ = write_fingerprint(d, run_fingerprint({"policy": {"lora": {"enabled": True, "alpha": 32, "dropout": 0.0}}}))
    >>> export_config_diff(d, {"policy": {"lora": {"enabled": True, "alpha": 64, "dropout": 0.1}}})
    ['policy.lora.alpha: 32 -> 64']
    """
    recorded = recorded_weight_config(directory)
    if recorded is None:
        return None
    old, new = recorded[0], weight_config(cfg_dict)
    lora_off = not old.get("policy.lora.enabled") and not new.get("policy.lora.enabled")

    def weight_keys(flat: dict) -> dict:  # without LoRA on either side its other settings shape nothing
        return {"config": {k: v for k, v in flat.items()
                           if not (lora_off and k.startswith("policy.lora.") and k != "policy.lora.enabled")}}

    return fingerprint_diff(weight_keys(old), weight_keys(new))


def claim_for_export(checkpoint_dir: str | os.PathLike, cfg_dict: dict, flag: str,
                     allow_change: bool = False) -> tuple[list[RunLock], str | None]:
    """Rank 0 of ``--export-hf`` / ``--export-adapter`` (``flag``), before anything is read: lock ``checkpoint_dir``
    (a live run holds it: refused at once, nothing touched; an export reads checkpoints the run may replace or
    prune) and check the export command's config against the run fingerprint (`export_config_diff`): a differing
    key is refused, naming it, unless ``allow_change`` (never for the policy.lora keys: the adapters only mean
    something with the settings they were trained with). Returns the lock (release it when the export is done) and
    the run id recorded there."""
    d = Path(checkpoint_dir)
    if not d.is_dir():
        raise RunDirError(f"{flag}: no checkpoint in {d} (no such directory)")
    try:
        lock = RunLock(d)
    except DirInUse as err:
        raise RunDirError(
            f"{flag}: {d} is in use by a running run ({err.who()}); an export while it runs could read a checkpoint "
            "the run is replacing or pruning. Export once it ends (SIGTERM makes it save and stop), or copy a "
            "step_N directory with its run_fingerprint.json elsewhere and export from there "
            "(checkpointing.checkpoint_dir=<the copy>)") from None
    try:
        diff = export_config_diff(d, cfg_dict)
        lora = [x for x in diff or [] if x.startswith("policy.lora.")]
        if diff and (lora or not allow_change):
            shown = "; ".join(diff[:6]) + (f"; and {len(diff) - 6} more" if len(diff) > 6 else "")
            raise RunDirError(
                f"{flag}: this command's config differs from the one the checkpoints in {d} were trained with, in keys "
                f"that shape the exported weights (checkpoint's -> this command's: {shown}), so the export would not "
                "be the model the run trained. "
                "Export with the run's settings (the command it trained with, plus the flag)" + (
                    "; the policy.lora keys cannot be overridden (the adapters only mean something with the "
                    "settings they were trained with)" if lora else
                    ", or add --export-allow-config-change if the change is deliberate"))
        return [lock], recorded_run_id(d)
    except BaseException:
        lock.release()
        raise
