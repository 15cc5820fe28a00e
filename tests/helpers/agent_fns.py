"""Agents for tests of env.name=agent (grpo/wings/agents/environment.py): each drives the endpoint with the official openai client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from collections import Counter

import openai

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluate.", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


async def _turns(row, base_url, api_key, model, keep_tokens=True):
    messages = [{"role": "user", "content": row["question"]}]
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        for _ in range(3):
            r = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS, logprobs=True,
                                                     **row["sampling"])
            msg = r.choices[0].message
            if keep_tokens:
                messages.append(msg.model_dump(exclude_none=True))
            else:  # an agent that keeps only the text and rewrites it: its history is re-templated
                messages.append({"role": "assistant", "content": (msg.content or "") + "!",
                                 "tool_calls": [c.model_dump() for c in msg.tool_calls or []] or None})
            if not msg.tool_calls:
                return msg.content or ""
            for call in msg.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "2146"})
    return ""


async def calc_agent(row, base_url, api_key, model):
    answer = await _turns(row, base_url, api_key, model)
    return {"reward": float(answer.strip() == row["answer"]), "reward_components": {"answered": 1.0}}


async def rewriting_agent(row, base_url, api_key, model):
    await _turns(row, base_url, api_key, model, keep_tokens=False)
    return 0.5


ANSWERS: dict[str, list[tuple[list[int], list[int]]]] = {}  # api key -> (prompt, generated) token ids of each answer


async def compacting_agent(row, base_url, api_key, model):
    """A harness that rewrites its history: it solves the question with the tool (calls 1, 2), compacts the
    conversation into one summary message and goes on from it (call 3: a new branch), asks a sub-agent (call 4: a
    conversation of its own) and hands the sub-agent's answer to the compacted conversation as the tool's result
    (call 5: continues call 3's branch). Every answer's token fields are kept in ``ANSWERS[api_key]``; the reward is
    the final answer's correctness."""
    seen = ANSWERS.setdefault(api_key, [])
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        async def ask(messages):
            r = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS, logprobs=True,
                                                     **row["sampling"])
            msg = r.choices[0].message
            seen.append((msg.prompt_token_ids, msg.generation_token_ids))
            return msg

        def tool_results(msg, content):
            return [{"role": "tool", "tool_call_id": c.id, "content": content} for c in msg.tool_calls or []]

        main = [{"role": "user", "content": row["question"]}]
        first = await ask(main)
        main += [first.model_dump(exclude_none=True), *tool_results(first, "2146")]
        solved = await ask(main)
        compacted = [{"role": "user", "content": f"{row['question']} (so far: {solved.content})"}]
        again = await ask(compacted)
        sub = await ask([{"role": "user", "content": "check " + row["question"]}])
        compacted += [again.model_dump(exclude_none=True),
                      *tool_results(again, "2146" if sub.tool_calls else "?")]
        final = await ask(compacted)
    return float((final.content or "").strip() == row["answer"])


async def broken_agent(row, base_url, api_key, model):
    raise KeyError("the agent's own bug")


async def slow_agent(row, base_url, api_key, model):
    await asyncio.sleep(60)
    return 1.0


async def malformed_agent(row, base_url, api_key, model):
    return {"score": 1}


async def silent_agent(row, base_url, api_key, model):
    return 1.0


def not_async(row, base_url, api_key, model):
    return 1.0


# ---- agents that misbehave (issue 43): each blocks, spins, leaks or fails only while the test wants it to -------
RELEASE = threading.Event()  # set by a test when it is done: blocked and spinning agents end
WOKE: list[str] = []  # what blocked agents did once released
SPUN_OUT = threading.Event()  # set when a spinning agent was stopped from outside
LEAKED: list = []  # clients an agent never closed
ATTEMPTS: Counter = Counter()  # attempts per question
FIRST_KEYS: list[str] = []  # the keys first attempts were given


async def blocking_agent(row, base_url, api_key, model):
    """Blocks its event loop in sync code (a 30 s wait inside async def, as time.sleep would) unless released."""
    RELEASE.wait(30)
    WOKE.append("woke")
    return 1.0


async def spinning_agent(row, base_url, api_key, model):
    """Spins in Python code, never awaiting, for 30 s unless released."""
    try:
        deadline = time.monotonic() + 30
        while not RELEASE.is_set() and time.monotonic() < deadline:
            pass
    except BaseException:
        SPUN_OUT.set()
        raise
    return 1.0


async def leaky_agent(row, base_url, api_key, model):
    """Never closes its client (no ``async with``), which outlives the call (as in a cache, or a reference cycle)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    LEAKED.append(client)
    await client.chat.completions.create(model=model, messages=[{"role": "user", "content": row["question"]}],
                                         **row["sampling"])
    return 1.0


async def _first_attempt_calls(row, base_url, api_key, model) -> bool:
    """On a question's first attempt: one call with another prompt, and True; later attempts: False."""
    ATTEMPTS[row["question"]] += 1
    if ATTEMPTS[row["question"]] > 1:
        return False
    FIRST_KEYS.append(api_key)
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "FIRST TRY"}],
                                             **row["sampling"])
    return True


async def flaky_agent(row, base_url, api_key, model):
    """First attempt: a call, then the connection to its tool server drops (infra); later: calc_agent."""
    if await _first_attempt_calls(row, base_url, api_key, model):
        raise ConnectionResetError("the tool server went away")
    return await calc_agent(row, base_url, api_key, model)


async def stalling_agent(row, base_url, api_key, model):
    """First attempt: a call, then blocked in sync code past any deadline; later: calc_agent."""
    if await _first_attempt_calls(row, base_url, api_key, model):
        RELEASE.wait(30)
        return 1.0
    return await calc_agent(row, base_url, api_key, model)


async def signal_then_block(row, base_url, api_key, model):
    """Asks the question once (reward 0: whatever an untrained model answers); the first sample answered by weights
    of version ``GRPO_TEST_SIGNAL_AT_VERSION`` or newer (a step after that many were trained) then sends SIGTERM to the
    trainer (this process) and blocks its event loop for 10 minutes in sync code. ``GRPO_TEST_FLAG``: a file that
    says it was sent."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        r = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": row["question"]}],
                                                 **row["sampling"])
    if (r.model_extra or {}).get("weight_version", 0) >= int(os.environ["GRPO_TEST_SIGNAL_AT_VERSION"]):
        try:
            os.close(os.open(os.environ["GRPO_TEST_FLAG"], os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return 0.0
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(600)
    return 0.0


if __name__ == "__main__":  # the program form: env.agent.command = [python, this file]
    row = json.load(sys.stdin)
    if row["question"] == "crash":
        sys.exit("the program fell over")
    answer = asyncio.run(_turns(row, os.environ["GRPO_BASE_URL"], os.environ["OPENAI_API_KEY"], os.environ["GRPO_MODEL"]))
    print("some log line")
    if row["question"].startswith("chatty"):  # 32 MB of log lines on stdout and on stderr before its result
        line = "x" * 1023 + "\n"
        for _ in range(32 * 1024):
            sys.stdout.write(line)
            sys.stderr.write(line)
        sys.stderr.write("the last words on stderr\n")
    print(json.dumps({"reward": float(answer.strip() == row["answer"])}))
    sys.exit(3 if row["question"] == "chatty and failing" else 0)
