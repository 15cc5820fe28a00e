"""Advantage estimators: per-prompt baselines, GRPO, GDPO, Reinforce++, OPD (distillation), clipping, message penalties.

Shapes: ``prompt_ids`` is ``[B]`` integer group ids (or ``[B, P]`` prompt token rows: equal rows are
one group), ``rewards`` / ``valid_mask`` are ``[B]``, per-token tensors are ``[B, T]``. Every
function is pure torch, never returns NaN, and never modifies its inputs.

    >>> grpo_advantages(torch.tensor([0, 0, 0]), torch.tensor([1.0, 0.0, 0.0]),
    ...                 torch.ones(3), leave_one_out=False, normalize_rewards=False)
    tensor([ 0.6667, -0.3333, -0.3333])
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence, Union

import torch

from grpo.config import AdvEstimatorConfig
from grpo.registry import get_estimator, register_estimator  # noqa: F401  (register_estimator: the fork point)


# --------------------------------------------------------------------------------------------------
# Per-prompt baseline and std
# --------------------------------------------------------------------------------------------------
def group_index(prompt_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map group keys to contiguous ids: ``[B]`` ids or ``[B, P]`` rows -> (``gid[B]`` in 0..G-1, G)."""
    if prompt_ids.dim() == 1:
        _, gid = torch.unique(prompt_ids, return_inverse=True)
    else:
        _, gid = torch.unique(prompt_ids, dim=0, return_inverse=True)
    return gid, int(gid.max().item()) + 1 if gid.numel() else 0


def baseline_and_std_per_prompt(
    prompt_ids: torch.Tensor,
    rewards: torch.Tensor,
    valid_mask: torch.Tensor,
    leave_one_out: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Baseline ``b_i`` and std ``σ_i`` of each sample over its prompt group.

    For a group with n valid samples, S_i = the valid group minus i (leave-one-out) or the whole
    valid group, m = |S_i|:

        b_i = (1/m) Σ_{j∈S_i} r_j          σ_i = sqrt( Σ_{j∈S_i} (r_j − b_i)² / (m − 1) )   (0 if m < 2)

    A group with n ≤ 1 valid samples gets b_i = r_i, σ_i = 0; invalid samples (valid_mask 0) get
    b_i = r_i, σ_i = 0 and never enter their siblings' statistics.

    An S_i whose rewards are all equal (max(S_i) == min(S_i), compared exactly) gets exactly b_i = that
    reward and σ_i = 0: the only correct answer of a group whose other answers agree keeps A_i = r_i − b_i
    under std normalisation instead of (r_i − b_i) / (rounding noise + eps), which was ~10⁵ for rewards
    such as 0.1 / 0.7. NeMo-RL's ``calculate_baseline_and_std_per_prompt`` (utils.py:104-198, E[r²] − E[r]²
    in float32) means the same but leaves such a rounding-noise σ for some values. Elsewhere the sums use
    rewards shifted by a member of their group, in float64; returned in ``rewards.dtype``.

        >>> baseline_and_std_per_prompt(torch.tensor([0, 0, 0]), torch.tensor([1.0, 0.0, 2.0]), torch.ones(3))
        (tensor([1.0000, 1.5000, 0.5000]), tensor([1.4142, 0.7071, 0.7071]))
        >>> baseline_and_std_per_prompt(torch.zeros(4, dtype=torch.long), torch.tensor([0.1, 0.7, 0.1, 0.1]),
        ...                             torch.ones(4))[1]
        tensor([0.3464, 0.0000, 0.3464, 0.3464])
    """
    gid, num_groups = group_index(prompt_ids)
    r = rewards.to(torch.float64)
    valid = valid_mask.bool()
    v = valid.to(torch.float64)

    n_g = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(0, gid, v)
    # Shift by a valid member (the max) of each group: equal rewards give exact zeros below.
    ref_g = torch.zeros(num_groups, dtype=torch.float64, device=r.device).scatter_reduce(
        0, gid[valid], r[valid], reduce="amax", include_self=False
    )
    d = torch.where(valid, r - ref_g[gid], 0.0)
    s1 = torch.zeros_like(n_g).index_add_(0, gid, d)[gid]
    s2 = torch.zeros_like(n_g).index_add_(0, gid, d * d)[gid]
    n = n_g[gid]
    if leave_one_out:
        m, s1, s2 = n - 1, s1 - d, s2 - d * d
    else:
        m = n
    mean_d = s1 / m.clamp(min=1)
    var = ((s2 - m * mean_d * mean_d) / (m - 1).clamp(min=1)).clamp(min=0)
    std = torch.where(m >= 2, var.sqrt(), 0.0)
    baseline = ref_g[gid] + mean_d

    # A constant S_i: exactly its value and std 0 (the sums above can leave rounding noise there).
    hi_b = _set_extreme(gid, r, valid, num_groups, leave_one_out)
    lo_b = -_set_extreme(gid, -r, valid, num_groups, leave_one_out)
    constant = hi_b == lo_b
    baseline = torch.where(constant, hi_b, baseline)
    std = torch.where(constant, 0.0, std)

    own = ~valid | (n <= 1)
    baseline = torch.where(own, r, baseline)
    std = torch.where(own, 0.0, std)
    return baseline.to(rewards.dtype), std.to(rewards.dtype)


def _set_extreme(gid: torch.Tensor, r: torch.Tensor, valid: torch.Tensor, num_groups: int,
                 leave_one_out: bool) -> torch.Tensor:
    """Per sample, max of the valid rewards of its group (leave-one-out: without the sample itself; −inf
    for an empty set). Exact: no arithmetic on the rewards."""
    neg_inf = torch.tensor(float("-inf"), dtype=r.dtype, device=r.device)
    x = torch.where(valid, r, neg_inf)
    top_g = torch.full((num_groups,), float("-inf"), dtype=r.dtype, device=r.device).scatter_reduce(
        0, gid, x, reduce="amax")
    out = top_g[gid]
    if not leave_one_out:
        return out
    is_top = valid & (x == out)
    ties_g = torch.zeros(num_groups, dtype=torch.long, device=r.device).index_add_(0, gid, is_top.long())
    second_g = torch.full((num_groups,), float("-inf"), dtype=r.dtype, device=r.device).scatter_reduce(
        0, gid, torch.where(is_top, neg_inf, x), reduce="amax")
    return torch.where(is_top & (ties_g[gid] == 1), second_g[gid], out)


def prompt_group_ids(input_ids_bt: torch.Tensor, token_mask_bt: torch.Tensor,
                     attention_mask_bt: Optional[torch.Tensor] = None) -> torch.Tensor:
    """THE definition of a group: ids ``[B]`` by prompt content. Samples whose tokens before their first generated
    token are equal share a group, also when they come from different dataloader rows. Every per-group statistic of
    a step reads it (`grpo.batch.TrainBatch.prompt_groups`): the baseline and std of the estimators, the thin groups
    dropped, DAPO's dynamic-sampling filter, the group reward shares and validation's pass@k. Why prompt tokens and
    not the batch position: NeMo-RL keys every estimator's baseline by the initial prompt's token row
    (``prompt_ids_for_adv``, nemo_rl/algorithms/grpo.py:3120-3131 and 3294 at 7ea279a), its dynamic sampling filters
    on the std of that same baseline computation, and its pass@k groups by the prompt tokens
    (``calculate_pass_rate_per_prompt``); one definition means the filter keeps exactly the groups whose advantages
    can be non-zero. A dataset that repeats prompts (DAPO-Math-17k holds each about 100 times) puts some twice in a
    step; their 2n samples then are one group (one baseline and std, kept or dropped together).

    ``attention_mask_bt`` (1 on a row's tokens, 0 on its padding): a row that generated nothing (a sample that
    failed before its first turn) is all prompt, and its padding is no part of it: it joins its prompt's group.

        >>> prompt_group_ids(torch.tensor([[5, 6, 1], [5, 6, 2], [7, 6, 3], [5, 6, 1]]), torch.tensor([[0, 0, 1]] * 4))
        tensor([0, 0, 1, 0])
        >>> prompt_group_ids(torch.tensor([[5, 6, 1], [5, 6, 0]]), torch.tensor([[0, 0, 1], [0, 0, 0]]),
        ...                  torch.tensor([[1, 1, 1], [1, 1, 0]]))
        tensor([0, 0])
    """
    B, T = input_ids_bt.shape
    generated = token_mask_bt > 0
    first = torch.where(generated.any(1), generated.to(torch.long).argmax(1),
                        torch.full((B,), T, dtype=torch.long, device=input_ids_bt.device))
    in_prompt = torch.arange(T, device=input_ids_bt.device)[None, :] < first[:, None]
    if attention_mask_bt is not None:
        in_prompt = in_prompt & (attention_mask_bt > 0)
    return group_index(torch.where(in_prompt, input_ids_bt, -1))[0]


# --------------------------------------------------------------------------------------------------
# Estimators
# --------------------------------------------------------------------------------------------------
def grpo_advantages(
    prompt_ids: torch.Tensor,
    rewards: torch.Tensor,
    valid_mask: torch.Tensor,
    leave_one_out: bool = True,
    normalize_rewards: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantage per sample: A_i = r_i − b_i, divided by (σ_i + eps) only where σ_i > 0.

    Zero-variance groups, singleton groups and invalid samples get A_i = 0 exactly; an invalid sample's reward
    (NaN, inf, a failed sample's 0) never reaches a valid one: the valid samples' advantages equal those of the
    batch with the invalid samples removed, bit for bit.

        >>> grpo_advantages(torch.tensor([0, 0]), torch.tensor([1.0, 0.0]), torch.ones(2), leave_one_out=False)
        tensor([ 0.7071, -0.7071])
        >>> grpo_advantages(torch.tensor([0, 0, 0]), torch.tensor([1.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, 0.0]),
        ...                 leave_one_out=False)
        tensor([ 0.7071, -0.7071,  0.0000])
    """
    baseline, std = baseline_and_std_per_prompt(prompt_ids, rewards, valid_mask, leave_one_out)
    adv_b = rewards - baseline
    if normalize_rewards:
        adv_b = torch.where(std > 0, adv_b / (std + eps), adv_b)
    return torch.where(valid_mask.bool(), adv_b, 0.0)


def drop_thin_groups(prompt_ids: torch.Tensor, valid_mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The valid mask without the groups that masking left with no signal, and how many groups that is.

        valid'_i = valid_i · 1[ n_valid(g_i) ≥ 2  or  n_invalid(g_i) = 0 ]

    A group that lost members (failed or flagged samples) and keeps fewer than two valid ones has no baseline
    to compare with: it is dropped from the step (out of the loss and of every statistic, GDPO's and
    Reinforce++'s global whitening included). A group that lost nobody is kept whatever its size (one
    generation per prompt is a valid Reinforce++ setup). Counted: the groups with an invalid member and fewer
    than two valid ones.

        >>> drop_thin_groups(torch.tensor([0, 0, 1, 1, 2]), torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0]))
        (tensor([False, False,  True,  True,  True]), 1)
    """
    gid, num_groups = group_index(prompt_ids)
    valid = valid_mask.bool()
    n_valid = torch.zeros(num_groups, dtype=torch.long, device=gid.device).index_add_(0, gid, valid.long())
    n_invalid = torch.zeros(num_groups, dtype=torch.long, device=gid.device).index_add_(0, gid, (~valid).long())
    thin_g = (n_invalid > 0) & (n_valid < 2)
    return valid & ~thin_g[gid], int(thin_g.sum().item())


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, *, unbiased: bool = False, var_floor: float = 0.0
) -> torch.Tensor:
    """Global whitening over the masked entries: (x − μ) / sqrt(var), μ and var over mask == 1.

    ``var_floor > 0``: divide by sqrt(max(var, var_floor)) (NeMo-RL's Reinforce++ uses 1e-8).
    ``var_floor == 0``: divide only when var > 0, else just centre (NeMo-RL's GDPO).
    ``unbiased``: var uses n − 1 (0 when n < 2). An empty mask returns zeros. ``mask`` is 0 / 1: μ and var
    are computed over the selected entries alone (in row-major order), so masked-out entries, whatever they
    hold, change nothing, and the result equals that of the batch with them removed, bit for bit.
    """
    selected = values[mask > 0]
    n = selected.numel()
    if n == 0:
        return torch.zeros_like(values)
    mean = selected.sum() / n
    sq = ((selected - mean) ** 2).sum()
    var = sq / (n - 1) if unbiased else sq / n
    if unbiased and n < 2:
        var = torch.zeros_like(var)
    centred = values - mean
    if var_floor > 0:
        return centred * var.clamp(min=var_floor).rsqrt()
    return centred / var.sqrt() if var > 0 else centred


def gdpo_advantages(
    prompt_ids: torch.Tensor,
    reward_components_bk: torch.Tensor,
    valid_mask: torch.Tensor,
    weights: Optional[Sequence[float]] = None,
    leave_one_out: bool = True,
    eps: float = 1e-6,
    normalize_rewards: bool = True,
) -> torch.Tensor:
    """GDPO (multi-reward) advantage per sample.

        A_i = whiten( Σ_k w_k · A_ik ),   A_ik = grpo_advantages(component k)_i

    whiten = (x − μ) / σ over valid samples (μ mean, σ unbiased std; divide only where σ > 0, as
    NeMo-RL). Invalid samples get 0. ``weights`` default to 1 per component. K >= 2 (NeMo-RL: with one
    component GDPO is GRPO plus a global whitening; use grpo).

    Components come penalised, scaled and shaped like the scalar reward
    (`grpo.rewards.process_reward_components`): the environment's components sorted by name, then
    ``overlong`` (the length penalty) when ``grpo.reward_shaping`` uses the overlong buffer.
    """
    if reward_components_bk.dim() != 2:
        raise ValueError(
            f"gdpo_advantages: reward_components_bk must be [B, K], got shape {tuple(reward_components_bk.shape)}"
        )
    num_k = reward_components_bk.shape[1]
    if num_k < 2:
        raise ValueError(
            f"grpo.adv_estimator.name='gdpo' needs at least 2 reward components, got {num_k}. Return a dict of "
            "named rewards from the reward function, or set grpo.adv_estimator.name='grpo'"
        )
    weights = [1.0] * num_k if weights is None else list(weights)
    if len(weights) != num_k:
        raise ValueError(
            f"grpo.adv_estimator.reward_weights has {len(weights)} entries but there are {num_k} reward components "
            "(the environment's, sorted by name, then 'overlong' when grpo.reward_shaping uses the overlong buffer)"
        )
    total_b = torch.zeros(reward_components_bk.shape[0], dtype=reward_components_bk.dtype,
                          device=reward_components_bk.device)
    for k, w_k in enumerate(weights):
        adv_k = grpo_advantages(prompt_ids, reward_components_bk[:, k], valid_mask,
                                leave_one_out, normalize_rewards, eps)
        total_b = total_b + w_k * adv_k
    valid = valid_mask.bool()
    return torch.where(valid, masked_whiten(total_b, valid, unbiased=True), 0.0)


def reverse_cumsum(values_bt: torch.Tensor) -> torch.Tensor:
    """out[b, t] = Σ_{t' ≥ t} values[b, t'] (returns-to-go with γ = 1)."""
    return values_bt.flip(-1).cumsum(-1).flip(-1)


def reinforce_plus_plus_advantages(
    prompt_ids: torch.Tensor,
    rewards: torch.Tensor,
    valid_mask: torch.Tensor,
    token_mask_bt: torch.Tensor,
    minus_baseline: bool = True,
    kl_bt: Optional[torch.Tensor] = None,
    kl_coef: float = 0.0,
    eps: float = 1e-8,
    kl_returns_to_go: bool = False,
    sample_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Reinforce++ per-token advantage, globally whitened over the trained tokens.

        a_i      = r_i − mean_{group, valid}(r)       (minus_baseline; else a_i = r_i)
        A_it     = a_i − kl_coef · Σ_{t' ≥ t} mask·kl_it'     (kl_returns_to_go, Reinforce++ paper / OpenRLHF)
        A_it     = a_i − kl_coef · kl_it                      (kl_returns_to_go=False: NeMo-RL's estimator)
        A        = (A − μ) · rsqrt(max(var, eps))             μ, var (population) over m = token_mask · sample_mask
                                                              · valid_mask;  A = 0 on invalid samples

    As NeMo-RL: the baseline is over the valid samples of the group (samples masked out of the loss,
    by overlong filtering or the logprob-error mask, still count), the whitening statistics only over
    the tokens the loss trains (``sample_mask``, default all ones). ``kl_bt`` is the per-token KL to the
    reference (``grpo.loss.calculate_kl``), passed with ``kl_coef = loss_fn.reference_policy_kl_penalty``
    when ``loss_fn.use_kl_in_reward``.
    """
    if minus_baseline:
        mean_b, _ = baseline_and_std_per_prompt(prompt_ids, rewards, valid_mask, leave_one_out=False)
        adv_b = rewards - mean_b
    else:
        adv_b = rewards
    token_mask = token_mask_bt.to(adv_b.dtype)
    adv_bt = adv_b[:, None].expand(token_mask.shape).clone()
    if kl_bt is not None and kl_coef != 0:
        kl_masked = torch.where(token_mask > 0, kl_bt, 0).to(adv_bt.dtype) * token_mask
        kl_term = reverse_cumsum(kl_masked) if kl_returns_to_go else kl_masked
        adv_bt = adv_bt - kl_coef * kl_term
    mask = token_mask * valid_mask.to(adv_bt.dtype)[:, None]
    if sample_mask is not None:
        mask = mask * sample_mask.to(adv_bt.dtype)[:, None]
    return torch.where(valid_mask.bool()[:, None], masked_whiten(adv_bt, mask, var_floor=eps), 0.0)


# --------------------------------------------------------------------------------------------------
# Registry (grpo.registry): estimators take keyword arguments and return [B] or [B, T]
# --------------------------------------------------------------------------------------------------
def grpo_estimator(*, group_ids, rewards, valid_mask, token_mask, cfg: AdvEstimatorConfig, **extra):
    """``grpo``: `grpo_advantages` with the config's leave-one-out baseline and std normalisation."""
    return grpo_advantages(group_ids, rewards, valid_mask, cfg.use_leave_one_out_baseline, cfg.normalize_rewards)


def gdpo_estimator(*, group_ids, valid_mask, cfg: AdvEstimatorConfig, reward_components=None, **extra):
    """``gdpo``: `gdpo_advantages` on the environment's reward components ``[B, K]``."""
    if reward_components is None:
        raise ValueError("grpo.adv_estimator.name='gdpo' needs reward_components [B, K] from the environment")
    return gdpo_advantages(group_ids, reward_components, valid_mask, cfg.reward_weights,
                           cfg.use_leave_one_out_baseline, normalize_rewards=cfg.normalize_rewards)


def reinforce_plus_plus_estimator(*, group_ids, rewards, valid_mask, token_mask, cfg: AdvEstimatorConfig, kl_bt=None,
                                  kl_coef=0.0, sample_mask=None, **extra):
    """``reinforce_plus_plus``: `reinforce_plus_plus_advantages` with the reward KL when it is on, whitened
    over the loss's samples (``sample_mask``)."""
    return reinforce_plus_plus_advantages(group_ids, rewards, valid_mask, token_mask,
                                          cfg.minus_baseline, kl_bt, kl_coef, kl_returns_to_go=cfg.kl_returns_to_go,
                                          sample_mask=sample_mask)


def opd_advantages(teacher_logprobs_bt: torch.Tensor, prev_logprobs_bt: torch.Tensor,
                   mask_bt: torch.Tensor) -> torch.Tensor:
    """Multi-teacher on-policy distillation (MOPD, arXiv:2601.02780, Eq. 8), NeMo-RL's ``OPDAdvantageEstimator``:

        A_t = sg[log π_teacher(y_t | y_<t) − log π_student(y_t | y_<t)] · mask_t

    The student's logprobs are the previous policy's (the training engine's under the weights that are trained, not
    the generation engine's); ``mask_bt`` is NeMo-RL's ``token_mask · sample_mask[:, None]``. No reward, baseline or
    coefficient enters: the teacher is the signal. (NeMo-RL pairs it with ``loss_fn.disable_ppo_ratio`` and icepop
    importance weights; the loss config says that, not this function.)

        >>> opd_advantages(torch.tensor([[-0.5, -0.5]]), torch.tensor([[-1.0, -2.0]]), torch.tensor([[0.0, 1.0]]))
        tensor([[0.0000, 1.5000]])
    """
    return (teacher_logprobs_bt - prev_logprobs_bt).detach() * mask_bt


def opd_estimator(*, token_mask, valid_mask, teacher_logprobs=None, prev_logprobs=None, sample_mask=None, **extra):
    """``opd``: `opd_advantages` with the teacher's and the previous policy's logprobs ``[B, T]`` over the loss's
    tokens (``token_mask · sample_mask``; ``valid_mask`` where no sample mask is given)."""
    if teacher_logprobs is None:
        raise ValueError("grpo.adv_estimator.name='opd' needs teacher logprobs (on_policy_distillation.enabled=true)")
    if prev_logprobs is None:
        raise ValueError("grpo.adv_estimator.name='opd' needs previous-policy logprobs (the student's), which this run "
                         "skipped")
    rows_b = sample_mask if sample_mask is not None else valid_mask
    return opd_advantages(teacher_logprobs, prev_logprobs, token_mask * rows_b.to(token_mask.dtype)[:, None])


def opd_metrics(teacher_logprobs_bt: torch.Tensor, student_logprobs_bt: torch.Tensor, advantages_bt: torch.Tensor,
                mask_bt: torch.Tensor) -> dict:
    """NeMo-RL's OPD metrics over the masked tokens: the mean teacher − student gap, and the mean and (unbiased) std
    of the advantages (0 where there are too few tokens).

        >>> opd_metrics(torch.tensor([[0.0, -1.0]]), torch.tensor([[-1.0, -1.0]]), torch.tensor([[1.0, 0.0]]),
        ...             torch.ones(1, 2))
        {'on_policy_distillation/teacher_student_logprob_gap_mean': 0.5, 'on_policy_distillation/adv_mean': 0.5, \
'on_policy_distillation/adv_std': 0.7071067690849304}
    """
    valid = mask_bt.bool()
    gap = torch.masked_select(teacher_logprobs_bt - student_logprobs_bt, valid)
    adv = torch.masked_select(advantages_bt, valid)
    return {"on_policy_distillation/teacher_student_logprob_gap_mean": gap.mean().item() if gap.numel() else 0.0,
            "on_policy_distillation/adv_mean": adv.mean().item() if adv.numel() else 0.0,
            "on_policy_distillation/adv_std": adv.std().item() if adv.numel() > 1 else 0.0}


def compute_advantages(
    name: str,
    *,
    group_ids: torch.Tensor,
    rewards: torch.Tensor,
    valid_mask: torch.Tensor,
    token_mask: torch.Tensor,
    cfg: AdvEstimatorConfig,
    **extra,
) -> torch.Tensor:
    """Advantages ``[B, T]`` from the estimator registered as ``name`` (`grpo.registry`).

    Per-sample estimators (grpo, gdpo) are broadcast over the token dimension of ``token_mask``
    (every position of a row holds A_i; the loss masks the untrained ones). ``extra``: the estimator's
    other inputs: ``reward_components``, ``kl_bt``, ``kl_coef``, ``sample_mask`` (the loss's samples:
    Reinforce++'s global whitening runs over them, as NeMo-RL's, and opd masks by them; grpo and gdpo do not read
    it), and ``prev_logprobs`` / ``teacher_logprobs`` / ``generation_logprobs`` ``[B, T]`` (opd reads the first two).
    """
    adv = get_estimator(name)(group_ids=group_ids, rewards=rewards, valid_mask=valid_mask, token_mask=token_mask,
                              cfg=cfg, **extra)
    if adv.dim() == 1:
        adv = adv[:, None].expand(token_mask.shape).contiguous()
    return adv


# --------------------------------------------------------------------------------------------------
# Post-processing
# --------------------------------------------------------------------------------------------------
def clip_advantages(adv: torch.Tensor, low: Optional[float], high: Optional[float]) -> torch.Tensor:
    """clamp(adv, low, high); a None bound does not clip (both None: adv unchanged)."""
    if low is None and high is None:
        return adv
    return adv.clamp(min=low, max=high)


MessageSpan = tuple[int, int, Union[str, Iterable[str], None]]


def apply_message_advantage_penalties(
    advantages_bt: torch.Tensor,
    message_spans: Sequence[Sequence[MessageSpan]],
    flags: Union[str, Iterable[str]],
    value: Optional[float],
) -> torch.Tensor:
    """Overwrite the advantage of every flagged assistant message with ``value``.

    Span format: ``message_spans[b]`` lists the assistant messages of sample b as
    ``(start, end, message_flags)``: the message's tokens are positions ``[start, end)`` of the
    ``[B, T]`` layout, and ``message_flags`` is a flag name, a collection of names, or None. A message
    is overwritten when it carries any name in ``flags`` (e.g. ``"invalid_tool_call"`` with
    ``grpo.invalid_tool_call_advantage``, ``"malformed_thinking"`` with
    ``grpo.malformed_thinking_advantage``). ``value=None`` (the config is off) returns the input.

        >>> apply_message_advantage_penalties(torch.ones(1, 5), [[(1, 3, "invalid_tool_call")]],
        ...                                   "invalid_tool_call", -1.0)
        tensor([[ 1., -1., -1.,  1.,  1.]])
    """
    if value is None:
        return advantages_bt
    if advantages_bt.dim() != 2:
        raise ValueError(f"advantages_bt must be [B, T], got shape {tuple(advantages_bt.shape)}")
    wanted = {flags} if isinstance(flags, str) else set(flags)
    out = advantages_bt.clone()
    for b, spans in enumerate(message_spans):
        for start, end, message_flags in spans:
            names = {message_flags} if isinstance(message_flags, str) else set(message_flags or ())
            if names & wanted:
                out[b, start:end] = value
    return out


def distillation_advantages(student_logprobs_bt: torch.Tensor, teacher_logprobs_bt: torch.Tensor,
                            token_mask_bt: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """On-policy distillation: the per-token reverse KL to a teacher as a (negative) advantage.

        A_t = −kl_coef · (log π_student(y_t | y_<t) − log π_teacher(y_t | y_<t))   on generated tokens, 0 elsewhere

    Added to the RL advantages (``on_policy_distillation.kl_coef``); its expectation under the student's
    own samples is −kl_coef · KL(π_student || π_teacher), so maximising it pulls the student to the teacher.

        >>> distillation_advantages(torch.tensor([[-1.0, -1.0]]), torch.tensor([[-0.5, -0.5]]),
        ...                         torch.tensor([[0.0, 1.0]]), 2.0)
        tensor([[0., 1.]])
    """
    return -kl_coef * (student_logprobs_bt - teacher_logprobs_bt) * token_mask_bt
