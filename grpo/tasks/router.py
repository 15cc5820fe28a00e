"""The router: the run's environments by task name, each step run in a thread with a timeout.

    envs = build_environments(cfg.env, cfg.data)          # grpo.tasks.factory
    ret, error = envs.step("arithmetic", message_logs, metadata)

A data row's ``task_name`` (``data.task_key``) picks its environment (`grpo.tasks.factory.task_specs`). A
failing, hanging or malformed environment costs only the samples of its call.
"""

from __future__ import annotations

import logging
import threading
import traceback

from grpo.tasks.interface import Environment, EnvironmentReturn, check_return

logger = logging.getLogger(__name__)


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
