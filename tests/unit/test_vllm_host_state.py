"""What constructing the vLLM backend leaves in the trainer's process, with a stand-in for vllm (no import, no
engine): vLLM's EngineCore calls gc.freeze() at start-up, which in-process froze the trainer's heap too."""

from __future__ import annotations

import gc

import torch

from tests.helpers.fake_vllm import install_fake_vllm


class FreezingLLM:
    """Does at construction what vLLM 0.32-0.33's EngineCore.__init__ does to the process (freeze_gc_heap)."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        gc.collect()
        gc.freeze()

    def sleep(self, level=1):
        pass


def test_constructing_the_backend_leaves_the_heap_unfrozen(monkeypatch, tiny_model_dir, char_tokenizer):
    from grpo.config import MasterConfig
    from grpo.system.generation import vllm as backend

    install_fake_vllm(monkeypatch, FreezingLLM)
    cfg = MasterConfig.model_validate({"policy": {"model_name": tiny_model_dir, "generation": {"backend": "vllm"}}})
    try:
        gen = backend.VllmGeneration(cfg, char_tokenizer, None, torch.device("cpu"))
        assert isinstance(gen.llm, FreezingLLM) and gen.llm.kwargs["model"] == tiny_model_dir
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
