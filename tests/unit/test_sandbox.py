"""Tests of the sandboxed python tool (grpo/tasks/sandbox.py): confinement, limits, clean-up.

They need Landlock (Linux >= 5.13 with landlock in the LSM list) and skip without it; the network and
process checks also need the namespaces, and skip where the run reports they were not available; the
read-only mounts need a mount namespace (a user namespace, or root), and skip where this process cannot
make one.
"""

from __future__ import annotations

import ctypes
import os
import platform
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

import pytest

import grpo.tasks.sandbox as sandbox
from grpo.tasks.pool import WorkerPool
from grpo.tasks.sandbox import SandboxLimits, landlock_abi, python, run_python
from grpo.tasks.tool_calls import load_tools, resolve_tools, run_tool_call, tool_schemas

pytestmark = pytest.mark.skipif(landlock_abi() < 1, reason="this kernel has no Landlock: the sandbox refuses to run")


def processes_in(path: str) -> list[int]:
    """PIDs of live processes whose working directory is ``path`` (or was, before it was deleted)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if cwd.removesuffix(" (deleted)") == path:
            found.append(int(pid))
    return found


def test_runs_code_and_reports_isolation():
    result = run_python("import sys\nprint('hi', 6 * 7)\nprint('err', file=sys.stderr)")
    assert result.output == "hi 42\nerr\n" and result.exit_code == 0 and result.text() == "hi 42\nerr\n"
    assert result.isolation["landlock"] >= 1
    assert python("x = 1") == "(no output; print() what you want to see)"
    assert "ZeroDivisionError" in python("1/0") and python("1/0").endswith("[exit code 1]")


def test_python_tool_has_a_schema():
    (schema,) = tool_schemas(resolve_tools(["grpo.tasks.sandbox:python"]))
    assert schema["function"]["name"] == "python"
    assert schema["function"]["parameters"]["properties"]["code"]["type"] == "string"


def test_cannot_write_outside_its_scratch_directory(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    code = f"""
import os
attempts = {{
    "write": lambda: open({str(victim)!r}, "w").write("pwned"),
    "append": lambda: open({str(victim)!r}, "a").write("pwned"),
    "truncate": lambda: os.truncate({str(victim)!r}, 0),
    "create": lambda: open({str(tmp_path / 'new.txt')!r}, "w").write("x"),
    "mkdir": lambda: os.mkdir({str(tmp_path / 'newdir')!r}),
    "remove": lambda: os.remove({str(victim)!r}),
    "rename_out": lambda: (open("mine.txt", "w").write("x"), os.rename("mine.txt", {str(tmp_path / 'moved.txt')!r})),
    "symlink_escape": lambda: (os.symlink({str(victim)!r}, "link"), open("link", "w").write("pwned")),
    "tmp": lambda: open("/tmp/grpo-sandbox-escape.txt", "w").write("x"),
    "repo": lambda: open({os.path.abspath(sandbox.__file__)!r}, "a").write("#"),
    "dev_shm": lambda: open("/dev/shm/grpo-sandbox-escape", "w").write("x"),
}}
for name, attempt in attempts.items():
    try:
        attempt()
        print(name, "WROTE")
    except OSError as err:
        print(name, "denied", type(err).__name__)
open("inside.txt", "w").write("fine")
os.mkdir("sub")
os.remove("inside.txt")
print("inside ok", os.getcwd())
"""
    before = open(sandbox.__file__).read()
    result = run_python(code)
    lines = result.output.splitlines()
    assert "WROTE" not in result.output, result.output
    assert len([line for line in lines if " denied " in line]) == 11, result.output
    assert lines[-1].startswith("inside ok /")
    assert victim.read_text() == "original" and sorted(p.name for p in tmp_path.iterdir()) == ["victim.txt"]
    assert not os.path.exists("/tmp/grpo-sandbox-escape.txt") and not os.path.exists("/dev/shm/grpo-sandbox-escape")
    assert open(sandbox.__file__).read() == before
    assert not os.path.exists(lines[-1].split()[-1])  # the scratch directory is gone


def test_cannot_read_outside_the_allowed_directories(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("token")
    disks = [f"/dev/{d}" for d in sorted(os.listdir("/dev")) if stat.S_ISBLK(os.stat(f"/dev/{d}").st_mode)][:1]
    for path in [str(secret), f"/proc/self/root{secret}", *disks]:  # through a magic link; a raw disk
        result = run_python(f"print(open({path!r}, 'rb').read(5))")
        assert "PermissionError" in result.output and "token" not in result.output, (path, result.output)
    assert run_python("import json, numpy; print(numpy.int64(6) * 7)").output == "42\n"  # site-packages are fine


def test_cpu_limit_stops_a_busy_loop():
    start = time.monotonic()
    result = run_python("while True:\n    pass", SandboxLimits(cpu_s=1, wall_s=30))
    assert time.monotonic() - start < 20
    assert result.signal == signal.SIGXCPU and not result.timed_out
    assert result.text().endswith("[killed: CPU time limit reached]")


def test_memory_and_file_size_limits():
    result = run_python("x = bytearray(400 * 1024 * 1024)", SandboxLimits(memory_mb=256))
    assert "MemoryError" in result.output and result.exit_code == 1
    result = run_python("open('big', 'wb').write(b'x' * (2 * 1024 * 1024))", SandboxLimits(file_mb=1))
    assert "File too large" in result.output and result.exit_code == 1


def test_output_limit_stops_a_flood():
    start = time.monotonic()
    result = run_python("while True:\n    print('spam' * 100)", SandboxLimits(max_output_bytes=10_000, wall_s=30))
    assert time.monotonic() - start < 10
    assert result.output_truncated and len(result.output) == 10_000
    assert result.text().endswith("[output truncated; the program was stopped]")


def test_wall_clock_limit_stops_a_sleeper_and_its_children():
    code = "import os, time\nprint(os.getcwd(), flush=True)\nfor _ in range(3):\n    os.fork()\ntime.sleep(100)"
    start = time.monotonic()
    result = run_python(code, SandboxLimits(wall_s=1.0))
    assert time.monotonic() - start < 5
    assert result.timed_out and result.text().endswith("[killed: wall-clock time limit reached]")
    if result.isolation.get("pidns"):
        assert processes_in(result.output.splitlines()[0]) == []  # the 8 sleepers are gone when the call returns


def test_fork_bomb_and_background_processes_cost_only_the_call():
    probe = run_python("print(1)")
    if not probe.isolation.get("pidns") or not probe.isolation.get("max_tasks"):
        pytest.skip(f"no PID namespace / task bound here: {probe.isolation}")
    start = time.monotonic()
    bomb = run_python("import os, time\nprint(os.getcwd(), flush=True)\nwhile True:\n    os.fork()\n"
                      "    time.sleep(0.01)", SandboxLimits(wall_s=4.0))
    assert time.monotonic() - start < 15
    scratch = bomb.output.splitlines()[0]
    assert scratch.startswith("/") and processes_in(scratch) == []  # every forked process is gone
    assert "BlockingIOError" in bomb.output or bomb.timed_out

    # A detached background process (new session, still running when the program exits) dies with the call.
    code = ("import os, subprocess\nprint(os.getcwd(), flush=True)\n"
            "subprocess.Popen(['sleep', '300'], start_new_session=True)\nprint('started', flush=True)")
    result = run_python(code)
    assert result.output.splitlines()[1] == "started"
    time.sleep(0.2)
    assert processes_in(result.output.splitlines()[0]) == []
    assert run_python("print('still fine')").output == "still fine\n"


def test_no_network_no_unix_sockets_and_no_signals_out(tmp_path):
    probe = run_python("print(1)")
    if not probe.isolation.get("netns") and probe.isolation.get("landlock", 0) < 4:
        pytest.skip(f"neither a network namespace nor Landlock's TCP rules here: {probe.isolation}")
    unix_path = str(tmp_path / "s.sock")
    with socket.socket() as server, socket.socket(socket.AF_UNIX) as unix_server:
        unix_server.bind(unix_path)
        unix_server.listen(1)
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        code = f"""
import os, signal, socket
for name, attempt in {{
    "tcp": lambda: socket.create_connection(("127.0.0.1", {port}), timeout=2),
    "udp": lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("8.8.8.8", 53)),
    "kill_trainer": lambda: os.kill({os.getpid()}, signal.SIGTERM),
    "unix": lambda: socket.socket(socket.AF_UNIX).connect({unix_path!r}),
}}.items():
    try:
        attempt()
        print(name, "WORKED")
    except OSError as err:
        print(name, "denied", type(err).__name__)
"""
        result = run_python(code)
    assert "WORKED" not in result.output and result.output.count("denied") == 4, result.output


def test_missing_landlock_refuses_to_run(monkeypatch):
    monkeypatch.setattr(sandbox, "landlock_abi", lambda: 0)
    result = run_python("print('unconfined')")
    assert result.output.startswith("error: the python tool is unavailable: this kernel has no Landlock")
    assert "unconfined" not in result.output


def test_python_tool_in_a_tool_environment():
    import json

    from grpo.tasks.tools import ToolEnvironment

    env = ToolEnvironment(["grpo.tasks.sandbox:python"], "grpo.tasks.arithmetic:arithmetic_reward", num_workers=1,
                          timeout_s=30, max_result_chars=200)
    try:
        outside = f"/tmp/grpo-sandbox-test-{os.getpid()}-{time.monotonic_ns()}"  # a new name: refused, not found
        call = {"name": "python", "arguments": {"code": f"print(6 * 7)\nopen({outside!r}, 'w')"}}
        message = "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"
        ret = env.step([[{"role": "assistant", "content": message}]], [{"question": "q", "answer": "42"}])
        (obs,) = ret.observations[0]
        assert obs["content"].startswith("42\nTraceback")
        assert "PermissionError" in obs["content"] or "Read-only file system" in obs["content"], obs["content"]
        assert obs["content"].endswith("[exit code 1]") and not ret.metadata[0]["invalid_tool_call"]
    finally:
        env.shutdown()


# --------------------------------------------------------------------------------------------------
# The seccomp filter: no Unix (or any other non-IP) socket by any route
# --------------------------------------------------------------------------------------------------
# socket(AF_UNIX, SOCK_STREAM, 0) through the i386 syscall table (int 0x80, socket = 359), as a function that
# returns eax: push rbx; mov eax, 359; mov ebx, 1; mov ecx, 1; xor edx, edx; int 0x80; pop rbx; ret
INT80_SOCKET = """
import ctypes, mmap, os
code = bytes.fromhex("53" "B867010000" "BB01000000" "B901000000" "31D2" "CD80" "5B" "C3")
page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(code)
print("calling", flush=True)
fd = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))()
print("fd", fd, os.readlink(f"/proc/self/fd/{fd}") if fd >= 0 else os.strerror(-fd))
"""


def test_unix_socket_through_the_32_bit_abi_kills_the_process():
    if platform.machine() != "x86_64":
        pytest.skip(f"int 0x80 is x86 only (this is {platform.machine()})")
    host = subprocess.run([sys.executable, "-c", INT80_SOCKET], capture_output=True, text=True, timeout=30)
    if "socket:[" not in host.stdout:  # no IA-32 emulation: int 0x80 faults or answers ENOSYS
        pytest.skip(f"this kernel does not run int 0x80 syscalls (rc {host.returncode}: {host.stdout!r})")
    result = run_python(INT80_SOCKET)
    assert result.output == "calling\n" and result.signal == signal.SIGSYS, result
    # x32 numbering (nr | 0x40000000) of the same ABI: killed too
    x32 = run_python("import ctypes\nprint('calling', flush=True)\n"
                     "print(ctypes.CDLL(None).syscall(0x40000000 + 41, 1, 1, 0))")
    assert x32.output == "calling\n" and x32.signal == signal.SIGSYS, x32


def test_socketpair_cannot_send_to_a_unix_socket_outside(tmp_path):
    listener_path = str(tmp_path / "dgram.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(listener_path)
        listener.setblocking(False)
        code = f"""
import socket
def attempt(name, f):
    try:
        f()
        print(name, "WORKED")
    except OSError as err:
        print(name, "denied", type(err).__name__)
attempt("dgram_pair", lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)[0].sendto(b"out", {listener_path!r}))
attempt("seqpacket_pair", lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET))
try:
    a, b = socket.socketpair()
except OSError as err:
    print("stream_pair denied", type(err).__name__)
else:
    a.sendall(b"ping")
    print("stream_pair", b.recv(4).decode())
    attempt("stream_pair_sendto", lambda: a.sendto(b"out", {listener_path!r}))
    attempt("stream_pair_connect", lambda: a.connect({listener_path!r}))
"""
        refused = run_python(code)
        with pytest.raises(BlockingIOError):  # nothing arrived
            print("received", listener.recv(100))
        allowed = run_python(code, SandboxLimits(allow_socketpair=True))  # stream pairs only
        with pytest.raises(BlockingIOError):
            print("received", listener.recv(100))
    assert refused.output.splitlines() == ["dgram_pair denied PermissionError", "seqpacket_pair denied PermissionError",
                                           "stream_pair denied PermissionError"], refused.output
    assert allowed.output.splitlines() == ["dgram_pair denied PermissionError", "seqpacket_pair denied PermissionError",
                                           "stream_pair ping", "stream_pair_sendto denied OSError",
                                           "stream_pair_connect denied OSError"], allowed.output


def test_only_ip_sockets_can_be_made():
    families = {"unix": "AF_UNIX, socket.SOCK_STREAM", "unix_dgram": "AF_UNIX, socket.SOCK_DGRAM",
                "vsock": "AF_VSOCK, socket.SOCK_STREAM", "netlink": "AF_NETLINK, socket.SOCK_RAW",
                "packet": "AF_PACKET, socket.SOCK_RAW", "alg": "AF_ALG, socket.SOCK_SEQPACKET",
                "inet": "AF_INET, socket.SOCK_STREAM", "inet6": "AF_INET6, socket.SOCK_DGRAM"}
    code = "import socket\n" + "".join(f"""
try:
    socket.socket(socket.{args}).close()
    print({name!r}, "made")
except OSError as err:
    print({name!r}, type(err).__name__)
""" for name, args in families.items()) + """
import ctypes, os
params = ctypes.create_string_buffer(120)  # io_uring_setup: IORING_OP_SOCKET makes sockets without socket()
libc = ctypes.CDLL(None, use_errno=True)
print("io_uring", libc.syscall(425, 4, params), os.strerror(ctypes.get_errno()))
"""
    lines = run_python(code).output.splitlines()
    assert lines == [f"{name} PermissionError" for name in list(families)[:6]] + [
        "inet made", "inet6 made", "io_uring -1 Operation not permitted"], lines
    # vsock to the host (CID 2) is refused at creation, not reset by the hypervisor's device
    vsock = run_python("import socket\nsocket.socket(socket.AF_VSOCK, socket.SOCK_STREAM).connect((2, 1024))")
    assert "PermissionError" in vsock.output and "ConnectionResetError" not in vsock.output, vsock.output


def test_ordinary_programs_still_work():
    code = """
import asyncio, math, os, subprocess, sys, threading, socket
print(math.factorial(20))
open("data.txt", "w").write("x" * 1000)
print(os.path.getsize("data.txt"))
print(subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True).stdout.strip())
out = []
threads = [threading.Thread(target=out.append, args=(i,)) for i in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(sorted(out))
r, w = os.pipe()
if os.fork() == 0:
    os.write(w, b"[1, 2]")
    os._exit(0)
print(os.read(r, 100).decode())
print(len(socket.getaddrinfo("127.0.0.1", 80)) > 0)
try:
    print(asyncio.run(asyncio.sleep(0, "async ok")))
except PermissionError:
    print("no asyncio")
"""
    expected = ["2432902008176640000", "1000", "42", "[0, 1, 2, 3]", "[1, 2]", "True"]
    result = run_python(code, SandboxLimits(wall_s=30))
    assert result.output.splitlines()[:7] == expected + ["no asyncio"] and result.exit_code == 0, result.output
    result = run_python(code, SandboxLimits(wall_s=30, allow_socketpair=True))
    assert result.output.splitlines() == expected + ["async ok"] and result.exit_code == 0, result.output


# --------------------------------------------------------------------------------------------------
# Scratch space: nothing is left behind, whatever the code does
# --------------------------------------------------------------------------------------------------
def tree_size(path) -> tuple[int, int]:
    """(entries, bytes) beneath ``path``."""
    entries = size = 0
    for root, dirs, files in os.walk(path):
        entries += len(dirs) + len(files)
        size += sum(os.lstat(os.path.join(root, f)).st_size for f in files)
    return entries, size


def test_a_worker_killed_at_the_tool_timeout_leaves_no_scratch(tmp_path, monkeypatch):
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # the workers' temp dir (before the pool gave them their own)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # the pool's
    code = ("import os, time\nfor i in range(40):\n    open(f'big{i}', 'wb').write(os.urandom(1 << 20))\n"
            "print('written', flush=True)\ntime.sleep(60)")
    pool = WorkerPool(["grpo.tasks.sandbox:python"], 1, timeout_s=4.0, load=load_tools, call=run_tool_call, what="tool")
    try:
        pool.start(wait=True)
        (outcome,) = pool.run([{"name": "python", "arguments": {"code": code}, "max_chars": 1000}])
        assert outcome[0] == "timeout" and pool.num_restarts == 1, outcome
        entries, size = tree_size(temp)
        assert size < 1 << 20, (entries, size)  # only the new worker's empty scratch root, no 40 MB
        (outcome,) = pool.run([{"name": "python", "arguments": {"code": "print('next')"}, "max_chars": 100}])
        assert outcome == ("ok", ("ok", "next\n"))
    finally:
        pool.close()
    assert list(temp.iterdir()) == []


def test_a_tree_that_defeats_rmtree_is_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    (tmp_path / "outside_dir").mkdir()
    (tmp_path / "outside_dir" / "f").write_text("keep me too")
    code = f"""
import os
top = os.getcwd()
os.symlink({str(outside)!r}, "link_to_file")
os.symlink({str(tmp_path / 'outside_dir')!r}, "link_to_dir")
for i in range(1200):  # deeper than Python 3.11's rmtree can go
    os.mkdir("d")
    os.chdir("d")
    if i % 300 == 0:
        open("f", "w").write("x")
        os.symlink({str(outside)!r}, "link")
os.chdir(top)
os.makedirs("locked/inner/deeper")
open("locked/inner/file", "w").write("x")
os.chmod("locked/inner", 0)
os.chmod("locked", 0)
os.mkdir("readonly")
open("readonly/file", "w").write("x")
os.chmod("readonly", 0o500)
print("built")
"""
    result = run_python(code)
    assert result.output == "built\n" and result.exit_code == 0, result
    assert outside.read_text() == "keep me" and (tmp_path / "outside_dir" / "f").read_text() == "keep me too"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside.txt", "outside_dir"]


# --------------------------------------------------------------------------------------------------
# Metadata (chmod, chown, utime, xattrs), which Landlock does not cover: read-only mounts and seccomp
# --------------------------------------------------------------------------------------------------
def mount_namespace_refused() -> str | None:
    """Why this process cannot make a mount namespace in which it may remount (None: it can), probed in a
    forked child as the sandbox does it: with a user namespace, or as root without one."""
    pid = os.fork()
    if pid == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        os._exit(0 if libc.unshare(0x10000000 | 0x00020000) == 0 or libc.unshare(0x00020000) == 0 else 1)
    _, status = os.waitpid(pid, 0)
    return None if os.waitstatus_to_exitcode(status) == 0 else "neither a user namespace nor CAP_SYS_ADMIN here"


def metadata(path) -> tuple:
    st = os.lstat(path)
    return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns, st.st_ctime_ns


ATTEMPTS = """
import os
def attempt(name, f):
    try:
        f()
        print(name, "WORKED")
    except OSError as err:
        print(name, "denied", os.strerror(err.errno))
"""


def test_cannot_change_metadata_outside_its_scratch_directory(tmp_path):
    if (reason := mount_namespace_refused()) is not None:
        pytest.skip(reason)
    victim = tmp_path / "victim.txt"
    victim.write_text("data")
    os.chmod(victim, 0o644)
    os.utime(victim, ns=(1_000_000_000, 1_000_000_000))
    before = {p: metadata(p) for p in (victim, tmp_path)}
    via_proc = f"/proc/{os.getpid()}/root{victim}"  # the trainer's mount namespace, through its /proc entry
    code = ATTEMPTS + f"""
attempt("chmod", lambda: os.chmod({str(victim)!r}, 0o777))
attempt("chmod_dir", lambda: os.chmod({str(tmp_path)!r}, 0o777))
attempt("chmod_via_proc", lambda: os.chmod({via_proc!r}, 0o777))
attempt("utime", lambda: os.utime({str(victim)!r}, (0, 0)))
attempt("utime_now", lambda: os.utime({str(victim)!r}))
attempt("chown", lambda: os.chown({str(victim)!r}, os.getuid(), os.getgid()))
attempt("lchown", lambda: os.lchown({str(victim)!r}, -1, -1))
attempt("setxattr", lambda: os.setxattr({str(victim)!r}, "user.grpo", b"x"))
attempt("link_in", lambda: os.link({str(victim)!r}, "hardlink"))
attempt("chmod_scratch_parent", lambda: os.chmod("..", 0o777))
"""
    result = run_python(code)
    lines = result.output.splitlines()
    assert len(lines) == 10 and all(" denied " in line for line in lines), result.output
    assert result.isolation["mountns"] and result.isolation["readonly_root"] is True, result.isolation
    for name in ("chmod", "chmod_dir", "utime", "utime_now", "setxattr", "chmod_scratch_parent"):
        assert f"{name} denied Read-only file system" in lines, result.output
    assert {p: metadata(p) for p in (victim, tmp_path)} == before
    assert "user.grpo" not in os.listxattr(victim)


def test_cannot_fchmod_a_file_opened_read_only_outside():
    if (reason := mount_namespace_refused()) is not None:
        pytest.skip(reason)
    library = os.path.realpath(os.__file__)  # beneath an allowed read root; its own mode: harmless if it worked
    before = {p: metadata(p) for p in (library, "/dev/null")}
    code = ATTEMPTS + f"""
for path in ({library!r}, "/dev/null"):
    fd = os.open(path, os.O_RDONLY)
    mode = os.fstat(fd).st_mode & 0o7777
    attempt("fchmod " + path, lambda: os.fchmod(fd, mode))
    attempt("fchown " + path, lambda: os.fchown(fd, -1, -1))
    attempt("fsetxattr " + path, lambda: os.setxattr(fd, "user.grpo", b"x"))
    attempt("futimes " + path, lambda: os.utime(fd))
print(open(os.devnull, "w").write("still writable"))
"""
    result = run_python(code)
    lines = result.output.splitlines()
    assert len(lines) == 9 and all(" denied " in line for line in lines[:8]) and lines[8] == "14", result.output
    assert f"fchmod {library} denied Read-only file system" in lines, result.output
    assert {p: metadata(p) for p in (library, "/dev/null")} == before


def test_setuid_and_setgid_bits_and_chown_are_refused_even_in_scratch():
    numbers = {"x86_64": (90, 268, 452), "aarch64": (None, 53, 452)}.get(platform.machine())
    if numbers is None:
        pytest.skip(f"no seccomp filter for {platform.machine()}")
    chmod_nr, fchmodat_nr, fchmodat2_nr = numbers
    code = ATTEMPTS + f"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def raw(nr, *args):
    if libc.syscall(nr, *args) != 0:
        raise OSError(ctypes.get_errno(), "")
open("tool", "w").write("#!/bin/sh\\n")
os.chmod("tool", 0o755)
os.mkdir("dir")
attempt("chmod_suid", lambda: os.chmod("tool", 0o4755))
attempt("chmod_sgid", lambda: os.chmod("tool", 0o2755))
attempt("chmod_sgid_dir", lambda: os.chmod("dir", 0o2775))
fd = os.open("tool", os.O_RDONLY)
attempt("fchmod_suid", lambda: os.fchmod(fd, 0o4755))
attempt("fchmodat_suid", lambda: raw({fchmodat_nr}, -100, b"tool", 0o4755))
attempt("fchmodat2_suid", lambda: raw({fchmodat2_nr}, -100, b"tool", 0o6755, 0))
if {chmod_nr} is not None:
    attempt("chmod_syscall_suid", lambda: raw({chmod_nr}, b"tool", 0o104755))
attempt("chown", lambda: os.chown("tool", os.getuid(), os.getgid()))
attempt("fchown", lambda: os.fchown(fd, -1, -1))
print(oct(os.stat("tool").st_mode & 0o7777), oct(os.stat("dir").st_mode & 0o7777))
attempt("chmod_plain", lambda: os.chmod("tool", 0o700))
"""
    result = run_python(code)
    lines = result.output.splitlines()
    refused = [line for line in lines if line.endswith(" denied Operation not permitted")]
    assert len(refused) == (9 if chmod_nr else 8) and "WORKED" not in "".join(lines[:-2]), result.output
    assert lines[-2:] == ["0o755 0o755", "chmod_plain WORKED"], result.output


def test_ordinary_file_work_inside_scratch_still_works(tmp_path):
    outside = tmp_path / "readable.txt"
    outside.write_text("outside")
    code = """
import os, shutil, subprocess, sys
open("script.sh", "w").write("#!/bin/sh\\necho script ran $1\\n")
os.chmod("script.sh", 0o755)
print(subprocess.run(["./script.sh", "ok"], capture_output=True, text=True).stdout.strip())
open("tool.py", "w").write("print('tool ran')")
print(subprocess.run([sys.executable, "tool.py"], capture_output=True, text=True).stdout.strip())
shutil.copy("script.sh", "copy.sh")
print(oct(os.stat("copy.sh").st_mode & 0o777), open("copy.sh").read() == open("script.sh").read())
shutil.copy2("script.sh", "copy2.sh")
os.utime("copy.sh", (1, 2))
print(os.stat("copy.sh").st_mtime)
os.makedirs("a/b/c")
os.chmod("a/b", 0o700)
os.rename("a/b/c", "c")
os.symlink("copy.sh", "link")
os.truncate("copy.sh", 3)
print(open("link").read(), sorted(os.listdir(".")))
"""
    result = run_python(code)
    assert result.exit_code == 0 and result.output.splitlines() == [
        "script ran ok", "tool ran", "0o755 True", "2.0",
        "#!/ ['a', 'c', 'copy.sh', 'copy2.sh', 'link', 'main.py', 'script.sh', 'tool.py']"], result.output
