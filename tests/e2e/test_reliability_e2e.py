"""End to end: what a hostile user does to a run (issue 10's list): non-finite steps, rewards that always fail,
two runs in one directory, signals, corrupt checkpoints, prompts that cannot fit, and metrics after a resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.e2e import REPO, TINY, child_env, kill_at_random_points, metrics, paths, run, train_rows


def cmd(tmp: Path, *extra: str) -> list[str]:
    return [sys.executable, "train_grpo.py", "--config", TINY, *paths(tmp, *extra)]


def steps_logged(tmp: Path) -> list[int]:
    return [r["step"] for r in metrics(tmp) if "train/loss" in r]


def test_a_diverging_run_stops_after_max_nonfinite_steps_names_it_and_exports_nothing(tmp_path):
    p = run(cmd(tmp_path, "policy.optimizer.lr=1e30", "grpo.max_num_steps=8", "policy.max_nonfinite_steps=2",
                "checkpointing.save_period=1"), check=False)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "non-finite steps in a row (policy.max_nonfinite_steps=2)" in p.stderr, p.stderr[-3000:]
    assert not (tmp_path / "ckpt" / "hf_final").exists()
    rows = train_rows(tmp_path)
    bad = [r for r in rows.values() if r["train/nonfinite_steps"] > 0]
    assert len(bad) == 2 and len(rows) < 8
    assert any(isinstance(v, str) and v in ("nan", "inf", "-inf") for r in bad for v in r.values())  # never null
    last_saved = json.loads((tmp_path / "ckpt" / "latest_checkpoint_status.json").read_text())["step"]
    assert last_saved < max(rows)  # the non-finite steps were not saved: the last checkpoint is the last good one


def test_a_reward_that_fails_on_every_sample_stops_the_run_with_its_last_error(tmp_path):
    p = run(cmd(tmp_path, "env.name=function", "env.reward_fn=tests.helpers.e2e_reward_fns:huge_reward",
                "grpo.rollout_failure.max_consecutive_skipped_steps=2", "grpo.rollout_failure.max_data_attempts_per_prompt=1",
                "grpo.max_num_steps=6", "checkpointing.save_period=10"), check=False)
    assert p.returncode == 1, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "2 steps in a row skipped" in errors[0] and "finite float32" in errors[0], p.stderr
    rows = {r["step"]: r for r in metrics(tmp_path)}
    assert sorted(rows) == [1, 2] and not train_rows(tmp_path)  # two skipped steps: nothing trained
    assert rows[1]["rollout/failed_samples"] == 16 and rows[2]["rollout/skipped_steps"] == 2
    assert (tmp_path / "ckpt" / "step_000002").is_dir()  # the run's state is good: saved, not exported
    assert not (tmp_path / "ckpt" / "hf_final").exists()


@pytest.mark.slow  # default-suite twin: tests/integration/test_export_guard.py and tests/unit/test_rundir.py
def test_one_run_per_directory_and_a_resume_must_match_the_run(tmp_path):
    a = subprocess.Popen(cmd(tmp_path, "grpo.max_num_steps=200", "checkpointing.save_period=1"), cwd=REPO,
                         env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while not steps_logged_safe(tmp_path) and time.time() < deadline:
            time.sleep(0.2)
        b = run(cmd(tmp_path, "grpo.max_num_steps=2"), check=False, timeout=120)
        assert b.returncode == 1 and f"PID {a.pid}" in b.stderr, b.stderr[-3000:]
    finally:
        a.kill()
        a.wait()
    # A fresh start into a directory holding checkpoints refuses instead of mixing runs.
    p = run(cmd(tmp_path, "grpo.max_num_steps=2", "checkpointing.resume=false"), check=False, timeout=120)
    assert p.returncode == 1 and "resume=false" in p.stderr, p.stderr[-3000:]
    # A resume with another config names what differs; the override flag lets a deliberate change through.
    p = run(cmd(tmp_path, "grpo.max_num_steps=2", "grpo.seed=7"), check=False, timeout=120)
    assert p.returncode == 1 and "grpo.seed" in p.stderr and "allow_config_change" in p.stderr, p.stderr[-3000:]


def steps_logged_safe(tmp: Path) -> list[int]:
    try:
        return steps_logged(tmp)
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def worker_pids(pid: int) -> list[int]:
    """Live reward workers of ``pid``: its children started by multiprocessing's spawn (``spawn_main``)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid
                        and b"spawn_main" in (d / "cmdline").read_bytes()):
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def alive(pids: list[int], within_s: float = 10.0) -> list[int]:
    """The processes of ``pids`` still running (not zombies) after up to ``within_s`` seconds."""
    def running(p: int) -> bool:
        try:
            return Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.time() + within_s
    while True:
        left = [p for p in pids if running(p)]
        if not left or time.time() > deadline:
            return left
        time.sleep(0.2)


# SIGINT takes the same path as SIGTERM (grpo/system/signals.py; tests/integration/test_signals.py checks both): slow suite only.
@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143),
                                         pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow)])
def test_a_signal_finishes_the_step_saves_stops_the_workers_and_the_same_command_resumes(tmp_path, sig, status):
    common = ("checkpointing.save_period=100", "env.name=function",
              "env.reward_fn=tests.helpers.e2e_reward_fns:slow_arithmetic")
    args = cmd(tmp_path, "grpo.max_num_steps=40", *common)
    proc = subprocess.Popen(args, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.time() + 240
    while len(steps_logged_safe(tmp_path)) < 2 and time.time() < deadline:
        time.sleep(0.2)
    workers = worker_pids(proc.pid)
    assert workers, "no reward worker processes"
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == status, out[-3000:]
    last = max(steps_logged(tmp_path))
    assert json.loads((tmp_path / "ckpt" / "latest_checkpoint_status.json").read_text())["step"] == last
    assert not (tmp_path / "ckpt" / "hf_final").exists()
    assert not alive(workers), "reward workers outlived the trainer"
    p = run(cmd(tmp_path, f"grpo.max_num_steps={last + 1}", *common), timeout=300)
    assert f"resumed from {tmp_path / 'ckpt' / f'step_{last:06d}'}" in p.stdout + p.stderr
    assert steps_logged(tmp_path) == list(range(1, last + 2))  # every step once in metrics.jsonl


def test_a_corrupt_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path):
    run(cmd(tmp_path, "grpo.max_num_steps=4", "checkpointing.save_period=2"))
    newest = tmp_path / "ckpt" / "step_000004"
    states = next(newest.rglob("*model_states.pt"))
    states.write_bytes(states.read_bytes()[:100])  # truncated
    (tmp_path / "ckpt" / "hf_final").rename(tmp_path / "hf_final_before")
    p = run(cmd(tmp_path, "grpo.max_num_steps=5", "checkpointing.save_period=2"), timeout=300)
    out = p.stdout + p.stderr
    assert "step_000004 is not intact" in out and "resumed from" in out and "step_000002" in out
    assert steps_logged(tmp_path) == [1, 2, 3, 4, 5]  # the lost steps 3-4 are trained again, each logged once


def test_a_prompt_that_cannot_fit_is_named_at_load_or_skipped_and_counted(tmp_path):
    data = tmp_path / "train.jsonl"
    rows = [{"input": f"{i}+1=", "output": str(i + 1)} for i in range(40)]
    rows[5] = {"input": "1" * 40 + "+1=", "output": "2"}  # within max_input_seq_length, over the 16-token limit
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    files = [f"data.train_data_path={data}", f"data.val_data_path={data}", "grpo.max_num_steps=1"]
    p = run(cmd(tmp_path, *files), check=False, timeout=120)
    assert p.returncode == 1 and "train.jsonl:6" in p.stderr and "max_total_sequence_length=16" in p.stderr
    p = run(cmd(tmp_path / "skip", *files, "data.on_bad_row=skip"), timeout=300)
    assert "1 with no room under policy.max_total_sequence_length skipped" in p.stdout + p.stderr


@pytest.mark.slow
def test_kill_9_at_random_points_then_rerun_ends_like_an_uninterrupted_run(tmp_path):
    """kill -9 at KILL_POINTS (env, default 4) random moments across steps and saves, rerun each time: the final
    metrics equal an uninterrupted run's and metrics.jsonl holds every step once."""
    extra = ("grpo.max_num_steps=8", "checkpointing.save_period=1")
    full = tmp_path / "full"
    run(cmd(full, *extra))
    killed = tmp_path / "killed"
    kill_at_random_points(cmd(killed, *extra), int(os.environ.get("KILL_POINTS", "4")), 25.0,
                          int(os.environ.get("KILL_SEED", "0")))
    run(cmd(killed, *extra), timeout=600)
    a, b = train_rows(full), train_rows(killed)
    assert [r["step"] for r in metrics(killed) if "train/loss" in r] == list(range(1, 9))
    for step in (7, 8):
        assert abs(a[step]["train/loss"] - b[step]["train/loss"]) < 1e-5, (step, a[step], b[step])
        assert a[step]["train/mean_total_reward"] == b[step]["train/mean_total_reward"]
