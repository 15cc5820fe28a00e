"""NeMo-RL's rollout, reward and advantage summary metrics, as pure functions of one step's rollout.

Each function returns a flat dict keyed *without* the ``train/`` prefix (the loop adds it): floats, and
plain lists for histograms (``MetricsLogger`` writes lists to metrics.jsonl; wandb / tensorboard get
the numbers only). Names follow NeMo-RL's ``_log_mixed_rewards_and_advantages_information``
(``nemo_rl/algorithms/grpo.py``) and its ``reward/<name>`` reward components:

    baseline_reward/pct_0, /pct_1, /pct_mixed    percent of groups whose rewards are all 0, all 1, other
    baseline_reward/histogram                    the group mean rewards, one per group
    advantages/mean, advantages/sum              over the trained tokens of the unmasked samples
    advantages/histogram                         one value per unmasked sample: its mean token advantage
    reward/<component>/mean                      per named reward component

`rollout_summary` has NeMo-RL's rollout metrics (``nemo_rl/experience/rollouts.py``: `run_multi_turn_rollout`'s
``rollout_metrics``, and `_aggregate_multi_turn_rollout_metrics` for the percentiles, per-turn lengths and
rewards). Per-task reward means (``reward_mean/<task>``) and scoring failures are `grpo.metrics.rollout_counts`'.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch


def percentile(values: Sequence[float], p: float) -> float:
    """NeMo-RL's ``pct`` (``nemo_rl/experience/metric_utils.py``): the value at index ⌊n·p/100⌋ of the sorted
    values (the last one at most), 0 for none.

        >>> percentile([5, 1, 4, 2, 3], 95), percentile([5, 1, 4, 2, 3], 50), percentile([], 99)
        (5.0, 3.0, 0.0)
    """
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[min(int(len(ordered) * p / 100), len(ordered) - 1)])


def rollout_summary(trajectories: Sequence) -> dict:
    """NeMo-RL's rollout metrics of a rollout's trajectories (`grpo.trajectory.Trajectory`), over its n samples:

        total_turns                  Σ turns                       avg_turns_per_sample / max_turns_per_sample
        turns_per_sample/p95, /p99   `percentile` of the turns
        natural_termination_rate     #{the environment ended it (terminated)} / n
        max_turns_reached_rate       #{grpo.max_rollout_turns ended it, the environment had not} / n
        truncation_rate              #{truncated: a turn hit its token cap, or the conversation ran out of room} / n
        mean_total_tokens_per_sample Σ (generated + environment tokens) / n   (the prompt not counted)
        mean_gen_tokens_per_sample / max_gen_tokens_per_sample / mean_env_tokens_per_sample
        max_gen_tokens_per_turn/max, /mean, /p95   over the samples' longest single turn
        mean_total_reward / max_total_reward / min_total_reward   the environments' reward (before penalties,
                                                                  scaling and shaping; NeMo-RL's total_reward)
                                                                  over the samples that did not fail (0 if none)

    A sample that ended on an error, or on the length limit before its environment said so, counts in neither
    rate. Empty input gives ``{}``.

        >>> from types import SimpleNamespace as T
        >>> turn = lambda n: T(token_ids=[0] * n, trained=True)
        >>> a = T(turns=1, terminated=True, max_turns_reached=False, truncated=False, num_generated_tokens=4,
        ...       observation_tokens=0, reward=1.0, scored=True, messages=[turn(4)])
        >>> b = T(turns=3, terminated=False, max_turns_reached=True, truncated=False, num_generated_tokens=6,
        ...       observation_tokens=2, reward=0.0, scored=True, messages=[turn(1), turn(5)])
        >>> m = rollout_summary([a, b])
        >>> m["total_turns"], m["natural_termination_rate"], m["max_turns_reached_rate"], m["mean_total_tokens_per_sample"]
        (4, 0.5, 0.5, 6.0)
    """
    n = len(trajectories)
    if n == 0:
        return {}
    turns = [t.turns for t in trajectories]
    gen = [t.num_generated_tokens for t in trajectories]
    env = [t.observation_tokens for t in trajectories]
    longest_turn = [max((len(m.token_ids) for m in t.messages if m.trained), default=0) for t in trajectories]
    rewards = [float(t.reward) for t in trajectories if t.scored] or [0.0]
    return {
        "total_turns": sum(turns),
        "avg_turns_per_sample": sum(turns) / n,
        "max_turns_per_sample": max(turns),
        "turns_per_sample/p95": percentile(turns, 95),
        "turns_per_sample/p99": percentile(turns, 99),
        "natural_termination_rate": sum(bool(t.terminated) for t in trajectories) / n,
        "truncation_rate": sum(bool(t.truncated) for t in trajectories) / n,
        "max_turns_reached_rate": sum(bool(t.max_turns_reached) for t in trajectories) / n,
        "mean_total_tokens_per_sample": (sum(gen) + sum(env)) / n,
        "mean_gen_tokens_per_sample": sum(gen) / n,
        "max_gen_tokens_per_sample": float(max(gen)),
        "mean_env_tokens_per_sample": sum(env) / n,
        "max_gen_tokens_per_turn/max": float(max(longest_turn)),
        "max_gen_tokens_per_turn/mean": sum(longest_turn) / n,
        "max_gen_tokens_per_turn/p95": percentile(longest_turn, 95),
        "mean_total_reward": sum(rewards) / len(rewards),
        "max_total_reward": max(rewards),
        "min_total_reward": min(rewards),
    }


def sample_token_means(values_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    """Per sample, the mean of ``values_bt`` over the positions where ``mask_bt`` is 1; NaN where the
    sample has no such position.  ``[B, T], [B, T] -> [B]``

        m_b = Σ_t mask_bt · values_bt / Σ_t mask_bt

    The dump's per-sample ``advantage`` is this over ``advantages_bt`` and ``token_mask_bt``.

        >>> sample_token_means(torch.tensor([[9., 1., 3.], [5., 5., 5.]]), torch.tensor([[0., 1., 1.], [0., 0., 0.]]))
        tensor([2., nan])
    """
    mask = mask_bt.to(torch.float32)
    total_b = (values_bt.to(torch.float32) * mask).sum(dim=1)
    count_b = mask.sum(dim=1)
    return torch.where(count_b > 0, total_b / count_b.clamp(min=1.0), torch.full_like(total_b, float("nan")))


def group_reward_shares(rewards_b: torch.Tensor, group_ids_b: torch.Tensor) -> dict:
    """Percent of groups (prompts) whose rewards are all exactly 0, all exactly 1, or neither; and the
    group mean rewards (histogram-ready).

        pct_0 = 100 · #{g : r_i = 0 for all i in g} / #groups      pct_mixed = 100 - pct_0 - pct_1

    Groups with rewards all 0 or all 1 give GRPO no signal (zero advantage). As in NeMo-RL, "mixed" is
    everything else, so a group scoring 0.5 on every sample counts as mixed. NeMo-RL counts samples whose
    (possibly leave-one-out) baseline is 0 or 1; this counts groups, which is what the names describe
    (the two agree for equal-size groups without leave-one-out). Empty input gives ``{}``.

        >>> rewards_b = torch.tensor([0., 0., 1., 1., 1., 0., 1., 1.])
        >>> out = group_reward_shares(rewards_b, group_ids_b=torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))
        >>> out["baseline_reward/pct_0"], out["baseline_reward/pct_1"], out["baseline_reward/pct_mixed"]
        (25.0, 50.0, 25.0)
        >>> out["baseline_reward/histogram"]
        [0.0, 1.0, 0.5, 1.0]
    """
    if rewards_b.numel() == 0:
        return {}
    _, group_b = torch.unique(group_ids_b, return_inverse=True)
    rewards = rewards_b.to(torch.float64)
    size_g = torch.bincount(group_b).to(torch.float64)
    zeros_g = torch.bincount(group_b, weights=(rewards == 0).to(torch.float64))
    ones_g = torch.bincount(group_b, weights=(rewards == 1).to(torch.float64))
    mean_g = torch.bincount(group_b, weights=rewards) / size_g
    pct_0 = 100.0 * (zeros_g == size_g).to(torch.float64).mean().item()
    pct_1 = 100.0 * (ones_g == size_g).to(torch.float64).mean().item()
    return {
        "baseline_reward/pct_0": pct_0,
        "baseline_reward/pct_1": pct_1,
        "baseline_reward/pct_mixed": 100.0 - pct_0 - pct_1,
        "baseline_reward/histogram": mean_g.tolist(),
    }


def advantage_summary(advantages_bt: torch.Tensor, token_mask_bt: torch.Tensor, sample_mask_b: torch.Tensor) -> dict:
    """Advantage mean and sum over the trained tokens of the unmasked samples, and one value per unmasked
    sample (its mean token advantage) for a histogram.

        M = token_mask_bt · sample_mask_b[:, None]      sum = Σ M·A      mean = sum / Σ M  (0 without tokens)

    NeMo-RL takes the sum and mean over every entry of its ``[B, T]`` advantages, padding and prompt
    positions included; over trained tokens only, the mean shows whether longer completions get larger
    advantages (it is ~0 when lengths and advantages are unrelated).

        >>> adv = torch.tensor([[0., 1., 1.], [0., -1., 0.], [0., 5., 5.]])
        >>> tok = torch.tensor([[0., 1., 1.], [0., 1., 0.], [0., 1., 1.]])
        >>> advantage_summary(adv, tok, torch.tensor([1., 1., 0.]))
        {'advantages/mean': 0.3333333333333333, 'advantages/sum': 1.0, 'advantages/histogram': [1.0, -1.0]}
    """
    mask_bt = token_mask_bt.to(torch.float32) * sample_mask_b.to(torch.float32)[:, None]
    total = (advantages_bt.to(torch.float32) * mask_bt).sum().item()
    count = mask_bt.sum().item()
    per_sample_b = sample_token_means(advantages_bt, mask_bt)
    return {
        "advantages/mean": total / count if count > 0 else 0.0,
        "advantages/sum": total,
        "advantages/histogram": per_sample_b[~torch.isnan(per_sample_b)].tolist(),
    }


def reward_component_means(components: Mapping[str, Sequence[float] | torch.Tensor]) -> dict:
    """Mean of each named reward component over the samples, as ``reward/<name>/mean`` (a name that
    already starts with ``reward/``, NeMo-RL's spelling of components, is not prefixed twice).

        >>> reward_component_means({"correctness": [1.0, 0.0], "reward/format": torch.tensor([1.0, 1.0])})
        {'reward/correctness/mean': 0.5, 'reward/format/mean': 1.0}
    """
    out = {}
    for name, values in components.items():
        values_b = torch.as_tensor(values, dtype=torch.float64)
        if values_b.numel() == 0:
            continue
        key = name if name.startswith("reward/") else f"reward/{name}"
        out[f"{key}/mean"] = values_b.mean().item()
    return out


def step_summary(batch) -> dict:
    """The summary metrics of a step's `grpo.batch.TrainBatch` (after the advantages phase): group reward shares of the
    environments' rewards over the scored samples, the advantage summary, and the mean of each reward component.

    The shares count each prompt drawn (``group_ids_b``, its slot), not the estimators' groups
    (`grpo.batch.TrainBatch.prompt_groups`): the two differ only where a prompt came twice in a step, and the CPU
    demos' fingerprints pin these numbers as they are."""
    scored_b = batch.scored_b & batch.first_rows()  # a failed sample has no reward: its group's shares are over the
    #                                                 others; a sample once, whatever its branches
    out = {**group_reward_shares(batch.raw_rewards_b[scored_b], batch.group_ids_b[scored_b]),
           **advantage_summary(batch.advantages_bt, batch.token_mask_bt, batch.sample_mask_b)}
    if batch.reward_components_bk is not None:
        out.update(reward_component_means({name: batch.reward_components_bk[:, k]
                                           for k, name in enumerate(batch.component_names)}))
    return out
