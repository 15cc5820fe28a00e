"""The agent of the agent demo (configs/cpu_demo_agent.yaml), written as any OpenAI agent is: the official ``openai``
package, the calculator offered as a function tool, the tool run by the agent, the final answer scored by the agent.

grpo-ds runs it once per sample (``env.agent.fn: examples.calculator_agent:calculator_agent``) with the run's
endpoint, a key of the sample's own and the served model's name; every call it makes is recorded under that key and
trained on as generated. Run it by hand against a running demo (``<log_dir>/endpoint.json`` holds the URL, key and
model)::

    python examples/calculator_agent.py results/cpu_demo_agent/logs/endpoint.json 37*58= 2146
"""

from __future__ import annotations

import asyncio
import json
import sys

import openai

from grpo.tasks.arithmetic import arithmetic_reward
from grpo.tasks.calculator import calc

TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
MAX_TURNS = 3


async def calculator_agent(row: dict, base_url: str, api_key: str, model: str) -> dict:
    """Ask the question, run the calc calls the model makes, score the final answer (1 if right). A conversation
    that outgrows the model's context (the endpoint's 400 ``context_length_exceeded``) ends there, unanswered: the
    policy spent its budget, which is a reward of 0 to learn from, not a failure of the environment to mask."""
    sampling = row.get("sampling", {"temperature": 1.0, "top_p": 1.0})  # the run's (training or validation)
    messages: list[dict] = [{"role": "user", "content": row["question"]}]
    answer = ""
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        for _ in range(MAX_TURNS):
            try:
                r = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS, logprobs=True,
                                                         **sampling)
            except openai.BadRequestError as err:
                if err.code != "context_length_exceeded":
                    raise
                break  # the conversation has used up the model's context: the episode ends unanswered (reward 0)
            msg = r.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))  # the token fields ride along: the endpoint splices
            if not msg.tool_calls:
                answer = msg.content or ""
                break
            for call in msg.tool_calls:
                try:
                    result = calc(**json.loads(call.function.arguments))
                except Exception as err:  # a bad call is the model's mistake: it sees the error
                    result = f"error: {err}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return {"reward": arithmetic_reward(row["question"], answer, row["answer"], {}),
            "reward_components": {"used_tool": float(any(m.get("tool_calls") for m in messages))}}


if __name__ == "__main__":
    info = json.load(open(sys.argv[1]))
    row = {"question": sys.argv[2], "answer": sys.argv[3]}
    print(asyncio.run(calculator_agent(row, info["base_url"], info["api_key"], info["model"])))
