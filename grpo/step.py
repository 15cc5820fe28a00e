"""The phases of a GRPO step, after the rollout: both loops call them under their banners, in this order.

    3. shape_rewards        penalties -> scaling -> overlong shaping          (TrainBatch.rewards_b)
    5. initial_sample_mask  overlong filtering, the environments' mask_sample  (TrainBatch.sample_mask_b)
    6. step_logprobs        previous-policy, reference, teacher logprobs       (..._logprobs_bt)
    7. step_advantages      logprob-error masking, estimator + distillation, message penalties, clipping
    8. train_step           one optimizer step per policy.train_global_batch_size samples
    9. record_step, due_validation, due_save, step_metrics

Each function takes the step's whole `grpo.batch.TrainBatch` (every rank holds all of it) and returns
a new one, or what it measured; nothing is filled in place.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from grpo.advantages import (
    apply_message_advantage_penalties, clip_advantages, compute_advantages, distillation_advantages,
)
from grpo.batch import TrainBatch
from grpo.logprobs import mask_by_seq_logprob_error
from grpo.loss import calculate_kl, clipped_pg_loss
from grpo.metrics import aggregate_rollout_metrics, global_valid_counts
from grpo.rewards import apply_reward_penalties, scale_rewards, shape_overlong_rewards
from grpo.rollout import all_gather_objects, rank_slice
from grpo.sampling import overlong_filter_mask


# ---- phase 3 ---------------------------------------------------------------------------------------
def shape_rewards(cfg, batch: TrainBatch, trajectories: list) -> tuple[TrainBatch, dict]:
    """rewards = shape(scale(penalise(raw_rewards))); raw rewards stay for logging. A sample whose completion
    has malformed think tags (``reward_penalties.penalize_malformed_think_tag``) gets the flag
    ``malformed_thinking`` on its generated messages. Returns (batch, penalty metrics)."""
    g = cfg.grpo
    texts = [t.completion_text() for t in trajectories]
    ids = [t.completion_ids() for t in trajectories]
    rewards_b, flags, metrics = apply_reward_penalties(batch.raw_rewards_b, texts, ids, cfg.reward_penalties)
    rewards_b = scale_rewards(rewards_b, g.reward_scaling)
    rewards_b = shape_overlong_rewards(rewards_b, batch.response_lengths_b, batch.truncated_b, g.reward_shaping)
    spans = batch.message_spans
    if "malformed_think_tag" in flags:
        spans = [[(s, e, tuple(sorted({*f, "malformed_thinking"}))) if bad else (s, e, f) for s, e, f in sample]
                 for sample, bad in zip(spans, flags["malformed_think_tag"].tolist())]
    return batch.replace(rewards_b=rewards_b, message_spans=spans), metrics


# ---- phase 5 ---------------------------------------------------------------------------------------
def initial_sample_mask(cfg, batch: TrainBatch) -> torch.Tensor:
    """1 per sample; 0 for truncated samples under ``grpo.overlong_filtering`` and for samples an
    environment flagged ``mask_sample``. Masked samples stay in their group's baseline."""
    mask_b = torch.ones(len(batch))
    if cfg.grpo.overlong_filtering:
        mask_b = overlong_filter_mask(batch.truncated_b, mask_b)
    return mask_b * (~batch.mask_sample_b).float()


# ---- phase 6 ---------------------------------------------------------------------------------------
@dataclass
class LogprobEngines:
    """The engines phase 6 scores with; None where the run skips them (`grpo.config.resolve_skip_flags`,
    no distillation)."""

    prev: object | None
    reference: object | None
    teacher: object | None = None


def gather_logprobs(engine, batch: TrainBatch, rank: int, world_size: int, temperature: float,
                    micro_batch_size: int, chunk_size: int | None = None) -> torch.Tensor:
    """Logprobs ``[B, T]`` of the whole batch: each rank scores its share, then all ranks gather."""
    from grpo.engines import compute_logprobs

    B, T = batch.input_ids_bt.shape
    sl = rank_slice(B, rank, world_size)
    attn = batch.attention_mask_bt[sl]
    t_local = max(int(attn.sum(dim=1).max().item()), 1) if len(attn) else 1
    lp = compute_logprobs(engine, batch.input_ids_bt[sl, :t_local], attn[:, :t_local], temperature,
                          micro_batch_size, chunk_size)
    lp = torch.nn.functional.pad(lp.float().cpu(), (0, T - lp.shape[1]))
    return torch.cat(all_gather_objects([lp]), dim=0)


def step_logprobs(cfg, batch: TrainBatch, engines: LogprobEngines, rank: int, world_size: int) -> TrainBatch:
    """Previous-policy, reference and teacher logprobs ``[B, T]`` under the current weights (a collective)."""
    p = cfg.policy

    def score(engine):
        if engine is None:
            return None
        return gather_logprobs(engine, batch, rank, world_size, p.generation.temperature, p.logprob_batch_size,
                               p.logprob_chunk_size)

    return batch.replace(prev_logprobs_bt=score(engines.prev), ref_logprobs_bt=score(engines.reference),
                         teacher_logprobs_bt=score(engines.teacher))


# ---- phase 7 ---------------------------------------------------------------------------------------
def step_advantages(cfg, batch: TrainBatch) -> tuple[TrainBatch, dict]:
    """Phase 7 (`compose_advantages`); with ``grpo.calculate_advantages_on_gpu`` (and CUDA) the math runs on
    the GPU and the results come back to the CPU."""
    if cfg.grpo.calculate_advantages_on_gpu and torch.cuda.is_available():
        on_gpu = batch.replace(**{k: v.cuda() for k, v in vars(batch).items() if isinstance(v, torch.Tensor)})
        adv_bt, mask_b, metrics = compose_advantages(cfg, on_gpu)
        return batch.replace(advantages_bt=adv_bt.cpu(), sample_mask_b=mask_b.cpu()), metrics
    adv_bt, mask_b, metrics = compose_advantages(cfg, batch)
    return batch.replace(advantages_bt=adv_bt, sample_mask_b=mask_b), metrics


def compose_advantages(cfg, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(advantages ``[B, T]``, sample mask ``[B]``, metrics) of the step:

        sample_mask = sample_mask · 1[seq_logprob_error ≤ grpo.seq_logprob_error_threshold]
        A   = estimator(group_ids, rewards, valid = 1, token_mask, kl = KL(prev || ref) if use_kl_in_reward)
        A  += −kl_coef · (student − teacher)                         (on-policy distillation; student = prev)
        A[message] = invalid_tool_call_advantage / malformed_thinking_advantage   (flagged messages)
        A   = clamp(A, advantage_clip_low, advantage_clip_high)

    Every sample counts in its group's baseline (valid = 1), masked ones included.
    """
    g, loss_cfg = cfg.grpo, cfg.loss_fn
    metrics: dict = {}
    sample_mask_b = batch.sample_mask_b
    if g.seq_logprob_error_threshold is not None:
        sample_mask_b, metrics = mask_by_seq_logprob_error(
            batch.generation_logprobs_bt, batch.prev_logprobs_bt, batch.token_mask_bt, sample_mask_b,
            batch.rewards_b, g.seq_logprob_error_threshold)
    kl_bt = None
    if loss_cfg.use_kl_in_reward:
        kl_bt = calculate_kl(batch.prev_logprobs_bt, batch.ref_logprobs_bt, loss_cfg.reference_policy_kl_type,
                             loss_cfg.kl_input_clamp_value, loss_cfg.kl_output_clamp_value)
    adv_bt = compute_advantages(
        g.adv_estimator.name, group_ids=batch.group_ids_b, rewards=batch.rewards_b,
        valid_mask=torch.ones_like(batch.rewards_b), token_mask=batch.token_mask_bt, cfg=g.adv_estimator,
        reward_components=batch.reward_components_bk, kl_bt=kl_bt, kl_coef=loss_cfg.reference_policy_kl_penalty)
    if batch.teacher_logprobs_bt is not None:
        student_bt = batch.prev_logprobs_bt if batch.prev_logprobs_bt is not None else batch.generation_logprobs_bt
        adv_bt = adv_bt + distillation_advantages(student_bt, batch.teacher_logprobs_bt, batch.token_mask_bt,
                                                  cfg.on_policy_distillation.kl_coef)
    adv_bt = apply_message_advantage_penalties(adv_bt, batch.message_spans, "invalid_tool_call",
                                               g.invalid_tool_call_advantage)
    adv_bt = apply_message_advantage_penalties(adv_bt, batch.message_spans, "malformed_thinking",
                                               g.malformed_thinking_advantage)
    return clip_advantages(adv_bt, g.advantage_clip_low, g.advantage_clip_high), sample_mask_b, metrics


# ---- phase 8 ---------------------------------------------------------------------------------------
def train_step(cfg, policy, batch: TrainBatch, rank: int, world_size: int, loss_fn=clipped_pg_loss) -> list[dict]:
    """One optimizer step per ``policy.train_global_batch_size`` samples of the batch; returns each step's
    metrics (`grpo.engines.train_on_batch`).

    Each rank trains its shard in micro-batches; ``loss_fn`` (`grpo.loss.clipped_pg_loss`'s signature) is
    normalised by the global valid-token / valid-sequence counts of the optimizer step
    (`grpo.metrics.global_valid_counts`), so the update does not depend on micro-batching or world size.
    Without previous-policy logprobs (``force_on_policy_ratio``) the training forward's own, detached,
    stand in.
    """
    from grpo.engines import train_on_batch

    p = cfg.policy
    results = []
    for start in range(0, len(batch), p.train_global_batch_size):
        mine = batch.select(slice(start, start + p.train_global_batch_size)).shard(rank, world_size)
        n_tokens, n_seqs = global_valid_counts(mine.token_mask_bt, mine.sample_mask_b)

        def loss_closure(logprobs_bt, mb: TrainBatch, n_tokens=n_tokens, n_seqs=n_seqs):
            prev = mb.prev_logprobs_bt if mb.prev_logprobs_bt is not None else logprobs_bt.detach()
            return loss_fn(logprobs_bt, prev, mb.advantages_bt, mb.token_mask_bt, mb.sample_mask_b, cfg.loss_fn,
                           ref_logprobs=mb.ref_logprobs_bt, generation_logprobs=mb.generation_logprobs_bt,
                           global_valid_tokens=n_tokens, global_valid_seqs=n_seqs)

        results.append(train_on_batch(policy, mine.micro_batches(p.train_micro_batch_size), loss_closure,
                                      temperature=p.generation.temperature))
    return results


# ---- phase 9 ---------------------------------------------------------------------------------------
def record_step(state, batch: TrainBatch, step: int) -> None:
    """Advance the loop counters saved with each checkpoint (`grpo.checkpoint.GRPOSaveState`)."""
    state.current_step = step
    state.total_steps += 1
    state.consumed_samples += len(batch)
    state.total_valid_tokens += int((batch.token_mask_bt * batch.sample_mask_b[:, None]).sum())


def due_validation(cfg, step: int, total_steps: int) -> bool:
    """Validate on ``grpo.val_period`` and, with ``grpo.val_at_end``, after the last step."""
    g = cfg.grpo
    return (g.val_period > 0 and step % g.val_period == 0) or (step == total_steps and g.val_at_end)


def due_save(cfg, step: int, total_steps: int) -> bool:
    """Checkpoint on ``checkpointing.save_period`` and after the last step."""
    c = cfg.checkpointing
    return c.enabled and (step % c.save_period == 0 or step == total_steps)


def early_stop_reason(cfg, val_metrics: dict | None) -> str | None:
    """The stop message once validation reaches ``grpo.stop_at_validation_threshold``, else None."""
    from grpo.metrics import validation_early_stop

    g = cfg.grpo
    if val_metrics is None or g.stop_at_validation_metric is None:
        return None
    stop, _, text = validation_early_stop(val_metrics, g.stop_at_validation_metric, g.stop_at_validation_threshold)
    return text if stop else None


def step_metrics(batch: TrainBatch, train_results: list[dict], seconds: float) -> dict:
    """The step's ``train/*`` metrics: rewards, lengths, the loss metrics of each optimizer step, tokens/s."""
    lengths = batch.response_lengths_b.float()
    agg = aggregate_rollout_metrics(train_results)
    # The loss of a GRPO step is the sum of its optimizer steps' losses; the other loss metrics are
    # means over micro-batches (kl_penalty is the KL itself, before the beta weight).
    agg["loss"] = sum(float(r["loss"]) for r in train_results)
    agg["kl"] = agg.get("kl_penalty", 0.0)
    out = {f"train/{k}": v for k, v in agg.items()}
    out.update({
        "train/reward_mean": batch.raw_rewards_b.mean().item(),
        "train/reward_std": batch.raw_rewards_b.std().item() if len(lengths) > 1 else 0.0,
        "train/shaped_reward_mean": batch.rewards_b.mean().item(),
        "train/advantage_abs_mean": batch.advantages_bt.abs().sum().item() / max(batch.token_mask_bt.sum().item(), 1.0),
        "train/response_length_mean": lengths.mean().item(),
        "train/response_length_max": lengths.max().item(),
        "train/num_completion_tokens": lengths.sum().item(),
        "train/truncated_frac": batch.truncated_b.float().mean().item(),
        "train/num_valid_samples": batch.sample_mask_b.sum().item(),
        "train/num_samples": float(len(lengths)),
        "train/tokens_per_s": float(batch.token_mask_bt.sum().item()) / max(seconds, 1e-9),
    })
    return out


def timed(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), seconds)``."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def mult_prob_error(engine, outputs: list, pad_id: int, temperature: float = 1.0) -> float:
    """token_mult_prob_error of plain generation outputs against ``engine``: the mean over generated tokens of
    exp|generation logprob − engine logprob| (1.0: the two agree). A check of a generation backend."""
    from grpo.batch import build_batch
    from grpo.engines import compute_logprobs
    from grpo.rollout import single_turn

    b = build_batch(single_turn(outputs), pad_id)
    ref_bt = compute_logprobs(engine, b.input_ids_bt, b.attention_mask_bt, temperature, micro_batch_size=len(b))
    mask_bt = b.token_mask_bt
    return float((torch.exp((b.generation_logprobs_bt - ref_bt).abs()) * mask_bt).sum() / mask_bt.sum())
