"""End to end: the distillation teacher on a rank of its own (on_policy_distillation.non_colocated_teachers), 1
training rank and 1 teacher rank under torchrun, against the same teacher on the training rank (one process).

Default suite (~45 s): the synchronous loop, 3 steps, the same losses. ``-m slow``: the asynchronous loop the same
way, a teacher beside a generation rank (3 ranks), a ZeRO-3 teacher over two teacher ranks, and a teacher that cannot
load stopping the launch with one line.
"""

from __future__ import annotations

import sys

import pytest

from tests.helpers.e2e import REPO, TINY, launcher, paths, run, train_rows

OPD = ["on_policy_distillation.enabled=true", "on_policy_distillation.teacher_model_name=toy:tiny",
       "on_policy_distillation.kl_coef=0.5", "checkpointing.enabled=false"]
TEACHER_RANK = ["on_policy_distillation.non_colocated_teachers.enabled=true",
                "on_policy_distillation.non_colocated_teachers.default_teacher_cfg.gpus_per_node=1"]
ASYNC = ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"]


def torchrun(n: int, script: str, tmp, *extra: str, check: bool = True):
    return run([*launcher("torchrun"), "--standalone", "--nproc_per_node", str(n), script, "--config", TINY,
                *paths(tmp), *OPD, *TEACHER_RANK, *extra], threads=None, check=check)


def same_losses(tmp, steps: int) -> None:
    """The run under ``tmp/split`` trained the losses of the run under ``tmp/one`` within 1e-5, step by step."""
    split, one = train_rows(tmp / "split"), train_rows(tmp / "one")
    assert sorted(split) == sorted(one) == list(range(1, steps + 1))
    for step in split:  # the same samples (per-sample seeds), the same teacher logprobs: the same updates
        assert split[step]["train/loss"] == pytest.approx(one[step]["train/loss"], abs=1e-5), step


def test_a_teacher_on_a_rank_of_its_own_trains_the_losses_of_the_teacher_on_the_training_rank(tmp_path):
    p = torchrun(2, "train_grpo.py", tmp_path / "split", "grpo.max_num_steps=3")
    assert "2 ranks: 1 train, 1 teach (on_policy_distillation.non_colocated_teachers)" in p.stdout + p.stderr
    run([sys.executable, "train_grpo.py", "--config", TINY, *paths(tmp_path / "one"), *OPD, "grpo.max_num_steps=3"])
    same_losses(tmp_path, 3)


@pytest.mark.slow  # 40 s
def test_async_loop_with_a_teacher_rank_trains_the_losses_of_the_teacher_on_the_training_rank(tmp_path):
    torchrun(2, "train_async_grpo.py", tmp_path / "split", "grpo.max_num_steps=2", *ASYNC)
    run([sys.executable, "train_async_grpo.py", "--config", TINY, *paths(tmp_path / "one"), *OPD, *ASYNC,
         "grpo.max_num_steps=2"])
    same_losses(tmp_path, 2)


@pytest.mark.slow  # 60 s
def test_a_teacher_rank_beside_a_generation_rank_trains_the_same_losses(tmp_path):
    p = torchrun(3, "train_grpo.py", tmp_path / "split", "grpo.max_num_steps=2",
                 "policy.generation.colocated.enabled=false", "policy.generation.colocated.resources.gpus_per_node=1")
    assert "3 ranks: 1 train, 1 teach (on_policy_distillation.non_colocated_teachers), 1 generate (hf" in \
        p.stdout + p.stderr
    run([sys.executable, "train_grpo.py", "--config", TINY, *paths(tmp_path / "one"), *OPD, "grpo.max_num_steps=2"])
    same_losses(tmp_path, 2)


@pytest.mark.slow  # 50 s
def test_two_teacher_ranks_sharing_a_zero3_teacher_train_the_same_losses(tmp_path):
    """The teacher over two teacher ranks as a ZeRO-3 inference engine (each rank scores its share of the rows, their
    own group gathers them) gives the teacher logprobs of a plain teacher on the training rank."""
    TEACHER_RANK_2 = [a.replace("gpus_per_node=1", "gpus_per_node=2") for a in TEACHER_RANK]
    p = run([*launcher("torchrun"), "--standalone", "--nproc_per_node", "3", "train_grpo.py", "--config", TINY,
             *paths(tmp_path / "split"), *OPD, *TEACHER_RANK_2, "policy.reference_placement=zero3",
             "grpo.max_num_steps=2"], threads=None)
    assert "3 ranks: 1 train, 2 teach" in p.stdout + p.stderr
    run([sys.executable, "train_grpo.py", "--config", TINY, *paths(tmp_path / "one"), *OPD, "grpo.max_num_steps=2"])
    same_losses(tmp_path, 2)


@pytest.mark.slow  # 25 s
def test_a_teacher_that_cannot_load_stops_the_launch_with_one_line(tmp_path):
    missing = tmp_path / "no_teacher_here"
    p = torchrun(2, "train_grpo.py", tmp_path, f"on_policy_distillation.teacher_model_name={missing}", check=False)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    line = f"error: starting the teacher ranks: teacher rank 0: could not load " \
           f"on_policy_distillation.teacher_model_name='{missing}'"
    assert line in out, out[-4000:]
    for ours in (f'File "{REPO}/grpo/', f'File "{REPO}/train_'):  # the ranks say lines, no traceback of ours
        assert ours not in out, out[-4000:]  # (torchrun's own stays, from a venv that may sit inside the repo)
    assert not (tmp_path / "logs" / "metrics.jsonl").exists() or not train_rows(tmp_path)


@pytest.mark.slow  # 30 s per loop
@pytest.mark.parametrize("script, extra", [("train_grpo.py", []), ("train_async_grpo.py", ASYNC)])
def test_a_killed_teacher_rank_stops_the_run_with_one_line_and_the_last_trained_step_saved(tmp_path, script, extra):
    """kill -9 of the teacher rank after step 2 (checkpoints every 10 steps): the trainer stops at once, naming the
    teacher rank, exit 1, with step 2 checkpointed by the run's end (not lost to the save period)."""
    import json
    import subprocess
    import time

    from tests.helpers.e2e import child_env, free_port

    port, procs = free_port(), []
    for rank in (0, 1):
        env = {**child_env(1), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        cmd = [sys.executable, script, "--config", TINY, *paths(tmp_path), *OPD, *TEACHER_RANK, *extra,
               "checkpointing.enabled=true", "checkpointing.save_period=10", "grpo.max_num_steps=40"]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(tmp_path / f"rank{rank}.log", "w"),
                                      stderr=subprocess.STDOUT))
    try:
        deadline = time.time() + 240
        while not ((tmp_path / "logs" / "metrics.jsonl").exists() and 2 in train_rows(tmp_path)):
            assert time.time() < deadline and procs[0].poll() is None, (tmp_path / "rank0.log").read_text()[-3000:]
            time.sleep(0.3)
        procs[1].kill()
        assert procs[0].wait(timeout=120) == 1
    finally:
        for p in procs:
            p.kill()
    log = (tmp_path / "rank0.log").read_text()
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "teacher rank 0 is gone" in errors[0], log[-3000:]
    assert "Traceback" not in log
    stopped_at = max(train_rows(tmp_path))
    status = json.loads((tmp_path / "ckpt" / "latest_checkpoint_status.json").read_text())
    assert (tmp_path / "ckpt" / f"step_{stopped_at:06d}").is_dir(), (status, log[-2000:])
