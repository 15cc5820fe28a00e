"""Environments from the config: `build_environment` for one ``env`` section, `build_environments` for a run.

By ``env.name``:

- a built-in task of `grpo.tasks.catalogue`: its reward function as a `grpo.tasks.reward.RewardEnvironment`
  (``arithmetic`` in the trainer process; ``math``, ``reasoning_gym`` in worker processes), or its multi-turn
  environment class built with ``env.kwargs`` (``guess_number``);
- ``function``: ``env.reward_fn`` as a `RewardEnvironment` in worker processes;
- ``tools``: tool calls (`grpo.tasks.tools.ToolEnvironment`), the final answer scored by ``env.reward_fn``;
- ``class``: a user environment, ``env.env_class: package.module:ClassName`` built with ``env.kwargs``;
- a name a wing registered (`register_environment`): ``agent``, a user's agent (``env.agent``) playing each sample
  over the run's endpoint (`grpo.wings.agents`); ``reward_model``, a sequence classifier scoring the
  conversation (``env.reward_model``; `grpo.wings.reward_model`), its engine the run's deferred scorer;
  ``nemo_gym``, NeMo-Gym's agent servers (``env.should_use_nemo_gym``, ``env.nemo_gym``; `grpo.wings.gym`);
- ``judge``: an LLM judge behind an OpenAI-compatible URL (``env.judge``, `grpo.tasks.judge`);
- ``combined``: the rewards of several one-turn environments (``env.rewards``) as a weighted sum or as GDPO's
  components (``env.combine``; `grpo.tasks.combined`).

Several environments in one run: ``env.tasks: {task_name: {name: ..., ...}}``; each data row's
``task_name`` (``data.task_key``) picks one, rows without it use the top-level environment, whose task name
is ``env.task_name`` (default: ``env.name``). ``env.val_tasks`` gives validation its own environments.

Each environment's ``observation_format`` (`observation_format`): ``auto`` is NeMo-RL's raw content for
``class`` environments and the chat template for the built-ins.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import Any

from grpo.tasks.catalogue import TASKS, load
from grpo.tasks.failures import RetryPolicy
from grpo.tasks.function import EnvError
from grpo.tasks.interface import Environment
from grpo.tasks.pool import MIN_IMPORT_TIMEOUT_S, check_reward_fn
from grpo.tasks.reward import RewardEnvironment
from grpo.tasks.router import Environments


# env.name -> build(env_spec, key, deferred) -> Environment: the environments the wings provide (register_environment).
_WING_ENVIRONMENTS: dict[str, Callable[..., Environment]] = {}


def register_environment(name: str, build: Callable[..., Environment]) -> None:
    """Make ``build(env_spec, key, deferred)`` the environment of ``env.name: <name>`` (a wing calls it when imported;
    the name must be one the config accepts, `grpo.tasks.catalogue.ENV_NAMES`). ``key``: the section's dotted name,
    for errors; ``deferred``: the run's `grpo.system.deferred.DeferredScorers` (None outside a run)."""
    _WING_ENVIRONMENTS[name] = build


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


def build_environment(env_spec, data_cfg=None, key: str = "env", deferred=None) -> Environment:
    """The environment of one `grpo.config.EnvSpec` (``key``: its dotted name, for errors); built-in tasks
    are looked up in `grpo.tasks.catalogue`, a wing's environments in what it registered (`register_environment`).
    ``deferred``: the run's deferred scorers (`grpo.system.deferred.DeferredScorers`), for the environments whose
    scores wait for the rollout's scoring point."""
    if env_spec.name == "combined":
        from grpo.tasks.combined import CombinedEnvironment

        parts: dict[str, Environment] = {}
        try:
            for name, spec in env_spec.rewards.items():
                parts[name] = build_environment(spec, data_cfg, f"{key}.rewards.{name}", deferred)
        except BaseException:
            for env in parts.values():
                env.shutdown()
            raise
        return CombinedEnvironment(parts, env_spec.combine, env_spec.weights)
    if env_spec.name == "judge":
        from grpo.tasks.judge import JudgeEnvironment

        return JudgeEnvironment(env_spec.judge)
    if env_spec.name in _WING_ENVIRONMENTS:
        return _WING_ENVIRONMENTS[env_spec.name](env_spec, key, deferred)
    if env_spec.name == "class":
        cls = _import_object(env_spec.env_class, f"{key}.env_class")
        try:
            env = cls(**env_spec.kwargs)
        except Exception as err:
            raise EnvError(f"{key}.env_class={env_spec.env_class!r} with {key}.kwargs={env_spec.kwargs!r}: "
                           f"{type(err).__name__}: {err}") from err
        if not callable(getattr(env, "step", None)):
            raise EnvError(f"{key}.env_class={env_spec.env_class!r}: {type(env).__name__} has no step(message_logs, "
                           "metadata) method (see grpo.tasks.interface.Environment)")
        return env
    if env_spec.name == "tools":
        from grpo.tasks.tools import ToolEnvironment

        return ToolEnvironment(env_spec.tools, env_spec.reward_fn, env_spec.tool_call_format, env_spec.tool_timeout_s,
                               env_spec.max_tool_result_chars, env_spec.max_tool_calls_per_turn, env_spec.num_workers,
                               env_spec.timeout_s, env_spec.disable_tools)
    if env_spec.name == "function":  # imported in a worker with a timeout: a module that fails or hangs fails here
        check_reward_fn(env_spec.reward_fn, max(env_spec.timeout_s, MIN_IMPORT_TIMEOUT_S))
        return RewardEnvironment(env_spec.reward_fn, in_process=False, num_workers=env_spec.num_workers,
                                 timeout_s=env_spec.timeout_s)
    if env_spec.name not in TASKS:  # a wing's name (the config knows every name) whose wing is not loaded
        raise EnvError(f"{key}.name={env_spec.name!r}: no environment is registered under this name (a wing registers "
                       "its environments when imported: grpo.wings.load())")
    task = TASKS[env_spec.name]
    if task.dataset_prefix and data_cfg is not None and not data_cfg.dataset_name.startswith(f"{env_spec.name}:"):
        raise EnvError(
            f"env.name={env_spec.name!r} needs data.dataset_name='{env_spec.name}:<task>' (got {data_cfg.dataset_name!r})"
        )
    if task.environment is not None:
        return load(task.environment)(**env_spec.kwargs)
    fn_spec, in_workers = task.reward_fn, task.reward_in_workers
    if env_spec.name == "math" and env_spec.math_verify_impl == "dapo_math_verify":  # NeMo-RL's math_verify_impl
        fn_spec = "grpo.tasks.math:dapo_math_reward"
    return RewardEnvironment(fn_spec, in_process=not in_workers, num_workers=env_spec.num_workers,
                             timeout_s=env_spec.timeout_s)


def observation_format(env_spec) -> str:
    """"raw" or "chat_template": ``env_spec.observation_format``, where ``auto`` is raw for ``env.name: class``
    (environments written to NeMo-RL's interface, whose rollout tokenises an observation's content alone) and
    chat_template for the built-ins (tools, guess_number, the reward functions).

        >>> from grpo.config import EnvSpec
        >>> observation_format(EnvSpec(name="class", env_class="m:C")), observation_format(EnvSpec(name="tools",
        ...     tools=["m:f"], reward_fn="m:g")), observation_format(EnvSpec(name="class", env_class="m:C",
        ...     observation_format="chat_template"))
        ('raw', 'chat_template', 'chat_template')
    """
    fmt = getattr(env_spec, "observation_format", "auto")
    if fmt != "auto":
        return fmt
    return "raw" if env_spec.name == "class" else "chat_template"


def task_specs(env_cfg, split: str = "train") -> dict[str, Any]:
    """Task name -> `EnvSpec`: the top-level environment (as ``env.task_name`` or ``env.name``) and
    ``env.tasks``; for ``split="val"``, ``env.val_tasks`` replaces the tasks it names."""
    specs = {env_cfg.task_name or env_cfg.name: env_cfg, **env_cfg.tasks}
    if split == "val":
        specs.update(env_cfg.val_tasks or {})
    return specs


def build_environments(env_cfg, data_cfg=None, split: str = "train", rollout_failure=None,
                       deferred=None) -> Environments:
    """Every environment of the run (see `task_specs`), wrapped in `Environments` with its observation format
    and the retry budgets of ``rollout_failure`` (``grpo.rollout_failure``; None: one attempt per call); the
    reward environments are known to give scalar rewards (`Environments` rejects a mix of kinds)."""
    envs, formats, kinds = {}, {}, {}
    specs = task_specs(env_cfg, split)
    try:
        for task, spec in specs.items():
            section = "val_tasks" if spec is (env_cfg.val_tasks or {}).get(task) else "tasks"
            envs[task] = build_environment(spec, data_cfg, "env" if spec is env_cfg else f"env.{section}.{task}",
                                           deferred)
            formats[task] = observation_format(spec)
            kinds[task] = "scalar" if isinstance(envs[task], RewardEnvironment) else None
        return Environments(envs, env_cfg.step_timeout_s, formats, kinds, retry=RetryPolicy.of(rollout_failure))
    except BaseException:
        for env in envs.values():  # workers the environments built so far have started
            shutdown = getattr(env, "shutdown", None)
            if shutdown is not None:
                with contextlib.suppress(Exception):
                    shutdown()
        raise
