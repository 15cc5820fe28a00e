"""``http_server_serving_chat_kwargs.tool_parser`` / ``reasoning_parser`` are checked at config load against the
backend that will parse: the hf backend has grpo-ds's parsers, the vLLM backend every parser the installed vLLM
registers (and compact); any other name is refused naming the key and the choices, before any model loads."""

from __future__ import annotations

import importlib.util

import pytest

from grpo.config import REASONING_PARSERS, TOOL_PARSERS, vllm_parser_names
from grpo.config.load import ConfigError, load_config
from tests.helpers.e2e import REPO

KEY = "policy.generation.vllm_cfg.http_server_serving_chat_kwargs"
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


def load(*overrides: str):
    return load_config(str(REPO / "configs" / "cpu_demo.yaml"), list(overrides))


def test_the_hf_backend_takes_grpo_ds_parsers_and_refuses_others_naming_key_and_choices():
    for name in TOOL_PARSERS:
        assert load(f"{KEY}.tool_parser={name}").policy.generation.vllm_cfg.http_server_serving_chat_kwargs
    for name in REASONING_PARSERS:
        load(f"{KEY}.reasoning_parser={name}")
    with pytest.raises(ConfigError) as err:
        load(f"{KEY}.tool_parser=mistral")
    assert f"{KEY}.tool_parser='mistral'" in str(err.value) and "['compact', 'hermes']" in str(err.value)
    with pytest.raises(ConfigError, match=r"reasoning_parser='granite'.*\['deepseek_r1', 'qwen3'\]"):
        load(f"{KEY}.reasoning_parser=granite")


@needs_vllm
def test_the_vllm_backend_takes_vllms_parsers_and_compact_and_refuses_names_neither_has():
    assert "mistral" in vllm_parser_names("tool_parser") and "granite" in vllm_parser_names("reasoning_parser")
    cfg = load("policy.generation.backend=vllm", f"{KEY}.tool_parser=mistral", f"{KEY}.reasoning_parser=granite")
    assert cfg.policy.generation.vllm_cfg.http_server_serving_chat_kwargs.tool_parser == "mistral"
    load("policy.generation.backend=vllm", f"{KEY}.tool_parser=compact")
    with pytest.raises(ConfigError) as err:
        load("policy.generation.backend=vllm", f"{KEY}.tool_parser=no_such_parser")
    message = str(err.value)
    assert f"{KEY}.tool_parser='no_such_parser'" in message and "neither vLLM nor grpo-ds" in message
    assert "'compact'" in message and "'hermes'" in message and "'mistral'" in message
