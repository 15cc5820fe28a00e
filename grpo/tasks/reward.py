"""Single-turn environments over a reward function ``fn(question, completion, answer, meta) -> float | dict``
(`grpo.tasks.function` has the contract).

`RewardEnvironment` makes a reward function a one-turn environment: the completion is the last assistant
message, every sample terminates after its first turn. It scores in the trainer process (a fast, pure
function: ``arithmetic``) or in a `grpo.tasks.pool.ScoringPool` of spawned workers with a per-sample timeout
(``math``, ``reasoning_gym``, ``function``: ``env.reward_fn``). A sample whose scorer raises
(``reward_error``, classed by its exception where it was raised: ``infra`` for a timeout, a dropped connection,
an HTTP 5xx / 408 / 429 (then the reason is ``http_*``), ``data`` otherwise) or runs past ``env.timeout_s``
(``reward_timeout``, infra) is reported failed (``EnvironmentReturn.failures``), never scored: the router
(`grpo.tasks.router.Environments`) scores it again within ``grpo.rollout_failure``'s budgets, then the trainer
masks it. Scoring failures are counted (``env/error_rate``, ``env/timeout_rate``) and the run goes on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from grpo.tasks.failures import http_reason
from grpo.tasks.function import resolve_reward_fn, score_sample
from grpo.tasks.interface import Environment, EnvironmentReturn
from grpo.tasks.pool import CallError, Outcome, ScoringPool
from grpo.trajectory import Failure

logger = logging.getLogger(__name__)


@dataclass
class ScoreResult:
    """Rewards of one batch. ``failures``: per sample None, or the `grpo.trajectory.Failure` of a sample
    whose scorer failed: its ``rewards`` entry (0.0) and components are placeholders, never a score.
    ``components`` (GDPO) is None unless the scorer returned dicts (a component a sample did not return: 0.0).
    ``metrics``: env/error_rate, env/timeout_rate, env/score_s."""

    rewards: list[float]
    components: list[dict[str, float]] | None
    num_errors: int
    num_timeouts: int
    failures: list[Failure | None] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def outcome_failure(outcome: Outcome) -> Failure | None:
    """The `Failure` of a scorer's outcome: None when it scored; ``reward_timeout`` (infra) past its time; for
    what it raised, ``reward_error`` (or the ``http_*`` reason of an HTTP status) with the class the worker gave.

        >>> outcome_failure(("ok", (1.0, None))), outcome_failure(("timeout", "no reward after 5s")).kind
        (None, 'infra')
        >>> f = outcome_failure(("error", CallError("infra", "Traceback ... 503", status=503)))
        >>> f.reason, f.kind
        ('http_5xx', 'infra')
    """
    kind, payload = outcome
    if kind == "ok":
        return None
    if kind == "timeout":
        return Failure.of("reward_timeout", str(payload))
    status = getattr(payload, "status", None)
    return Failure.of(http_reason(status) if status is not None else "reward_error", str(payload),
                      getattr(payload, "kind", None))


def collect(outcomes: list[Outcome], seconds: float) -> ScoreResult:
    """Outcomes -> ScoreResult: a failed sample is a `Failure` (its reward a 0.0 placeholder); a component a
    sample did not return is 0.0.

    >>> r = collect([("ok", (1.0, None)), ("error", CallError("data", "tb")), ("timeout", "t")], seconds=0.5)
    >>> r.rewards, [f and f.reason for f in r.failures], r.num_errors, r.metrics["env/error_rate"]
    ([1.0, 0.0, 0.0], [None, 'reward_error', 'reward_timeout'], 1, 0.3333333333333333)
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
    return ScoreResult(rewards, components, num_errors, num_timeouts, [outcome_failure(o) for o in outcomes], metrics)


class RewardEnvironment(Environment):
    """A single-turn environment over the reward function ``spec``; ``in_process=False`` runs it in worker
    processes. `step` scores the last assistant message of each conversation against the row's answer
    and ends every sample; `score` scores plain samples ``{"question", "completion", "answer", "meta"}``.

    Workers start on the first call; `shutdown` (or leaving a ``with`` block) stops them.
    """

    bounds_own_time = True  # every sample has env.timeout_s: `Environments` need not guard the call

    def __init__(self, spec: str, in_process: bool = False, num_workers: int = 2, timeout_s: float = 10.0):
        self.spec = spec
        self.in_process = in_process
        self._fn = resolve_reward_fn(spec) if in_process else None
        self._pool = None if in_process else ScoringPool(spec, num_workers, timeout_s)
        self._logged: set[str] = set()  # warnings already given

    def step(self, message_logs: list, metadata: list[dict]) -> EnvironmentReturn:
        """Reward of each conversation's last assistant message; every sample terminates. Metadata keeps the
        row and adds ``reward_components`` (a dict reward's components); a sample whose scorer failed is in
        ``failures`` (its reward a placeholder)."""
        import torch

        completions = [next((m["content"] for m in reversed(log) if m["role"] == "assistant"), "")
                       for log in message_logs]
        result = self.score([{"question": md["question"], "completion": c, "answer": md["answer"],
                              "meta": md.get("meta") or {}} for c, md in zip(completions, metadata)])
        comps = result.components or [None] * len(completions)
        out_meta = [{**md, "reward_components": comp} for md, comp in zip(metadata, comps)]
        n = len(completions)
        return EnvironmentReturn(observations=[{"role": "user", "content": ""}] * n, metadata=out_meta,
                                 next_stop_strings=[None] * n, rewards=torch.tensor(result.rewards),
                                 terminateds=torch.ones(n, dtype=torch.bool), answers=[None] * n,
                                 failures=result.failures)

    def score(self, samples: list[dict]) -> ScoreResult:
        """Rewards for samples ``{"question", "completion", "answer", "meta"}``, in order."""
        start = time.perf_counter()
        outcomes = self._pool.run(samples) if self._pool is not None else [self._run_one(s) for s in samples]
        self._warn_mixed(outcomes)
        return collect(outcomes, time.perf_counter() - start)

    def _run_one(self, sample: dict) -> Outcome:
        try:
            return "ok", score_sample(self._fn, sample)
        except Exception as err:
            return "error", CallError.of(err)

    def _warn_mixed(self, outcomes: list[Outcome]) -> None:
        """Warn once when the scorer returned a dict for some samples and a number for others. Failures are the
        router's to log (`grpo.tasks.router.Environments`: the first of each reason, with its traceback)."""
        returned_dict = {p[1] is not None for kind, p in outcomes if kind == "ok"}
        if len(returned_dict) == 2 and "mixed" not in self._logged:
            self._logged.add("mixed")
            logger.warning("reward %s returned a dict for some samples and a number for others; "
                           "missing reward components are scored 0.0", self.spec)

    def start(self) -> None:
        """Start the worker processes now and wait until they are ready (optional: `score` starts them)."""
        if self._pool is not None:
            self._pool.start(wait=True)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> RewardEnvironment:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
