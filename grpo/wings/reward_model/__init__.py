"""Reward models (NeMo-RL's ``env.reward_model``): a sequence classifier scoring the whole conversation, rendered
with its own template, once per rollout at the deferred scoring point, collectively over the ranks.

Registers the ``reward_model`` environment (`grpo.tasks.factory.register_environment`), which renders each
conversation and leaves its score pending, and the run's `RewardModels` (`grpo.system.deferred`), which places
the models once the engines hold their memory and scores the pending samples.
"""

from __future__ import annotations

from grpo.system.deferred import register_deferred_scorer
from grpo.tasks.factory import register_environment
from grpo.tasks.function import EnvError


def reward_model_environment(env_spec, key: str, deferred):
    """``env.name: reward_model``: the environment over the run's scorer of ``env.reward_model``."""
    from grpo.wings.reward_model.environment import RewardModelEnvironment

    if deferred is None or "reward_model" not in deferred:
        raise EnvError(f"{key}.name='reward_model' needs the run's reward-model engines (build_environments(..., "
                       "deferred=grpo.system.deferred.DeferredScorers(device)))")
    rm = env_spec.reward_model
    return RewardModelEnvironment(deferred["reward_model"](rm), rm.batch_size, rm.max_model_len)


def reward_models(device, policy=None, world_size: int = 1):
    """The run's reward models (`grpo.wings.reward_model.scorer.RewardModels`): a copy per rank, or ZeRO-3 over them."""
    from grpo.wings.reward_model.scorer import RewardModels

    return RewardModels(device, policy, world_size)


register_environment("reward_model", reward_model_environment)
register_deferred_scorer("reward_model", reward_models)
