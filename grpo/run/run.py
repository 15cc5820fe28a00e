"""A run's shared parts: the `Run` every loop works with, `RunError` and the scripts' ``__main__``, and what a loop
calls with the run each step (rollout, dumps, checkpoint, stop decisions) up to `finish`, its teardown.

    run = setup(argv, DEFAULT_CONFIG, asynchronous=False)   # grpo.run.run_setup: a Run, or None (--export-hf done)
    ... the loop, calling run_rollout(run, ...), validate(run, ...) and grpo.run.step_end's phases ...
    return finish(run, failure=..., stop=...)                # None or a signal's exit status

A run that cannot start or that fails raises `RunError`; `run_script` (the scripts' ``__main__``) catches
it once, prints its ``error:`` line and exits 1.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from grpo.config import MasterConfig
from grpo.config.load import ConfigError

if TYPE_CHECKING:  # for the types only: a config error must exit before torch (and all that follows) is imported
    import torch
    from deepspeed import DeepSpeedEngine
    from torchdata.stateful_dataloader import StatefulDataLoader
    from transformers import PreTrainedTokenizerBase

    from grpo.system.chat import ChatFormat
    from grpo.system.checkpoint import CheckpointManager, GRPOSaveState, SaveDeadline
    from grpo.system.data import PromptDataset
    from grpo.system.deferred import DeferredScorers
    from grpo.system.dumps import RolloutDumper
    from grpo.system.players import Player
    from grpo.system.generation.base import GenerationBackend
    from grpo.system.health import StepChecks
    from grpo.system.rundir import RunLock
    from grpo.system.signals import StopRequest
    from grpo.system.tracking import MetricsLogger
    from grpo.system.training import LogprobEngines
    from grpo.tasks.router import Environments
    from grpo.tasks.rows import PromptRow
    from grpo.trajectory import Trajectory


class RunError(Exception):
    """A run that cannot start, or that failed: its message is written for people. Raised on every rank
    together (after the collectives that make them agree); `run_script` prints ``error: <message>`` and exits 1."""


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------
@dataclass
class Run:
    """Everything a loop works with, built by `grpo.run.run_setup.setup`. ``checks``: the per-step health checks
    (`grpo.system.health.StepChecks`); ``stop``: the SIGTERM / SIGINT flag (`grpo.system.signals.StopRequest`); ``dumper``:
    the rollout dumps (`grpo.system.dumps.RolloutDumper`); ``run_id``: the run's id in its directories
    (`grpo.system.rundir`). ``generator`` is the synchronous loop's generation
    backend (None for the async loop, which builds its own, unless generation runs on ranks of its own: then the
    `grpo.system.generation.remote.RemoteGeneration` the async producer drives); ``val_envs`` are validation's environments
    (``envs`` themselves unless ``env.val_tasks`` is set or the loop is asynchronous: its generation thread
    owns ``envs``); ``resume`` holds what the newest checkpoint restored for the loop to use
    (``loader_state``, ``extra``), or None; ``exit_status`` is a stop signal's (set by `stop_requested`);
    ``closables`` are closed in order by `finish`; ``turn_stop``: a fork's turn-level stopping rule for multi-turn
    rollouts (`grpo.system.rollout.TurnSettings.stop`; ``setup(..., turn_stop=...)``), or None."""

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
    player: Player | None = None  # who plays the samples of its tasks (grpo.system.players), or None
    deferred: DeferredScorers | None = None  # the scorers of the deferred scoring point (grpo.system.deferred)
    turn_stop: Callable[[Trajectory], bool] | None = None


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


class RunLocks:
    """Closes (releases) the run directories' locks at the very end."""

    def __init__(self, locks: list[RunLock]):
        self.locks = locks

    def close(self) -> None:
        for lock in self.locks:
            lock.release()


def claim_on_rank0(rank: int, claim) -> tuple[list[RunLock], str | None]:
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


def turn_settings(cfg, greedy: bool = False, stop: Callable[[Trajectory], bool] | None = None,
                  validation: bool = False):
    """The rollout's limits from the config, and a fork's turn-level stopping rule ``stop``
    (`grpo.system.rollout.TurnSettings`); with ``validation`` it samples with validation's profile (NeMo-RL's
    ``val_temperature`` / ``val_top_p`` / ``val_top_k``)."""
    from grpo.system.rollout import TurnSettings

    p = cfg.policy
    return TurnSettings(max_turns=cfg.grpo.max_rollout_turns, max_total_len=p.max_total_sequence_length,
                        chunk_size=p.generation_batch_size, greedy=greedy, max_new_tokens=p.generation.max_new_tokens,
                        stop=stop, sampling=p.generation.sampling(validation=validation))


def run_rollout(run: Run, generator, envs, prompts: list[PromptRow], step: int, gen_batch: int, *,
                stream: str = "train", num_generations: int | None = None, weights=None, group=None,
                score_pending=None):
    """`grpo.system.rollout.generate_rollout` of a prompt batch with the run's settings and turn-level stopping rule
    (a collective). ``score_pending``: the deferred scoring point (default: the run's deferred scorers, in this
    thread; the async producer passes its hand-over to the trainer thread). ``weights``: the async loop's weight
    source; None in the synchronous loop, whose generator holds the weights of the steps trained so far (refit after
    each): that is the version its samples and the endpoint's answers record. (None in the async loop: its
    validation copy, which the endpoint does not version.)"""
    from grpo.system.rollout import FixedWeights, generate_rollout

    cfg = run.cfg
    if weights is None and not cfg.grpo.async_grpo.enabled:
        weights = FixedWeights(run.state.current_step)
    settings = turn_settings(cfg, stop=run.turn_stop, validation=stream == "val")
    return generate_rollout(prompts, num_generations or cfg.grpo.num_generations_per_prompt, generator, envs,
                            run.chat, settings, base_seed=cfg.grpo.seed, step=step,
                            gen_batch=gen_batch, stream=stream, rank=run.rank, world_size=run.world_size,
                            weights=weights, group=group, player=run.player,
                            score_pending=score_pending or (run.deferred.score_pending if run.deferred else None))


# --------------------------------------------------------------------------------------------------
# Dumps, checkpoints, stopping
# --------------------------------------------------------------------------------------------------
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


def done_line(steps: int, val_reward: float) -> str:
    """The run's closing line: its steps and the accuracy of its last saved validation (``val_reward``: NeMo-RL's
    ``GRPOSaveState.val_reward``, -99999999 when there was none); NaN is a validation whose samples all failed,
    said as failed, never as a number (`grpo.run.validation.validate`).

        >>> done_line(3, 0.5), done_line(3, -99999999.0)
        ('done: 3 steps, last validation/accuracy 0.5', 'done: 3 steps')
        >>> done_line(3, float("nan"))
        'done: 3 steps, last validation failed (none of its samples was scored)'
    """
    if math.isnan(val_reward):
        return f"done: {steps} steps, last validation failed (none of its samples was scored)"
    return f"done: {steps} steps" + (f", last validation/accuracy {val_reward:.4g}" if val_reward > -99999999.0 else "")


def known_error_message(err: BaseException) -> str | None:
    """The ``error:`` line of an exception whose message is written for people (bad data, a checkpoint that
    cannot be written or read, a run directory that cannot be used, a rollout that broke, an environment that
    cannot be built (a reward model that is none), a file system that refuses a write), or None for any other
    exception (a bug: its traceback matters)."""
    from grpo.system.write_errors import describe_os_error

    known: list[type] = [ConfigError]
    for module, names in (("grpo.system.data", ("DataError",)), ("grpo.system.chat", ("ChatFormatError",)),
                          ("grpo.system.checkpoint", ("CheckpointError",)), ("grpo.system.rundir", ("RunDirError",)),
                          ("grpo.system.weights", ("ExportError",)), ("grpo.system.rollout", ("RolloutError",)),
                          ("grpo.system.teacher", ("TeacherError",)),
                          ("grpo.tasks.function", ("EnvError",))):
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
           extra: dict | None = None, metrics: dict | None = None, rng: dict | None = None,
           stop: str | None = None) -> int | None:
    """End of a run: the line that says why it stops (``failure``, else ``stop``: a normal stop's reason), a last
    checkpoint of the last finished step when it is not saved yet and the data ran
    out, a signal stopped the run (e.g. abandoning a step before training), or a failure left the state good
    (not after non-finite steps: the last checkpoint holds the last good weights); the consolidated export
    (``hf_final``; not after a failure, a signal or a time-limit stop), the closing line, and every resource
    released. ``loader_state``, ``metrics`` (the step's, for checkpoint ranking) and ``rng`` (the RNG state at
    the end of that step, `grpo.system.checkpoint.rng_state`; None: as it is now) describe that last finished step.
    Returns what ``main`` returns, a signal's exit status or None; with a ``failure`` (what went wrong, written
    for people) raises `RunError` with it once all of that is done (the script exits 1)."""
    from grpo.system import engines, weights
    from grpo.system.checkpoint import set_rng_state
    from grpo.system.health import HealthStop

    cfg, state = run.cfg, run.state
    if stop or failure:
        run.logger.write(f"stopping at step {state.current_step}: {failure or stop}")
    saved = run.ckpt.latest_step(checksums=False) if cfg.checkpointing.enabled else None
    good_state = failure is not None and run.checks.stop_kind is not HealthStop.NONFINITE
    signalled = run.exit_status is not None
    if (cfg.checkpointing.enabled and (out_of_data or good_state or signalled) and saved != state.current_step
            and (state.current_step > 0 or out_of_data)):
        if rng is not None:
            set_rng_state(rng)
        save(run, state.current_step, metrics if metrics is not None else state.metrics, None, loader_state, extra)
    if failure is None and run.exit_status is None and not run.deadline.reached and cfg.checkpointing.enabled:
        weights.export_hf(run.policy, os.path.join(cfg.checkpointing.checkpoint_dir, "hf_final"), run.tokenizer,
                          run_id=run.run_id)
    run.logger.write(done_line(state.current_step, state.val_reward))
    for closable in run.closables:
        closable.close()
    engines.shutdown()
    if failure is not None:
        raise RunError(failure)
    return run.exit_status
