"""Agents as environments (``env.name: agent``): a user's agent plays each sample against the policy through the
run's OpenAI-compatible endpoint (`grpo.wings.agents.endpoint`), and says what the sample earned.

An agent is an async Python function (``env.agent.fn: package.module:function``)::

    async def agent(row: dict, base_url: str, api_key: str, model: str) -> float | dict:
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
            ...                               # any number of chat completions, tools run by the agent
        return {"reward": 1.0, "reward_components": {"correct": 1.0}, "mask_sample": False}

or a program (``env.agent.command: [argv...]``) that reads the row as JSON on stdin, finds ``GRPO_BASE_URL``,
``GRPO_API_KEY``, ``GRPO_MODEL`` (and the ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` the openai package reads, the
``ANTHROPIC_BASE_URL`` / ``ANTHROPIC_API_KEY`` the anthropic package reads: the endpoint's ``/v1/messages``) in its
environment, and prints the result as JSON on the last line of its stdout (what it prints before is read and
dropped, its last megabyte kept: `grpo.wings.agents.call.run_program`). ``row`` is
``{"question", "answer", "meta", "task_name", "messages", "sampling"}`` (``messages``: the prompt as the data
formatted it, role / content dicts in OpenAI's chat form, a row's picture an ``image_url`` part with a ``data:`` URL
(`agent_messages`): forwarded unchanged, the endpoint renders them to the row's own ids; ``sampling``: the
``temperature`` and ``top_p`` to send, the run's training or validation pair: the endpoint refuses others). A
number is the reward; a dict has ``reward`` and optionally ``reward_components`` (named finite numbers) and
``mask_sample`` (keep the sample out of the loss).

Every attempt of a sample gets its own API key and its own ``base_url`` (``.../rollout/<id>/v1``, where the run's key
works too: a harness that sends one key for all its conversations), so the endpoint records each call it makes,
chat completions and the Responses API alike; the trainer builds the sample's trajectory from those records
(`grpo.wings.agents.player`), never from what the agent says it saw.

Each call of the function runs on an event loop of its own, in a thread of its own (`grpo.wings.agents.call`: so
that the timeout and stop signals hold whatever the agent does); make clients inside the function, as above, not at
module level: a connection does not outlive the loop it was opened on.

An attempt *fails* (`grpo.tasks.failures`) when its agent raises (its class from the exception: a dropped connection
or a 5xx is infra, the agent's own bug data), runs past ``env.agent.timeout_s`` (``env_timeout``; it is abandoned, a
program killed), exits non-zero, or returns something that is not a result (``env_malformed``). A failed attempt is
retried within ``grpo.rollout_failure``'s budgets under a fresh key (`grpo.wings.agents.player`); a sample whose
attempts all failed is masked, never scored 0. Up to ``env.agent.max_concurrency`` agents run at once.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable

from grpo.wings.agents.call import AgentCall, ProgramFailed, ProgramOutputError, run_program
from grpo.tasks.failures import failure_of_exception, reward_problem
from grpo.tasks.function import EnvError, resolve_function
from grpo.tasks.interface import Environment
from grpo.trajectory import DATA, Failure


@dataclass
class AgentOutcome:
    """What one sample's agent said: its reward, components and mask flag, or the failure in their place."""

    reward: float = 0.0
    reward_components: dict[str, float] | None = None
    mask_sample: bool = False
    failure: Failure | None = None


def parse_result(value: Any) -> AgentOutcome:
    """An agent's return value as an `AgentOutcome`; anything else is an ``env_malformed`` failure.

        >>> parse_result(1).reward, parse_result({"reward": 0.5, "mask_sample": True}).mask_sample
        (1.0, True)
        >>> parse_result({"score": 1}).failure.reason
        'env_malformed'
    """
    def bad(why: str) -> AgentOutcome:
        return AgentOutcome(failure=Failure.of("env_malformed", f"the agent returned {str(value)[:300]!r}: {why}"))

    def number(x) -> float | None:
        return float(x) if reward_problem(x) is None else None  # finite in float32, the dtype rewards train in

    if number(value) is not None:
        return AgentOutcome(reward=number(value))
    if not isinstance(value, dict) or number(value.get("reward")) is None:
        return bad("expected a finite number or a dict with a finite 'reward' (finite in float32, the dtype rewards "
                   "train in)")
    unknown = sorted(set(value) - {"reward", "reward_components", "mask_sample"})
    if unknown:
        return bad(f"unknown keys {unknown} (expected reward, reward_components, mask_sample)")
    comps = value.get("reward_components")
    if comps is not None:
        if not isinstance(comps, dict) or any(number(v) is None for v in comps.values()):
            return bad("reward_components must map names to finite numbers")
        comps = {str(k): float(v) for k, v in comps.items()}
    if not isinstance(value.get("mask_sample", False), bool):
        return bad("mask_sample must be true or false")
    return AgentOutcome(number(value["reward"]), comps, value.get("mask_sample", False))


class AgentEnvironment(Environment):
    """``env.name: agent``. Its samples are played by their agents (`start`), never stepped:
    `grpo.system.rollout.generate_rollout` hands them to `grpo.wings.agents.player.play_agents`."""

    def __init__(self, fn: str | None = None, command: list[str] | None = None, max_concurrency: int = 64,
                 timeout_s: float = 300.0, key: str = "env.agent", fork_threshold_tokens: int = 0):
        self.command, self.max_concurrency, self.timeout_s = command, max_concurrency, timeout_s
        self.fork_threshold_tokens = fork_threshold_tokens
        self.fn = None
        if fn is not None:
            self.fn = resolve_function(fn, f"{key}.fn")
            if not inspect.iscoroutinefunction(self.fn):
                raise EnvError(f"{key}.fn={fn!r}: expected an async function (async def ...(row, base_url, api_key, "
                               "model))")

    def step(self, message_logs, metadata):
        raise EnvError("env.name=agent: its samples are played by the agent over the endpoint "
                       "(grpo.wings.agents.player), not stepped")

    def global_post_process_and_metrics(self, batch: dict) -> tuple[dict, dict]:
        """Metrics of the agent samples (``env/<task>/<name>``): failed and masked non-contiguous samples (counts),
        model calls per sample (mean), and what their rows cost (`grpo.wings.agents.branches`): training rows
        (branches) per sample, trained (generated) tokens per sample, row tokens per sample (context included:
        what the forward passes read) and generated tokens a realign left untrained (means)."""
        trajs = batch["trajectories"]
        n = max(len(trajs), 1)
        rows = [[t.messages, *t.branches] for t in trajs]
        return batch, {"failed_samples": sum(not t.scored for t in trajs),
                       "noncontiguous_samples": sum(bool((t.metadata or {}).get("agent_noncontiguous"))
                                                    for t in trajs),
                       "calls_per_sample": sum(t.turns for t in trajs) / n,
                       "branches_per_sample": sum(len(r) for r in rows) / n,
                       "trained_tokens_per_sample": sum(t.num_generated_tokens for t in trajs) / n,
                       "row_tokens_per_sample": sum(len(m.token_ids) for r in rows for row in r for m in row) / n,
                       "realigned_tokens_per_sample": sum(int((t.metadata or {}).get("agent_realigned_tokens", 0))
                                                          for t in trajs) / n}

    def start(self, row: dict, base_url: str, api_key: str, model: str,
              on_done: Callable[[AgentCall], None]) -> AgentCall:
        """One attempt of ``row``'s agent, started in its own thread (`grpo.wings.agents.call.AgentCall`); its
        `outcome_of` once ``on_done(call)`` is called."""
        if self.fn is not None:
            return AgentCall(lambda call: self.fn(row, base_url, api_key, model), on_done)
        env = {**os.environ, "GRPO_BASE_URL": base_url, "GRPO_API_KEY": api_key, "GRPO_MODEL": model,
               "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key,
               "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"), "ANTHROPIC_API_KEY": api_key}
        return AgentCall(lambda call: run_program(self.command, row, env, call), on_done)


def outcome_of(call: AgentCall) -> AgentOutcome:
    """The `AgentOutcome` of an attempt that ended: its return value parsed (`parse_result`), or the failure of what
    it raised: a program's non-zero exit ``env_error`` (data), its unreadable result ``env_malformed``, any other
    exception ``env_error`` or its HTTP status's reason, classed by `grpo.tasks.failures.failure_of_exception`."""
    err = call.error
    if err is None:
        return parse_result(call.value)
    if isinstance(err, ProgramFailed):
        return AgentOutcome(failure=Failure.of("env_error", str(err), kind=DATA))
    if isinstance(err, ProgramOutputError):
        return AgentOutcome(failure=Failure.of("env_malformed", str(err)))
    return AgentOutcome(failure=failure_of_exception(err, "env_error", call.traceback))


def timed_out(timeout_s: float) -> AgentOutcome:
    """The outcome of an attempt abandoned at its deadline."""
    return AgentOutcome(failure=Failure.of("env_timeout", f"the agent ran past env.agent.timeout_s={timeout_s}"))


def agent_row(question: str, answer: str, meta: dict, task_name: str, messages: list[dict],
              sampling: dict[str, float]) -> dict:
    """The row an agent gets (module docstring); ``messages`` as `agent_messages` makes them."""
    return {"question": question, "answer": answer, "meta": meta, "task_name": task_name,
            "messages": [{"role": m["role"], "content": m["content"]} for m in messages], "sampling": dict(sampling)}


def agent_messages(messages: list[dict], prompt_parts: list | None, where: str) -> list[dict]:
    """A sample's prompt ``messages`` (role / content, the content text) as its agent gets them: where the row gave
    a message as parts with images (``prompt_parts``, `grpo.tasks.rows.PromptRow`), that content in OpenAI's form,
    each picture an ``image_url`` part with a ``data:`` URL (`grpo.system.vision.openai_content`), so the endpoint
    renders the row's own ids; a text row's messages as they are. A picture that cannot be read any more (a file
    gone since the data was loaded) raises `grpo.tasks.rows.DataError` naming ``where``.

        >>> agent_messages([{"role": "user", "content": "hi"}], None, "row 0")
        [{'role': 'user', 'content': 'hi'}]
    """
    from grpo.system.vision import openai_content

    if prompt_parts is None:
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    return [{"role": m["role"], "content": openai_content(parts, where)} for m, parts in zip(messages, prompt_parts)]
