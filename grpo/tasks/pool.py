"""Worker processes that run one task at a time with a per-task timeout; a hung worker is killed and replaced.

The reward scorers (`ScoringPool`: one sample per task) and the tool calls of `grpo.tasks.tools` (one call
per task) both run here: a pool is given a ``spec``, a ``load(spec)`` that each worker calls once to build
its callable, and a ``call(loaded, task)`` that runs one task (both module-level functions, so that they
pickle by reference).

Why our own small pool rather than `concurrent.futures`: a timeout must cost only the sample that hung.
Each worker takes one sample at a time, so the dispatcher knows when every sample started; a worker
past its deadline is killed (SIGKILL) and a fresh one is started in its place while the others keep
scoring. Workers use the "spawn" start method (the trainer process has torch threads: fork is unsafe)
and run the scorer in their main thread (math-verify's own timeouts use signals, which only work
there). Workers are started on the first `run`, import the scorer before they take work (import time
never counts against the timeout), ignore Ctrl-C (the trainer handles it), and never outlive the
trainer: Linux kills them (SIGKILL) when the trainer dies, however it dies (`set_parent_death_signal`),
even in the middle of a reward function that hangs. `check_reward_fn` imports a scorer in such a worker
with a timeout, so a module that hangs or raises at import cannot take the trainer with it.

Each worker has a private scratch root, a directory the pool makes before it starts the worker and removes
(`remove_tree`) after the worker has exited or been killed, and when the pool closes (or, left open, when the
trainer exits): the worker's temporary files (``tempfile.gettempdir()`` and ``TMPDIR`` point there, so the
sandboxed ``python`` tool's per-call scratch directories live there too) cannot outlive it, whatever the code
did before it was killed. The roots of one pool sit in a ``grpo-pool-*`` directory of the trainer's temp dir,
locked (``flock``) by the trainer; a new pool removes those whose trainer died without closing them (kill -9).

An outcome is ``("ok", call's return value)`` (scoring: ``(reward, components)``), ``("error", CallError)``
or ``("timeout", text)``. A `CallError` is classified in the worker, where the exception still exists (NeMo-RL's
rule: classify before crossing a process boundary, `grpo.tasks.failures.classify_exception`): its class
(``infra`` / ``data``), the HTTP status it carried, and its traceback; ``str()`` of it is the traceback. A worker
that dies in a call (a crash, the out-of-memory killer) is an infra error, as NeMo-RL counts a crashed worker.
"""

from __future__ import annotations

import ctypes
import fcntl
import multiprocessing as mp
import os
import signal
import stat
import sys
import tempfile
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Callable

from grpo.tasks.failures import classify_exception, http_status
from grpo.tasks.function import EnvError, resolve_reward_fn, score_sample
from grpo.trajectory import INFRA

Outcome = tuple[str, Any]
PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class CallError:
    """What a call raised: its class (``"infra"`` / ``"data"``), the HTTP status its exception carried (or None)
    and its traceback text (also its ``str()``)."""

    kind: str
    detail: str
    status: int | None = None

    def __str__(self) -> str:
        return self.detail

    @classmethod
    def of(cls, err: BaseException) -> CallError:
        """The error of ``err``, being handled now (its traceback is the current one).

            >>> try:
            ...     raise ConnectionRefusedError("judge down")
            ... except OSError as err:
            ...     e = CallError.of(err)
            >>> e.kind, e.status, str(e).splitlines()[-1]
            ('infra', None, 'ConnectionRefusedError: judge down')
        """
        return cls(classify_exception(err), traceback.format_exc(), http_status(err))


def set_parent_death_signal(sig: int = signal.SIGKILL, expected_parent: int | None = None) -> bool:
    """Have Linux send ``sig`` to this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``): call it first
    thing in a child. With ``expected_parent``, exits at once when the parent is already gone (it may die
    before the call). Returns False where prctl does not exist (not Linux).

    Linux sends the signal when the THREAD that started the child ends: start child processes from a thread
    that lives as long as the trainer (the main thread, or a thread joined only at the end of the run).
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)
    return True


def _worker_main(conn: Connection, spec: Any, load: Callable, call: Callable, parent_pid: int | None = None,
                 scratch_root: str | None = None) -> None:
    """Worker loop: ``load(spec)``, say "ready", then run ``call(loaded, task)`` per message until None/EOF.
    Temporary files go beneath ``scratch_root``, which the pool removes when this worker is gone."""
    set_parent_death_signal(signal.SIGKILL, expected_parent=parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if scratch_root is not None:
        tempfile.tempdir = os.environ["TMPDIR"] = scratch_root
    try:
        fn = load(spec)
    except EnvError as err:  # a message with the module's traceback summary
        conn.send(("init_error", str(err)))
        return
    except BaseException:
        conn.send(("init_error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            sample = conn.recv()
        except (EOFError, OSError):  # the trainer went away
            return
        if sample is None:
            return
        try:
            result = ("ok", call(fn, sample))
        except BaseException as err:  # noqa: BLE001 - SystemExit from the user's code costs only its sample
            result = ("error", CallError.of(err))
        try:
            conn.send(result)
        except Exception as err:  # the result cannot be pickled
            conn.send(("error", CallError.of(err)))


@dataclass
class _Worker:
    process: BaseProcess
    conn: Connection
    started_at: float
    ready: bool = False
    task: int | None = None  # index of the sample it is scoring
    deadline: float = 0.0
    scratch: str | None = None  # its private scratch root, removed when it is gone


class WorkerPool:
    """``num_workers`` spawned processes running ``call(load(spec), task)``; by default the scorer ``spec``
    ("package.module:function") on samples. ``what`` and ``timeout_key`` name the work and the config key of
    the timeout in messages."""

    def __init__(self, spec: Any, num_workers: int, timeout_s: float, start_timeout_s: float = 300.0, *,
                 load: Callable = resolve_reward_fn, call: Callable = score_sample, what: str = "reward",
                 timeout_key: str = "env.timeout_s"):
        self.spec = spec
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.load, self.call, self.what, self.timeout_key = load, call, what, timeout_key
        self.num_restarts = 0
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        self._root: str | None = None  # the grpo-pool-* directory holding the workers' scratch roots

    # -- lifecycle ---------------------------------------------------------------------------------
    def _start_worker(self) -> _Worker:
        if self._root is None:
            remove_stale_pool_roots(tempfile.gettempdir())
            self._root, lock = _make_pool_root()
            self._remove_root = weakref.finalize(self, _remove_pool_root, self._root, lock)  # or at exit
        scratch = tempfile.mkdtemp(prefix="worker-", dir=self._root)
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=_worker_main,
                                    args=(child_conn, self.spec, self.load, self.call, os.getpid(), scratch),
                                    daemon=True, name=f"grpo-{self.what}-worker")
        process.start()
        child_conn.close()
        return _Worker(process, parent_conn, started_at=time.monotonic(), scratch=scratch)

    def _kill(self, worker: _Worker) -> None:
        worker.process.kill()
        worker.process.join(timeout=10)
        worker.conn.close()
        remove_tree(worker.scratch)  # the kernel kills the worker's sandboxes with it (parent-death signal)

    def _replace(self, worker: _Worker) -> None:
        self._kill(worker)
        self._workers[self._workers.index(worker)] = self._start_worker()
        self.num_restarts += 1

    def start(self, wait: bool = False) -> None:
        """Start the missing workers (`run` does it lazily); ``wait=True`` blocks until all are ready."""
        while len(self._workers) < self.num_workers:
            self._workers.append(self._start_worker())
        while wait and not all(w.ready for w in self._workers):
            self._receive([])
            self._expire([])

    def close(self) -> None:
        """Stop every worker (politely, then by force)."""
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        for w in self._workers:
            w.process.join(timeout=2)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(timeout=10)
            w.conn.close()
        self._workers = []
        if self._root is not None:
            self._remove_root()
            self._root = None

    # -- running -----------------------------------------------------------------------------------
    def run(self, samples: list) -> list[Outcome]:
        """Run every task (sample); returns one outcome per task, in order. Never hangs past the timeouts."""
        if not samples:
            return []
        outcomes: list[Outcome | None] = [None] * len(samples)
        pending = deque(range(len(samples)))
        try:
            self.start()
            while pending or any(w.task is not None for w in self._workers):
                self._dispatch(samples, pending, outcomes)
                self._receive(outcomes)
                self._expire(outcomes)
        except BaseException:  # EnvError, Ctrl-C: no worker may keep a stale task; the next run restarts them
            self.close()
            raise
        return outcomes  # type: ignore[return-value]

    def _dispatch(self, samples: list[dict], pending: deque, outcomes: list) -> None:
        for w in self._workers:
            if not pending or not w.ready or w.task is not None:
                continue
            i = pending.popleft()
            try:
                w.conn.send(samples[i])
            except (BrokenPipeError, EOFError, OSError):  # died while idle: requeue, replace
                pending.appendleft(i)
                self._replace(w)
                continue
            except Exception as err:  # the sample itself cannot be pickled
                outcomes[i] = ("error", CallError.of(err))
                continue
            w.task, w.deadline = i, time.monotonic() + self.timeout_s

    def _next_deadline(self) -> float:
        deadlines = [w.deadline if w.task is not None else w.started_at + self.start_timeout_s
                     for w in self._workers if w.task is not None or not w.ready]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else 0.0

    def _receive(self, outcomes: list) -> None:
        waiting = {w.conn: w for w in self._workers if w.task is not None or not w.ready}
        if not waiting:
            return
        for conn in wait(list(waiting), timeout=self._next_deadline()):
            w = waiting[conn]
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):  # the worker died (crash, os._exit, out of memory)
                w.process.join(timeout=10)
                if not w.ready:
                    raise EnvError(f"{self.what} worker for {self.spec!r} died while starting "
                                   f"(exit code {w.process.exitcode})") from None
                outcomes[w.task] = ("error", CallError(INFRA, f"{self.what} worker process died (exit code "
                                                              f"{w.process.exitcode})"))
                self._replace(w)
                continue
            if kind == "init_error":
                raise EnvError(f"{self.what} worker cannot load {self.spec!r}:\n{payload}")
            if kind == "ready":
                w.ready = True
            else:
                outcomes[w.task] = (kind, payload)
                w.task = None

    def _expire(self, outcomes: list) -> None:
        now = time.monotonic()
        for w in list(self._workers):
            if w.task is not None and now >= w.deadline:
                outcomes[w.task] = ("timeout", f"no {self.what} after {self.timeout_key}={self.timeout_s}s; "
                                               "worker restarted")
                self._replace(w)
            elif not w.ready and now >= w.started_at + self.start_timeout_s:
                raise EnvError(f"{self.what} worker for {self.spec!r} did not start within {self.start_timeout_s}s: "
                               "importing its module hangs or is too slow (keep the module's import cheap)")

    def pids(self) -> list[int]:
        """Process ids of the live workers."""
        return [w.process.pid for w in self._workers if w.process.is_alive()]

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the daemon workers die with us anyway
            pass


# --------------------------------------------------------------------------------------------------
# Scratch directories
# --------------------------------------------------------------------------------------------------
_POOL_ROOT_PREFIX, _LOCK = "grpo-pool-", ".lock"


def _make_pool_root() -> tuple[str, int]:
    """A new ``grpo-pool-*`` directory in the temp dir and the fd of its ``.lock``, flock-ed: the lock file
    gets its name only once locked, so `remove_stale_pool_roots` never takes a pool that is being made."""
    root = tempfile.mkdtemp(prefix=_POOL_ROOT_PREFIX)
    fd = os.open(os.path.join(root, _LOCK + ".new"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(os.path.join(root, _LOCK + ".new"), os.path.join(root, _LOCK))
    return root, fd


def _remove_pool_root(root: str, lock_fd: int) -> None:
    remove_tree(root)
    os.close(lock_fd)


def remove_stale_pool_roots(temp_dir: str) -> None:
    """Remove the ``grpo-pool-*`` directories of ``temp_dir`` whose lock nobody holds (their trainer died)."""
    try:
        names = [n for n in os.listdir(temp_dir) if n.startswith(_POOL_ROOT_PREFIX)]
    except OSError:
        return
    for name in names:
        root = os.path.join(temp_dir, name)
        try:
            fd = os.open(os.path.join(root, _LOCK), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # not ours, or a pool being made
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            remove_tree(root)
        except OSError:  # held: a live pool
            pass
        finally:
            os.close(fd)


def remove_tree(path: str | None, patience_s: float = 5.0) -> bool:
    """Remove ``path`` and everything beneath it; True when it is gone. Never raises and never follows a
    symlink (a link to a file or directory elsewhere is removed, not its target). Whatever tree the code
    built: no recursion (10,000 nested directories are fine; `shutil.rmtree` of Python 3.11 raises
    RecursionError past ~1,000) and two file descriptors at a time (it climbs back through ``..``, checking
    it is where it came from); directories it cannot enter or empty (``chmod 000``) are given ``rwx`` for their
    owner first. While something still writes into the tree (a process that is being killed), it starts
    again, for up to ``patience_s`` seconds.

    >>> d = tempfile.mkdtemp(); os.makedirs(os.path.join(d, "a", "b")); os.chmod(os.path.join(d, "a"), 0)
    >>> remove_tree(d), os.path.exists(d)
    (True, False)
    """
    if path is None:
        return True
    deadline, delay = time.monotonic() + patience_s, 0.01
    while True:
        try:
            _remove_tree_once(os.path.abspath(path))
        except Exception:  # something changed under us, or cannot be removed: look again
            pass
        if not os.path.lexists(path):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(2 * delay, 0.5)


def _remove_tree_once(path: str) -> None:
    parent, name = os.path.split(path)
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)
            return
    except FileNotFoundError:
        return
    parent_fd = os.open(parent or "/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fd = None
    try:
        fd = _open_dir(parent_fd, name)
        # Depth first, without recursion: per level above and at fd, the directory's name in its parent, its
        # (st_dev, st_ino), and the subdirectories left to remove (None: list it again).
        levels: list[list] = [[name, _identity(fd), None]]
        while True:
            level = levels[-1]
            if level[2] is None:
                level[2] = _remove_entries(fd)
                if not level[2]:  # empty: climb back and remove it
                    levels.pop()
                    if not levels:
                        os.close(fd)
                        fd = None
                        os.rmdir(name, dir_fd=parent_fd)
                        return
                    up = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
                    os.close(fd)
                    fd = up
                    if _identity(fd) != levels[-1][1]:
                        raise OSError(f"{path}: the tree moved while it was removed")
                    os.rmdir(level[0], dir_fd=fd)
            elif level[2]:
                child = level[2].pop()
                try:
                    child_fd = _open_dir(fd, child)
                except (FileNotFoundError, NotADirectoryError):  # gone, or replaced: the next listing sees it
                    continue
                os.close(fd)
                fd = child_fd
                levels.append([child, _identity(fd), None])
            else:  # every subdirectory listed is gone: list again (new entries?) before removing it
                level[2] = None
    finally:
        if fd is not None:
            os.close(fd)
        os.close(parent_fd)


def _open_dir(dir_fd: int, name: str) -> int:
    """An fd of the directory ``name`` in ``dir_fd`` (never a symlink's target), made ``rwx`` for its owner."""
    flags = os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(name, os.O_RDONLY | flags, dir_fd=dir_fd)
    except PermissionError:  # chmod 000 and we are not root: chmod it through an O_PATH fd of it
        path_fd = os.open(name, os.O_PATH | flags, dir_fd=dir_fd)
        try:
            os.chmod(f"/proc/self/fd/{path_fd}", 0o700)
            fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=path_fd)
        finally:
            os.close(path_fd)
    try:
        os.chmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) | 0o700)  # to remove its entries (r-x is not enough)
    except OSError:
        pass
    return fd


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _remove_entries(fd: int) -> list[str]:
    """Unlink every entry of the directory ``fd`` but its subdirectories; their names."""
    subdirs = []
    with os.scandir(fd) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                subdirs.append(entry.name)
                continue
            try:
                os.unlink(entry.name, dir_fd=fd)
            except FileNotFoundError:
                pass
            except IsADirectoryError:  # replaced by a directory since the listing
                subdirs.append(entry.name)
    return subdirs


# The reward scorers' pool (its original name).
ScoringPool = WorkerPool


# Seconds at least that `check_reward_fn` gives a worker to start at setup, whatever env.timeout_s (one call's
# limit) says: a spawned Python importing torch or a verifier takes seconds, more on a loaded machine (a 1 s
# env.timeout_s made a run fail at startup under load), and the pool's own workers get 300.
MIN_IMPORT_TIMEOUT_S = 60.0


def check_reward_fn(spec: str, timeout_s: float) -> None:
    """Import the scorer ``spec`` ("package.module:function") in a spawned worker process and raise `EnvError`
    when that fails (the message carries the module's traceback summary) or takes more than ``timeout_s``
    seconds (a module that hangs at import): the trainer itself never imports user reward code. Setup passes
    ``max(env.timeout_s, MIN_IMPORT_TIMEOUT_S)``."""
    pool = ScoringPool(spec, num_workers=1, timeout_s=timeout_s, start_timeout_s=timeout_s)
    try:
        pool.start(wait=True)
    finally:
        pool.close()
