"""Tests of the scratch clean-up of grpo/tasks/pool.py: `remove_tree` and the pools' scratch roots.

The sandbox-level checks (a tool worker killed at its timeout, a tree built by sandboxed code) live in
tests/unit/test_sandbox.py; these need no Landlock.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
import time

import pytest

from grpo.tasks.pool import WorkerPool, remove_stale_pool_roots, remove_tree


def build_hostile_tree(top: str, outside_file: str, outside_dir: str) -> None:
    """Deep nesting (past PATH_MAX and Python's recursion limit), symlinks out, chmod 000 / 500 directories."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for i in range(1500):
        name = "d" if i % 75 else "n" * 200  # 20 long names: the deepest path is ~7,000 characters
        os.mkdir(name, dir_fd=fd)
        if i % 300 == 0:
            os.symlink(outside_file, "link_to_file", dir_fd=fd)
            os.symlink(outside_dir, "link_to_dir", dir_fd=fd)
            os.close(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
        child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    os.close(fd)
    for i in range(50):
        os.mkdir(os.path.join(top, f"wide{i}"))
        open(os.path.join(top, f"wide{i}", "f"), "w").close()
    os.makedirs(os.path.join(top, "locked", "inner", "deeper"))
    open(os.path.join(top, "locked", "inner", "file"), "w").close()
    os.mkfifo(os.path.join(top, "locked", "fifo"))
    os.chmod(os.path.join(top, "locked", "inner"), 0)
    os.chmod(os.path.join(top, "locked"), 0)
    os.mkdir(os.path.join(top, "readonly"))
    open(os.path.join(top, "readonly", "file"), "w").close()
    os.chmod(os.path.join(top, "readonly"), 0o500)
    os.chmod(top, 0)


def test_remove_tree_removes_what_rmtree_cannot_and_follows_no_link(tmp_path):
    outside_file, outside_dir = tmp_path / "outside.txt", tmp_path / "outside_dir"
    outside_file.write_text("keep")
    outside_dir.mkdir()
    (outside_dir / "f").write_text("keep")
    top = str(tmp_path / "tree")
    os.mkdir(top)
    build_hostile_tree(top, str(outside_file), str(outside_dir))
    start = time.monotonic()
    assert remove_tree(top) is True
    assert time.monotonic() - start < 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside.txt", "outside_dir"]
    assert outside_file.read_text() == "keep" and (outside_dir / "f").read_text() == "keep"
    assert remove_tree(top) is True and remove_tree(None) is True  # nothing there: fine
    link = tmp_path / "link"
    link.symlink_to(outside_dir)
    assert remove_tree(str(link)) and not link.exists() and (outside_dir / "f").exists()  # the link, not its target


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a check as another user")
def test_remove_tree_as_a_user_who_cannot_enter_chmod_000_directories():
    top = tempfile.mkdtemp(prefix="grpo-test-rm-", dir="/tmp")  # /tmp: reachable by uid 65534
    os.chmod(top, 0o777)
    tree = os.path.join(top, "tree")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # as uid 65534, who owns the tree but cannot enter its chmod 000 directories
        try:
            os.setgid(65534)
            os.setuid(65534)
            os.makedirs(os.path.join(tree, "a", "b", "c"))
            open(os.path.join(tree, "a", "b", "file"), "w").close()
            os.chmod(os.path.join(tree, "a", "b"), 0)
            os.chmod(os.path.join(tree, "a"), 0o500)
            os.chmod(tree, 0)
            try:
                os.listdir(tree)
                report = "could list"
            except PermissionError:
                report = "cannot list"
            report += f" {remove_tree(tree, patience_s=1)} {os.path.lexists(tree)}"
        except BaseException as err:
            report = repr(err)
        os.write(write, report.encode())
        os._exit(0)
    os.close(write)
    report = os.read(read, 1000).decode()
    os.waitpid(pid, 0)
    os.close(read)
    remove_tree(top)
    assert report == "cannot list True False"
    assert not os.path.exists(top)


def test_remove_tree_outlasts_a_process_still_writing(tmp_path):
    top = tmp_path / "tree"
    (top / "sub").mkdir(parents=True)
    writer = subprocess.Popen([sys.executable, "-c", f"""
import os, time
end = time.monotonic() + 1.0
i = 0
while time.monotonic() < end:
    try:
        os.makedirs({str(top / 'sub')!r} + f"/d{{i}}", exist_ok=True)
        open({str(top / 'sub')!r} + f"/d{{i}}/f", "w").close()
    except OSError:
        pass
    i += 1
"""])
    try:
        time.sleep(0.3)
        assert remove_tree(str(top), patience_s=20) is True
    finally:
        writer.wait(timeout=30)
    assert not top.exists()


def test_pools_remove_their_scratch_roots_and_those_of_dead_trainers(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead, live = tmp_path / "grpo-pool-dead", tmp_path / "grpo-pool-live"
    for root in (dead, live):
        (root / "worker-x" / "grpo-sandbox-y").mkdir(parents=True)
        (root / ".lock").touch()
    (tmp_path / "grpo-pool-unlocked").mkdir()  # no lock file: a pool being made, or not ours
    held = os.open(live / ".lock", os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # as its trainer does
    try:
        remove_stale_pool_roots(str(tmp_path))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["grpo-pool-live", "grpo-pool-unlocked"]

        pool = WorkerPool("grpo.tasks.arithmetic:arithmetic_reward", num_workers=2, timeout_s=30)
        try:
            pool.start(wait=True)
            roots = [w.scratch for w in pool._workers]
            assert len(set(roots)) == 2 and all(os.path.isdir(r) for r in roots)
            assert os.path.dirname(roots[0]).startswith(str(tmp_path / "grpo-pool-"))
        finally:
            pool.close()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["grpo-pool-live", "grpo-pool-unlocked"]
    finally:
        os.close(held)
