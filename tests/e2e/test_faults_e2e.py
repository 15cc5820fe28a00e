"""End to end, issue 25's faults: an environment that breaks mid-run (sync loop), a log disk that refuses
rollout dumps, a rerun over another run's metrics.jsonl, a stop signal in the middle of a step (SIGUSR1 /
SIGHUP as SLURM and a closed ssh session send it), and errors that must read as one `error:` line."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.e2e import REPO, TINY, child_env, paths, run, train_rows


def cmd(tmp: Path, *extra: str) -> list[str]:
    return [sys.executable, "train_grpo.py", "--config", TINY, *paths(tmp, *extra)]


def saved_step(tmp: Path) -> int:
    return json.loads((tmp / "ckpt" / "latest_checkpoint_status.json").read_text())["step"]


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


# ---- fault 5: global_post_process_and_metrics raises in the synchronous loop ------------------------------
def boom_data(tmp: Path, train_boom: bool) -> list[str]:
    """Unshuffled arithmetic rows; "boom" (tests.helpers.multiturn_envs:FailsOnBoom fails the whole rollout batch on it)
    in the second training prompt batch, or in the validation set."""
    rows = [{"input": f"{i % 10}+{i // 10}=", "output": str(i % 10 + i // 10)} for i in range(40)]
    val = rows[:4]
    if train_boom:
        rows[5] = {"input": "boom", "output": "0"}
    else:
        val = [*val[:3], {"input": "boom", "output": "0"}]
    (tmp / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp / "val.jsonl").write_text("\n".join(json.dumps(r) for r in val) + "\n")
    return [f"data.train_data_path={tmp / 'train.jsonl'}", f"data.val_data_path={tmp / 'val.jsonl'}",
            "data.shuffle=false", "env.name=class", "env.env_class=tests.helpers.multiturn_envs:FailsOnBoom",
            "checkpointing.save_period=10"]


@pytest.mark.parametrize("where", ["train", pytest.param("val", marks=pytest.mark.slow)])  # the same path
def test_an_environment_that_raises_stops_the_sync_loop_with_a_checkpoint_and_one_error_line(tmp_path, where):
    extra = ["grpo.max_num_steps=4"] if where == "train" else ["grpo.max_num_steps=2", "grpo.val_period=1"]
    p = run(cmd(tmp_path, *boom_data(tmp_path, where == "train"), *extra), check=False)
    assert p.returncode == 1, p.stderr[-3000:]
    failed = "the rollout of step 2 failed" if where == "train" else "validation at step 1 failed"
    line = last_line(p.stderr)
    assert line.startswith(f"error: {failed}") and "boom in this prompt batch" in line, p.stderr[-3000:]
    assert "step 1 is checkpointed" in line and "rerun the same command" in line
    assert sorted(train_rows(tmp_path)) == [1] and saved_step(tmp_path) == 1  # step 1 was not lost
    assert not (tmp_path / "ckpt" / "hf_final").exists()


# ---- fault 6: a log directory that refuses the rollout dumps ---------------------------------------------------
def test_a_rollout_dump_the_file_system_refuses_is_counted_and_warned_and_the_run_goes_on(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rollouts").write_text("")  # a file where the dumps' directory should be
    p = run(cmd(tmp_path, "logger.dump_rollouts=true", "grpo.max_num_steps=2", "checkpointing.save_period=10"))
    out = p.stdout + p.stderr
    assert out.count("warning: could not write the rollout dump") == 1 and "dumps are off" in out, out[-3000:]
    rows = train_rows(tmp_path)
    assert sorted(rows) == [1, 2] and rows[2]["logger/dump_write_failures"] == 1
    assert saved_step(tmp_path) == 2 and (tmp_path / "ckpt" / "hf_final").is_dir()


# ---- fault 7: a rerun in the same log directory must not delete the earlier run's metrics ----------------------
@pytest.mark.slow  # its default-suite twin: test_claim_metrics_truncates_only_this_runs_resume_and_keeps_another_runs_file
def test_a_fresh_run_in_a_used_log_directory_keeps_the_earlier_metrics_under_another_name(tmp_path):
    args = cmd(tmp_path, "grpo.max_num_steps=1", "checkpointing.enabled=false")
    run(args)
    first = (tmp_path / "logs" / "metrics.jsonl").read_text()
    p = run(args)  # the same command again: checkpointing off, so a fresh run
    kept = list((tmp_path / "logs").glob("metrics.*.jsonl"))
    assert len(kept) == 1 and kept[0].read_text() == first, sorted(os.listdir(tmp_path / "logs"))
    assert f"kept as {kept[0]}" in p.stdout + p.stderr
    assert sorted(train_rows(tmp_path)) == [1]


# ---- faults 8 and 9: a stop signal mid-step abandons the step before training and saves the last one ----------
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    run(cmd(tmp, *SIGNAL_RUN))
    return train_rows(tmp)


SIGNAL_RUN = ("grpo.max_num_steps=3", "checkpointing.save_period=100", "env.name=function",
              "env.reward_fn=tests.helpers.signal_reward_fns:arithmetic_then_signal")


# SIGUSR1 fails on the old code twice over (killed at once; step 3 not abandoned); SIGTERM and SIGHUP take the
# same path (tests/integration/test_signals.py checks every signal's handler): slow suite only.
@pytest.mark.parametrize("sig", [signal.SIGUSR1, pytest.param(signal.SIGTERM, marks=pytest.mark.slow),
                                 pytest.param(signal.SIGHUP, marks=pytest.mark.slow)])
def test_a_signal_during_a_rollout_abandons_the_step_saves_the_last_one_and_the_rerun_matches(tmp_path, sig,
                                                                                              uninterrupted):
    # 16 reward calls per step: the 40th is in the middle of step 3's rollout. Before, step 3 ran to its end
    # (a step longer than the launcher's grace was killed unsaved) and these signals killed the run at once.
    env = {**child_env(), "GRPO_TEST_SIGNAL": sig.name, "GRPO_TEST_SIGNAL_AT": "40",
           "GRPO_TEST_COUNTER": str(tmp_path / "calls")}
    p = subprocess.run(cmd(tmp_path, *SIGNAL_RUN), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 128 + sig, out[-3000:]
    assert f"{sig.name} received during step 3: the step was abandoned before training" in out, out[-3000:]
    assert sorted(train_rows(tmp_path)) == [1, 2] and saved_step(tmp_path) == 2
    assert not (tmp_path / "ckpt" / "hf_final").exists()
    p = run(cmd(tmp_path, *SIGNAL_RUN))
    assert f"resumed from {tmp_path / 'ckpt' / 'step_000002'}" in p.stdout + p.stderr
    rows = train_rows(tmp_path)
    assert sorted(rows) == [1, 2, 3]
    assert rows[3]["train/loss"] == pytest.approx(uninterrupted[3]["train/loss"], rel=1e-5, abs=1e-7)
    assert rows[3]["train/mean_total_reward"] == uninterrupted[3]["train/mean_total_reward"]


# ---- one `error:` line, no traceback, for errors written for people -------------------------------------------
def test_a_log_dir_that_is_a_file_and_a_bad_data_row_give_one_error_line(tmp_path):
    (tmp_path / "logs").write_text("")
    p = run(cmd(tmp_path, "grpo.max_num_steps=1"), check=False, timeout=120)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert last_line(p.stderr).startswith(f"error: cannot write {tmp_path / 'logs'}"), p.stderr[-3000:]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "1+1=", "output": "2"}\n{"input": 3}\n')
    p = run(cmd(tmp_path / "b", f"data.train_data_path={bad}", f"data.val_data_path={bad}"), check=False, timeout=120)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert last_line(p.stderr).startswith("error: ") and "bad.jsonl line 2" in p.stderr, p.stderr[-3000:]
    env = {**child_env(), "GRPO_DEBUG": "1"}
    p = subprocess.run(cmd(tmp_path / "b", f"data.train_data_path={bad}", f"data.val_data_path={bad}"), cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "Traceback" in p.stderr and last_line(p.stderr).startswith("error: ")


def test_a_file_size_limit_is_named_as_such_not_as_a_full_disk(tmp_path):
    limit = 512 * 1024  # more than metrics.jsonl, less than a checkpoint's optimizer states

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    p = subprocess.run(cmd(tmp_path, "grpo.max_num_steps=1", "checkpointing.save_period=1"), cwd=REPO,
                       env=child_env(), capture_output=True, text=True, timeout=300, preexec_fn=limited)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    line = last_line(p.stderr)
    assert line.startswith("error: could not write checkpoint step 1"), p.stderr[-3000:]
    assert f"file-size limit of {limit} bytes" in line and "ulimit -f" in line and "free some space" not in line
