"""The roofline's counts (`grpo.tools.roofline`): hand-computed FLOPs and bytes on a small config, torch's own FLOP
counter on the model the config builds, and the rules between phases (generation and scoring run the same layers;
a backward is twice a forward)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from grpo.tools.roofline import (
    Group, ModelShape, Work, achieved, adam_bytes_per_param, attended_keys, body_flops, decode_work, forward_work,
    groups_of, head_flops, optimizer_work, prefill_work, refit_work, train_work,
)

# The bench workload's tiny model (bench/WORKLOAD.md): hidden 64, 2 layers, 4 heads of 16, 2 kv heads, MLP 128.
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=58, tie_word_embeddings=False)
# Per layer: q, o 64x64 (4096 each), k, v 64x32 (2048 each), gate, up, down 64x128 (8192 each) = 36,864; head 58x64.
LAYER_PARAMS, HEAD_PARAMS = 36_864, 3_712
ATTN_PER_KEY = 4 * 2 * 4 * 16  # 4 FLOPs x 2 layers x 4 heads x head_dim 16 = 512 per attended key


@pytest.fixture
def shape() -> ModelShape:
    return ModelShape.from_config(Qwen2Config(**TINY))


def test_the_shape_counts_the_linear_weights_of_the_model_it_describes(shape):
    assert (shape.layer_matmul_params, shape.head_params) == (LAYER_PARAMS, HEAD_PARAMS)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert linear == shape.layers * shape.layer_matmul_params + shape.head_params
    assert shape.weight_bytes == 4 * linear
    assert shape.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # k and v, 2 layers, 2 kv heads of 16, fp32


def test_a_forward_counts_what_torchs_flop_counter_counts(shape):
    """One unpadded sequence of T tokens through the eager model: torch counts every matmul, attention as the full
    T x T square; the count here is causal (each token sees itself and the ones before)."""
    T = 7
    model = Qwen2ForCausalLM(Qwen2Config(**TINY, attn_implementation="eager")).eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=torch.randint(3, 58, (1, T)))
    square_attention = ATTN_PER_KEY * T * T
    causal_attention = ATTN_PER_KEY * attended_keys(T, 0)
    linear_and_head = body_flops(shape, T) - causal_attention + head_flops(shape, T)
    assert counter.get_total_flops() - square_attention == linear_and_head


def test_hand_computed_flops_of_a_logprob_pass(shape):
    # One prompt of 3 tokens, one row of 2 completion tokens: the layers run the prompt (3 tokens, 6 keys) and the
    # first completion token after it (1 token, 4 keys); the head runs at the 2 positions that predict the completion.
    linear = 2 * 2 * LAYER_PARAMS * (3 + 1)
    attention = ATTN_PER_KEY * (6 + 4)
    head = 2 * HEAD_PARAMS * 2
    assert linear + attention + head == 609_792
    assert forward_work(shape, [Group(3, (2,))]) == Work(609_792, shape.weight_bytes)


def test_a_shared_prompt_is_counted_once(shape):
    one = forward_work(shape, [Group(5, (4,))])
    two_rows = forward_work(shape, [Group(5, (4, 4))])
    prompt = body_flops(shape, 5)
    assert two_rows.flops == 2 * one.flops - prompt
    assert groups_of([[1, 2, 3], [1, 2, 3]], [4, 4]) == [Group(3, (4, 4))]


def test_hand_computed_prefill_and_decode(shape):
    groups = [Group(3, (2, 4))]
    prefill = prefill_work(shape, groups)
    # the prompt once (3 tokens, 6 keys), one set of logits; its KV cache written
    assert prefill.flops == 2 * 2 * LAYER_PARAMS * 3 + ATTN_PER_KEY * 6 + 2 * HEAD_PARAMS
    assert prefill.bytes == shape.weight_bytes + 3 * shape.kv_bytes_per_token
    decode = decode_work(shape, groups)
    # row 1 feeds 1 token (4 keys), row 2 feeds 3 (4 + 5 + 6 keys); 3 steps each read the weights
    fed, keys = 1 + 3, 4 + (4 + 5 + 6)
    assert decode.flops == 2 * 2 * LAYER_PARAMS * fed + ATTN_PER_KEY * keys + 2 * HEAD_PARAMS * fed
    assert decode.bytes == 3 * shape.weight_bytes + keys * shape.kv_bytes_per_token


def test_generation_runs_the_layers_a_logprob_pass_runs(shape):
    """Prefill + decode and a logprob pass run the same tokens through the layers; the head differs only in that
    the rows of a group share the prefill's logits."""
    groups = [Group(9, (1, 5, 12)), Group(4, (7,))]
    generation = prefill_work(shape, groups) + decode_work(shape, groups)
    rows_beyond_first = 2
    assert generation.flops == forward_work(shape, groups).flops - 2 * HEAD_PARAMS * rows_beyond_first


def test_training_is_three_forwards_and_two_for_frozen_weights(shape):
    groups = [Group(6, (3, 8))]
    fwd = forward_work(shape, groups).flops
    assert train_work(shape, groups, trainable_params=1000).flops == 3 * fwd
    assert train_work(shape, groups, trainable_params=10, weight_grads=False).flops == 2 * fwd
    assert train_work(shape, groups, trainable_params=1000).bytes == 2 * shape.weight_bytes + 4 * 1000
    # two optimizer updates over the rows: the same FLOPs, the weights read and the gradients written twice
    two = train_work(shape, groups, trainable_params=1000, updates=2)
    assert (two.flops, two.bytes) == (3 * fwd, 2 * (2 * shape.weight_bytes + 4 * 1000))


def test_adam_and_refit_bytes():
    # fp32: read param, grad, m, v (16) and write param, m, v (12); 16-bit: a 2-byte gradient, the fp32 master,
    # m and v read and written (24) and the 16-bit copy written (2)
    assert adam_bytes_per_param(4) == 28 and adam_bytes_per_param(2) == 28
    assert optimizer_work(1_000_000, 4).bytes == 28_000_000
    assert optimizer_work(1_000_000, 4, updates=3) == Work(3 * 12_000_000, 3 * 28_000_000)
    assert refit_work(1_000, 2) == Work(0, 4_000)


def test_the_bound_is_the_slower_of_compute_and_memory():
    peak, bandwidth = 100e9, 10e9  # ridge: 10 FLOP per byte
    compute = achieved(Work(flops=1e9, bytes=1e7), seconds=0.05, peak_flops=peak, bandwidth=bandwidth)
    assert (compute.bound, compute.fraction) == ("compute", pytest.approx(0.2))
    memory = achieved(Work(flops=1e8, bytes=1e9), seconds=0.2, peak_flops=peak, bandwidth=bandwidth)
    assert (memory.bound, memory.fraction) == ("memory", pytest.approx(0.5))
    assert achieved(Work(), seconds=1.0, peak_flops=peak, bandwidth=bandwidth).fraction is None
    assert achieved(Work(1e9, 0), seconds=0.0, peak_flops=peak, bandwidth=bandwidth).fraction is None
