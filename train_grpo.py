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

import itertools
import os
import time

from grpo.run.run import (
    finish, resume_note, run_rollout, run_script, save, signal_stop_message, stop_reason, stop_requested,
)
from grpo.run.run_setup import setup
from grpo.run.step_end import end_step, skip_step
from grpo.run.validation import validate

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "cpu_demo.yaml")


def main(argv=None) -> int | None:
    """Train; return None, or a stop signal's exit status. A run that cannot start or that fails raises
    `grpo.run.run.RunError` (the script prints its ``error:`` line and exits 1)."""
    run = setup(argv, DEFAULT_CONFIG, asynchronous=False, description=__doc__)
    if run is None:  # --export-hf done, or a generation rank (colocated.enabled=false) that served its run
        return None
    import torch

    from grpo.batch import build_batch
    from grpo.system.checkpoint import rng_state
    from grpo.system.data import PromptStream
    from grpo.metrics import rollout_counts
    from grpo.system.rollout import RolloutError
    from grpo.rollout_metrics import step_summary
    from grpo.dynamic_sampling import DynamicSamplingCache, DynamicSamplingExhausted
    from grpo.step import (
        add_counts, due_save, early_stop_reason, group_std_for_dynamic_sampling, initial_sample_mask,
        mask_invalid_samples, record_step, shape_rewards, step_advantages, step_metrics,
    )
    from grpo.loss import clipped_pg_loss_fn
    from grpo.system.tracking import timed
    from grpo.system.training import step_logprobs, train_step

    cfg, g, state = run.cfg, run.cfg.grpo, run.state
    prompts = PromptStream(run.loader, g.max_num_epochs, state.current_epoch,
                           run.resume.loader_state if run.resume else None)
    stop = failure = abandoned = last_metrics = None
    if g.val_at_start and state.current_step == 0:
        try:
            stop = early_stop_reason(cfg, validate(run, run.generator, run.val_envs, 0))
        except RolloutError as err:  # an environment that breaks; every rank raises it together
            failure = f"validation before training failed: {err}"

    out_of_data = False
    while state.current_step < run.total_steps and stop is None and failure is None:
        step = state.current_step + 1
        t_step = time.perf_counter()
        # Where the last finished step left the prompts and the RNG: what a step abandoned before training saves.
        mark, rng = prompts.mark(), rng_state()
        metrics, timing = {}, {"timing/generate_s": 0.0, "timing/env_step_s": 0.0}

        # ---- 1-4. play the conversations, score, penalties / scaling / shaping, mask the failed samples,
        #           dynamic sampling ----
        dynamic = DynamicSamplingCache(g.num_prompts_per_step, g.num_generations_per_prompt,
                                       g.dynamic_sampling_max_gen_batches)
        budget = run.checks.rollouts  # grpo.rollout_failure: a step trains only when enough samples got a score
        batch, counts, short = None, {}, 0
        for gen_batch in itertools.count():
            rows = prompts.next()
            if rows is None:
                break
            try:
                with timed(timing, "rollout"):
                    r = run_rollout(run, run.generator, run.envs, rows, step, gen_batch)
            except RolloutError as err:  # the state of the last finished step is good: finish() saves it
                failure, abandoned = f"the rollout of step {step} failed: {err}{resume_note(run)}", step
                break
            timing["timing/generate_s"] += r.timing["generate_s"]
            timing["timing/env_step_s"] += r.timing["env_step_s"]
            batch, penalty_metrics = shape_rewards(
                cfg, build_batch(r.trajectories, run.tokenizer.pad_token_id, cfg.env.should_mask_flagged_samples),
                run.tokenizer)
            # Failed (and flagged) samples leave the loss and their group's statistics; thin groups are dropped.
            batch, gen_counts = mask_invalid_samples(batch)
            budget.count(r.trajectories)
            counts = add_counts(counts, gen_counts)
            metrics.update({**rollout_counts(r.trajectories), **r.metrics, **penalty_metrics})
            if not g.use_dynamic_sampling:
                break
            gathered = batch
            if not budget.trainable(int(batch.failed_b.sum()), len(batch)):  # too many failures: draw more prompts
                short += 1
                batch = batch.replace(valid_b=torch.zeros_like(batch.valid_b))  # no group of it is kept
            # DAPO: keep whole groups whose (unshaped) rewards differ; regenerate until the batch is full.
            try:
                batch, dyn_metrics = dynamic.add(batch, batch.group_ids_b, group_std_for_dynamic_sampling(batch))
            except DynamicSamplingExhausted:
                if not short:
                    raise
                batch = gathered  # the failures emptied the step: it is skipped below
                break
            metrics.update(dyn_metrics)
            if batch is not None:
                break
        if abandoned is not None:
            break
        if batch is None:
            out_of_data = True
            break
        metrics = {f"train/{k}": v for k, v in metrics.items()}
        metrics.update(counts)
        if stop_requested(run):  # a stop signal: abandon the step now rather than after training
            abandoned = step
            break

        # ---- the step budget: too few samples got a score -> the step is skipped, counted, logged --------
        if not budget.trainable(int(batch.failed_b.sum()), len(batch)):
            failure = skip_step(run, step, batch, metrics)
            state.current_epoch = prompts.epoch
            if failure is None:
                stop = stop_reason(run, step, None)
                if due_save(cfg, step, run.total_steps) or (stop and cfg.checkpointing.enabled):
                    save(run, step, state.metrics, None, run.loader.state_dict())
            continue
        budget.trained()

        # ---- 5. sample masks: invalid samples (failed, flagged), overlong filtering (stays in the baseline) --
        batch = batch.replace(sample_mask_b=initial_sample_mask(cfg, batch))

        # ---- 6. previous-policy, reference (and teacher) logprobs; each rank scores its share ----
        with timed(timing, "logprobs"):
            batch = step_logprobs(cfg, batch, run.logprob_engines, run.rank, run.world_size)
        if stop_requested(run):  # the last safe point before the weights change
            abandoned = step
            break

        # ---- 7. logprob-error masking, advantages, message penalties, clipping -------------------
        batch, adv_metrics = step_advantages(cfg, batch)
        metrics.update({f"train/{k}": v for k, v in {**adv_metrics, **step_summary(batch)}.items()})

        # ---- 8. train: one optimizer step per train_global_batch_size samples -------------------
        with timed(timing, "train"):
            results = train_step(cfg, run.policy, batch, run.rank, run.world_size, loss_fn=clipped_pg_loss_fn)

        # ---- 9. refit the generation engine, log, validate, checkpoint (a stop signal skips validation) --
        try:
            timing["timing/refit_s"] = run.generator.refit(run.policy)
        except RolloutError as err:  # generation ranks gone (colocated.enabled=false); step `step` is trained
            failure, timing["timing/refit_s"] = f"the refit after step {step} failed: {err}", 0.0
        record_step(state, batch, step)
        state.current_epoch = prompts.epoch
        timing["timing/step_s"] = time.perf_counter() - t_step
        metrics.update({**step_metrics(batch, results, timing["timing/step_s"]), **timing, **budget.metrics(),
                        **run.generator.memory, "train/epoch": state.current_epoch})
        end = end_step(run, step, batch, results, metrics, failure=failure,
                       validate=lambda at: validate(run, run.generator, run.val_envs, at),
                       loader_state=run.loader.state_dict)  # log, check, dump, validate, checkpoint
        stop, failure, last_metrics = end.stop, end.failure, end.metrics

    # ================================================================ the end
    if out_of_data:  # dynamic sampling can use up the epochs before max_num_steps
        stop = "out of training data"
    if abandoned is not None and failure is None:
        stop = signal_stop_message(run, abandoned)
    if stop or failure:
        run.logger.write(f"stopping at step {state.current_step}: {failure or stop}")
    return finish(run, out_of_data=out_of_data, loader_state=mark["loader"] if abandoned else run.loader.state_dict(),
                  failure=failure, metrics=last_metrics, rng=rng if abandoned else None)


if __name__ == "__main__":
    run_script(main)  # known errors as one `error:` line (GRPO_DEBUG=1: with the traceback); exit status
