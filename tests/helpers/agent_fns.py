"""Agents for tests of env.name=agent (grpo/tasks/agent.py): each drives the endpoint with the official openai client."""

from __future__ import annotations

import asyncio
import json
import os
import sys

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


if __name__ == "__main__":  # the program form: env.agent.command = [python, this file]
    row = json.load(sys.stdin)
    if row["question"] == "crash":
        sys.exit("the program fell over")
    answer = asyncio.run(_turns(row, os.environ["GRPO_BASE_URL"], os.environ["OPENAI_API_KEY"], os.environ["GRPO_MODEL"]))
    print("some log line")
    print(json.dumps({"reward": float(answer.strip() == row["answer"])}))
