"""Several rewards for one sample: ``env.name: combined`` scores each conversation with every environment of
``env.rewards`` (a reward model and a verifier, say) and combines their rewards as ``env.combine`` says:

- ``weighted_sum``: one scalar reward, r = Σ_k w_k · r_k (``env.weights[k]``, default 1);
- ``components``: each environment's reward is a named reward component (its key in ``env.rewards``), for GDPO
  (``grpo.adv_estimator.name: gdpo``, which normalises each component per group; ``grpo.adv_estimator.reward_weights``
  weighs them in the names' sorted order); the scalar reward is their sum.

A reward model whose scores are computed at the rollout's collective point (`grpo.tasks.pending.PendingScore`)
counts 0 here and leaves its pending score, weighted and named, for that point to add.

Each environment must end every sample in one turn (a reward function, a reward model). A sample that any of them
failed fails (`grpo.tasks.failures`: retried, then masked, never scored 0). Each environment's own metrics
(``global_post_process_and_metrics``) are computed on its own rewards and logged under its key.

    env:
      name: combined
      combine: components            # or weighted_sum (with env.weights)
      rewards:
        math: {name: math}
        rm: {name: reward_model, reward_model: {model_name: ..., batch_size: 8}}
"""

from __future__ import annotations

import dataclasses

from grpo.tasks.interface import Environment, EnvironmentReturn, check_return
from grpo.tasks.pending import OWN_REWARDS, PENDING  # (OWN_REWARDS: the parts' rewards, for their metrics)


def combine(rewards: dict[str, list[float]], mode: str, weights: dict[str, float]) -> list[float] | dict:
    """The combined reward of each sample: Σ_k w_k · r_k (``weighted_sum``) or the components themselves.

        >>> combine({"a": [1.0, 0.0], "b": [0.5, 2.0]}, "weighted_sum", {"b": 2.0})
        [2.0, 4.0]
        >>> combine({"a": [1.0, 0.0], "b": [0.5, 2.0]}, "components", {})
        {'a': [1.0, 0.0], 'b': [0.5, 2.0]}
    """
    if mode == "components":
        return dict(rewards)
    n = len(next(iter(rewards.values())))
    return [sum(weights.get(k, 1.0) * r[i] for k, r in rewards.items()) for i in range(n)]


class CombinedEnvironment(Environment):
    """``envs``: name -> a one-turn environment; ``mode``: ``weighted_sum`` | ``components``."""

    def __init__(self, envs: dict[str, Environment], mode: str, weights: dict[str, float] | None = None):
        self.envs, self.mode, self.weights = envs, mode, dict(weights or {})
        self.reward_kind = "dict" if mode == "components" else "scalar"

    def step(self, message_logs: list, metadata: list) -> EnvironmentReturn:
        import torch

        n = len(message_logs)
        own: dict[str, list[float]] = {}
        failures = [None] * n
        pending: list[list] = [[] for _ in range(n)]
        for name, env in self.envs.items():
            ret = check_return(env.step([list(m) for m in message_logs], [dict(md) if isinstance(md, dict) else md
                                                                            for md in metadata]), n)
            if isinstance(ret.rewards, dict):
                raise ValueError(f"env.rewards.{name}: returned named rewards; a combined environment takes one "
                                 "reward per environment")
            if not bool(ret.terminateds.all()):
                raise ValueError(f"env.rewards.{name}: did not end every sample in one turn (combined environments "
                                 "are single-turn)")
            own[name] = ret.rewards.tolist()
            failures = [f or g for f, g in zip(failures, ret.failures)]
            for i, md in enumerate(ret.metadata):  # a reward model scored later: its share of the combination
                for p in (md or {}).get(PENDING, []) if isinstance(md, dict) else []:
                    pending[i].append(dataclasses.replace(
                        p, weight=p.weight * (1.0 if self.mode == "components" else self.weights.get(name, 1.0)),
                        component=name if self.mode == "components" else None, own=name))
        combined = combine(own, self.mode, self.weights)
        rewards = ({k: torch.tensor(v) for k, v in combined.items()} if isinstance(combined, dict)
                   else torch.tensor(combined))
        out_meta = [{**(md or {}), OWN_REWARDS: {k: own[k][i] for k in own}, **({PENDING: pending[i]} if pending[i]
                                                                                else {})}
                    for i, md in enumerate(metadata)]
        return EnvironmentReturn(observations=[{"role": "user", "content": ""}] * n, metadata=out_meta,
                                 next_stop_strings=[None] * n, rewards=rewards,
                                 terminateds=torch.ones(n, dtype=torch.bool), answers=[None] * n, failures=failures)

    def global_post_process_and_metrics(self, batch: dict) -> tuple[dict, dict]:
        """Each environment's metrics on its own rewards (``<name>/<metric>``)."""
        import torch

        metrics = {}
        own = [(md or {}).get(OWN_REWARDS, {}) for md in batch["extra_env_info"]]
        for name, env in self.envs.items():
            hook = getattr(env, "global_post_process_and_metrics", None)
            if hook is None:
                continue
            rewards = torch.tensor([o.get(name, 0.0) for o in own], dtype=torch.float32)
            _, env_metrics = hook({**batch, "rewards": rewards, "total_reward": rewards})
            metrics.update({f"{name}/{k}": v for k, v in (env_metrics or {}).items()})
        return batch, metrics

    def shutdown(self) -> None:
        for env in self.envs.values():
            env.shutdown()
