"""Environments: what the policy talks to, and what scores it (the interface: `grpo.envs.interface`).

    envs = build_environments(cfg.env, cfg.data)          # task name -> environment, with a step timeout
    ret, error = envs.step("arithmetic", message_logs, metadata)

Built in, by ``env.name``:

- single-turn tasks scored by a reward function ``fn(question, completion, answer, meta) -> float | dict``
  (`grpo.envs.function` has the contract): ``arithmetic`` (a regex, in the trainer process), ``math``
  (math-verify), ``reasoning_gym`` and ``function`` (``env.reward_fn``), run in a `grpo.envs.pool.ScoringPool`
  of spawned workers with a per-sample timeout. `RewardEnvironment` makes them one-turn environments: the
  completion is the last assistant message, every sample terminates after its first turn. A sample whose
  scorer raises or times out scores 0.0 and is counted; the first failure of each kind is logged with its
  traceback, later ones are only counted, and the run goes on;
- ``guess_number``: a multi-turn task (`grpo.envs.guess_number`);
- ``tools``: tool calls (`grpo.envs.tools.ToolEnvironment`), the final answer scored by ``env.reward_fn``;
- ``class``: a user environment, ``env.env_class: package.module:ClassName`` built with ``env.kwargs``.

Several environments in one run: ``env.tasks: {task_name: {name: ..., ...}}``; each data row's
``task_name`` (``data.task_key``) picks one, rows without it use the top-level environment, whose task name
is ``env.task_name`` (default: ``env.name``). ``env.val_tasks`` gives validation its own environments.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from grpo.envs.function import EnvError, resolve_reward_fn, score_sample
from grpo.envs.interface import Environment, EnvironmentReturn, check_return
from grpo.envs.pool import Outcome, ScoringPool, check_reward_fn

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


def _import_object(spec: str, key: str):
    """``"package.module:Name"`` -> the object, or EnvError naming ``key``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise EnvError(f"{key}={spec!r}: expected 'package.module:Name'")
    try:
        obj = importlib.import_module(module_name)
    except Exception as err:
        raise EnvError(f"{key}={spec!r}: cannot import {module_name!r} ({type(err).__name__}: {err})") from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise EnvError(f"{key}={spec!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


def build_environment(spec, data_cfg=None, key: str = "env") -> Environment:
    """The environment of one `grpo.config.EnvSpec` (``key``: its dotted name, for errors)."""
    if spec.name == "class":
        cls = _import_object(spec.env_class, f"{key}.env_class")
        try:
            env = cls(**spec.kwargs)
        except Exception as err:
            raise EnvError(f"{key}.env_class={spec.env_class!r} with {key}.kwargs={spec.kwargs!r}: "
                           f"{type(err).__name__}: {err}") from err
        if not callable(getattr(env, "step", None)):
            raise EnvError(f"{key}.env_class={spec.env_class!r}: {type(env).__name__} has no step(message_logs, "
                           "metadata) method (see grpo.envs.interface.Environment)")
        return env
    if spec.name == "tools":
        from grpo.envs.tools import ToolEnvironment

        return ToolEnvironment(spec.tools, spec.reward_fn, spec.tool_call_format, spec.tool_timeout_s,
                               spec.max_tool_result_chars, spec.max_tool_calls_per_turn, spec.num_workers,
                               spec.timeout_s, spec.disable_tools)
    if spec.name == "guess_number":
        from grpo.envs.guess_number import GuessNumberEnvironment

        return GuessNumberEnvironment(**spec.kwargs)
    if spec.name == "function":  # imported in a worker with a timeout: a module that fails or hangs fails here
        check_reward_fn(spec.reward_fn, spec.timeout_s)
        fn_spec, in_workers = spec.reward_fn, True
    else:
        fn_spec, in_workers = SCORERS[spec.name]
    if spec.name == "reasoning_gym" and data_cfg is not None and not data_cfg.dataset_name.startswith(
        "reasoning_gym:"
    ):
        raise EnvError(
            f"env.name='reasoning_gym' needs data.dataset_name='reasoning_gym:<task>' (got {data_cfg.dataset_name!r})"
        )
    return RewardEnvironment(fn_spec, in_process=not in_workers, num_workers=spec.num_workers,
                             timeout_s=spec.timeout_s)


class Environments:
    """The run's environments by task name, each `step` call bounded by ``step_timeout_s`` seconds.

    An environment whose `step` raises, runs past its timeout or returns a malformed `EnvironmentReturn`
    costs only the samples of that call: `step` returns ``(None, "env_error" | "env_timeout")`` and the
    rollout ends them with reward 0. The first failure of each kind per task is logged with its traceback;
    ``num_failures`` counts them all. Each call runs in a daemon thread: a step that never returns is left
    behind (it cannot be killed) and never blocks the trainer's exit.
    """

    def __init__(self, envs: dict[str, Environment], step_timeout_s: float):
        self.envs = envs
        self.step_timeout_s = step_timeout_s
        self.num_failures = 0
        self.last_error: str | None = None
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    @property
    def tasks(self) -> list[str]:
        return sorted(self.envs)

    def first_stop_strings(self, task: str) -> list[str] | None:
        """The stop strings of a sample's first turn: its environment's ``stop_strings`` attribute when it has
        one (a tool environment stops a turn at the end of a call), else None (the config's)."""
        return getattr(self.envs[task], "stop_strings", None)

    def tool_schemas(self) -> list[dict] | None:
        """The JSON schemas of the tools of the run's environments (for the chat template), or None."""
        schemas = [s for env in self.envs.values() for s in (getattr(env, "schemas", None) or [])]
        return schemas or None

    def step(self, task: str, message_logs: list, metadata: list) -> tuple[EnvironmentReturn | None, str | None]:
        """One checked `Environment.step` of ``task``'s environment: ``(return, None)``, or ``(None, error)``
        with the error's kind and traceback in `last_error`. An environment that bounds its own time
        (``bounds_own_time = True``: the reward and tool environments, whose worker processes have per-call
        timeouts, and which must start those workers from a thread that lives on) is called in this thread."""
        result: dict = {}
        env = self.envs[task]

        def call() -> None:
            try:
                result["ret"] = check_return(env.step(message_logs, metadata), len(message_logs))
            except BaseException:
                result["error"] = traceback.format_exc()

        if getattr(env, "bounds_own_time", False):
            call()
            if "error" in result:
                return None, self._failed(task, "env_error", result["error"])
            return result["ret"], None
        thread = threading.Thread(target=call, name=f"env-{task}", daemon=True)
        thread.start()
        thread.join(self.step_timeout_s)
        if thread.is_alive():
            return None, self._failed(task, "env_timeout", f"no return within env.step_timeout_s={self.step_timeout_s}")
        if "error" in result:
            return None, self._failed(task, "env_error", result["error"])
        return result["ret"], None

    def _failed(self, task: str, kind: str, detail: str) -> str:
        with self._lock:
            self.num_failures += 1
            self.last_error = f"environment {task!r}: {detail}"[-4000:]
            if (task, kind) in self._logged:
                return kind
            self._logged.add((task, kind))
        logger.warning("environment %r (task %r): step %s; its samples end with reward 0 and the run goes on "
                       "(later failures are only counted in train/env_errors):\n%s",
                       type(self.envs[task]).__name__, task, "timed out" if kind == "env_timeout" else "failed",
                       detail)
        return kind

    def post_process(self, trajectories: list) -> tuple[list, dict[str, float]]:
        """Each environment's ``global_post_process_and_metrics`` on its own trajectories (order kept);
        metrics come back as ``env/<task>/<name>``."""
        out, metrics = list(trajectories), {}
        for task, env in self.envs.items():
            idx = [i for i, t in enumerate(trajectories) if t.task_name == task]
            hook = getattr(env, "global_post_process_and_metrics", None)
            if not idx or hook is None:
                continue
            processed, env_metrics = hook([trajectories[i] for i in idx])
            for i, t in zip(idx, processed):
                out[i] = t
            metrics.update({f"env/{task}/{k}": float(v) for k, v in (env_metrics or {}).items()
                            if isinstance(v, (int, float))})
        return out, metrics

    def close(self) -> None:
        for env in self.envs.values():
            shutdown = getattr(env, "shutdown", None)
            if shutdown is not None:
                shutdown()


def task_specs(env_cfg, split: str = "train") -> dict[str, Any]:
    """Task name -> `EnvSpec`: the top-level environment (as ``env.task_name`` or ``env.name``) and
    ``env.tasks``; for ``split="val"``, ``env.val_tasks`` replaces the tasks it names."""
    specs = {env_cfg.task_name or env_cfg.name: env_cfg, **env_cfg.tasks}
    if split == "val":
        specs.update(env_cfg.val_tasks or {})
    return specs


def build_environments(env_cfg, data_cfg=None, split: str = "train") -> Environments:
    """Every environment of the run (see `task_specs`), wrapped in `Environments`."""
    envs = {}
    for task, spec in task_specs(env_cfg, split).items():
        section = "val_tasks" if spec is (env_cfg.val_tasks or {}).get(task) else "tasks"
        envs[task] = build_environment(spec, data_cfg, "env" if spec is env_cfg else f"env.{section}.{task}")
    return Environments(envs, env_cfg.step_timeout_s)


__all__ = ["EnvError", "Environment", "EnvironmentReturn", "Environments", "RewardEnvironment", "ScoreResult",
           "build_environment", "build_environments", "collect", "task_specs"]
