"""NeMo-Gym (``env.should_use_nemo_gym``, ``env.nemo_gym``): rows go to Gym's agent servers, which play them over
the run's OpenAI-compatible endpoint (the agents wing); results come back in any order, regrouped by row, their
trajectories built from the response items' token fields; NeMo-RL's effort levels and reward penalties on them.

Registers the ``nemo_gym`` environment (`grpo.tasks.factory.register_environment`), its samples' play over the
endpoint and its servers' start with it (`grpo.wings.agents`), and the reward transform of Gym batches
(`grpo.rewards.register_reward_transform`). Gym's row and result schema (what data loading reads too) is
`grpo.tasks.nemo_gym`.
"""

from __future__ import annotations

from grpo.rewards import register_reward_transform
from grpo.system.players import PlayerError
from grpo.tasks.factory import register_environment
from grpo.tasks.nemo_gym import NemoGymEnvironment
from grpo.wings.agents import register_endpoint_service
from grpo.wings.agents.player import register_endpoint_game


def gym_environment(env_spec, key: str, deferred):
    """``env.name: nemo_gym``: its samples are played by Gym's agent servers (`grpo.wings.gym.rollout`)."""
    # NeMo-RL's meaning (_should_log_nemo_gym_responses, grpo.py:2173): true = NeMo-Gym logs them, no local dump
    return NemoGymEnvironment(env_spec.nemo_gym, log_responses=not env_spec.should_log_nemo_gym_responses)


def play(env, trajs, seed_keys, endpoint, retry, weight_version):
    """A Gym task's samples, POSTed to its agent server (`grpo.wings.gym.rollout.play_gym`)."""
    from grpo.wings.gym.rollout import play_gym

    play_gym(env, trajs, seed_keys, endpoint, retry, weight_version)


def start_servers(cfg, envs_list, endpoint, log_dir, closables, logger):
    """Gym's servers found or launched with the endpoint (`grpo.wings.gym.servers.start_gym_servers`); one that
    cannot start stops the run with its line."""
    from grpo.wings.gym.servers import GymServerError, start_gym_servers

    try:
        start_gym_servers(cfg, envs_list, endpoint, log_dir, closables, logger)
    except GymServerError as err:
        raise PlayerError(str(err)) from None


def is_gym_batch(trajectories) -> bool:
    from grpo.wings.gym.rewards import is_gym_batch

    return is_gym_batch(trajectories)


def shape(rewards_b, trajectories, rp, env, tokenizer):
    """NeMo-RL's Gym shaping: effort levels (``env.nemo_gym.effort_levels``), then the penalties on the Gym
    results (`grpo.wings.gym.rewards.shape_gym_rewards`)."""
    from grpo.wings.gym.rewards import shape_gym_rewards

    return shape_gym_rewards(rewards_b, trajectories, rp, getattr(env, "nemo_gym", None), tokenizer)


register_environment("nemo_gym", gym_environment)
register_endpoint_game(NemoGymEnvironment, play)
register_endpoint_service(start_servers)
register_reward_transform(is_gym_batch, shape)
