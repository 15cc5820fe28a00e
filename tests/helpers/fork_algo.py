"""What a research fork of train_grpo.py adds, all outside grpo/ (`tests/e2e/test_fork.py` runs it):

    MyConfig            the master config with a new section, ``my_algo`` (validated, in --help-config)
    my_estimator        an advantage estimator that reads ``my_algo.baseline``
    entropy_bonus_loss  the clipped PG loss minus ``my_algo.entropy_coef`` x the policy's entropy

The forked script then differs from train_grpo.py in two lines:
``setup(..., config_cls=MyConfig)`` and ``train_step(..., loss_fn=entropy_bonus_loss)``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from grpo.advantages import grpo_advantages, register_estimator
from grpo.config import MasterConfig
from grpo.loss import LossInputs, clipped_pg_loss_fn


class MyAlgoConfig(BaseModel, extra="forbid"):  # extra="forbid": a misspelt key fails, naming it
    entropy_coef: float = Field(0.0, ge=0.0, description="Weight of the entropy bonus: loss -= entropy_coef * H.")
    baseline: Literal["group_mean", "none"] = Field(
        "group_mean", description="my_estimator's baseline: the prompt group's mean reward, or none (A = r).")


class MyConfig(MasterConfig):
    my_algo: MyAlgoConfig = Field(default_factory=MyAlgoConfig, description="The fork's own algorithm settings.")


@register_estimator("my_estimator")
def my_estimator(*, group_ids, rewards, valid_mask, token_mask, cfg, master_cfg, **extra):
    """A = r − (mean reward of the prompt's group), or A = r with ``my_algo.baseline=none``."""
    if master_cfg.my_algo.baseline == "none":
        return rewards.clone()
    return grpo_advantages(group_ids, rewards, valid_mask, leave_one_out=False, normalize_rewards=False)


def entropy_bonus_loss(x: LossInputs):
    """clipped_pg_loss − entropy_coef · H, H aggregated like the policy term (global normalisers)."""
    loss, metrics = clipped_pg_loss_fn(x)
    bonus = x.cfg.my_algo.entropy_coef * x.aggregate(x.entropy_bt)
    return loss - bonus, {**metrics, "entropy": x.aggregate(x.entropy_bt.detach(), local=True).item()}


entropy_bonus_loss.needs = ("entropy",)  # the forward computes the per-token entropy only for a loss that asks
