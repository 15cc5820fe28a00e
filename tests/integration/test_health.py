"""grpo.system.health: non-finite detection and the stop rule, a skipped optimizer step on a real DeepSpeed engine,
collapse warnings, the reward error budget."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from grpo.system.health import CollapseWatch, NonFiniteGuard, RolloutBudget, nonfinite, overflow_check_gap, skip_nonfinite_loss
from grpo.trajectory import Failure
from tests.helpers.batches import train_batch

NAN, INF = float("nan"), float("inf")


# --------------------------------------------------------------------------------------------------
# nonfinite, NonFiniteGuard
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, expected", [
    ((0.5, 1.0, [1.0, 0.0]), None),
    ((None, None, None), None),
    ((NAN, 1.0, [1.0]), "train/loss is nan"),
    ((1.0, INF, [1.0]), "train/grad_norm is inf"),
    ((-INF, NAN, None), "train/loss is -inf"),
    ((NAN, NAN, [0.0, 1e39]), "the reward of sample 1 is inf as float32 (1e+39)"),    # rewards come first
    ((0.1, 0.1, torch.tensor([0.0, -1e39], dtype=torch.float64)), "the reward of sample 1 is -inf as float32"),
    ((0.1, 0.1, [3e38, NAN]), "the reward of sample 1 is nan as float32 (nan)"),
    ((torch.tensor(1.0), torch.tensor(INF), None), "train/grad_norm is inf"),
])
def test_nonfinite_names_the_first_bad_quantity(args, expected):
    got = nonfinite(*args)
    assert got is None if expected is None else got.startswith(expected), got


def test_1e39_is_a_finite_python_float_but_not_a_finite_reward():
    assert math.isfinite(1e39) and nonfinite(rewards_b=[1e39]) is not None


def test_guard_skips_then_stops_after_max_consecutive_and_counts_all():
    guard = NonFiniteGuard(3)
    decisions = [guard.update(p) for p in ["train/loss is nan", None, "a", "b", None, "train/grad_norm is inf", "c",
                                           "d"]]
    assert decisions == ["skip", "ok", "skip", "skip", "ok", "skip", "skip", "stop"]
    assert guard.count == 6
    message = guard.message()
    assert "3 non-finite steps in a row (policy.max_nonfinite_steps=3)" in message
    assert "the first: train/grad_norm is inf" in message  # the first of the streak that stops the run
    with pytest.raises(ValueError, match="policy.max_nonfinite_steps=0"):
        NonFiniteGuard(0)


# --------------------------------------------------------------------------------------------------
# a non-finite optimizer step on a real engine
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["auto", "ds_configs/zero3.json"])
def engines_pair(tmp_path_factory, request):
    """Two one-rank fp32 engines from the same weights: without ZeRO (auto: `CheckedAdamW`), and ZeRO-3."""
    from grpo.system import engines
    from grpo.system.dist import init_distributed
    from grpo.config import MasterConfig
    from grpo.tasks.toy import save_tiny_model

    model_dir = save_tiny_model(str(tmp_path_factory.mktemp("health") / "model"), seed=3)
    init_distributed()
    cfg = MasterConfig.model_validate({
        "policy": {"model_name": model_dir, "precision": "float32", "train_global_batch_size": 2,
                   "train_micro_batch_size": 2, "optimizer": {"lr": 1e-2},
                   "scheduler": {"name": "linear", "warmup_steps": 0}, "deepspeed_config": request.param},
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 1}})
    return [engines.build_policy_engine(cfg, 1, total_optimizer_steps=4) for _ in range(2)]


def _batch():
    ids = torch.randint(3, 80, (2, 7), generator=torch.Generator().manual_seed(4))
    return [train_batch(input_ids_bt=ids, attention_mask_bt=torch.ones_like(ids))]


def _weights(engine) -> dict:
    from grpo.system.weights import iter_gathered_params

    return {n: t.clone() for bucket in iter_gathered_params(engine) for n, t in bucket}


def _good(lp, mb):
    return -lp.sum() / 12, {}


def _inf_without_gradient(lp, mb):
    """A loss that is inf while its gradient is finite: an inf term that does not depend on the weights."""
    return -lp.sum() / 12 + torch.tensor(INF), {}


def test_a_nonfinite_step_is_skipped_and_leaves_no_trace(engines_pair):
    from grpo.system.training import train_on_batch

    a, b = engines_pair
    assert overflow_check_gap(a) is None
    before, lr_before = _weights(a), a.get_lr()[0]
    out = train_on_batch(a, _batch(), skip_nonfinite_loss(_inf_without_gradient))
    # ZeRO reports an overflow's norm as inf, CheckedAdamW the NaN it measured
    assert math.isnan(out["loss"]) and not math.isfinite(out["grad_norm"]) and not a.was_step_applied()
    assert nonfinite(out["loss"], out["grad_norm"]) == "train/loss is nan"
    for name, w in _weights(a).items():
        torch.testing.assert_close(w, before[name], atol=0, rtol=0)
    assert a.get_lr()[0] == lr_before and a.skipped_steps == 1
    # The next good step is exactly the first step of an engine that never saw the bad one: no Adam moment,
    # step count, scheduler position or stale gradient was left behind.
    out_a = train_on_batch(a, _batch(), skip_nonfinite_loss(_good))
    out_b = train_on_batch(b, _batch(), _good)
    assert a.was_step_applied() and out_a["grad_norm"] == out_b["grad_norm"] and out_a["lr"] == out_b["lr"]
    wb = _weights(b)
    for name, w in _weights(a).items():
        torch.testing.assert_close(w, wb[name], atol=0, rtol=0)
    assert any((w != before[name]).any() for name, w in wb.items())  # and that step did move the weights


def test_without_the_wrapper_deepspeed_applies_an_inf_loss_with_finite_gradients(engines_pair):
    from grpo.system.training import train_on_batch

    _, b = engines_pair
    before = _weights(b)
    out = train_on_batch(b, _batch(), _inf_without_gradient)
    assert math.isinf(out["loss"]) and math.isfinite(out["grad_norm"]) and b.was_step_applied()
    assert any((w != before[name]).any() for name, w in _weights(b).items())


def test_overflow_check_gap_names_configs_that_apply_nan_gradients():
    def engine(stage, bf16=False, check=True, optimizer=None):
        return SimpleNamespace(zero_optimization_stage=lambda: stage, bfloat16_enabled=lambda: bf16,
                               optimizer=optimizer or SimpleNamespace(),
                               _config=SimpleNamespace(bfloat16_config=SimpleNamespace(check_grad_overflow=check)))

    assert "no ZeRO stage" in overflow_check_gap(engine(0))
    assert overflow_check_gap(engine(0, optimizer=SimpleNamespace(overflow=False))) is None  # CheckedAdamW
    assert "bf16.check_grad_overflow=false" in overflow_check_gap(engine(2, bf16=True, check=False))
    assert overflow_check_gap(engine(2, bf16=True)) is None and overflow_check_gap(engine(3, True, False)) is None


# --------------------------------------------------------------------------------------------------
# collapse
# --------------------------------------------------------------------------------------------------
def test_collapse_watch_warns_once_on_uniform_entropy(caplog):
    watch = CollapseWatch(vocab_size=1000, patience=3)
    ln_v = math.log(1000)
    seq = [(ln_v * 0.5, 1.0), (ln_v, 1.0), (ln_v, 1.0), (ln_v * 0.5, 1.0), (ln_v, 1.0), (ln_v, 1.0), (ln_v, 1.0),
           (ln_v, 1.0)]
    out = [watch.update(e, g, [0.0, 1.0]) for e, g in seq]
    assert [m is not None for m in out] == [False] * 6 + [True, False]  # three in a row, then only once
    assert "collapsed to a uniform distribution" in out[6] and "policy.optimizer.lr" in out[6]
    assert "collapsed" in caplog.text


def test_collapse_watch_zero_grad_norm_only_counts_when_rewards_vary():
    watch = CollapseWatch(vocab_size=1000, patience=2)
    assert watch.update(1.0, 0.0, [1.0, 1.0]) is None and watch.update(1.0, 0.0, [0.0, 0.0]) is None
    assert watch.update(1.0, 0.0, [0.0, 1.0]) is None
    message = watch.update(1.0, 0.0, [0.0, 1.0])
    assert "train/grad_norm is exactly 0 for 2 steps while the rewards vary" in message
    assert watch.update(1.0, 1e-9, [0.0, 1.0]) is None and watch.update(None, None, None) is None


# --------------------------------------------------------------------------------------------------
# the step budget of failed rollouts (grpo.rollout_failure)
# --------------------------------------------------------------------------------------------------
def _failed(task="judge", reason="http_5xx", detail="Traceback (most recent call last):\n  ...\nHTTPError: 503"):
    return SimpleNamespace(task_name=task, failure=Failure.of(reason, detail), retries=4)


def test_rollout_budget_trains_at_the_fraction_skips_below_and_stops_after_the_streak():
    budget = RolloutBudget(min_fraction=0.9, max_consecutive=3)
    def scored(n_failed, n):
        return torch.arange(n) >= n_failed

    assert budget.trainable(scored(1, 10)) and not budget.trainable(scored(2, 10)) and budget.trainable(scored(0, 1))
    assert not budget.skipped([_failed()]) and not budget.skipped([_failed(task="other")])
    budget.trained()  # a trained step ends the streak, not the run total
    assert (budget.consecutive, budget.skipped_steps) == (0, 2)
    assert [budget.skipped([_failed()]) for _ in range(3)] == [False, False, True]
    message = budget.message()
    assert "3 steps in a row skipped" in message and "max_consecutive_skipped_steps=3" in message
    assert "environment 'judge': http_5xx (infra): HTTPError: 503" in message and "\n" not in message


def test_rollout_budget_counters_survive_a_checkpoint():
    budget = RolloutBudget(0.5, 4)
    budget.count([_failed(), SimpleNamespace(task_name="judge", failure=None, retries=1), None])
    budget.skipped([_failed()])
    state = budget.state_dict()
    again = RolloutBudget(0.5, 4)
    again.load_state_dict(state)
    assert again.state_dict() == state == {"skipped_steps": 1, "consecutive_skipped_steps": 1,
                                           "failed_samples": {"http_5xx": 1}, "retries": 5}
    assert again.metrics() == {"rollout/skipped_steps": 1, "rollout/failed_samples_total": 1}
    with pytest.raises(ValueError, match="min_step_batch_fraction=0"):
        RolloutBudget(0.0, 1)


@pytest.mark.slow
def test_zero2_skips_a_nonfinite_step_too(engines_pair, tmp_path):
    """The ZeRO-1/2 optimizer has its own overflow check: the same skip (ds_configs/zero2.json, fp32)."""
    from grpo.system import engines
    from grpo.system.training import train_on_batch
    from grpo.config import MasterConfig
    from grpo.tasks.toy import save_tiny_model

    model_dir = save_tiny_model(str(tmp_path / "model"), seed=3)
    cfg = MasterConfig.model_validate({
        "policy": {"model_name": model_dir, "precision": "float32", "train_global_batch_size": 2,
                   "train_micro_batch_size": 2, "deepspeed_config": "ds_configs/zero2.json"},
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 1}})
    engine = engines.build_policy_engine(cfg, 1, total_optimizer_steps=4)
    assert overflow_check_gap(engine) is None
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    out = train_on_batch(engine, _batch(), skip_nonfinite_loss(_inf_without_gradient))
    assert not engine.was_step_applied() and math.isinf(out["grad_norm"])
    for n, p in engine.module.named_parameters():
        torch.testing.assert_close(p.detach(), before[n], atol=0, rtol=0)
    train_on_batch(engine, _batch(), _good)
    assert engine.was_step_applied()
