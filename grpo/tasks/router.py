"""The router: the run's environments by task name, each step run in a thread with a timeout, failed calls retried.

    envs = build_environments(cfg.env, cfg.data, cfg.grpo.rollout_failure)   # grpo.tasks.factory
    ret, retries = envs.step("arithmetic", message_logs, metadata)
    ret.failures[b]     # None, or the Failure of sample b after its retries (grpo.tasks.failures)

A data row's ``task_name`` (``data.task_key``) picks its environment (`grpo.tasks.factory.task_specs`). A
failing, hanging or malformed environment costs only the samples of its call, and those are retried
(`Environments.step`) before they fail for good; a sample that still fails is masked by the trainer, never
scored. What is wrong with the run's environments together (scalar rewards from one, dicts from another)
stops the run (`EnvError`).

After a rollout, each environment's ``global_post_process_and_metrics`` gets its samples as NeMo-RL's rollout
batch (`rollout_batch`).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

from grpo.tasks.failures import RetryPolicy, failure_of_exception
from grpo.trajectory import filled_components, filled_rewards
from grpo.tasks.function import EnvError
from grpo.tasks.interface import Environment, EnvironmentReturn, check_return
from grpo.trajectory import INFRA, Failure

logger = logging.getLogger(__name__)

OBSERVATION_FORMATS = ("raw", "chat_template")
REWARD_KINDS = ("scalar", "dict")


class StepResult(NamedTuple):
    """What `Environments.step` returns. ``ret``: one row per sample of the call; ``ret.failures[b]`` is the
    `Failure` of sample b when it still failed after its retries (its other fields are then placeholders: never
    read them), else None. ``retries[b]``: how many times sample b was called again, whether or not the retry
    succeeded."""

    ret: EnvironmentReturn
    retries: list[int]


class Environments:
    """The run's environments by task name, each `step` call bounded by ``step_timeout_s`` seconds.

    An environment whose `step` raises (``env_error``, or the ``http_*`` reason of an HTTP error), runs past
    its timeout (``env_timeout``) or returns what `check_return` refuses (``env_malformed``) fails for the
    samples of that call; an environment may also report single samples failed (``EnvironmentReturn.failures``).
    `step` retries failed samples within ``retry``'s budgets (`grpo.tasks.failures.RetryPolicy`: NeMo-RL's
    ``max_infra_attempts_per_prompt`` / ``max_data_attempts_per_prompt``, independent counters per sample),
    after an exponential backoff when one of them failed for an infra reason, at once otherwise. The first
    failure of each reason and class per task is logged with its traceback; ``num_failures`` counts failed sample
    attempts, ``num_retries`` sample retries, ``last_error`` describes the newest failure. Each call runs in a
    daemon thread: a step that never returns is left behind (it cannot be killed) and never blocks the
    trainer's exit.
    """

    def __init__(self, envs: dict[str, Environment], step_timeout_s: float,
                 observation_formats: dict[str, str] | None = None, reward_kinds: dict[str, str | None] | None = None,
                 retry: RetryPolicy | None = None, sleep: Callable[[float], None] = time.sleep):
        """``observation_formats``: task -> "raw" | "chat_template" (`observation_format`; missing tasks:
        chat_template); ``reward_kinds``: task -> "scalar" | "dict" where known before the first step (an
        environment's own ``reward_kind`` attribute comes first). Known kinds that differ raise EnvError.
        ``retry``: the budgets (``grpo.rollout_failure``; None: one attempt, no retry, NeMo-RL's
        ``single_attempt`` for callers that build their own); ``sleep``: waits out a backoff (tests record it)."""
        self.envs = envs
        self.step_timeout_s = step_timeout_s
        self.retry = retry or RetryPolicy.single_attempt()
        self._sleep = sleep
        self.num_failures = 0
        self.num_retries = 0
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

    def step(self, task: str, message_logs: list, metadata: list) -> StepResult:
        """One `Environment.step` of ``task``'s environment for these samples, failed samples retried.

        Each attempt is checked (`check_return`); a call that fails fails all its samples, a return may fail
        some (``failures``). A failed sample is called again, alone with the others that failed, with the same
        conversation and metadata (a fresh copy per attempt: what a failed attempt changed in place is not
        seen), while its class's budget lasts; the results of all attempts are spliced into one return, in the
        samples' order. Before a retry that follows an infra failure: ``backoff_s`` of the sample that has
        failed most often (NeMo-RL's ``backoff_base_s · 2^(k − 1)``, capped at ``max_backoff_s``); data
        failures are retried at once. An environment that bounds its own time (``bounds_own_time = True``: the
        reward and tool environments, whose worker processes have per-call timeouts, and which must start those
        workers from a thread that lives on) is called in this thread."""
        n = len(message_logs)
        rows: list[tuple[EnvironmentReturn, int] | None] = [None] * n  # sample -> (the return it came in, row)
        failures: list[Failure | None] = [None] * n
        retries = [0] * n
        failed_by_kind = [Counter() for _ in range(n)]
        pending, first = list(range(n)), None
        while pending:
            ret, failure = self._attempt(task, [message_logs[i] for i in pending], [metadata[i] for i in pending])
            first = ret if len(pending) == n and first is None else first
            again, waits = [], []
            for j, i in enumerate(pending):
                f = failure if ret is None else ret.failures[j]
                failures[i] = f
                if f is None:
                    rows[i] = (ret, j)
                    continue
                rows[i] = None
                failed_by_kind[i][f.kind] += 1
                self._failed(task, f)
                if self.retry.may_retry(f.kind, failed_by_kind[i][f.kind]):
                    again.append(i)
                    retries[i] += 1
                    if f.kind == INFRA:
                        waits.append(self.retry.backoff_s(failed_by_kind[i][INFRA]))
            if again:
                with self._lock:
                    self.num_retries += len(again)
                if waits:
                    self._sleep(max(waits))
            pending = again
        return StepResult(_splice(rows, failures, first), retries)

    def _attempt(self, task: str, message_logs: list, metadata: list) -> tuple[EnvironmentReturn | None,
                                                                               Failure | None]:
        """One checked call: ``(return, None)`` or ``(None, failure of the whole call)``."""
        env = self.envs[task]
        result: dict = {}
        logs, meta = _fresh(message_logs), _fresh(metadata)

        def call() -> None:
            try:
                raw = env.step(logs, meta)
            except Exception as err:
                result["failure"] = failure_of_exception(err, "env_error", traceback.format_exc())
                return
            try:
                result["ret"] = check_return(raw, len(logs))
            except Exception as err:  # noqa: BLE001 - whatever a strange return raises while it is checked
                result["failure"] = Failure.of("env_malformed", f"{type(err).__name__}: {err}")

        if getattr(env, "bounds_own_time", False):
            call()
        else:
            thread = threading.Thread(target=call, name=f"env-{task}", daemon=True)
            thread.start()
            thread.join(self.step_timeout_s)
            if thread.is_alive():
                return None, Failure.of("env_timeout", f"no return within env.step_timeout_s={self.step_timeout_s}")
            if not result:  # SystemExit and its kin end the thread without a word
                return None, Failure.of("env_error", "step ended its thread without returning or raising an Exception")
        if "failure" in result:
            return None, result["failure"]
        ret = result["ret"]
        self._note_reward_kind(task, "dict" if isinstance(ret.rewards, dict) else "scalar", "returned")
        return ret, None

    def _failed(self, task: str, failure: Failure) -> None:
        """Count one failed sample attempt, remember it as `last_error`, log the first of its reason and class."""
        env_name = type(self.envs[task]).__name__
        with self._lock:
            self.num_failures += 1
            self.last_error = (f"environment {task!r} ({env_name}): {failure.reason} ({failure.kind}): "
                               f"{failure.detail[-3000:]}")
            if (task, failure.reason, failure.kind) in self._logged:
                return
            self._logged.add((task, failure.reason, failure.kind))
        logger.warning("environment %r (task %r): a sample failed with %s (%s): retried within grpo.rollout_failure's "
                       "budget (max_%s_attempts_per_prompt), then masked out of the loss and its group's baseline, "
                       "never scored (later %s (%s) failures are only counted in rollout/failed_samples/%s):\n%s",
                       env_name, task, failure.reason, failure.kind, failure.kind, failure.reason, failure.kind,
                       failure.reason, failure.detail)

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


def _fresh(values: list) -> list:
    """A deep copy of an attempt's conversations or metadata, so an attempt that changed them in place (or a
    timed-out one still running) cannot change what a retry sees; the values themselves when they cannot be
    copied (an environment's own handles in its metadata)."""
    try:
        return copy.deepcopy(values)
    except Exception:  # noqa: BLE001 - whatever an uncopyable object raises
        return list(values)


def _splice(rows: list, failures: list, first: EnvironmentReturn | None) -> EnvironmentReturn:
    """One return for the whole call from the rows of its attempts (``rows[b]``: ``(return, row)``, None for a
    failed sample), with ``failures``. When every surviving row is its own row of one return of the whole call
    (no retry was needed, or none succeeded: then ``first``, the first attempt's return when it came back),
    that return itself; otherwise a new one, a failed sample's fields
    placeholders (no observation, reward 0.0, metadata None, terminated) and, with dict rewards, a component a
    retried call did not return 0.0.

        >>> import torch
        >>> a = EnvironmentReturn([[{"role": "user", "content": "x"}]] * 2, [{}, {}], [None] * 2, torch.tensor([1., 2.]),
        ...                       torch.tensor([True, True]), [None] * 2, [None, Failure.of("env_timeout")])
        >>> b = EnvironmentReturn([[{"role": "user", "content": "y"}]], [{"b": 1}], [None], torch.tensor([5.]),
        ...                       torch.tensor([False]), ["five"], [None])
        >>> r = _splice([(a, 0), (b, 0)], [None, None], None)
        >>> r.rewards.tolist(), r.terminateds.tolist(), r.metadata, r.answers, r.failures
        ([1.0, 5.0], [True, False], [{}, {'b': 1}], [None, 'five'], [None, None])
    """
    import torch

    n = len(rows)
    sources = {id(r[0]) for r in rows if r is not None}
    whole = next((r[0] for r in rows if r is not None), first)
    if whole is not None and len(sources) <= 1 and len(whole.observations) == n and all(
            r is None or r[1] == b for b, r in enumerate(rows)):
        return whole._replace(failures=list(failures))
    dict_rewards = any(isinstance(r[0].rewards, dict) for r in rows if r is not None)
    keys = list(dict.fromkeys(k for r in rows if r is not None and dict_rewards for k in r[0].rewards))

    def field(name: str, placeholder):
        return [placeholder if r is None else getattr(r[0], name)[r[1]] for r in rows]

    if dict_rewards:
        rewards = {k: torch.tensor([0.0 if r is None or k not in r[0].rewards else float(r[0].rewards[k][r[1]])
                                    for r in rows], dtype=torch.float32) for k in keys}
    else:
        rewards = torch.tensor([0.0 if r is None else float(r[0].rewards[r[1]]) for r in rows], dtype=torch.float32)
    return EnvironmentReturn(field("observations", []), field("metadata", None), field("next_stop_strings", None),
                             rewards, torch.tensor([r is None or bool(r[0].terminateds[r[1]]) for r in rows]),
                             field("answers", None), list(failures))


def rollout_batch(trajectories: list) -> dict:
    """Samples as NeMo-RL's rollout batch, what ``global_post_process_and_metrics(batch)`` receives: a dict
    (NeMo-RL's ``BatchedDataDict`` is one) with one entry per sample under each key.

    NeMo-RL's data batch (``rl_collate_fn``) and what ``run_multi_turn_rollout`` adds:

    - ``message_log``: the conversation, ``{"role", "content", "token_ids": LongTensor}`` per message, and
      ``"generation_logprobs"`` (FloatTensor) on the generated assistant messages;
    - ``extra_env_info``: the sample's metadata as the environment left it; ``task_name``; ``idx``: the data
      row's index (a list); ``stop_strings``: the row's first-turn stop strings (or None);
    - ``length``: prompt tokens [B]; ``batch_max_length`` [B]; ``loss_multiplier`` [B]: 0.0 for samples the
      environment masked (``mask_sample``) and failed ones (not ``Trajectory.scored``: their ``total_reward`` is
      ``UNSCORED_REWARD``, a placeholder, not a score), else 1.0;
    - ``total_reward`` [B] (float32) and ``truncated`` [B] (bool); each named reward component (dict rewards)
      under its own name, [B] (0.0 where a sample has not got it).

    Keys NeMo-RL's own environments read in their hooks (``math_environment.py``, ``vlm_environment.py``):
    ``rewards`` (= ``total_reward``), ``is_end`` [B] (bool: not truncated), ``prompt_lengths`` (= ``length``),
    ``generation_lengths`` [B] (all tokens of the sample, prompt included, so ``generation_lengths -
    prompt_lengths`` counts the response), ``text`` [B, P] (the prompt ids, right-padded with -1: what
    ``calculate_pass_rate_per_prompt`` groups by).

    grpo-ds's own: ``trajectories``: the `grpo.trajectory.Trajectory` objects themselves.

        >>> from grpo.trajectory import Message, Trajectory
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
    total = torch.tensor(filled_rewards(trajectories), dtype=torch.float32)
    truncated = torch.tensor([t.truncated for t in trajectories], dtype=torch.bool)
    batch = {
        "message_log": [[message(m) for m in t.messages] for t in trajectories],
        "extra_env_info": [t.metadata for t in trajectories],
        "task_name": [t.task_name for t in trajectories],
        "idx": [t.prompt_index for t in trajectories],
        "stop_strings": [getattr(t, "stop_strings", None) for t in trajectories],
        "length": length,
        "batch_max_length": torch.full_like(length, width),
        "loss_multiplier": torch.tensor([1.0 if t.scored and not t.mask_sample else 0.0 for t in trajectories]),
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
    comps = filled_components(trajectories, names)
    for k, name in enumerate(names):
        batch[name] = torch.tensor([row[k] for row in comps], dtype=torch.float32)
    return batch
