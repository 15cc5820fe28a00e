"""One attempt of one sample's agent (`grpo.wings.agents.environment`), run where the run can stop waiting for it, whatever it does.

Each attempt runs in a daemon thread of its own, on an event loop of its own (`AgentCall`). The run waits for it with
a deadline from its own thread (`grpo.wings.agents.player`), so neither ``env.agent.timeout_s`` nor a stop signal
depends on the agent giving control back: an ``async def`` agent that calls ``time.sleep`` or spins in sync code
blocks only its own loop. Past its deadline an attempt is *abandoned* (`AgentCall.abandon`): its task is cancelled
(an agent that awaits stops at once, its ``async with`` blocks closing what they opened), a program's process group
is killed (SIGKILL: a program that ignores SIGTERM goes too), and a thread still running a little later gets
`AgentAbandoned` raised at its next Python instruction (`AgentCall.interrupt`): one that spins in Python stops then,
one blocked in a sync call when the call returns.

Why a thread and not a process per attempt: agents are many small I/O-bound clients (the demo runs 128 at once),
and a Python process with ``openai`` imported costs about 0.6 s of CPU and 60 MB each; a thread costs neither. What
no thread can bound: code that holds the GIL in C without returning (the trainer stalls with it), ``os._exit``, a
crash. An agent that may do those is a program (``env.agent.command``): its own process group, killed at its
deadline.

An attempt's loop (`AgentLoop`) closes the connections opened on it when it closes, so a client the agent never
closed (an ``AsyncOpenAI`` without ``async with``) cannot outlive it with sockets of a closed loop: the openai client
closes itself when it is collected, on whatever loop is running then, which ended in ``RuntimeError: Event loop is
closed`` tracebacks in the run's output.

A program (`run_program`) gets the row as JSON on stdin and prints its result as JSON on its last stdout line; its
output is read as it comes, keeping the last `MAX_RESULT_BYTES` of stdout (the result line) and the last
`MAX_STDERR_BYTES` of stderr (for the message when it fails): a program that prints without end costs the trainer
no more than those.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import threading
import traceback
import weakref
from typing import Any, Awaitable, Callable

MAX_RESULT_BYTES = 1 << 20  # the end of a program's stdout kept: its last line is the result
MAX_STDERR_BYTES = 64 << 10  # the end of its stderr kept: the message of a program that failed
STDERR_CHARS_SHOWN = 2000


class AgentAbandoned(BaseException):
    """Raised inside an abandoned attempt's thread (`AgentCall.interrupt`): a BaseException, so an agent's ``except
    Exception`` does not swallow it."""


class ProgramFailed(RuntimeError):
    """A program exited with a non-zero status (its sample's ``env_error``, a data failure)."""


class ProgramOutputError(ValueError):
    """A program's last stdout line is not a result (its sample's ``env_malformed``)."""


class AgentLoop(asyncio.SelectorEventLoop):
    """An attempt's event loop: closing it first closes the connections opened on it (``create_connection``, which
    asyncio's streams, anyio, httpx and aiohttp open theirs with) that are still open."""

    def __init__(self):
        super().__init__()
        self._opened: weakref.WeakSet = weakref.WeakSet()

    async def create_connection(self, *args, **kwargs):
        transport, protocol = await super().create_connection(*args, **kwargs)
        self._opened.add(transport)
        return transport, protocol

    def close(self) -> None:
        if not self.is_running() and not self.is_closed():
            still_open = [t for t in self._opened if not t.is_closing()]
            for transport in still_open:
                transport.abort()  # a later close of it (the client's own, when collected) is then a no-op
            if still_open:
                self.run_until_complete(asyncio.sleep(0))  # their sockets close in connection_lost callbacks
        super().close()


class AgentCall:
    """``attempt(call)`` (a coroutine function) run in a daemon thread on an `AgentLoop`; ``on_done(call)`` is
    called from that thread when it ends, after ``value`` (what it returned) or ``error`` (what it raised, with its
    ``traceback`` text) is set. The caller waits, and `abandon` s it when it stops waiting."""

    def __init__(self, attempt: Callable[[AgentCall], Awaitable[Any]], on_done: Callable[[AgentCall], None]):
        self.value: Any = None
        self.error: BaseException | None = None
        self.traceback = ""
        self.abandoned = False
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._pid: int | None = None  # a program's process group
        self._thread = threading.Thread(target=self._main, args=(attempt, on_done), name="grpo-agent", daemon=True)
        self._thread.start()

    def _main(self, attempt, on_done) -> None:
        try:
            with asyncio.Runner(loop_factory=AgentLoop) as runner:
                self.value = runner.run(self._run(attempt))
        except BaseException as err:  # noqa: BLE001 - the agent's own, or its cancellation when abandoned
            self.error, self.traceback = err, traceback.format_exc()
        finally:
            try:
                on_done(self)
            except AgentAbandoned:
                pass

    async def _run(self, attempt):
        with self._lock:
            self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
            if self.abandoned:
                raise asyncio.CancelledError
        return await attempt(self)

    def own_process(self, pid: int) -> None:
        """The attempt started a program (process group ``pid``): `abandon` kills it."""
        with self._lock:
            self._pid = pid
            abandoned = self.abandoned
        if abandoned:
            kill_group(pid)

    def abandon(self) -> None:
        """Stop the attempt the caller no longer waits for: its task cancelled (from this thread, safely), its
        program's process group killed. Returns at once, whatever the agent is doing."""
        with self._lock:
            self.abandoned = True
            loop, task, pid = self._loop, self._task, self._pid
        if pid is not None:
            kill_group(pid)
        if loop is not None and task is not None:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # its loop is closed: the attempt has ended
                pass

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the thread to end; whether it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def interrupt(self) -> None:
        """Raise `AgentAbandoned` in the thread at its next Python instruction (CPython's
        ``PyThreadState_SetAsyncExc``): for an abandoned attempt that did not end when cancelled."""
        ident = self._thread.ident
        if ident is not None and self._thread.is_alive():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(AgentAbandoned))


def kill_group(pid: int) -> None:
    """SIGKILL to process group ``pid`` (a program and what it started); nothing when it is gone."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------------------------------------------------- programs
async def run_program(command: list[str], row: dict, env: dict[str, str], call: AgentCall) -> Any:
    """Run ``command`` (in a session of its own, so its process group can be killed) with ``row`` as JSON on stdin;
    the JSON of its last non-blank stdout line. `ProgramFailed` when it exits non-zero (the end of its stderr in the
    message), `ProgramOutputError` when that line is not JSON or longer than `MAX_RESULT_BYTES`."""
    proc = await asyncio.create_subprocess_exec(*command, stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                env=env, start_new_session=True)
    call.own_process(proc.pid)
    try:
        (out, out_cut), (err, _), _ = await asyncio.gather(read_tail(proc.stdout, MAX_RESULT_BYTES),
                                                           read_tail(proc.stderr, MAX_STDERR_BYTES),
                                                           feed(proc.stdin, json.dumps(row).encode()))
        await proc.wait()
    except BaseException:  # cancelled (the deadline, the run stopping): the program and its children go
        kill_group(proc.pid)
        await proc.wait()
        raise
    if proc.returncode != 0:
        raise ProgramFailed(f"env.agent.command {command} exited with status {proc.returncode}; the end of its "
                            f"stderr:\n{err.decode(errors='replace')[-STDERR_CHARS_SHOWN:]}")
    line = last_line(out, out_cut)
    if line is None:
        return None
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        raise ProgramOutputError(f"env.agent.command {command} printed {line[:300]!r} last: expected its result "
                                 "as JSON on its last stdout line") from None


async def feed(stdin: asyncio.StreamWriter, data: bytes) -> None:
    """Write ``data`` to a program's stdin and close it; a program that exits without reading it is not an error
    here (its exit status says what happened)."""
    try:
        stdin.write(data)
        await stdin.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        stdin.close()


async def read_tail(stream: asyncio.StreamReader, limit: int) -> tuple[bytes, bool]:
    """Read ``stream`` to its end keeping only its last ``limit`` bytes: ``(tail, cut)``, ``cut`` when bytes
    before the tail were dropped."""
    tail, cut = bytearray(), False
    while chunk := await stream.read(1 << 16):
        tail += chunk
        if len(tail) > limit:
            del tail[:-limit]
            cut = True
    return bytes(tail), cut


def last_line(tail: bytes, cut: bool) -> str | None:
    """The last non-blank line of a program's stdout from its tail (`read_tail`), or None when it printed none;
    `ProgramOutputError` when that line began before the tail (it is longer than the tail kept).

        >>> last_line(b"log\\n{\\"reward\\": 1}\\n\\n", cut=True), last_line(b" \\n", cut=False)
        ('{"reward": 1}', None)
    """
    text = tail.rstrip()
    if not text:
        return None
    start = max(text.rfind(b"\n"), text.rfind(b"\r")) + 1
    if start == 0 and cut:
        raise ProgramOutputError(f"env.agent.command's last stdout line is longer than the {len(tail)} bytes kept: "
                                 "expected its result as one JSON line")
    return text[start:].decode(errors="replace")
