"""grpo.loss against hand-computed values, a scalar-loop reference of the contract, and properties."""

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from grpo.config import ClippedPGLossConfig
from grpo.loss import aggregate_loss, calculate_kl, clipped_pg_loss, importance_weights, masked_mean
from grpo.metrics import global_valid_counts

LOG = math.log


def cfg_(**kw) -> ClippedPGLossConfig:
    kw.setdefault("reference_policy_kl_penalty", 0.0)
    return ClippedPGLossConfig(**kw)


# ----------------------------------------------------------------------------------------------
# KL and aggregation
# ----------------------------------------------------------------------------------------------
def test_kl_estimators_by_hand():
    lp, ref = torch.tensor([0.0, -1.0]), torch.tensor([-1.0, -1.0])  # logr = [-1, 0]
    torch.testing.assert_close(calculate_kl(lp, ref, "k1"), torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(calculate_kl(lp, ref, "k2"), torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(calculate_kl(lp, ref, "k3"), torch.tensor([math.exp(-1), 0.0]))


def test_kl_clamps():
    lp, ref = torch.tensor([0.0]), torch.tensor([30.0])  # logr = 30 -> clamp 20 -> k3 = e^20 - 21 -> clamp 10
    assert calculate_kl(lp, ref, "k3").item() == 10.0
    assert calculate_kl(lp, ref, "k1").item() == -10.0  # -20 clamped to -10
    assert calculate_kl(lp, ref, "k1", input_clamp=5.0, output_clamp=None).item() == -5.0
    assert calculate_kl(lp, ref, "k1", input_clamp=None, output_clamp=None).item() == -30.0
    with pytest.raises(ValueError, match="k1"):
        calculate_kl(lp, ref, "k4")


def test_masked_mean_ignores_masked_nonfinite():
    v = torch.tensor([[1.0, 3.0, float("nan")], [float("inf"), 5.0, 7.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    torch.testing.assert_close(masked_mean(v, m), torch.tensor(4.0))
    torch.testing.assert_close(masked_mean(v, m, dim=-1), torch.tensor([2.0, 6.0]))
    torch.testing.assert_close(masked_mean(v, m, normalizer=8), torch.tensor(2.0))
    assert masked_mean(v, torch.zeros_like(m)).item() == 0.0


def test_aggregate_token_and_sequence_level_by_hand():
    v = torch.tensor([[1.0, 2.0, 3.0], [10.0, 0.0, 0.0], [100.0, 100.0, 100.0]])
    tm = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    sm = torch.tensor([1.0, 1.0, 0.0])
    torch.testing.assert_close(aggregate_loss(v, tm, sm, True), torch.tensor(16.0 / 4))
    torch.testing.assert_close(aggregate_loss(v, tm, sm, False), torch.tensor((2.0 + 10.0) / 2))
    torch.testing.assert_close(aggregate_loss(v, tm, sm, True, global_valid_tokens=8), torch.tensor(2.0))
    torch.testing.assert_close(aggregate_loss(v, tm, sm, False, global_valid_seqs=4), torch.tensor(3.0))


# ----------------------------------------------------------------------------------------------
# clipped_pg_loss: hand-computed cases
# ----------------------------------------------------------------------------------------------
def _loss(lp, prev, adv, cfg, tm=None, sm=None, **kw):
    lp = torch.tensor(lp, requires_grad=True)
    prev = torch.tensor(prev) if prev is not None else None
    adv = torch.tensor(adv)
    tm = torch.ones_like(lp) if tm is None else torch.tensor(tm)
    sm = torch.ones(lp.shape[0]) if sm is None else torch.tensor(sm)
    loss, metrics = clipped_pg_loss(lp, prev, adv, tm, sm, cfg, **kw)
    loss.backward()
    return loss, metrics, lp.grad


def test_unclipped_ratio_loss_and_gradient():
    loss, m, grad = _loss([[LOG(1.1), LOG(0.9)]], [[0.0, 0.0]], [[1.0, -1.0]], cfg_())
    torch.testing.assert_close(loss, torch.tensor((-1.1 + 0.9) / 2))
    torch.testing.assert_close(grad, torch.tensor([[-1.1 / 2, 0.9 / 2]]))  # d(-A e^lp)/dlp = -A r
    assert m["clip_fraction_high"] == 0 and m["clip_fraction_low"] == 0
    assert m["probs_ratio_min"] == pytest.approx(0.9) and m["probs_ratio_max"] == pytest.approx(1.1)
    assert m["probs_ratio"] == pytest.approx(1.0)


def test_clipped_both_sides_no_gradient():
    loss, m, grad = _loss([[LOG(1.5), LOG(0.5)]], [[0.0, 0.0]], [[1.0, -1.0]], cfg_())
    torch.testing.assert_close(loss, torch.tensor((-1.2 + 0.8) / 2))
    torch.testing.assert_close(grad, torch.zeros(1, 2))
    assert m["clip_fraction_high"] == 0.5 and m["clip_fraction_low"] == 0.5


def test_asymmetric_clip():
    loss, m, _ = _loss([[LOG(1.25), LOG(0.85)]], [[0.0, 0.0]], [[1.0, -1.0]],
                       cfg_(ratio_clip_min=0.1, ratio_clip_max=0.28))
    torch.testing.assert_close(loss, torch.tensor((-1.25 + 0.9) / 2))  # high bound 1.28 not hit, low 0.9 hit
    assert m["clip_fraction_high"] == 0 and m["clip_fraction_low"] == 0.5


def test_dual_clip():
    loss, m, grad = _loss([[LOG(5.0)]], [[0.0]], [[-1.0]], cfg_(ratio_clip_c=3.0))
    torch.testing.assert_close(loss, torch.tensor(3.0))  # max(5, 1.2) = 5 -> min(5, 3) = 3
    torch.testing.assert_close(grad, torch.zeros(1, 1))
    assert m["dual_clip_fraction"] == 1.0


def test_sample_advantages_broadcast():
    loss_b, _, _ = _loss([[LOG(1.1), LOG(1.05)]], [[0.0, 0.0]], [2.0], cfg_())
    loss_bt, _, _ = _loss([[LOG(1.1), LOG(1.05)]], [[0.0, 0.0]], [[2.0, 2.0]], cfg_())
    torch.testing.assert_close(loss_b, loss_bt)
    torch.testing.assert_close(loss_b, torch.tensor(-2.0 * (1.1 + 1.05) / 2))


def test_force_on_policy_ratio_is_policy_gradient():
    lp = [[-1.0, -2.0, -0.5]]
    loss, m, grad = _loss(lp, None, [[1.0, -2.0, 0.5]], cfg_(force_on_policy_ratio=True))
    torch.testing.assert_close(loss, torch.tensor((-1.0 + 2.0 - 0.5) / 3))  # -A * 1
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 2.0, -0.5]]) / 3)
    assert m["probs_ratio"] == 1.0


def test_disable_ppo_ratio_is_reinforce():
    loss, _, grad = _loss([[-1.0, -2.0]], [[-5.0, -5.0]], [[1.0, -1.0]], cfg_(disable_ppo_ratio=True))
    torch.testing.assert_close(loss, torch.tensor((1.0 * 1.0 - 2.0) / 2))  # -A * lp
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 0.5]]))


def test_gspo_sequence_ratio_value_and_gradient():
    # Row mean of lp - prev over the 2 masked tokens: (log 1.1 + log 1.0)/2 -> r = sqrt(1.1) on every token.
    cfg = cfg_(token_level_loss=False, sequence_level_importance_ratios=True)
    loss, _, grad = _loss([[LOG(1.1), 0.0, 7.0]], [[0.0, 0.0, 0.0]], [1.0], cfg, tm=[[1.0, 1.0, 0.0]])
    r = math.sqrt(1.1)
    torch.testing.assert_close(loss, torch.tensor(-r))
    # d(-r)/dlp_t = -r * 1/2 on masked tokens; the padded one gets nothing
    torch.testing.assert_close(grad, torch.tensor([[-r / 2, -r / 2, 0.0]]))


def test_kl_penalty_token_level():
    cfg = cfg_(reference_policy_kl_penalty=0.5, reference_policy_kl_type="k1")
    loss, m, grad = _loss([[0.0, 0.0]], [[0.0, 0.0]], [[0.0, 0.0]], cfg, ref_logprobs=torch.tensor([[-1.0, -3.0]]))
    torch.testing.assert_close(loss, torch.tensor(0.5 * 2.0))  # k1 = lp - ref = [1, 3], mean 2
    assert m["kl_penalty"] == pytest.approx(2.0)
    # NeMo-RL's KL gradient (#2506) keeps the score-function term: d(w·k1)/dlp = 1 + k1 with w = exp(lp - sg(lp)).
    torch.testing.assert_close(grad, torch.tensor([[0.5 * (1 + 1) / 2, 0.5 * (1 + 3) / 2]]))
    # A global normaliser (this micro-batch is half the step) scales the loss, not the logged KL.
    loss_g, m_g, _ = _loss([[0.0, 0.0]], [[0.0, 0.0]], [[0.0, 0.0]], cfg, ref_logprobs=torch.tensor([[-1.0, -3.0]]),
                           global_valid_tokens=4)
    torch.testing.assert_close(loss_g, torch.tensor(0.5 * 4.0 / 4))
    assert m_g["kl_penalty"] == pytest.approx(2.0) and m_g["loss"] == pytest.approx(0.5)
    cfg_reward = cfg_(reference_policy_kl_penalty=0.5, use_kl_in_reward=True)
    loss2, m2, _ = _loss([[0.0, 0.0]], [[0.0, 0.0]], [[0.0, 0.0]], cfg_reward)  # beta = 0: no ref needed
    assert loss2.item() == 0.0 and m2["kl_penalty"] == 0.0


def test_on_policy_kl_approximation_weights_kl():
    cfg = cfg_(reference_policy_kl_penalty=1.0, reference_policy_kl_type="k1", use_on_policy_kl_approximation=True)
    loss, _, _ = _loss([[0.0]], [[0.0]], [[0.0]], cfg, ref_logprobs=torch.tensor([[-1.0]]),
                       generation_logprobs=torch.tensor([[LOG(2.0)]]))
    torch.testing.assert_close(loss, torch.tensor(0.5 * 1.0))  # w = exp(0 - log 2) = .5, k1 = 1


def test_kl_gradient_keeps_the_score_function_term_and_the_input_clamp_stops_it():
    """NeMo-RL #2506: the KL's weight w (exp(lp - gen) on-policy, else exp(lp - sg(lp))) is not detached, so
    d(w·k)/dlp = w·(k + dk/dlp); where the input clamp bites, w is detached and k is flat: no gradient."""
    cfg = cfg_(reference_policy_kl_penalty=1.0, reference_policy_kl_type="k1", use_on_policy_kl_approximation=True)
    loss, _, grad = _loss([[0.0]], [[0.0]], [[0.0]], cfg, ref_logprobs=torch.tensor([[-1.0]]),
                          generation_logprobs=torch.tensor([[LOG(2.0)]]))
    torch.testing.assert_close(grad, torch.tensor([[0.5 * (1.0 + 1.0)]]))  # w = .5, k1 = 1, dk1/dlp = 1
    cfg = cfg_(reference_policy_kl_penalty=1.0, reference_policy_kl_type="k1", kl_output_clamp_value=None)
    _, _, grad = _loss([[0.0]], [[0.0]], [[0.0]], cfg, ref_logprobs=torch.tensor([[-30.0]]))  # logr = -30 -> -20
    torch.testing.assert_close(grad, torch.zeros(1, 1))


def test_importance_sampling_truncations_by_hand():
    prev = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    gen = torch.tensor([[LOG(2.0), LOG(0.25), 0.0], [LOG(1.1), LOG(1.2), 0.0]])  # w = [.5, 4, 1], [1/1.1, 1/1.2, 1]
    tm = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    sm = torch.ones(2)
    w, m = importance_weights(prev, gen, tm, sm, cfg_(use_importance_sampling_correction=True,
                                                      truncated_importance_sampling_type="tis",
                                                      truncated_importance_sampling_ratio=2.0))
    torch.testing.assert_close(w[0], torch.tensor([0.5, 2.0, 1.0]))
    assert m["is_oob_ratio"] == pytest.approx(1 / 5)
    w, m = importance_weights(prev, gen, tm, sm, cfg_(use_importance_sampling_correction=True,
                                                      truncated_importance_sampling_type="icepop",
                                                      truncated_importance_sampling_ratio=2.0,
                                                      truncated_importance_sampling_ratio_min=0.6))
    torch.testing.assert_close(w[0], torch.tensor([0.0, 0.0, 1.0]))
    assert m["is_oob_ratio"] == pytest.approx(2 / 5)
    # seq-mask-tis: geo means: row 0 exp((log .5 + log 4 + 0)/3) = 2^(1/3) = 1.26 (out of [.8, 1.2]);
    # row 1 exp((-log 1.1 - log 1.2)/2) = .87 (kept, with its raw token weights)
    w, m = importance_weights(prev, gen, tm, sm, cfg_(use_importance_sampling_correction=True,
                                                      truncated_importance_sampling_type="seq-mask-tis",
                                                      truncated_importance_sampling_ratio=1.2,
                                                      truncated_importance_sampling_ratio_min=0.8))
    torch.testing.assert_close(w[0], torch.zeros(3))
    torch.testing.assert_close(w[1, :2], torch.tensor([1 / 1.1, 1 / 1.2]))
    assert m["is_oob_ratio"] == pytest.approx(0.5)


def _nemo_is_oob_ratio(weights, tm, sm, kind, hi, lo):
    """NeMo-RL's ClippedPGLossFn is_oob_ratio for tis / icepop, transcribed: weights [B, T] or [B, 1]
    (sequence-level), masked_mean(oob, token_mask * sample_mask) with the batch's own valid tokens."""
    mask = tm * sm[:, None]
    oob = (weights > hi) | (weights < (lo or 0.0)) if kind == "tis" else ~((weights >= lo) & (weights <= hi))
    return float((oob.float() * mask).sum() / (mask.sum() + 1e-8))


@pytest.mark.parametrize("kind,lo", [("tis", None), ("icepop", 0.5)])
def test_is_oob_ratio_counts_masked_tokens_also_for_sequence_weights(kind, lo):
    # GSPO weights w_i = exp(sum_t m (prev - gen)): row 0 -> 8 (3 tokens, out), row 1 -> 1 (1 token, in),
    # row 2 out of range but sample-masked. NeMo-RL: 3 out of 4 masked tokens, not 1 of 2 sequences.
    prev = torch.zeros(3, 3)
    gen = torch.tensor([[-LOG(2.0)] * 3, [0.0, 0.0, 0.0], [-LOG(4.0), 0.0, 0.0]])
    tm = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    sm = torch.tensor([1.0, 1.0, 0.0])
    cfg = cfg_(token_level_loss=False, sequence_level_importance_ratios=True, use_importance_sampling_correction=True,
               truncated_importance_sampling_type=kind, truncated_importance_sampling_ratio=2.0,
               truncated_importance_sampling_ratio_min=lo)
    w, m = importance_weights(prev, gen, tm, sm, cfg)
    torch.testing.assert_close(w[:2, 0], torch.tensor([2.0 if kind == "tis" else 0.0, 1.0]))
    raw_w = torch.exp(((prev - gen) * tm * sm[:, None]).sum(-1, keepdim=True))
    assert m["is_oob_ratio"] == pytest.approx(3 / 4)
    assert m["is_oob_ratio"] == pytest.approx(_nemo_is_oob_ratio(raw_w, tm, sm, kind, 2.0, lo))
    # token-level weights: the same definition (row 0: three tokens at w = 2 are inside [lo, 2])
    token_cfg = cfg.model_copy(update={"sequence_level_importance_ratios": False})
    _, m_tok = importance_weights(prev, gen, tm, sm, token_cfg)
    assert m_tok["is_oob_ratio"] == pytest.approx(_nemo_is_oob_ratio(torch.exp(prev - gen), tm, sm, kind, 2.0, lo))


def test_kl_term_uses_the_unfiltered_logprobs():
    """Under top-k / top-p the KL compares the current policy's unfiltered logprobs with the (unfiltered)
    reference, as NeMo-RL's curr_logprobs_unfiltered; the policy term keeps the filtered ones."""
    cfg = cfg_(reference_policy_kl_penalty=0.5, reference_policy_kl_type="k1")
    lp = torch.tensor([[LOG(0.5), LOG(0.25)]], requires_grad=True)  # filtered
    lp_u = torch.tensor([[LOG(0.4), LOG(0.2)]], requires_grad=True)  # unfiltered (less mass per token)
    ref = torch.tensor([[LOG(0.4), LOG(0.1)]])
    tm, sm, adv = torch.ones(1, 2), torch.ones(1), torch.zeros(1, 2)
    loss, m = clipped_pg_loss(lp, lp.detach(), adv, tm, sm, cfg, ref_logprobs=ref, unfiltered_logprobs=lp_u)
    loss.backward()
    kl_u = calculate_kl(lp_u.detach(), ref, "k1").mean()  # k1 = lp_u - ref = [0, log 2]
    torch.testing.assert_close(loss.detach(), 0.5 * kl_u)
    assert m["kl_penalty"] == pytest.approx(LOG(2.0) / 2)
    # d(0.5 * mean(w · (lp_u - ref))) with w = exp(lp_u - sg(lp_u)): 0.25 · (1 + k1), k1 = [0, log 2]
    torch.testing.assert_close(lp_u.grad, torch.tensor([[0.25, 0.25 * (1 + math.log(2))]]))
    torch.testing.assert_close(lp.grad, torch.zeros(1, 2))  # A = 0: no policy gradient
    # without unfiltered logprobs the KL uses `logprobs` (no filter): unchanged behaviour
    loss2, _ = clipped_pg_loss(lp.detach(), lp.detach(), adv, tm, sm, cfg, ref_logprobs=ref)
    torch.testing.assert_close(loss2, 0.5 * calculate_kl(lp.detach(), ref, "k1").mean())


def test_gspo_importance_weight_sums_log_ratios():
    cfg = cfg_(token_level_loss=False, sequence_level_importance_ratios=True, use_importance_sampling_correction=True)
    w, _ = importance_weights(torch.tensor([[0.0, 0.0]]), torch.tensor([[LOG(0.5), LOG(0.5)]]), torch.ones(1, 2),
                              torch.ones(1), cfg)
    torch.testing.assert_close(w, torch.tensor([[4.0]]))


def test_metrics_by_hand():
    lp = [[LOG(0.5), LOG(0.25), 0.0]]
    gen = torch.tensor([[LOG(0.5), LOG(0.5), 0.0]])
    prev = [[LOG(0.5), LOG(0.5), 0.0]]
    _, m, _ = _loss(lp, prev, [[0.0, 0.0, 0.0]], cfg_(), tm=[[1.0, 1.0, 0.0]], generation_logprobs=gen)
    assert m["token_mult_prob_error"] == pytest.approx(1.0)
    assert m["sampling_importance_ratio"] == pytest.approx(1.0)
    # entropy estimate: -(1 * log .5 + (.25/.5) * log .25) / 2
    assert m["approx_entropy"] == pytest.approx(-(LOG(0.5) + 0.5 * LOG(0.25)) / 2)
    assert m["num_valid_samples"] == 1
    _, m2, _ = _loss(lp, prev, [[0.0, 0.0, 0.0]], cfg_(), tm=[[1.0, 1.0, 0.0]],
                     generation_logprobs=torch.tensor([[0.0, LOG(0.5), 0.0]]))
    assert m2["token_mult_prob_error"] == pytest.approx((2.0 + 1.0) / 2)


def test_missing_inputs_raise():
    with pytest.raises(ValueError, match="prev_logprobs"):
        _loss([[0.0]], None, [[1.0]], cfg_())
    with pytest.raises(ValueError, match="ref_logprobs"):
        _loss([[0.0]], [[0.0]], [[1.0]], cfg_(reference_policy_kl_penalty=0.1))
    with pytest.raises(ValueError, match="generation_logprobs"):
        _loss([[0.0]], [[0.0]], [[1.0]], cfg_(use_importance_sampling_correction=True))


# ----------------------------------------------------------------------------------------------
# Scalar-loop reference of the contract, for random configs and data
# ----------------------------------------------------------------------------------------------
def reference_loss(lp, prev, adv, tm, sm, cfg, ref, gen, gvt=None, gvs=None):
    B, T = len(lp), len(lp[0])
    beta = 0.0 if cfg.use_kl_in_reward else cfg.reference_policy_kl_penalty
    lo_b, hi_b = 1 - cfg.ratio_clip_min, 1 + cfg.ratio_clip_max
    kind, w_hi, w_lo = (cfg.truncated_importance_sampling_type, cfg.truncated_importance_sampling_ratio,
                        cfg.truncated_importance_sampling_ratio_min)
    per_tok = [[0.0] * T for _ in range(B)]
    for b in range(B):
        toks = [t for t in range(T) if tm[b][t] > 0]
        if cfg.force_on_policy_ratio:
            prev_b = lp[b]
        else:
            prev_b = prev[b]
        seq_lr = sum(lp[b][t] - prev_b[t] for t in toks) / len(toks) if toks else 0.0
        seq_w = math.exp(sum(prev_b[t] - gen[b][t] for t in toks)) if sm[b] > 0 else 1.0
        geo = math.exp(sum(prev_b[t] - gen[b][t] for t in toks) / len(toks)) if toks else 1.0
        for t in toks:
            a = adv[b][t]
            if cfg.force_on_policy_ratio:
                r = rc = 1.0
            elif cfg.disable_ppo_ratio:
                r = rc = lp[b][t]
            else:
                r = math.exp(seq_lr if cfg.sequence_level_importance_ratios else lp[b][t] - prev_b[t])
                rc = min(max(r, lo_b), hi_b)
            L = max(-a * r, -a * rc)
            if cfg.ratio_clip_c is not None and a < 0:
                L = min(L, -cfg.ratio_clip_c * a)
            if cfg.use_importance_sampling_correction:
                w = seq_w if cfg.sequence_level_importance_ratios else math.exp(prev_b[t] - gen[b][t])
                if kind == "tis":
                    w = min(max(w, w_lo or 0.0), w_hi)
                elif kind == "icepop":
                    w = w if w_lo <= w <= w_hi else 0.0
                elif kind == "seq-mask-tis":
                    w = w if w_lo <= geo <= w_hi else 0.0
                L *= w
            if beta:
                logr = min(max(ref[b][t] - lp[b][t], -20.0), 20.0)
                k = {"k1": -logr, "k2": logr * logr / 2, "k3": math.exp(logr) - 1 - logr}[cfg.reference_policy_kl_type]
                if cfg.use_on_policy_kl_approximation:  # weighted before the output clamp (NeMo-RL)
                    k *= math.exp(lp[b][t] - gen[b][t])
                k = min(max(k, -10.0), 10.0)
                L += beta * k
            per_tok[b][t] = L
    if cfg.token_level_loss:
        n = gvt if gvt is not None else sum(tm[b][t] * sm[b] for b in range(B) for t in range(T))
        total = sum(per_tok[b][t] * tm[b][t] * sm[b] for b in range(B) for t in range(T))
        return total / n if n else 0.0
    n = gvs if gvs is not None else sum(sm)
    total = 0.0
    for b in range(B):
        cnt = sum(tm[b])
        if cnt and sm[b]:
            total += sm[b] * sum(per_tok[b][t] * tm[b][t] for t in range(T)) / cnt
    return total / n if n else 0.0


@st.composite
def loss_configs(draw, allow_seq_ratio=True):
    token_level = draw(st.booleans())
    seq_ratio = (not token_level) and allow_seq_ratio and draw(st.booleans())
    use_is = draw(st.booleans())
    kind = draw(st.sampled_from([None, "tis", "icepop", "seq-mask-tis"])) if use_is else None
    kw = dict(
        token_level_loss=token_level,
        sequence_level_importance_ratios=seq_ratio,
        ratio_clip_min=draw(st.sampled_from([0.1, 0.2])),
        ratio_clip_max=draw(st.sampled_from([0.2, 0.28])),
        ratio_clip_c=draw(st.sampled_from([None, 3.0])),
        reference_policy_kl_penalty=draw(st.sampled_from([0.0, 0.05, 0.5])),
        reference_policy_kl_type=draw(st.sampled_from(["k1", "k2", "k3"])),
        use_kl_in_reward=draw(st.booleans()),
        use_importance_sampling_correction=use_is,
        truncated_importance_sampling_type=kind,
        truncated_importance_sampling_ratio=2.0 if kind else None,
        truncated_importance_sampling_ratio_min=draw(st.sampled_from([None, 0.5])) if kind == "tis" else (
            0.5 if kind else None),
        use_on_policy_kl_approximation=draw(st.booleans()),
        force_on_policy_ratio=draw(st.booleans()),
        disable_ppo_ratio=draw(st.booleans()),
    )
    try:
        return ClippedPGLossConfig(**kw)
    except ValidationError:
        assume(False)


@st.composite
def loss_batches(draw, min_b=1):
    B = draw(st.integers(min_b, 4))
    T = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    lp = -3 * torch.rand(B, T, generator=g, dtype=torch.float64)
    prev = lp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    gen = prev + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = lp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    per_token_adv = draw(st.booleans())
    adv = torch.randn(B, T, generator=g, dtype=torch.float64) if per_token_adv else torch.randn(
        B, generator=g, dtype=torch.float64)
    tm = (torch.rand(B, T, generator=g) > 0.3).double()
    sm = (torch.rand(B, generator=g) > 0.2).double()
    return dict(lp=lp, prev=prev, gen=gen, ref=ref, adv=adv, tm=tm, sm=sm)


def _run(d, cfg, rows=slice(None), cols=slice(None), gvt=None, gvs=None):
    lp = d["lp"][rows, cols].clone().requires_grad_(True)
    adv = d["adv"][rows] if d["adv"].dim() == 1 else d["adv"][rows, cols]
    loss, metrics = clipped_pg_loss(lp, d["prev"][rows, cols], adv, d["tm"][rows, cols], d["sm"][rows], cfg,
                                    ref_logprobs=d["ref"][rows, cols], generation_logprobs=d["gen"][rows, cols],
                                    global_valid_tokens=gvt, global_valid_seqs=gvs)
    return loss, metrics, lp


@settings(max_examples=200, deadline=None)
@given(loss_configs(), loss_batches())
def test_loss_matches_scalar_reference(cfg, d):
    loss, _, _ = _run(d, cfg)
    adv = d["adv"] if d["adv"].dim() == 2 else d["adv"][:, None].expand_as(d["lp"])
    expected = reference_loss(d["lp"].tolist(), d["prev"].tolist(), adv.tolist(), d["tm"].tolist(),
                              d["sm"].tolist(), cfg, d["ref"].tolist(), d["gen"].tolist())
    assert loss.item() == pytest.approx(expected, rel=1e-9, abs=1e-9)


@settings(max_examples=150, deadline=None)
@given(loss_configs(), loss_batches(min_b=2), st.data())
def test_micro_batch_losses_add_up_to_full_batch(cfg, d, data):
    B = d["lp"].shape[0]
    cut = data.draw(st.integers(1, B - 1))
    gvt, gvs = global_valid_counts(d["tm"], d["sm"])
    full, _, lp_full = _run(d, cfg)
    full.backward()
    a, _, lp_a = _run(d, cfg, rows=slice(0, cut), gvt=gvt, gvs=gvs)
    b, _, lp_b = _run(d, cfg, rows=slice(cut, B), gvt=gvt, gvs=gvs)
    (a + b).backward()
    torch.testing.assert_close(a + b, full, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.cat([lp_a.grad, lp_b.grad]), lp_full.grad, rtol=1e-10, atol=1e-12)


@settings(max_examples=150, deadline=None)
@given(loss_configs(), loss_batches(), st.integers(1, 4),
       st.sampled_from([0.0, -1e4, 55.5, float("inf"), float("nan")]))
def test_padding_never_changes_the_loss(cfg, d, n_pad, pad_value):
    B = d["lp"].shape[0]
    base, _, lp = _run(d, cfg)
    base.backward()
    padded = {}
    for k, v in d.items():
        if v.dim() == 2:
            fill = torch.zeros(B, n_pad, dtype=v.dtype) if k == "tm" else torch.full((B, n_pad), pad_value,
                                                                                       dtype=v.dtype)
            padded[k] = torch.cat([v, fill], dim=1)
        else:
            padded[k] = v
    loss, metrics, lp_pad = _run(padded, cfg)
    loss.backward()
    torch.testing.assert_close(loss, base, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lp_pad.grad[:, : d["lp"].shape[1]], lp.grad, rtol=1e-12, atol=1e-12)
    assert torch.equal(lp_pad.grad[:, d["lp"].shape[1]:], torch.zeros(B, n_pad, dtype=torch.float64))
    assert all(v is None or math.isfinite(v) for k, v in metrics.items() if not k.startswith("probs_ratio_m"))


def test_half_precision_inputs_compute_in_fp32():
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16, requires_grad=True)
    loss, _ = clipped_pg_loss(lp, lp.detach().float(), torch.tensor([1.0]), torch.ones(1, 2), torch.ones(1), cfg_())
    assert loss.dtype == torch.float32
    loss.backward()
    assert lp.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lp.grad.float(), torch.tensor([[-0.5, -0.5]]))


# --------------------------------------------------------------------------------------------------
# The loss function the training step calls: LossInputs, clipped_pg_loss_fn, needs
# --------------------------------------------------------------------------------------------------
def _loss_inputs(with_prev=True, **extra):
    from types import SimpleNamespace  # stands in for the micro-batch (a grpo.batch.TrainBatch)

    from grpo.config.load import build_config
    from grpo.loss import LossInputs

    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(3, 5, generator=g, dtype=torch.float64).requires_grad_(True)
    tm = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 1, 0, 0], [0, 1, 1, 1, 1]], dtype=torch.float64)
    mb = SimpleNamespace(prev_logprobs_bt=(lp.detach() - 0.1) if with_prev else None,
                         advantages_bt=torch.randn(3, 5, generator=g, dtype=torch.float64), token_mask_bt=tm,
                         sample_mask_b=torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64),
                         ref_logprobs_bt=lp.detach() - 0.2, generation_logprobs_bt=lp.detach() - 0.05,
                         unfiltered_logprobs_bt=None)
    cfg = build_config({"loss_fn": {"reference_policy_kl_penalty": 0.1}})
    return LossInputs(lp, mb, cfg, global_valid_tokens=11, global_valid_seqs=4, **extra)


@pytest.mark.parametrize("with_prev", [True, False])
def test_clipped_pg_loss_fn_is_clipped_pg_loss_on_the_micro_batch(with_prev):
    from grpo.loss import clipped_pg_loss_fn

    x = _loss_inputs(with_prev)
    mb = x.batch
    prev = mb.prev_logprobs_bt if with_prev else x.logprobs_bt.detach()
    loss, metrics = clipped_pg_loss_fn(x)
    expected, expected_metrics = clipped_pg_loss(x.logprobs_bt, prev, mb.advantages_bt, mb.token_mask_bt,
                                                 mb.sample_mask_b, x.cfg.loss_fn, ref_logprobs=mb.ref_logprobs_bt,
                                                 generation_logprobs=mb.generation_logprobs_bt,
                                                 global_valid_tokens=11, global_valid_seqs=4)
    assert torch.equal(loss, expected) and metrics == expected_metrics


def test_loss_inputs_aggregate_like_the_policy_term():
    x = _loss_inputs()
    v = torch.rand(3, 5, dtype=torch.float64)
    mb = x.batch
    assert torch.equal(x.aggregate(v), aggregate_loss(v, mb.token_mask_bt, mb.sample_mask_b, True, 11, 4))
    assert torch.equal(x.aggregate(v, local=True), aggregate_loss(v, mb.token_mask_bt, mb.sample_mask_b, True))


def test_loss_needs_reads_the_attribute_and_names_a_bad_one():
    from grpo.loss import clipped_pg_loss_fn, loss_needs

    def with_entropy(x):
        return clipped_pg_loss_fn(x)

    assert loss_needs(clipped_pg_loss_fn) == ()
    with_entropy.needs = "entropy"
    assert loss_needs(with_entropy) == ("entropy",)
    with_entropy.needs = ("entropy", "logits")
    assert loss_needs(with_entropy) == ("entropy", "logits")
    with_entropy.needs = ("entropie",)
    with pytest.raises(ValueError, match=r"with_entropy\.needs=\('entropie',\): \['entropie'\] unknown; expected "
                                         r"names from \['entropy', 'logits'\]"):
        loss_needs(with_entropy)
    with pytest.raises(TypeError, match="pass grpo.loss.clipped_pg_loss_fn"):
        loss_needs(clipped_pg_loss)
