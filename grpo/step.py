"""The phases of a GRPO step, after the rollout: both loops call them under their banners, in this order.

    rewards       shape_rewards        penalties -> scaling -> overlong shaping          (TrainBatch.rewards_b)
    validity      mask_invalid_samples failed / flagged samples out, thin groups dropped  (TrainBatch.valid_b)
    sample mask   initial_sample_mask  overlong filtering, invalid samples              (TrainBatch.sample_mask_b)
    logprobs      step_logprobs        previous-policy, reference, teacher logprobs       (..._logprobs_bt)
    advantages    step_advantages      logprob-error masking, estimator + distillation, message penalties, clipping
    train         train_step           one optimizer step per policy.train_global_batch_size samples
    bookkeeping   record_step, due_validation, due_save, step_metrics

`step_logprobs` and `train_step` run the engines: they are the training forward's (`grpo.system.training`);
the others are here, pure functions of the config and the batch: what a fork of the algorithm edits.

Each function takes the step's whole `grpo.batch.TrainBatch` (every rank holds all of it) and returns
a new one, or what it measured; nothing is filled in place.
"""

from __future__ import annotations

import torch

from grpo.advantages import (
    apply_message_advantage_penalties, clip_advantages, compute_advantages, distillation_advantages, drop_thin_groups,
    opd_metrics,
)
from grpo.batch import TrainBatch, spread_to_rows
from grpo.logprobs import mask_by_seq_logprob_error, skipped_seq_logprob_error_metrics
from grpo.loss import calculate_kl
from grpo.metrics import aggregate_rollout_metrics
from grpo.rewards import (
    Turn, apply_reward_penalties, malformed_thinking_flags, process_reward_components, prompt_starts_in_think,
    reward_transform, scale_rewards, shape_overlong_rewards, single_token_think_ids,
)
from grpo.dynamic_sampling import group_reward_std, overlong_filter_mask


# ---- rewards ---------------------------------------------------------------------------------------
def shape_rewards(cfg, batch: TrainBatch, tokenizer) -> tuple[TrainBatch, dict]:
    """Penalties, scaling and overlong shaping of the rewards (and of GDPO's components); returns (batch, metrics).

        task_rewards = scale(penalise(raw_rewards))      what dynamic sampling filters on (DAPO, NeMo-RL)
        rewards      = shape(task_rewards)               what the advantages read

    Components (GDPO) go through the same steps (`grpo.rewards.process_reward_components`). The detectors
    read each generated assistant message (turn) on its own, as NeMo-RL does, and know when the text before a
    turn opened the thinking block (a chat template's generation prompt); where each think tag is one token of
    the tokenizer, the tags are checked on the token ids too (NeMo-RL infers those ids the same way). With
    ``grpo.malformed_thinking_advantage`` set, every generated message with malformed think tags is flagged
    ``malformed_thinking`` (no reward is changed by that; the penalty
    ``reward_penalties.penalize_malformed_think_tag`` zeroes the sample's reward on its own).
    """
    g, rp = cfg.grpo, cfg.reward_penalties
    first = batch.first_rows()  # a sample's branches share its reward: penalised once, on its first row
    task_s, flags, metrics, turns, think_ids = penalize(batch.raw_rewards_b[first], batch.samples(), rp, tokenizer,
                                                        cfg.env)
    task_b = spread_to_rows(batch, task_s)
    flags = {name: spread_to_rows(batch, f) for name, f in flags.items()}
    task_b = scale_rewards(task_b, g.reward_scaling)
    rewards_b = shape_overlong_rewards(task_b, batch.response_lengths_b, batch.truncated_b, g.reward_shaping)
    changes = {"task_rewards_b": task_b, "rewards_b": rewards_b}
    if batch.reward_components_bk is not None:
        task_bk, shaped_bk = process_reward_components(batch.reward_components_bk, flags, batch.response_lengths_b,
                                                       batch.truncated_b, g.reward_scaling, g.reward_shaping)
        extra = ("overlong",) if shaped_bk.shape[1] > task_bk.shape[1] else ()
        changes.update(task_components_bk=task_bk, reward_components_bk=shaped_bk,
                       component_names=batch.component_names + extra)
    if g.malformed_thinking_advantage is not None and turns is not None:  # Gym: the messages carry the flags
        spans = []
        for sample_spans, sample in zip(batch.message_spans, turns):
            bad = malformed_thinking_flags(sample, rp, tokenizer_think_ids=think_ids).tolist()
            spans.append([(s, e, tuple(sorted({*f, "malformed_thinking"})) if b else f)
                          for (s, e, f), b in zip(sample_spans, bad)])
        changes["message_spans"] = spans
    return batch.replace(**changes), metrics


def penalize(rewards_b: torch.Tensor, trajectories, rp, tokenizer, env=None):
    """``reward_penalties`` on the trajectories' generated messages (`grpo.rewards.apply_reward_penalties`):
    returns (rewards_b', flags, metrics, turns, think_ids). Training (`shape_rewards`) and validation
    (`grpo.run.validation.validate`, as NeMo-RL's ``validate`` passes its ``reward_penalties`` to the rollout) share it.

    A batch that a wing's reward transform claims (`grpo.rewards.register_reward_transform`: NeMo-Gym's effort
    levels, then the penalties on the Gym results) gets it instead; its message flags come from the wing, so turns
    and think_ids are None."""
    transform = reward_transform(trajectories)
    if transform is not None:
        out_b, flags, metrics = transform(rewards_b, trajectories, rp, env, tokenizer)
        return out_b, flags, metrics, None, None
    turns = [sample_turns(t, tokenizer, rp) for t in trajectories]
    think_ids = single_token_think_ids(tokenizer, rp.think_open_tag, rp.think_close_tag)
    out_b, flags, metrics = apply_reward_penalties(rewards_b, turns, rp, tokenizer_think_ids=think_ids)
    return out_b, flags, metrics, turns, think_ids


def sample_turns(traj, tokenizer, rp) -> list[Turn]:
    """The generated assistant messages of ``traj`` as `grpo.rewards.Turn`s (text, token ids, and whether the
    text just before the message left a think block open), in order."""
    opened = _turns_open_thinking(traj, tokenizer, rp)
    return [Turn(m.content, m.token_ids, o) for m, o in zip((m for m in traj.messages if m.trained), opened)]


def _turns_open_thinking(traj, tokenizer, rp) -> list[bool]:
    """Per generated message of ``traj``: did the text just before it (the prompt, or an observation and the
    next generation prompt) leave a think block open?"""
    out, context = [], []
    for m in traj.messages:
        if m.trained:
            out.append(prompt_starts_in_think(tokenizer.decode(context, skip_special_tokens=False),
                                              rp.think_open_tag, rp.think_close_tag))
            context = []
        else:
            context += m.token_ids
    return out


def group_std_for_dynamic_sampling(batch: TrainBatch) -> torch.Tensor:
    """The std DAPO's group filter reads: of the unshaped task reward over each group's valid members, per
    component for GDPO's components (`grpo.dynamic_sampling.group_reward_std`); groups by prompt tokens
    (`TrainBatch.prompt_groups`), the estimators' groups."""
    task = batch.task_components_bk if batch.task_components_bk is not None else batch.task_rewards_b
    first = batch.first_rows()  # a sample once, whatever its branches
    return spread_to_rows(batch, group_reward_std(batch.prompt_groups()[first], task[first], batch.valid_b[first]))


# ---- validity: failed and flagged samples ----------------------------------------------------------
def mask_invalid_samples(batch: TrainBatch) -> tuple[TrainBatch, dict]:
    """Drop the groups that failed or flagged samples left without signal (`grpo.advantages.drop_thin_groups`,
    groups by prompt tokens as the estimators have them); returns (batch with ``valid_b`` updated, the counts).

    ``valid_b`` comes from `grpo.batch.build_batch` (not failed, not flagged ``mask_sample`` under
    ``env.should_mask_flagged_samples``); an invalid sample is out of the loss (sample mask 0) AND out of its
    group's statistics (the estimators' ``valid_mask``). Counts (`failure_counts`): ``rollout/failed_samples/
    <reason>``, ``rollout/retries``, ``rollout/masked_samples`` (samples left invalid), ``rollout/dropped_groups``.
    """
    first = batch.first_rows()  # a sample once, whatever its branches
    valid_s, dropped = drop_thin_groups(batch.prompt_groups()[first], batch.valid_b[first])
    batch = batch.replace(valid_b=spread_to_rows(batch, valid_s))
    return batch, {**failure_counts(batch.samples()), "rollout/masked_samples": int((~valid_s).sum().item()),
                   "rollout/dropped_groups": dropped}


def failure_counts(trajectories) -> dict:
    """``rollout/failed_samples/<reason>`` per failure reason seen (`grpo.tasks.failures.REASONS`), their sum
    ``rollout/failed_samples``, and ``rollout/retries`` (Σ Trajectory.retries: calls retried, also those that
    then succeeded).

        >>> from types import SimpleNamespace as T
        >>> from grpo.trajectory import Failure
        >>> failure_counts([T(failure=None, retries=1), T(failure=Failure.of("env_timeout"), retries=4),
        ...                 T(failure=None, retries=0)])
        {'rollout/failed_samples': 1, 'rollout/retries': 5, 'rollout/failed_samples/env_timeout': 1}
    """
    trajs = [t for t in trajectories if t is not None]
    reasons = [t.failure.reason for t in trajs if t.failure is not None]
    out = {"rollout/failed_samples": len(reasons), "rollout/retries": sum(int(getattr(t, "retries", 0)) for t in trajs)}
    for reason in sorted(set(reasons)):
        out[f"rollout/failed_samples/{reason}"] = reasons.count(reason)
    return out


def add_counts(total: dict, more: dict) -> dict:
    """Counts summed key by key (the generation batches of one step under dynamic sampling).

        >>> add_counts({"a": 1, "b": 2}, {"b": 3, "c": 4})
        {'a': 1, 'b': 5, 'c': 4}
    """
    return {**total, **{k: total.get(k, 0) + v for k, v in more.items()}}


# ---- sample mask -----------------------------------------------------------------------------------
def initial_sample_mask(cfg, batch: TrainBatch) -> torch.Tensor:
    """``valid_b`` as 1 / 0 (failed samples, flagged ones under ``env.should_mask_flagged_samples``, dropped
    groups: out of the loss and of their group's statistics); also 0 for truncated samples under
    ``grpo.overlong_filtering`` (those stay in their group's baseline, as in DAPO and NeMo-RL)."""
    mask_b = batch.valid_b.float()
    if cfg.grpo.overlong_filtering:
        mask_b = overlong_filter_mask(batch.truncated_b, mask_b)
    return mask_b


# ---- advantages ------------------------------------------------------------------------------------
def step_advantages(cfg, batch: TrainBatch) -> tuple[TrainBatch, dict]:
    """The advantages phase (`compose_advantages`); with ``grpo.calculate_advantages_on_gpu`` (and CUDA) the math runs on
    the GPU and the results come back to the CPU."""
    if cfg.grpo.calculate_advantages_on_gpu and torch.cuda.is_available():
        on_gpu = batch.replace(**{k: v.cuda() for k, v in vars(batch).items() if isinstance(v, torch.Tensor)})
        adv_bt, mask_b, metrics = compose_advantages(cfg, on_gpu)
        return batch.replace(advantages_bt=adv_bt.cpu(), sample_mask_b=mask_b.cpu()), metrics
    adv_bt, mask_b, metrics = compose_advantages(cfg, batch)
    return batch.replace(advantages_bt=adv_bt, sample_mask_b=mask_b), metrics


def compose_advantages(cfg, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(advantages ``[B, T]``, sample mask ``[B]``, metrics) of the step:

        sample_mask = sample_mask · valid · 1[seq_logprob_error ≤ grpo.seq_logprob_error_threshold]
        A   = estimator(groups, rewards, valid, token_mask, sample_mask,
                        kl = KL(prev || ref) if use_kl_in_reward, master_cfg = cfg)
              groups: by prompt tokens (`grpo.advantages.prompt_group_ids`, NeMo-RL's key): a prompt that came
              twice in the step is one group of 2n; the estimator sees a sample once (its first row), its
              branch rows get its advantage (`advantages_of_branches`)
              opd: A_t = sg[teacher_t − prev_t] · token_mask · sample_mask   (NeMo-RL's MOPD; no reward, no kl_coef;
                   per token of every row, branch rows included)
        A  += −kl_coef · (student − teacher)                         (on-policy distillation with another estimator;
                                                                      student = prev)
        A[message] = malformed_thinking_advantage, then invalid_tool_call_advantage   (flagged messages;
                                                                          invalid wins, as in NeMo-RL)
        A   = clamp(A, advantage_clip_low, advantage_clip_high)

    ``valid = batch.valid_b``: failed samples, flagged ones and dropped groups (`mask_invalid_samples`) are out
    of their group's statistics and of the loss; samples masked for other reasons (overlong filtering, the
    logprob error) stay in their group's baseline. The estimator gets the run's whole config as ``master_cfg``
    (a fork's estimator reads its own section there).
    """
    g, loss_cfg = cfg.grpo, cfg.loss_fn
    metrics: dict = {}
    valid_b = batch.valid_b.to(batch.sample_mask_b.device)
    sample_mask_b = batch.sample_mask_b * valid_b.to(batch.sample_mask_b.dtype)
    if batch.prev_logprobs_bt is not None:  # the error metrics always; masking only with a threshold (NeMo-RL)
        sample_mask_b, metrics = mask_by_seq_logprob_error(
            batch.generation_logprobs_bt, batch.prev_logprobs_bt, batch.token_mask_bt, sample_mask_b,
            batch.rewards_b, g.seq_logprob_error_threshold)
    else:  # the previous-logprob pass was skipped: the metrics at 0, as NeMo-RL logs them
        metrics = skipped_seq_logprob_error_metrics()
    kl_bt = None
    if loss_cfg.use_kl_in_reward and batch.ref_logprobs_bt is not None:  # skipped at beta = 0: the term is 0
        kl_bt = calculate_kl(batch.prev_logprobs_bt, batch.ref_logprobs_bt, loss_cfg.reference_policy_kl_type,
                             loss_cfg.kl_input_clamp_value, loss_cfg.kl_output_clamp_value)
    per_row = g.adv_estimator.name == "opd"  # per token of each row's own logprobs: every row, branches included
    first = batch.first_rows().to(valid_b.device)  # the other estimators see each sample once (its first row)

    def once(x):
        return x if x is None or per_row or bool(first.all()) else x[first]

    adv_first_bt = compute_advantages(
        g.adv_estimator.name, group_ids=once(batch.prompt_groups()), rewards=once(batch.rewards_b),
        valid_mask=once(valid_b.to(batch.rewards_b.dtype)), token_mask=once(batch.token_mask_bt),
        cfg=g.adv_estimator, reward_components=once(batch.reward_components_bk), kl_bt=once(kl_bt),
        kl_coef=loss_cfg.reference_policy_kl_penalty, sample_mask=once(sample_mask_b),
        prev_logprobs=once(batch.prev_logprobs_bt), teacher_logprobs=once(batch.teacher_logprobs_bt),
        generation_logprobs=once(batch.generation_logprobs_bt), master_cfg=cfg)
    adv_bt = adv_first_bt if per_row else advantages_of_branches(batch, adv_first_bt)
    if batch.teacher_logprobs_bt is not None:
        student_bt = batch.prev_logprobs_bt if batch.prev_logprobs_bt is not None else batch.generation_logprobs_bt
        if g.adv_estimator.name == "opd":  # the estimator is the distillation term (NeMo-RL's metrics of it)
            metrics.update(opd_metrics(batch.teacher_logprobs_bt, student_bt, adv_bt,
                                       batch.token_mask_bt * sample_mask_b[:, None]))
        else:
            adv_bt = adv_bt + distillation_advantages(student_bt, batch.teacher_logprobs_bt, batch.token_mask_bt,
                                                      cfg.on_policy_distillation.kl_coef)
    adv_bt = apply_message_advantage_penalties(adv_bt, batch.message_spans, "malformed_thinking",
                                               g.malformed_thinking_advantage)
    adv_bt = apply_message_advantage_penalties(adv_bt, batch.message_spans, "invalid_tool_call",
                                               g.invalid_tool_call_advantage)
    metrics.update(message_penalty_metrics(batch.message_spans, g.invalid_tool_call_advantage,
                                           g.malformed_thinking_advantage))
    return clip_advantages(adv_bt, g.advantage_clip_low, g.advantage_clip_high), sample_mask_b, metrics


def advantages_of_branches(batch: TrainBatch, adv_first_bt: torch.Tensor) -> torch.Tensor:
    """Advantages ``[B, T]`` of every row from those of the first rows (``adv_first_bt``, one per sample): a first row
    keeps its own, a branch row (`grpo.batch.TrainBatch.branch_b`) gets its sample's advantage A_i on every position,
    as `grpo.advantages.compute_advantages` broadcasts a per-sample estimator's. A_i is the mean of the first row's
    advantage over its generated tokens (in float64: exactly A_i where it is constant, as every per-sample
    estimator's is; a per-token estimator's, Reinforce++ with the KL in the reward, gives the sample's mean), its
    first position's where it generated none. A batch without branches is returned as it is."""
    first = batch.first_rows().to(adv_first_bt.device)
    if bool(first.all()):
        return adv_first_bt
    mask_bt = batch.token_mask_bt.to(adv_first_bt.device)[first].to(torch.float64)
    n_s = mask_bt.sum(1)
    mean_s = (adv_first_bt.to(torch.float64) * mask_bt).sum(1) / n_s.clamp(min=1)
    adv_s = torch.where(n_s > 0, mean_s, adv_first_bt[:, 0].to(torch.float64)).to(adv_first_bt.dtype)
    adv_bt = spread_to_rows(batch, adv_s)[:, None].expand(batch.token_mask_bt.shape).clone()
    adv_bt[first] = adv_first_bt
    return adv_bt


def message_penalty_metrics(message_spans, invalid_tool_call_advantage, malformed_thinking_advantage) -> dict:
    """NeMo-RL's metrics of the message-level advantage penalties (`nemo_rl/algorithms/grpo.py`,
    ``_apply_message_level_advantage_penalties``); none when both are off.

    Over the step's generated assistant messages: ``num_invalid_tool_calls`` counts those overwritten with
    ``invalid_tool_call_advantage``, ``num_malformed_thinking`` those overwritten with
    ``malformed_thinking_advantage`` (a message flagged both counts as invalid: invalid wins), each ``_rate``
    is its count over ``num_assistant_messages``. A penalty that is off counts nothing.

        >>> message_penalty_metrics([[(0, 2, ("invalid_tool_call", "malformed_thinking")), (2, 4, ())]], -1.0, -1.0)
        {'invalid_tool_call_rate': 0.5, 'malformed_thinking_rate': 0.0, 'num_invalid_tool_calls': 1, \
'num_malformed_thinking': 0, 'num_assistant_messages': 2}
    """
    if invalid_tool_call_advantage is None and malformed_thinking_advantage is None:
        return {}
    invalid = malformed = messages = 0
    for spans in message_spans:
        for _, _, flags in spans:
            names = {flags} if isinstance(flags, str) else set(flags or ())
            messages += 1
            if invalid_tool_call_advantage is not None and "invalid_tool_call" in names:
                invalid += 1
            elif malformed_thinking_advantage is not None and "malformed_thinking" in names:
                malformed += 1
    return {"invalid_tool_call_rate": invalid / max(messages, 1),
            "malformed_thinking_rate": malformed / max(messages, 1), "num_invalid_tool_calls": invalid, "num_malformed_thinking": malformed, "num_assistant_messages": messages}


# ---- bookkeeping -----------------------------------------------------------------------------------
def record_step(state, batch: TrainBatch, step: int, trained: bool = True) -> None:
    """Advance the loop counters saved with each checkpoint (`grpo.system.checkpoint.GRPOSaveState`);
    ``consumed_samples`` counts prompts, as NeMo-RL's does.

    A step skipped for failed rollouts (``trained=False``, ``grpo.rollout_failure``) is a step: it has its
    number (the weights' version, the checkpoints' and the logs' step), consumes its prompts, and trains no
    token; only the optimizer (and its learning-rate schedule) does not move."""
    state.current_step = step
    state.total_steps += 1
    state.consumed_samples += int(torch.unique(batch.group_ids_b).numel())
    if trained:
        state.total_valid_tokens += int((batch.token_mask_bt * batch.sample_mask_b[:, None]).sum())


def due_validation(cfg, step: int, total_steps: int) -> bool:
    """Validate on ``grpo.val_period`` from step ``grpo.val_start_at`` on (-1: from the first) and, with
    ``grpo.val_at_end``, after the last step; NeMo-RL's ``should_run_validation`` (nemo_rl/algorithms/grpo.py):

        (val_period > 0 and step >= val_start_at and step % val_period == 0) or (val_at_end and last step)
    """
    g = cfg.grpo
    periodic = g.val_period > 0 and step >= g.val_start_at and step % g.val_period == 0
    return periodic or (step == total_steps and g.val_at_end)


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
    """The step's ``train/*`` metrics, in NeMo-RL's names where it has one: the loss metrics of each optimizer
    step (``kl_penalty``: the KL itself, before the beta weight; 0 without a KL term), ``reward`` (the rewards the
    advantages read: after penalties, scaling and shaping, as NeMo-RL's grpo_train logs it), reward spread,
    tokens, tokens/s. The environments' rewards, lengths and truncation are the rollout's
    (`grpo.rollout_metrics.rollout_summary`: ``mean_total_reward``, ``mean_gen_tokens_per_sample``, ...)."""
    first = batch.first_rows()  # per-sample figures read each sample once, whatever its branches
    lengths = batch.response_lengths_b[first].float()
    scored = batch.scored_b & first
    scored_rewards = batch.raw_rewards_b[scored]  # a failed sample has no reward
    agg = aggregate_rollout_metrics(train_results)
    # The loss of a GRPO step is the sum of its optimizer steps' losses; the other loss metrics are
    # means over micro-batches.
    agg["loss"] = sum(float(r["loss"]) for r in train_results)
    agg.setdefault("kl_penalty", 0.0)
    out = {f"train/{k}": v for k, v in agg.items()}
    out.update({
        "train/reward_std": scored_rewards.std().item() if len(scored_rewards) > 1 else 0.0,
        "train/reward": batch.rewards_b[scored].mean().item() if len(scored_rewards) else 0.0,
        "train/advantage_abs_mean": batch.advantages_bt.abs().sum().item() / max(batch.token_mask_bt.sum().item(), 1.0),
        "train/num_completion_tokens": lengths.sum().item(),
        "train/num_valid_samples": batch.sample_mask_b[first].sum().item(),
        "train/num_samples": float(len(lengths)),
        "train/tokens_per_s": float(batch.token_mask_bt.sum().item()) / max(seconds, 1e-9),
    })
    return out
