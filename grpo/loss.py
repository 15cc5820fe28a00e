"""Clipped policy-gradient loss (GRPO / DAPO / GSPO / REINFORCE / CISPO, VAPO's NLL), KL estimators, aggregation.

Semantics are NeMo-RL's ``ClippedPGLossFn``. Per-token tensors are ``[B, T]`` and already aligned
(position t holds the logprob of token t); ``token_mask`` is 1 on trained tokens, ``sample_mask``
``[B]`` is 1 on trained samples. Positions outside ``token_mask · sample_mask`` never reach the loss,
whatever they hold (even inf / NaN): the inputs are zeroed there first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from grpo.batch import TrainBatch
from grpo.config import ClippedPGLossConfig, MasterConfig

Normalizer = Union[torch.Tensor, float, int, None]


# --------------------------------------------------------------------------------------------------
# KL estimators and aggregation
# --------------------------------------------------------------------------------------------------
def calculate_kl(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kl_type: str = "k3",
    input_clamp: Optional[float] = 20.0,
    output_clamp: Optional[float] = 10.0,
    importance_weights: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-token estimate of KL(π || π_ref) (http://joschu.net/blog/kl-approx.html), as NeMo-RL's
    ``calculate_kl`` (nemo_rl/algorithms/utils.py):

        logr = clamp(ref − logprobs, ±input_clamp)
        k1 = −logr      k2 = logr² / 2      k3 = exp(logr) − 1 − logr
        result = clamp(w · k, ±output_clamp)   (a None clamp is skipped; w = importance_weights, default 1)

    Where the input clamp bites, w is detached: the clamp stops the gradient through both the KL and w.

        >>> calculate_kl(torch.tensor([0.0]), torch.tensor([-1.0]))   # e^-1 - 1 + 1
        tensor([0.3679])
    """
    logr = ref_logprobs - logprobs
    if input_clamp is not None:
        clamped = logr.clamp(min=-input_clamp, max=input_clamp)
        if importance_weights is not None:
            importance_weights = torch.where(logr == clamped, importance_weights, importance_weights.detach())
        logr = clamped
    if kl_type == "k1":
        kl = -logr
    elif kl_type == "k2":
        kl = logr.square() / 2
    elif kl_type == "k3":
        kl = torch.exp(logr) - 1 - logr
    else:
        raise ValueError(f"loss_fn.reference_policy_kl_type={kl_type!r}: expected one of ['k1', 'k2', 'k3']")
    if importance_weights is not None:
        kl = importance_weights * kl
    if output_clamp is not None:
        kl = kl.clamp(min=-output_clamp, max=output_clamp)
    return kl


def kl_sampling_weights(lp_u: torch.Tensor, gen: Optional[torch.Tensor], on_policy_approximation: bool) -> torch.Tensor:
    """The weight of the per-token KL, as NeMo-RL (loss_functions.py, "fix: KL backward in GRPO", #2506):

        w = exp(lp_u − gen)          with use_on_policy_kl_approximation (the KL's samples come from π_gen)
        w = exp(lp_u − sg(lp_u))     otherwise: 1 in value, ∇w = ∇lp_u

    Not detached: the KL's samples are drawn from the policy being optimised, so its gradient keeps the
    score-function term KL · ∇lp_u (https://arxiv.org/abs/2506.09477). Non-finite weights become 0.

        >>> lp = torch.tensor([-1.0], requires_grad=True)
        >>> w = kl_sampling_weights(lp, None, False); w.backward(); (w.item(), lp.grad.item())
        (1.0, 1.0)
    """
    if on_policy_approximation:
        if gen is None:
            raise ValueError("loss_fn.use_on_policy_kl_approximation=true needs generation_logprobs")
        w = torch.exp(lp_u - gen)
    else:
        w = torch.exp(lp_u - lp_u.detach())
    return torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None, normalizer: Normalizer = None
) -> torch.Tensor:
    """Σ mask·values / normalizer, with normalizer = Σ mask (over ``dim``) unless given.

    Entries where mask == 0 are ignored even when they are inf / NaN. A zero normaliser gives 0.
    """
    num = (torch.where(mask != 0, values, 0) * mask).sum() if dim is None else (
        torch.where(mask != 0, values, 0) * mask
    ).sum(dim)
    if normalizer is None:
        denom = mask.sum() if dim is None else mask.sum(dim)
    else:
        denom = torch.as_tensor(normalizer, dtype=num.dtype, device=num.device)
    return num / denom.to(num.dtype).clamp(min=1e-8)


def aggregate_loss(
    values_bt: torch.Tensor,
    token_mask_bt: torch.Tensor,
    sample_mask_b: torch.Tensor,
    token_level: bool,
    global_valid_tokens: Normalizer = None,
    global_valid_seqs: Normalizer = None,
) -> torch.Tensor:
    """THE loss aggregation; with global normalisers, micro-batch results add up to the full batch.

        token level:     Σ_{b,t} m_bt · v_bt / global_valid_tokens            m = token_mask · sample_mask
        sequence level:  Σ_b s_b · (Σ_t tm_bt · v_bt / Σ_t tm_bt) / global_valid_seqs

    The defaults (None) are this batch's Σ m and Σ s; pass ``grpo.metrics.global_valid_counts`` of
    the whole step when the step is split into micro-batches or ranks.
    """
    token_mask = token_mask_bt.to(values_bt.dtype)
    sample_mask = sample_mask_b.to(values_bt.dtype)
    if token_level:
        return masked_mean(values_bt, token_mask * sample_mask[:, None], normalizer=global_valid_tokens)
    per_seq_b = masked_mean(values_bt, token_mask, dim=-1)
    return masked_mean(per_seq_b, sample_mask, normalizer=global_valid_seqs)


# --------------------------------------------------------------------------------------------------
# Pieces of the clipped PG loss
# --------------------------------------------------------------------------------------------------
def policy_ratio(
    logprobs_bt: torch.Tensor, prev_logprobs_bt: torch.Tensor, token_mask_bt: torch.Tensor, cfg: ClippedPGLossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(r, clamp(r)) entering the clipped objective.

        default:                 r_t = exp(lp_t − prev_t),   clamp to [1 − ratio_clip_min, 1 + ratio_clip_max]
        GSPO (sequence ratios):  r_t = exp(mean_{t' in mask}(lp − prev)) for every t of the sequence
        force_on_policy_ratio:   r_t = exp(lp_t − stopgrad(lp_t)) ≡ 1, no clamp
        disable_ppo_ratio:       r_t = lp_t (so L = −A·lp), no clamp
    """
    if cfg.force_on_policy_ratio:
        ratio = torch.exp(logprobs_bt - logprobs_bt.detach())
        return ratio, ratio
    if cfg.disable_ppo_ratio:
        return logprobs_bt, logprobs_bt
    log_ratio = logprobs_bt - prev_logprobs_bt
    if cfg.sequence_level_importance_ratios:
        seq_log_ratio_b = masked_mean(log_ratio, token_mask_bt.to(log_ratio.dtype), dim=-1)
        log_ratio = seq_log_ratio_b[:, None].expand_as(logprobs_bt)
    ratio = torch.exp(log_ratio)
    return ratio, ratio.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)


def clipped_objective(
    ratio: torch.Tensor, ratio_clamped: torch.Tensor, advantages: torch.Tensor, ratio_clip_c: Optional[float]
) -> torch.Tensor:
    """Per-token loss L = max(−A·r, −A·clamp(r)); dual clip: L = min(L, −c·A) where A < 0."""
    loss = torch.max(-advantages * ratio, -advantages * ratio_clamped)
    if ratio_clip_c is not None:
        loss = torch.where(advantages < 0, torch.min(loss, -ratio_clip_c * advantages), loss)
    return loss


def cispo_objective(ratio_clamped: torch.Tensor, advantages: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """CISPO's per-token loss (MiniMax-M1, arXiv:2506.13585): L = −A · sg(clamp(r)) · lp.

    The clamped ratio is a detached weight, so every token keeps the gradient −A · sg(clamp(r)) of its logprob
    (PPO's clip zeroes it outside the range); the bounds are ``ratio_clip_min`` / ``ratio_clip_max``.
    """
    return -advantages * ratio_clamped.detach() * logprobs


def positive_example_nll(
    logprobs_bt: torch.Tensor, mask_bt: torch.Tensor, rewards_b: torch.Tensor, normalizer: Normalizer = None
) -> torch.Tensor:
    """VAPO's positive-example NLL (arXiv:2504.05118, Eq. 10): −Σ c_bt · lp_bt / normalizer,
    c = mask · [reward_b > 0] (the correct samples' trained tokens), normalizer = Σ c unless given (the step's
    count, so micro-batches add up); token level whatever ``token_level_loss`` says; 0 without a correct token.

        >>> positive_example_nll(torch.tensor([[-1.0, -3.0], [-5.0, -7.0]]), torch.ones(2, 2), torch.tensor([1.0, 0.0]))
        tensor(2.)
    """
    correct_bt = mask_bt * (rewards_b > 0).to(mask_bt.dtype)[:, None]
    return masked_mean(-logprobs_bt, correct_bt, normalizer=normalizer)


def importance_weights(
    prev_logprobs_bt: torch.Tensor,
    generation_logprobs_bt: torch.Tensor,
    token_mask_bt: torch.Tensor,
    sample_mask_b: torch.Tensor,
    cfg: ClippedPGLossConfig,
) -> tuple[torch.Tensor, dict]:
    """Off-policy correction weights (detached) and the fraction truncated.

        token level:   w_t = exp(prev_t − gen_t)                                     -> [B, T]
        GSPO:          w_i = exp(Σ_t m_t·(prev_t − gen_t))  (NeMo-RL sums here)       -> [B, 1]
        tis:           w = clamp(w, ratio_min or 0, ratio)
        icepop:        w = 0 where w ∉ [ratio_min, ratio]
        seq-mask-tis:  w = 0 on every token of sequences whose exp(mean_t m_t·(prev_t − gen_t)) ∉ [ratio_min, ratio]

    ``ratio`` / ``ratio_min`` are ``truncated_importance_sampling_ratio`` / ``..._ratio_min``;
    inf / NaN weights become 0. Metric ``is_oob_ratio`` (NeMo-RL's): for tis and icepop the fraction
    of masked tokens (m = token_mask · sample_mask) whose weight is outside the range, also with GSPO's
    sequence weights (each token of a sequence carries its sequence's weight, so a sequence counts
    with its number of masked tokens); for seq-mask-tis the fraction of valid sequences (sample_mask)
    that are dropped.
    """
    dtype = prev_logprobs_bt.dtype
    token_mask = token_mask_bt.to(dtype)
    sample_mask = sample_mask_b.to(dtype)
    mask = token_mask * sample_mask[:, None]
    log_w = torch.where(mask > 0, (prev_logprobs_bt - generation_logprobs_bt).detach(), 0.0)
    if cfg.sequence_level_importance_ratios:
        weights = torch.exp((log_w * mask).sum(-1, keepdim=True))
    else:
        weights = torch.exp(log_w)
    weights = torch.nan_to_num(weights, nan=0.0, posinf=0.0, neginf=0.0)

    kind, hi, lo = (cfg.truncated_importance_sampling_type, cfg.truncated_importance_sampling_ratio,
                    cfg.truncated_importance_sampling_ratio_min)
    metrics: dict = {}
    if kind is None:
        return weights, metrics
    if kind == "tis":
        lo = 0.0 if lo is None else lo
        oob = (weights > hi) | (weights < lo)
        weights = weights.clamp(min=lo, max=hi)
        metrics["is_oob_ratio"] = masked_mean(oob.to(dtype).expand_as(mask), mask).item()
    elif kind == "icepop":
        kept = (weights >= lo) & (weights <= hi)
        weights = torch.where(kept, weights, 0.0)
        metrics["is_oob_ratio"] = masked_mean((~kept).to(dtype).expand_as(mask), mask).item()
    elif kind == "seq-mask-tis":
        geo_mean_b = torch.exp(masked_mean(log_w, token_mask, dim=-1))
        kept_b = (geo_mean_b >= lo) & (geo_mean_b <= hi)
        weights = weights * kept_b.to(dtype)[:, None]
        metrics["is_oob_ratio"] = masked_mean((~kept_b).to(dtype), sample_mask).item()
    else:
        raise ValueError(f"loss_fn.truncated_importance_sampling_type={kind!r}: expected tis, icepop or seq-mask-tis")
    return weights, metrics


# --------------------------------------------------------------------------------------------------
# The loss
# --------------------------------------------------------------------------------------------------
def clipped_pg_loss(
    logprobs: torch.Tensor,
    prev_logprobs: Optional[torch.Tensor],
    advantages: torch.Tensor,
    token_mask: torch.Tensor,
    sample_mask: torch.Tensor,
    cfg: ClippedPGLossConfig,
    ref_logprobs: Optional[torch.Tensor] = None,
    generation_logprobs: Optional[torch.Tensor] = None,
    global_valid_tokens: Normalizer = None,
    global_valid_seqs: Normalizer = None,
    unfiltered_logprobs: Optional[torch.Tensor] = None,
    rewards: Optional[torch.Tensor] = None,
    global_correct_tokens: Normalizer = None,
) -> tuple[torch.Tensor, dict]:
    """NeMo-RL's clipped policy-gradient loss with KL penalty and off-policy correction.

        r   = policy_ratio(...)                      L_t = clipped_objective(r, clamp(r), A)
                                                     (use_cispo: L_t = cispo_objective(clamp(r), A, lp))
        w   = importance_weights(...) if use_importance_sampling_correction else 1
        KL  = calculate_kl(lp_u, ref, importance_weights=kl_sampling_weights(lp_u, gen, ...))
        loss = aggregate(w·L) + β·aggregate(KL) + μ·positive_example_nll(lp, m, rewards, global_correct_tokens)
        β = reference_policy_kl_penalty (0 if use_kl_in_reward),  μ = positive_example_nll_weight

    CISPO (``use_cispo``) replaces PPO's clipped objective by −A · sg(clamp(r, 1 − ratio_clip_min,
    1 + ratio_clip_max)) · lp, token level; the IS correction w and the KL term apply to it unchanged.
    VAPO's NLL term (μ > 0) needs ``rewards`` ``[B]``: samples with reward > 0 are the correct ones, and its
    normaliser is ``global_correct_tokens`` (the step's Σ m·[reward > 0]; default: this batch's).

    Under top-k / top-p sampling, ``logprobs`` and ``prev_logprobs`` are the filtered ones (the sampling
    distribution, like ``generation_logprobs``) and ``unfiltered_logprobs`` = lp_u are the current
    policy's with the temperature only, as NeMo-RL's ``curr_logprobs_unfiltered``: the reference
    logprobs are unfiltered (the reference's top-k set is not the policy's), so the KL term compares
    unfiltered with unfiltered. Default (None): lp_u = ``logprobs`` (no filter).

    ``aggregate`` is :func:`aggregate_loss` (token or sequence level per ``cfg.token_level_loss``).
    ``advantages`` is ``[B]`` or ``[B, T]``. ``prev_logprobs`` may be None under
    ``force_on_policy_ratio`` (then prev = stopgrad(logprobs)). Computed in fp32 (fp64 for fp64 inputs).

    Metrics (python floats). ``loss`` is the returned loss: with global normalisers, SUM it over the
    micro-batches of a step. All others describe this micro-batch alone (average them, min / max the
    extremes; ``grpo.metrics.aggregate_rollout_metrics`` does), over m = token_mask · sample_mask:
      kl_penalty: the KL term before β, aggregated like the loss but with this micro-batch's own
        normalisers (0 when β = 0)
      clip_fraction_high / _low: fraction of masked tokens with A > 0, r > 1 + ratio_clip_max /
        A < 0, r < 1 − ratio_clip_min (the clamped branch is active); dual_clip_fraction: A < 0, r > c
      probs_ratio (mean), probs_ratio_min, probs_ratio_max: r = exp(lp − prev) over masked tokens
        (inf / −inf with no masked token)
      token_mult_prob_error: masked mean of exp(|prev − gen|)         (only with generation_logprobs)
      gen_kl_error, policy_kl_error, js_divergence_error: see `_engine_mismatch_metrics` (only with
        generation_logprobs)
      sampling_importance_ratio: masked mean of the IS weights w     (only with generation_logprobs)
      is_oob_ratio: see :func:`importance_weights`                    (only with a truncation type)
      approx_entropy: masked mean of −exp(lp − gen)·lp (of −lp without generation_logprobs)
      num_valid_samples: Σ sample_mask
      positive_nll_loss: the NLL term before μ over this micro-batch's correct tokens (only with μ > 0; None
        without a correct token)
    Under CISPO clip_fraction_high / _low count every masked token whose weight is clamped (r > 1 + ratio_clip_max
    / r < 1 − ratio_clip_min, either sign of A: its gradient is scaled, not zeroed), and probs_ratio_clamped is
    the masked mean of the weight sg(clamp(r)).
    A micro-batch with no token in the mask (every sample masked) reports None for all but ``loss`` and
    ``num_valid_samples``: `grpo.metrics.aggregate_rollout_metrics` averages over the others.
    """
    dtype = torch.promote_types(logprobs.dtype, torch.float32)  # bf16 / fp16 inputs: compute in fp32
    token_mask = token_mask.to(dtype)
    sample_mask = sample_mask.to(dtype)
    mask = token_mask * sample_mask[:, None]
    keep = mask > 0

    def clean(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if x is None else torch.where(keep, x.to(dtype), 0.0)

    lp = clean(logprobs)
    if cfg.force_on_policy_ratio:
        prev = lp.detach()
    elif prev_logprobs is None:
        raise ValueError("clipped_pg_loss: prev_logprobs is required unless loss_fn.force_on_policy_ratio=true")
    else:
        prev = clean(prev_logprobs).detach()
    gen = clean(generation_logprobs)
    adv = advantages.detach()
    adv = clean(adv[:, None].expand_as(lp) if adv.dim() == 1 else adv).to(dtype)

    def agg(values_bt: torch.Tensor) -> torch.Tensor:
        return aggregate_loss(values_bt, token_mask, sample_mask, cfg.token_level_loss,
                              global_valid_tokens, global_valid_seqs)

    # Policy term.
    ratio, ratio_clamped = policy_ratio(lp, prev, token_mask, cfg)
    if cfg.use_cispo:
        pg_bt = cispo_objective(ratio_clamped, adv, lp)
    else:
        pg_bt = clipped_objective(ratio, ratio_clamped, adv, cfg.ratio_clip_c)
    metrics: dict = {}
    if gen is not None:
        is_w, is_metrics = importance_weights(prev, gen, token_mask, sample_mask, cfg)
        metrics.update(is_metrics)
        if cfg.sequence_level_importance_ratios:
            metrics["sampling_importance_ratio"] = masked_mean(is_w[:, 0], sample_mask).item()
        else:
            metrics["sampling_importance_ratio"] = masked_mean(is_w, mask).item()
        metrics["token_mult_prob_error"] = masked_mean(torch.exp((prev - gen).abs()), mask).item()
        metrics.update(_engine_mismatch_metrics(prev, gen, mask, cfg.reference_policy_kl_type))
        if cfg.use_importance_sampling_correction:
            pg_bt = is_w * pg_bt
    elif cfg.use_importance_sampling_correction:
        raise ValueError("loss_fn.use_importance_sampling_correction=true needs generation_logprobs")
    loss = agg(pg_bt)

    # KL term.
    beta = 0.0 if cfg.use_kl_in_reward else cfg.reference_policy_kl_penalty
    kl_value = 0.0
    if beta != 0:
        if ref_logprobs is None:
            raise ValueError(f"loss_fn.reference_policy_kl_penalty={beta} needs ref_logprobs")
        lp_u = lp if unfiltered_logprobs is None else clean(unfiltered_logprobs)
        kl_bt = calculate_kl(lp_u, clean(ref_logprobs), cfg.reference_policy_kl_type,
                             cfg.kl_input_clamp_value, cfg.kl_output_clamp_value,
                             importance_weights=kl_sampling_weights(lp_u, gen, cfg.use_on_policy_kl_approximation))
        loss = loss + beta * agg(kl_bt)
        with torch.no_grad():  # this micro-batch's own KL (local normalisers), for logging
            kl_value = aggregate_loss(kl_bt, token_mask, sample_mask, cfg.token_level_loss).item()

    # VAPO's NLL on the correct samples.
    mu = cfg.positive_example_nll_weight
    if mu > 0:
        if rewards is None:
            raise ValueError(f"loss_fn.positive_example_nll_weight={mu} needs the samples' rewards")
        rewards = rewards.detach().to(device=lp.device)
        loss = loss + mu * positive_example_nll(lp, mask, rewards, global_correct_tokens)
        with torch.no_grad():
            has_correct = bool((mask * (rewards > 0).to(dtype)[:, None]).any())
            metrics["positive_nll_loss"] = positive_example_nll(lp, mask, rewards).item() if has_correct else None

    metrics.update(_ratio_metrics(lp, prev, ratio, ratio_clamped, adv, keep, mask, cfg))
    with torch.no_grad():
        entropy_w = torch.ones_like(lp) if gen is None else torch.exp(lp - gen)
        metrics["approx_entropy"] = masked_mean(-entropy_w * lp, mask).item()
    metrics.update(kl_penalty=kl_value)
    if not bool(keep.any()):  # nothing trained here: no per-token statistic (micro-batch means skip None)
        metrics = dict.fromkeys(metrics)
    metrics.update(loss=loss.item(), num_valid_samples=sample_mask.sum().item())
    return loss, metrics


def _engine_mismatch_metrics(prev: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor, kl_type: str) -> dict:
    """How far the training engine's logprobs (prev) are from the sampler's (gen), over the masked tokens, as
    NeMo-RL's ClippedPGLossFn logs them (nemo_rl/algorithms/loss/loss_functions.py:414-466 at 7ea279a):

        gen_kl_error        = mean calculate_kl(gen, prev, kl_type, no clamps)     KL(P_gen || P_train)
        policy_kl_error     = mean calculate_kl(prev, gen, kl_type, no clamps)     KL(P_train || P_gen)
        js_divergence_error = mean ½·k3(M vs prev) + ½·k3(M vs gen),   log M = log(½·e^prev + ½·e^gen)
    """
    with torch.no_grad():
        log_mix = torch.logaddexp(prev, gen) - math.log(2.0)
        k3 = lambda x: torch.exp(x - log_mix) - (x - log_mix) - 1  # noqa: E731
        return {
            "gen_kl_error": masked_mean(calculate_kl(gen, prev, kl_type, None, None), mask).item(),
            "policy_kl_error": masked_mean(calculate_kl(prev, gen, kl_type, None, None), mask).item(),
            "js_divergence_error": masked_mean(0.5 * k3(prev) + 0.5 * k3(gen), mask).item(),
        }


def _ratio_metrics(lp, prev, ratio, ratio_clamped, adv, keep, mask, cfg: ClippedPGLossConfig) -> dict:
    """Clip fractions and the probability ratio exp(lp − prev) over the masked tokens (see clipped_pg_loss)."""
    with torch.no_grad():
        uses_clip = not (cfg.force_on_policy_ratio or cfg.disable_ppo_ratio)
        r = ratio.detach() if uses_clip else torch.exp(lp.detach() - prev)
        pos, neg = (keep, keep) if cfg.use_cispo else (adv > 0, adv < 0)  # CISPO clamps the weight whatever A is
        high = keep & pos & (r > 1.0 + cfg.ratio_clip_max) if uses_clip else torch.zeros_like(keep)
        low = keep & neg & (r < 1.0 - cfg.ratio_clip_min) if uses_clip else torch.zeros_like(keep)
        out = {
            "clip_fraction_high": masked_mean(high.to(mask.dtype), mask).item(),
            "clip_fraction_low": masked_mean(low.to(mask.dtype), mask).item(),
            "probs_ratio": masked_mean(r, mask).item(),
        }
        if cfg.use_cispo:
            out["probs_ratio_clamped"] = masked_mean(ratio_clamped.detach(), mask).item()
        if cfg.ratio_clip_c is not None:
            dual = keep & (adv < 0) & (r > cfg.ratio_clip_c) if uses_clip else torch.zeros_like(keep)
            out["dual_clip_fraction"] = masked_mean(dual.to(mask.dtype), mask).item()
        masked_r = r[keep]
        out["probs_ratio_min"] = masked_r.min().item() if masked_r.numel() else float("inf")
        out["probs_ratio_max"] = masked_r.max().item() if masked_r.numel() else float("-inf")
    return out


# --------------------------------------------------------------------------------------------------
# The loss function the training step calls: one micro-batch in, (loss, metrics) out
# --------------------------------------------------------------------------------------------------
# What a loss function may ask the training forward for, beyond the logprobs (its ``needs`` attribute).
LOSS_NEEDS = ("entropy", "logits")


@dataclass(frozen=True)
class LossInputs:
    """What `grpo.system.training.train_step` hands a loss function for one micro-batch.

    ``logprobs_bt``: the policy's token logprobs ``[B, T]`` with grad (the sampler's distribution:
    temperature, top-k / top-p); ``batch``: the micro-batch (`grpo.batch.TrainBatch`, tensors on the
    engine's device: ``advantages_bt``, ``token_mask_bt``, ``sample_mask_b``, ``prev_logprobs_bt``,
    ``ref_logprobs_bt``, ``generation_logprobs_bt``, ``unfiltered_logprobs_bt``, ``rewards_b``, ...); ``cfg``: the
    run's config (`grpo.config.MasterConfig`, or a fork's subclass: its own sections are here);
    ``global_valid_tokens`` / ``global_valid_seqs``: the normalisers of the whole optimizer step
    (`grpo.metrics.global_valid_counts`), so micro-batch losses add up to the step's loss;
    ``global_correct_tokens``: the step's valid tokens of samples with reward > 0 (VAPO's NLL normaliser; set
    only when ``loss_fn.positive_example_nll_weight`` > 0, None otherwise).

    Only when the loss function asks for them (``loss_fn.needs``, see `loss_needs`; the default asks for
    nothing and the forward computes nothing more):
      ``entropy_bt`` ``[B, T]``, with grad: entropy of softmax(logits / temperature) of the distribution
        that produced token t (`grpo.logprobs.aligned_entropy_from_logits`; full vocabulary, no top-k /
        top-p), 0 at position 0 and on padding, computed chunk by chunk like the logprobs;
      ``logits_btv`` ``[B, T, V]``: the model's raw logits (position t predicts token t + 1; not divided by
        the temperature), the tensor the forward made anyway.
    """

    logprobs_bt: torch.Tensor
    batch: TrainBatch
    cfg: MasterConfig
    global_valid_tokens: Normalizer = None
    global_valid_seqs: Normalizer = None
    global_correct_tokens: Normalizer = None
    entropy_bt: Optional[torch.Tensor] = None
    logits_btv: Optional[torch.Tensor] = None

    def aggregate(self, values_bt: torch.Tensor, local: bool = False) -> torch.Tensor:
        """``values_bt`` aggregated like the policy term (`aggregate_loss` with ``loss_fn.token_level_loss`` and
        the step's global normalisers): add ``coef * inputs.aggregate(term_bt)`` to the loss and the
        micro-batch losses still sum to the step's. ``local=True``: with this micro-batch's own normalisers,
        for a metric (the step averages micro-batch metrics)."""
        return aggregate_loss(values_bt, self.batch.token_mask_bt, self.batch.sample_mask_b,
                              self.cfg.loss_fn.token_level_loss, None if local else self.global_valid_tokens,
                              None if local else self.global_valid_seqs)


def clipped_pg_loss_fn(inputs: LossInputs) -> tuple[torch.Tensor, dict]:
    """The training step's default loss: `clipped_pg_loss` of the micro-batch with ``cfg.loss_fn`` and the
    step's global normalisers; VAPO's NLL reads ``batch.rewards_b`` (after penalties, scaling and shaping: what
    NeMo-RL's loss gets as ``rewards``). Without previous-policy logprobs (``force_on_policy_ratio``) the training
    forward's own, detached, stand in. A fork adds a term around it::

        def loss_with_entropy_bonus(x: LossInputs):
            loss, metrics = clipped_pg_loss_fn(x)
            bonus = x.cfg.my_algo.entropy_coef * x.aggregate(x.entropy_bt)
            return loss - bonus, {**metrics, "entropy": x.aggregate(x.entropy_bt.detach(), local=True).item()}
        loss_with_entropy_bonus.needs = ("entropy",)
    """
    mb = inputs.batch
    prev = mb.prev_logprobs_bt if mb.prev_logprobs_bt is not None else inputs.logprobs_bt.detach()
    return clipped_pg_loss(inputs.logprobs_bt, prev, mb.advantages_bt, mb.token_mask_bt, mb.sample_mask_b,
                           inputs.cfg.loss_fn, ref_logprobs=mb.ref_logprobs_bt,
                           generation_logprobs=mb.generation_logprobs_bt,
                           global_valid_tokens=inputs.global_valid_tokens, global_valid_seqs=inputs.global_valid_seqs,
                           unfiltered_logprobs=mb.unfiltered_logprobs_bt, rewards=getattr(mb, "rewards_b", None),
                           global_correct_tokens=inputs.global_correct_tokens)


def loss_needs(loss_fn) -> tuple[str, ...]:
    """What ``loss_fn`` asks the forward for: its ``needs`` attribute (a tuple of `LOSS_NEEDS`; none: ``()``).

        >>> loss_needs(clipped_pg_loss_fn)
        ()
    """
    if loss_fn is clipped_pg_loss:
        raise TypeError("loss_fn=clipped_pg_loss: a loss function takes one grpo.loss.LossInputs; pass "
                        "grpo.loss.clipped_pg_loss_fn (clipped_pg_loss on a LossInputs)")
    needs = getattr(loss_fn, "needs", ())
    needs = (needs,) if isinstance(needs, str) else tuple(needs)
    unknown = [n for n in needs if n not in LOSS_NEEDS]
    if unknown:
        raise ValueError(f"{getattr(loss_fn, '__name__', loss_fn)}.needs={needs!r}: {unknown} unknown; "
                         f"expected names from {list(LOSS_NEEDS)}")
    return needs
