"""The packed-versus-padded logprob canary (tests/gpu/test_gpu_packing.py on CUDA, its CPU twin in
tests/unit/test_packing_canary.py): the logprob forward on packed rows (`grpo.system.packed`) against the padded
rows, and a change to one packed sample's tokens, which must leave every other sample's logprobs as they were (a
kernel that reads across samples, e.g. a flash build that ignores the packed positions, moves them)."""

from __future__ import annotations

import torch

LENGTHS = (9, 1, 23, 4, 17, 2, 30, 6)
CHANGED = 2  # the sample whose tokens the canary changes


def tiny_llama(attn: str, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, attn_implementation=attn)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype)


def rows(seed: int = 1, vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows of LENGTHS, random ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros((len(LENGTHS), max(LENGTHS)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(LENGTHS):
        ids[b, :n] = torch.randint(3, vocab, (n,), generator=g)
        mask[b, :n] = 1
    return ids, mask


def canary(attn: str, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """``packed_vs_padded``: the largest |packed - padded| logprob over real tokens; ``others_moved``: the largest
    change of the other samples' packed logprobs when sample CHANGED gets new tokens; ``changed_moved``: that
    sample's own change (the canary can see a change)."""
    from grpo.system.engines import FrozenModel
    from grpo.system.packed import Packing
    from grpo.system.training import logprob_forward

    engine = FrozenModel(tiny_llama(attn, device, dtype), device)
    ids, mask = rows()
    other = ids.clone()
    n = LENGTHS[CHANGED]
    other[CHANGED, 1:n] = (ids[CHANGED, 1:n] + 7) % 61 + 3
    real = mask.bool().clone()
    real[:, 0] = False  # position 0 has no logprob
    with torch.no_grad():
        padded = logprob_forward(engine, ids, mask)[0].float().cpu()
        packed = logprob_forward(engine, ids, mask, packing=Packing(8, always=True))[0].float().cpu()
        packed_other = logprob_forward(engine, other, mask, packing=Packing(8, always=True))[0].float().cpu()
    keep = torch.ones(len(LENGTHS), dtype=torch.bool)
    keep[CHANGED] = False
    diff = (packed_other - packed).abs()
    return {"packed_vs_padded": float((packed - padded).abs()[real].max()),
            "others_moved": float(diff[keep][real[keep]].max()),
            "changed_moved": float(diff[CHANGED][real[CHANGED]].max())}


# |logprob| tolerances: fp32 rounding; bf16 rounding of a 2-layer model (a leak across samples moves far more)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 2e-2}


def check(result: dict[str, float], dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    assert result["packed_vs_padded"] <= tol, result
    assert result["others_moved"] <= tol, f"a packed sample's change reached the others: {result}"
    assert result["changed_moved"] > 10 * tol, f"the canary cannot see a change: {result}"
