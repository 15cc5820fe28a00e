"""The end of a trained step, the same in both loops: log, check, dump, validate, checkpoint.

    end = end_step(run, step, batch, results, metrics, validate=..., loader_state=...)
    stop, failure = end.stop, end.failure          # both None: go on

A fork that changes what a step logs or when it validates edits this one function, not two loops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from grpo.run import Run, dump_rollouts, resume_note, save, stop_reason, stop_requested


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
       fails the run: this step is trained and good, `grpo.run.finish` saves it);
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
