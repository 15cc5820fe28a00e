"""The endpoint with generation on ranks of its own: which runs serve it, and that a launch with several trainers is
taken (each trainer serves its own agents; grpo/wings/agents/lockstep.py makes their generation agree:
tests/unit/test_lockstep.py, and end to end tests/e2e/test_agent_backends_e2e.py and test_agent_async_e2e.py)."""

from __future__ import annotations

import pytest

from grpo.config import serves_endpoint
from grpo.config.load import ConfigError, load_config
from tests.helpers.e2e import REPO

SPLIT = ["policy.generation.colocated.enabled=false", "policy.generation.colocated.resources.gpus_per_node=1"]


def config(name: str, *extra: str):
    return load_config(str(REPO / "configs" / name), [*SPLIT, *extra])


def test_which_runs_serve_the_endpoint():
    assert serves_endpoint(config("cpu_demo_agent.yaml"))
    assert not serves_endpoint(config("cpu_demo.yaml"))
    assert serves_endpoint(config("cpu_demo.yaml", "policy.generation.vllm_cfg.expose_http_server=true"))


def test_colocated_tensor_parallel_vllm_with_the_endpoint_is_refused_at_load():
    """Issue 52, finding 3: each rank's endpoint generates when its own agents call, so one rank of a colocated
    tensor-parallel vLLM group started a gather its other ranks never joined (a hang). Refused at load, naming the
    keys; generation ranks serve it (the trainers agree on every generation), and without the endpoint TP stands."""
    vllm_tp2 = ["policy.generation.backend=vllm", "policy.generation.vllm_cfg.tensor_parallel_size=2"]
    for name, extra in (("cpu_demo_agent.yaml", []), ("cpu_demo.yaml", ["policy.generation.vllm_cfg.expose_http_server=true"])):
        with pytest.raises(ConfigError) as err:
            load_config(str(REPO / "configs" / name), [*vllm_tp2, *extra])
        lines = str(err.value).splitlines()  # "invalid config:", then one line per problem
        assert len(lines) == 2 and lines[1].strip().startswith("policy.generation.vllm_cfg.tensor_parallel_size=2 with "
                                                               "colocated vLLM and the endpoint"), lines
        assert "policy.generation.colocated.enabled=false" in lines[1]
    assert load_config(str(REPO / "configs" / "cpu_demo.yaml"), vllm_tp2).policy.generation.vllm_cfg.tensor_parallel_size == 2
    split = load_config(str(REPO / "configs" / "cpu_demo_agent.yaml"), [*vllm_tp2, *SPLIT[:1],
                                                                          "policy.generation.colocated.resources.gpus_per_node=2"])
    assert serves_endpoint(split) and split.policy.generation.vllm_cfg.tensor_parallel_size == 2
