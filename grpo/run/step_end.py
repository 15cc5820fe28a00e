"""The end of a step, the same in both loops: a trained step's log, checks, dumps, validation and checkpoint
(`end_step`), or the bookkeeping of a step skipped for failed rollouts (`skip_step`).

    end = end_step(run, step, batch, results, metrics, validate=..., loader_state=...)
    stop, failure = end.stop, end.failure          # both None: go on

A fork that changes what a step logs or when it validates edits this one function, not two loops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from grpo.run.run import Run, dump_rollouts, resume_note, save, stop_reason, stop_requested


@dataclass
class StepEnd:
    """What the loop does after a step: go on (``stop`` and ``failure`` None), stop normally (``stop``: why:
    max steps, a time limit, a stop signal, validation's threshold) or fail (``failure``: one line, exit 1).
    ``metrics``: the step's row as logged (NeMo-RL's names)."""

    stop: str | None
    failure: str | None
    metrics: dict


def end_step(run: Run, step: int, batch, results: list[dict], metrics: dict, *, validate: Callable[[int], dict],
             loader_state: Callable[[], dict | None], extra: Callable[[], dict] | None = None,
             failure: str | None = None) -> StepEnd:
    """After step ``step`` trained on ``batch`` (``results``: its optimizer steps' loss metrics):

    1. the row's keys as NeMo-RL logs them (`grpo.metrics.nemo_rl_names`), the health checks (non-finite
       losses, a collapsing policy: `grpo.system.health.StepChecks`), the row logged, the rollouts dumped;
    2. a ``failure`` already known (a refit that broke) or found by the checks ends the step here;
    3. ``validate(step)`` when ``grpo.val_period`` says so and no stop signal is pending (a `RolloutError` there
       fails the run: this step is trained and good, `grpo.run.run.finish` saves it);
    4. a checkpoint on ``checkpointing.save_period``, at the last step, or when the run stops now, with
       ``loader_state()`` (the position after the last trained prompts) and ``extra()`` (the async replay buffer).
    """
    from grpo.metrics import nemo_rl_names
    from grpo.step import due_save, due_validation
    from grpo.system.rollout import RolloutError

    cfg = run.cfg
    metrics = nemo_rl_names(metrics)
    failure = failure or run.checks.after_step(batch.trajectories, batch.raw_rewards_b, results, metrics)
    run.logger.log(metrics, step)
    run.logger.progress(step, metrics)
    dump_rollouts(run, "train", step, batch.trajectories, batch)
    if failure is not None:
        return StepEnd(None, failure, metrics)
    val = None
    if due_validation(cfg, step, run.total_steps) and not stop_requested(run):
        try:
            val = validate(step)
        except RolloutError as err:
            return StepEnd(None, f"validation at step {step} failed: {err}{resume_note(run)}", metrics)
    stop = stop_reason(run, step, val)
    if due_save(cfg, step, run.total_steps) or (stop and cfg.checkpointing.enabled):
        save(run, step, metrics, val, loader_state(), extra=extra() if extra is not None else None)
    return StepEnd(stop, None, metrics)


def skip_step(run: Run, step: int, batch, metrics: dict) -> str | None:
    """Step ``step`` is not trained: too many of its samples failed (``grpo.rollout_failure.min_step_batch_fraction``,
    `grpo.system.health.RolloutBudget`). It is still a step (`grpo.step.record_step` with ``trained=False``): its
    prompts are consumed, its row is logged (rollout metrics, no ``train/loss``) with ``rollout/skipped_steps``,
    its samples dumped, and a line names the environment's last error. Returns None, or the stop message (one
    line) once ``max_consecutive_skipped_steps`` steps in a row were skipped: `grpo.run.run.finish` then saves the state (the
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
