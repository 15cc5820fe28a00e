"""grpo.rundir: one run per directory (a lock another process cannot take, released when its holder dies), the
run fingerprint a resume must match, and no fresh start into a directory holding checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from grpo.config import MasterConfig
from grpo.rundir import (
    FINGERPRINT_FILE, LOCK_FILE, RESUME_MUTABLE, RunDirError, RunLock, check_fingerprint, check_fresh_start,
    claim_run_dirs, distinct_dirs, recorded_run_id, run_fingerprint, write_fingerprint,
)
from tests.e2e import REPO, child_env


def _lock_in_child(directory, hold: bool = False) -> subprocess.Popen:
    code = ("import sys, time\nfrom grpo.rundir import RunLock, RunDirError\n"
            "try:\n    lock = RunLock(sys.argv[1])\n"
            "except RunDirError as e:\n    print(e, file=sys.stderr); sys.exit(3)\n"
            "print('locked', flush=True)\n"
            "time.sleep(600 if sys.argv[2] == '1' else 0)\n")
    return subprocess.Popen([sys.executable, "-c", code, str(directory), "1" if hold else "0"], cwd=REPO,
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_second_process_fails_at_once_naming_the_holder(tmp_path):
    with RunLock(tmp_path / "run") as lock:
        holder = json.loads(lock.path.read_text())
        assert holder["pid"] == os.getpid() and holder["host"] and holder["started"]
        child = _lock_in_child(tmp_path / "run")
        out, err = child.communicate(timeout=60)
        assert child.returncode == 3, out + err
        assert f"{tmp_path / 'run'} is in use by another run (PID {os.getpid()} on " in err
    child = _lock_in_child(tmp_path / "run")  # released: the next run may go
    assert child.communicate(timeout=60)[0] == "locked\n" and child.returncode == 0


def test_the_lock_dies_with_its_holder_even_under_kill_9(tmp_path):
    child = _lock_in_child(tmp_path, hold=True)
    try:
        assert child.stdout.readline() == "locked\n"
        with pytest.raises(RunDirError, match=rf"PID {child.pid} on "):
            RunLock(tmp_path)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=60)
    with RunLock(tmp_path):  # no stale lock
        pass
    assert (tmp_path / LOCK_FILE).exists()


def test_the_same_directory_twice_in_one_process_is_refused_and_distinct_dirs_dedups(tmp_path):
    with RunLock(tmp_path):
        with pytest.raises(RunDirError, match=f"PID {os.getpid()}"):
            RunLock(tmp_path)
    assert distinct_dirs(tmp_path, f"{tmp_path}/", tmp_path / "logs" / "..", tmp_path / "logs") == \
        [tmp_path.resolve(), (tmp_path / "logs").resolve()]


def _cfg(*overrides: tuple[str, object]) -> dict:
    raw = MasterConfig().model_dump(mode="json")
    for key, value in overrides:
        *parents, leaf = key.split(".")
        node = raw
        for p in parents:
            node = node[p]
        node[leaf] = value
    return MasterConfig.model_validate(raw).model_dump(mode="json")


def test_fingerprint_holds_model_data_seed_and_ignores_only_the_resume_mutable_fields():
    fp = run_fingerprint(_cfg())
    assert fp["model"] == "Qwen/Qwen2.5-1.5B" and fp["seed"] == 42 and fp["data"]["dataset_name"] == "arithmetic"
    same = run_fingerprint(_cfg(("grpo.max_num_steps", 7), ("grpo.val_period", 3), ("logger.log_dir", "x"),
                                ("logger.wandb.project", "p"), ("checkpointing.keep_top_k", 1),
                                ("checkpointing.checkpoint_must_save_by", "00:01:00:00"),
                                ("checkpointing.resume", False), ("cluster.num_nodes", 2)))
    assert same["config_sha256"] == fp["config_sha256"]
    for key, value in [("grpo.seed", 1), ("policy.optimizer.lr", 1e-3), ("data.dataset_name", "x.jsonl"),
                       ("loss_fn.ratio_clip_max", 0.3), ("policy.model_name", "other")]:
        assert run_fingerprint(_cfg((key, value)))["config_sha256"] != fp["config_sha256"], key
    assert not any(k.startswith(("logger.", "cluster.")) for k in fp["config"])
    assert "checkpointing.save_period" in RESUME_MUTABLE and "policy.optimizer.lr" in fp["config"]


def test_check_fingerprint_names_the_differing_field_and_can_be_overridden(tmp_path):
    fp = run_fingerprint(_cfg())
    check_fingerprint(tmp_path, fp)  # nothing recorded yet
    assert recorded_run_id(tmp_path) is None
    run_id = write_fingerprint(tmp_path, fp)
    assert recorded_run_id(tmp_path) == run_id and len(run_id) == 32
    check_fingerprint(tmp_path, run_fingerprint(_cfg(("grpo.max_num_steps", 99))))  # a resume that trains longer
    other = run_fingerprint(_cfg(("policy.optimizer.lr", 1e-3), ("grpo.seed", 7)))
    check_fingerprint(tmp_path, other)  # the recorded run wrote nothing yet (stopped at startup): no conflict
    (tmp_path / "step_000002").mkdir()  # now it has a checkpoint
    with pytest.raises(RunDirError) as err:
        check_fingerprint(tmp_path, other)
    message = str(err.value)
    assert f"{tmp_path} belongs to a run with another config (grpo.seed: 42 -> 7; policy.optimizer.lr: 5e-06 -> " \
           "0.001)" in message and "checkpointing.allow_config_change=true" in message
    check_fingerprint(tmp_path, other, allow_change=True)
    assert write_fingerprint(tmp_path, other) == run_id  # the run keeps its id
    assert json.loads((tmp_path / FINGERPRINT_FILE).read_text())["config_sha256"] == other["config_sha256"]


def test_an_unreadable_fingerprint_is_named(tmp_path):
    (tmp_path / FINGERPRINT_FILE).write_text("{")
    with pytest.raises(RunDirError, match=f"{FINGERPRINT_FILE}: unreadable"):
        check_fingerprint(tmp_path, run_fingerprint(_cfg()))


def test_resume_false_refuses_a_directory_with_checkpoints(tmp_path):
    check_fresh_start(tmp_path / "missing")
    (tmp_path / "step_000010.tmp").mkdir()
    (tmp_path / "hf_final").mkdir()
    check_fresh_start(tmp_path)  # no checkpoint yet
    (tmp_path / "step_000010").mkdir()
    with pytest.raises(RunDirError, match=rf"checkpointing.resume=false but {tmp_path} holds checkpoints "
                                          r"\(step_000010\)"):
        check_fresh_start(tmp_path)


def test_claim_run_dirs_locks_checks_and_records(tmp_path):
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    locks, run_id = claim_run_dirs(ckpt, logs, _cfg(), resume=True)
    with pytest.raises(RunDirError, match="is in use by another run"):
        claim_run_dirs(ckpt, tmp_path / "other_logs", _cfg(), resume=True)
    assert not (tmp_path / "other_logs" / FINGERPRINT_FILE).exists()  # nothing recorded by the refused claim
    for lock in locks:
        lock.release()
    (ckpt / "step_000002").mkdir()
    locks, again = claim_run_dirs(ckpt, logs, _cfg(("grpo.max_num_steps", 50)), resume=True)  # resume, train longer
    assert again == run_id and [lk.directory for lk in locks] == [ckpt.resolve(), logs.resolve()]
    for lock in locks:
        lock.release()
    with pytest.raises(RunDirError, match="checkpointing.resume=false"):
        claim_run_dirs(ckpt, logs, _cfg(), resume=False)
    with pytest.raises(RunDirError, match=r"policy.optimizer.lr: 5e-06 -> 0.1"):
        claim_run_dirs(ckpt, logs, _cfg(("policy.optimizer.lr", 0.1)), resume=True)
    locks, _ = claim_run_dirs(ckpt, logs, _cfg(("policy.optimizer.lr", 0.1)), resume=True, allow_change=True)
    for lock in locks:  # the refusals above released what they had locked
        lock.release()
    locks, log_run = claim_run_dirs(None, tmp_path / "only_logs", _cfg(), resume=False)  # checkpointing off
    assert len(locks) == 1 and log_run != run_id
    locks[0].release()
