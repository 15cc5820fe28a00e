"""Tests of grpo/tasks: the scorers, the worker pool's error/timeout handling, the router, the factory and the catalogue."""

from __future__ import annotations

import doctest
import logging
import math
import multiprocessing as mp
import time

import pytest

import grpo.tasks.arithmetic
import grpo.tasks.catalogue
import grpo.tasks.function
import grpo.tasks.math
import grpo.tasks.reward
from grpo.config import DataConfig, EnvConfig
from grpo.system.data import load_rows
from grpo.tasks.factory import build_environment
from grpo.tasks.function import EnvError
from grpo.tasks.pool import CallError
from grpo.tasks.reward import RewardEnvironment, ScoreResult, collect
from grpo.tasks.arithmetic import arithmetic_reward
from grpo.tasks.function import score_sample, to_reward
from grpo.tasks.math import math_reward

FNS = "tests.helpers.reward_fns_for_tests"  # the repo is on sys.path (conftest.py); spawned workers inherit it


def sample(question="q", completion="", answer="", meta=None):
    return {"question": question, "completion": completion, "answer": answer, "meta": meta or {}}


@pytest.mark.parametrize("module", [grpo.tasks.reward, grpo.tasks.catalogue, grpo.tasks.arithmetic, grpo.tasks.function,
                                    grpo.tasks.math])
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


# --------------------------------------------------------------------------------------------------
# Pure pieces
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("completion,answer,want", [
    ("7", "7", 1.0),
    (" 7<eos>", "7", 1.0),
    ("the sum is 12.", "12", 1.0),
    ("-3 is it", "-3", 1.0),
    ("3", "-3", 0.0),
    ("70", "7", 0.0),
    ("8 or 7", "7", 0.0),
    ("no digits", "7", 0.0),
    ("", "0", 0.0),
    ("007", "7", 1.0),
])
def test_arithmetic_reward(completion, answer, want):
    assert arithmetic_reward("q", completion, answer, {}) == want


@pytest.mark.parametrize("value,want", [
    (1, (1.0, None)),
    (0.25, (0.25, None)),
    ({"a": 1, "b": 0.5}, (1.5, {"a": 1.0, "b": 0.5})),
    ({"reward": -1.0, "a": 2.0}, (-1.0, {"a": 2.0})),
    ({"reward": 3}, (3.0, {})),
])
def test_to_reward(value, want):
    assert to_reward(value) == want


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "1.0", None, True, {"a": float("nan")}, {"reward": "x"}])
def test_to_reward_rejects_non_finite_or_non_numbers(bad):
    with pytest.raises(ValueError, match="finite number"):
        to_reward(bad)


def test_score_sample_calls_positionally_with_meta():
    seen = []

    def fn(q, c, a, m):
        seen.append((q, c, a, m))
        return 1.0

    assert score_sample(fn, sample("Q", "C", "A", {"k": 1})) == (1.0, None)
    assert seen == [("Q", "C", "A", {"k": 1})]


def test_collect_reports_failures_unscored_and_fills_missing_components_with_zero():
    outcomes = [("ok", (1.5, {"f": 0.5, "c": 1.0})), ("error", CallError("data", "tb")), ("ok", (2.0, {"g": 2.0})),
                ("timeout", "t"), ("ok", (0.5, None))]
    r = collect(outcomes, seconds=2.0)
    assert r.rewards == [1.5, 0.0, 2.0, 0.0, 0.5]  # the failed samples' 0.0 are placeholders
    assert [f and (f.reason, f.kind, f.detail) for f in r.failures] == [
        None, ("reward_error", "data", "tb"), None, ("reward_timeout", "infra", "t"), None]
    assert r.components == [{"f": 0.5, "c": 1.0, "g": 0.0}, {"f": 0.0, "c": 0.0, "g": 0.0},
                            {"f": 0.0, "c": 0.0, "g": 2.0}, {"f": 0.0, "c": 0.0, "g": 0.0},
                            {"f": 0.0, "c": 0.0, "g": 0.0}]
    assert (r.num_errors, r.num_timeouts) == (1, 1)
    assert r.metrics == {"env/error_rate": 0.2, "env/timeout_rate": 0.2, "env/score_s": 2.0}
    assert collect([("ok", (1.0, None))], 0.0).components is None


# --------------------------------------------------------------------------------------------------
# Math (math-verify) and reasoning-gym scorers
# --------------------------------------------------------------------------------------------------
MATH_CASES = [
    (r"\boxed{3/4}", "0.75", 1.0),
    ("0.75", r"so the answer is $\boxed{\frac{3}{4}}$", 1.0),
    ("42", "The answer is 42", 1.0),
    ("42", "The answer is 43", 0.0),
    ("x+1", "$1+x$", 1.0),  # a bare gold expression only parses once wrapped in $...$
    ("x+1", "$x+2$", 0.0),
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", r"\boxed{72}", 1.0),  # GSM8K-style gold
]


@pytest.mark.parametrize("gold,completion,want", MATH_CASES)
def test_math_reward_in_main_thread(gold, completion, want):
    assert math_reward("q", completion, gold, {}) == want


def test_math_reward_unparseable_gold_raises():
    with pytest.raises(ValueError, match="cannot parse the gold answer"):
        math_reward("q", "1", "", {})


def test_math_env_scores_in_worker_processes():
    with build_environment(EnvConfig(name="math", num_workers=2, timeout_s=30)) as env:
        assert env._pool is not None and env._pool._workers == []  # lazy: nothing started yet
        result = env.score([sample(completion=c, answer=g) for g, c, _ in MATH_CASES] + [sample(answer="")])
    assert result.rewards == [w for _, _, w in MATH_CASES] + [0.0]
    assert (result.num_errors, result.num_timeouts, result.components) == (1, 0, None)


def test_reasoning_gym_env():
    data_cfg = DataConfig(dataset_name="reasoning_gym:basic_arithmetic", num_train_samples=3)
    rows = load_rows(data_cfg, "train", seed=0)
    wrong = str(int(rows[1]["answer"]) + 1)
    samples = [
        {**rows[0], "completion": f"Let me think.\n<answer>{rows[0]['answer']}</answer>"},
        {**rows[1], "completion": f"<answer>{wrong}</answer>"},
        {**rows[2], "completion": f"  {rows[2]['answer']}\n"},  # no tags: the whole completion is the answer
        sample(completion="<answer>1</answer>", answer="1"),  # no entry in meta: an error
    ]
    with build_environment(EnvConfig(name="reasoning_gym", num_workers=1, timeout_s=30), data_cfg) as env:
        result = env.score(samples)
    assert result.rewards == [1.0, 0.0, 1.0, 0.0] and result.num_errors == 1


def test_reasoning_gym_env_needs_reasoning_gym_data():
    with pytest.raises(EnvError, match="reasoning_gym:<task>"):
        build_environment(EnvConfig(name="reasoning_gym"), DataConfig(dataset_name="arithmetic"))


# --------------------------------------------------------------------------------------------------
# In-process arithmetic env
# --------------------------------------------------------------------------------------------------
def test_arithmetic_env_runs_in_process_and_counts_errors():
    env = build_environment(EnvConfig(name="arithmetic"), DataConfig())
    assert env.in_process and env._pool is None
    result = env.score([sample(completion="7", answer="7"), sample(completion="5", answer="7"),
                        sample(completion="5", answer="not a number")])
    assert isinstance(result, ScoreResult)
    assert result.rewards == [1.0, 0.0, 0.0] and (result.num_errors, result.num_timeouts) == (1, 0)
    assert set(result.metrics) == {"env/error_rate", "env/timeout_rate", "env/score_s"}
    env.shutdown()


# --------------------------------------------------------------------------------------------------
# User functions in the worker pool: failures cost only their own samples
# --------------------------------------------------------------------------------------------------
def test_build_env_function_checks_the_name():
    with pytest.raises(EnvError, match="cannot import 'no_such_module_xyz'"):
        build_environment(EnvConfig(name="function", reward_fn="no_such_module_xyz:f"))
    with pytest.raises(EnvError, match="has no 'missing'"):
        build_environment(EnvConfig(name="function", reward_fn=f"{FNS}:missing"))
    with pytest.raises(EnvError, match="is int, not a function"):
        build_environment(EnvConfig(name="function", reward_fn=f"{FNS}:NOT_A_FUNCTION"))


def test_failures_cost_only_their_own_samples_classified_in_the_worker():
    timeout_s = 1.5
    batch = [
        sample("ok", "1", "1"), sample("hang", "1", "1"), sample("raise", "1", "1"), sample("ok", "2", "1"),
        sample("crash", "1", "1"), sample("nan", "1", "1"), sample("ok", "3", "3"), sample("connection"),
        sample("http503"), sample("http404"),
    ]
    env = build_environment(EnvConfig(name="function", reward_fn=f"{FNS}:by_question", num_workers=2, timeout_s=timeout_s))
    with env:
        start = time.monotonic()
        result = env.score(batch)
        elapsed = time.monotonic() - start
        assert result.rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]  # failures: placeholders
        # Classified where the exception existed (the worker): the reward's own bugs (RuntimeError, a NaN that
        # to_reward refuses) are data; a timeout, a dead worker, a refused connection, a 503 are infra.
        assert [f and (f.reason, f.kind) for f in result.failures] == [
            None, ("reward_timeout", "infra"), ("reward_error", "data"), None, ("reward_error", "infra"),
            ("reward_error", "data"), None, ("reward_error", "infra"), ("http_5xx", "infra"), ("http_4xx", "data")]
        assert "boom from the reward function" in result.failures[2].detail and "Traceback" in result.failures[2].detail
        assert "exit code 3" in result.failures[4].detail
        assert (result.num_errors, result.num_timeouts) == (6, 1)
        assert result.metrics["env/error_rate"] == pytest.approx(6 / 10)
        assert result.metrics["env/timeout_rate"] == pytest.approx(1 / 10)
        assert elapsed < 20, elapsed  # bounded: the hung sample costs one timeout, not 60 s
        assert env._pool.num_restarts == 2  # the hung worker and the crashed one were replaced

        # Later batches: nothing is left hanging.
        start = time.monotonic()
        result = env.score([sample("raise"), sample("ok", "5", "5"), sample("ok", "6", "6"), sample("hang")])
        assert [f and f.reason for f in result.failures] == ["reward_error", None, None, "reward_timeout"]
        assert result.rewards[1:3] == [1.0, 1.0] and (result.num_errors, result.num_timeouts) == (1, 1)
        assert time.monotonic() - start < 20
        assert len([p for p in mp.active_children() if p.name == "grpo-reward-worker"]) == 2
    assert [p for p in mp.active_children() if p.name == "grpo-reward-worker"] == []  # closed


def test_an_in_process_reward_is_classified_the_same_way():
    env = RewardEnvironment(f"{FNS}:by_question", in_process=True)
    result = env.score([sample("connection"), sample("raise"), sample("ok", "1", "1")])
    assert [f and (f.reason, f.kind) for f in result.failures] == [("reward_error", "infra"), ("reward_error", "data"),
                                                                   None]
    assert result.rewards[2] == 1.0


def test_a_reward_environment_reports_failed_samples_and_the_router_scores_just_those_again(tmp_path, caplog):
    """Per-sample reward failures through the router (grpo.tasks.router.Environments): only the failed samples
    are scored again; one that fails once (a judge that refused a connection) ends with its real reward; one
    that always raises ends failed after max_data_attempts_per_prompt, logged once with its traceback."""
    from grpo.tasks.failures import RetryPolicy
    from grpo.tasks.router import Environments

    sleeps = []
    envs = Environments({"t": RewardEnvironment(f"{FNS}:by_question", num_workers=2, timeout_s=10)}, 30,
                        retry=RetryPolicy(3, 2, 0.5, 1.0), sleep=sleeps.append)
    questions = ["ok", "once", "raise", "ok"]
    logs = [[{"role": "user", "content": q}, {"role": "assistant", "content": "7"}] for q in questions]
    meta = [{"question": q, "answer": "7", "meta": {"once": str(tmp_path / f"once{i}")}} for i, q in enumerate(questions)]
    try:
        with caplog.at_level(logging.WARNING, logger="grpo.tasks.router"):
            ret, retries = envs.step("t", logs, meta)
    finally:
        envs.close()
    assert [f and (f.reason, f.kind) for f in ret.failures] == [None, None, ("reward_error", "data"), None]
    assert [ret.rewards[b].item() for b in (0, 1, 3)] == [1.0, 1.0, 1.0]
    assert retries == [0, 1, 1, 0] and sleeps == [0.5]  # the infra failure waited; the data one did not
    assert (tmp_path / "once1").exists() and not (tmp_path / "once0").exists()  # sample 0 was scored once
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2  # one per reason and class: the connection, the raise
    assert any("reward_error (data)" in m and "boom from the reward function" in m and "Traceback" in m
               for m in logged)
    assert envs.num_failures == 3 and envs.num_retries == 2


def test_timeout_is_per_sample_from_dispatch():
    # 4 samples of 0.8 s on 2 workers take ~1.6 s in all, but each stays within its own 1.5 s limit.
    with RewardEnvironment(f"{FNS}:sleepy", num_workers=2, timeout_s=1.5) as env:
        env.start()
        result = env.score([sample(meta={"sleep": 0.8}) for _ in range(4)] + [sample(meta={"sleep": 5})])
    assert result.rewards == [1.0, 1.0, 1.0, 1.0, 0.0] and result.num_timeouts == 1


def test_samples_are_spread_over_workers():
    with RewardEnvironment(f"{FNS}:pid", num_workers=2, timeout_s=10) as env:
        env.start()
        assert all(w.ready for w in env._pool._workers)
        pids = set(env.score([sample(meta={"sleep": 0.1}) for _ in range(8)]).rewards)
    assert len(pids) == 2 and all(p > 0 for p in pids)


def test_dict_rewards_give_gdpo_components():
    with build_environment(EnvConfig(name="function", reward_fn=f"{FNS}:components", num_workers=1, timeout_s=10)) as env:
        result = env.score([sample(completion="7", answer="7"), sample(completion="x", answer="7"),
                            sample(completion="3", answer="7", meta={"scalar": -2.0})])
    assert result.rewards == [1.5, 0.0, -2.0]
    assert result.components == [{"format": 0.5, "correct": 1.0}, {"format": 0.0, "correct": 0.0},
                                 {"format": 0.5, "correct": 0.0}]


def test_worker_that_cannot_import_the_scorer_fails_clearly():
    env = RewardEnvironment("no_such_module_xyz:f", num_workers=1, timeout_s=5)  # not checked in-process
    with env, pytest.raises(EnvError, match="cannot load 'no_such_module_xyz:f'"):
        env.score([sample()])
    assert [p for p in mp.active_children() if p.name == "grpo-reward-worker"] == []


def test_empty_batch():
    with RewardEnvironment(f"{FNS}:exact", num_workers=1, timeout_s=5) as env:
        result = env.score([])
        assert env._pool._workers == []
    assert result.rewards == [] and result.metrics["env/error_rate"] == 0.0
    assert not math.isnan(result.metrics["env/score_s"])


def test_reward_workers_live_across_environment_steps():
    """The runner calls a reward environment in its own thread: its workers (started there, killed by the kernel
    when that thread ends: PR_SET_PDEATHSIG) serve every later step."""
    from grpo.tasks.router import Environments

    env = RewardEnvironment(f"{FNS}:exact", num_workers=1, timeout_s=10)
    envs = Environments({"t": env}, step_timeout_s=30)
    logs = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "7"}]]
    meta = [{"question": "q", "answer": "7", "meta": {}}]
    try:
        assert envs.step("t", logs, meta)[0].rewards.tolist() == [1.0]
        pids = env._pool.pids()
        time.sleep(0.5)
        assert envs.step("t", logs, meta)[0].rewards.tolist() == [1.0]
        assert env._pool.pids() == pids and env._pool.num_restarts == 0
    finally:
        envs.close()
