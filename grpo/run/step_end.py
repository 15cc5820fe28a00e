"""The end of a step, the same in both loops, as the phases the loops call by name: `log_step` (names, health
checks, the row logged, the rollouts dumped), `validate_step` (on ``grpo.val_period``), `checkpoint_step` (the
stop decision and the checkpoint), or `skip_step` for a step skipped for failed rollouts; `validate_first` before
the first step. Each passes a `StepEnd` on.

    end = log_step(run, step, batch, results, metrics)
    val, end = validate_step(run, step, end, validate=...)
    end = checkpoint_step(run, step, end, val, loader_state=...)
    end.stop, end.failure                          # both None: go on

A fork that changes what a step logs or when it validates edits these functions, not two loops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from grpo.run.run import Run, dump_rollouts, resume_note, save, stop_reason, stop_requested


@dataclass
class StepEnd:
    """What the loop does after a step: go on (``stop`` and ``failure`` None), stop normally (``stop``: why:
    max steps, a time limit, a stop signal, validation's threshold) or fail (``failure``: one line, exit 1).
    ``metrics``: the last trained step's row as logged (NeMo-RL's names; None before the first), what a last
    checkpoint at the run's end ranks by (`grpo.run.run.finish`)."""

    stop: str | None
    failure: str | None
    metrics: dict | None


def record_trained(run: Run, step: int, batch, results: list[dict], metrics: dict, adv_metrics: dict, timing: dict,
                   t_step: float, epoch: int, extra: dict) -> dict:
    """Bookkeeping of a trained step: the state's step, counters and ``epoch`` (`grpo.step.record_step`), the
    step's seconds; returns the step's row: ``metrics`` (the rollouts'), the advantages' ``adv_metrics``, the
    batch's summary (`grpo.rollout_metrics.step_summary`) and its images' payload figures (a VLM's,
    `grpo.system.media.payload_metrics`) under ``train/``, the step's own
    (`grpo.step.step_metrics`), ``timing``, the step budget's, then ``extra`` (the loop's own) and ``train/epoch``."""
    import time

    from grpo.rollout_metrics import step_summary
    from grpo.step import record_step, step_metrics
    from grpo.system.media import payload_metrics

    record_step(run.state, batch, step)
    run.state.current_epoch = epoch
    timing["timing/train/total_step_time"] = time.perf_counter() - t_step
    metrics = {**metrics, **{f"train/{k}": v for k, v in {**adv_metrics, **step_summary(batch),
                                                          **payload_metrics(batch.media, "policy_train")}.items()}}
    return {**metrics, **step_metrics(batch, results, timing["timing/train/total_step_time"]), **timing,
            **run.checks.rollouts.metrics(), **extra, "train/epoch": epoch}


def validate_first(run: Run, validate: Callable[[int], dict]) -> StepEnd:
    """Before the first step (``grpo.val_at_start``, a fresh run): ``validate(0)``; its early-stop threshold may
    stop the run, a `RolloutError` (an environment that breaks, raised on every rank together) fails it."""
    from grpo.step import early_stop_reason
    from grpo.system.rollout import RolloutError

    if not (run.cfg.grpo.val_at_start and run.state.current_step == 0):
        return StepEnd(None, None, None)
    try:
        return StepEnd(early_stop_reason(run.cfg, validate(0)), None, None)
    except RolloutError as err:
        return StepEnd(None, f"validation before training failed: {err}", None)


def log_step(run: Run, step: int, batch, results: list[dict], metrics: dict, failure: str | None = None) -> StepEnd:
    """After step ``step`` trained on ``batch`` (``results``: its optimizer steps' loss metrics): the health checks
    (non-finite losses, a collapsing policy: `grpo.system.health.StepChecks`), the row logged (``metrics``, in
    NeMo-RL's names as the phases made them), the rollouts dumped. A ``failure`` already known (a refit that broke)
    or found by the checks ends the step here: the later phases pass it on."""
    first = batch.first_rows()  # each sample once, whatever its branches
    failure = failure or run.checks.after_step(batch.raw_rewards_b[first], batch.scored_b[first], results, metrics)
    run.logger.log(metrics, step)
    run.logger.progress(step, metrics)
    dump_rollouts(run, "train", step, batch.trajectories, batch)
    return StepEnd(None, failure, metrics)


def validate_step(run: Run, step: int, end: StepEnd, validate: Callable[[int], dict]) -> tuple[dict | None, StepEnd]:
    """``validate(step)`` when ``grpo.val_period`` says so, the step did not fail and no stop signal is pending;
    returns (its metrics or None, the end). A `RolloutError` there fails the run: this step is trained and good,
    `grpo.run.run.finish` saves it."""
    from grpo.step import due_validation
    from grpo.system.rollout import RolloutError

    if end.failure is not None or not due_validation(run.cfg, step, run.total_steps) or stop_requested(run):
        return None, end
    try:
        return validate(step), end
    except RolloutError as err:
        return None, StepEnd(None, f"validation at step {step} failed: {err}{resume_note(run)}", end.metrics)


def checkpoint_step(run: Run, step: int, end: StepEnd, val: dict | None, loader_state: Callable[[], dict | None],
                    extra: Callable[[], dict] | None = None) -> StepEnd:
    """Unless the step failed: whether the run stops now (`grpo.run.run.stop_reason`: a stop signal, validation's
    threshold, the time limit), and a checkpoint on ``checkpointing.save_period``, at the last step, or when the
    run stops now, with ``loader_state()`` (the position after the last trained prompts) and ``extra()`` (the
    async replay buffer)."""
    from grpo.step import due_save

    if end.failure is not None:
        return end
    stop = stop_reason(run, step, val)
    if due_save(run.cfg, step, run.total_steps) or (stop and run.cfg.checkpointing.enabled):
        save(run, step, end.metrics, val, loader_state(), extra=extra() if extra is not None else None)
    return StepEnd(stop, None, end.metrics)


def skip_step(run: Run, step: int, last: StepEnd, batch, metrics: dict, epoch: int,
              loader_state: Callable[[], dict | None], extra: Callable[[], dict] | None = None) -> StepEnd:
    """Step ``step`` is not trained: too many of its samples failed (``grpo.rollout_failure.min_step_batch_fraction``,
    `grpo.system.health.RolloutBudget`). It is still a step (`grpo.step.record_step` with ``trained=False``): its
    prompts are consumed (the run is in ``epoch``), its row is logged (rollout metrics, no ``train/loss``) with
    ``rollout/skipped_steps``, its samples dumped, and a line names the environment's last error; then the stop
    decision and the checkpoint as after a trained step (`checkpoint_step`, without validation). Fails (one line)
    once ``max_consecutive_skipped_steps`` steps in a row were skipped: `grpo.run.run.finish` then saves the state
    (the weights of the last trained step) and the run exits 1 with it. ``last``: the end of the step before; its
    ``metrics`` (the last trained step's row) go on in the end returned: a skipped step has no row of its own to
    rank a checkpoint by (its own checkpoint ranks by the last saved metrics)."""
    from grpo.step import record_step
    from grpo.system.health import HealthStop

    budget = run.checks.rollouts
    stop = budget.skipped(batch.samples())
    record_step(run.state, batch, step, trained=False)
    run.logger.write(budget.skip_note(step, batch.scored_samples()))
    run.logger.log({**metrics, **budget.metrics(), "train/skipped_step": 1}, step)
    dump_rollouts(run, "train", step, batch.trajectories, batch)
    run.state.current_epoch = epoch
    if stop:
        run.checks.stop_kind = HealthStop.ROLLOUTS
        return StepEnd(None, f"{budget.message()}; the weights are those of step {step - budget.consecutive} (the last "
                       "trained one)" + (f"; step {step} is checkpointed: rerun the same command to resume once the "
                                         "environment is back" if run.cfg.checkpointing.enabled else ""), last.metrics)
    end = checkpoint_step(run, step, StepEnd(None, None, run.state.metrics), None, loader_state, extra)
    return StepEnd(end.stop, None, last.metrics)
