"""An expose_http_server run without an agent environment (issue 32): outside requests sent with the official
``openai`` client to a real train_grpo.py process on loopback, all through its life, never hang. Those that find a
generation window (a rollout) are answered; those sent while it trains or checkpoints wait at most
http_server.max_wait_s and get a 503 with OpenAI's error body and Retry-After (slow: a real run)."""

from __future__ import annotations

import pytest

from tests.helpers.outside_client import ask_while_it_runs, check_answered_or_refused

MAX_WAIT_S = 0.5


@pytest.mark.slow
def test_outside_requests_are_answered_or_refused_never_left_hanging(tmp_path):
    results, out, status = ask_while_it_runs("train_grpo.py", tmp_path, "grpo.max_num_steps=8",
                                             "checkpointing.save_period=1", max_wait_s=MAX_WAIT_S)
    assert status == 0, out[-4000:]
    check_answered_or_refused(results, MAX_WAIT_S, steps=8)
    assert [r for r in results if r[0] == 503 and r[3]["code"] == "generation_paused"], results
