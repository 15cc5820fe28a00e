"""The phases before training that the loops compose with the run: scoring a rollout's samples (`score_rollouts`,
both loops), the synchronous loop's collection of a step's rollouts (`collect_rollouts`: play and score prompt
batches until the step's batch is full, and say what the step does next as one typed `Outcome`), the logprobs of
both loops (`score_logprobs`) and the synchronous loop's weight sync into the generation engine (`sync_weights`).

    got = collect_rollouts(run, prompts, step, timing)
    match got.outcome:
        case Outcome.TRAIN: ...            # got.batch, got.metrics: train on it
        case Outcome.SKIP: ...             # too few samples got a score (grpo.rollout_failure): a skipped step
        case _: ...                        # OUT_OF_DATA, ABANDONED (a stop signal), FAILED (got.failure): the end

One prompt batch without dynamic sampling; with it (DAPO), prompt batches until enough groups whose rewards
differ are kept, or ``grpo.dynamic_sampling_max_gen_batches`` is used up.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from grpo.run.run import Run, resume_note, run_rollout, stop_requested


class Outcome(enum.Enum):
    """What a step does after its rollouts: train on them, skip the step (too many failed samples), or end the
    run: the data ran out, a stop signal abandoned the step, or the rollout failed."""

    TRAIN = "train"
    SKIP = "skip"
    OUT_OF_DATA = "out of data"
    ABANDONED = "abandoned"
    FAILED = "failed"


@dataclass
class Collected:
    """The collection's `Outcome` and its payload: ``batch`` and ``metrics`` (the step's row so far, NeMo-RL's
    ``train/`` prefix and the validity counts) for TRAIN and SKIP; ``failure`` (one line) for FAILED."""

    outcome: Outcome
    batch: object = None  # grpo.batch.TrainBatch
    metrics: dict = field(default_factory=dict)
    failure: str | None = None


def score_rollouts(run: Run, trajectories: list, metrics: dict) -> tuple:
    """Score: a rollout's samples as a batch (`grpo.batch.build_batch`), penalties / scaling / shaping
    (`grpo.step.shape_rewards`), failed and flagged samples masked and thin groups dropped
    (`grpo.step.mask_invalid_samples`), the samples counted by the step budget (``run.checks.rollouts``). Returns
    (batch, validity counts, metrics: the rollout's counts, ``metrics`` (the rollout's own), the penalties')."""
    from grpo.batch import build_batch
    from grpo.metrics import rollout_counts
    from grpo.step import mask_invalid_samples, shape_rewards

    cfg = run.cfg
    batch, penalty_metrics = shape_rewards(
        cfg, build_batch(trajectories, run.tokenizer.pad_token_id, cfg.env.should_mask_flagged_samples), run.tokenizer)
    batch, counts = mask_invalid_samples(batch)
    run.checks.rollouts.count(trajectories)
    return batch, counts, {**rollout_counts(trajectories), **metrics, **penalty_metrics}


def collect_rollouts(run: Run, prompts, step: int, timing: dict) -> Collected:
    """Phases 1-4 of step ``step``: take prompts from ``prompts`` (a `grpo.system.data.PromptStream`), play G
    conversations each (`run_rollout`), penalties / scaling / shaping (`grpo.step.shape_rewards`), failed and
    flagged samples masked (`grpo.step.mask_invalid_samples`), dynamic sampling; adds the generation and
    environment seconds to ``timing``. Then a stop signal abandons the step, and the step budget
    (``grpo.rollout_failure``, ``run.checks.rollouts``) says whether it trains (counted as trained) or is skipped."""
    import torch

    from grpo.dynamic_sampling import DynamicSamplingCache, DynamicSamplingExhausted
    from grpo.step import add_counts, group_std_for_dynamic_sampling
    from grpo.system.rollout import RolloutError
    from grpo.system.tracking import timed

    g = run.cfg.grpo
    dynamic = DynamicSamplingCache(g.num_prompts_per_step, g.num_generations_per_prompt,
                                   g.dynamic_sampling_max_gen_batches)
    budget = run.checks.rollouts  # grpo.rollout_failure: a step trains only when enough samples got a score
    batch, counts, short, metrics = None, {}, 0, {}
    for gen_batch in itertools.count():
        rows = prompts.next()
        if rows is None:
            break
        try:
            with timed(timing, "rollout"):
                r = run_rollout(run, run.generator, run.envs, rows, step, gen_batch)
        except RolloutError as err:  # the state of the last finished step is good: finish() saves it
            return Collected(Outcome.FAILED, failure=f"the rollout of step {step} failed: {err}{resume_note(run)}")
        timing["timing/train/generate_s"] += r.timing["generate_s"]
        timing["timing/train/env_step_s"] += r.timing["env_step_s"]
        # Failed (and flagged) samples leave the loss and their group's statistics; thin groups are dropped.
        batch, gen_counts, gen_metrics = score_rollouts(run, r.trajectories, r.metrics)
        counts = add_counts(counts, gen_counts)
        metrics.update(gen_metrics)
        if not g.use_dynamic_sampling:
            break
        gathered = batch
        if not budget.trainable(batch.scored_samples()):  # too many failures: draw more prompts
            short += 1
            batch = batch.replace(valid_b=torch.zeros_like(batch.valid_b))  # no group of it is kept
        # DAPO: keep whole groups whose (unshaped) rewards differ; regenerate until the batch is full.
        try:
            batch, dyn_metrics = dynamic.add(batch, batch.prompt_groups(), group_std_for_dynamic_sampling(batch))
        except DynamicSamplingExhausted:
            if not short:
                raise
            batch = gathered  # the failures emptied the step: it is skipped
            break
        metrics.update(dyn_metrics)
        if batch is not None:
            break
    if batch is None:  # dynamic sampling can use up the epochs before max_num_steps
        return Collected(Outcome.OUT_OF_DATA)
    metrics = {**{f"train/{k}": v for k, v in metrics.items()}, **counts}
    if stop_requested(run):  # a stop signal: abandon the step now rather than after training
        return Collected(Outcome.ABANDONED)
    if not budget.trainable(batch.scored_samples()):
        return Collected(Outcome.SKIP, batch, metrics)
    budget.trained()
    return Collected(Outcome.TRAIN, batch, metrics)


def score_logprobs(run: Run, batch, step: int) -> tuple[object, str | None]:
    """Phase 6 of both loops: previous-policy, reference and teacher logprobs (`grpo.system.training.step_logprobs`,
    a collective). Returns ``(batch, None)``, or ``(None, failure)`` (one line) when the teacher ranks failed, died or
    hang (``on_policy_distillation.non_colocated_teachers``): the step is abandoned before training, and the run
    ends with the last finished step saved."""
    from grpo.system.teacher import TeacherError
    from grpo.system.training import step_logprobs

    try:
        return step_logprobs(run.cfg, batch, run.logprob_engines, run.rank, run.world_size), None
    except TeacherError as err:
        return None, f"step {step} stops before training: {err}"


def sync_weights(run: Run, step: int, timing: dict) -> str | None:
    """Refit the generation engine with the policy's weights after step ``step`` (its seconds as NeMo-RL's
    ``timing/train/prepare_for_generation/total``); returns None, or the failure (one line) when the generation
    ranks are gone (``colocated.enabled=false``): the step is trained, the log and the final save still happen."""
    from grpo.system.rollout import RolloutError

    try:
        timing["timing/train/prepare_for_generation/total"] = run.generator.refit(run.policy)
    except RolloutError as err:
        timing["timing/train/prepare_for_generation/total"] = 0.0
        return f"the refit after step {step} failed: {err}"
    return None
