"""GPU only: the packed-versus-padded logprob canary (tests/helpers/packing_canary.py) on CUDA kernels: sdpa in fp32
and bf16, and flash-attention 2 in bf16 where flash_attn is installed (one packed row, its varlen kernel). Packed
logprobs equal the padded ones, and changing one packed sample leaves the others' logprobs unchanged."""

import importlib.util

import pytest
import torch

from tests.helpers.packing_canary import canary, check


@pytest.mark.parametrize("attn,dtype", [("sdpa", torch.float32), ("sdpa", torch.bfloat16),
                                        ("flash_attention_2", torch.bfloat16)])
def test_packed_logprobs_equal_padded_and_samples_stay_apart_on_cuda(attn, dtype):
    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash_attn is not installed: flash-attention 2 not covered")
    result = canary(attn, torch.device("cuda"), dtype)
    print(f"{attn} {dtype}: {result}")
    check(result, dtype)
