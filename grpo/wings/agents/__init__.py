"""Agents over the OpenAI-compatible endpoint (``env.name: agent``, ``expose_http_server``; NeMo-Gym's agent servers
play through it too): a user's agent, a Python function or a program given the endpoint's ``base_url``, key and
model, plays each sample; its trajectory is built from the tokens the endpoint recorded.

Registers the ``agent`` environment (`grpo.tasks.factory.register_environment`) and the endpoint's player
(`grpo.system.players.register_player`: `start_endpoint`, which serves the endpoint over the run's generation
backend when the config asks for it or an environment is played over it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from grpo.config import serves_endpoint
from grpo.system.players import PlayerError, register_backend_wrapper, register_player
from grpo.tasks.factory import register_environment


# What starts with the endpoint, in order: start(cfg, envs_list, endpoint, log_dir, closables, logger), raising
# PlayerError (register_endpoint_service; NeMo-Gym's servers: grpo.wings.gym).
_SERVICES: list[Callable] = []


def register_endpoint_service(start: Callable) -> None:
    """Have ``start`` called once the endpoint serves (a wing calls it when imported)."""
    _SERVICES.append(start)


def agent_environment(env_spec, key: str, deferred):
    """``env.name: agent``: its samples are played over the endpoint (`grpo.wings.agents.player`)."""
    from grpo.wings.agents.environment import AgentEnvironment

    a = env_spec.agent
    return AgentEnvironment(a.fn, a.command, a.max_concurrency, a.timeout_s, key=f"{key}.agent",
                            fork_threshold_tokens=a.fork_threshold_tokens)


def start_endpoint(cfg, generator, tokenizer, envs_list, closables: list, logger, rank: int, asynchronous: bool,
                   vocab_size: int):
    """The OpenAI-compatible endpoint over ``generator`` (`grpo.wings.agents.endpoint`), when
    ``policy.generation.vllm_cfg.expose_http_server`` is set or an environment is an agent (env.name=agent); its
    base URL, key and model name go to ``<log_dir>/endpoint.json`` (``endpoint_rank<r>.json`` on other ranks;
    owner-only) for agents outside the run. ``vocab_size``: the policy's embedding rows (token ids a request may
    carry, with the tokenizer's). Returns the `grpo.wings.agents.player.AgentPlayer`, or None.
    ``asynchronous`` without a ``generator`` (the async loop's own weight copy, built once its weights are staged):
    None; the loop serves it with `grpo.run.serving.start_async_player`. Raises `PlayerError`."""
    from grpo.wings.agents.player import AgentPlayer, agent_tasks

    agent = sorted({t for envs in envs_list for t in agent_tasks(envs)})
    if not cfg.policy.generation.vllm_cfg.expose_http_server and not agent:
        return None
    if generator is None:
        if asynchronous:
            return None
        raise PlayerError("the endpoint (policy.generation.vllm_cfg.expose_http_server, env.name=agent) needs the "
                          "run's generation backend")
    from grpo.wings.agents.endpoint import Endpoint

    try:
        endpoint = Endpoint(cfg, generator, tokenizer, vocab_size, processor=policy_processor(cfg.policy))
    except ValueError as err:  # vLLM's parsers refuse the tokenizer (grpo.wings.agents.vllm_chat_parsers)
        raise PlayerError(str(err)) from None
    url = endpoint.start()
    closables.insert(0, endpoint)  # closed first: no request reaches a closed backend
    path = os.path.join(cfg.logger.log_dir, "endpoint.json" if rank == 0 else f"endpoint_rank{rank}.json")
    os.makedirs(cfg.logger.log_dir, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"base_url": url, "api_key": endpoint.api_key, "model": endpoint.model_name}, f)
    logger.write(f"endpoint: {url} serves {endpoint.model_name!r} (key in {path}){'; agent tasks ' + str(agent) if agent else ''}")
    for start in _SERVICES:  # NeMo-Gym's servers (env.should_use_nemo_gym), found or launched with this endpoint
        start(cfg, envs_list, endpoint, cfg.logger.log_dir if rank == 0 else
              os.path.join(cfg.logger.log_dir, f"rank{rank}"), closables, logger)
    return AgentPlayer(endpoint)


def policy_processor(policy_cfg):
    """A vision-language policy's processor, with which the endpoint renders image parts as the data path does; None
    for a text model (its endpoint answers an image part 400)."""
    from grpo.system.model_config import load_model_config
    from grpo.system.vision import load_processor

    return load_processor(policy_cfg, load_model_config(policy_cfg))


def lockstep(cfg, backend, layout):
    """Several trainers that serve the endpoint over the generation ranks: each trainer's endpoint generates when its
    agents call, the trainers agree their generation by rounds (`grpo.wings.agents.lockstep`)."""
    if layout.world_size > 1 and serves_endpoint(cfg):
        from grpo.wings.agents.lockstep import LockstepGeneration

        return LockstepGeneration(backend, cfg.policy.generation)
    return backend


register_environment("agent", agent_environment)
register_player("endpoint", start_endpoint)
register_backend_wrapper(lockstep)
