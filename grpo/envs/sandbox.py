"""The built-in ``python`` code tool (``env.tools: ["grpo.envs.sandbox:python"]``): code runs in a sandbox.

Each call writes the code to ``main.py`` in a fresh scratch directory (removed afterwards) and runs
``python -I -B -u main.py`` there (unbuffered: stdout and stderr interleave in program order), through
two steps of this file run as a script:

1. a launcher (the process group leader, killed with its group at the wall-clock limit, and by the
   kernel when the tool worker that started it dies) that enters new user, network, PID, IPC and UTS
   namespaces where the OS allows it, then forks an init: PID 1 of the new PID namespace, which
   reports how the code ended; when it exits or is killed, every process in the namespace dies;
2. the code's process, forked by the init, which sets the resource limits, confines itself with
   Landlock, drops every capability and execs the interpreter on ``main.py``.

What it enforces, and where:

- **writes only inside the scratch directory** (Landlock, Linux >= 5.13 with Landlock enabled): creating,
  writing, truncating, renaming or deleting anything elsewhere fails with PermissionError, whatever the
  file permissions say and whether the process runs as root or not. **Reads and execution** are allowed
  only beneath the Python installation (``sys.prefix``, ``sys.base_prefix``, the stdlib and
  site-packages), ``/usr``, ``/lib*``, ``/bin``, ``/sbin``, ``/dev/{null,zero,full,random,urandom}`` (not
  the disks: a raw block device would bypass every rule), a few files of ``/etc`` (the loader
  cache, localtime, passwd, group), the code process's own ``/proc/self``, ``/proc/cpuinfo``,
  ``/proc/meminfo``, ``/sys/devices/system/cpu`` and the scratch directory, so files elsewhere (the home
  directory, ``/tmp``, the training data, keys in ``~/.cache``, ``/etc/shadow``, other processes'
  ``/proc`` entries) cannot be read. Where Landlock is missing, `run_python` refuses to run code
  (``require_landlock=True``, the default) and the call returns an error.
- **no network**: a new network namespace has no interface but a loopback that is down, so no packet
  leaves or arrives (needs user namespaces or root). With Landlock ABI >= 4, TCP bind/connect are
  also denied. Where neither is available, the code has the network. A seccomp filter makes
  ``socket(AF_UNIX, ...)`` fail (x86_64 and aarch64), so Unix sockets on the filesystem, which neither
  covers (``/var/run/docker.sock``, a trainer's sockets), cannot be reached; ``socketpair`` still works.
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
outlive the call (they stay confined and CPU-limited).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass

# Linux constants (x86_64 / aarch64 share these syscall numbers for Landlock).
_SYS_LANDLOCK_CREATE_RULESET, _SYS_LANDLOCK_ADD_RULE, _SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
_LANDLOCK_CREATE_RULESET_VERSION, _LANDLOCK_RULE_PATH_BENEATH = 1, 1
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_READ = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
_FS_FILE_RIGHTS = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | 1 << 14 | 1 << 15  # + truncate, ioctl_dev
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS, _PR_CAPBSET_DROP = 1, 38, 24
_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_READ_ROOTS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/dev/null", "/dev/zero", "/dev/full",
               "/dev/random", "/dev/urandom", "/etc/ld.so.cache", "/etc/localtime",
               "/etc/passwd", "/etc/group", "/etc/nsswitch.conf", "/etc/mime.types", "/proc/self", "/proc/cpuinfo",
               "/proc/meminfo", "/sys/devices/system/cpu")


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one code run. ``cpu_s``: CPU seconds per process; ``wall_s``: wall-clock seconds of the
    whole call; ``memory_mb``: address space per process; ``file_mb``: size of any one file written;
    ``max_processes``: processes + threads (see the module docstring for where); ``max_output_bytes``:
    stdout + stderr read back (the code is killed past it)."""

    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 1024
    file_mb: int = 16
    max_processes: int = 16
    max_open_files: int = 256
    max_output_bytes: int = 64 * 1024


@dataclass
class SandboxResult:
    """What a run gave: the output (stdout and stderr interleaved, decoded), how it ended, and which
    protections were in force (``isolation``: landlock ABI, namespaces, process limit)."""

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
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where Landlock is missing or disabled."""
    try:
        abi = _libc().syscall(_SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                              ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(int(abi), 0)


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
    scratch = tempfile.mkdtemp(prefix="grpo-sandbox-")
    try:
        with open(os.path.join(scratch, "main.py"), "w") as f:
            f.write(code)
        return _run_in(scratch, limits, require_landlock)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run_in(scratch: str, limits: SandboxLimits, require_landlock: bool) -> SandboxResult:
    status_r, status_w = os.pipe()
    args = {"scratch": scratch, "limits": asdict(limits), "status_fd": status_w, "parent": os.getpid(),
            "uid": os.geteuid(),
            "read_roots": read_roots(), "require_landlock": require_landlock}
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8"}
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-B", os.path.abspath(__file__), json.dumps(args)],
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


# --------------------------------------------------------------------------------------------------
# Inside the sandbox (this file run as a script, stdlib only)
# --------------------------------------------------------------------------------------------------
def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def _enter_namespaces(libc) -> dict:
    """New user (mapped to our own uid/gid), network, PID, IPC and UTS namespaces; what it got."""
    uid, gid = os.geteuid(), os.getegid()
    flags = _CLONE_NEWUSER | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWUTS
    if libc.unshare(flags) == 0:
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"0 {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"0 {gid} 1")
        return {"userns": True, "netns": True, "pidns": True}
    if libc.unshare(_CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWUTS) == 0:  # root without userns
        return {"userns": False, "netns": True, "pidns": True}
    return {"userns": False, "netns": False, "pidns": False}


def _landlock(libc, abi: int, scratch: str, read_roots: list[str]) -> None:
    """Confine this process and its children: read/execute beneath ``read_roots``, everything beneath
    ``scratch``, write /dev/null; no TCP (ABI >= 4); no signals or abstract sockets outward (ABI >= 6)."""
    handled_fs = (1 << 13) - 1  # ABI 1: execute .. make_sym
    if abi >= 2:
        handled_fs |= 1 << 13  # refer
    if abi >= 3:
        handled_fs |= 1 << 14  # truncate
    if abi >= 5:
        handled_fs |= 1 << 15  # ioctl_dev
    fields = [handled_fs] + ([3] if abi >= 4 else []) + ([3] if abi >= 6 else [])
    attr = (ctypes.c_uint64 * len(fields))(*fields)
    ruleset = _check(libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr),
                                  ctypes.c_size_t(ctypes.sizeof(attr)), ctypes.c_uint32(0)), "landlock_create_ruleset")

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    def allow(path: str, access: int) -> None:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        try:
            rule = PathBeneath(access if os.path.isdir(path) else access & _FS_FILE_RIGHTS, fd)
            _check(libc.syscall(_SYS_LANDLOCK_ADD_RULE, ruleset, _LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule),
                                ctypes.c_uint32(0)), f"landlock_add_rule({path})")
        finally:
            os.close(fd)

    for root in read_roots:
        allow(root, _FS_READ)
    allow(scratch, handled_fs)
    allow("/dev/null", _FS_READ_FILE | _FS_WRITE_FILE)
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    _check(libc.syscall(_SYS_LANDLOCK_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)), "landlock_restrict_self")
    os.close(ruleset)


def _deny_unix_sockets(libc) -> bool:
    """A seccomp filter: ``socket(AF_UNIX, ...)`` fails with EACCES (Landlock does not cover connecting to a
    Unix socket on the filesystem, e.g. /var/run/docker.sock). False on an architecture not handled here."""
    import platform

    arch, sys_socket = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}.get(platform.machine(), (0, 0))
    if not arch:
        return False
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, deny = 0x7FFF0000, 0x00050000 | 13  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EACCES
    program = [(ld, 0, 0, 4), (jeq, 0, 5, arch),  # seccomp_data.arch; another ABI: allow
               (ld, 0, 0, 0), (jge, 4, 0, 0x40000000),  # seccomp_data.nr; x32 syscalls: deny
               (jeq, 0, 2, sys_socket), (ld, 0, 0, 16), (jeq, 1, 0, 1),  # socket(AF_UNIX=1, ...): deny
               (ret, 0, 0, allow), (ret, 0, 0, deny)]

    class Instruction(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Instruction))]

    filters = (Instruction * len(program))(*[Instruction(*i) for i in program])
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    _check(libc.prctl(22, 2, ctypes.byref(Program(len(program), filters)), 0, 0), "prctl(SECCOMP_MODE_FILTER)")
    return True


def _drop_capabilities(libc) -> None:
    """Empty the bounding set and the effective/permitted/inheritable sets (an exec regains nothing)."""
    for cap in range(64):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == 22:  # EINVAL: past the last
            break
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()
    _check(libc.capset(header, data), "capset")


def _run_code(libc, args: dict, limits: SandboxLimits, isolation: dict) -> None:
    """The code's process: limits, Landlock, no capabilities, then exec the interpreter on main.py."""
    try:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        mb = 1024 * 1024
        for res, value in ((resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1)),
                           (resource.RLIMIT_AS, (limits.memory_mb * mb,) * 2),
                           (resource.RLIMIT_FSIZE, (limits.file_mb * mb,) * 2),
                           (resource.RLIMIT_NOFILE, (limits.max_open_files,) * 2),
                           (resource.RLIMIT_CORE, (0, 0))):
            resource.setrlimit(res, value)
        if isolation["userns"] and args["uid"] != 0:  # counted per user namespace: the sandbox's own tasks
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes,) * 2)
        if isolation["landlock"] >= 1:
            _landlock(libc, isolation["landlock"], args["scratch"], args["read_roots"])
        elif args["require_landlock"]:
            raise OSError("Landlock is not available")
        _deny_unix_sockets(libc)
        _drop_capabilities(libc)
        os.execve(sys.executable, [sys.executable, "-I", "-B", "-u", "-X", "utf8", "main.py"], dict(os.environ))
    except BaseException as err:
        os.write(2, f"sandbox setup failed: {type(err).__name__}: {err}\n".encode())
    os._exit(127)


def _limit_tasks(limits: SandboxLimits, isolation: dict, uid: int) -> int | None:
    """Bound the number of tasks (processes + threads) of the sandbox; the bound, or None where none holds.

    RLIMIT_NPROC (set in the code's process) counts per user namespace, but never binds uid 0. The PID
    namespace's own ``pid_max`` (Linux >= 6.14; at least 301) binds everyone, root included."""
    bound = limits.max_processes if isolation["userns"] and uid != 0 else None
    if isolation["pidns"]:
        pid_max = max(limits.max_processes + 1, 301)
        try:
            with open("/proc/sys/kernel/pid_max", "w") as f:
                f.write(str(pid_max))
            bound = min(bound or pid_max, pid_max - 1)
        except OSError:  # an older kernel: pid_max is global
            pass
    return bound


def _child_main(args: dict) -> None:
    """The launcher: enter the namespaces, fork an init (PID 1 of the new PID namespace) that forks the
    code's process, waits for it and reports how it ended on status_fd; everything else in the namespace
    dies with the init."""
    libc = _libc()
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != args["parent"]:  # the tool worker died before the line above
        os._exit(1)
    limits = SandboxLimits(**args["limits"])
    signal.alarm(int(limits.wall_s) + 2)  # a backstop: the caller kills us at wall_s
    isolation = _enter_namespaces(libc)
    isolation["landlock"] = landlock_abi()
    status_fd = args["status_fd"]
    init = os.fork()
    if init == 0:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        isolation["max_tasks"] = _limit_tasks(limits, isolation, args["uid"])
        code = os.fork()
        if code == 0:
            os.close(status_fd)
            _run_code(libc, args, limits, isolation)
        _, wait_status = os.waitpid(code, 0)
        status = {"isolation": isolation,
                  "exit_code": os.waitstatus_to_exitcode(wait_status) if os.WIFEXITED(wait_status) else None,
                  "signal": os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else None}
        os.write(status_fd, json.dumps(status).encode() + b"\n")
        os._exit(0)
    os.write(status_fd, json.dumps({"init": init}).encode() + b"\n")
    os.close(status_fd)
    os.waitpid(init, 0)
    os._exit(0)


if __name__ == "__main__":
    _child_main(json.loads(sys.argv[1]))
