"""End to end, train_async_grpo.py serving the endpoint (issue 32): the agent demo shrunk (an openai-package agent
over the run's endpoint, the endpoint over the generation thread's weight copy) trains a few steps on the tokens the
endpoint recorded, within the staleness bound, and so do NeMo-Gym's agent servers; an outside client (the official
``openai`` package, a real process on loopback) is answered or refused with the bounded 503 all through an async
run, never left hanging (slow)."""

from __future__ import annotations

import sys

import pytest

from tests.e2e.test_agent_e2e import CONFIG, SMALL
from tests.e2e.test_agent_backends_e2e import SPLIT
from tests.helpers.e2e import REPO, launcher, metrics, paths, run, train_rows
from tests.helpers.outside_client import ask_while_it_runs, check_answered_or_refused, versions_answered

ASYNC = ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true",
         "grpo.async_grpo.max_trajectory_age_steps=1"]


@pytest.mark.slow
@pytest.mark.parametrize("lr", ["1.0e-3", "1.0e-12"])
def test_an_async_agent_run_trains_on_the_recorded_tokens_within_the_bound(tmp_path, lr):
    """With the demo's learning rate a step trains samples up to one step old, and those of age 0 (step 1 always)
    score exactly as recorded; with lr 1e-12 (> 0 is required) every version holds the same float32 weights, so
    every step must score the recorded tokens exactly, through the thread's weight loads, the endpoint's windows and
    validation's."""
    # validation at step 2 plays its agent samples over the same endpoint while the thread generates step 3's
    run([sys.executable, "train_async_grpo.py", "--config", CONFIG, *paths(tmp_path, *SMALL, *ASYNC),
         "grpo.max_num_steps=3", "grpo.val_period=2", "grpo.max_val_samples=4", "grpo.val_batch_size=4",
         f"policy.optimizer.lr={lr}"], timeout=1200)
    rows = train_rows(tmp_path)
    assert sorted(rows) == [1, 2, 3]
    for r in rows.values():
        assert r["train/env/agent/failed_samples"] == 0 and r["train/env/agent/noncontiguous_samples"] == 0
        assert 1 <= r["train/env/agent/calls_per_sample"] <= 3
        assert r["async/trajectory_age_max"] <= 1 and r["async/evicted_groups"] == 0
        if r["async/trajectory_age_max"] == 0 or lr == "1.0e-12":  # the weights that made them: the tokens recorded
            assert abs(r["train/token_mult_prob_error"] - 1.0) < 1e-3, r["step"]
    assert rows[1]["async/trajectory_age_max"] == 0  # step 1 always trains the initial weights' samples
    assert max(r["async/trajectory_age_max"] for r in rows.values()) == 1  # the thread ran a step ahead
    val = [r for r in metrics(tmp_path) if "validation/accuracy" in r]
    assert val and all(v["validation/failed_samples"] == 0 for v in val)


@pytest.mark.slow  # 24 s
def test_an_async_agent_run_with_two_trainers_and_a_generation_rank_loads_weights_mid_request(tmp_path):
    """2 trainers, each serving its own agents, over 1 generation rank (grpo/wings/agents/lockstep.py): the
    producers' weight loads, in-flight loads inside the endpoints' batches and validation's agent samples; lr 1e-12
    (every version holds the same float32 weights), so every step scores the recorded tokens exactly."""
    run([*launcher("torchrun"), "--standalone", "--nproc_per_node", "3", "train_async_grpo.py", "--config", CONFIG,
         *paths(tmp_path, *SMALL, *ASYNC), *SPLIT, "grpo.max_num_steps=3", "grpo.val_period=2",
         "grpo.max_val_samples=4", "grpo.val_batch_size=4", "grpo.async_grpo.in_flight_weight_updates=true",
         "policy.optimizer.lr=1.0e-12"], timeout=1200, threads=1)
    rows = train_rows(tmp_path)
    assert sorted(rows) == [1, 2, 3]
    for r in rows.values():
        assert r["train/env/agent/failed_samples"] == 0 and r["train/env/agent/noncontiguous_samples"] == 0
        assert abs(r["train/token_mult_prob_error"] - 1.0) < 1e-3, r["step"]
    assert rows[3]["async/in_flight_weight_updates"] >= 1  # weights changed inside a batch at least once
    val = [r for r in metrics(tmp_path) if "validation/accuracy" in r]
    assert val and all(v["validation/failed_samples"] == 0 for v in val)


@pytest.mark.slow
def test_outside_requests_during_an_async_run_are_answered_or_refused_never_left_hanging(tmp_path):
    # Many steps, stopped by SIGTERM once answers came from 3 weight versions: six steps of the tiny model can end
    # before the client's first request on a fast machine (every answer then a 503 "shutting_down": nothing tested).
    results, out, status = ask_while_it_runs("train_async_grpo.py", tmp_path, *ASYNC, "grpo.max_num_steps=2000",
                                             "checkpointing.save_period=2", max_wait_s=0.5,
                                             stop_when=lambda results: versions_answered(results) >= 3)
    assert status == 143, out[-4000:]
    steps = sorted(train_rows(tmp_path))
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] < 2000
    check_answered_or_refused(results, max_wait_s=0.5, steps=steps[-1])


@pytest.mark.slow
def test_an_async_nemo_gym_run_trains_on_the_token_fields(tmp_path):
    """NeMo-Gym's agent servers over the async loop's endpoint (NeMo-RL's async Gym recipes load for it)."""
    run([sys.executable, "train_async_grpo.py", "--config", str(REPO / "configs" / "cpu_demo_gym.yaml"),
         *paths(tmp_path, *ASYNC, *SMALL)], timeout=1200)
    rows = train_rows(tmp_path)
    assert sorted(rows) == [1, 2]
    assert all(r["train/env/nemo_gym/failed_samples"] == 0 and r["async/trajectory_age_max"] <= 1
               for r in rows.values())
    assert abs(rows[1]["train/token_mult_prob_error"] - 1.0) < 1e-3  # age 0: the very tokens the servers returned


@pytest.mark.slow
def test_an_async_agent_run_on_a_generation_rank_with_in_flight_updates(tmp_path):
    """One trainer and one hf generation rank (colocated.enabled=false): the endpoint serves the generation rank's
    backend, into which the thread also loads new weights between rounds of unfinished requests (in-flight updates);
    an answer is labelled with the version its batch started with."""
    from tests.e2e.test_noncolocated_e2e import torchrun

    torchrun("train_async_grpo.py", CONFIG, tmp_path, *SMALL, *ASYNC, "grpo.max_num_steps=3",
             "grpo.async_grpo.in_flight_weight_updates=true", "grpo.val_period=2", "grpo.max_val_samples=4",
             "grpo.val_batch_size=4", timeout=1200)  # validation's agents reach the generation rank too
    rows = train_rows(tmp_path)
    assert sorted(rows) == [1, 2, 3]
    for r in rows.values():
        assert r["train/env/agent/failed_samples"] == 0 and r["train/env/agent/noncontiguous_samples"] == 0
        assert r["async/trajectory_age_max"] <= 1 and r["async/evicted_groups"] == 0
        if r["async/trajectory_age_max"] == 0:
            assert abs(r["train/token_mult_prob_error"] - 1.0) < 1e-3, r["step"]
    val = [r for r in metrics(tmp_path) if "validation/accuracy" in r]
    assert val and all(v["validation/failed_samples"] == 0 for v in val)
