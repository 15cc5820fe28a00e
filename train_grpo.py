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

from grpo.config import ConfigError, MasterConfig, load_config, resolve_skip_flags

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


def load_run_config(argv=None) -> tuple[argparse.Namespace, MasterConfig]:
    """Parse the command line and validate the config: fails (exit 2) before torch is imported."""
    args, overrides = parse_args(argv)
    if args.config is None:
        print(f"No --config given: running the built-in CPU demo ({os.path.relpath(DEFAULT_CONFIG)})", flush=True)
        args.config = DEFAULT_CONFIG
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    return args, cfg


def main(argv=None) -> None:
    args, cfg = load_run_config(argv)

    # Heavy imports only once the config is known to be good.
    import warnings

    # torch.distributed deprecation notices that DeepSpeed's collectives trigger on every step.
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*torch.distributed.*")
    import torch

    from grpo import engines
    from grpo.advantages import (
        apply_message_advantage_penalties, baseline_and_std_per_prompt, clip_advantages, compute_advantages,
        distillation_advantages,
    )
    from grpo.checkpoint import CheckpointManager, GRPOSaveState
    from grpo.data import PromptDataset, PromptFormatter, build_dataloader, load_rows
    from grpo.envs import build_env
    from grpo.logging import MetricsLogger
    from grpo.logprobs import mask_by_seq_logprob_error
    from grpo.loss import calculate_kl, clipped_pg_loss
    from grpo.metrics import global_valid_counts, validation_early_stop
    from grpo.rewards import apply_reward_penalties, scale_rewards, shape_overlong_rewards
    from grpo.phases import (
        build_generation_backend, gather_logprobs, generate_and_score, load_tokenizer, rollout_metrics,
        run_validation, tokens_per_second,
    )
    from grpo.rollout import build_batch, completion_spans, micro_batches, select, shard_batch
    from grpo.sampling import DynamicSamplingCache, overlong_filter_mask
    from grpo.toy import resolve_model_name

    rank, local_rank, world_size, device = engines.init_distributed()
    cfg.policy.model_name = resolve_model_name(cfg.policy.model_name, rank)  # "toy:..." models build locally
    g, loss_cfg = cfg.grpo, cfg.loss_fn
    skip_prev, skip_ref = resolve_skip_flags(cfg)
    G = g.num_generations_per_prompt

    # ================================================================ setup: data, env, engines
    tokenizer = load_tokenizer(cfg.policy)
    formatter = PromptFormatter(tokenizer, cfg.data, cfg.policy.tokenizer.chat_template)
    train_rows = load_rows(cfg.data, "train", seed=g.seed)
    val_rows = load_rows(cfg.data, "val", seed=g.seed)
    train_ds = PromptDataset(train_rows, formatter, cfg.data.max_input_seq_length)
    val_ds = PromptDataset(val_rows, formatter, cfg.data.max_input_seq_length)
    prompts_per_gen_batch = int(g.num_prompts_per_step * (g.batch_multiplier if g.use_dynamic_sampling else 1))
    loader = build_dataloader(train_ds, batch_size=prompts_per_gen_batch, shuffle=cfg.data.shuffle, seed=g.seed)
    env = build_env(cfg.env, cfg.data)

    steps_per_epoch = len(loader)
    if steps_per_epoch == 0:
        raise SystemExit(f"error: {len(train_ds)} training prompts < {prompts_per_gen_batch} prompts per step")
    total_steps = min(g.max_num_steps, g.max_num_epochs * steps_per_epoch)
    samples_per_step = g.num_prompts_per_step * G
    opt_steps_per_step = samples_per_step // cfg.policy.train_global_batch_size
    policy = engines.build_policy_engine(cfg, world_size, total_steps * opt_steps_per_step)
    reference = None if skip_ref else engines.build_reference_engine(cfg, world_size)
    teacher = None
    if cfg.on_policy_distillation.enabled:  # a frozen ZeRO-3 teacher sharing the policy's tokenizer
        teacher_name = resolve_model_name(cfg.on_policy_distillation.teacher_model_name, rank)
        teacher = engines.build_reference_engine(cfg.policy.model_copy(update={"model_name": teacher_name}), world_size)
    generator = build_generation_backend(cfg, tokenizer, policy, device)
    ckpt = CheckpointManager(cfg.checkpointing, rank)

    # ================================================================ resume
    state = GRPOSaveState()
    latest = ckpt.latest() if cfg.checkpointing.enabled and cfg.checkpointing.resume else None
    if args.export_hf is not None and latest is None:
        raise SystemExit(f"error: --export-hf: no checkpoint in {cfg.checkpointing.checkpoint_dir}")
    if latest is not None:
        ckpt.clean_partial()
        state, loader_state, _ = ckpt.load(latest, policy)
        if loader_state is not None:
            loader.load_state_dict(loader_state)
    if args.export_hf is not None:
        engines.export_hf(policy, args.export_hf, tokenizer)
        return
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
        export = (lambda d: engines.export_hf(policy, d, tokenizer)) if cfg.checkpointing.save_consolidated else None
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

    val_metrics = None
    if g.val_at_start and state.current_step == 0:
        val_metrics = validate(0)

    # ================================================================ the loop
    stop_reason = None
    while state.current_step < total_steps:
        step = state.current_step + 1
        t_step = time.perf_counter()
        timing: dict[str, float] = {}
        step_metrics: dict[str, float] = {}

        # ---- 1-4. generate, score, penalties / scaling / shaping, dynamic sampling -------------
        dyn = DynamicSamplingCache(g.num_prompts_per_step, G, g.dynamic_sampling_max_gen_batches)
        batch = None
        for gen_batch in itertools.count():
            prompts = next_prompts()
            if prompts is None:
                break
            rollout = generate_and_score(cfg, generator, env, prompts, step, gen_batch, rank, world_size, timing)
            b = build_batch(rollout["outputs"], tokenizer.pad_token_id)
            b["prompt_ids"] = torch.tensor(rollout["prompt_idx"], dtype=torch.long)
            b["raw_rewards"] = torch.tensor(rollout["rewards"], dtype=torch.float32)
            rewards_b, flags, penalty_metrics = apply_reward_penalties(
                b["raw_rewards"], rollout["texts"], rollout["completion_ids"], cfg.reward_penalties)
            rewards_b = scale_rewards(rewards_b, g.reward_scaling)
            b["rewards"] = shape_overlong_rewards(rewards_b, b["response_lengths"], b["truncated"], g.reward_shaping)
            b["malformed_thinking"] = flags.get("malformed_think_tag", torch.zeros(len(rewards_b), dtype=torch.bool))
            if rollout["components"] is not None:
                b["reward_components"] = rollout["components"]
            step_metrics.update({f"train/{k}": v for k, v in {**rollout["metrics"], **penalty_metrics}.items()})
            if not g.use_dynamic_sampling:
                batch = b
                break
            # DAPO: keep whole groups whose rewards differ; regenerate until the batch is full.
            _, std_b = baseline_and_std_per_prompt(b["prompt_ids"], b["rewards"], torch.ones(len(b["rewards"])),
                                                   leave_one_out=False)
            batch, ds_metrics = dyn.add(b, b["prompt_ids"], std_b)
            step_metrics.update({f"train/{k}": v for k, v in ds_metrics.items()})
            if batch is not None:
                batch["prompt_ids"] = batch.pop("group_ids")
                break
        if batch is None:
            stop_reason = "out of training data"
            break
        B = len(batch["rewards"])

        # ---- 5. overlong filtering and sample masks (filtered samples stay in the baseline) ------
        batch["sample_mask"] = torch.ones(B)
        if g.overlong_filtering:
            batch["sample_mask"] = overlong_filter_mask(batch["truncated"], batch["sample_mask"])

        # ---- 6. previous-policy and reference logprobs (each rank computes its shard) ------------
        t = time.perf_counter()
        mb_size = cfg.policy.logprob_batch_size
        temp = cfg.policy.generation.temperature
        if not skip_prev:
            batch["prev_logprobs"] = gather_logprobs(policy, batch, rank, world_size, temp, mb_size,
                                                     cfg.policy.logprob_chunk_size)
        if not skip_ref:
            batch["ref_logprobs"] = gather_logprobs(reference, batch, rank, world_size, temp, mb_size,
                                                    cfg.policy.logprob_chunk_size)
        if teacher is not None:
            batch["teacher_logprobs"] = gather_logprobs(teacher, batch, rank, world_size, temp, mb_size,
                                                        cfg.policy.logprob_chunk_size)
        timing["timing/logprobs_s"] = time.perf_counter() - t

        # ---- 7. logprob-error masking, advantages, message penalties, clipping -------------------
        if g.seq_logprob_error_threshold is not None:
            batch["sample_mask"], mask_metrics = mask_by_seq_logprob_error(
                batch["generation_logprobs"], batch["prev_logprobs"], batch["token_mask"], batch["sample_mask"],
                batch["rewards"], g.seq_logprob_error_threshold)
            step_metrics.update({f"train/{k}": v for k, v in mask_metrics.items()})
        kl_bt = None
        if loss_cfg.use_kl_in_reward:
            kl_bt = calculate_kl(batch["prev_logprobs"], batch["ref_logprobs"], loss_cfg.reference_policy_kl_type,
                                 loss_cfg.kl_input_clamp_value, loss_cfg.kl_output_clamp_value)
        adv_cfg = g.adv_estimator
        batch["advantages"] = compute_advantages(
            adv_cfg.name, prompt_ids=batch["prompt_ids"], rewards=batch["rewards"], valid_mask=torch.ones(B),
            token_mask=batch["token_mask"], cfg=adv_cfg, reward_components=batch.get("reward_components"),
            kl_bt=kl_bt, kl_coef=loss_cfg.reference_policy_kl_penalty)
        if teacher is not None:
            student_lp = batch.get("prev_logprobs", batch["generation_logprobs"])
            batch["advantages"] = batch["advantages"] + distillation_advantages(
                student_lp, batch["teacher_logprobs"], batch["token_mask"], cfg.on_policy_distillation.kl_coef)
        batch["advantages"] = apply_message_advantage_penalties(
            batch["advantages"], completion_spans(batch["token_mask"], {"malformed_thinking": batch["malformed_thinking"]}),
            "malformed_thinking", g.malformed_thinking_advantage)
        batch["advantages"] = clip_advantages(batch["advantages"], g.advantage_clip_low, g.advantage_clip_high)

        # ---- 8. train: one optimizer step per train_global_batch_size samples -------------------
        t = time.perf_counter()
        train_keys = ("input_ids", "attention_mask", "token_mask", "sample_mask", "advantages",
                      "generation_logprobs", "prev_logprobs", "ref_logprobs")
        train_batch = {k: batch[k] for k in train_keys if k in batch}
        results = []
        gbs = cfg.policy.train_global_batch_size
        for start in range(0, B, gbs):
            mine = shard_batch(select(train_batch, slice(start, start + gbs)), rank, world_size)
            n_tokens, n_seqs = global_valid_counts(mine["token_mask"], mine["sample_mask"])

            def loss_closure(logprobs_bt, mb, n_tokens=n_tokens, n_seqs=n_seqs):
                prev = mb["prev_logprobs"] if "prev_logprobs" in mb else logprobs_bt.detach()
                return clipped_pg_loss(logprobs_bt, prev, mb["advantages"], mb["token_mask"], mb["sample_mask"],
                                       loss_cfg, ref_logprobs=mb.get("ref_logprobs"),
                                       generation_logprobs=mb["generation_logprobs"],
                                       global_valid_tokens=n_tokens, global_valid_seqs=n_seqs)

            results.append(engines.train_on_batch(policy, micro_batches(mine, cfg.policy.train_micro_batch_size),
                                                  loss_closure, temperature=temp))
        timing["timing/train_s"] = time.perf_counter() - t

        # ---- 9. refit the generation engine, log, validate, checkpoint --------------------------
        timing["timing/refit_s"] = generator.refit(policy)
        state.current_step = step
        state.total_steps += 1
        state.consumed_samples += B
        n_valid_tokens = int((batch["token_mask"] * batch["sample_mask"][:, None]).sum())
        state.total_valid_tokens += n_valid_tokens
        timing["timing/step_s"] = time.perf_counter() - t_step
        step_metrics.update(rollout_metrics(batch, results))
        step_metrics.update(timing)
        step_metrics.update(getattr(generator, "memory", {}))  # memory/* per phase (vLLM on GPU)
        step_metrics["train/tokens_per_s"] = tokens_per_second(batch, timing["timing/step_s"])
        step_metrics["train/epoch"] = state.current_epoch
        logger.log(step_metrics, step)
        logger.progress(step, step_metrics)

        last = step == total_steps
        val_metrics = None
        if (g.val_period > 0 and step % g.val_period == 0) or (last and g.val_at_end):
            val_metrics = validate(step)
            logger.progress(step, {**step_metrics, **{f"val/{k}": v for k, v in val_metrics.items()}})
        state.metrics = {k: float(v) for k, v in step_metrics.items() if isinstance(v, (int, float))}
        if val_metrics is not None:
            state.metrics.update({f"val/{k}": float(v) for k, v in val_metrics.items()
                                  if isinstance(v, (int, float))})
        if cfg.checkpointing.enabled and (step % cfg.checkpointing.save_period == 0 or last):
            save(step, val_metrics)
        if val_metrics is not None and g.stop_at_validation_metric is not None:
            stop, value, message = validation_early_stop(val_metrics, g.stop_at_validation_metric,
                                                         g.stop_at_validation_threshold)
            if stop:
                logger.write(message)
                stop_reason = message
                if cfg.checkpointing.enabled and step % cfg.checkpointing.save_period != 0 and not last:
                    save(step, val_metrics)
                break

    # ================================================================ the end
    if stop_reason == "out of training data":  # dynamic sampling can use up the epochs before max_num_steps
        logger.write(f"stopping at step {state.current_step}: {stop_reason}")
        if cfg.checkpointing.enabled and state.current_step % cfg.checkpointing.save_period:
            save(state.current_step, None)
    if cfg.checkpointing.enabled:  # the trained policy as consolidated HF safetensors (from_pretrained loads it)
        engines.export_hf(policy, os.path.join(cfg.checkpointing.checkpoint_dir, "hf_final"), tokenizer)
    logger.write(f"done: {state.current_step} steps" + (f", last val/reward_mean {state.val_reward:.4g}"
                                                         if state.val_reward > -99999999.0 else ""))
    logger.close()
    env.close()
    generator.close()
    engines.shutdown()


if __name__ == "__main__":
    main()
