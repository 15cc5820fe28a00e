"""Single-turn environments over a reward function ``fn(question, completion, answer, meta) -> float | dict``
(`grpo.tasks.function` has the contract).

`RewardEnvironment` makes a reward function a one-turn environment: the completion is the last assistant
message, every sample terminates after its first turn. It scores in the trainer process (a fast, pure
function: ``arithmetic``) or in a `grpo.tasks.pool.ScoringPool` of spawned workers with a per-sample timeout
(``math``, ``reasoning_gym``, ``function``: ``env.reward_fn``). A sample whose scorer raises or times out scores
0.0 and is counted; the first failure of each kind is logged with its traceback, later ones are only counted,
and the run goes on.
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass, field

from grpo.tasks.function import resolve_reward_fn, score_sample
from grpo.tasks.interface import Environment, EnvironmentReturn
from grpo.tasks.pool import Outcome, ScoringPool

logger = logging.getLogger(__name__)


@dataclass
class ScoreResult:
    """Rewards of one batch. ``components`` (GDPO) is None unless the scorer returned dicts; failed
    samples get 0.0 for every component. ``kinds``: per sample "ok", "error" or "timeout".
    ``metrics``: env/error_rate, env/timeout_rate, env/score_s."""

    rewards: list[float]
    components: list[dict[str, float]] | None
    num_errors: int
    num_timeouts: int
    kinds: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    details: list[str | None] = field(default_factory=list)  # per sample: the traceback of a failure


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
    return ScoreResult(rewards, components, num_errors, num_timeouts, [kind for kind, _ in outcomes], metrics,
                       [None if kind == "ok" else str(payload)[-4000:] for kind, payload in outcomes])


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
        self._logged: set[str] = set()  # failure kinds already logged with a traceback

    def step(self, message_logs: list, metadata: list[dict]) -> EnvironmentReturn:
        """Reward of each conversation's last assistant message; every sample terminates. Metadata keeps the
        row and adds ``reward_components`` (a dict reward's components), and for a sample whose scorer failed
        ``reward_error`` ("reward_error" / "reward_timeout") and ``reward_error_detail`` (its traceback)."""
        import torch

        completions = [next((m["content"] for m in reversed(log) if m["role"] == "assistant"), "")
                       for log in message_logs]
        result = self.score([{"question": md["question"], "completion": c, "answer": md["answer"],
                              "meta": md.get("meta") or {}} for c, md in zip(completions, metadata)])
        comps = result.components or [None] * len(completions)
        out_meta = [{**md, "reward_components": comp, "reward_error": None if kind == "ok" else f"reward_{kind}",
                     "reward_error_detail": detail}
                    for md, comp, kind, detail in zip(metadata, comps, result.kinds, result.details)]
        n = len(completions)
        return EnvironmentReturn(observations=[{"role": "user", "content": ""}] * n, metadata=out_meta,
                                 next_stop_strings=[None] * n, rewards=torch.tensor(result.rewards),
                                 terminateds=torch.ones(n, dtype=torch.bool), answers=[None] * n)

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
                    "(later %ss are only counted in train/reward_%ss):\n%s",
                    self.spec, what, str(sample.get("question", ""))[:200], kind, kind, payload,
                )

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
