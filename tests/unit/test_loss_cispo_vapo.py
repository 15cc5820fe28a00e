"""CISPO (loss_fn.use_cispo) and VAPO's positive-example NLL (loss_fn.positive_example_nll_weight) against
NeMo-RL's ClippedPGLossFn, transcribed below, on random cases: values, gradients, metrics, rejected configs."""

import math

import pytest
import torch
from pydantic import ValidationError

from grpo.config import ClippedPGLossConfig
from grpo.loss import clipped_pg_loss, positive_example_nll

LOG = math.log


# ----------------------------------------------------------------------------------------------
# NeMo-RL 7ea279a, nemo_rl/algorithms/loss/loss_functions.py ClippedPGLossFn.__call__ (l. 374-790), transcribed
# for what these two options touch: the token-level ratio and its clamp (l. 526-541), CISPO's clip_loss (l. 545-546),
# dual clip (l. 553-560), token-level IS weights with tis / icepop (l. 577-636), the token- / sequence-level
# reduction (l. 673-693), VAPO's NLL (l. 719-735) and the metrics probs_ratio(_clamped), positive_nll_loss
# (l. 736-786).
# No KL term (beta = 0). nemo_rl.algorithms.utils.masked_mean: Σ values·mask / (normaliser + 1e-8).
# ----------------------------------------------------------------------------------------------
def _nrl_masked_mean(values, mask, dim=None, global_normalization_factor=None):
    factor = torch.sum(mask, dim=dim) if global_normalization_factor is None else global_normalization_factor
    return torch.sum(values * mask, dim=dim) / (factor + 1e-8)


def nemo_rl_loss(curr, prev, gen, adv, token_mask, sample_mask, rewards, *, use_cispo=False, clip_min=0.2,
                 clip_max=0.2, clip_c=None, token_level=True, is_correction=False, tis_type=None, tis_ratio=None,
                 tis_min=None, nll_weight=0.0, global_valid_toks=None, global_valid_seqs=None):
    mask = token_mask * sample_mask.unsqueeze(-1)
    global_valid_toks = mask.sum() if global_valid_toks is None else global_valid_toks
    global_valid_seqs = sample_mask.sum() if global_valid_seqs is None else global_valid_seqs
    ratios = (curr - prev).exp()
    ratios_clamped = ratios.clamp(1.0 - clip_min, 1.0 + clip_max)
    if use_cispo:
        clip_loss = -adv * ratios_clamped.detach() * curr
    else:
        clip_loss = torch.max(-adv * ratios, -adv * ratios_clamped)
    if clip_c is not None:
        clip_loss = torch.where(adv < 0, torch.min(clip_loss, -adv * clip_c), clip_loss)
    w = torch.nan_to_num(torch.exp(prev - gen), nan=0.0, posinf=0.0, neginf=0.0)
    if tis_type == "tis":
        w = torch.clamp(w, min=0.0 if tis_min is None else tis_min, max=tis_ratio)
    elif tis_type == "icepop":
        w = torch.where((w >= tis_min) & (w <= tis_ratio), w, torch.zeros_like(w))
    weights = w if is_correction else torch.ones_like(prev)
    if token_level:
        actor_loss = _nrl_masked_mean(weights * clip_loss, mask, global_normalization_factor=global_valid_toks)
    else:
        actor_loss = _nrl_masked_mean(_nrl_masked_mean(weights * clip_loss, token_mask, dim=-1), sample_mask,
                                      global_normalization_factor=global_valid_seqs)
    nll_loss = torch.tensor(0.0)
    if nll_weight > 0 and rewards is not None:
        correct_mask = mask * (rewards > 0).float().unsqueeze(-1)
        correct_valid_toks = correct_mask.sum()
        if correct_valid_toks > 0:
            nll_loss = _nrl_masked_mean(-curr, correct_mask, global_normalization_factor=correct_valid_toks)
    loss = actor_loss + nll_weight * nll_loss
    metrics = {
        "probs_ratio": _nrl_masked_mean(ratios.detach(), mask, global_normalization_factor=global_valid_toks).item(),
        "probs_ratio_clamped": _nrl_masked_mean(ratios_clamped.detach(), mask,
                                                global_normalization_factor=global_valid_toks).item(),
        "positive_nll_loss": nll_loss.item(),
    }
    return loss, metrics


# ----------------------------------------------------------------------------------------------
# Random cases, run through both
# ----------------------------------------------------------------------------------------------
def _case(seed, B=6, T=9):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    prev = lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4  # ratios well outside [0.8, 1.2]
    gen = prev + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    tm = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    sm = (torch.rand(B, generator=g) > 0.2).to(torch.float64)
    sm[0] = 1.0
    rewards = torch.tensor([1.0, 0.0, -1.0, 0.5, 1.0, 0.0], dtype=torch.float64)[:B]
    return lp, prev, gen, adv, tm, sm, rewards


def _both(seed, cfg_kw, nrl_kw, ours_kw=None):
    lp, prev, gen, adv, tm, sm, rewards = _case(seed)
    lp_a, lp_b = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    ref, ref_m = nemo_rl_loss(lp_a, prev, gen, adv, tm, sm, rewards, **nrl_kw)
    ref.backward()
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.0, **cfg_kw)
    ours, ours_m = clipped_pg_loss(lp_b, prev, adv, tm, sm, cfg, generation_logprobs=gen, rewards=rewards,
                                   **(ours_kw or {}))
    ours.backward()
    return (ref, ref_m, lp_a.grad), (ours, ours_m, lp_b.grad)


CISPO_CASES = [  # (our loss_fn, NeMo-RL's flags)
    (dict(use_cispo=True), dict(use_cispo=True)),
    (dict(use_cispo=True, ratio_clip_min=1.0, ratio_clip_max=5.0),  # NeMo-RL's CISPO recipe's bounds
     dict(use_cispo=True, clip_min=1.0, clip_max=5.0)),
    (dict(use_cispo=True, ratio_clip_max=0.28, use_importance_sampling_correction=True),
     dict(use_cispo=True, clip_max=0.28, is_correction=True)),
    (dict(use_cispo=True, use_importance_sampling_correction=True, truncated_importance_sampling_type="tis",
          truncated_importance_sampling_ratio=1.2),
     dict(use_cispo=True, is_correction=True, tis_type="tis", tis_ratio=1.2)),
    (dict(use_cispo=True, use_importance_sampling_correction=True, truncated_importance_sampling_type="icepop",
          truncated_importance_sampling_ratio=1.3, truncated_importance_sampling_ratio_min=0.8),
     dict(use_cispo=True, is_correction=True, tis_type="icepop", tis_ratio=1.3, tis_min=0.8)),
]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cfg_kw, nrl_kw", CISPO_CASES)
def test_cispo_value_and_gradient_match_nemo_rl(seed, cfg_kw, nrl_kw):
    (ref, ref_m, ref_grad), (ours, m, grad) = _both(seed, cfg_kw, nrl_kw)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(grad, ref_grad)
    assert m["probs_ratio"] == pytest.approx(ref_m["probs_ratio"])
    assert m["probs_ratio_clamped"] == pytest.approx(ref_m["probs_ratio_clamped"])
    assert "positive_nll_loss" not in m  # μ = 0: no NLL term, no metric


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("token_level, cispo", [(True, False), (False, False), (True, True)])  # CISPO: token level
def test_positive_example_nll_value_gradient_and_metric_match_nemo_rl(seed, token_level, cispo):
    cfg_kw = dict(positive_example_nll_weight=0.3, token_level_loss=token_level, use_cispo=cispo)
    nrl_kw = dict(nll_weight=0.3, token_level=token_level, use_cispo=cispo)
    (ref, ref_m, ref_grad), (ours, m, grad) = _both(seed, cfg_kw, nrl_kw)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(grad, ref_grad)
    assert m["positive_nll_loss"] == pytest.approx(ref_m["positive_nll_loss"])
    assert ref_m["positive_nll_loss"] > 0  # the cases have correct samples


def test_nll_gradient_by_hand_only_correct_samples_token_level():
    # rewards [1, 0, 0.5, -1]: rows 0 and 2 are correct (reward > 0); row 2 has 1 token: 3 correct tokens
    lp = torch.tensor([[-1.0, -2.0], [-1.0, -1.0], [-3.0, 0.0], [-1.0, -1.0]], requires_grad=True)
    tm = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.0, positive_example_nll_weight=0.5,
                              token_level_loss=False)  # the NLL stays a token mean at sequence level too
    loss, m = clipped_pg_loss(lp, lp.detach(), torch.zeros(4), tm, torch.ones(4), cfg,
                              rewards=torch.tensor([1.0, 0.0, 0.5, -1.0]))
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * (1 + 2 + 3) / 3)
    assert m["positive_nll_loss"] == pytest.approx(2.0)
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, -1.0], [0.0, 0.0], [-1.0, 0.0], [0.0, 0.0]]) * 0.5 / 3)


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    """PPO: A > 0 and r > 1 + ε gives no gradient; CISPO: −A·(1 + ε), through the logprob."""
    lp, prev, adv = [[LOG(1.5), LOG(0.5)]], torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, -2.0]])
    grads, metrics = [], []
    for cispo in (False, True):
        x = torch.tensor(lp, requires_grad=True)
        cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.0, use_cispo=cispo)
        loss, m = clipped_pg_loss(x, prev, adv, torch.ones(1, 2), torch.ones(1), cfg)
        loss.backward()
        grads.append(x.grad)
        metrics.append(m)
    torch.testing.assert_close(grads[0], torch.tensor([[0.0, 0.0]]))
    torch.testing.assert_close(grads[1], torch.tensor([[-1.0 * 1.2 / 2, 2.0 * 0.8 / 2]]))
    # clip fractions: PPO counts a clipped token only where the clip removes its gradient (A > 0 high, A < 0 low);
    # CISPO counts every clamped weight, whatever the sign of A
    assert (metrics[0]["clip_fraction_high"], metrics[0]["clip_fraction_low"]) == (0.5, 0.5)
    assert (metrics[1]["clip_fraction_high"], metrics[1]["clip_fraction_low"]) == (0.5, 0.5)
    assert metrics[1]["probs_ratio_clamped"] == pytest.approx(1.0)
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.0, use_cispo=True)
    _, m = clipped_pg_loss(torch.tensor(lp), prev, -adv, torch.ones(1, 2), torch.ones(1), cfg)
    assert (m["clip_fraction_high"], m["clip_fraction_low"]) == (0.5, 0.5)


def test_nll_micro_batches_add_up_with_the_steps_correct_token_count():
    """With the step's correct-token count (what train_step passes), micro-batch losses sum to the full batch's;
    NeMo-RL normalises each micro-batch by its own count, so there the sum depends on the micro-batching."""
    lp, prev, gen, adv, tm, sm, rewards = _case(7)
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.0, positive_example_nll_weight=0.2)
    mask = tm * sm[:, None]
    n_tok, n_seq = mask.sum(), sm.sum()
    n_correct = (mask * (rewards > 0)[:, None]).sum()
    full, _ = clipped_pg_loss(lp, prev, adv, tm, sm, cfg, rewards=rewards)
    parts = [clipped_pg_loss(lp[s], prev[s], adv[s], tm[s], sm[s], cfg, rewards=rewards[s], global_valid_tokens=n_tok,
                             global_valid_seqs=n_seq, global_correct_tokens=n_correct)[0]
             for s in (slice(0, 2), slice(2, 5), slice(5, 6))]
    torch.testing.assert_close(sum(parts), full)
    nrl_parts = [nemo_rl_loss(lp[s], prev[s], gen[s], adv[s], tm[s], sm[s], rewards[s], nll_weight=0.2,
                              global_valid_toks=n_tok, global_valid_seqs=n_seq)[0]
                 for s in (slice(0, 2), slice(2, 5), slice(5, 6))]
    assert abs(sum(nrl_parts).item() - full.item()) > 1e-3


def test_nll_without_a_correct_sample_is_zero_and_its_metric_none():
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.0, positive_example_nll_weight=1.0)
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, m = clipped_pg_loss(lp, lp.detach(), torch.zeros(1), torch.ones(1, 2), torch.ones(1), cfg,
                              rewards=torch.tensor([0.0]))
    loss.backward()
    assert loss.item() == 0.0 and m["positive_nll_loss"] is None and torch.all(lp.grad == 0)
    # a correct sample that is sample-masked does not count
    loss, m = clipped_pg_loss(lp, lp.detach(), torch.zeros(1), torch.ones(1, 2), torch.zeros(1), cfg,
                              rewards=torch.tensor([1.0]))
    assert loss.item() == 0.0
    assert positive_example_nll(torch.tensor([[-1.0]]), torch.ones(1, 1), torch.tensor([1.0]), normalizer=4) == 0.25


def test_nll_needs_rewards():
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.0, positive_example_nll_weight=0.1)
    with pytest.raises(ValueError, match="positive_example_nll_weight=0.1 needs the samples' rewards"):
        clipped_pg_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), torch.ones(1), cfg)


def test_clipped_pg_loss_fn_passes_rewards_and_the_correct_token_count():
    from types import SimpleNamespace

    from grpo.config.load import build_config
    from grpo.loss import LossInputs, clipped_pg_loss_fn

    lp, prev, gen, adv, tm, sm, rewards = _case(3)
    mb = SimpleNamespace(prev_logprobs_bt=prev, advantages_bt=adv, token_mask_bt=tm, sample_mask_b=sm,
                         ref_logprobs_bt=None, generation_logprobs_bt=gen, unfiltered_logprobs_bt=None,
                         rewards_b=rewards)
    cfg = build_config({"loss_fn": {"reference_policy_kl_penalty": 0.0, "use_cispo": True,
                                    "positive_example_nll_weight": 0.1}})
    loss, m = clipped_pg_loss_fn(LossInputs(lp, mb, cfg, global_valid_tokens=40, global_valid_seqs=9,
                                            global_correct_tokens=13))
    expected, _ = clipped_pg_loss(lp, prev, adv, tm, sm, cfg.loss_fn, generation_logprobs=gen, rewards=rewards,
                                  global_valid_tokens=40, global_valid_seqs=9, global_correct_tokens=13)
    assert torch.equal(loss, expected) and "positive_nll_loss" in m


# ----------------------------------------------------------------------------------------------
# Config: NeMo-RL's ClippedPGLossFn.__init__ (l. 270-291) rejects these combinations with use_cispo
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, key", [
    (dict(disable_ppo_ratio=True), "disable_ppo_ratio"),
    (dict(force_on_policy_ratio=True), "force_on_policy_ratio"),
    (dict(token_level_loss=False, sequence_level_importance_ratios=True), "sequence_level_importance_ratios"),
    (dict(ratio_clip_c=3.0), "ratio_clip_c"),
    (dict(token_level_loss=False), "token_level_loss"),
])
def test_cispo_rejects_nemo_rl_s_combinations(kw, key):
    with pytest.raises(ValidationError, match=f"use_cispo=true cannot be combined with loss_fn.{key}="):
        ClippedPGLossConfig(use_cispo=True, **kw)
    ClippedPGLossConfig(use_cispo=False, **kw)  # each alone is fine


def test_config_defaults_and_nll_weight_bounds():
    cfg = ClippedPGLossConfig()
    assert cfg.use_cispo is False and cfg.positive_example_nll_weight == 0.0
    ClippedPGLossConfig(use_cispo=True, use_importance_sampling_correction=True,
                        truncated_importance_sampling_type="icepop", truncated_importance_sampling_ratio=2.0,
                        truncated_importance_sampling_ratio_min=0.5, positive_example_nll_weight=0.1)
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValidationError, match="positive_example_nll_weight"):
            ClippedPGLossConfig(positive_example_nll_weight=bad)
