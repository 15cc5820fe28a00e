"""A NeMo-Gym multi-reward resources server in plain FastAPI: Gym's ``example_tool_call_multireward`` environment
(resources_servers/example_tool_call_multireward/app.py), the one NeMo-RL's GDPO Gym recipe
(``gdpo-qwen2.5-1.5b-1n8g-gym-multireward.yaml``) trains on, without installing Gym. The model is asked for one
``get_weather`` tool call; ``POST /verify`` grades it on three independent {0, 1} components:

- ``correctness``: some call has the expected name and arguments (the row's ``expected_call``);
- ``schema_valid``: the first call's arguments parse as a JSON object with every required parameter of the tool;
- ``format``: exactly one tool call and no assistant text.

``reward_components`` carries the three and ``reward`` is their sum (the sum NeMo-RL checks), so GDPO normalises
each component per group and a GRPO baseline reads the same total. Routes: ``/seed_session``, ``/get_weather`` (the
tool) and ``/verify``; the agent is examples/gym/agent_server.py (Gym's simple_agent).

Run by the stand-in launcher (examples/gym/launch.py) as ``python tool_call_multireward_server.py --name NAME --config
FILE``.
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request


def parse_arguments(arguments) -> tuple[dict, bool]:
    """A call's arguments -> (the dict, whether they are a JSON object)."""
    if isinstance(arguments, dict):
        return arguments, True
    try:
        value = json.loads(arguments)
    except (TypeError, json.JSONDecodeError):
        return {}, False
    return (value, True) if isinstance(value, dict) else ({}, False)


def required_params(params: dict, tool_name: str) -> list[str]:
    for tool in params.get("tools") or []:
        if tool.get("name") == tool_name:
            return (tool.get("parameters") or {}).get("required") or []
    return []


def reward_components(row: dict, response: dict) -> dict[str, float]:
    """The three components of Gym's example_tool_call_multireward for one verify request (row + response)."""
    output = response.get("output") or []
    calls = [{"name": i.get("name"), "arguments": i.get("arguments")} for i in output if i.get("type") == "function_call"]
    has_text = any(i.get("type") == "message" for i in output)
    schema_valid = 0.0
    if calls:
        parsed, is_object = parse_arguments(calls[0]["arguments"])
        required = required_params(row.get("responses_create_params") or {}, calls[0]["name"])
        schema_valid = float(is_object and all(k in parsed for k in required))
    expected = row.get("expected_call") or {}

    def matches(call: dict) -> bool:
        args = parse_arguments(call["arguments"])[0]
        return bool(expected) and call["name"] == expected.get("name") and all(
            args.get(k) == v for k, v in (expected.get("arguments") or {}).items())

    return {"correctness": float(any(matches(c) for c in calls)), "schema_valid": schema_valid,
            "format": float(len(calls) == 1 and not has_text)}


def app() -> FastAPI:
    api = FastAPI(title="example_tool_call_multireward resources server")

    @api.post("/seed_session")
    async def seed_session():
        return {}

    @api.post("/get_weather")
    async def get_weather(request: Request):
        city = str((await request.json()).get("city", ""))
        return {"city": city, "weather_description": f"The weather in {city} is sunny."}

    @api.post("/verify")
    async def verify(request: Request):
        body = await request.json()
        components = reward_components(body, body["response"])
        return {**body, "reward": sum(components.values()), "reward_components": components, **components}

    return api


if __name__ == "__main__":
    from serve import serve  # examples/gym/serve.py: this server's host and port from the launcher's config

    serve(app())
