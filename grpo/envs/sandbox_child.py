"""Inside the python tool's sandbox: this file runs as a script (``python -I -B sandbox_child.py ARGS``),
so it imports the standard library only. See `grpo.envs.sandbox` for what it enforces and why.

1. the launcher (`_child_main`) enters new user, network, PID, IPC and UTS namespaces where the OS
   allows it, then forks an init: PID 1 of the new PID namespace, which reports how the code ended;
   when it exits or is killed, every process in the namespace dies;
2. the code's process (`_run_code`), forked by the init, sets the resource limits, confines itself
   with Landlock, installs a seccomp filter, drops every capability and execs the interpreter on
   ``main.py``.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import resource
import signal
import sys

# Linux constants (x86_64 and aarch64 share the Landlock syscall numbers).
_SYS_LANDLOCK_CREATE_RULESET, _SYS_LANDLOCK_ADD_RULE, _SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
_LANDLOCK_CREATE_RULESET_VERSION, _LANDLOCK_RULE_PATH_BENEATH = 1, 1
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_READ = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
_FS_FILE_RIGHTS = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | 1 << 14 | 1 << 15  # + truncate, ioctl_dev
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS, _PR_CAPBSET_DROP = 1, 38, 24
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_CLONE_NEWUTS, _CLONE_NEWIPC = 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000


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


# The seccomp filter (classic BPF over struct seccomp_data: int nr; u32 arch; u64 ip; u64 args[6]).
_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_JGE_K, _BPF_AND_K, _BPF_RET_K = 0x20, 0x15, 0x35, 0x54, 0x06
_DATA_NR, _DATA_ARCH = 0, 4
_DATA_ARG_LOW = (16, 24)  # the low 32 bits of args[0] and args[1] (little-endian); the kernel reads ints
_RET_KILL_PROCESS, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_EACCES, _EPERM = 13, 1
_AF_INET, _AF_INET6, _SOCK_STREAM, _SOCK_TYPE_MASK = 2, 10, 1, 0xF
_X32_SYSCALL_BIT = 0x40000000
_SECCOMP_ABIS = {  # AUDIT_ARCH_*, then the native numbers of socket, socketpair, io_uring_{setup,enter,register}
    "x86_64": (0xC000003E, 41, 53, (425, 426, 427)),
    "aarch64": (0xC00000B7, 198, 199, (425, 426, 427)),
}


def seccomp_program(machine: str, allow_socketpair: bool = False) -> list[tuple[int, int, int, int]]:
    """The sandbox's seccomp filter as BPF instructions ``(code, jt, jf, k)``; [] on an architecture it does
    not know (the caller refuses to run there). In order:

    1. a syscall of another ABI than the native one (``int 0x80`` into the i386 table, whose socket is 359
       and socketcall 102; an arm32 compat task) or an x32 syscall (``nr | 0x40000000``) kills the process;
    2. ``socket()`` succeeds for AF_INET and AF_INET6 only (the network namespace isolates those): AF_UNIX,
       AF_VSOCK, AF_NETLINK, AF_PACKET, AF_ALG and every other family fail with EACCES;
    3. ``socketpair()`` fails with EACCES, or with ``allow_socketpair`` succeeds for SOCK_STREAM only (a
       connected stream pair cannot address anything else: connect/sendto answer EISCONN, while a
       SOCK_DGRAM pair could ``sendto`` any Unix socket path);
    4. io_uring (setup, enter, register) fails with EPERM: IORING_OP_SOCKET makes sockets without socket().
    """
    if machine not in _SECCOMP_ABIS:
        return []
    arch, sys_socket, sys_socketpair, sys_io_uring = _SECCOMP_ABIS[machine]
    source = [
        # 1. the ABI: check seccomp_data.arch before anything reads a syscall number
        ("ld", _DATA_ARCH), ("jeq", arch, None, "kill"),
        ("ld", _DATA_NR), ("jge", _X32_SYSCALL_BIT, "kill", None),
        # dispatch on the syscall number
        ("jeq", sys_socket, "socket", None),
        ("jeq", sys_socketpair, "socketpair", None),
        *[("jeq", nr, "eperm", None) for nr in sys_io_uring],
        ("ret", _RET_ALLOW),
        # 2. socket(domain, ...): an allow-list of domains
        "socket", ("ld", _DATA_ARG_LOW[0]), ("jeq", _AF_INET, "allow", None), ("jeq", _AF_INET6, "allow", "eacces"),
        # 3. socketpair(domain, type, ...): stream pairs only, and only when allowed
        "socketpair", ("ld", _DATA_ARG_LOW[1]), ("and", _SOCK_TYPE_MASK),
        ("jeq", _SOCK_STREAM, "allow" if allow_socketpair else "eacces", "eacces"),
        "allow", ("ret", _RET_ALLOW),
        "eacces", ("ret", _RET_ERRNO | _EACCES),
        "eperm", ("ret", _RET_ERRNO | _EPERM),
        "kill", ("ret", _RET_KILL_PROCESS),
    ]
    return _assemble(source)


def _assemble(source: list) -> list[tuple[int, int, int, int]]:
    """BPF instructions from ``source``: strings are labels, ``("ld", offset)``, ``("and", k)``,
    ``("ret", k)``, ``("jeq"|"jge", k, then, else)`` with labels (None: the next instruction)."""
    labels, n = {}, 0
    for item in source:
        if isinstance(item, str):
            labels[item] = n
        else:
            n += 1
    program = []
    for item in source:
        if isinstance(item, str):
            continue
        op, k, *targets = item
        if op in ("jeq", "jge"):
            here = len(program) + 1  # jumps are relative to the next instruction, forward only
            jt, jf = (0 if t is None else labels[t] - here for t in targets)
            assert 0 <= jt < 256 and 0 <= jf < 256, item
            program.append((_BPF_JEQ_K if op == "jeq" else _BPF_JGE_K, jt, jf, k))
        else:
            program.append(({"ld": _BPF_LD_W_ABS, "and": _BPF_AND_K, "ret": _BPF_RET_K}[op], 0, 0, k))
    return program


def _install_seccomp(libc, allow_socketpair: bool) -> None:
    """Install `seccomp_program` on this (single-threaded) process; its children and exec inherit it. Landlock
    does not cover connecting to a Unix socket on the filesystem (/var/run/docker.sock, a trainer's socket)."""
    program = seccomp_program(platform.machine(), allow_socketpair)
    if not program:
        raise OSError(f"no seccomp filter for this architecture ({platform.machine()}): Unix sockets would be open")

    class Instruction(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                    ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Instruction))]

    filters = (Instruction * len(program))(*[Instruction(*i) for i in program])
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    _check(libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(Program(len(program), filters)), 0, 0),
           "prctl(SECCOMP_MODE_FILTER)")


def _drop_capabilities(libc) -> None:
    """Empty the bounding set and the effective/permitted/inheritable sets (an exec regains nothing)."""
    for cap in range(64):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == 22:  # EINVAL: past the last
            break
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()
    _check(libc.capset(header, data), "capset")


def _run_code(libc, args: dict, limits: dict, isolation: dict) -> None:
    """The code's process: limits, Landlock, seccomp, no capabilities, then exec the interpreter on main.py."""
    try:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        mb = 1024 * 1024
        for res, value in ((resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1)),
                           (resource.RLIMIT_AS, (limits["memory_mb"] * mb,) * 2),
                           (resource.RLIMIT_FSIZE, (limits["file_mb"] * mb,) * 2),
                           (resource.RLIMIT_NOFILE, (limits["max_open_files"],) * 2),
                           (resource.RLIMIT_CORE, (0, 0))):
            resource.setrlimit(res, value)
        if isolation["userns"] and args["uid"] != 0:  # counted per user namespace: the sandbox's own tasks
            resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"],) * 2)
        if isolation["landlock"] >= 1:
            _landlock(libc, isolation["landlock"], args["scratch"], args["read_roots"])
        elif args["require_landlock"]:
            raise OSError("Landlock is not available")
        _install_seccomp(libc, limits["allow_socketpair"])
        _drop_capabilities(libc)
        os.execve(sys.executable, [sys.executable, "-I", "-B", "-u", "-X", "utf8", "main.py"], dict(os.environ))
    except BaseException as err:
        os.write(2, f"sandbox setup failed: {type(err).__name__}: {err}\n".encode())
    os._exit(127)


def _limit_tasks(limits: dict, isolation: dict, uid: int) -> int | None:
    """Bound the number of tasks (processes + threads) of the sandbox; the bound, or None where none holds.

    RLIMIT_NPROC (set in the code's process) counts per user namespace, but never binds uid 0. The PID
    namespace's own ``pid_max`` (Linux >= 6.14; at least 301) binds everyone, root included."""
    bound = limits["max_processes"] if isolation["userns"] and uid != 0 else None
    if isolation["pidns"]:
        pid_max = max(limits["max_processes"] + 1, 301)
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
    limits = args["limits"]
    signal.alarm(int(limits["wall_s"]) + 2)  # a backstop: the caller kills us at wall_s
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
