"""Agents that misbehave (issue 43, items 5, 10 and 16), played over a real endpoint on loopback with the official
openai client: an agent that blocks or spins in sync code is abandoned at env.agent.timeout_s; a client it never
closes leaves no ``Event loop is closed`` traceback; a program that prints without end costs bounded memory; a
failed attempt is retried under a fresh key and its sample trained on the retry's calls only."""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import time
import tracemalloc
from pathlib import Path

import openai
import pytest

from grpo.config import RolloutFailureConfig
from grpo.wings.agents.player import AgentPlayer
from tests.helpers import agent_fns
from tests.integration.test_agent_env import FNS, _play, endpoint  # noqa: F401 - the module's endpoint fixture

CALC_TRAJECTORY = "<bos>37*58=<calc>37*58</calc><eos><r>2146</r>2146<eos>"  # calc_agent's two calls


@pytest.fixture(autouse=True)
def misbehaving_agents():
    """The misbehaving agents' state, fresh per test; whatever is still blocked or spinning is released after it."""
    agent_fns.RELEASE.clear()
    agent_fns.SPUN_OUT.clear()
    for kept in (agent_fns.WOKE, agent_fns.LEAKED, agent_fns.FIRST_KEYS):
        kept.clear()
    agent_fns.ATTEMPTS.clear()
    yield
    agent_fns.RELEASE.set()


def _retry(infra: int = 3, data: int = 2) -> RolloutFailureConfig:
    return RolloutFailureConfig(max_infra_attempts_per_prompt=infra, max_data_attempts_per_prompt=data,
                                backoff_base_s=0.01, max_backoff_s=0.01)


# ---- item 5: the timeout holds whatever the agent does ----------------------------------------------------------
@pytest.mark.parametrize("agent", ["blocking_agent", "spinning_agent"])
def test_an_agent_that_never_yields_is_abandoned_at_its_timeout(endpoint, agent):
    """An ``async def`` agent that blocks (a sync wait, as time.sleep) or spins in Python shares no event loop with
    the run: its sample fails with env_timeout at env.agent.timeout_s while it is still running (before: the run
    waited for it, past the timeout and past SIGTERM); a spinning one is then stopped from outside."""
    trajs, envs = _play(endpoint, {"fn": f"{FNS}:{agent}", "timeout_s": 0.5})
    assert agent_fns.WOKE == []  # play returned while the agents were still blocked or spinning
    for t in trajs:
        assert (t.failure.reason, t.failure.kind, t.reward) == ("env_timeout", "infra", None), t.failure.detail
        assert "timeout_s=0.5" in t.failure.detail
    assert envs.post_process(trajs)[1]["env/agent/failed_samples"] == 2.0
    if agent == "spinning_agent":  # it never awaits, so only an exception raised inside its thread ends it
        assert agent_fns.SPUN_OUT.wait(10)


def test_a_program_that_ignores_sigterm_is_killed_with_its_children_at_its_timeout(endpoint, tmp_path):
    """A program agent that ignores SIGTERM and whose child keeps its stdout open: killed with its process group."""
    pids = tmp_path / "pids"
    script = f"trap '' TERM; sleep 1000 & echo $$ $! > {pids}; wait"
    trajs, _ = _play(endpoint, {"command": ["bash", "-c", script], "timeout_s": 1.0}, n=1)
    assert trajs[0].failure.reason == "env_timeout"
    running = [int(p) for p in pids.read_text().split()]
    deadline = time.monotonic() + 10
    while (running := [p for p in running if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running == []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_timed_out_agent_is_retried_until_a_stop_is_requested(endpoint):
    """env_timeout is an infra failure, retried within max_infra_attempts_per_prompt; once the run's stop flag is
    set no sample is retried, so a stop waits for no more than the attempts running (one timeout_s)."""
    agent = {"fn": f"{FNS}:blocking_agent", "timeout_s": 0.3}
    trajs, _ = _play(endpoint, agent, rollout_failure=_retry(infra=3))
    assert [(t.failure.reason, t.retries) for t in trajs] == [("env_timeout", 2)] * 2
    stopping = AgentPlayer(endpoint, stop_requested=lambda: True)
    trajs, _ = _play(endpoint, agent, rollout_failure=_retry(infra=3), player=stopping)
    assert [(t.failure.reason, t.retries) for t in trajs] == [("env_timeout", 0)] * 2


def test_an_agent_that_never_closes_its_client_prints_no_event_loop_traceback(endpoint, caplog):
    """The client an agent left open is closed by the openai package when it is collected, on whatever loop runs
    then; its connections belonged to the agent's loop, closed by then: ``RuntimeError: Event loop is closed`` from
    a task nobody awaited. The agent's loop now closes its connections as it closes."""
    trajs, _ = _play(endpoint, {"fn": f"{FNS}:leaky_agent"})
    assert [t.failure for t in trajs] == [None, None] and len(agent_fns.LEAKED) == 2

    async def collected_later():  # the next loop of the run (the next rollout, the endpoint's)
        agent_fns.LEAKED.clear()
        gc.collect()
        await asyncio.sleep(0.2)

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(collected_later())
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text


# ---- item 10: a program's output is read with bounded memory -------------------------------------------------
@pytest.mark.parametrize("question, error", [("chatty", None), ("chatty and failing", "env_error")])
def test_a_program_that_prints_without_end_costs_bounded_memory(endpoint, question, error):
    """32 MB on stdout and on stderr: the result (the last stdout line) is read, the message of a failed program
    ends with its stderr's last words, and the trainer never holds more than the tails (before: all of it)."""
    tracemalloc.start()
    try:
        trajs, _ = _play(endpoint, {"command": [sys.executable, "-m", FNS]}, n=1, question=question)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    t = trajs[0]
    assert (t.failure and t.failure.reason) == error and t.turns == 2
    if error is None:
        assert t.reward == 1.0  # the result line, read after 32 MB of log lines
    else:
        assert "exited with status 3" in t.failure.detail and "the last words on stderr" in t.failure.detail
    assert peak < 16 * 2**20, f"{peak / 2**20:.0f} MiB held for 64 MiB of output"


# ---- item 16: failed attempts are retried, and a trajectory is made of one attempt's calls -------------------
@pytest.mark.parametrize("agent, timeout_s", [("flaky_agent", 300.0), ("stalling_agent", 1.0)])
def test_a_failed_attempt_is_retried_under_a_fresh_key_and_trained_on_the_retrys_calls_only(endpoint, agent,
                                                                                            timeout_s):
    """A first attempt that called the model, then failed (its tool server dropped the connection: infra) or ran
    past its deadline, is retried (grpo.rollout_failure's budget, as other environments' calls are); the sample is
    the retry's calls alone, and the failed attempt's key is refused from then on (before: no retry, the sample
    failed)."""
    trajs, _ = _play(endpoint, {"fn": f"{FNS}:{agent}", "timeout_s": timeout_s}, n=1, rollout_failure=_retry())
    t = trajs[0]
    assert (t.failure, t.reward, t.retries, t.turns) == (None, 1.0, 1, 2), t.failure
    assert endpoint.tokenizer.decode(t.token_ids()) == CALC_TRAJECTORY  # no "FIRST TRY" in it
    (first_key,) = agent_fns.FIRST_KEYS
    client = openai.OpenAI(base_url=endpoint.base_url, api_key=first_key, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model=endpoint.model_name, messages=[{"role": "user", "content": "late"}],
                                       **endpoint.sampling("train"))


def test_a_sample_whose_attempts_all_fail_keeps_its_last_failure_and_counts_its_retries(endpoint):
    """A deterministic failure (the agent's own bug: data) takes max_data_attempts_per_prompt attempts in all."""
    trajs, envs = _play(endpoint, {"fn": f"{FNS}:broken_agent"}, rollout_failure=_retry(data=2))
    assert [(t.failure.reason, t.failure.kind, t.retries) for t in trajs] == [("env_error", "data", 1)] * 2
    assert envs.post_process(trajs)[1]["env/agent/failed_samples"] == 2.0
