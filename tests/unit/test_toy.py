"""grpo.tasks.toy's local model builds leave nothing half-built behind: SIGTERM, Ctrl-C or an error during a build
removes its temporary directory, and the temporary directories of builds killed outright (kill -9) are removed
by the next build; a live build's directory stays."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from grpo.tasks.toy import build_into, remove_stale_builds
from tests.helpers.e2e import REPO, child_env

SLOW_BUILD = """
import os, sys, time
from grpo.tasks.toy import build_into

def slow(tmp):
    with open(os.path.join(tmp, "weights.bin"), "wb") as f:
        f.write(b"x" * 1000)
    print("building", flush=True)
    time.sleep(60)

build_into(sys.argv[1], slow)
"""


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("sig, returncode", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)])
def test_a_signal_during_a_build_removes_its_temporary_directory(tmp_path, sig, returncode):
    out = tmp_path / "assets" / "demo_model"
    out.parent.mkdir()
    p = subprocess.Popen([sys.executable, "-c", SLOW_BUILD, str(out)], cwd=REPO, env=child_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "building"
    assert len(list(out.parent.iterdir())) == 1  # the temporary directory, with a file in it
    p.send_signal(sig)
    p.wait(timeout=30)
    assert p.returncode == returncode  # dies of the signal, as without the cleanup
    assert list(out.parent.iterdir()) == []


def test_a_failed_build_removes_its_temporary_directory_and_a_good_one_is_renamed(tmp_path):
    out = str(tmp_path / "m")

    def broken(tmp):
        open(os.path.join(tmp, "half"), "w").close()
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError):
        build_into(out, broken)
    assert os.listdir(tmp_path) == []
    build_into(out, lambda tmp: open(os.path.join(tmp, "config.json"), "w").close())
    assert os.listdir(tmp_path) == ["m"] and os.listdir(out) == ["config.json"]


def test_stale_builds_of_dead_processes_are_removed_and_live_ones_kept(tmp_path):
    out = str(tmp_path / "demo_model")
    host = socket.gethostname()
    dead, dead_legacy = f"{out}.tmp{_dead_pid()}-{host}", f"{out}.tmp{_dead_pid()}"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        keep = [f"{out}.tmp{live.pid}-{host}", f"{out}.tmp{_dead_pid()}-another-host", f"{out}.tmpfoo",
                str(tmp_path / "other_model.tmp1")]
        for d in [dead, dead_legacy, *keep]:
            os.makedirs(d)
        assert sorted(remove_stale_builds(out)) == sorted([dead, dead_legacy])
        assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(d) for d in keep)
        build_into(out, lambda tmp: open(os.path.join(tmp, "config.json"), "w").close())  # cleans first too
        os.makedirs(dead)
        build_into(out, lambda tmp: open(os.path.join(tmp, "config.json"), "w").close())
        assert not os.path.exists(dead) and os.path.exists(keep[0])
    finally:
        live.kill()
        live.wait()
