"""An expose_http_server run without an agent environment (issue 32): outside requests sent with the official
``openai`` client to a real train_grpo.py process on loopback, all through its life, never hang. Those that find a
generation window (a rollout) are answered; those sent while it trains or checkpoints wait at most
http_server.max_wait_s and get a 503 with OpenAI's error body and Retry-After (slow: a real run)."""

from __future__ import annotations

import pytest

from tests.helpers.e2e import train_rows
from tests.helpers.outside_client import ask_while_it_runs, check_answered_or_refused, paused, versions_answered

MAX_WAIT_S = 0.05  # shorter than a step's training and checkpoint, so requests sent then wait it out
SLOW_REWARD = ("env.name=function", "env.reward_fn=tests.helpers.e2e_reward_fns:slow_arithmetic")  # longer rollouts


@pytest.mark.slow
def test_outside_requests_are_answered_or_refused_never_left_hanging(tmp_path):
    # Stopped by SIGTERM once answers came from 3 weight versions and a request waited out a pause: a run of a few
    # steps can end before the client's first request on a fast machine (8 steps of the tiny model take 0.7 s).
    results, out, status = ask_while_it_runs(
        "train_grpo.py", tmp_path, "grpo.max_num_steps=150", "checkpointing.save_period=1", *SLOW_REWARD,
        max_wait_s=MAX_WAIT_S, stop_when=lambda results: versions_answered(results) >= 3 and bool(paused(results)))
    assert status == 143, out[-4000:]
    steps = sorted(train_rows(tmp_path))
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] < 150
    check_answered_or_refused(results, MAX_WAIT_S, steps=steps[-1])
    assert paused(results), results
