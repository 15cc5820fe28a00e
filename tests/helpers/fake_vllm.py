"""A stand-in for the ``vllm`` package, so that `grpo.system.generation.vllm.VllmGeneration` can be built in unit
tests without vLLM: ``vllm.LLM`` is the test's class (it records what the backend passes), the platform is a CPU
without sleep mode, and the head-size check is off."""

from __future__ import annotations

import sys
import types


def install_fake_vllm(monkeypatch, llm_cls, **modules) -> None:
    """Put ``vllm`` (with ``LLM=llm_cls``) and ``vllm.platforms`` into ``sys.modules`` for the test; ``modules``:
    more attributes of ``vllm`` (e.g. ``SamplingParams``); dotted submodules are given with ``monkeypatch``
    by the test itself."""
    from grpo.system.generation import vllm as backend

    platform = types.SimpleNamespace(is_cpu=lambda: True, is_sleep_mode_available=lambda: False)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=llm_cls, **modules))
    monkeypatch.setitem(sys.modules, "vllm.platforms", types.SimpleNamespace(current_platform=platform))
    monkeypatch.setattr(backend, "check_cpu_head_size", lambda *a: None)
