"""The endpoint with generation on ranks of its own: one trainer serves it (two trainers' endpoints would each drive
the trainers' collective generation on their own schedule and hang); a launch with more trainers is refused before
any model loads, naming the keys and the launch that works."""

from __future__ import annotations

import pytest

from grpo.config_load import load_config
from grpo.run import RunError
from grpo.serving import endpoint_split_problem, serves_endpoint, start_split
from tests.helpers.e2e import REPO

SPLIT = ["policy.generation.colocated.enabled=false", "policy.generation.colocated.resources.gpus_per_node=1"]


def config(name: str, *extra: str):
    return load_config(str(REPO / "configs" / name), [*SPLIT, *extra])


def test_which_runs_serve_the_endpoint():
    assert serves_endpoint(config("cpu_demo_agent.yaml"))
    assert not serves_endpoint(config("cpu_demo.yaml"))
    assert serves_endpoint(config("cpu_demo.yaml", "policy.generation.vllm_cfg.expose_http_server=true"))


def test_one_trainer_serves_it_more_are_refused_with_the_launch_that_works():
    cfg = config("cpu_demo_agent.yaml")
    assert endpoint_split_problem(cfg, 1) is None
    assert endpoint_split_problem(config("cpu_demo.yaml"), 2) is None  # no endpoint: any number of trainers
    problem = endpoint_split_problem(cfg, 2)
    assert "2 training ranks" in problem and "launch 2 ranks" in problem
    assert "policy.generation.colocated.enabled=true" in problem


def test_start_split_refuses_it_before_any_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(RunError, match="serves one training rank only; this launch has 2 training ranks"):
        start_split(config("cpu_demo_agent.yaml"))
