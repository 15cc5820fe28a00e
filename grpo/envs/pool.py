"""Worker processes that run one task at a time with a per-task timeout; a hung worker is killed and replaced.

The reward scorers (`ScoringPool`: one sample per task) and the tool calls of `grpo.envs.tools` (one call
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
trainer: Linux kills them (SIGKILL) when the trainer dies, however it dies (`grpo.signals.set_parent_death_signal`),
even in the middle of a reward function that hangs. `check_reward_fn` imports a scorer in such a worker
with a timeout, so a module that hangs or raises at import cannot take the trainer with it.

An outcome is ``("ok", call's return value)`` (scoring: ``(reward, components)``), ``("error", traceback
text)`` or ``("timeout", text)``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from grpo.envs.function import EnvError, resolve_reward_fn, score_sample
from grpo.signals import set_parent_death_signal

Outcome = tuple[str, Any]


def _worker_main(conn: Connection, spec: Any, load: Callable, call: Callable, parent_pid: int | None = None) -> None:
    """Worker loop: ``load(spec)``, say "ready", then run ``call(loaded, task)`` per message until None/EOF."""
    set_parent_death_signal(signal.SIGKILL, expected_parent=parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
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
            conn.send(("ok", call(fn, sample)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


@dataclass
class _Worker:
    process: Any
    conn: Connection
    started_at: float
    ready: bool = False
    task: int | None = None  # index of the sample it is scoring
    deadline: float = 0.0


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

    # -- lifecycle ---------------------------------------------------------------------------------
    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=_worker_main,
                                    args=(child_conn, self.spec, self.load, self.call, os.getpid()),
                                    daemon=True, name=f"grpo-{self.what}-worker")
        process.start()
        child_conn.close()
        return _Worker(process, parent_conn, started_at=time.monotonic())

    def _kill(self, worker: _Worker) -> None:
        worker.process.kill()
        worker.process.join(timeout=10)
        worker.conn.close()

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
            except Exception:  # the sample itself cannot be pickled
                outcomes[i] = ("error", traceback.format_exc())
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
                outcomes[w.task] = ("error", f"{self.what} worker process died (exit code {w.process.exitcode})")
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


# The reward scorers' pool (its original name).
ScoringPool = WorkerPool


def check_reward_fn(spec: str, timeout_s: float) -> None:
    """Import the scorer ``spec`` ("package.module:function") in a spawned worker process and raise `EnvError`
    when that fails (the message carries the module's traceback summary) or takes more than ``timeout_s``
    seconds (a module that hangs at import): the trainer itself never imports user reward code."""
    pool = ScoringPool(spec, num_workers=1, timeout_s=timeout_s, start_timeout_s=timeout_s)
    try:
        pool.start(wait=True)
    finally:
        pool.close()
