"""Where a run's generation runs and how it is served: the launch split into training, teacher and generation ranks,
a generation rank's and a teacher rank's whole run, the run's distillation teacher, the trainers' generation backend
(hf, vLLM, or the generation ranks behind the bridge) and the player over it (`grpo.system.players`: the
OpenAI-compatible endpoint, where a wing serves one)."""

from __future__ import annotations

import os

from grpo.config import cluster_mismatch, generation_ranks, loaded_teachers, teacher_ranks
from grpo.run.run import RunError


def start_split(cfg):
    """``policy.generation.colocated.enabled=false`` and / or ``on_policy_distillation.non_colocated_teachers``:
    check the launch against the config, then split it into training, teacher and generation ranks
    (`grpo.system.dist.init_split`); returns ``(layout, device)``."""
    from grpo.config import generation_split_problem
    from grpo.system.dist import EnvMismatch, init_split
    from grpo.system.engines import local_world_size

    launched, n_teacher = int(os.environ.get("WORLD_SIZE", "1")), teacher_ranks(cfg.on_policy_distillation)
    teachers = max(len(loaded_teachers(cfg.on_policy_distillation)), 1)  # a block of teacher ranks each
    problem = (cluster_mismatch(cfg.cluster, launched, local_world_size())
               or generation_split_problem(cfg.policy.generation, launched, n_teacher, teachers))
    if problem is not None:
        raise RunError(problem.removeprefix("error: "))
    try:
        return init_split(generation_ranks(cfg.policy.generation), num_teacher=n_teacher, teacher_groups=teachers)
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


def serve_teacher_rank(cfg, layout, device) -> None:
    """A teacher rank's whole run (`grpo.system.teacher.serve_teacher`): returns when trainer 0 closes the teacher
    bridge; raises `RunError` (one line) when the trainers are gone or the teacher cannot load."""
    from grpo.system.bridge import BridgeError
    from grpo.system.teacher import serve_teacher

    try:
        serve_teacher(cfg, layout, device)
    except Exception as err:  # noqa: BLE001 - its traceback is in this rank's log (serve_teacher logged it)
        why = str(err) if isinstance(err, BridgeError) else f"{type(err).__name__}: {err}"
        alias = loaded_teachers(cfg.on_policy_distillation)[layout.teacher_group]
        raise RunError(f"teacher rank {layout.teacher_index} ({alias!r}, launcher rank {layout.global_rank}) stops: "
                       f"{why}") from None


def start_teachers(cfg, layout, rank: int, world_size: int):
    """The run's distillation teachers: ``(teachers on the training ranks by alias, the teacher ranks' handle)``. On
    the teacher ranks (``non_colocated_teachers.enabled``: a `grpo.system.teacher.RemoteTeacher`, once they have
    loaded it) or on the training ranks (frozen engines, like the reference: `grpo.system.teacher.build_teachers`);
    ``({}, None)`` without distillation. A teacher that cannot load stops every trainer with one line (`RunError`)."""
    from grpo.system.teacher import TeacherError, build_teachers, connect_teacher

    if layout is None or not layout.num_teacher:
        return build_teachers(cfg, rank, world_size), None
    try:
        return {}, connect_teacher(cfg, layout)
    except TeacherError as err:
        raise RunError(str(err)) from None


def build_generation_backend(cfg, tokenizer, policy_engine, device, layout=None):
    """`policy.generation.backend`: "hf" (transformers generate, any device) or "vllm" (colocated). With hf and
    whole weights on every rank (ZeRO-1/2), generation runs on the policy module itself (no copy to refit). With a
    ``layout`` (`grpo.system.dist.Layout`, ``colocated.enabled=false``): `RemoteGeneration`, the generation
    ranks' engines behind the bridge (a collective of the trainers), inside what the wings wrap around it
    (`grpo.system.players.wrap_backend`: with several trainers that serve the endpoint, the agents wing's lockstep
    rounds, so each trainer's endpoint generates when its agents call and the trainers still generate together)."""
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
        from grpo.system.players import wrap_backend

        return wrap_backend(cfg, remote, layout)
    if cfg.policy.generation.backend == "hf":
        from grpo.system.generation.hf import HFGeneration

        shared = policy_engine.zero_optimization_stage() < 3
        return HFGeneration(cfg.policy, tokenizer, policy_engine.module.config, device,
                            model=policy_engine.module if shared else None, shared=shared,
                            refit_bucket_numel=cfg.policy.generation.refit_bucket_numel)
    from grpo.system.generation.vllm import VllmGeneration

    return VllmGeneration(cfg, tokenizer, policy_engine, device,
                          refit_bucket_numel=cfg.policy.generation.refit_bucket_numel)


def serve_player(cfg, generator, tokenizer, envs_list, closables: list, logger, rank: int, asynchronous: bool,
                 vocab_size: int):
    """The run's player (`grpo.system.players.start_player`: agents over the OpenAI-compatible endpoint, when a wing
    serves one), or None; one that cannot start stops the run with its line (`RunError`)."""
    from grpo.system.players import PlayerError, start_player

    try:
        return start_player(cfg, generator, tokenizer, envs_list, closables, logger, rank, asynchronous, vocab_size)
    except PlayerError as err:
        raise RunError(str(err)) from None


def start_async_player(run, generator) -> None:
    """The async loop's player (``run.player``) over its generation thread's backend ``generator`` (the thread's
    weight copy), when the run has one and setup has not started it (over the generation ranks' backend, which the
    thread drives too). Weights change through the player (`grpo.run.producer.RolloutProducer.load_newest`); the
    trainer's validation plays its samples through it as well, on the thread's weights."""
    if run.player is None and run.generator is None:
        run.player = serve_player(run.cfg, generator, run.tokenizer, [run.envs, run.val_envs], run.closables,
                                  run.logger, run.rank, asynchronous=True,
                                  vocab_size=run.policy.module.config.get_text_config().vocab_size)
        if run.player is not None:  # a stop signal ends the player's retries
            run.player.stop_requested = run.stop.requested
