"""grpo-ds's math against NeMo-RL at 7ea279a (August 2026), on random inputs.

NeMo-RL's functions are transcribed here (each with its file:line at 7ea279a), not imported: NeMo-RL is not a
dependency. The transcriptions run in float64, so the two sides agree to rounding; where they differ on
purpose, the test says why.
"""

import random

import pytest
import torch

from grpo.advantages import baseline_and_std_per_prompt, compute_advantages, grpo_advantages
from grpo.config import AdvEstimatorConfig


# ----------------------------------------------------------------------------------------------
# NeMo-RL, transcribed
# ----------------------------------------------------------------------------------------------
def nrl_baseline_and_std(prompts, rewards, valid_mask, leave_one_out):
    """nemo_rl/algorithms/utils.py:104-198 calculate_baseline_and_std_per_prompt (std_rewards None)."""
    baseline, std = torch.zeros_like(rewards), torch.zeros_like(rewards)
    for u in torch.unique(prompts, dim=0):
        idx = torch.arange(len(prompts))[(prompts == u).all(1)]
        m = (1 - torch.eye(len(idx), dtype=rewards.dtype)) if leave_one_out else torch.ones(
            len(idx), len(idx), dtype=rewards.dtype)
        if valid_mask[idx].sum() <= 1:
            baseline[idx] = rewards[idx]
            continue
        num_valid = valid_mask[idx].sum() - int(leave_one_out)
        pb = m @ (rewards[idx] * valid_mask[idx]) / num_valid
        sq = m @ (rewards[idx] ** 2 * valid_mask[idx]) / num_valid
        baseline[idx] = pb
        std[idx] = ((sq - pb.square()) * (num_valid / (num_valid - 1))).sqrt().nan_to_num(0)
    return baseline, std


def nrl_grpo(prompts, rewards, leave_one_out, normalize_rewards):
    """nemo_rl/algorithms/advantage_estimator.py:69-98 GRPOAdvantageEstimator.compute_advantage ([B] out)."""
    base, std = nrl_baseline_and_std(prompts, rewards, torch.ones_like(rewards), leave_one_out)
    adv = rewards - base
    if normalize_rewards:
        nz = std > 0
        adv[nz] = adv[nz] / (std[nz] + 1e-6)
    return adv


def random_groups(rng, gen):
    """(group ids [B], prompt token rows [B, 3], rewards [B] float64): 1-5 groups of 1-6 samples, rows shuffled,
    rewards binary, from a few partial-credit values, or continuous."""
    sizes = [rng.randint(1, 6)] * rng.randint(1, 5) if rng.random() < 0.7 else [rng.randint(1, 6) for _ in range(4)]
    gid = torch.tensor([g for g, n in enumerate(sizes) for _ in range(n)])
    gid = gid[torch.randperm(len(gid), generator=gen)]
    kind = rng.choice(["binary", "few", "continuous"])
    if kind == "binary":
        r = (torch.rand(len(gid), generator=gen) < 0.5).double()
    elif kind == "few":
        r = torch.tensor([rng.choice([0.0, 0.1, 0.7, 1.0, 1 / 3]) for _ in gid], dtype=torch.float64)
    else:
        r = torch.randn(len(gid), generator=gen, dtype=torch.float64) * rng.choice([0.01, 1.0, 10.0])
    rows = torch.randint(0, 1000, (len(sizes), 3), generator=gen)[gid]
    return gid, rows, r


# ----------------------------------------------------------------------------------------------
# Baseline / std and the GRPO estimator
# ----------------------------------------------------------------------------------------------
def test_baseline_std_and_grpo_match_nemo_rl_on_random_groups():
    """300 random batches: baseline and std of every valid sample, and the GRPO advantage, as NeMo-RL's.

    Invalid samples (valid_mask 0) differ on purpose and are not compared: both trainers pass valid = 1 everywhere
    (NeMo-RL: grpo.py:3056-3075 and advantage_estimator.py:84), and NeMo-RL's rows for them divide a sum over the
    valid samples by (valid count − 1), not a mean; grpo-ds gives them b = r, σ = 0 (the math contract).
    """
    for seed in range(300):
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        gid, rows, r = random_groups(rng, gen)
        loo, norm = rng.random() < 0.6, rng.random() < 0.7
        valid = (torch.rand(len(r), generator=gen) < 0.75).double() if rng.random() < 0.5 else torch.ones_like(r)
        b_n, s_n = nrl_baseline_and_std(rows, r, valid, loo)
        b_g, s_g = baseline_and_std_per_prompt(gid, r, valid, leave_one_out=loo)
        v = valid.bool()
        torch.testing.assert_close(b_g[v], b_n[v], rtol=1e-9, atol=1e-9, msg=f"seed {seed}")
        torch.testing.assert_close(s_g[v], s_n[v], rtol=1e-7, atol=1e-7, msg=f"seed {seed}")
        cfg = AdvEstimatorConfig(name="grpo", use_leave_one_out_baseline=loo, normalize_rewards=norm)
        adv = compute_advantages("grpo", group_ids=gid, rewards=r, valid_mask=torch.ones_like(r),
                                 token_mask=torch.ones(len(r), 2), cfg=cfg)
        expected = nrl_grpo(rows, r, loo, norm)
        # where NeMo-RL's own float64 rounding leaves a noise std on a constant set (see the next test), skip
        noise = (s_n > 0) & (s_n < 1e-6)
        torch.testing.assert_close(adv[~noise, 0], expected[~noise], rtol=1e-6, atol=1e-6, msg=f"seed {seed}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_constant_leave_one_out_set_has_std_exactly_zero(dtype):
    """The only correct answer of a group whose other answers agree: its leave-one-out set is constant, so σ = 0
    and A = r − b, NeMo-RL's intent ("don't sharpen the ones with no variation", advantage_estimator.py:87-93).

    E[r²] − E[r]² in floating point leaves a noise σ ~ 1e-9 for rewards like 0.1 / 0.7 (NeMo-RL, and grpo-ds's
    shifted sums before: the shift was by the group's max, which is not in the sample's own set), and then
    A = 0.6 / (1e-9 + 1e-6) ≈ 6e5. Every such pair of values and group size gives exactly 0 now.
    """
    values = [0.1, 0.2, 0.3, 0.7, 0.9, 1 / 3, -0.5, 0.05, 2.5, 1e-3]
    nrl_blowups = 0
    for w in values:
        for v in values:
            if v == w:
                continue
            for n in (2, 3, 4, 8, 16):
                r = torch.tensor([w] + [v] * (n - 1), dtype=dtype)
                b, s = baseline_and_std_per_prompt(torch.zeros(n, dtype=torch.long), r, torch.ones(n, dtype=dtype))
                assert s[0] == 0 and b[0] == r[1], (w, v, n)
                adv = grpo_advantages(torch.zeros(n, dtype=torch.long), r, torch.ones(n, dtype=dtype))
                assert adv[0] == r[0] - r[1]
                assert adv.abs().max() < 1e3
                if n > 2:  # the others: S_i = {w, v, ...}, non-constant, NeMo-RL's values
                    expected = nrl_grpo(torch.zeros(n, 1), r.double(), True, True)
                    torch.testing.assert_close(adv[1:].double(), expected[1:], rtol=1e-4, atol=1e-4)
                nrl_blowups += int(nrl_grpo(torch.zeros(n, 1), r, True, True).abs().max() > 1e3)
    assert nrl_blowups > 0  # NeMo-RL's formula, in the same dtype, does blow up on some of these


# ----------------------------------------------------------------------------------------------
# GDPO and Reinforce++
# ----------------------------------------------------------------------------------------------
def nrl_gdpo(prompts, components, weights, leave_one_out, normalize_rewards):
    """nemo_rl/algorithms/advantage_estimator.py:116-190 GDPOAdvantageEstimator.compute_advantage ([B] out)."""
    parts = [nrl_grpo(prompts, r, leave_one_out, normalize_rewards) for r in components]
    adv = sum(w * a for w, a in zip(weights, parts))
    s = adv.std()
    return (adv - adv.mean()) / s if s > 0 else adv - adv.mean()


def nrl_kl(logprobs, ref, kl_type, input_clamp=20.0, output_clamp=10.0):
    """nemo_rl/algorithms/utils.py:42-101 calculate_kl (no importance weights)."""
    logr = (ref - logprobs).clamp(-input_clamp, input_clamp)
    kl = {"k1": -logr, "k2": logr.square() / 2, "k3": torch.exp(logr) - 1 - logr}[kl_type]
    return kl.clamp(-output_clamp, output_clamp)


def nrl_reinforce_pp(prompts, rewards, mask, minus_baseline, kl_coef=0.0, prev=None, ref=None, kl_type="k3"):
    """nemo_rl/algorithms/advantage_estimator.py:209-267 ReinforcePlusPlusAdvantageEstimator.compute_advantage;
    mask = token_mask · sample_mask (grpo.py:3290-3299), KL from prev_logprobs with calculate_kl's default clamps."""
    adv = rewards - nrl_baseline_and_std(prompts, rewards, torch.ones_like(rewards), False)[0] if minus_baseline \
        else rewards
    adv = adv.unsqueeze(-1).expand(mask.shape)
    if prev is not None:
        adv = adv - kl_coef * nrl_kl(prev, ref, kl_type)
    mean = (adv * mask).sum() / mask.sum()
    var = ((adv - mean).pow(2) * mask).sum() / mask.sum()
    return (adv - mean) * var.clamp(min=1e-8).rsqrt()


@pytest.mark.filterwarnings("ignore:std\\(\\)")  # one-sample batches: NeMo-RL's adv.std() is nan there (no whitening)
def test_gdpo_and_reinforce_pp_match_nemo_rl_on_random_groups():
    """300 random batches each: GDPO (K = 2-4 components, weights or none) and Reinforce++ (baseline or not, KL in
    the reward or not) as NeMo-RL's. GDPO batches whose weighted sum is 0 up to rounding (components that cancel
    exactly) are skipped: both sides then whiten rounding noise into ±1-sized values, not comparable; so are those
    where NeMo-RL's own rounding leaves a noise std on a constant leave-one-out set (the previous test)."""
    gdpo_cases = 0
    for seed in range(300):
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        gid, rows, r = random_groups(rng, gen)
        B, T = len(r), rng.randint(1, 5)
        loo, norm = rng.random() < 0.6, rng.random() < 0.7
        K = rng.randint(2, 4)
        comps = torch.stack([(torch.rand(B, generator=gen) < 0.5).double() * rng.choice([1.0, 0.5, 0.3])
                             for _ in range(K)], dim=1)
        weights = None if rng.random() < 0.5 else [rng.choice([0.5, 1.0, 2.0]) for _ in range(K)]
        expected = nrl_gdpo(rows, list(comps.T), weights or [1.0] * K, loo, norm)
        raw_sum = sum(w * nrl_grpo(rows, c, loo, norm) for w, c in zip(weights or [1.0] * K, comps.T))
        stds = torch.stack([nrl_baseline_and_std(rows, c, torch.ones_like(c), loo)[1] for c in comps.T])
        if 0 < raw_sum.std() < 1e-9 or (norm and ((stds > 0) & (stds < 1e-6)).any()):
            continue  # cancelling components, or NeMo-RL's noise std on a constant set (see above)
        gdpo_cases += 1
        cfg = AdvEstimatorConfig(name="gdpo", use_leave_one_out_baseline=loo, normalize_rewards=norm,
                                 reward_weights=weights)
        adv = compute_advantages("gdpo", group_ids=gid, rewards=r, valid_mask=torch.ones_like(r),
                                 token_mask=torch.ones(B, T), cfg=cfg, reward_components=comps)
        torch.testing.assert_close(adv[:, 0], expected, rtol=1e-6, atol=1e-6, msg=f"gdpo seed {seed}")

        token_mask = (torch.rand(B, T, generator=gen) < 0.8).double()
        sample_mask = (torch.rand(B, generator=gen) < 0.8).double()
        mask = token_mask * sample_mask[:, None]
        if not mask.any():
            continue
        minus_baseline, kl_type = rng.random() < 0.6, rng.choice(["k1", "k2", "k3"])
        prev = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
        ref = prev + torch.randn(B, T, generator=gen, dtype=torch.float64) * rng.choice([0.1, 3.0, 30.0])
        kl_coef = rng.choice([0.0, 0.01, 0.5])
        expected = nrl_reinforce_pp(rows, r, mask, minus_baseline, kl_coef, prev, ref, kl_type)
        from grpo.loss import calculate_kl
        adv = compute_advantages("reinforce_plus_plus", group_ids=gid, rewards=r, valid_mask=torch.ones_like(r),
                                 token_mask=token_mask, cfg=AdvEstimatorConfig(name="reinforce_plus_plus",
                                                                               minus_baseline=minus_baseline),
                                 kl_bt=calculate_kl(prev, ref, kl_type), kl_coef=kl_coef, sample_mask=sample_mask)
        m = mask.bool()
        torch.testing.assert_close(adv[m], expected[m], rtol=1e-6, atol=1e-6, msg=f"reinforce++ seed {seed}")
    assert gdpo_cases > 200


# ----------------------------------------------------------------------------------------------
# Sequence logprob-error masking
# ----------------------------------------------------------------------------------------------
def nrl_seq_logprob_error_masking(token_mask, sample_mask, prev, gen, rewards, threshold):
    """nemo_rl/algorithms/grpo.py:2513-2631 compute_and_apply_seq_logprob_error_masking (tensors already aligned):
    (new sample_mask, metrics)."""
    mask = token_mask * sample_mask.unsqueeze(-1)
    denom = mask.sum(dim=-1)
    valid_seq = denom > 0
    err = torch.zeros_like(denom)
    num = (torch.exp((gen - prev).abs() * mask) * mask).sum(dim=-1)
    err[valid_seq] = num[valid_seq] / denom[valid_seq].clamp(min=1)
    stats = lambda x: (x.max().item(), x.mean().item(), x.min().item()) if x.numel() else (0.0, 0.0, 0.0)  # noqa: E731
    before = stats(err[valid_seq])
    after, num_masked, pct, new = before, 0, 0.0, sample_mask
    if threshold is not None:
        new = (err <= threshold).double() * sample_mask
        diff = sample_mask - new
        num_masked = int(diff.sum().item())
        if num_masked:
            pct = int((rewards[diff.bool()] == 1).sum().item()) / num_masked
        after = stats(err[new.bool() & valid_seq])
    return new, {"num_masked_seqs_by_logprob_error": num_masked, "masked_correct_pct": pct,
                 "max_seq_mult_prob_error": before[0], "mean_seq_mult_prob_error": before[1],
                 "min_seq_mult_prob_error": before[2], "max_seq_mult_prob_error_after_mask": after[0],
                 "mean_seq_mult_prob_error_after_mask": after[1], "min_seq_mult_prob_error_after_mask": after[2]}


def test_seq_logprob_error_masking_matches_nemo_rl_on_random_batches():
    """300 random batches (some samples already masked, some with no generated token): the new sample mask and
    every metric as NeMo-RL's, under NeMo-RL's keys."""
    from grpo.logprobs import mask_by_seq_logprob_error

    for seed in range(300):
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        B, T = rng.randint(1, 6), rng.randint(1, 6)
        token_mask = (torch.rand(B, T, generator=gen) < 0.7).double()
        sample_mask = (torch.rand(B, generator=gen) < 0.8).double()
        prev = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
        glp = prev + torch.randn(B, T, generator=gen, dtype=torch.float64) * rng.choice([0.01, 0.3, 1.0])
        rewards = torch.tensor([rng.choice([0.0, 1.0, 0.5]) for _ in range(B)], dtype=torch.float64)
        threshold = rng.choice([None, 1.01, 1.2, 2.0])
        new_n, m_n = nrl_seq_logprob_error_masking(token_mask, sample_mask, prev, glp, rewards, threshold)
        new_g, m_g = mask_by_seq_logprob_error(glp, prev, token_mask, sample_mask, rewards, threshold)
        torch.testing.assert_close(new_g, new_n, msg=f"seed {seed}")
        assert m_g == pytest.approx(m_n, rel=1e-9, abs=1e-12), seed


def test_a_down_weighted_sequence_is_scored_by_its_own_error_not_by_its_weight():
    """NeMo-RL#4171 (open after 7ea279a): NeMo-RL scores a sequence with exp(|gen − prev| · w) under the mask
    token_mask · w, so a sample weight w < 1 shrinks its error and lets it pass the threshold more easily. grpo-ds
    keeps its own on purpose (docs/nemo_rl.md, differences): the weight decides how much a kept sequence trains,
    not whether it is kept; e_b is the mean of exp(|gen − prev|) over the sequence's tokens, the same at every
    w > 0, and masking keeps the weight of a kept sequence (as NeMo-RL does). With 0/1 masks the two agree (the
    test above); num_masked_seqs_by_logprob_error counts sequences (NeMo-RL sums the dropped weights)."""
    from grpo.logprobs import mask_by_seq_logprob_error

    token_mask = torch.ones(3, 4, dtype=torch.float64)
    prev = torch.full((3, 4), -1.0, dtype=torch.float64)
    gen = prev + torch.tensor([[0.5], [0.5], [0.01]], dtype=torch.float64)  # e = exp(0.5) = 1.65 for rows 0 and 1
    rewards = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)
    for w in (1.0, 0.5, 0.25):
        sample_mask = torch.tensor([1.0, w, w], dtype=torch.float64)
        new, metrics = mask_by_seq_logprob_error(gen, prev, token_mask, sample_mask, rewards, threshold=1.5)
        assert new.tolist() == [0.0, 0.0, w], w  # rows 0 and 1 dropped alike; row 2 kept with its weight
        assert metrics["num_masked_seqs_by_logprob_error"] == 2 and metrics["masked_correct_pct"] == 1.0
        assert metrics["max_seq_mult_prob_error"] == pytest.approx(torch.tensor(0.5).exp().item())
    nrl_new, _ = nrl_seq_logprob_error_masking(token_mask, sample_mask, prev, gen, rewards, 1.5)
    assert nrl_new.tolist() == [0.0, 0.25, 0.25]  # NeMo-RL at w = 0.25: exp(0.5 · 0.25) = 1.13 passes 1.5


# ----------------------------------------------------------------------------------------------
# ClippedPGLossFn: loss value, gradient, and the engine-mismatch metrics
# ----------------------------------------------------------------------------------------------
def nrl_masked_mean(values, mask, dim=None, global_normalization_factor=None):
    """nemo_rl/algorithms/utils.py:212-224 masked_mean."""
    norm = torch.sum(mask, dim=dim) if global_normalization_factor is None else global_normalization_factor
    return torch.sum(values * mask, dim=dim) / (norm + 1e-8)


def nrl_calculate_kl(logprobs, ref, kl_type, input_clamp, output_clamp, weights=None):
    """nemo_rl/algorithms/utils.py:42-101 calculate_kl."""
    logr = ref - logprobs
    if input_clamp is not None:
        clamped = logr.clamp(-input_clamp, input_clamp)
        if weights is not None:
            weights = torch.where(logr == clamped, weights, weights.detach())
        logr = clamped
    kl = {"k1": -logr, "k2": logr.square() / 2, "k3": torch.exp(logr) - 1 - logr}[kl_type]
    if weights is not None:
        kl = weights * kl
    return kl if output_clamp is None else kl.clamp(-output_clamp, output_clamp)


def nrl_clipped_pg_loss(c, curr, prev, gen, ref, adv, token_mask, sample_mask, gvt, gvs):
    """nemo_rl/algorithms/loss/loss_functions.py:374-789 ClippedPGLossFn.__call__ (no CISPO, no NLL; inputs already
    shifted): (loss, {gen_kl_error, policy_kl_error, js_divergence_error})."""
    mask = token_mask * sample_mask.unsqueeze(-1)
    token_level = c["token_level_loss"]

    def reduce(x, n_tok=gvt, n_seq=gvs):
        if token_level:
            return nrl_masked_mean(x, mask, global_normalization_factor=n_tok)
        return nrl_masked_mean(nrl_masked_mean(x, token_mask, dim=-1), sample_mask, global_normalization_factor=n_seq)

    if c["force_on_policy_ratio"]:
        prev = curr.detach()
    kl_type = c["reference_policy_kl_type"]
    metrics = {  # :414-466
        "gen_kl_error": nrl_masked_mean(nrl_calculate_kl(gen, prev, kl_type, None, None), mask).item(),
        "policy_kl_error": nrl_masked_mean(nrl_calculate_kl(prev, gen, kl_type, None, None), mask).item(),
    }
    log_mix = torch.log(0.5 * torch.exp(prev) + 0.5 * torch.exp(gen))
    js = 0.5 * (torch.exp(prev - log_mix) - (prev - log_mix) - 1) + 0.5 * (torch.exp(gen - log_mix) - (gen - log_mix) - 1)
    metrics["js_divergence_error"] = nrl_masked_mean(js, mask).item()
    beta = 0.0 if c["use_kl_in_reward"] else c["reference_policy_kl_penalty"]
    kl = 0.0
    if beta != 0:  # :468-510
        w = torch.exp(curr - gen) if c["use_on_policy_kl_approximation"] else torch.exp(curr - curr.detach())
        w = torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)
        kl = reduce(beta * nrl_calculate_kl(curr, ref, kl_type, 20.0, 10.0, w))
    if c["force_on_policy_ratio"]:  # :512-540
        ratios = torch.exp(curr - curr.detach())
        clamped = ratios
    elif not c["disable_ppo_ratio"]:
        log_ratios = curr - prev
        if c["sequence_level_importance_ratios"]:
            ratios = nrl_masked_mean(log_ratios, token_mask, dim=-1).unsqueeze(-1).exp().repeat(1, adv.shape[1])
        else:
            ratios = log_ratios.exp()
        clamped = ratios.clamp(1.0 - c["ratio_clip_min"], 1.0 + c["ratio_clip_max"])
    else:
        ratios = clamped = curr
    clip_loss = torch.max(-adv * ratios, -adv * clamped)
    if c["ratio_clip_c"] is not None:
        clip_loss = torch.where(adv < 0, torch.min(clip_loss, -adv * c["ratio_clip_c"]), clip_loss)
    if c["sequence_level_importance_ratios"]:  # :556-654
        iw = torch.nan_to_num(torch.exp(((prev - gen) * mask).sum(-1)).detach(), nan=0.0, posinf=0.0,
                              neginf=0.0).unsqueeze(-1)
    else:
        iw = torch.nan_to_num(torch.exp(prev - gen), nan=0.0, posinf=0.0, neginf=0.0)
    kind, hi, lo = (c["truncated_importance_sampling_type"], c["truncated_importance_sampling_ratio"],
                    c["truncated_importance_sampling_ratio_min"])
    if kind == "tis":
        iw = iw.clamp(min=0.0 if lo is None else lo, max=hi)
    elif kind == "icepop":
        iw = torch.where((iw >= lo) & (iw <= hi), iw, torch.zeros_like(iw))
    elif kind == "seq-mask-tis":
        log_is = torch.nan_to_num(prev - gen, nan=0.0, posinf=0.0, neginf=0.0)
        geo = torch.exp(nrl_masked_mean(log_is, token_mask, dim=-1)).detach()
        iw = iw * ((geo >= lo) & (geo <= hi)).double().unsqueeze(-1)
    if not c["use_importance_sampling_correction"]:
        iw = torch.ones_like(prev)
    return reduce(iw * clip_loss) + kl, metrics


def random_loss_config(rng):
    c = {"token_level_loss": rng.random() < 0.6}
    c["sequence_level_importance_ratios"] = not c["token_level_loss"] and rng.random() < 0.4
    c["disable_ppo_ratio"] = rng.random() < 0.15
    c["force_on_policy_ratio"] = not c["disable_ppo_ratio"] and rng.random() < 0.15
    c["ratio_clip_min"], c["ratio_clip_max"] = rng.choice([0.1, 0.2]), rng.choice([0.2, 0.28])
    c["ratio_clip_c"] = rng.choice([None, 3.0, 1.5])
    c["reference_policy_kl_penalty"] = rng.choice([0.0, 0.01, 0.5])
    c["reference_policy_kl_type"] = rng.choice(["k1", "k2", "k3"])
    c["use_kl_in_reward"] = rng.random() < 0.1
    c["use_on_policy_kl_approximation"] = rng.random() < 0.3
    c["use_importance_sampling_correction"] = rng.random() < 0.5
    c["truncated_importance_sampling_type"] = c["truncated_importance_sampling_ratio"] = None
    c["truncated_importance_sampling_ratio_min"] = None
    if c["use_importance_sampling_correction"] and rng.random() < 0.7:
        kind = rng.choice(["tis", "icepop"] + ([] if c["sequence_level_importance_ratios"] else ["seq-mask-tis"]))
        c["truncated_importance_sampling_type"] = kind
        c["truncated_importance_sampling_ratio"] = rng.choice([1.05, 2.0, 5.0])
        if kind != "tis" or rng.random() < 0.5:
            c["truncated_importance_sampling_ratio_min"] = rng.choice([0.5, 0.9, 0.97])
    return c


def test_clipped_pg_loss_matches_nemo_rl_on_random_configs():
    """200 random configs and batches (global normalisers above the batch's own counts, [B] and [B, T]
    advantages): the loss and its gradient as NeMo-RL's, and gen_kl_error / policy_kl_error / js_divergence_error.

    The metrics that differ on purpose are not compared: under disable_ppo_ratio NeMo-RL's probs_ratio* are of its
    "ratio", the logprob itself (grpo-ds: exp(lp − prev)); with sequence-level ratios NeMo-RL's
    sampling_importance_ratio is Σ_i w_i · Σ_j s_j / global_valid_seqs (a [B, 1] × [B] broadcast), grpo-ds the
    masked mean of w."""
    from grpo.config import ClippedPGLossConfig
    from grpo.loss import clipped_pg_loss

    for seed in range(200):
        rng, gen_ = random.Random(seed), torch.Generator().manual_seed(seed)
        c = random_loss_config(rng)
        B, T = rng.randint(1, 5), rng.randint(2, 7)
        lp0 = -torch.rand(B, T, generator=gen_, dtype=torch.float64) * 3
        prev = lp0 + torch.randn(B, T, generator=gen_, dtype=torch.float64) * rng.choice([0.05, 0.3, 1.0])
        glp = prev + torch.randn(B, T, generator=gen_, dtype=torch.float64) * rng.choice([0.01, 0.1, 0.5])
        ref = lp0 + torch.randn(B, T, generator=gen_, dtype=torch.float64) * rng.choice([0.1, 1.0, 25.0])
        adv = torch.randn(B, T, generator=gen_, dtype=torch.float64) if rng.random() < 0.3 else \
            torch.randn(B, 1, generator=gen_, dtype=torch.float64).expand(B, T)
        tm = (torch.rand(B, T, generator=gen_) < 0.7).double()
        sm = (torch.rand(B, generator=gen_) < 0.8).double()
        gvt = torch.tensor(float((tm * sm[:, None]).sum() + rng.choice([0, 3])), dtype=torch.float64)
        gvs = torch.tensor(float(sm.sum() + rng.choice([0, 2])), dtype=torch.float64)
        lp_n, lp_g = lp0.clone().requires_grad_(True), lp0.clone().requires_grad_(True)
        loss_n, m_n = nrl_clipped_pg_loss(c, lp_n, prev, glp, ref, adv, tm, sm, gvt, gvs)
        loss_g, m_g = clipped_pg_loss(lp_g, prev, adv, tm, sm, ClippedPGLossConfig(**c), ref_logprobs=ref,
                                      generation_logprobs=glp, global_valid_tokens=gvt, global_valid_seqs=gvs)
        torch.testing.assert_close(loss_g, loss_n, rtol=1e-6, atol=1e-9, msg=f"seed {seed}: {c}")
        (grad_n,), (grad_g,) = torch.autograd.grad(loss_n, lp_n), torch.autograd.grad(loss_g, lp_g)
        keep = (tm * sm[:, None]).bool()
        torch.testing.assert_close(grad_g[keep], grad_n[keep], rtol=1e-6, atol=1e-9, msg=f"seed {seed}: {c}")
        if keep.any():
            for key in ("gen_kl_error", "policy_kl_error", "js_divergence_error"):
                assert m_g[key] == pytest.approx(m_n[key], rel=1e-6, abs=1e-9), (seed, key)


# ----------------------------------------------------------------------------------------------
# Groups by prompt content
# ----------------------------------------------------------------------------------------------
def test_a_prompt_that_comes_twice_in_a_step_is_one_group_as_nemo_rl():
    """NeMo-RL keys the baseline by the initial prompt's tokens (grpo.py:3120-3131, prompt_ids_for_adv, passed to
    the estimator at :3294), so two dataloader rows with the same prompt (DAPO-Math-17k repeats each prompt ~100
    times) share one group of 2n. compose_advantages groups the same way: 100 random steps with repeated prompts."""
    from grpo.advantages import prompt_group_ids
    from grpo.batch import build_batch
    from grpo.config.load import build_config
    from grpo.step import compose_advantages
    from grpo.trajectory import Message, Trajectory

    for seed in range(100):
        rng = random.Random(seed)
        loo, norm = rng.random() < 0.5, rng.random() < 0.7
        cfg = build_config({"grpo": {"use_leave_one_out_baseline": loo, "normalize_rewards": norm}})
        prompts = [[1, 5], [1, 5, 6], [2, 5]]
        n = rng.randint(2, 4)
        groups = [rng.choice(prompts) for _ in range(rng.randint(2, 5))]  # dataloader rows, prompts may repeat
        trajs = []
        for gid, prompt in enumerate(groups):
            for _ in range(n):
                ids = [rng.randint(7, 20) for _ in range(rng.randint(1, 3))]
                messages = [Message("user", "p", list(prompt)), Message("assistant", "a", ids, [-0.5] * len(ids))]
                trajs.append(Trajectory(gid, gid, "t", "q", "a", messages, {}, reward=rng.choice([0.0, 0.5, 1.0]),
                                        turns=1, num_prompt_messages=1))
        batch = build_batch(trajs, pad_id=0)
        adv, _, _ = compose_advantages(cfg, batch)
        rows = torch.full((len(trajs), 3), -1)
        for i, t in enumerate(trajs):
            rows[i, :len(t.messages[0].token_ids)] = torch.tensor(t.messages[0].token_ids)
        expected = nrl_grpo(rows, batch.rewards_b.double(), loo, norm)
        torch.testing.assert_close(adv[:, 0].double(), expected, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
        num_prompts = len(torch.unique(prompt_group_ids(batch.input_ids_bt, batch.token_mask_bt)))
        assert num_prompts == len(set(map(tuple, groups)))
