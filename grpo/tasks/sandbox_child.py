"""Inside the python tool's sandbox: this file runs as a script (``python -I -B sandbox_child.py ARGS``),
so it imports the standard library only. See `grpo.tasks.sandbox` for what it enforces and why.

1. the launcher (`_child_main`) enters new user, mount, network, PID, IPC and UTS namespaces where the
   OS allows it, then forks an init: PID 1 of the new PID namespace, which makes every mount but the
   scratch directory read-only (`_read_only_mounts`), forks the code's process and reports how the code
   ended; when it exits or is killed, every process in the namespace dies;
2. the code's process (`_run_code`), forked by the init, sets the resource limits, confines itself
   with Landlock, installs a seccomp filter, drops every capability and execs the interpreter on
   ``main.py``.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import re
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
_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_NOSYMFOLLOW = 1, 2, 4, 8, 32, 256
_MS_BIND, _MS_REC, _MS_PRIVATE = 4096, 16384, 1 << 18
_MOUNT_OPTION_FLAGS = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC, "nosymfollow": _MS_NOSYMFOLLOW}


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
    """New user (mapped to our own uid/gid), mount, network, PID, IPC and UTS namespaces; what it got: the
    first set the OS allows of: all of them; all but the mount namespace; the same two without a user
    namespace (root where user namespaces are forbidden); a mount namespace alone (none: a container whose
    seccomp profile forbids ``unshare``)."""
    uid, gid = os.geteuid(), os.getegid()
    others = _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWUTS
    for userns, flags in ((True, _CLONE_NEWNS | others), (True, others), (False, _CLONE_NEWNS | others),
                          (False, others), (False, _CLONE_NEWNS)):
        if libc.unshare(flags | (_CLONE_NEWUSER if userns else 0)) == 0:
            break
    else:
        return {"userns": False, "mountns": False, "netns": False, "pidns": False}
    if userns:
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"0 {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"0 {gid} 1")
    return {"userns": userns, "mountns": bool(flags & _CLONE_NEWNS), "netns": bool(flags & _CLONE_NEWNET),
            "pidns": bool(flags & _CLONE_NEWPID)}


def _mount_table() -> list[tuple[int, str, int]]:
    """This mount namespace's mounts from /proc/self/mountinfo: (mount id, mount point, the per-mount flags
    that a bind remount must repeat: nosuid, nodev, noexec, nosymfollow). The kernel keeps the atime flags
    when a remount names none, and refuses (EPERM) to clear a flag it locked in a user namespace."""
    table = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split()
            point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), fields[4])  # \040: a space
            flags = sum(_MOUNT_OPTION_FLAGS.get(o, 0) for o in fields[5].decode().split(","))
            table.append((int(fields[0]), os.fsdecode(point), flags))
    return table


def _mount_id(fd: int) -> int:
    """The id of the mount an open file lies on (``mnt_id`` of /proc/self/fdinfo)."""
    with open(f"/proc/self/fdinfo/{fd}") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("mnt_id:"))


def _read_only_mounts(libc, scratch: str) -> dict:
    """In this (new) mount namespace: make every mount private (nothing propagates to or from the host's),
    bind-mount ``scratch`` onto itself (read-write, nosuid, nodev) and remount every other mount read-only,
    then make ``scratch`` the working directory (the old one lies on the now read-only mount beneath it).

    chmod, chown, utime, setxattr and writes anywhere but beneath ``scratch`` then fail with EROFS, whatever
    Landlock (which does not cover metadata) and the file permissions say; hard links into ``scratch`` from
    outside fail with EXDEV. A mount whose mount point leads to another mount (one mounted over it) cannot
    be reached by path and is left as it is. Returns ``readonly_root`` and the mounts that stayed writable."""
    _check(libc.mount(None, b"/", None, ctypes.c_ulong(_MS_REC | _MS_PRIVATE), None), "mount(/, MS_PRIVATE)")
    target = os.fsencode(scratch)
    _check(libc.mount(target, target, None, ctypes.c_ulong(_MS_BIND), None), "bind mount of the scratch directory")
    fd = os.open(scratch, os.O_PATH | os.O_CLOEXEC)
    try:
        scratch_mount = _mount_id(fd)
    finally:
        os.close(fd)
    writable = []
    for mount_id, point, flags in _mount_table():
        try:
            fd = os.open(point, os.O_PATH | os.O_CLOEXEC)
        except OSError:  # beneath a mount that hides it
            continue
        try:
            if _mount_id(fd) != mount_id:  # hidden by a mount on top of it: the path leads to that one
                continue
            extra = _MS_NOSUID | _MS_NODEV if mount_id == scratch_mount else _MS_RDONLY
            path = f"/proc/self/fd/{fd}".encode()  # exactly this mount, however the path resolves
            if libc.mount(None, path, None, ctypes.c_ulong(_MS_REMOUNT | _MS_BIND | flags | extra), None) != 0:
                if mount_id == scratch_mount:
                    continue  # nosuid and nodev are extras: the code runs with no_new_privs and no CAP_MKNOD
                writable.append(f"{point}: {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(fd)
    os.chdir(scratch)
    return {"readonly_root": not writable, **({"writable_mounts": writable} if writable else {})}


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
_DATA_ARG_LOW = (16, 24, 32)  # the low 32 bits of args[0..2] (little-endian); the kernel reads ints and modes
_RET_KILL_PROCESS, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_EACCES, _EPERM = 13, 1
_AF_INET, _AF_INET6, _SOCK_STREAM, _SOCK_TYPE_MASK = 2, 10, 1, 0xF
_S_ISUID, _S_ISGID = 0o4000, 0o2000
_X32_SYSCALL_BIT = 0x40000000
_SECCOMP_ABIS = {  # AUDIT_ARCH_* and the native syscall numbers (aarch64 has no chmod, chown, lchown)
    "x86_64": {"arch": 0xC000003E, "socket": 41, "socketpair": 53, "io_uring": (425, 426, 427),
               "mode_in_arg1": (90, 91), "mode_in_arg2": (268, 452), "chown": (92, 93, 94, 260)},
    "aarch64": {"arch": 0xC00000B7, "socket": 198, "socketpair": 199, "io_uring": (425, 426, 427),
                "mode_in_arg1": (52,), "mode_in_arg2": (53, 452), "chown": (54, 55)},
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
    4. io_uring (setup, enter, register) fails with EPERM: IORING_OP_SOCKET makes sockets without socket();
    5. chmod, fchmod (mode in args[1]), fchmodat and fchmodat2 (mode in args[2]) fail with EPERM when the
       mode has S_ISUID or S_ISGID: no setuid/setgid file, wherever it lies (the read-only mounts are the
       first line: this one also holds where the mount namespace could not be had);
    6. chown, fchown, lchown and fchownat fail with EPERM.
    """
    if machine not in _SECCOMP_ABIS:
        return []
    nr = _SECCOMP_ABIS[machine]
    source = [
        # 1. the ABI: check seccomp_data.arch before anything reads a syscall number
        ("ld", _DATA_ARCH), ("jeq", nr["arch"], None, "kill"),
        ("ld", _DATA_NR), ("jge", _X32_SYSCALL_BIT, "kill", None),
        # dispatch on the syscall number
        ("jeq", nr["socket"], "socket", None),
        ("jeq", nr["socketpair"], "socketpair", None),
        *[("jeq", n, "eperm", None) for n in nr["io_uring"]],
        *[("jeq", n, "mode_in_arg1", None) for n in nr["mode_in_arg1"]],
        *[("jeq", n, "mode_in_arg2", None) for n in nr["mode_in_arg2"]],
        *[("jeq", n, "eperm", None) for n in nr["chown"]],
        ("ret", _RET_ALLOW),
        # 2. socket(domain, ...): an allow-list of domains
        "socket", ("ld", _DATA_ARG_LOW[0]), ("jeq", _AF_INET, "allow", None), ("jeq", _AF_INET6, "allow", "eacces"),
        # 3. socketpair(domain, type, ...): stream pairs only, and only when allowed
        "socketpair", ("ld", _DATA_ARG_LOW[1]), ("and", _SOCK_TYPE_MASK),
        ("jeq", _SOCK_STREAM, "allow" if allow_socketpair else "eacces", "eacces"),
        # 5. chmod(path, mode), fchmod(fd, mode); fchmodat(dirfd, path, mode), fchmodat2(dirfd, path, mode, flags)
        "mode_in_arg1", ("ld", _DATA_ARG_LOW[1]), ("and", _S_ISUID | _S_ISGID), ("jeq", 0, "allow", "eperm"),
        "mode_in_arg2", ("ld", _DATA_ARG_LOW[2]), ("and", _S_ISUID | _S_ISGID), ("jeq", 0, "allow", "eperm"),
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
    does not cover connecting to a Unix socket on the filesystem (/var/run/docker.sock, a trainer's socket),
    nor chmod and chown."""
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
        isolation["max_tasks"] = _limit_tasks(limits, isolation, args["uid"])  # writes /proc: before the remount
        isolation["readonly_root"] = False
        if isolation["mountns"]:
            try:
                isolation.update(_read_only_mounts(libc, args["scratch"]))
            except OSError as err:
                isolation["mount_error"] = str(err)
                os.chdir(args["scratch"])  # the bind mount if one was made (then the scratch stays writable)
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
