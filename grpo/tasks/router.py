"""The router: the run's environments by task name, each step run in a thread with a timeout.

    envs = build_environments(cfg.env, cfg.data)          # grpo.tasks.factory
    ret, error = envs.step("arithmetic", message_logs, metadata)

A data row's ``task_name`` (``data.task_key``) picks its environment (`grpo.tasks.factory.task_specs`). A
failing, hanging or malformed environment costs only the samples of its call. What is wrong with the run's
environments together (scalar rewards from one, dicts from another) stops the run (`EnvError`).

After a rollout, each environment's ``global_post_process_and_metrics`` gets its samples as NeMo-RL's rollout
batch (`rollout_batch`).
"""

from __future__ import annotations

import logging
import threading
import traceback

from grpo.tasks.function import EnvError
from grpo.tasks.interface import Environment, EnvironmentReturn, check_return

logger = logging.getLogger(__name__)

OBSERVATION_FORMATS = ("raw", "chat_template")
REWARD_KINDS = ("scalar", "dict")


class Environments:
    """The run's environments by task name, each `step` call bounded by ``step_timeout_s`` seconds.

    An environment whose `step` raises, runs past its timeout or returns a malformed `EnvironmentReturn`
    costs only the samples of that call: `step` returns ``(None, "env_error" | "env_timeout")`` and the
    rollout ends them with reward 0. The first failure of each kind per task is logged with its traceback;
    ``num_failures`` counts them all. Each call runs in a daemon thread: a step that never returns is left
    behind (it cannot be killed) and never blocks the trainer's exit.
    """

    def __init__(self, envs: dict[str, Environment], step_timeout_s: float,
                 observation_formats: dict[str, str] | None = None, reward_kinds: dict[str, str | None] | None = None):
        """``observation_formats``: task -> "raw" | "chat_template" (`observation_format`; missing tasks:
        chat_template); ``reward_kinds``: task -> "scalar" | "dict" where known before the first step (an
        environment's own ``reward_kind`` attribute comes first). Known kinds that differ raise EnvError."""
        self.envs = envs
        self.step_timeout_s = step_timeout_s
        self.num_failures = 0
        self.last_error: str | None = None
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self.observation_formats = dict(observation_formats or {})
        for task, fmt in self.observation_formats.items():
            if fmt not in OBSERVATION_FORMATS:
                raise EnvError(f"environment {task!r}: observation format {fmt!r}, expected one of {OBSERVATION_FORMATS}")
        self._reward_kinds: dict[str, tuple[str, str]] = {}  # task -> (kind, "declared" | "returned")
        for task, env in envs.items():
            kind = getattr(env, "reward_kind", None) or (reward_kinds or {}).get(task)
            if kind is not None:
                if kind not in REWARD_KINDS:
                    raise EnvError(f"environment {task!r} ({type(env).__name__}): reward_kind={kind!r}, expected "
                                   f"one of {REWARD_KINDS}")
                self._note_reward_kind(task, kind, "declared")

    @property
    def tasks(self) -> list[str]:
        return sorted(self.envs)

    def observation_format(self, task: str) -> str:
        """How ``task``'s observations become tokens: "raw" (NeMo-RL's: the content as tokens) or
        "chat_template" (rendered by the chat template); see `grpo.system.chat`."""
        return self.observation_formats.get(task, "chat_template")

    def _note_reward_kind(self, task: str, kind: str, how: str) -> None:
        """Record that ``task`` gives ``kind`` rewards; EnvError when another environment (or this one before)
        gives the other kind: NeMo-RL's calculate_rewards asserts on the mix (grpo-ds would zero-fill)."""
        with self._lock:
            for other, (known, known_how) in self._reward_kinds.items():
                if known == kind:
                    continue
                said = {"declared": "gives", "returned": "returned"}
                if other == task:
                    where = f"environment {task!r} ({type(self.envs[task]).__name__}) {said[known_how]} {known} rewards"
                    raise EnvError(f"{where}, then {kind} ones: an environment's rewards must be all [B] tensors or "
                                   "all dicts of named [B] tensors")
                raise EnvError(
                    f"environment {other!r} ({type(self.envs[other]).__name__}) {said[known_how]} {known} rewards and "
                    f"environment {task!r} ({type(self.envs[task]).__name__}) {said[how]} {kind} rewards: the "
                    "environments of one run must all return rewards as [B] tensors or all as dicts of named [B] "
                    "tensors (NeMo-RL asserts the same); make them return the same kind")
            self._reward_kinds[task] = (kind, how)

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
        else:
            thread = threading.Thread(target=call, name=f"env-{task}", daemon=True)
            thread.start()
            thread.join(self.step_timeout_s)
            if thread.is_alive():
                return None, self._failed(task, "env_timeout",
                                          f"no return within env.step_timeout_s={self.step_timeout_s}")
        if "error" in result:
            return None, self._failed(task, "env_error", result["error"])
        ret = result["ret"]
        self._note_reward_kind(task, "dict" if isinstance(ret.rewards, dict) else "scalar", "returned")
        return ret, None

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
        """Each environment's ``global_post_process_and_metrics`` on its own samples as NeMo-RL's rollout batch
        (`rollout_batch`, order kept); metrics come back as ``env/<task>/<name>`` (numbers and one-element
        tensors; others are dropped). The returned batch's ``"trajectories"`` replace the samples' trajectories
        (an environment that returns a list instead, as grpo-ds's hook did, returns the trajectories)."""
        out, metrics = list(trajectories), {}
        for task, env in self.envs.items():
            idx = [i for i, t in enumerate(trajectories) if t.task_name == task]
            hook = getattr(env, "global_post_process_and_metrics", None)
            if not idx or hook is None:
                continue
            mine = [trajectories[i] for i in idx]
            processed, env_metrics = hook(rollout_batch(mine))
            if isinstance(processed, dict):
                processed = processed.get("trajectories", mine)
            processed = list(processed)
            if len(processed) != len(idx):
                raise EnvError(f"environment {task!r} ({type(env).__name__}): global_post_process_and_metrics "
                               f"returned {len(processed)} trajectories for {len(idx)} samples")
            for i, t in zip(idx, processed):
                out[i] = t
            for k, v in (env_metrics or {}).items():
                if hasattr(v, "numel") and v.numel() == 1:
                    v = v.item()
                if isinstance(v, (int, float)):
                    metrics[f"env/{task}/{k}"] = float(v)
        return out, metrics

    def close(self) -> None:
        for env in self.envs.values():
            shutdown = getattr(env, "shutdown", None)
            if shutdown is not None:
                shutdown()


def rollout_batch(trajectories: list) -> dict:
    """Samples as NeMo-RL's rollout batch, what ``global_post_process_and_metrics(batch)`` receives: a dict
    (NeMo-RL's ``BatchedDataDict`` is one) with one entry per sample under each key.

    NeMo-RL's data batch (``rl_collate_fn``) and what ``run_multi_turn_rollout`` adds:

    - ``message_log``: the conversation, ``{"role", "content", "token_ids": LongTensor}`` per message, and
      ``"generation_logprobs"`` (FloatTensor) on the generated assistant messages;
    - ``extra_env_info``: the sample's metadata as the environment left it; ``task_name``; ``idx``: the data
      row's index (a list); ``stop_strings``: the row's first-turn stop strings (or None);
    - ``length``: prompt tokens [B]; ``batch_max_length`` [B]; ``loss_multiplier`` [B]: 0.0 for samples the
      environment masked (``mask_sample``), else 1.0;
    - ``total_reward`` [B] (float32) and ``truncated`` [B] (bool); each named reward component (dict rewards)
      under its own name, [B] (0.0 where a sample has not got it).

    Keys NeMo-RL's own environments read in their hooks (``math_environment.py``, ``vlm_environment.py``):
    ``rewards`` (= ``total_reward``), ``is_end`` [B] (bool: not truncated), ``prompt_lengths`` (= ``length``),
    ``generation_lengths`` [B] (all tokens of the sample, prompt included, so ``generation_lengths -
    prompt_lengths`` counts the response), ``text`` [B, P] (the prompt ids, right-padded with -1: what
    ``calculate_pass_rate_per_prompt`` groups by).

    grpo-ds's own: ``trajectories``: the `grpo.system.rollout.Trajectory` objects themselves.

        >>> from grpo.system.rollout import Message, Trajectory
        >>> t = Trajectory(0, 3, "echo", "q", "a", [Message("user", "q", [5, 6]), Message("assistant", "x", [7], [-0.5])],
        ...                {"answer": "a"}, reward=1.0, num_prompt_messages=1)
        >>> b = rollout_batch([t])
        >>> b["total_reward"], b["idx"], b["message_log"][0][1]["token_ids"], b["generation_lengths"]
        (tensor([1.]), [3], tensor([7]), tensor([3]))
    """
    import torch

    n_prompt = [sum(len(m.token_ids) for m in t.messages[:t.num_prompt_messages]) for t in trajectories]
    width = max(n_prompt, default=0)
    text = torch.full((len(trajectories), width), -1, dtype=torch.long)
    for b, t in enumerate(trajectories):
        prompt = [x for m in t.messages[:t.num_prompt_messages] for x in m.token_ids]
        text[b, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)

    def message(m) -> dict:
        d = {"role": m.role, "content": m.content, "token_ids": torch.tensor(m.token_ids, dtype=torch.long)}
        if m.generation_logprobs is not None:
            d["generation_logprobs"] = torch.tensor(m.generation_logprobs, dtype=torch.float32)
        return d

    length = torch.tensor(n_prompt, dtype=torch.long)
    total = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    truncated = torch.tensor([t.truncated for t in trajectories], dtype=torch.bool)
    batch = {
        "message_log": [[message(m) for m in t.messages] for t in trajectories],
        "extra_env_info": [t.metadata for t in trajectories],
        "task_name": [t.task_name for t in trajectories],
        "idx": [t.prompt_index for t in trajectories],
        "stop_strings": [getattr(t, "stop_strings", None) for t in trajectories],
        "length": length,
        "batch_max_length": torch.full_like(length, width),
        "loss_multiplier": torch.tensor([0.0 if t.mask_sample else 1.0 for t in trajectories]),
        "total_reward": total,
        "truncated": truncated,
        "rewards": total.clone(),
        "is_end": ~truncated,
        "prompt_lengths": length.clone(),
        "generation_lengths": torch.tensor([len(t.token_ids()) for t in trajectories], dtype=torch.long),
        "text": text,
        "trajectories": list(trajectories),
    }
    names = sorted({k for t in trajectories for k in (t.reward_components or {})} - set(batch))
    for name in names:
        batch[name] = torch.tensor([(t.reward_components or {}).get(name, 0.0) for t in trajectories],
                                   dtype=torch.float32)
    return batch
