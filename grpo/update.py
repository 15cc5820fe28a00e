"""From a scored rollout to an optimizer update: the phases both loops run after generation.

Each function is one phase of DESIGN.md's step, called under its banner in train_grpo.py and
train_async_grpo.py. They work on the step's global batch (every rank holds all of it; see
grpo/rollout.py) and fill it in place: a dict of per-sample ``[B]`` and per-token ``[B, T]`` tensors.
"""

from __future__ import annotations

import torch

from grpo.advantages import (
    apply_message_advantage_penalties, clip_advantages, compute_advantages, distillation_advantages,
)
from grpo.logprobs import mask_by_seq_logprob_error
from grpo.loss import calculate_kl, clipped_pg_loss
from grpo.metrics import global_valid_counts
from grpo.rewards import apply_reward_penalties, scale_rewards, shape_overlong_rewards
from grpo.rollout import build_batch, completion_spans, micro_batches, shard_batch
from grpo.sampling import overlong_filter_mask, select_rows


def build_engines(cfg, world_size: int, total_optimizer_steps: int, skip_ref: bool, rank: int):
    """The ZeRO-3 policy, the frozen reference (None when skipped) and the distillation teacher (None when off)."""
    from grpo import engines
    from grpo.toy import resolve_model_name

    policy = engines.build_policy_engine(cfg, world_size, total_optimizer_steps)
    reference = None if skip_ref else engines.build_reference_engine(cfg, world_size)
    teacher = None
    if cfg.on_policy_distillation.enabled:  # a frozen ZeRO-3 teacher sharing the policy's tokenizer
        name = resolve_model_name(cfg.on_policy_distillation.teacher_model_name, rank)
        teacher = engines.build_reference_engine(cfg.policy.model_copy(update={"model_name": name}), world_size)
    return policy, reference, teacher


# ---- phase 3 ---------------------------------------------------------------------------------------
def rollout_to_batch(cfg, rollout: dict, pad_id: int) -> tuple[dict, dict]:
    """The flat batch of a scored rollout, with reward penalties, scaling and overlong shaping applied.

    rewards = shape(scale(penalise(raw_rewards))); raw_rewards are kept for logging. Returns (batch, metrics).
    """
    g = cfg.grpo
    batch = build_batch(rollout["outputs"], pad_id)
    batch["prompt_ids"] = torch.tensor(rollout["prompt_idx"], dtype=torch.long)
    batch["raw_rewards"] = torch.tensor(rollout["rewards"], dtype=torch.float32)
    rewards_b, flags, penalty_metrics = apply_reward_penalties(
        batch["raw_rewards"], rollout["texts"], rollout["completion_ids"], cfg.reward_penalties)
    rewards_b = scale_rewards(rewards_b, g.reward_scaling)
    batch["rewards"] = shape_overlong_rewards(rewards_b, batch["response_lengths"], batch["truncated"],
                                              g.reward_shaping)
    batch["malformed_thinking"] = flags.get("malformed_think_tag", torch.zeros(len(rewards_b), dtype=torch.bool))
    if rollout["components"] is not None:
        batch["reward_components"] = rollout["components"]
    return batch, {**rollout.get("metrics", {}), **penalty_metrics}


# ---- phase 5 ---------------------------------------------------------------------------------------
def initial_sample_mask(cfg, batch: dict) -> torch.Tensor:
    """1 per sample, 0 for truncated samples under ``grpo.overlong_filtering`` (they stay in the baseline)."""
    mask_b = torch.ones(len(batch["rewards"]))
    return overlong_filter_mask(batch["truncated"], mask_b) if cfg.grpo.overlong_filtering else mask_b


# ---- phase 6 ---------------------------------------------------------------------------------------
def step_logprobs(cfg, batch: dict, engines: dict, rank: int, world_size: int) -> None:
    """prev_logprobs / ref_logprobs / teacher_logprobs ``[B, T]`` under the current weights.

    ``engines`` maps those keys to an engine, or to None when the logprobs are skipped
    (`grpo.config.resolve_skip_flags`, no distillation). Each rank scores its share; all gather.
    """
    from grpo.phases import gather_logprobs

    p = cfg.policy
    for key, engine in engines.items():
        if engine is not None:
            batch[key] = gather_logprobs(engine, batch, rank, world_size, p.generation.temperature,
                                         p.logprob_batch_size, p.logprob_chunk_size)


# ---- phase 7 ---------------------------------------------------------------------------------------
def step_advantages(cfg, batch: dict) -> dict:
    """Sequence logprob-error masking, then advantages ``[B, T]``: the estimator (with the reward KL for
    Reinforce++), the distillation term, message-level penalties, clipping. Returns the masking metrics.
    With ``grpo.calculate_advantages_on_gpu`` (and CUDA) the math runs on the GPU; the batch stays on the
    CPU."""
    if cfg.grpo.calculate_advantages_on_gpu and torch.cuda.is_available():
        on_gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        metrics = _advantages(cfg, on_gpu)
        batch["sample_mask"], batch["advantages"] = on_gpu["sample_mask"].cpu(), on_gpu["advantages"].cpu()
        return metrics
    return _advantages(cfg, batch)


def _advantages(cfg, batch: dict) -> dict:
    g, loss_cfg = cfg.grpo, cfg.loss_fn
    metrics = {}
    if g.seq_logprob_error_threshold is not None:
        batch["sample_mask"], metrics = mask_by_seq_logprob_error(
            batch["generation_logprobs"], batch["prev_logprobs"], batch["token_mask"], batch["sample_mask"],
            batch["rewards"], g.seq_logprob_error_threshold)
    kl_bt = None
    if loss_cfg.use_kl_in_reward:
        kl_bt = calculate_kl(batch["prev_logprobs"], batch["ref_logprobs"], loss_cfg.reference_policy_kl_type,
                             loss_cfg.kl_input_clamp_value, loss_cfg.kl_output_clamp_value)
    adv_bt = compute_advantages(
        g.adv_estimator.name, prompt_ids=batch["prompt_ids"], rewards=batch["rewards"],
        valid_mask=torch.ones_like(batch["rewards"]), token_mask=batch["token_mask"], cfg=g.adv_estimator,
        reward_components=batch.get("reward_components"), kl_bt=kl_bt, kl_coef=loss_cfg.reference_policy_kl_penalty)
    if "teacher_logprobs" in batch:
        student_lp = batch.get("prev_logprobs", batch["generation_logprobs"])
        adv_bt = adv_bt + distillation_advantages(student_lp, batch["teacher_logprobs"], batch["token_mask"],
                                                  cfg.on_policy_distillation.kl_coef)
    spans = completion_spans(batch["token_mask"], {"malformed_thinking": batch["malformed_thinking"]})
    adv_bt = apply_message_advantage_penalties(adv_bt, spans, "malformed_thinking", g.malformed_thinking_advantage)
    batch["advantages"] = clip_advantages(adv_bt, g.advantage_clip_low, g.advantage_clip_high)
    return metrics


# ---- phase 8 ---------------------------------------------------------------------------------------
TRAIN_KEYS = ("input_ids", "attention_mask", "token_mask", "sample_mask", "advantages", "generation_logprobs",
              "prev_logprobs", "ref_logprobs")


def train_step(cfg, policy, batch: dict, rank: int, world_size: int) -> list[dict]:
    """One optimizer step per ``policy.train_global_batch_size`` samples of the batch.

    Each rank trains its shard in micro-batches; the loss is `clipped_pg_loss` normalised by the
    global valid-token / valid-sequence counts of the optimizer step (`global_valid_counts`), so the
    update does not depend on micro-batching or world size. Without previous-policy logprobs
    (``force_on_policy_ratio``) the training forward's own, detached, stand in.
    """
    from grpo.engines import train_on_batch

    p = cfg.policy
    train_batch = {k: batch[k] for k in TRAIN_KEYS if k in batch}
    results = []
    for start in range(0, len(batch["rewards"]), p.train_global_batch_size):
        mine = shard_batch(select_rows(train_batch, slice(start, start + p.train_global_batch_size)), rank,
                           world_size)
        n_tokens, n_seqs = global_valid_counts(mine["token_mask"], mine["sample_mask"])

        def loss_closure(logprobs_bt, mb, n_tokens=n_tokens, n_seqs=n_seqs):
            prev = mb["prev_logprobs"] if "prev_logprobs" in mb else logprobs_bt.detach()
            return clipped_pg_loss(logprobs_bt, prev, mb["advantages"], mb["token_mask"], mb["sample_mask"],
                                   cfg.loss_fn, ref_logprobs=mb.get("ref_logprobs"),
                                   generation_logprobs=mb["generation_logprobs"],
                                   global_valid_tokens=n_tokens, global_valid_seqs=n_seqs)

        results.append(train_on_batch(policy, micro_batches(mine, p.train_micro_batch_size), loss_closure,
                                      temperature=p.generation.temperature))
    return results


# ---- phase 9 ---------------------------------------------------------------------------------------
def record_step(state, batch: dict, step: int) -> None:
    """Advance the loop counters saved with each checkpoint (GRPOSaveState)."""
    state.current_step = step
    state.total_steps += 1
    state.consumed_samples += len(batch["rewards"])
    state.total_valid_tokens += int((batch["token_mask"] * batch["sample_mask"][:, None]).sum())


def validate_save_or_stop(cfg, step: int, total_steps: int, state, step_metrics: dict, validate, save, logger,
                          deadline=None):
    """Validation on ``val_period`` (and at the end), checkpoint on ``save_period`` (and at the end),
    early stop on ``stop_at_validation_metric``, and a checkpoint and stop when ``deadline`` (a
    `grpo.checkpoint.SaveDeadline`) leaves no time for another step. Returns the stop message, or None
    to go on."""
    from grpo.metrics import validation_early_stop

    g = cfg.grpo
    last = step == total_steps
    val_metrics = None
    if (g.val_period > 0 and step % g.val_period == 0) or (last and g.val_at_end):
        val_metrics = validate(step)
        logger.progress(step, {**step_metrics, **{f"val/{k}": v for k, v in val_metrics.items()}})
    state.metrics = {k: float(v) for k, v in step_metrics.items() if isinstance(v, (int, float))}
    if val_metrics is not None:
        state.metrics.update({f"val/{k}": float(v) for k, v in val_metrics.items() if isinstance(v, (int, float))})
    saved = cfg.checkpointing.enabled and (step % cfg.checkpointing.save_period == 0 or last)
    if saved:
        save(step, val_metrics)
    message = None
    if val_metrics is not None and g.stop_at_validation_metric is not None:
        stop, _, text = validation_early_stop(val_metrics, g.stop_at_validation_metric,
                                              g.stop_at_validation_threshold)
        message = text if stop else None
    if message is None and not last and deadline is not None and deadline.due():
        message = (f"checkpointing.checkpoint_must_save_by={deadline.spec}: no time left for another step "
                   f"(the longest took {deadline.longest_step_s:.0f} s); rerun the same command to resume")
    if message is None:
        return None
    logger.write(message)
    if cfg.checkpointing.enabled and not saved:
        save(step, val_metrics)
    return message
