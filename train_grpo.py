#!/usr/bin/env python
"""Synchronous GRPO on DeepSpeed ZeRO-3: read top to bottom, this file is the algorithm.

    python train_grpo.py                                  # the CPU demo (configs/cpu_demo.yaml)
    python train_grpo.py --config configs/X.yaml grpo.num_prompts_per_step=8 loss_fn.ratio_clip_max=0.28
    torchrun --nproc_per_node 2 train_grpo.py --config ...
    deepspeed --num_gpus 8 train_grpo.py --config ...
    accelerate launch --config_file launch/accelerate_zero3.yaml train_grpo.py --config ...

One step: take prompts -> generate G completions each -> score -> penalties, scaling, shaping ->
per-prompt baselines (dynamic sampling may ask for more prompts) -> overlong filtering ->
previous-policy and reference logprobs -> logprob-error masking, advantages, clipping -> train with
the loss normalised by the step's global valid-token count -> refit the generation engine ->
validate, checkpoint, log. Every rank holds the whole rollout of a step; each trains on its shard.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

from grpo.config import MasterConfig, cluster_mismatch, resolve_skip_flags
from grpo.config_load import ConfigError, load_config

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "cpu_demo.yaml")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="YAML run config (default: the CPU demo)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    p.add_argument("--export-hf", default=None, metavar="DIR",
                   help="load the latest checkpoint, export consolidated HF safetensors to DIR, and exit")
    args, overrides = p.parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)} (overrides are dotted.key=value)")
    return args, overrides


def load_run_config(argv=None, default_config: str = DEFAULT_CONFIG,
                    asynchronous: bool = False) -> tuple[argparse.Namespace, MasterConfig]:
    """Parse the command line and validate the config: fails (exit 2) before torch is imported.

    ``asynchronous``: the caller is train_async_grpo.py, which runs exactly the configs with
    ``grpo.async_grpo.enabled=true`` (this script runs the others).
    """
    args, overrides = parse_args(argv)
    if args.config is None:
        print(f"No --config given: running the built-in {'async ' if asynchronous else ''}CPU demo "
              f"({os.path.relpath(default_config)})", flush=True)
        args.config = default_config
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if cfg.grpo.async_grpo.enabled != asynchronous and args.export_hf is None:
        wrong = ("train_async_grpo.py needs grpo.async_grpo.enabled=true (train_grpo.py is the synchronous loop)"
                 if asynchronous else
                 "grpo.async_grpo.enabled=true: run train_async_grpo.py (train_grpo.py is the synchronous loop)")
        print(f"error: invalid config:\n  {wrong}", file=sys.stderr)
        sys.exit(2)
    return args, cfg


def main(argv=None) -> str | None:
    """Train; return None, or the error message of a run that cannot go on (the script exits 1 with it)."""
    args, cfg = load_run_config(argv)
    t_run = time.monotonic()  # checkpointing.checkpoint_must_save_by counts from here

    # Heavy imports only once the config is known to be good.
    import warnings

    # torch.distributed deprecation notices that DeepSpeed's collectives trigger on every step.
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*torch.distributed.*")
    warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata calls a deprecated torch API
    import torch

    if not torch.cuda.is_available():  # DeepSpeed would otherwise warn that it falls back to its CPU accelerator
        os.environ.setdefault("DS_ACCELERATOR", "cpu")

    from grpo import engines, weights
    from grpo.advantages import baseline_and_std_per_prompt
    from grpo.checkpoint import CheckpointManager, GRPOSaveState, SaveDeadline
    from grpo.data import build_dataloader
    from grpo.envs import build_env
    from grpo.logging import MetricsLogger
    from grpo.phases import (
        build_datasets, build_generation_backend, generate_and_score, load_tokenizer, rollout_metrics,
        run_validation, tokens_per_second,
    )
    from grpo.sampling import DynamicSamplingCache
    from grpo.toy import resolve_model_name
    from grpo.update import (
        build_engines, initial_sample_mask, record_step, rollout_to_batch, step_advantages, step_logprobs,
        train_step, validate_save_or_stop,
    )

    rank, local_rank, world_size, device = engines.init_distributed()
    if (mismatch := cluster_mismatch(cfg.cluster, world_size, engines.local_world_size())) is not None:
        return mismatch
    cfg.policy.model_name = resolve_model_name(cfg.policy.model_name, rank)  # "toy:..." models build locally
    g = cfg.grpo
    skip_prev, skip_ref = resolve_skip_flags(cfg)

    # ================================================================ setup: data, env, engines
    tokenizer = load_tokenizer(cfg.policy)
    train_rows, train_ds, val_ds = build_datasets(cfg, tokenizer)
    prompts_per_gen_batch = int(g.num_prompts_per_step * (g.batch_multiplier if g.use_dynamic_sampling else 1))
    loader = build_dataloader(train_ds, batch_size=prompts_per_gen_batch, shuffle=cfg.data.shuffle, seed=g.seed)
    env = build_env(cfg.env, cfg.data)
    if len(loader) == 0:
        return f"error: {len(train_ds)} training prompts < {prompts_per_gen_batch} prompts per step"
    total_steps = min(g.max_num_steps, g.max_num_epochs * len(loader))
    opt_steps_per_step = g.num_prompts_per_step * g.num_generations_per_prompt // cfg.policy.train_global_batch_size
    policy, reference, teacher = build_engines(cfg, world_size, total_steps * opt_steps_per_step, skip_ref, rank)
    logprob_engines = {"prev_logprobs": None if skip_prev else policy, "ref_logprobs": reference,
                       "teacher_logprobs": teacher}
    generator = build_generation_backend(cfg, tokenizer, policy, device)
    ckpt = CheckpointManager(cfg.checkpointing, rank)

    # ================================================================ resume
    state = GRPOSaveState()
    latest = ckpt.latest() if cfg.checkpointing.enabled and cfg.checkpointing.resume else None
    if args.export_hf is not None and latest is None:
        return f"error: --export-hf: no checkpoint in {cfg.checkpointing.checkpoint_dir}"
    if latest is not None:
        ckpt.clean_partial()
        state, loader_state, _ = ckpt.load(latest, policy)
        if loader_state is not None:
            loader.load_state_dict(loader_state)
    if args.export_hf is not None:
        weights.export_hf(policy, args.export_hf, tokenizer)
        return None
    logger = MetricsLogger(cfg.logger, rank, cfg.model_dump(mode="json"), total_steps, state.current_step)
    if latest is not None:
        logger.write(f"resumed from {latest} (step {state.current_step}, epoch {state.current_epoch})")
    logger.write(f"grpo-ds: {world_size} rank(s), {len(train_ds)} train / {len(val_ds)} val prompts "
                 f"({train_ds.num_filtered} over data.max_input_seq_length filtered, "
                 f"{train_rows.report.num_skipped} malformed rows skipped), {total_steps} steps, "
                 f"reference {'skipped' if skip_ref else 'on'}")
    generator.refit(policy)

    def validate(step: int) -> dict:
        metrics, samples = run_validation(cfg, generator, env, val_ds, rank, world_size)
        logger.log({f"val/{k}": v for k, v in metrics.items()}, step)
        logger.print_samples(samples, cfg.logger.num_val_samples_to_print)
        return metrics

    def save(step: int, val_metrics: dict | None) -> None:
        if val_metrics is not None:
            state.val_reward = float(val_metrics["reward_mean"])
        export = (lambda d: weights.export_hf(policy, d, tokenizer)) if cfg.checkpointing.save_consolidated else None
        ckpt.save(step, policy, state, loader.state_dict(), export_fn=export)

    # Prompt batches across epochs; the StatefulDataLoader resumes mid-epoch from its saved state.
    batch_iter = iter(loader)

    def next_prompts():
        nonlocal batch_iter
        for _ in range(2):
            try:
                return next(batch_iter)
            except StopIteration:
                state.current_epoch += 1
                if state.current_epoch >= g.max_num_epochs:
                    return None
                batch_iter = iter(loader)
        return None

    if g.val_at_start and state.current_step == 0:
        validate(0)

    # ================================================================ the loop
    stop_reason = None
    deadline = SaveDeadline(cfg.checkpointing.checkpoint_must_save_by, started_at=t_run)
    while state.current_step < total_steps:
        step = state.current_step + 1
        t_step = time.perf_counter()
        timing: dict[str, float] = {}
        step_metrics: dict = {}

        # ---- 1-4. generate, score, penalties / scaling / shaping, dynamic sampling -------------
        dynamic = DynamicSamplingCache(g.num_prompts_per_step, g.num_generations_per_prompt,
                                       g.dynamic_sampling_max_gen_batches)
        batch = None
        for gen_batch in itertools.count():
            prompts = next_prompts()
            if prompts is None:
                break
            rollout = generate_and_score(cfg, generator, env, prompts, step, gen_batch, rank, world_size, timing)
            batch, rollout_stats = rollout_to_batch(cfg, rollout, tokenizer.pad_token_id)
            step_metrics.update({f"train/{k}": v for k, v in rollout_stats.items()})
            if not g.use_dynamic_sampling:
                break
            # DAPO: keep whole groups whose rewards differ; regenerate until the batch is full.
            _, std_b = baseline_and_std_per_prompt(batch["prompt_ids"], batch["rewards"],
                                                   torch.ones(len(batch["rewards"])), leave_one_out=False)
            batch, dyn_metrics = dynamic.add(batch, batch["prompt_ids"], std_b)
            step_metrics.update({f"train/{k}": v for k, v in dyn_metrics.items()})
            if batch is not None:
                batch["prompt_ids"] = batch.pop("group_ids")
                break
        if batch is None:
            stop_reason = "out of training data"
            break

        # ---- 5. overlong filtering and sample masks (filtered samples stay in the baseline) ------
        batch["sample_mask"] = initial_sample_mask(cfg, batch)

        # ---- 6. previous-policy, reference (and teacher) logprobs; each rank scores its share ----
        t = time.perf_counter()
        step_logprobs(cfg, batch, logprob_engines, rank, world_size)
        timing["timing/logprobs_s"] = time.perf_counter() - t

        # ---- 7. logprob-error masking, advantages, message penalties, clipping -------------------
        step_metrics.update({f"train/{k}": v for k, v in step_advantages(cfg, batch).items()})

        # ---- 8. train: one optimizer step per train_global_batch_size samples -------------------
        t = time.perf_counter()
        results = train_step(cfg, policy, batch, rank, world_size)
        timing["timing/train_s"] = time.perf_counter() - t

        # ---- 9. refit the generation engine, log, validate, checkpoint --------------------------
        timing["timing/refit_s"] = generator.refit(policy)
        record_step(state, batch, step)
        timing["timing/step_s"] = time.perf_counter() - t_step
        step_metrics.update(rollout_metrics(batch, results))
        step_metrics.update(timing)
        step_metrics.update(getattr(generator, "memory", {}))  # memory/* per phase (vLLM on GPU)
        step_metrics["train/tokens_per_s"] = tokens_per_second(batch, timing["timing/step_s"])
        step_metrics["train/epoch"] = state.current_epoch
        logger.log(step_metrics, step)
        logger.progress(step, step_metrics)
        stop_reason = validate_save_or_stop(cfg, step, total_steps, state, step_metrics, validate, save, logger,
                                            deadline)
        if stop_reason is not None:
            break

    # ================================================================ the end
    if stop_reason == "out of training data":  # dynamic sampling can use up the epochs before max_num_steps
        logger.write(f"stopping at step {state.current_step}: {stop_reason}")
        if cfg.checkpointing.enabled and state.current_step % cfg.checkpointing.save_period:
            save(state.current_step, None)
    if cfg.checkpointing.enabled and not deadline.reached:  # the trained policy, consolidated (from_pretrained)
        weights.export_hf(policy, os.path.join(cfg.checkpointing.checkpoint_dir, "hf_final"), tokenizer)
    logger.write(f"done: {state.current_step} steps" + (f", last val/reward_mean {state.val_reward:.4g}"
                                                         if state.val_reward > -99999999.0 else ""))
    logger.close()
    env.close()
    generator.close()
    engines.shutdown()
    return None


if __name__ == "__main__":
    stopped = main()
    from grpo.engines import exit_process

    exit_process(stopped)  # without interpreter finalization: see its docstring
