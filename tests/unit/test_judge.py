"""The LLM judge (grpo.tasks.judge, env.name=judge) against a stub OpenAI-compatible server run as a real process on
loopback (tests/helpers/judge_server.py): good answers score, malformed answers, timeouts and 5xx fail the sample
(retried within the budgets, then masked and counted), never score 0."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest
from pydantic import ValidationError

from grpo.config import EnvConfig, JudgeConfig, RolloutFailureConfig
from tests.helpers.e2e import REPO, child_env, free_port


@pytest.fixture(scope="module")
def judge_url():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.judge_server", str(port)], cwd=REPO,
                            env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(base + "/health", timeout=1).read()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the stub judge did not start: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.2)
    yield base
    proc.terminate()
    proc.wait(10)


def counts(base: str) -> dict:
    return json.loads(urllib.request.urlopen(base + "/counts", timeout=5).read())


def spec(base: str, **kw) -> dict:
    return {"name": "judge", "judge": {"base_url": base + "/v1", "model": "stub-judge", "max_score": 10,
                                       "timeout_s": 1.0, "prompt_template": "Q: {question}\nA: {completion}\nScore it.",
                                       **kw}}


def logs(*completions):
    return ([[{"role": "user", "content": "q"}, {"role": "assistant", "content": c}] for c in completions],
            [{"question": "q", "answer": "a"} for _ in completions])


def test_good_answers_score_and_failures_are_classed(judge_url):
    from grpo.tasks.judge import JudgeEnvironment

    env = JudgeEnvironment(EnvConfig.model_validate(spec(judge_url)).judge)
    try:
        ret = env.step(*logs("GOOD", "BAD", "MALFORMED", "SLOW", "ERR500", "ERR404"))
    finally:
        env.shutdown()
    assert ret.rewards[:2].tolist() == pytest.approx([0.8, 0.2])
    assert [f and (f.reason, f.kind) for f in ret.failures] == [
        None, None, ("env_malformed", "data"), ("env_timeout", "infra"), ("http_5xx", "infra"), ("http_4xx", "data")]


def test_the_router_retries_then_masks_and_counts(judge_url):
    from grpo.tasks.factory import build_environments

    envs = build_environments(EnvConfig.model_validate(spec(judge_url)), rollout_failure=RolloutFailureConfig(
        max_infra_attempts_per_prompt=3, max_data_attempts_per_prompt=2, backoff_base_s=0.01, max_backoff_s=0.01))
    try:
        before = counts(judge_url)
        result = envs.step("judge", *logs("GOOD FLAKY", "MALFORMED twice", "ERR500 thrice"))
    finally:
        envs.close()
    after = counts(judge_url)
    sent = {k: after[k] - before.get(k, 0) for k in after}
    ret = result.ret
    assert ret.failures[0] is None and float(ret.rewards[0]) == pytest.approx(0.6)  # a 503, then scored
    assert [f.reason for f in ret.failures[1:]] == ["env_malformed", "http_5xx"]  # masked, never scored
    assert result.retries == [1, 1, 2]
    assert sent["Q: q\nA: MALFORMED twice\nScore it."] == 2 and sent["Q: q\nA: ERR500 thrice\nScore it."] == 3
    assert envs.num_failures == 1 + 2 + 3


def test_a_score_that_is_no_reward_fails_its_sample_alone(judge_url):
    """Issue 43 (8): one non-finite judge score (NaN, or 1e299 that float32 makes inf) failed the whole call, so every
    sample of the batch, and the step was skipped. Only that sample fails (env_malformed, naming the judge's answer);
    the others keep their scores."""
    from grpo.tasks.factory import build_environments

    envs = build_environments(EnvConfig.model_validate(spec(judge_url, score_pattern=r"Score:\s*(\S+)")),
                              rollout_failure=RolloutFailureConfig(max_data_attempts_per_prompt=2))
    try:
        result = envs.step("judge", *logs("GOOD", "NAN", "HUGE", "INF", "BAD"))
    finally:
        envs.close()
    ret = result.ret
    assert [f and f.reason for f in ret.failures] == [None, "env_malformed", "env_malformed", "env_malformed", None]
    assert ret.rewards[[0, 4]].tolist() == pytest.approx([0.8, 0.2])
    assert result.retries == [0, 1, 1, 1, 0]  # data failures: retried once, then masked
    assert "the judge's score nan / max_score 10 is nan" in ret.failures[1].detail
    assert "inf as float32" in ret.failures[2].detail and "'Score: 999" in ret.failures[2].detail
    assert "is inf" in ret.failures[3].detail


def test_config_checks_the_template_and_the_pattern():
    base = {"base_url": "http://x/v1", "model": "m"}
    with pytest.raises(ValidationError, match="no {completion}"):
        JudgeConfig(**base, prompt_template="rate {question}")
    with pytest.raises(ValidationError, match="KeyError"):
        JudgeConfig(**base, prompt_template="rate {completion} {bogus}")
    with pytest.raises(ValidationError, match="a group around the score"):
        JudgeConfig(**base, prompt_template="{completion}", score_pattern=r"Score: \d")
    with pytest.raises(ValidationError, match="needs an env.judge section"):
        EnvConfig(name="judge")
