"""Reward functions: the signature every scorer follows, resolving one by name, checking what it returns.

A reward function (``env.name=function``, ``env.reward_fn="package.module:function"``)::

    def my_reward(question: str, completion: str, answer: str, meta: dict) -> float | dict[str, float]:
        ...

It is called positionally, once per sample, in a worker process (so it may raise or hang: that costs
only its own sample, which is scored again within ``grpo.rollout_failure``'s budgets, then masked, never
scored 0; `grpo.tasks.reward`). Raise for what is wrong outside the completion (a judge server that does
not answer: ``ConnectionError`` / ``TimeoutError`` or an HTTP error with a ``status``, retried with backoff);
return a low reward for what the completion got wrong. ``question`` is the dataset question (before the
prompt template), ``completion`` the decoded generated text, ``answer`` the reference answer as a
string, ``meta`` the row's extra data (the other columns of a file row, or a reasoning-gym entry).

Return a finite number, or a dict of named finite numbers: reward components for GDPO. With a dict,
the scalar reward is the sum of the components, unless the dict has a ``"reward"`` key, which is then
the scalar reward and not a component. The module is imported in every worker; keep its import cheap
and free of side effects. Workers are daemon processes: a reward function may run subprocesses
(``subprocess``) but not start `multiprocessing` children of its own.
"""

from __future__ import annotations

import importlib
import os
import traceback
from collections.abc import Callable
from typing import Any

from grpo.tasks.failures import reward_problem

RewardFn = Callable[[str, str, str, dict], Any]


class EnvError(RuntimeError):
    """A reward environment that cannot run (bad reward_fn name, scorer that fails to import)."""


def traceback_summary(err: BaseException, limit: int = 6) -> str:
    """The frames of ``err``'s traceback outside Python's import machinery and this file (the user's code),
    the last ``limit`` of them, then the exception itself."""
    machinery = (os.path.dirname(importlib.__file__) + os.sep, "<frozen ")
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not f.filename.startswith(machinery) and f.filename != __file__][-limit:]
    lines = [f'  File "{f.filename}", line {f.lineno}, in {f.name}' + (f"\n    {f.line}" if f.line else "")
             for f in frames]
    return "\n".join(lines + traceback.format_exception_only(type(err), err)).rstrip()


def resolve_function(spec: str, key: str = "env.reward_fn") -> Callable:
    """``"package.module:function"`` -> the function (imports the module); errors name the config ``key``."""
    module_name, sep, attr = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or not module_name or not attr:
        raise EnvError(f"{key}={spec!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - whatever the module's own code raises
        if isinstance(err, ModuleNotFoundError) and err.name and (module_name + ".").startswith(err.name + "."):
            raise EnvError(f"{key}={spec!r}: cannot import {module_name!r} ({err})") from err
        raise EnvError(f"{key}={spec!r}: importing {module_name!r} raised {type(err).__name__}: {err}\n"
                       f"{traceback_summary(err)}") from err
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise EnvError(f"{key}={spec!r}: module {module_name!r} has no {attr!r}")
    if not callable(fn):
        raise EnvError(f"{key}={spec!r}: {attr!r} is {type(fn).__name__}, not a function")
    return fn


def resolve_reward_fn(spec: str) -> RewardFn:
    """``"package.module:function"`` -> the reward function (imports the module: in the trainer, use
    `grpo.tasks.pool.check_reward_fn`, which imports it in a worker process with a timeout)."""
    return resolve_function(spec, "env.reward_fn")


def _finite(value: Any, what: str) -> float:
    """``value`` as a float when it is a reward (`grpo.tasks.failures.reward_problem`: finite in float32), else
    ValueError saying why (the sample fails, as any reward function error)."""
    problem = reward_problem(value, what)
    if problem is not None:
        raise ValueError(problem)
    return float(value)


def to_reward(value: Any) -> tuple[float, dict[str, float] | None]:
    """A reward function's return value -> (scalar reward, components or None).

    >>> to_reward(1)
    (1.0, None)
    >>> to_reward({"format": 0.5, "correct": 1.0})
    (1.5, {'format': 0.5, 'correct': 1.0})
    >>> to_reward({"reward": 2.0, "format": 0.5})
    (2.0, {'format': 0.5})
    """
    if isinstance(value, dict):
        components = {str(k): _finite(v, f"reward component {k!r}") for k, v in value.items() if k != "reward"}
        if "reward" in value:
            return _finite(value["reward"], "reward 'reward'"), components
        return sum(components.values()), components
    return _finite(value, "reward"), None


def score_sample(fn: RewardFn, sample: dict) -> tuple[float, dict[str, float] | None]:
    """Call ``fn`` on one sample ``{"question", "completion", "answer", "meta"}`` and check its return."""
    value = fn(sample["question"], sample["completion"], sample["answer"], sample.get("meta") or {})
    return to_reward(value)
