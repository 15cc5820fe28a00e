"""grpo.advantages against hand-computed values, a python-loop reference, and properties."""

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo.advantages import (
    apply_message_advantage_penalties,
    baseline_and_std_per_prompt,
    clip_advantages,
    compute_advantages,
    gdpo_advantages,
    grpo_advantages,
    masked_whiten,
    reinforce_plus_plus_advantages,
    reverse_cumsum,
)
from grpo.config import AdvEstimatorConfig

torch.set_default_dtype(torch.float32)


def t(*xs, dtype=torch.float32):
    return torch.tensor(xs, dtype=dtype)


# ----------------------------------------------------------------------------------------------
# Reference: the contract, one sample at a time, with python's statistics module.
# ----------------------------------------------------------------------------------------------
def reference_baseline_std(prompt_ids, rewards, valid, leave_one_out):
    base, std = [], []
    for i, (g, r, v) in enumerate(zip(prompt_ids, rewards, valid)):
        group_valid = [j for j, (gj, vj) in enumerate(zip(prompt_ids, valid)) if gj == g and vj]
        if not v or len(group_valid) <= 1:
            base.append(r)
            std.append(0.0)
            continue
        s = [rewards[j] for j in group_valid if not (leave_one_out and j == i)]
        base.append(sum(s) / len(s))
        std.append(statistics.stdev(s) if len(s) >= 2 else 0.0)
    return base, std


group_batches = st.integers(1, 12).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 3), min_size=n, max_size=n),
        st.lists(st.sampled_from([0.0, 0.1, 0.5, 1.0, -2.0, 3.25]), min_size=n, max_size=n),
        st.lists(st.booleans(), min_size=n, max_size=n),
    )
)


# ----------------------------------------------------------------------------------------------
# baseline_and_std_per_prompt
# ----------------------------------------------------------------------------------------------
def test_baseline_leave_one_out_by_hand():
    b, s = baseline_and_std_per_prompt(t(0, 0, 0, dtype=torch.long), t(1.0, 0.0, 2.0), t(1, 1, 1))
    # S_0 = {0, 2}: mean 1, stdev sqrt(2); S_1 = {1, 2}: 1.5, sqrt(.5); S_2 = {1, 0}: .5, sqrt(.5)
    torch.testing.assert_close(b, t(1.0, 1.5, 0.5))
    torch.testing.assert_close(s, t(math.sqrt(2), math.sqrt(0.5), math.sqrt(0.5)))


def test_baseline_whole_group_by_hand():
    b, s = baseline_and_std_per_prompt(t(0, 0, 0, dtype=torch.long), t(1.0, 0.0, 2.0), t(1, 1, 1), leave_one_out=False)
    torch.testing.assert_close(b, t(1.0, 1.0, 1.0))
    torch.testing.assert_close(s, t(1.0, 1.0, 1.0))  # unbiased: ((0)^2 + 1 + 1) / 2 = 1


def test_invalid_samples_keep_own_reward_and_leave_siblings_alone():
    ids, r, valid = t(5, 5, 5, dtype=torch.long), t(1.0, 0.0, 2.0), t(1, 1, 0)
    b, s = baseline_and_std_per_prompt(ids, r, valid, leave_one_out=False)
    torch.testing.assert_close(b, t(0.5, 0.5, 2.0))
    torch.testing.assert_close(s, t(math.sqrt(0.5), math.sqrt(0.5), 0.0))
    b, s = baseline_and_std_per_prompt(ids, r, valid, leave_one_out=True)
    torch.testing.assert_close(b, t(0.0, 1.0, 2.0))  # m = 1: the other valid sample; std undefined -> 0
    torch.testing.assert_close(s, t(0.0, 0.0, 0.0))


def test_singleton_groups_and_all_invalid_groups():
    b, s = baseline_and_std_per_prompt(t(0, 1, 1, dtype=torch.long), t(3.0, 4.0, 5.0), t(1, 0, 0))
    torch.testing.assert_close(b, t(3.0, 4.0, 5.0))
    torch.testing.assert_close(s, t(0.0, 0.0, 0.0))


def test_prompt_rows_as_group_keys():
    rows = torch.tensor([[1, 2], [3, 4], [1, 2], [3, 4]])
    b, _ = baseline_and_std_per_prompt(rows, t(1.0, 10.0, 3.0, 20.0), torch.ones(4), leave_one_out=False)
    torch.testing.assert_close(b, t(2.0, 15.0, 2.0, 15.0))


@settings(max_examples=150, deadline=None)
@given(group_batches, st.booleans())
def test_baseline_matches_reference(batch, loo):
    ids, rewards, valid = batch
    b, s = baseline_and_std_per_prompt(torch.tensor(ids), torch.tensor(rewards, dtype=torch.float64),
                                       torch.tensor(valid, dtype=torch.float64), leave_one_out=loo)
    rb, rs = reference_baseline_std(ids, rewards, valid, loo)
    torch.testing.assert_close(b, torch.tensor(rb, dtype=torch.float64))
    torch.testing.assert_close(s, torch.tensor(rs, dtype=torch.float64))


# ----------------------------------------------------------------------------------------------
# grpo_advantages
# ----------------------------------------------------------------------------------------------
def test_grpo_advantages_by_hand():
    adv = grpo_advantages(t(0, 0, 0, dtype=torch.long), t(1.0, 0.0, 2.0), t(1, 1, 1), eps=0.0)
    torch.testing.assert_close(adv, t(0.0, -1.5 / math.sqrt(0.5), 1.5 / math.sqrt(0.5)))
    raw = grpo_advantages(t(0, 0, 0, dtype=torch.long), t(1.0, 0.0, 2.0), t(1, 1, 1), normalize_rewards=False)
    torch.testing.assert_close(raw, t(0.0, -1.5, 1.5))


def test_grpo_eps_only_where_std_positive():
    # group 0 has std 0 (undivided, = 0); group 1 std sqrt(.5) -> divide by sqrt(.5) + eps
    adv = grpo_advantages(t(0, 0, 1, 1, dtype=torch.long), t(1.0, 1.0, 1.0, 0.0), torch.ones(4),
                          leave_one_out=False, eps=0.5)
    torch.testing.assert_close(adv, t(0.0, 0.0, 0.5 / (math.sqrt(0.5) + 0.5), -0.5 / (math.sqrt(0.5) + 0.5)))


def test_grpo_two_samples_leave_one_out_not_divided():
    # LOO with two valid samples: b = the other reward, σ undefined (m = 1) -> 0 -> A = r - b, undivided.
    adv = grpo_advantages(t(0, 0, dtype=torch.long), t(1.0, 0.0), torch.ones(2), leave_one_out=True)
    torch.testing.assert_close(adv, t(1.0, -1.0))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.sampled_from([0.0, 0.1, 1.0 / 3.0, 7.3, -1e4]), st.booleans(), st.booleans())
def test_zero_variance_and_singleton_groups_give_zero(n, value, loo, normalize):
    ids = torch.cat([torch.zeros(n, dtype=torch.long), torch.ones(1, dtype=torch.long)])
    rewards = torch.full((n + 1,), value)
    adv = grpo_advantages(ids, rewards, torch.ones(n + 1), leave_one_out=loo, normalize_rewards=normalize)
    assert torch.equal(adv, torch.zeros(n + 1))


@settings(max_examples=100, deadline=None)
@given(group_batches, st.booleans(), st.randoms(use_true_random=False))
def test_permuting_samples_permutes_advantages(batch, loo, rnd):
    ids, rewards, valid = (torch.tensor(x) for x in batch)
    rewards, valid = rewards.float(), valid.float()
    perm = list(range(len(ids)))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    adv = grpo_advantages(ids, rewards, valid, leave_one_out=loo)
    adv_perm = grpo_advantages(ids[perm], rewards[perm], valid[perm], leave_one_out=loo)
    torch.testing.assert_close(adv_perm, adv[perm])
    assert torch.isfinite(adv).all()


@settings(max_examples=100, deadline=None)
@given(group_batches, st.booleans())
def test_grpo_never_nan_and_invalid_are_zero(batch, loo):
    ids, rewards, valid = (torch.tensor(x) for x in batch)
    adv = grpo_advantages(ids, rewards.float(), valid.float(), leave_one_out=loo)
    assert torch.isfinite(adv).all()
    assert (adv[~valid] == 0).all()


# ----------------------------------------------------------------------------------------------
# GDPO
# ----------------------------------------------------------------------------------------------
def test_gdpo_by_hand():
    # One group of two (whole-group baseline). Component 0: [1, 0] -> +-0.5 / (std .7071 + eps);
    # component 1 constant -> 0. Weighted sum with w = [2, 1]: +-1.4142; whitening (unbiased std 2) -> +-.7071.
    comps = torch.tensor([[1.0, 4.0], [0.0, 4.0]])
    adv = gdpo_advantages(t(0, 0, dtype=torch.long), comps, torch.ones(2), weights=[2.0, 1.0], leave_one_out=False)
    torch.testing.assert_close(adv, t(1 / math.sqrt(2), -1 / math.sqrt(2)), atol=1e-5, rtol=0)


def test_gdpo_whitened_over_valid_and_invalid_zero():
    torch.manual_seed(0)
    ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    comps = torch.rand(8, 3)
    valid = t(1, 1, 1, 1, 1, 0, 1, 1)
    adv = gdpo_advantages(ids, comps, valid, weights=[1.0, 0.5, 2.0])
    v = valid.bool()
    assert (adv[~v] == 0).all()
    torch.testing.assert_close(adv[v].mean(), torch.tensor(0.0), atol=1e-6, rtol=0)
    torch.testing.assert_close(adv[v].std(), torch.tensor(1.0))


def test_gdpo_weight_count_mismatch_raises():
    with pytest.raises(ValueError, match="reward_weights"):
        gdpo_advantages(t(0, 0, dtype=torch.long), torch.zeros(2, 2), torch.ones(2), weights=[1.0])


def test_gdpo_all_zero_variance_is_zero_not_nan():
    adv = gdpo_advantages(t(0, 0, 1, 1, dtype=torch.long), torch.ones(4, 2), torch.ones(4))
    assert torch.equal(adv, torch.zeros(4))


# ----------------------------------------------------------------------------------------------
# Reinforce++
# ----------------------------------------------------------------------------------------------
def test_reverse_cumsum():
    torch.testing.assert_close(reverse_cumsum(torch.tensor([[1.0, 2.0, 3.0]])), torch.tensor([[6.0, 5.0, 3.0]]))


def test_masked_whiten_population_by_hand():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    m = torch.tensor([[1.0, 1.0, 0.0]])
    torch.testing.assert_close(masked_whiten(x, m, var_floor=1e-8)[:, :2], torch.tensor([[-1.0, 1.0]]))


def test_reinforce_pp_returns_to_go_by_hand():
    # One group of two with rewards [1, 0]: a = [.5, -.5]. KL [[.1,.2,.3],[.4,0,0]], coef 1, mask all ones
    # except row 1 position 2. Returns-to-go: row0 [.6,.5,.3], row1 [.4, 0, (masked)].
    ids, r = t(0, 0, dtype=torch.long), t(1.0, 0.0)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.0, 9.0]])
    pre = torch.tensor([0.5 - 0.6, 0.5 - 0.5, 0.5 - 0.3, -0.5 - 0.4, -0.5 - 0.0])
    expected = (pre - pre.mean()) / pre.var(unbiased=False).sqrt()
    adv = reinforce_plus_plus_advantages(ids, r, torch.ones(2), mask, kl_bt=kl, kl_coef=1.0, kl_returns_to_go=True)
    torch.testing.assert_close(adv[mask.bool()], expected)


def test_reinforce_pp_per_token_kl_matches_nemo_formula():
    torch.manual_seed(1)
    ids = torch.tensor([0, 0, 1, 1])
    r = torch.rand(4)
    mask = (torch.rand(4, 5) > 0.3).float()
    mask[:, 0] = 1
    kl = torch.rand(4, 5)
    adv = reinforce_plus_plus_advantages(ids, r, torch.ones(4), mask, kl_bt=kl, kl_coef=0.1, kl_returns_to_go=False)
    group_mean = torch.stack([r[:2].mean()] * 2 + [r[2:].mean()] * 2)
    pre = (r - group_mean)[:, None] - 0.1 * kl
    mean = (pre * mask).sum() / mask.sum()
    var = ((pre - mean) ** 2 * mask).sum() / mask.sum()
    torch.testing.assert_close(adv[mask.bool()], ((pre - mean) / var.sqrt())[mask.bool()])


def test_reinforce_pp_without_baseline_or_kl():
    mask = torch.ones(3, 2)
    adv = reinforce_plus_plus_advantages(t(0, 1, 2, dtype=torch.long), t(0.0, 1.0, 2.0), torch.ones(3), mask,
                                         minus_baseline=False)
    expected = (t(0.0, 1.0, 2.0) - 1.0) / math.sqrt(2 / 3)
    torch.testing.assert_close(adv, expected[:, None].expand(3, 2))


# ----------------------------------------------------------------------------------------------
# Registry, clipping, message penalties
# ----------------------------------------------------------------------------------------------
def test_compute_advantages_broadcasts_and_dispatches():
    ids, r, valid, mask = t(0, 0, dtype=torch.long), t(1.0, 0.0), torch.ones(2), torch.ones(2, 3)
    cfg = AdvEstimatorConfig(name="grpo", use_leave_one_out_baseline=False, normalize_rewards=False)
    adv = compute_advantages("grpo", group_ids=ids, rewards=r, valid_mask=valid, token_mask=mask, cfg=cfg)
    torch.testing.assert_close(adv, torch.tensor([[0.5] * 3, [-0.5] * 3]))
    comps = torch.tensor([[1.0, 0.5], [0.0, 0.5]])  # GDPO needs two components
    gd = compute_advantages("gdpo", group_ids=ids, rewards=r, valid_mask=valid, token_mask=mask, cfg=cfg,
                            reward_components=comps)
    assert gd.shape == (2, 3)
    rpp = compute_advantages("reinforce_plus_plus", group_ids=ids, rewards=r, valid_mask=valid, token_mask=mask,
                             cfg=cfg)
    torch.testing.assert_close(rpp, torch.tensor([[1.0] * 3, [-1.0] * 3]))


def test_compute_advantages_unknown_name_lists_choices():
    with pytest.raises(ValueError, match=r"gdpo.*grpo.*reinforce_plus_plus"):
        compute_advantages("ppo", group_ids=t(0, dtype=torch.long), rewards=t(1.0), valid_mask=t(1.0),
                           token_mask=torch.ones(1, 1), cfg=AdvEstimatorConfig())


def test_gdpo_needs_components():
    with pytest.raises(ValueError, match="reward_components"):
        compute_advantages("gdpo", group_ids=t(0, dtype=torch.long), rewards=t(1.0), valid_mask=t(1.0),
                           token_mask=torch.ones(1, 1), cfg=AdvEstimatorConfig(name="gdpo"))


def test_clip_advantages():
    x = t(-3.0, 0.0, 3.0)
    torch.testing.assert_close(clip_advantages(x, -1.0, 2.0), t(-1.0, 0.0, 2.0))
    torch.testing.assert_close(clip_advantages(x, None, 2.0), t(-3.0, 0.0, 2.0))
    torch.testing.assert_close(clip_advantages(x, -1.0, None), t(-1.0, 0.0, 3.0))
    assert clip_advantages(x, None, None) is x


def test_message_penalties():
    adv = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    spans = [
        [(0, 2, None), (3, 5, {"invalid_tool_call", "malformed_thinking"})],
        [(1, 3, "malformed_thinking"), (4, 6, "invalid_tool_call")],
    ]
    out = apply_message_advantage_penalties(adv, spans, "invalid_tool_call", -2.0)
    expected = adv.clone()
    expected[0, 3:5] = -2.0
    expected[1, 4:6] = -2.0
    torch.testing.assert_close(out, expected)
    assert torch.equal(adv, torch.arange(12, dtype=torch.float32).reshape(2, 6))  # input untouched
    out2 = apply_message_advantage_penalties(adv, spans, ["malformed_thinking"], 0.0)
    assert out2[1, 1:3].eq(0).all() and out2[0, 3:5].eq(0).all() and out2[1, 4] == 10
    assert apply_message_advantage_penalties(adv, spans, "invalid_tool_call", None) is adv


def test_a_registered_estimator_is_found_by_name_and_the_config_accepts_it(monkeypatch):
    import grpo.registry
    from grpo.advantages import register_estimator
    from grpo.config.load import load_config

    monkeypatch.setattr(grpo.registry, "_ESTIMATORS", dict(grpo.registry._ESTIMATORS))  # undone after the test

    @register_estimator("test_sign_only")
    def sign_only(*, group_ids, rewards, valid_mask, token_mask, cfg, **extra):
        return torch.sign(rewards - rewards.mean())

    adv = compute_advantages("test_sign_only", group_ids=t(0, 0, dtype=torch.long), rewards=t(3.0, 1.0),
                             valid_mask=torch.ones(2), token_mask=torch.ones(2, 2), cfg=AdvEstimatorConfig())
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1.0], [-1.0, -1.0]]))
    assert load_config(None, ["grpo.adv_estimator.name=test_sign_only"]).grpo.adv_estimator.name == "test_sign_only"


# ----------------------------------------------------------------------------------------------
# NeMo-RL semantics: GDPO's components through penalties / scaling / shaping, K >= 2,
# Reinforce++ whitening over the loss's samples
# ----------------------------------------------------------------------------------------------
def nemo_baseline_and_std(prompts, rewards, valid_mask, leave_one_out):
    """NeMo-RL's calculate_baseline_and_std_per_prompt, transcribed (prompts [B, P])."""
    baseline, std = torch.zeros_like(rewards), torch.zeros_like(rewards)
    for u in torch.unique(prompts, dim=0):
        idx = torch.arange(len(prompts))[(prompts == u).all(1)]
        m = (1 - torch.eye(len(idx))) if leave_one_out else torch.ones(len(idx), len(idx))
        if valid_mask[idx].sum() <= 1:
            baseline[idx] = rewards[idx]
            continue
        num_valid = valid_mask[idx].float().sum() - int(leave_one_out)
        pb = m @ (rewards[idx] * valid_mask[idx]) / num_valid
        sq = m @ (rewards[idx] ** 2 * valid_mask[idx]) / num_valid
        baseline[idx] = pb
        std[idx] = ((sq - pb.square()) * (num_valid / (num_valid - 1))).sqrt().nan_to_num(0)
    return baseline, std


def nemo_gdpo(prompts, components, weights, leave_one_out, normalize_rewards):
    """NeMo-RL's GDPOAdvantageEstimator.compute_advantage, transcribed ([B] out)."""
    parts = []
    for r in components:
        base, std_k = nemo_baseline_and_std(prompts, r, torch.ones_like(r), leave_one_out)
        adv_k = (r - base).unsqueeze(-1)
        if normalize_rewards:
            nz = std_k > 0
            adv_k[nz] = adv_k[nz] / (std_k.unsqueeze(-1)[nz] + 1e-6)
        parts.append(adv_k)
    adv = sum(w * a for w, a in zip(weights, parts))
    s = adv.std()
    return ((adv - adv.mean()) / s if s > 0 else adv - adv.mean())[:, 0]


def nemo_scale(r, cfg):
    """NeMo-RL's scale_rewards' _scale, applied to total_reward and every reward/<name> component."""
    r = torch.clamp(r, min=cfg.source_min, max=cfg.source_max)
    return cfg.target_min + (r - cfg.source_min) / (cfg.source_max - cfg.source_min) * (cfg.target_max - cfg.target_min)


@pytest.mark.parametrize("loo,normalize", [(True, True), (False, True), (True, False)])
def test_gdpo_components_are_scaled_as_nemo_rl(loo, normalize):
    from grpo.config import RewardScalingConfig, RewardShapingConfig
    from grpo.rewards import process_reward_components

    g = torch.Generator().manual_seed(0)
    ids = torch.arange(4).repeat_interleave(4)
    correct = torch.randint(0, 2, (16,), generator=g).float()
    bonus = torch.randint(-2, 5, (16,), generator=g).float() * 0.5  # in [-1, 2]: clamped to [0, 1] first
    comps = torch.stack([correct, bonus], dim=1)
    scaling = RewardScalingConfig(enabled=True, source_min=0.0, source_max=1.0, target_min=0.0, target_max=10.0)
    task, shaped = process_reward_components(comps, {}, [5] * 16, None, scaling, RewardShapingConfig())
    torch.testing.assert_close(task, shaped)
    ours = gdpo_advantages(ids, shaped, torch.ones(16), weights=[1.0, 0.5], leave_one_out=loo,
                           normalize_rewards=normalize)
    theirs = nemo_gdpo(ids[:, None], [nemo_scale(comps[:, k], scaling) for k in range(2)], [1.0, 0.5], loo, normalize)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    raw = gdpo_advantages(ids, comps, torch.ones(16), weights=[1.0, 0.5], leave_one_out=loo,
                          normalize_rewards=normalize)
    assert (ours - raw).abs().max() > 0.1  # GDPO on the raw components (what the loop read) differs


def test_gdpo_components_get_penalties_and_shaping():
    from grpo.config import RewardScalingConfig, RewardShapingConfig
    from grpo.rewards import process_reward_components

    ids = torch.tensor([0, 0, 0, 0])
    comps = torch.tensor([[1.0, 0.5], [1.0, 0.5], [0.0, 0.5], [0.0, 0.0]])
    flags = {"malformed_think_tag": torch.tensor([False, True, False, False])}
    shaping = RewardShapingConfig(enabled=True, overlong_buffer_length=20, overlong_buffer_penalty=1.0,
                                  max_response_length=100)
    task, shaped = process_reward_components(comps, flags, [10, 10, 90, 100], None, RewardScalingConfig(), shaping)
    torch.testing.assert_close(task, torch.tensor([[1.0, 0.5], [0.0, 0.0], [0.0, 0.5], [0.0, 0.0]]))
    torch.testing.assert_close(shaped[:, 2], torch.tensor([0.0, 0.0, -0.5, -1.0]))  # 'overlong', last
    adv = gdpo_advantages(ids, shaped, torch.ones(4))
    expected = nemo_gdpo(ids[:, None], [shaped[:, k] for k in range(3)], [1.0] * 3, True, True)
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)
    assert adv[1] < adv[0]  # the penalised sample lost its components
    with pytest.raises(ValueError, match="overlong"):
        gdpo_advantages(ids, shaped, torch.ones(4), weights=[1.0, 1.0])  # K + 1 weights needed
    # stop-properly: the components of truncated samples are scaled by the coefficient
    stop = RewardShapingConfig(enabled=True, stop_properly_penalty_coef=0.5)
    _, shaped = process_reward_components(comps, {}, [10] * 4, torch.tensor([True, False, False, False]),
                                          RewardScalingConfig(), stop)
    torch.testing.assert_close(shaped, torch.tensor([[0.5, 0.25], [1.0, 0.5], [0.0, 0.5], [0.0, 0.0]]))


def test_gdpo_needs_two_components():
    with pytest.raises(ValueError, match=r"at least 2 reward components.*adv_estimator.name='grpo'"):
        gdpo_advantages(t(0, 0, dtype=torch.long), torch.tensor([[1.0], [0.0]]), torch.ones(2))
    with pytest.raises(ValueError, match="at least 2"):
        compute_advantages("gdpo", group_ids=t(0, 0, dtype=torch.long), rewards=t(1.0, 0.0), valid_mask=torch.ones(2),
                           token_mask=torch.ones(2, 1), cfg=AdvEstimatorConfig(name="gdpo"),
                           reward_components=torch.tensor([[1.0], [0.0]]))


def nemo_reinforce_pp(prompts, rewards, mask, minus_baseline=True):
    """NeMo-RL's ReinforcePlusPlusAdvantageEstimator (no KL), transcribed; mask = token_mask · sample_mask."""
    if minus_baseline:
        mean, _ = nemo_baseline_and_std(prompts, rewards, torch.ones_like(rewards), False)
        adv = rewards - mean
    else:
        adv = rewards
    adv = adv.unsqueeze(-1).expand(mask.shape)
    adv_mean = (adv * mask).sum() / mask.sum()
    adv_var = ((adv - adv_mean).pow(2) * mask).sum() / mask.sum()
    return (adv - adv_mean) * adv_var.clamp(min=1e-8).rsqrt()


def test_reinforce_pp_whitens_over_the_loss_samples_as_nemo_rl():
    # Sample 3 is out of the loss (sample_mask 0: overlong filtering) but stays in its group's baseline.
    ids = torch.tensor([0, 0, 1, 1, 1])
    r = t(1.0, 0.0, 1.0, 0.0, 0.0)
    token_mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    sample_mask = t(1.0, 1.0, 1.0, 0.0, 1.0)
    mask = token_mask * sample_mask[:, None]
    expected = nemo_reinforce_pp(ids[:, None], r, mask)
    adv = reinforce_plus_plus_advantages(ids, r, torch.ones(5), token_mask, sample_mask=sample_mask)
    torch.testing.assert_close(adv[mask.bool()], expected[mask.bool()])
    cfg = AdvEstimatorConfig(name="reinforce_plus_plus")
    via_registry = compute_advantages("reinforce_plus_plus", group_ids=ids, rewards=r, valid_mask=torch.ones(5),
                                      token_mask=token_mask, cfg=cfg, sample_mask=sample_mask)
    torch.testing.assert_close(via_registry[mask.bool()], expected[mask.bool()])
    # the whitening ignored sample_mask before: whitened over sample 3's tokens too, which differs
    unmasked = reinforce_plus_plus_advantages(ids, r, torch.ones(5), token_mask)
    assert not torch.allclose(unmasked[mask.bool()], expected[mask.bool()], atol=1e-3)
