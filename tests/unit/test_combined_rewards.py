"""Several rewards for one sample (grpo.tasks.combined, env.name=combined): a weighted sum or GDPO's components, a
failure of any part fails the sample, each part's metrics on its own rewards, the config's checks."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from grpo.config import EnvConfig
from grpo.tasks.combined import CombinedEnvironment
from grpo.tasks.reward import RewardEnvironment

LOGS = [[{"role": "user", "content": q}, {"role": "assistant", "content": c}]
        for q, c in (("3+4=", "7"), ("1+1=", "3"), ("raise", "x"))]
META = [{"question": "3+4=", "answer": "7"}, {"question": "1+1=", "answer": "2"}, {"question": "raise", "answer": "x"}]


def parts():
    return {"exact": RewardEnvironment("tests.helpers.reward_fns_for_tests:by_question", in_process=True),
            "digits": RewardEnvironment("tests.helpers.reward_fns_for_tests:components", in_process=True)}


def test_weighted_sum_is_one_scalar_reward():
    ret = CombinedEnvironment(parts(), "weighted_sum", {"exact": 2.0}).step(LOGS[:2], META[:2])
    # exact: [1, 0]; components (format 0.5 x digits + correct): [1.5, 0.5]
    assert ret.rewards.tolist() == [2.0 * 1.0 + 1.5, 2.0 * 0.0 + 0.5]
    assert [m["combined_rewards"] for m in ret.metadata] == [{"exact": 1.0, "digits": 1.5}, {"exact": 0.0, "digits": 0.5}]


def test_components_are_named_by_their_environment_for_gdpo():
    env = CombinedEnvironment(parts(), "components")
    ret = env.step(LOGS[:2], META[:2])
    assert env.reward_kind == "dict" and set(ret.rewards) == {"exact", "digits"}
    assert ret.rewards["exact"].tolist() == [1.0, 0.0] and ret.rewards["digits"].tolist() == [1.5, 0.5]


def test_a_sample_any_part_failed_fails_and_the_others_are_scored():
    ret = CombinedEnvironment(parts(), "weighted_sum").step(LOGS, META)
    assert [f and f.reason for f in ret.failures] == [None, None, "reward_error"]
    assert ret.rewards[:2].tolist() == [2.5, 0.5]


def test_each_part_s_metrics_read_its_own_rewards():
    class Mean(RewardEnvironment):
        def global_post_process_and_metrics(self, batch):
            return batch, {"mean": float(batch["rewards"].mean())}

    env = CombinedEnvironment({"a": Mean("tests.helpers.reward_fns_for_tests:exact", in_process=True),
                               "b": Mean("tests.helpers.reward_fns_for_tests:components", in_process=True)},
                              "weighted_sum")
    ret = env.step(LOGS[:2], META[:2])
    batch = {"extra_env_info": ret.metadata, "rewards": ret.rewards}
    _, m = env.global_post_process_and_metrics(batch)
    assert m == {"a/mean": 0.5, "b/mean": 1.0}


def test_config_builds_the_combination_and_checks_it():
    from grpo.tasks.factory import build_environments

    cfg = EnvConfig.model_validate({"name": "combined", "combine": "weighted_sum", "weights": {"a": 0.5},
                                    "rewards": {"a": {"name": "arithmetic"}, "b": {"name": "arithmetic"}}})
    envs = build_environments(cfg)
    try:
        env = envs.envs["combined"]
        assert isinstance(env, CombinedEnvironment) and env.weights == {"a": 0.5} and sorted(env.envs) == ["a", "b"]
    finally:
        envs.close()
    with pytest.raises(ValidationError, match="env.name='combined' needs env.rewards"):
        EnvConfig(name="combined")
    with pytest.raises(ValidationError, match="one-turn environments"):
        EnvConfig.model_validate({"name": "combined", "rewards": {"t": {"name": "agent", "agent": {"fn": "m:f"}}}})
    with pytest.raises(ValidationError, match="grpo.adv_estimator.reward_weights"):
        EnvConfig.model_validate({"name": "combined", "combine": "components", "weights": {"a": 1.0},
                                  "rewards": {"a": {"name": "arithmetic"}}})
