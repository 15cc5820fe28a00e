"""Validation as NeMo-RL runs it: a scored pass with validation's sampling parameters over the validation
prompts, and its ``validation/*`` metrics."""

from __future__ import annotations

import time

from grpo.run.run import Run, dump_rollouts, run_rollout


def validate(run: Run, generator, envs, step: int) -> dict:
    """Score up to ``grpo.max_val_samples`` prompts x ``grpo.val_num_generations_per_prompt`` samples with validation's
    sampling (`grpo.config.GenerationConfig.sampling`), log NeMo-RL's ``validation/*`` and ``timing/validation/*``,
    print a few conversations and dump them (``logger.dump_rollouts``); returns the metrics under NeMo-RL's names
    (`grpo.config.validation_metric_names`), as NeMo-RL's ``validate`` (nemo_rl/algorithms/grpo.py):

        accuracy    mean reward over the scored samples  pass_k   share of prompts with a sample rewarded > 0
        avg_length  mean generated tokens per sample              (only when k > 1, as in NeMo-RL)
        truncation_rate, avg_turns_per_sample, num_samples  (the rollout's, `grpo.rollout_metrics.rollout_summary`)
        failed_samples  samples whose environment or reward call failed (`grpo.tasks.failures`): left out of
                        accuracy and pass_k (a prompt whose samples all failed is not counted), never scored 0

    A validation in which every sample failed scored nothing: its accuracy and pass_k are NaN, never 0 (a
    checkpoint then ranks lowest by them, `grpo.system.checkpoint.state_json`; early stopping reads no threshold
    reached), and a line says so (`failed_validation_note`).

    Seeds depend only on the sample's index (not the step), so successive validations differ only by the
    weights. A collective: every rank calls it.
    """
    import torch

    from grpo.batch import build_batch
    from grpo.metrics import pass_at_k
    from grpo.rollout_metrics import rollout_summary
    from grpo.step import penalize
    from grpo.trajectory import filled_rewards

    g = run.cfg.grpo
    n = min(len(run.val_ds), g.max_val_samples or len(run.val_ds))
    k = g.val_num_generations_per_prompt
    rows = [run.val_ds[i] for i in range(n)]
    trajs, timing, t0 = [], {"generate_s": 0.0, "env_step_s": 0.0}, time.perf_counter()
    bs = g.val_batch_size or n
    for start in range(0, n, bs):  # stream "val": validation's sampling profile (`grpo.run.run.turn_settings`)
        r = run_rollout(run, generator, envs, rows[start: start + bs], 0, start // bs, stream="val",
                        num_generations=k)
        trajs += r.trajectories
        timing = {key: v + r.timing[key] for key, v in timing.items()}
    # NeMo-RL's validate scores with its reward_penalties too: accuracy counts a zeroed sample as wrong.
    rewards_b, _, penalty_metrics, _, _ = penalize(torch.tensor(filled_rewards(trajs)), trajs,
                                                   run.cfg.reward_penalties, run.tokenizer, run.cfg.env)
    rollout = rollout_summary(trajs)  # {} without samples
    scored_b = torch.tensor([t.scored for t in trajs], dtype=torch.bool)
    nothing_scored = not scored_b.any()  # a score of nothing is no score: NaN, never 0 (`failed_validation_note`)
    metrics = {
        "accuracy": float("nan") if nothing_scored else rewards_b[scored_b].mean().item(),
        "avg_length": rollout.get("mean_gen_tokens_per_sample", 0.0),
        "truncation_rate": rollout.get("truncation_rate", 0.0),
        "avg_turns_per_sample": rollout.get("avg_turns_per_sample", 0.0),
        "num_samples": float(len(trajs)),
        "failed_samples": float((~scored_b).sum().item()),
        **penalty_metrics,
    }
    if k > 1:  # per prompt: the step's groups (by prompt tokens, `grpo.batch.TrainBatch.prompt_groups`), a sample once
        rows = build_batch(trajs, pad_id=0)
        metrics["pass_k"] = float("nan") if nothing_scored else pass_at_k(
            rewards_b[scored_b], rows.prompt_groups()[rows.first_rows()][scored_b])
    if nothing_scored:
        run.logger.write(failed_validation_note(step, trajs))
    timing["total_validation_time"] = time.perf_counter() - t0
    run.logger.log({**{f"validation/{key}": v for key, v in metrics.items()},
                    **{f"timing/validation/{key}": v for key, v in timing.items()}}, step)
    run.logger.print_samples(trajs, run.cfg.logger.num_val_samples_to_print)
    dump_rollouts(run, "val", step, trajs)
    return metrics


def failed_validation_note(step: int, trajs: list) -> str:
    """The line of a validation whose samples all failed: how many, by reason, and the first one's detail.

        >>> from types import SimpleNamespace as T
        >>> from grpo.trajectory import Failure
        >>> failed = T(failure=Failure.of("reward_error", "Traceback ...\\nValueError: down"), retries=1)
        >>> note = failed_validation_note(3, [failed, failed])
        >>> note[:84]
        'validation at step 3 failed: all 2 samples failed (reward_error: 2), none was scored'
        >>> note[84:]
        ': validation/accuracy is NaN, not 0; the first: ValueError: down'
    """
    from grpo.step import failure_counts

    prefix = "rollout/failed_samples/"
    reasons = ", ".join(f"{k[len(prefix):]}: {v}" for k, v in failure_counts(trajs).items() if k.startswith(prefix))
    detail = next((t.failure.detail for t in trajs if t.failure is not None and t.failure.detail), "")
    last = detail.strip().splitlines()[-1][:300] if detail.strip() else ""
    return (f"validation at step {step} failed: all {len(trajs)} samples failed ({reasons}), none was scored: "
            f"validation/accuracy is NaN, not 0" + (f"; the first: {last}" if last else ""))
