"""NeMo-RL's reward and advantage summary metrics, as pure functions of one step's rollout.

Each function returns a flat dict keyed *without* the ``train/`` prefix (the loop adds it): floats, and
plain lists for histograms (``MetricsLogger`` writes lists to metrics.jsonl; wandb / tensorboard get
the numbers only). Names follow NeMo-RL's ``_log_mixed_rewards_and_advantages_information``
(``nemo_rl/algorithms/grpo.py``) and its ``reward/<name>`` reward components:

    baseline_reward/pct_0, /pct_1, /pct_mixed    percent of groups whose rewards are all 0, all 1, other
    baseline_reward/histogram                    the group mean rewards, one per group
    advantages/mean, advantages/sum              over the trained tokens of the unmasked samples
    advantages/histogram                         one value per unmasked sample: its mean token advantage
    reward/<component>/mean                      per named reward component

Per-task reward means (``reward_mean/<task>``) are `grpo.metrics.rollout_counts`'.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch


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
    environments' rewards, the advantage summary, and the mean of each reward component."""
    out = {**group_reward_shares(batch.raw_rewards_b, batch.group_ids_b),
           **advantage_summary(batch.advantages_bt, batch.token_mask_bt, batch.sample_mask_b)}
    if batch.reward_components_bk is not None:
        out.update(reward_component_means({name: batch.reward_components_bk[:, k]
                                           for k, name in enumerate(batch.component_names)}))
    return out
