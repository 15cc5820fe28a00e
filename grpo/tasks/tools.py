"""Tool calling: an environment that runs the tool calls of each assistant message and scores final answers.

    env = ToolEnvironment(["grpo.tasks.calculator:calc"], verifier="grpo.tasks.arithmetic:arithmetic_reward",
                          tool_call_format="compact")
    env.schemas        # -> apply_chat_template(messages, tools=env.schemas, ...)
    env.stop_strings   # the stop strings of every turn: the format's closing tag(s)
    ret = env.step(message_logs, metadata)

Per sample, `ToolEnvironment.step` parses the last (assistant) message:

- tool calls (``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, ``compact``:
  ``<calc>12*34</calc>``; see `grpo.tasks.tool_calls`): they run in order, each in a worker process with
  ``timeout_s``; the observation is one ``{"role": "tool", "name": ..., "content": ...}`` message per call;
  reward 0, not terminated. A call that fails answers with ``error: <what went wrong>``; results are cut to
  ``max_result_chars``. Two kinds of failure, as NeMo-RL tells them apart:

  - an invalid call (`INVALID_CALL_KINDS`: malformed JSON, no name, non-object arguments, an unknown tool,
    arguments that do not fit the tool's schema, more than ``max_calls_per_turn`` calls): the model wrote a
    call that cannot run. The message is flagged ``invalid_tool_call`` (so ``grpo.invalid_tool_call_advantage``
    applies). NeMo-RL flags a turn whose tool call its parser could not read (`nemo_rl/environments/
    nemo_gym.py`, ``_detect_invalid_tool_call_and_malformed_thinking``);
  - a tool error (`TOOL_ERROR_KINDS`: the tool raised, timed out, returned what cannot be turned into text,
    its process died, or tools are disabled): a well-formed call to a real tool that failed at run time. Not
    an invalid call: the model gets the error text back and the message is not flagged (metadata
    ``tool_error: True`` says so), as NeMo-Gym returns a raising tool's error as the call's output.
  Neither is a rollout failure (`grpo.tasks.failures`): what a tool call does is the policy's outcome (the
  arguments it wrote, the code it asked to run: a call that hangs or kills its worker may be the policy's
  doing), so the sample goes on with the error as its observation and keeps its reward and penalties.
- no tool call: the final answer. The reward is the verifier's (``fn(question, completion, answer, meta)``
  on that message, e.g. ``grpo.tasks.math:math_reward``); terminated. A verifier that raises or hangs is a
  reward failure (``reward_error`` / ``reward_timeout``, `grpo.tasks.reward`): reported in
  ``EnvironmentReturn.failures``, never scored; the router verifies that sample again (a final answer has no
  tool call to run again), then the trainer masks it. Counted in ``verifier_error_rate`` (per verification).

Metrics since the last `global_post_process_and_metrics` call (logged as ``train/env/<task>/<name>``):
``tool_calls_per_sample``, ``samples_with_tool_calls``, ``tool_calls_per_sample/<tool>``, ``invalid_call_rate``
and ``num_invalid_calls`` (invalid calls), ``tool_error_rate`` and ``num_tool_errors`` (tool errors),
``tool_errors/<kind>`` (per call, by kind, both families), ``tool_s`` (seconds spent running tools),
``verifier_error_rate``. Rates are per call.

``disable_tools=True`` is the ablation: same parsing, stop strings and turns, but every call is answered
with an error, so the model can only answer on its own.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from grpo.tasks.catalogue import in_process_reward
from grpo.tasks.function import resolve_reward_fn
from grpo.tasks.interface import Environment, EnvironmentReturn, MessageLog
from grpo.tasks.pool import WorkerPool
from grpo.tasks.reward import RewardEnvironment
from grpo.tasks.tool_calls import (FORMATS, ParsedCall, check_arguments, check_format, format_result,
                                  function_spec, load_tools, parse_tool_calls, resolve_tools, run_tool_call,
                                  stop_strings, tool_schemas, truncate)

__all__ = ["ERROR_KINDS", "FORMATS", "INVALID_CALL_KINDS", "TOOL_ERROR_KINDS", "ToolEnvironment", "check_arguments",
           "parse_tool_calls", "resolve_tools", "stop_strings", "tool_schemas"]

# Every way a call can fail, as counted in tool_errors/<kind>: the model's call cannot run (invalid, flags the
# message invalid_tool_call), or a well-formed call to a real tool failed at run time (a tool error).
INVALID_CALL_KINDS = ("bad_json", "missing_name", "arguments_not_object", "unknown_tool", "bad_arguments",
                      "too_many_calls")
TOOL_ERROR_KINDS = ("disabled", "exception", "timeout", "bad_result", "worker_error")
ERROR_KINDS = INVALID_CALL_KINDS + TOOL_ERROR_KINDS


class ToolEnvironment(Environment):
    """Tools (``"module:function"`` specs or module-level functions) + a verifier of final answers.

    ``num_workers`` tool worker processes run the calls (started on first use or by `start`); the
    verifier runs in the trainer process when it is a built-in in-process scorer (``arithmetic``) and in
    ``num_workers`` worker processes otherwise.
    """

    bounds_own_time = True  # tool calls and the verifier have timeouts: `Environments` calls step directly

    def __init__(self, tools: Sequence[str | Callable], verifier: str, tool_call_format: str = "hermes",
                 timeout_s: float = 20.0, max_result_chars: int = 1000, max_calls_per_turn: int = 4,
                 num_workers: int = 2, verifier_timeout_s: float = 10.0, disable_tools: bool = False):
        self.format = check_format(tool_call_format)
        self.tools = resolve_tools(tools)
        self.schemas = tool_schemas(self.tools)
        self._schema_by_name = {s["function"]["name"]: s for s in self.schemas}
        self.stop_strings = stop_strings(self.format, list(self.tools))
        self.timeout_s, self.max_result_chars = timeout_s, max_result_chars
        self.max_calls_per_turn, self.disable_tools = max_calls_per_turn, disable_tools
        specs = [t if isinstance(t, str) else function_spec(t) for t in tools]
        self._pool = WorkerPool(specs, num_workers, timeout_s, load=load_tools, call=run_tool_call, what="tool",
                                timeout_key="env.tool_timeout_s")
        resolve_reward_fn(verifier)  # a bad name fails here, not in every worker
        in_process = in_process_reward(verifier)
        self._verifier = RewardEnvironment(verifier, in_process=in_process, num_workers=num_workers,
                                           timeout_s=verifier_timeout_s)
        self._counts: Counter = Counter()
        self._tool_s = 0.0

    # -- one turn ----------------------------------------------------------------------------------
    def step(self, message_logs: list[MessageLog], metadata: list[dict]) -> EnvironmentReturn:
        n = len(message_logs)
        texts = [log[-1]["content"] for log in message_logs]
        parsed = [parse_tool_calls(text, self.format, self._schema_by_name) for text in texts]
        replies = self._answer_calls(parsed)
        finals = [b for b in range(n) if not parsed[b]]
        final_rewards, final_failures = self._verify([metadata[b] for b in finals], [texts[b] for b in finals])
        failures = [None] * n
        for b, failure in zip(finals, final_failures):
            failures[b] = failure

        observations, meta_out = [], []
        rewards, terminateds = torch.zeros(n), torch.zeros(n, dtype=torch.bool)
        # A sample is counted once, when it first comes back unfailed (a failed one is verified again).
        self._counts["samples"] += sum("tool_calls" not in md and f is None for md, f in zip(metadata, failures))
        for b in range(n):
            calls_so_far = metadata[b].get("tool_calls", 0)
            self._counts["samples_with_calls"] += bool(parsed[b]) and calls_so_far == 0
            observations.append([
                {"role": "tool", "name": call.name or "", "content": format_result(
                    self.format, text if kind == "ok" else f"error: {text}")}
                for call, (kind, text) in zip(parsed[b], replies[b])
            ])
            kinds = {kind for kind, _ in replies[b]}
            meta_out.append({**metadata[b], "tool_calls": calls_so_far + len(parsed[b]),
                             "invalid_tool_call": not kinds.isdisjoint(INVALID_CALL_KINDS),
                             "tool_error": not kinds.isdisjoint(TOOL_ERROR_KINDS)})
        for b, reward in zip(finals, final_rewards):
            rewards[b], terminateds[b] = reward, True
        return EnvironmentReturn(
            observations=observations, metadata=meta_out,
            next_stop_strings=[None if terminateds[b] else list(self.stop_strings) for b in range(n)],
            rewards=rewards, terminateds=terminateds, answers=[texts[b] if terminateds[b] else None for b in range(n)],
            failures=failures,
        )

    def _precheck(self, call: ParsedCall, k: int) -> tuple[str, str] | None:
        """The error reply to call number ``k`` of a message if it must not run, else None."""
        if call.problem is not None:
            return call.problem, call.detail
        if k >= self.max_calls_per_turn:
            return "too_many_calls", f"not run: at most {self.max_calls_per_turn} tool calls per message"
        if self.disable_tools:  # short: the ablation must leave the answer as much room as a real result does
            return "disabled", "disabled"
        if call.name not in self.tools:
            names = ", ".join(self.tools) or "none"
            return "unknown_tool", f"unknown tool {call.name!r} (the tools: {names})"
        problem = check_arguments(self._schema_by_name[call.name], call.arguments)
        return None if problem is None else ("bad_arguments", problem)

    def _answer_calls(self, parsed: list[list[ParsedCall]]) -> list[list[tuple[str, str]]]:
        """``(kind, text)`` for every call of every sample. The j-th runnable calls of all samples run as
        one batch on the pool, so a sample's calls run in order while samples run in parallel."""
        replies: list[list] = [[None] * len(calls) for calls in parsed]
        runnable: list[list[int]] = [[] for _ in parsed]
        for b, calls in enumerate(parsed):
            for k, call in enumerate(calls):
                self._counts["calls"] += 1
                if call.name in self.tools:
                    self._counts[f"calls/{call.name}"] += 1
                replies[b][k] = self._precheck(call, k)
                if replies[b][k] is None:
                    runnable[b].append(k)
        start = time.perf_counter()
        for j in range(max((len(r) for r in runnable), default=0)):
            batch = [(b, r[j]) for b, r in enumerate(runnable) if j < len(r)]
            tasks = [{"name": parsed[b][k].name, "arguments": parsed[b][k].arguments,
                      "max_chars": self.max_result_chars} for b, k in batch]
            for (b, k), (kind, payload) in zip(batch, self._pool.run(tasks)):
                if kind == "ok":
                    replies[b][k] = payload
                elif kind == "timeout":
                    replies[b][k] = ("timeout", f"the call did not finish within {self.timeout_s:g}s")
                else:  # the worker died, or the arguments could not be sent to it
                    last_line = str(payload).strip().splitlines()[-1:] or [""]
                    replies[b][k] = ("worker_error", f"the tool's process failed ({truncate(last_line[0], 200)})")
        self._tool_s += time.perf_counter() - start
        for kind, _ in (reply for sample in replies for reply in sample):
            if kind != "ok":
                self._counts[f"errors/{kind}"] += 1
        return replies

    def _verify(self, metadata: list[dict], texts: list[str]) -> tuple[list[float], list]:
        """The verifier's rewards of final answers and their failures (`grpo.tasks.reward.ScoreResult`)."""
        if not texts:
            return [], []
        result = self._verifier.score([
            {"question": md.get("question", ""), "completion": text, "answer": md.get("answer", ""),
             "meta": md.get("meta") or {}} for md, text in zip(metadata, texts)
        ])
        self._counts["final_answers"] += len(texts)
        self._counts["verifier_errors"] += result.num_errors + result.num_timeouts
        return result.rewards, result.failures

    # -- metrics and lifecycle ---------------------------------------------------------------------
    def global_post_process_and_metrics(self, batch: dict) -> tuple[dict, dict]:
        """NeMo-RL's rollout batch unchanged (`grpo.tasks.router.rollout_batch`); the tool metrics accumulated
        since the last call (then reset)."""
        c, tool_s = self._counts, self._tool_s
        self._counts, self._tool_s = Counter(), 0.0
        if not c["samples"] and not c["calls"] and not c["final_answers"]:
            return batch, {}
        samples, calls = max(c["samples"], 1), max(c["calls"], 1)
        num_invalid = sum(c[f"errors/{kind}"] for kind in INVALID_CALL_KINDS)
        num_tool_errors = sum(c[f"errors/{kind}"] for kind in TOOL_ERROR_KINDS)
        metrics = {
            "tool_calls_per_sample": c["calls"] / samples,
            "samples_with_tool_calls": c["samples_with_calls"] / samples,
            **{f"tool_calls_per_sample/{name}": c[f"calls/{name}"] / samples for name in self.tools},
            "invalid_call_rate": num_invalid / calls,
            "num_invalid_calls": num_invalid,
            "tool_error_rate": num_tool_errors / calls,
            "num_tool_errors": num_tool_errors,
            **{f"tool_errors/{kind}": c[f"errors/{kind}"] / calls for kind in ERROR_KINDS},
            "tool_s": tool_s,
            "verifier_error_rate": c["verifier_errors"] / max(c["final_answers"], 1),
        }
        return batch, metrics

    def start(self) -> None:
        """Start the tool (and verifier) workers now and wait until they are ready (optional)."""
        self._pool.start(wait=True)
        self._verifier.start()

    def shutdown(self) -> None:
        self._pool.close()
        self._verifier.shutdown()
