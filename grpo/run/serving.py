"""Where a run's generation runs and how it is served: the launch split into training and generation ranks, a
generation rank's whole run, the trainers' generation backend (hf, vLLM, or the generation ranks behind the
bridge) and the OpenAI-compatible endpoint over it."""

from __future__ import annotations

import json
import os

from grpo.config import cluster_mismatch, generation_ranks, serves_endpoint  # noqa: F401 (serves_endpoint: here too)
from grpo.run.run import RunError


def start_split(cfg):
    """``policy.generation.colocated.enabled=false``: check the launch against the config, then split it into
    training and generation ranks (`grpo.system.dist.init_split`); returns ``(layout, device)``."""
    from grpo.config import generation_split_problem
    from grpo.system.dist import EnvMismatch, init_split
    from grpo.system.engines import local_world_size

    launched = int(os.environ.get("WORLD_SIZE", "1"))
    problem = (cluster_mismatch(cfg.cluster, launched, local_world_size())
               or generation_split_problem(cfg.policy.generation, launched))
    if problem is not None:
        raise RunError(problem.removeprefix("error: "))
    try:
        return init_split(generation_ranks(cfg.policy.generation))
    except EnvMismatch as err:
        raise RunError(str(err)) from None


def serve_generation(cfg, layout, device) -> None:
    """A generation rank's whole run (`grpo.system.generation.server.serve`): returns when trainer 0 closes the
    bridge; raises `RunError` when the trainers are gone or the engine cannot start."""
    from grpo.system.bridge import BridgeError
    from grpo.system.generation.server import serve

    try:
        serve(cfg, layout, device)
    except BridgeError as err:
        raise RunError(f"generation rank {layout.rank} (launcher rank {layout.global_rank}) stops: {err}") from None


def build_generation_backend(cfg, tokenizer, policy_engine, device, layout=None):
    """`policy.generation.backend`: "hf" (transformers generate, any device) or "vllm" (colocated). With hf and
    whole weights on every rank (ZeRO-1/2), generation runs on the policy module itself (no copy to refit). With a
    ``layout`` (`grpo.system.dist.Layout`, ``colocated.enabled=false``): `RemoteGeneration`, the generation
    ranks' engines behind the bridge (a collective of the trainers); with several trainers that serve the endpoint,
    wrapped in `grpo.system.generation.lockstep.LockstepGeneration` (each trainer's endpoint generates when its
    agents call, the trainers still generate together)."""
    if layout is not None:
        from grpo.system.bridge import Bridge, BridgeError
        from grpo.system.generation.remote import RemoteGeneration

        from grpo.system.dist import comm_device

        timeout = cfg.policy.generation.colocated.bridge_timeout_s
        bridge, error = None, None
        if layout.rank == 0:
            try:
                bridge = Bridge(layout.store, 0, 1 + layout.num_generation, timeout, comm_device())
            except BridgeError as err:  # a generation rank never joined: every trainer stops with it
                error = str(err)
        remote = RemoteGeneration(cfg, layout, bridge, cfg.policy.model_name, device, tokenizer,
                                  getattr(policy_engine.module.config, "eos_token_id", None), bridge_error=error)
        if layout.world_size > 1 and serves_endpoint(cfg):  # each trainer's endpoint: generation agreed by rounds
            from grpo.system.generation.lockstep import LockstepGeneration

            return LockstepGeneration(remote, cfg.policy.generation)
        return remote
    if cfg.policy.generation.backend == "hf":
        from grpo.system.generation.hf import HFGeneration

        shared = policy_engine.zero_optimization_stage() < 3
        return HFGeneration(cfg.policy, tokenizer, policy_engine.module.config, device,
                            model=policy_engine.module if shared else None, shared=shared,
                            refit_bucket_numel=cfg.policy.generation.refit_bucket_numel)
    from grpo.system.generation.vllm import VllmGeneration

    return VllmGeneration(cfg, tokenizer, policy_engine, device,
                          refit_bucket_numel=cfg.policy.generation.refit_bucket_numel)


def start_endpoint(cfg, generator, tokenizer, envs_list, closables: list, logger, rank: int, asynchronous: bool,
                   vocab_size: int):
    """The OpenAI-compatible endpoint over ``generator`` (`grpo.system.generation.endpoint`), when
    ``policy.generation.vllm_cfg.expose_http_server`` is set or an environment is an agent (env.name=agent); its
    base URL, key and model name go to ``<log_dir>/endpoint.json`` (``endpoint_rank<r>.json`` on other ranks;
    owner-only) for agents outside the run. ``vocab_size``: the policy's embedding rows (token ids a request may
    carry, with the tokenizer's). Returns the `grpo.system.agent_rollout.AgentPlayer`, or None.
    ``asynchronous`` without a ``generator`` (the async loop's own weight copy, built once its weights are staged):
    None; the loop serves it with `start_async_endpoint`."""
    from grpo.system.agent_rollout import AgentPlayer, agent_tasks

    agent = sorted({t for envs in envs_list for t in agent_tasks(envs)})
    if not cfg.policy.generation.vllm_cfg.expose_http_server and not agent:
        return None
    if generator is None:
        if asynchronous:
            return None
        raise RunError("the endpoint (policy.generation.vllm_cfg.expose_http_server, env.name=agent) needs the run's "
                       "generation backend")
    from grpo.system.generation.endpoint import Endpoint

    try:
        endpoint = Endpoint(cfg, generator, tokenizer, vocab_size)
    except ValueError as err:  # vLLM's parsers refuse the tokenizer (grpo.system.generation.vllm_chat_parsers)
        raise RunError(str(err)) from None
    url = endpoint.start()
    closables.insert(0, endpoint)  # closed first: no request reaches a closed backend
    path = os.path.join(cfg.logger.log_dir, "endpoint.json" if rank == 0 else f"endpoint_rank{rank}.json")
    os.makedirs(cfg.logger.log_dir, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"base_url": url, "api_key": endpoint.api_key, "model": endpoint.model_name}, f)
    logger.write(f"endpoint: {url} serves {endpoint.model_name!r} (key in {path}){'; agent tasks ' + str(agent) if agent else ''}")
    from grpo.system.nemo_gym_servers import GymServerError, start_gym_servers

    try:  # NeMo-Gym's servers (env.should_use_nemo_gym), found or launched with this endpoint
        start_gym_servers(cfg, envs_list, endpoint, cfg.logger.log_dir if rank == 0 else
                          os.path.join(cfg.logger.log_dir, f"rank{rank}"), closables, logger)
    except GymServerError as err:
        raise RunError(str(err)) from None
    return AgentPlayer(endpoint)


def start_async_endpoint(run, generator) -> None:
    """The async loop's endpoint (``run.agents``) over its generation thread's backend ``generator`` (the thread's
    weight copy), when the run serves one and setup has not (over the generation ranks' backend, which the thread
    drives too). Weights change through the endpoint (`grpo.run.producer.RolloutProducer.load_newest`); the trainer's
    validation plays its agent samples over it as well, on the thread's weights."""
    if run.agents is None and run.generator is None:
        run.agents = start_endpoint(run.cfg, generator, run.tokenizer, [run.envs, run.val_envs], run.closables,
                                    run.logger, run.rank, asynchronous=True,
                                    vocab_size=run.policy.module.config.vocab_size)
        if run.agents is not None:  # a stop signal ends the agents' retries
            run.agents.stop_requested = run.stop.requested
