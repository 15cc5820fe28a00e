"""vLLM's prefix-cache reset after a weight change is checked (grpo.system.generation.vllm.reset_prefix_cache, issue
52 finding 6): vLLM answers False while a request holds KV blocks. The real engine's case (a generation that failed
mid-way) runs in tests/integration/test_generation_vllm.py; here the rule for blocks that no abort frees."""

from __future__ import annotations

import types

import pytest

from grpo.system.generation.vllm import reset_prefix_cache


class Engine:
    """vLLM's contract (``BlockPool.reset_prefix_cache``): False while any block is held; a request's blocks are freed
    when it is aborted. ``pinned``: blocks no request holds (a KV connector's), which no abort frees."""

    def __init__(self, requests: list[str], pinned: int = 0):
        self.output_processor = types.SimpleNamespace(request_states={r: None for r in requests})
        self.pinned, self.aborted = pinned, []

    def abort_request(self, ids, internal=False):
        self.aborted += ids
        for r in ids:
            self.output_processor.request_states.pop(r)

    def reset(self) -> bool:
        return not self.output_processor.request_states and not self.pinned


def llm(engine: Engine):
    return types.SimpleNamespace(llm_engine=engine, reset_prefix_cache=engine.reset)


def test_requests_left_in_the_engine_are_aborted_then_the_reset_succeeds(caplog):
    engine = Engine(["7", "8"])
    reset_prefix_cache(llm(engine))
    assert engine.aborted == ["7", "8"] and "2 request(s) left by a failed generation" in caplog.text
    clean = Engine([])
    reset_prefix_cache(llm(clean))
    assert clean.aborted == []


def test_a_reset_that_still_fails_raises_instead_of_generating_on_old_prefixes():
    with pytest.raises(RuntimeError, match="could not reset its prefix cache after a weight change"):
        reset_prefix_cache(llm(Engine(["1"], pinned=3)))
