"""A NeMo-Gym agent server in plain FastAPI: Gym's ``simple_agent`` loop, calling the policy with the official
``openai`` package, so the protocol is visible without installing Gym.

``POST /run`` gets one row (``responses_create_params``, ``agent_ref``, task fields, ``_rowidx``) and:

1. seeds a session on its resources server (``POST /seed_session``; the session cookie rides along after);
2. calls the policy up to ``max_steps`` times: a chat completion at the run's endpoint (``policy_base_url``,
   ``policy_api_key``, ``policy_model_name``, as NeMo-RL hands them to Gym) with the row's ``temperature``,
   ``top_p`` and ``max_output_tokens`` and ``logprobs=true``, so the answer carries the token fields
   (``prompt_token_ids``, ``generation_token_ids``, ``generation_log_probs``). Each answer becomes Responses-API
   output items (a ``message`` for text, a ``function_call`` per tool call) and the LAST item of each call carries
   the token fields: what Gym's model server (responses_api_models/vllm_model) does between a Gym agent and
   NeMo-RL's vLLM server. The answer, token fields included, goes back into the history, so the endpoint shows the
   model its own tokens next turn (the prefix splice) and the trajectory stays contiguous;
3. runs each tool call on the resources server (``POST /<tool name>``) and appends a ``function_call_output``;
4. stops at an answer without tool calls (or at ``max_steps``, or a turn cut by ``max_output_tokens``), asks the
   resources server for the reward (``POST /verify`` with the row and the ``response``) and returns its answer.

Run by the stand-in launcher (examples/gym/launch.py) as ``python agent_server.py --name NAME --config FILE``.
"""

from __future__ import annotations

import json
import uuid

import httpx
import openai
from fastapi import FastAPI, Request

try:
    from serve import args, serve, server_entry, url_of  # run as a script: examples/gym is on the path
except ImportError:
    from examples.gym.serve import args, serve, server_entry, url_of

TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def chat_messages(params: dict) -> list[dict]:
    """The Responses-API ``input`` as chat messages (a string is one user message). Content parts: text joined into
    a string, unless there is an image: then ``input_text`` parts become chat ``text`` parts and ``input_image``
    parts (``{"type": "input_image", "image_url": "data:..."}``) chat ``image_url`` parts, in order, as Gym's model
    server converts them for a chat endpoint.

        >>> chat_messages({"input": [{"role": "user", "content": [
        ...     {"type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "auto"},
        ...     {"type": "input_text", "text": "colour?"}]}]})[0]["content"]
        [{'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,AA', 'detail': 'auto'}}, {'type': 'text', 'text': 'colour?'}]
    """
    given = params["input"]
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    out = []
    for m in given:
        content = m.get("content")
        if isinstance(content, list) and any(p.get("type") == "input_image" for p in content if isinstance(p, dict)):
            content = [chat_part(p) for p in content if isinstance(p, dict)]
        elif isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        out.append({"role": m["role"], "content": content})
    return out


def chat_part(part: dict) -> dict:
    """One Responses-API content part as a chat content part: ``input_image`` as ``image_url``, text as ``text``."""
    if part.get("type") == "input_image":
        return {"type": "image_url", "image_url": {"url": part.get("image_url"), "detail": part.get("detail", "auto")}}
    return {"type": "text", "text": part.get("text", "")}


def chat_tools(params: dict) -> list[dict] | None:
    """Responses-API function tools (``{"type": "function", "name", "parameters"}``) as chat tools."""
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
             for t in params.get("tools") or [] if t.get("type") == "function"]
    return tools or None


def output_items(message: dict) -> list[dict]:
    """One chat answer as Responses output items, the token fields on the last one (Gym's converter's way)."""
    items = []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "completed",
                      "content": [{"type": "output_text", "text": message.get("content") or "", "annotations": []}]})
    for call in calls:
        items.append({"id": call["id"], "call_id": call["id"], "type": "function_call", "status": "completed",
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"]})
    items[-1].update({k: message[k] for k in TOKEN_FIELDS if k in message})
    return items


class Agent:
    """The agent ``name`` of the global config: its resources server and ``max_steps``, the policy keys."""

    def __init__(self, name: str, global_config: dict):
        entry = server_entry(global_config, name)
        self.resources_url = url_of(global_config, entry["resources_server"]["name"])
        self.max_steps = int(entry.get("max_steps") or 4)
        base = global_config["policy_base_url"]
        self.base_url = base[0] if isinstance(base, list) else base
        self.api_key, self.model = global_config["policy_api_key"], global_config["policy_model_name"]
        self.policy = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0, timeout=600)

    async def respond(self, params: dict, resources: httpx.AsyncClient) -> dict:
        """The episode: model calls and tool calls until an answer; the Responses-API ``response``."""
        messages, tools, output = chat_messages(params), chat_tools(params), []
        incomplete = None
        for _ in range(self.max_steps):
            extra = {"tools": tools} if tools else {}
            answer = await self.policy.chat.completions.create(
                model=self.model, messages=messages, temperature=params["temperature"], top_p=params["top_p"],
                max_tokens=params.get("max_output_tokens"), logprobs=True, **extra)
            choice = answer.choices[0]
            message = choice.message.model_dump(exclude_none=True)  # the token fields ride along
            messages.append(message)
            output.extend(output_items(message))
            if choice.finish_reason == "length":
                incomplete = {"reason": "max_output_tokens"}
                break
            if not message.get("tool_calls"):
                break
            for call in message["tool_calls"]:
                try:
                    arguments = json.loads(call["function"]["arguments"])
                    result = (await resources.post(f"/{call['function']['name']}", json=arguments)).text
                except json.JSONDecodeError as err:
                    result = json.dumps({"error": f"Invalid tool call arguments: {err!r}"})
                output.append({"type": "function_call_output", "call_id": call["id"], "output": result})
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "model": self.model, "output": output,
                "incomplete_details": incomplete, "status": "incomplete" if incomplete else "completed"}

    async def run(self, row: dict) -> dict:
        async with httpx.AsyncClient(base_url=self.resources_url, timeout=600) as resources:
            seeded = await resources.post("/seed_session", json=row)
            seeded.raise_for_status()
            resources.cookies = seeded.cookies
            response = await self.respond(row["responses_create_params"], resources)
            verified = await resources.post("/verify", json={**row, "response": response})
            verified.raise_for_status()
            return verified.json()


def app(agent: Agent) -> FastAPI:
    api = FastAPI(title="simple agent")

    @api.post("/run")
    async def run(request: Request):
        return await agent.run(await request.json())

    return api


if __name__ == "__main__":
    name, config = args()
    serve(app(Agent(name, config)), name, config)
