"""Agents that drive the endpoint's ``/v1/messages`` with the official ``anthropic`` client
(tests/integration/test_endpoint_anthropic.py): a tool-using calculator agent (a function, and a program that finds
the endpoint in ``ANTHROPIC_BASE_URL`` / ``ANTHROPIC_API_KEY``), and a two-turn chatter for the token-exact check."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import anthropic

TOOLS = [{"name": "calc", "description": "Evaluate.", "input_schema": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}]


async def _calc_turns(client: anthropic.AsyncAnthropic, row: dict, model: str) -> str:
    """Up to three calls: each answer handed back as the client gives it (``r.content``), each tool call answered
    by a ``tool_result`` block; the text of the first answer without a tool call."""
    messages = [{"role": "user", "content": row["question"]}]
    for _ in range(3):
        r = await client.messages.create(model=model, max_tokens=64, messages=messages, tools=TOOLS,
                                         extra_body=row["sampling"])
        messages.append({"role": "assistant", "content": r.content})
        calls = [block for block in r.content if block.type == "tool_use"]
        if r.stop_reason != "tool_use":
            return "".join(block.text for block in r.content if block.type == "text")
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                      "content": "2146"} for call in calls]})
    return ""


async def calc_agent(row, base_url, api_key, model):
    async with anthropic.AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key,
                                        max_retries=0) as client:
        answer = await _calc_turns(client, row, model)
    return float(answer.strip() == row["answer"])


async def chatting_agent(row, base_url, api_key, model):
    """Two calls with a system prompt: the question, then the answer handed back and a follow-up."""
    messages = [{"role": "user", "content": row["question"]}]
    async with anthropic.AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key,
                                        max_retries=0) as client:
        for follow_up in ("and?", None):
            r = await client.messages.create(model=model, max_tokens=6, messages=messages, system="Be brief.",
                                             extra_body=row["sampling"])
            messages.append({"role": "assistant", "content": r.content})
            if follow_up:
                messages.append({"role": "user", "content": follow_up})
    return float(len(r.content[0].text if r.content else "") % 2)  # rewards that differ within a group


async def _program(row: dict) -> str:
    async with anthropic.AsyncAnthropic(max_retries=0) as client:  # ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY
        return await _calc_turns(client, row, os.environ["GRPO_MODEL"])


if __name__ == "__main__":  # the program form: env.agent.command = [python, -m, this module]
    row = json.load(sys.stdin)
    answer = asyncio.run(_program(row))
    print(json.dumps({"reward": float(answer.strip() == row["answer"])}))
