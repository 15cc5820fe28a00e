"""A harness that rewrites its history, as coding agents do, written with the official ``openai`` package: it hands
the model's tool calls to a sub-agent and rebuilds (compacts) its own conversation from its record before the model
answers. Its samples are trained as trees (grpo/wings/agents/branches.py): each conversation a row, every generated
token trained once, the sample's reward on every row.

One sample (``env.agent.fn: examples.compacting_agent:compacting_agent``, configs/cpu_demo_agent_tree.yaml):

1. the main conversation asks the question, the calculator offered as a function tool;
2. the model's calculator call goes to a **sub-agent**: a conversation of its own asked the call's expression, the
   calculator offered too; the harness runs the calculator for the sub-agent, and the sub-agent's answer is the
   result of the main conversation's call;
3. the main conversation is **compacted**: rebuilt from the harness's record, as a harness does when it summarises
   its context: the question, the call in the harness's canonical form (operands sorted: ``17*13`` becomes
   ``13*17``) and the result, without the endpoint's token fields; the model answers from that. Where the call was
   rewritten the prompt no longer continues the first call: a new branch (``env.agent.fork_threshold_tokens`` at
   12 or more would keep it in the first row instead, the rewritten call's tail untrained).

The reward is the final answer's (1 if right). Why the call is rewritten rather than dropped: the demo's policy
(``toy:calc_agent``) is fitted to copy a result that follows its call; after a history with the call dropped it
copied none of 48 results (a measured fact of the toy, not of the trainer), so such a demo could not learn.

A model that answers at once, without the tool, makes one call. Run it by hand against a running demo
(``<log_dir>/endpoint.json`` holds the URL, key and model)::

    python examples/compacting_agent.py results/cpu_demo_agent_tree/logs/endpoint.json 17*13= 221
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


async def ask(client: openai.AsyncOpenAI, model: str, messages: list[dict], sampling: dict):
    """The model's next message in ``messages``, or None when the conversation has outgrown its context (the
    endpoint's 400 ``context_length_exceeded``: the episode ends there, a reward of 0 to learn from)."""
    try:
        r = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS, logprobs=True, **sampling)
    except openai.BadRequestError as err:
        if err.code != "context_length_exceeded":
            raise
        return None
    return r.choices[0].message


def run_calls(msg) -> list[dict]:
    """The tool messages answering ``msg``'s calculator calls (a bad call is the model's mistake: it sees the
    error)."""
    out = []
    for call in msg.tool_calls or []:
        try:
            result = calc(**json.loads(call.function.arguments))
        except Exception as err:  # noqa: BLE001
            result = f"error: {err}"
        out.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return out


async def sub_agent(client, model: str, expression: str, sampling: dict) -> str:
    """A conversation of its own: asked ``expression``, the calculator run for it once; its answer's text."""
    messages: list[dict] = [{"role": "user", "content": f"{expression}="}]
    msg = await ask(client, model, messages, sampling)
    if msg is not None and msg.tool_calls:
        messages += [msg.model_dump(exclude_none=True), *run_calls(msg)]  # token fields ride along: spliced
        msg = await ask(client, model, messages, sampling)
    return "" if msg is None else (msg.content or "").strip()


def canonical(expression: str) -> str:
    """The harness's form of a product: its operands sorted (anything else as it is).

        >>> canonical("17*13"), canonical("12*18"), canonical("7+1")
        ('13*17', '12*18', '7+1')
    """
    parts = expression.split("*")
    if len(parts) == 2 and all(p.strip().isdigit() for p in parts):
        return "*".join(sorted((p.strip() for p in parts), key=int))
    return expression


async def compacting_agent(row: dict, base_url: str, api_key: str, model: str) -> dict:
    """One sample (module docstring): ask, hand a calculator call to the sub-agent, compact, answer; the reward."""
    sampling = row.get("sampling", {"temperature": 1.0, "top_p": 1.0})  # the run's (training or validation)
    question = row["question"]
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        msg = await ask(client, model, [{"role": "user", "content": question}], sampling)
        used_tool = msg is not None and bool(msg.tool_calls)
        if used_tool:
            call = msg.tool_calls[0]
            try:
                expression = str(json.loads(call.function.arguments).get("expression", ""))
            except (json.JSONDecodeError, AttributeError):
                expression = ""
            result = await sub_agent(client, model, expression, sampling)
            rewritten = {"name": "calc", "arguments": json.dumps({"expression": canonical(expression)})}
            compacted = [{"role": "user", "content": question},  # rebuilt from the record: no token fields
                         {"role": "assistant", "content": "",
                          "tool_calls": [{"id": call.id, "type": "function", "function": rewritten}]},
                         {"role": "tool", "tool_call_id": call.id, "content": result}]
            msg = await ask(client, model, compacted, sampling)
        answer = "" if msg is None or msg.tool_calls else (msg.content or "")
    return {"reward": arithmetic_reward(question, answer, row["answer"], {}),
            "reward_components": {"used_tool": float(used_tool)}}


if __name__ == "__main__":
    info = json.load(open(sys.argv[1]))
    row = {"question": sys.argv[2], "answer": sys.argv[3]}
    print(asyncio.run(compacting_agent(row, info["base_url"], info["api_key"], info["model"])))
