"""The endpoint with generation on ranks of its own: which runs serve it, and that a launch with several trainers is
taken (each trainer serves its own agents; grpo/system/generation/lockstep.py makes their generation agree:
tests/unit/test_lockstep.py, and end to end tests/e2e/test_agent_backends_e2e.py and test_agent_async_e2e.py)."""

from __future__ import annotations

from grpo.config_load import load_config
from grpo.serving import serves_endpoint
from tests.helpers.e2e import REPO

SPLIT = ["policy.generation.colocated.enabled=false", "policy.generation.colocated.resources.gpus_per_node=1"]


def config(name: str, *extra: str):
    return load_config(str(REPO / "configs" / name), [*SPLIT, *extra])


def test_which_runs_serve_the_endpoint():
    assert serves_endpoint(config("cpu_demo_agent.yaml"))
    assert not serves_endpoint(config("cpu_demo.yaml"))
    assert serves_endpoint(config("cpu_demo.yaml", "policy.generation.vllm_cfg.expose_http_server=true"))
