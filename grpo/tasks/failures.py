"""Rollout failures: what broke outside the policy, and whether trying again can help.

A sample *fails* when something other than the policy's output breaks: an environment or reward call raises,
runs past its timeout or returns malformed data, a server answers 5xx / 408 / 429 or not at all. What the policy
wrote (a wrong answer, a malformed tool call, an overlong output) is never a failure: it keeps its reward and its
penalties. A failed sample is retried within a budget, then masked: out of the loss and out of its group's
baseline (never scored 0, which would teach the group's other members they were better than they were).

Every failure has a reason and a class (`grpo.trajectory.REASONS`, `grpo.trajectory.Failure`: the data, with the
trajectory types), NeMo-RL's split (``nemo_rl/experience/failures.py``); this module holds the rules:

- ``infra``: the sample is fine, the service is not (a timeout, a dropped connection, a 5xx, 408 or 429);
  retried up to ``grpo.rollout_failure.max_infra_attempts_per_prompt`` attempts with exponential backoff;
- ``data``: deterministic and sample-specific (malformed data, an exception of the environment's or reward's
  own code); retried up to ``max_data_attempts_per_prompt`` attempts: one retry separates a transient failure
  from a deterministic one.

As in NeMo-RL, an exception that is not recognised as infrastructure is ``data``: an unexpected exception is
more likely a bug than a blip, and the small budget surfaces it instead of retrying it into silence. Classify
where the exception still exists (in the worker process that raised it), then carry the class across.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

from grpo.trajectory import DATA, INFRA, Failure

# Exception class names (anywhere in the MRO) that mean the transport broke, for libraries that are not imported
# here (aiohttp, httpx, requests, openai): NeMo-RL's _INFRA_TYPE_NAMES and their kin.
_INFRA_TYPE_NAMES = frozenset({
    "ClientConnectionError", "ClientConnectorError", "ClientOSError", "ClientPayloadError",
    "ServerConnectionError", "ServerDisconnectedError", "ServerTimeoutError",  # aiohttp
    "ConnectError", "ReadError", "WriteError", "RemoteProtocolError", "ConnectTimeout", "ReadTimeout",
    "WriteTimeout", "PoolTimeout",  # httpx
    "APIConnectionError", "APITimeoutError",  # openai
})
_MAX_CAUSE_DEPTH = 8
# The smallest magnitude that rounds to inf as float32: halfway between the largest float32, (2 - 2^-23) * 2^127,
# and 2^128; a tie rounds to even, here up (the largest float32's mantissa is odd).
FLOAT32_OVERFLOW = 2.0 ** 128 - 2.0 ** 103


def http_status_is_infra(status: int) -> bool:
    """NeMo-RL's rule: 5xx and the retriable 4xx (408, 429) mean the server is unwell; any other 4xx describes the
    request, which another try would send the same.

        >>> [http_status_is_infra(s) for s in (500, 503, 408, 429, 400, 404)]
        [True, True, True, True, False, False]
    """
    return status >= 500 or status in (408, 429)


def http_reason(status: int) -> str:
    """The failure reason of an HTTP error status.

        >>> [http_reason(s) for s in (502, 408, 429, 422)]
        ['http_5xx', 'http_408', 'http_429', 'http_4xx']
    """
    if status >= 500:
        return "http_5xx"
    return {408: "http_408", 429: "http_429"}.get(status, "http_4xx")


def http_status(exc: BaseException) -> int | None:
    """The HTTP status an exception carries (aiohttp's ``.status``, httpx / openai ``.status_code`` or
    ``.response.status_code``), or None."""
    for obj in (exc, getattr(exc, "response", None)):
        for name in ("status", "status_code"):
            value = getattr(obj, name, None)
            if isinstance(value, int) and 100 <= value <= 599:
                return value
    return None


def classify_exception(exc: BaseException) -> str:
    """``"infra"`` or ``"data"`` for an exception raised by an environment or reward call (NeMo-RL's
    ``classify_rollout_failure``): an HTTP error by its status, then TimeoutError, ConnectionError and the
    transport errors of the HTTP clients (by class name) along the ``__cause__`` chain are infra; anything else
    is data.

        >>> classify_exception(TimeoutError()), classify_exception(ConnectionResetError()), classify_exception(KeyError("x"))
        ('infra', 'infra', 'data')
        >>> try:
        ...     try:
        ...         raise ConnectionRefusedError("down")
        ...     except OSError as err:
        ...         raise RuntimeError("the judge failed") from err
        ... except RuntimeError as wrapped:
        ...     classify_exception(wrapped)
        'infra'
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    for _ in range(_MAX_CAUSE_DEPTH):
        if current is None or id(current) in seen:
            break
        seen.add(id(current))
        status = http_status(current)
        if status is not None:
            return INFRA if http_status_is_infra(status) else DATA
        if isinstance(current, (TimeoutError, ConnectionError)):
            return INFRA
        if any(c.__name__ in _INFRA_TYPE_NAMES for c in type(current).__mro__):
            return INFRA
        current = current.__cause__ or current.__context__
    return DATA


def reward_problem(value, what: str = "the reward") -> str | None:
    """Why ``value`` is not a reward, or None. A reward is a real number (not a bool) that stays finite in float32,
    the dtype rewards are trained in: NaN and inf are not, nor is 1e300 (finite in float64, inf as float32 under
    IEEE round-to-nearest-even, as torch converts). Every source of rewards (environments' returns, reward
    functions, judges, reward models, agents, NeMo-Gym) applies this one rule where it reads the value, and a value
    it refuses fails that sample (``env_malformed``), never its batch or its step.

        >>> reward_problem(1.5) is None, reward_problem(-3.4e38) is None
        (True, True)
        >>> reward_problem(float("nan"))
        'the reward is nan: expected a finite number'
        >>> reward_problem(1e300, "the judge's score")
        "the judge's score is 1e+300: inf as float32, the dtype rewards train in; expected a finite float32 number"
        >>> reward_problem(True), reward_problem("1")
        ('the reward is True: expected a finite number', "the reward is '1': expected a finite number")
    """
    if isinstance(value, bool) or not isinstance(value, Real):
        return f"{what} is {value if isinstance(value, bool) else repr(value)[:100]}: expected a finite number"
    x = float(value)
    if not math.isfinite(x):
        return f"{what} is {x}: expected a finite number"
    if abs(x) >= FLOAT32_OVERFLOW:
        return f"{what} is {x:g}: inf as float32, the dtype rewards train in; expected a finite float32 number"
    return None


def backoff_s(retry: int, base_s: float, max_s: float) -> float:
    """Seconds to wait before retry number ``retry`` (1, 2, ...) of an infra failure: base · 2^(retry − 1),
    capped at ``max_s`` (NeMo-RL's ``backoff_base_s`` / ``max_backoff_s``). Data failures are retried at once.

        >>> [backoff_s(k, 1.0, 5.0) for k in (1, 2, 3, 4)]
        [1.0, 2.0, 4.0, 5.0]
    """
    return min(base_s * 2 ** (retry - 1), max_s)


def attempts_allowed(kind: str, max_infra_attempts: int, max_data_attempts: int) -> int:
    """How many attempts in all (the first included) a call that failed with ``kind`` may take."""
    return max_infra_attempts if kind == INFRA else max_data_attempts


def failure_of_exception(exc: BaseException, reason: str, detail: str) -> Failure:
    """The `Failure` of an exception an environment or reward call raised: an HTTP error by its status
    (`http_reason`), anything else as ``reason`` (``env_error`` / ``reward_error``); the class by
    `classify_exception`.

        >>> failure_of_exception(ConnectionResetError(), "env_error", "tb").kind
        'infra'
        >>> class Bad(Exception): status = 503
        >>> failure_of_exception(Bad(), "env_error", "tb").reason
        'http_5xx'
    """
    status = http_status(exc)
    return Failure.of(http_reason(status) if status is not None else reason, detail, classify_exception(exc))


@dataclass(frozen=True)
class RetryPolicy:
    """The retry budgets of environment and reward calls (``grpo.rollout_failure``, NeMo-RL's
    ``RolloutRetryPolicy``): attempts in all, the first included, per failure class, as two independent counters
    (a sample may take up to ``max_infra_attempts + max_data_attempts - 1`` attempts), and the backoff before an
    infra retry. The defaults live in the config only; `single_attempt` is the explicit no-retry policy of an
    `Environments` built by hand.

        >>> p = RetryPolicy(5, 2, 1.0, 30.0)
        >>> p.may_retry(INFRA, failures_of_kind=4), p.may_retry(INFRA, failures_of_kind=5), p.may_retry(DATA, 1)
        (True, False, True)
    """

    max_infra_attempts: int
    max_data_attempts: int
    backoff_base_s: float
    max_backoff_s: float

    @classmethod
    def single_attempt(cls) -> RetryPolicy:
        return cls(1, 1, 0.0, 0.0)

    @classmethod
    def of(cls, rollout_failure) -> RetryPolicy:
        """From a ``grpo.rollout_failure`` section (`grpo.config.RolloutFailureConfig`; None: `single_attempt`)."""
        if rollout_failure is None:
            return cls.single_attempt()
        return cls(rollout_failure.max_infra_attempts_per_prompt, rollout_failure.max_data_attempts_per_prompt,
                   rollout_failure.backoff_base_s, rollout_failure.max_backoff_s)

    def may_retry(self, kind: str, failures_of_kind: int) -> bool:
        """Whether a call that has failed ``failures_of_kind`` times with class ``kind`` gets another attempt."""
        return failures_of_kind < attempts_allowed(kind, self.max_infra_attempts, self.max_data_attempts)

    def backoff_s(self, infra_failures: int) -> float:
        """Seconds to wait before the retry that follows infra failure number ``infra_failures`` (`backoff_s`)."""
        return backoff_s(infra_failures, self.backoff_base_s, self.max_backoff_s)
