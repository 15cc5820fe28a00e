"""The example multi-reward Gym server (examples/gym/tool_call_multireward_server.py) grades as Gym's
example_tool_call_multireward does (its tests/test_app.py cases), and the stand-in launcher starts only config entries
that name an entrypoint (NeMo-RL's Gym recipes configure servers such as ``policy_model`` without one)."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from examples.gym.launch import is_server
from examples.gym.tool_call_multireward_server import reward_components
from tests.helpers.e2e import REPO

ROW = json.loads((REPO / "examples/gym/data/tool_call_multireward.jsonl").read_text().splitlines()[0])  # San Francisco


def _call(city: str | None = "San Francisco", arguments: str | None = None, name: str = "get_weather") -> dict:
    return {"type": "function_call", "name": name, "call_id": "c",
            "arguments": arguments if arguments is not None else json.dumps({"city": city})}


TEXT = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "sunny"}]}


@pytest.mark.parametrize("output, expected", [
    ([_call()], {"correctness": 1.0, "schema_valid": 1.0, "format": 1.0}),
    ([_call("Paris")], {"correctness": 0.0, "schema_valid": 1.0, "format": 1.0}),          # well-formed but wrong
    ([TEXT, _call()], {"correctness": 1.0, "schema_valid": 1.0, "format": 0.0}),           # right, extra prose
    ([_call(), _call()], {"correctness": 1.0, "schema_valid": 1.0, "format": 0.0}),        # two calls
    ([_call(arguments="{city: SF")], {"correctness": 0.0, "schema_valid": 0.0, "format": 1.0}),  # not JSON
    ([_call(arguments="{}")], {"correctness": 0.0, "schema_valid": 0.0, "format": 1.0}),   # a required key missing
    ([_call(name="get_time")], {"correctness": 0.0, "schema_valid": 1.0, "format": 1.0}),  # unknown tool: none required
    ([TEXT], {"correctness": 0.0, "schema_valid": 0.0, "format": 0.0}),
])
def test_the_three_components_are_gyms(output, expected):
    assert reward_components(ROW, {"output": output}) == expected


def test_only_entries_with_an_entrypoint_are_started():
    config = OmegaConf.create({
        "agent": {"responses_api_agents": {"simple_agent": {"entrypoint": "app.py"}}},
        "policy_model": {"responses_api_models": {"vllm_model": {"uses_reasoning_parser": False}}},
        "code_gen": {"resources_servers": {"code_gen": {"num_processes": 64}}},
        "policy_base_url": "http://127.0.0.1:3000/v1"})
    assert [name for name, entry in config.items() if is_server(entry)] == ["agent"]
