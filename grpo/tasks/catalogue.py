"""The built-in tasks by name: the one list that data loading (`grpo.system.data.load_rows`), config
validation (`grpo.config.EnvSpec.name`), the environment factory (`grpo.tasks.factory`) and the toy model
builder (`resolve_model_name`) read.

A built-in task is one module, ``grpo.tasks.<task>``, holding what the task is: its rows (a function
``rows(name, data_cfg, n, seed, split)`` that reads the task's own ``data.*`` fields), its environment (the
reward function of a single-turn task, or the `grpo.tasks.interface.Environment` class of a multi-turn one,
built with ``env.kwargs``) and its demo model (the toy starting policy of its CPU demo). Its `Task` entry here
names those pieces as ``"module:name"``, so reading the catalogue imports none of them: the config is
checked before torch (or math-verify, or reasoning-gym) loads, and a scorer's module is first imported in
the worker processes that run it. A new built-in task is a module and one entry in `TASKS`.

    >>> sorted(name for name, task in TASKS.items() if task.rows)
    ['arithmetic', 'calculator', 'guess_number', 'reasoning_gym', 'sliding_puzzle', 'visual']
    >>> ENV_NAMES
    ('math', 'math_multi_reward', 'reasoning_gym', 'arithmetic', 'guess_number', 'sliding_puzzle', 'visual', 'vlm', 'function', 'tools', 'class', 'agent', 'reward_model', 'judge', 'combined', 'nemo_gym')
    >>> dataset_task("reasoning_gym:basic_arithmetic") is TASKS["reasoning_gym"], dataset_task("gsm8k.jsonl")
    (True, None)
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, Callable

from grpo.tasks.toy import build_into, save_tiny_model


@dataclass(frozen=True)
class Task:
    """What a built-in task's module provides, each as ``"module:name"`` (None: the task has no such piece)."""

    rows: str | None = None  # rows(name, data_cfg, n, seed, split) -> list[Row], for data.dataset_name=<task>
    dataset_prefix: bool = False  # the rows are for data.dataset_name=<task>:<rest> (and env.name needs that)
    reward_fn: str | None = None  # env.name=<task>: a single-turn environment scored by this reward function
    reward_in_workers: bool = True  # False: a fast, pure reward scored in the trainer process
    environment: str | None = None  # env.name=<task>: a multi-turn environment class, built with env.kwargs
    toy_model: tuple[str, str] | None = None  # ("<name>", builder(out_dir)): policy.model_name="toy:<name>"


TASKS: dict[str, Task] = {
    "math": Task(reward_fn="grpo.tasks.math:math_reward"),
    # NeMo-RL's MathMultiRewardEnvironment: reward/{correctness,integer,format} components for GDPO.
    "math_multi_reward": Task(reward_fn="grpo.tasks.math_multi_reward:math_multi_reward"),
    "reasoning_gym": Task(rows="grpo.tasks.reasoning_gym:rows", dataset_prefix=True,
                          reward_fn="grpo.tasks.reasoning_gym:reasoning_gym_reward"),
    "arithmetic": Task(rows="grpo.tasks.arithmetic:rows", reward_fn="grpo.tasks.arithmetic:arithmetic_reward",
                       reward_in_workers=False, toy_model=("demo", "grpo.tasks.arithmetic:make_demo_model")),
    "guess_number": Task(rows="grpo.tasks.guess_number:rows", environment="grpo.tasks.guess_number:GuessNumberEnvironment",
                         toy_model=("guess_number", "grpo.tasks.guess_number:make_guess_number_model")),
    # NeMo-RL's sliding puzzle: data.dataset_name="sliding_puzzle:size=<n>,shuffle_moves=<k>", env.kwargs.max_moves.
    "sliding_puzzle": Task(rows="grpo.tasks.sliding_puzzle:rows", dataset_prefix=True,
                           environment="grpo.tasks.sliding_puzzle:SlidingPuzzleEnvironment"),
    # Run with env.name=tools (the calculator tool, the arithmetic reward): configs/cpu_demo_tools.yaml.
    "calculator": Task(rows="grpo.tasks.calculator:rows",
                       toy_model=("calc_demo", "grpo.tasks.calculator:make_calculator_demo_model")),
    # Pictures and one-word questions for a vision-language policy: data.dataset_name=visual:images (or visual:blank).
    "visual": Task(rows="grpo.tasks.visual:rows", dataset_prefix=True, reward_fn="grpo.tasks.visual:visual_reward",
                   reward_in_workers=False, toy_model=("visual_demo", "grpo.tasks.visual:make_visual_demo_model")),
    # NeMo-RL's VLM environment: env.kwargs.reward_functions (format, exact_alnum, math_expr, bbox_giou, geo3k).
    "vlm": Task(environment="grpo.tasks.vlm:vlm_environment"),
}

# env.name: the built-in tasks that have an environment, then the environments a config spells out:
# a reward function (env.reward_fn), tool calls (grpo.tasks.tools), a user class (env.env_class) and an agent
# program that drives the policy over HTTP (env.agent, grpo.wings.agents.environment), a reward model (env.reward_model,
# a wing: grpo.wings.reward_model), an LLM judge (env.judge, grpo.tasks.judge), several rewards of one sample (env.rewards, grpo.tasks.combined) and NeMo-Gym's agent servers
# (env.should_use_nemo_gym, grpo.tasks.nemo_gym).
ENV_NAMES = tuple(name for name, task in TASKS.items() if task.reward_fn or task.environment) + (
    "function", "tools", "class", "agent", "reward_model", "judge", "combined", "nemo_gym")


def load(spec: str) -> Any:
    """``"package.module:name"`` -> the object (the catalogue's own pieces: a bad spec is a bug here)."""
    module_name, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def dataset_task(name: str) -> Task | None:
    """The built-in task whose rows ``data.dataset_name=name`` means, or None (a file, a directory, a hub name)."""
    task = TASKS.get(name.split(":", 1)[0] if ":" in name else name)
    if task is None or task.rows is None or task.dataset_prefix != (":" in name):
        return None
    return task


def in_process_reward(spec: str) -> bool:
    """Whether the reward function ``spec`` is a built-in one that runs in the trainer process."""
    return any(task.reward_fn == spec and not task.reward_in_workers for task in TASKS.values())


# Toy models that no task names (TASKS' toy_model), as "package.module:builder".
EXTRA_TOY_MODELS = {"calc_agent": "grpo.tasks.calculator:make_calculator_agent_model",  # the agent demo
                    "demo_rm": "grpo.tasks.demo_reward_model:make_demo_reward_model",  # env.reward_model's demo
                    "tiny_vlm": "grpo.tasks.visual:save_tiny_vlm"}  # an untrained vision-language model

# "toy:<name>" in policy.model_name -> builder(out_dir): the tasks' demo models and two untrained sizes.
TOY_MODELS: dict[str, Callable[[str], str]] = {
    **{task.toy_model[0]: (lambda out, spec=task.toy_model[1]: load(spec)(out))
       for task in TASKS.values() if task.toy_model},
    **{key: (lambda out, spec=spec: load(spec)(out)) for key, spec in EXTRA_TOY_MODELS.items()},
    "tiny": lambda out: save_tiny_model(out, size="tiny"),
    "small": lambda out: save_tiny_model(out, size="small"),
}


def resolve_model_name(name: str, rank: int = 0) -> str:
    """``"toy:<name>"`` -> a local directory built on first use (rank 0 builds, the others wait).

    Anything else is returned unchanged (a local path or a hub name for `from_pretrained`).
    """
    if not name.startswith("toy:"):
        return name
    key = name[len("toy:"):]
    if key not in TOY_MODELS:
        raise ValueError(f"policy.model_name={name!r}: expected one of {['toy:' + k for k in TOY_MODELS]}")
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "assets")
    out = os.path.join(root, f"{key}_model")
    stamp = builder_stamp(key)
    if rank == 0 and not _built(out, stamp):
        print(f"building {name} into {out} (local, no download) ...", flush=True)
        build_into(out, lambda tmp: (TOY_MODELS[key](tmp), _write_stamp(tmp, stamp)))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return out


def builder_stamp(key: str) -> str:
    """A hash of the source of ``toy:<key>``'s builder (its task's module, and the shared toy code): a model built by an
    older builder (a checkout from before a change of the demo) is rebuilt instead of reused."""
    import hashlib
    import inspect

    from grpo.tasks import toy

    builder = TOY_MODELS[key]
    spec = next((t.toy_model[1] for t in TASKS.values() if t.toy_model and t.toy_model[0] == key),
                EXTRA_TOY_MODELS.get(key))
    source = inspect.getsource(inspect.getmodule(load(spec)) if spec else builder) + inspect.getsource(toy)
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def _built(out: str, stamp: str) -> bool:
    try:
        with open(os.path.join(out, "grpo_builder.txt")) as f:
            return f.read().strip() == stamp and os.path.exists(os.path.join(out, "config.json"))
    except OSError:
        return False


def _write_stamp(out: str, stamp: str) -> None:
    with open(os.path.join(out, "grpo_builder.txt"), "w") as f:
        f.write(stamp + "\n")
