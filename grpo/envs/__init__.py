"""Reward environments: score decoded completions against reference answers.

    with build_env(cfg.env, cfg.data) as env:
        result = env.score([{"question": "3+4=", "completion": "7", "answer": "7", "meta": {}}])
        result.rewards        # [1.0]

Every environment is a reward function ``fn(question, completion, answer, meta) -> float | dict``
(see `grpo.envs.function` for the contract) run either in the trainer process (``arithmetic``: a
regex that cannot hang) or in a `grpo.envs.pool.ScoringPool` of spawned workers with a per-sample
timeout (``math``, ``reasoning_gym``, ``function``). A sample whose scorer raises or times out scores
0.0 and is counted; the first failure of each kind is logged with its traceback, later ones are only
counted, and the run goes on.
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass, field

from grpo.envs.function import EnvError, resolve_reward_fn, score_sample
from grpo.envs.pool import Outcome, ScoringPool

logger = logging.getLogger(__name__)

# env.name -> the reward function ("module:function") and whether it must run in worker processes.
SCORERS = {
    "math": ("grpo.envs.math:math_reward", True),
    "reasoning_gym": ("grpo.envs.reasoning_gym:reasoning_gym_reward", True),
    "arithmetic": ("grpo.envs.arithmetic:arithmetic_reward", False),
}


@dataclass
class ScoreResult:
    """Rewards of one batch. ``components`` (GDPO) is None unless the scorer returned dicts; failed
    samples get 0.0 for every component. ``metrics``: env/error_rate, env/timeout_rate, env/score_s."""

    rewards: list[float]
    components: list[dict[str, float]] | None
    num_errors: int
    num_timeouts: int
    metrics: dict[str, float] = field(default_factory=dict)


def collect(outcomes: list[Outcome], seconds: float) -> ScoreResult:
    """Outcomes -> ScoreResult: failures score 0.0; missing components are 0.0.

    >>> r = collect([("ok", (1.0, None)), ("error", "tb"), ("timeout", "t")], seconds=0.5)
    >>> r.rewards, r.num_errors, r.num_timeouts, r.metrics["env/error_rate"]
    ([1.0, 0.0, 0.0], 1, 1, 0.3333333333333333)
    """
    rewards = [payload[0] if kind == "ok" else 0.0 for kind, payload in outcomes]
    keys: dict[str, None] = {}
    for kind, payload in outcomes:
        if kind == "ok" and payload[1] is not None:
            keys.update(dict.fromkeys(payload[1]))
    components = None
    if keys:
        components = [
            {k: (payload[1] or {}).get(k, 0.0) if kind == "ok" else 0.0 for k in keys} for kind, payload in outcomes
        ]
    n = max(len(outcomes), 1)
    num_errors = sum(kind == "error" for kind, _ in outcomes)
    num_timeouts = sum(kind == "timeout" for kind, _ in outcomes)
    metrics = {"env/error_rate": num_errors / n, "env/timeout_rate": num_timeouts / n, "env/score_s": seconds}
    return ScoreResult(rewards, components, num_errors, num_timeouts, metrics)


class RewardEnv:
    """Scores batches with the reward function ``spec``; ``in_process=False`` runs it in worker processes.

    Workers start on the first `score` call; `close` (or leaving a ``with`` block) stops them.
    """

    def __init__(self, spec: str, in_process: bool = False, num_workers: int = 2, timeout_s: float = 10.0):
        self.spec = spec
        self.in_process = in_process
        self._fn = resolve_reward_fn(spec) if in_process else None
        self._pool = None if in_process else ScoringPool(spec, num_workers, timeout_s)
        self._logged: set[str] = set()  # failure kinds already logged with a traceback

    def score(self, samples: list[dict]) -> ScoreResult:
        """Rewards for samples ``{"question", "completion", "answer", "meta"}``, in order."""
        start = time.perf_counter()
        outcomes = self._pool.run(samples) if self._pool is not None else [self._run_one(s) for s in samples]
        self._log_first_failures(samples, outcomes)
        return collect(outcomes, time.perf_counter() - start)

    def _run_one(self, sample: dict) -> Outcome:
        try:
            return "ok", score_sample(self._fn, sample)
        except Exception:
            return "error", traceback.format_exc()

    def _log_first_failures(self, samples: list[dict], outcomes: list[Outcome]) -> None:
        returned_dict = {p[1] is not None for kind, p in outcomes if kind == "ok"}
        if len(returned_dict) == 2 and "mixed" not in self._logged:
            self._logged.add("mixed")
            logger.warning("reward %s returned a dict for some samples and a number for others; "
                           "missing reward components are scored 0.0", self.spec)
        for sample, (kind, payload) in zip(samples, outcomes):
            if kind != "ok" and kind not in self._logged:
                self._logged.add(kind)
                what = "raised" if kind == "error" else "timed out"
                logger.warning(
                    "reward %s %s on the sample with question %r; it scores 0.0 and the run goes on "
                    "(later %ss are only counted in env/%s_rate):\n%s",
                    self.spec, what, str(sample.get("question", ""))[:200], kind, kind, payload,
                )

    def start(self) -> None:
        """Start the worker processes now and wait until they are ready (optional: `score` starts them)."""
        if self._pool is not None:
            self._pool.start(wait=True)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> RewardEnv:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_env(env_cfg, data_cfg=None) -> RewardEnv:
    """The environment of ``env.name`` (an `EnvConfig`); ``data_cfg`` is checked against it when given."""
    if env_cfg.name == "function":
        resolve_reward_fn(env_cfg.reward_fn)  # a bad name fails here, not in every worker
        spec, in_workers = env_cfg.reward_fn, True
    else:
        spec, in_workers = SCORERS[env_cfg.name]
    if env_cfg.name == "reasoning_gym" and data_cfg is not None and not data_cfg.dataset_name.startswith(
        "reasoning_gym:"
    ):
        raise EnvError(
            f"env.name='reasoning_gym' needs data.dataset_name='reasoning_gym:<task>' (got {data_cfg.dataset_name!r})"
        )
    return RewardEnv(spec, in_process=not in_workers, num_workers=env_cfg.num_workers, timeout_s=env_cfg.timeout_s)


__all__ = ["EnvError", "RewardEnv", "ScoreResult", "build_env", "collect"]
