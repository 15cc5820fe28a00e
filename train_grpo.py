#!/usr/bin/env python
"""Synchronous GRPO on DeepSpeed ZeRO-3: read top to bottom, this file is the algorithm.

    python train_grpo.py                                  # the CPU demo (configs/cpu_demo.yaml)
    python train_grpo.py --config configs/X.yaml grpo.num_prompts_per_step=8 loss_fn.ratio_clip_max=0.28
    python train_grpo.py --help-config grpo               # every field of a config section
    torchrun --nproc_per_node 2 train_grpo.py --config ...
    deepspeed --num_gpus 8 train_grpo.py --config ...
    accelerate launch --config_file launch/accelerate_zero3.yaml train_grpo.py --config ...

One step: take prompts -> play G conversations each with the environments (one turn, or up to
grpo.max_rollout_turns) -> penalties, scaling, shaping -> failed samples masked (a step with too many is
skipped: grpo.rollout_failure) -> per-prompt baselines (dynamic sampling may ask for more prompts) -> sample
masks -> previous-policy and reference logprobs -> advantages -> train with the loss normalised by the step's
global valid-token count -> refit the generation engine -> validate, checkpoint, log. Every rank holds the
whole rollout of a step; each trains on its shard.
"""

from __future__ import annotations

import os
import time

from grpo.run.run import finish, run_script, signal_stop_message, stop_requested
from grpo.run.run_setup import setup
from grpo.run.step_end import (
    checkpoint_step, log_step, record_trained, skip_step, validate_first, validate_step,
)
from grpo.run.phases import Collected, Outcome, collect_rollouts, score_logprobs, sync_weights
from grpo.run.validation import validate

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "cpu_demo.yaml")


def main(argv=None) -> int | None:
    """Train; return None, or a stop signal's exit status. A run that cannot start or that fails raises
    `grpo.run.run.RunError` (the script prints its ``error:`` line and exits 1)."""
    run = setup(argv, DEFAULT_CONFIG, asynchronous=False, description=__doc__)
    if run is None:  # --export-hf done, or a generation rank (colocated.enabled=false) that served its run
        return None
    from grpo.loss import clipped_pg_loss_fn
    from grpo.step import initial_sample_mask, step_advantages
    from grpo.system.checkpoint import rng_state
    from grpo.system.data import PromptStream
    from grpo.system.tracking import timed
    from grpo.system.training import train_step

    cfg, state = run.cfg, run.state
    prompts = PromptStream(run.loader, cfg.grpo.max_num_epochs, state.current_epoch,
                           run.resume.loader_state if run.resume else None)

    def validate_now(step: int) -> dict:
        return validate(run, run.generator, run.val_envs, step)

    end = validate_first(run, validate_now)  # grpo.val_at_start
    got = Collected(Outcome.TRAIN)  # what ended the loop: a step's outcome (TRAIN or SKIP: the loop's condition)
    while state.current_step < run.total_steps and end.stop is None and end.failure is None:
        step = state.current_step + 1
        t_step = time.perf_counter()
        # Where the last finished step left the prompts and the RNG: what a step abandoned before training saves.
        mark, rng = prompts.mark(), rng_state()
        timing = {"timing/train/generate_s": 0.0, "timing/train/env_step_s": 0.0}

        # ---- 1-4. generate and score: play the conversations, penalties / scaling / shaping, mask the failed
        #           samples, dynamic sampling; then the step budget (too few samples got a score: skipped) ----
        got = collect_rollouts(run, prompts, step, timing)
        if got.outcome is Outcome.SKIP:  # counted, logged, checkpointed when due
            end = skip_step(run, step, end, got.batch, got.metrics, prompts.epoch, run.loader.state_dict)
            continue
        if got.outcome is not Outcome.TRAIN:  # out of data, a stop signal, a failed rollout: the end below
            break
        batch, metrics = got.batch, got.metrics

        # ---- 5. sample masks: invalid samples (failed, flagged), overlong filtering (stays in the baseline) --
        batch = batch.replace(sample_mask_b=initial_sample_mask(cfg, batch))

        # ---- 6. previous-policy, reference (and teacher) logprobs; each rank scores its share ----
        with timed(timing, "logprobs"):
            batch, failure = score_logprobs(run, batch, step)
        if failure is not None:  # the teacher ranks are gone: the run ends, the last finished step saved
            got = Collected(Outcome.FAILED, failure=failure)
            break
        if stop_requested(run):  # the last safe point before the weights change
            got = Collected(Outcome.ABANDONED)
            break

        # ---- 7. logprob-error masking, advantages, message penalties, clipping -------------------
        batch, adv_metrics = step_advantages(cfg, batch)

        # ---- 8. train: one optimizer step per train_global_batch_size samples -------------------
        with timed(timing, "train"):
            results = train_step(cfg, run.policy, batch, run.rank, run.world_size, loss_fn=clipped_pg_loss_fn)

        # ---- 9. sync weights: refit the generation engine --------------------------------------------
        failure = sync_weights(run, step, timing)  # generation ranks gone (colocated.enabled=false)
        metrics = record_trained(run, step, batch, results, metrics, adv_metrics, timing, t_step, prompts.epoch,
                                 extra=run.generator.memory)

        # ---- 10. log (health checks, dumps), validate, checkpoint (a stop signal skips validation) -------
        end = log_step(run, step, batch, results, metrics, failure)
        val, end = validate_step(run, step, end, validate_now)
        end = checkpoint_step(run, step, end, val, run.loader.state_dict)

    # ================================================================ the end
    stop, failure = end.stop, end.failure
    match got.outcome:
        case Outcome.OUT_OF_DATA:  # dynamic sampling can use up the epochs before max_num_steps
            stop = "out of training data"
        case Outcome.ABANDONED:  # before training: the last finished step's prompts and RNG are what finish saves
            stop = signal_stop_message(run, step)
        case Outcome.FAILED:
            failure = got.failure
    abandoned = got.outcome in (Outcome.ABANDONED, Outcome.FAILED)
    return finish(run, out_of_data=got.outcome is Outcome.OUT_OF_DATA,
                  loader_state=mark.loader if abandoned else run.loader.state_dict(), failure=failure,
                  metrics=end.metrics, stop=stop, rng=rng if abandoned else None)


if __name__ == "__main__":
    run_script(main)  # known errors as one `error:` line (GRPO_DEBUG=1: with the traceback); exit status
