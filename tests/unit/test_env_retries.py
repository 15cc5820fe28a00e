"""grpo.tasks.router.Environments.step's retries (issue 31): a failed call or sample is called again with the same
conversation and metadata within its class's budget (infra after a backoff, data at once), the attempts are
spliced into one return, and what still fails is reported per sample, never scored. In-process fake environments
(the reward and tool environments' worker processes: tests/unit/test_environments.py, test_tools.py)."""

from __future__ import annotations

import time

import pytest
import torch

from grpo.tasks.failures import RetryPolicy
from grpo.trajectory import DATA, INFRA, Failure
from grpo.tasks.interface import Environment, EnvironmentReturn
from grpo.tasks.router import Environments

POLICY = RetryPolicy(max_infra_attempts=4, max_data_attempts=2, backoff_base_s=1.0, max_backoff_s=3.0)


class Count(Environment):
    """Reward = len(last message) + turn metadata; one observation, a next stop string, an answer: every field
    of the return depends on the sample, so a spliced return that mixes rows up shows."""

    def __init__(self):
        self.calls: list[list[str]] = []  # the last messages of each call

    def step(self, message_logs, metadata):
        self.calls.append([log[-1]["content"] for log in message_logs])
        texts = [log[-1]["content"] for log in message_logs]
        return EnvironmentReturn(
            observations=[{"role": "user", "content": f"seen {t}"} for t in texts],
            metadata=[{**md, "turn": md.get("turn", 0) + 1} for md in metadata],
            next_stop_strings=[[t] for t in texts],
            rewards=torch.tensor([len(t) + md.get("turn", 0) / 4 for t, md in zip(texts, metadata)]),
            terminateds=torch.tensor([len(t) % 2 == 0 for t in texts]),
            answers=[t.upper() for t in texts])


class FailsFirst(Count):
    """The first ``times`` calls fail as ``how`` says, then `Count`."""

    def __init__(self, how: str, times: int = 1):
        super().__init__()
        self.how, self.times = how, times

    def step(self, message_logs, metadata):
        if len(self.calls) < self.times:
            for md in metadata:
                md["turn"] = 99  # changed in place by an attempt that then fails: a retry must not see it
            self.calls.append([log[-1]["content"] for log in message_logs])
            if self.how == "raise":
                raise ValueError("the environment's own bug")
            if self.how == "connection":
                raise ConnectionResetError("the server went away")
            if self.how == "http":
                raise HTTPError(503)
            if self.how == "hang":
                time.sleep(3)
            return EnvironmentReturn([{"role": "user"}] * len(message_logs), metadata, None, [0.0] * len(message_logs),
                                     [True] * len(message_logs), None)  # malformed: an observation without content
        return super().step(message_logs, metadata)


class HTTPError(Exception):
    def __init__(self, status):
        super().__init__(f"HTTP {status}")
        self.status = status


def logs_and_meta(texts=("a", "bb", "ccc")):
    return [[{"role": "user", "content": "q"}, {"role": "assistant", "content": t}] for t in texts], [{} for _ in texts]


def step(env, policy=POLICY, timeout_s=5.0, texts=("a", "bb", "ccc")):
    sleeps: list[float] = []
    envs = Environments({"t": env}, timeout_s, retry=policy, sleep=sleeps.append)
    logs, meta = logs_and_meta(texts)
    ret, retries = envs.step("t", logs, meta)
    return ret, retries, sleeps, envs


def assert_same_return(got, want):
    assert got.observations == want.observations and got.metadata == want.metadata
    assert got.next_stop_strings == want.next_stop_strings and got.answers == want.answers
    assert torch.equal(got.rewards, want.rewards) and torch.equal(got.terminateds, want.terminateds)
    assert got.failures == [None] * len(want.observations)


@pytest.mark.parametrize("how, kind, waits", [("raise", DATA, []), ("malformed", DATA, []), ("hang", INFRA, [1.0]),
                                              ("connection", INFRA, [1.0]), ("http", INFRA, [1.0])])
def test_a_call_that_fails_once_then_succeeds_returns_exactly_the_clean_return(how, kind, waits):
    clean, _, _, _ = step(Count())
    ret, retries, sleeps, envs = step(FailsFirst(how), timeout_s=0.3)
    assert_same_return(ret, clean)  # the retry saw the same conversations and untouched metadata
    assert retries == [1, 1, 1] and envs.num_retries == 3 and envs.num_failures == 3
    assert sleeps == waits  # infra: backoff_base_s before the retry; data: at once


@pytest.mark.parametrize("how, reason, kind", [("raise", "env_error", DATA), ("malformed", "env_malformed", DATA),
                                               ("hang", "env_timeout", INFRA), ("connection", "env_error", INFRA),
                                               ("http", "http_5xx", INFRA)])
def test_a_call_that_keeps_failing_ends_its_samples_with_reason_and_class_within_the_budget(how, reason, kind):
    env = FailsFirst(how, times=100)
    ret, retries, sleeps, envs = step(env, timeout_s=0.2)
    attempts = POLICY.max_infra_attempts if kind == INFRA else POLICY.max_data_attempts
    assert len(env.calls) == attempts
    assert [(f.reason, f.kind) for f in ret.failures] == [(reason, kind)] * 3
    assert retries == [attempts - 1] * 3 and envs.num_failures == 3 * attempts
    # Infra: base * 2^(k-1), capped at max_backoff_s; data: no wait.
    assert sleeps == ([1.0, 2.0, 3.0] if kind == INFRA else [])
    assert reason in envs.last_error and "FailsFirst" in envs.last_error
    assert len(ret.observations) == 3 and ret.rewards.shape == (3,)  # placeholders, one per sample


def test_without_a_policy_a_call_is_tried_once():
    env = FailsFirst("raise", times=1)
    ret, retries, _, _ = step(env, policy=None)
    assert len(env.calls) == 1 and retries == [0, 0, 0] and ret.failures[0].reason == "env_error"


class FailsSamples(Count):
    """Reports sample-level failures: ``plan[text]`` is a list of failures (or None) per call of that sample."""

    def __init__(self, plan: dict[str, list[Failure | None]]):
        super().__init__()
        self.plan, self.seen = plan, {}

    def step(self, message_logs, metadata):
        ret = super().step(message_logs, metadata)
        failures = []
        for log in message_logs:
            text = log[-1]["content"]
            k = self.seen[text] = self.seen.get(text, -1) + 1
            plan = self.plan.get(text, [])
            failures.append(plan[k] if k < len(plan) else None)
        return ret._replace(failures=failures)


def test_samples_an_environment_reports_failed_are_retried_alone_and_spliced_back_in_order():
    flaky = Failure.of("http_429", "slow down")
    env = FailsSamples({"a": [flaky, flaky], "ccc": [Failure.of("reward_error", "bug", kind=DATA)]})
    clean, _, _, _ = step(Count())
    ret, retries, sleeps, _ = step(env)
    assert env.calls == [["a", "bb", "ccc"], ["a", "ccc"], ["a"]]  # only the failed samples, again
    assert_same_return(ret, clean)
    assert retries == [2, 0, 1] and sleeps == [1.0, 2.0]


def test_infra_and_data_budgets_are_independent_counters():
    # NeMo-RL: a sample may take max_infra + max_data - 1 attempts when its failures alternate.
    infra, data = Failure.of("connection", "refused"), Failure.of("env_malformed", "bad")
    env = FailsSamples({"a": [infra, data, infra, infra, data, None]})
    ret, retries, sleeps, _ = step(env, texts=("a",))
    assert len(env.calls) == 5 and retries == [4]  # the 2nd data failure ends it: the 6th call never happens
    assert (ret.failures[0].reason, ret.failures[0].kind) == ("env_malformed", DATA)
    assert sleeps == [1.0, 2.0, 3.0]  # after infra failures 1, 2, 3; none after the data one


def test_a_sample_that_still_fails_keeps_the_others_results():
    env = FailsSamples({"bb": [Failure.of("env_timeout", "t")] * 10})
    clean, _, _, _ = step(Count())
    ret, retries, _, _ = step(env)
    assert [f and f.reason for f in ret.failures] == [None, "env_timeout", None]
    assert retries == [0, 3, 0]
    assert ret.rewards[[0, 2]].tolist() == clean.rewards[[0, 2]].tolist()
    assert ret.answers[0] == "A" and ret.answers[2] == "CCC"


def test_dict_rewards_are_spliced_per_component():
    class Parts(Count):
        def step(self, message_logs, metadata):
            ret = super().step(message_logs, metadata)
            return ret._replace(rewards={"len": ret.rewards, "one": torch.ones(len(message_logs))})

    class FlakyParts(Parts):
        def step(self, message_logs, metadata):
            ret = super().step(message_logs, metadata)
            first = len(self.calls) == 1
            return ret._replace(failures=[Failure.of("connection") if first and b == 1 else None
                                          for b in range(len(message_logs))])

    clean, _, _, _ = step(Parts())
    ret, retries, _, _ = step(FlakyParts())
    assert retries == [0, 1, 0] and ret.failures == [None] * 3
    assert {k: v.tolist() for k, v in ret.rewards.items()} == {k: v.tolist() for k, v in clean.rewards.items()}


def test_a_failure_that_is_not_a_failure_object_is_malformed():
    class Says(Count):
        def step(self, message_logs, metadata):
            return super().step(message_logs, metadata)._replace(failures=["oops"] * len(message_logs))

    ret, _, _, _ = step(Says())
    assert ret.failures[0].reason == "env_malformed" and "EnvironmentReturn.failures[0]='oops'" in ret.failures[0].detail


def test_an_environment_sees_copies_and_a_failed_sample_leaves_the_hooks_loss_multiplier():
    from grpo.trajectory import Message, Trajectory
    from grpo.tasks.router import rollout_batch

    class InPlace(Count):
        def step(self, message_logs, metadata):
            metadata[0]["mine"] = True  # not kept: NeMo-RL's environments get serialised copies too
            return super().step(message_logs, metadata)._replace(metadata=[None] * len(message_logs))

    logs, meta = logs_and_meta(("a",))
    Environments({"t": InPlace()}, 5).step("t", logs, meta)
    assert meta == [{}]
    ok = Trajectory(0, 0, "t", "q", "a", [Message("user", "q", [1]), Message("assistant", "x", [2], [-0.1])], {},
                    reward=1.0, num_prompt_messages=1)
    failed = Trajectory(0, 0, "t", "q", "a", [Message("user", "q", [1]), Message("assistant", "y", [3], [-0.1])], {},
                        reward=None, failure=Failure.of("env_timeout"), num_prompt_messages=1)
    assert rollout_batch([ok, failed])["loss_multiplier"].tolist() == [1.0, 0.0]


def test_the_run_builds_its_environments_with_grpo_rollout_failure():
    from grpo.config import DataConfig, EnvConfig, RolloutFailureConfig
    from grpo.tasks.factory import build_environments

    section = RolloutFailureConfig(max_infra_attempts_per_prompt=3, backoff_base_s=0.5, max_backoff_s=4.0)
    envs = build_environments(EnvConfig(name="arithmetic"), DataConfig(), rollout_failure=section)
    assert envs.retry == RetryPolicy(max_infra_attempts=3, max_data_attempts=2, backoff_base_s=0.5, max_backoff_s=4.0)
    assert build_environments(EnvConfig(name="arithmetic"), DataConfig()).retry == RetryPolicy.single_attempt()
