"""Tests of the sandboxed python tool (grpo/envs/sandbox.py): confinement, limits, clean-up.

They need Landlock (Linux >= 5.13 with landlock in the LSM list) and skip without it; the network and
process checks also need the namespaces, and skip where the run reports they were not available.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import time

import pytest

import grpo.envs.sandbox as sandbox
from grpo.envs.sandbox import SandboxLimits, landlock_abi, python, run_python
from grpo.envs.tool_calls import resolve_tools, tool_schemas

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
    (schema,) = tool_schemas(resolve_tools(["grpo.envs.sandbox:python"]))
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

    from grpo.envs.tools import ToolEnvironment

    env = ToolEnvironment(["grpo.envs.sandbox:python"], "grpo.envs.arithmetic:arithmetic_reward", num_workers=1,
                          timeout_s=30, max_result_chars=200)
    try:
        call = {"name": "python", "arguments": {"code": "print(6 * 7)\nopen('/tmp/x', 'w')"}}
        message = "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"
        ret = env.step([[{"role": "assistant", "content": message}]], [{"question": "q", "answer": "42"}])
        (obs,) = ret.observations[0]
        assert obs["content"].startswith("42\nTraceback") and "PermissionError" in obs["content"]
        assert obs["content"].endswith("[exit code 1]") and not ret.metadata[0]["invalid_tool_call"]
    finally:
        env.shutdown()
