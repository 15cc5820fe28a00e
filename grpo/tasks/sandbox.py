"""The built-in ``python`` code tool (``env.tools: ["grpo.tasks.sandbox:python"]``): code runs in a sandbox.

Each call writes the code to ``main.py`` in a fresh scratch directory (``work`` in a private 0700
directory made for the call; both removed afterwards) and runs ``python -I -B -u main.py`` there
(unbuffered: stdout and stderr interleave in program order), through two steps of
`grpo.tasks.sandbox_child` run as a script:

1. a launcher (the process group leader, killed with its group at the wall-clock limit, and by the
   kernel when the tool worker that started it dies) that enters new user, mount, network, PID, IPC and
   UTS namespaces where the OS allows it, then forks an init: PID 1 of the new PID namespace, which
   remounts every mount of its mount namespace but the scratch directory read-only, forks the code's
   process and reports how the code ended; when it exits or is killed, every process in the namespace dies;
2. the code's process, forked by the init, which sets the resource limits, confines itself with
   Landlock, installs a seccomp filter, drops every capability and execs the interpreter on ``main.py``.

What it enforces, and where:

- **writes only inside the scratch directory** (Landlock, Linux >= 5.13 with Landlock enabled): creating,
  writing, truncating, renaming or deleting anything elsewhere fails, whatever the file permissions say
  and whether the process runs as root or not: with PermissionError from Landlock, or first with OSError
  EROFS where the read-only mounts below hold (most writes: the kernel checks the mount first). **Reads
  and execution** are allowed only beneath the Python installation (``sys.prefix``, ``sys.base_prefix``,
  the stdlib and site-packages), ``/usr``, ``/lib*``, ``/bin``, ``/sbin``, ``/dev/{null,zero,full,random,urandom}`` (not
  the disks: a raw block device would bypass every rule), a few files of ``/etc`` (the loader
  cache, localtime, passwd, group), the code process's own ``/proc/self``, ``/proc/cpuinfo``,
  ``/proc/meminfo``, ``/sys/devices/system/cpu`` and the scratch directory, so files elsewhere (the home
  directory, ``/tmp``, the training data, keys in ``~/.cache``, ``/etc/shadow``, other processes'
  ``/proc`` entries) cannot be read. Where Landlock is missing, `run_python` refuses to run code
  (``require_landlock=True``, the default) and the call returns an error.
- **no metadata changes outside the scratch directory** (Landlock does not cover chmod, chown, utime or
  xattrs): in a new mount namespace (with the user namespace, or as root without one) every mount is
  made private (nothing propagates to or from the host), the scratch directory is bind-mounted onto
  itself (read-write, nosuid, nodev) and every other mount point of /proc/self/mountinfo is remounted
  read-only (keeping the nosuid/nodev/noexec/atime flags a user namespace locks), so ``chmod``,
  ``utime``, ``setxattr`` and writes anywhere else fail with OSError EROFS ("Read-only file system"),
  also through a descriptor opened read-only (``fchmod`` of a file under ``/usr``, of ``/dev/null``), and
  hard links into the scratch directory fail with EXDEV; ``/dev/null`` stays writable (a device). Inside
  the scratch directory everything works (files, ``chmod +x`` and run, ``shutil.copy``, ``os.utime``).
  A mount hidden under another one at the same path cannot be reached and stays as it was. The code
  cannot undo this: it has no capability, Landlock forbids mount changes, and a user namespace it makes
  inherits the mounts locked read-only. ``SandboxResult.isolation``: ``mountns``, ``readonly_root`` (True
  when every reachable mount was made read-only; else ``writable_mounts`` or ``mount_error`` says what
  did not). Independently of the mounts, the seccomp filter refuses (EPERM) ``chmod``/``fchmod``/
  ``fchmodat``/``fchmodat2`` with S_ISUID or S_ISGID in the mode and the whole chown family (``chown``,
  ``fchown``, ``lchown``, ``fchownat``), wherever the file lies. A setuid file can still be *created*
  in the scratch directory (``open(path, O_CREAT, 0o4755)``, ``mknod``): inside the sandbox it grants
  nothing (nosuid mount, ``no_new_privs``), and outside it lies in the 0700 directory that the code
  cannot chmod (it is read-only to it) until it is removed.
- **no network**: a new network namespace has no interface but a loopback that is down, so no packet
  leaves or arrives (needs user namespaces or root). With Landlock ABI >= 4, TCP bind/connect are
  also denied. Where neither is available, the code has the network.
- **no socket but IP ones** (a seccomp filter, `sandbox_child.seccomp_program`; x86_64 and aarch64, and on
  another architecture the code does not run): ``socket()`` succeeds only for AF_INET and AF_INET6, which
  the network namespace isolates; AF_UNIX (Unix sockets on the filesystem, which neither Landlock nor the
  namespace covers: ``/var/run/docker.sock``, a trainer's sockets), AF_VSOCK (the hypervisor), AF_NETLINK,
  AF_PACKET and every other family fail with PermissionError when the socket is made. ``socketpair()``
  fails too: asyncio's event loop needs one, so ``asyncio.run`` fails unless
  ``SandboxLimits.allow_socketpair`` allows connected SOCK_STREAM pairs (they cannot address another
  socket: connect and sendto answer EISCONN); SOCK_DGRAM pairs, which could ``sendto`` any socket path,
  stay refused. The filter checks the ABI before the syscall number: a syscall through another one
  (``int 0x80`` into the i386 table, where socket is 359 and socketcall 102; x32 numbers) kills the
  process with SIGSYS. io_uring, which makes sockets without ``socket()`` (IORING_OP_SOCKET), fails
  with PermissionError.
- **nothing left on disk**: the scratch directory is removed after each call by `grpo.tasks.pool.remove_tree`
  (no recursion, so thousands of nested directories are fine; never follows a symlink; enters
  ``chmod 000`` directories; starts again while a dying process still writes). In a tool worker it lies
  beneath the worker's private scratch root, which the pool removes when it kills the worker at
  ``env.tool_timeout_s`` (the kernel kills the worker's sandboxes with it, before this module's own
  clean-up could run) and when it closes; a trainer killed with SIGKILL leaves its ``grpo-pool-*``
  directory in the temp dir, which the next pool to start removes.
- **limits**: CPU seconds (SIGXCPU, then SIGKILL), address space (MemoryError), the size of any file
  written, open files, no core dumps. The number of tasks (processes + threads): ``max_processes`` by
  RLIMIT_NPROC inside a new user namespace when the trainer does not run as root (uid 0 is exempt from
  it), and the new PID namespace's ``pid_max`` (Linux >= 6.14, at least 301), which binds root too;
  ``SandboxResult.isolation["max_tasks"]`` says which bound held. The output is read up to
  ``max_output_bytes`` and the code is killed past it. A wall-clock limit kills the whole process group;
  in a new PID namespace that also ends every process the code started (a fork bomb or an infinite loop
  costs only the call).
- **isolation from the trainer**: a new PID namespace and Landlock's scoping (ABI >= 6) keep the code
  from signalling other processes; Landlock forbids ptrace of processes outside the sandbox and mounts;
  every capability is dropped and ``no_new_privs`` set; the environment holds only PATH, HOME, TMPDIR and
  LANG; stdin is /dev/null.

What it does **not** protect against: kernel exploits (this is not a VM or gVisor); reading the files
in the allowed directories (the Python installation, ``/usr``; the code runs as the trainer's user, root
here, so file permissions stop little); memory across processes (the address-space limit is per
process: up to ``max_tasks`` x ``memory_mb`` in all, there is no cgroup); CPU use by many processes
in parallel until the wall-clock limit (a fork bomb run as root on Linux >= 6.14 holds ~300 processes
for at most ``wall_s``); disk use in the scratch directory (``file_mb`` bounds each file, not their
number); a program that sleeps uses no CPU time, so only the wall-clock limit stops it.
Without user/PID namespaces (e.g. a container whose seccomp profile forbids ``unshare``), or as root
on a kernel older than 6.14, the number of processes is not limited; without namespaces the network
stays on (but for Landlock's TCP rule) and background processes that leave the process group can
outlive the call (they stay confined and CPU-limited). Without a mount namespace (neither a user
namespace nor root, or ``unshare`` forbidden: ``isolation["readonly_root"]`` is False) the code can
still change the permission bits (not setuid/setgid), timestamps and ``user.*`` xattrs of any file the
trainer's user owns wherever it can name it (as root: most of the system, e.g. ``chmod 000`` on the
training data), including the directory holding its scratch directory; ownership stays refused.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass

from grpo.tasks import sandbox_child
from grpo.tasks.pool import remove_tree
from grpo.tasks.sandbox_child import landlock_abi

_READ_ROOTS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/dev/null", "/dev/zero", "/dev/full",
               "/dev/random", "/dev/urandom", "/etc/ld.so.cache", "/etc/localtime",
               "/etc/passwd", "/etc/group", "/etc/nsswitch.conf", "/etc/mime.types", "/proc/self", "/proc/cpuinfo",
               "/proc/meminfo", "/sys/devices/system/cpu")


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one code run. ``cpu_s``: CPU seconds per process; ``wall_s``: wall-clock seconds of the
    whole call; ``memory_mb``: address space per process; ``file_mb``: size of any one file written;
    ``max_processes``: processes + threads (see the module docstring for where); ``max_output_bytes``:
    stdout + stderr read back (the code is killed past it); ``allow_socketpair``: let ``socketpair()`` make
    connected SOCK_STREAM pairs (asyncio's event loop needs one: ``asyncio.run`` fails without it), which
    cannot address any other socket; SOCK_DGRAM pairs, which could ``sendto`` a Unix socket path, stay refused."""

    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 1024
    file_mb: int = 16
    max_processes: int = 16
    max_open_files: int = 256
    max_output_bytes: int = 64 * 1024
    allow_socketpair: bool = False


@dataclass
class SandboxResult:
    """What a run gave: the output (stdout and stderr interleaved, decoded), how it ended, and which
    protections were in force (``isolation``: landlock ABI, namespaces (userns, mountns, netns, pidns),
    readonly_root, process limit)."""

    output: str
    exit_code: int | None  # None when it was killed by a signal
    signal: int | None
    timed_out: bool
    output_truncated: bool
    isolation: dict

    def text(self) -> str:
        """The output followed by a line that says how the run ended when it did not end normally."""
        notes = []
        if self.output_truncated:
            notes.append("output truncated; the program was stopped")
        elif self.timed_out:
            notes.append("killed: wall-clock time limit reached")
        elif self.signal == signal.SIGXCPU:
            notes.append("killed: CPU time limit reached")
        elif self.signal == signal.SIGKILL:
            notes.append("killed (CPU time limit or out of memory)")
        elif self.signal is not None:
            notes.append(f"killed by signal {signal.Signals(self.signal).name}")
        elif self.exit_code:
            notes.append(f"exit code {self.exit_code}")
        out = self.output if self.output.strip() or notes else "(no output; print() what you want to see)"
        return out + "".join(f"\n[{n}]" for n in notes)


DEFAULT_LIMITS = SandboxLimits()


def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it printed (stdout and stderr).

    Args:
        code: a complete Python program; print() the values you want to see.
    """
    return run_python(code).text()


# --------------------------------------------------------------------------------------------------
# The caller's side
# --------------------------------------------------------------------------------------------------
def read_roots() -> list[str]:
    """Directories the code may read and execute beneath (besides its scratch directory)."""
    paths = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)), *_READ_ROOTS}
    paths.update(p for key in ("stdlib", "platstdlib", "purelib", "platlib") if (p := sysconfig.get_paths().get(key)))
    return sorted(p for p in paths if os.path.exists(p))


def run_python(code: str, limits: SandboxLimits = DEFAULT_LIMITS, require_landlock: bool = True) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh scratch directory under the sandbox; see the module docstring.

    ``require_landlock=False`` runs code even where the kernel cannot confine its writes (its file
    writes are then limited only by the OS permissions of the trainer's user).
    """
    if require_landlock and landlock_abi() < 1:
        return SandboxResult("error: the python tool is unavailable: this kernel has no Landlock (Linux >= 5.13 "
                             "with landlock in its LSM list), so the sandbox cannot keep code from writing "
                             "outside its directory", None, None, False, False, {"landlock": 0})
    # The code's directory lies in a private (0700) one that it cannot chmod (read-only to it), so no other
    # user of the host can reach what it leaves there (say a setuid copy of a binary) before it is removed.
    top = tempfile.mkdtemp(prefix="grpo-sandbox-")  # in a tool worker: beneath its scratch root
    try:
        scratch = os.path.join(top, "work")
        os.mkdir(scratch, 0o700)
        with open(os.path.join(scratch, "main.py"), "w") as f:
            f.write(code)
        return _run_in(scratch, limits, require_landlock)
    finally:
        remove_tree(top)  # every process of the sandbox is dead by now (but without a PID namespace)


def _run_in(scratch: str, limits: SandboxLimits, require_landlock: bool) -> SandboxResult:
    status_r, status_w = os.pipe()
    args = {"scratch": scratch, "limits": asdict(limits), "status_fd": status_w, "parent": os.getpid(),
            "uid": os.geteuid(),
            "read_roots": read_roots(), "require_landlock": require_landlock}
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8"}
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-B", os.path.abspath(sandbox_child.__file__), json.dumps(args)],
                                cwd=scratch, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, pass_fds=(status_w,), start_new_session=True)
    finally:
        os.close(status_w)
    deadline = time.monotonic() + limits.wall_s
    chunks, size, timed_out, truncated = [], 0, False, False
    fd = proc.stdout.fileno()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if size > limits.max_output_bytes:
            truncated = True
            break
    os.set_blocking(status_r, False)
    reports = _read_available(status_r)
    if timed_out or truncated:
        _stop(proc, reports)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # cannot happen after SIGKILL, short of a kernel problem
        _kill_group(proc.pid)
        proc.wait()
    proc.stdout.close()
    os.set_blocking(status_r, True)
    with os.fdopen(status_r, "rb") as f:
        reports += f.read()
    status = {}
    for line in reports.splitlines():  # {"init": pid} from the launcher, then how the code ended from the init
        status.update(json.loads(line))
    output = b"".join(chunks)[: limits.max_output_bytes].decode("utf-8", errors="replace")
    return SandboxResult(output, status.get("exit_code"), status.get("signal"), timed_out, truncated,
                         status.get("isolation", {}))


def _read_available(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return b""


def _stop(proc: subprocess.Popen, reports: bytes) -> None:
    """Kill the sandbox: its init first, so that the launcher only exits once every process of the PID
    namespace is gone (the kernel empties a namespace whose init dies), then the process group (all of
    it where there is no PID namespace)."""
    init = next((json.loads(line)["init"] for line in reports.splitlines() if b'"init"' in line), None)
    if init is not None:
        try:
            os.kill(init, signal.SIGKILL)  # not yet reaped by the launcher, which is alive: no PID reuse
            proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    _kill_group(proc.pid)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
