"""The packed forward: a micro-batch's samples as ONE row, positions restarting at 0 in each sample.

    rows [B, T] (right-padded)  ->  ids [1, N], position_ids [1, N]  ->  model  ->  logits [1, N, V]
                                ->  per-token values [N]  ->  back to [B, T] (`grpo.packing.unpack`)

N = Σ lengths (rounded up to ``sequence_length_round``). No padding goes through the model, and no attention
crosses samples: transformers (5.x, masking_utils) reads the samples off the position ids when the forward
gets ``position_ids`` and neither an ``attention_mask`` nor a cache (``use_cache=False``):

* sdpa, eager, flex_attention: ``create_causal_mask`` finds the samples with ``find_packed_sequence_indices``
  (a position that is not its predecessor + 1 starts a sample) and ANDs the causal mask with "same sample":
  a block-diagonal causal mask.
* flash_attention_2 / 3: ``_flash_attention_forward`` sees a batch of one row whose positions restart
  (``_is_packed_sequence``) and runs ``flash_attn_varlen_func`` with ``cu_seqlens`` from the restarts.

Any other implementation (paged kernels, a hub kernel, a model's own attention code) is refused by name
(`check_packable`) rather than trusted. Rotary embeddings take the per-sample positions, so every token is
computed as in its own padded row: the logprobs equal the padded forward's up to float rounding.
"""

from __future__ import annotations

import torch

from grpo.packing import packed_layout, unpack

# attn_implementation values whose mask transformers builds from packed position ids (see the docstring)
PACKABLE_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


def attention_implementation(module: torch.nn.Module) -> str:
    """The model's attention implementation (its config's ``_attn_implementation``; peft wrappers too)."""
    config = getattr(module, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    return str(impl) if impl is not None else "unknown"


def check_packable(module: torch.nn.Module) -> None:
    """ValueError naming the attention implementation when packed rows would let samples see each other."""
    impl = attention_implementation(module)
    if impl not in PACKABLE_ATTENTION:
        raise ValueError(
            f"policy.sequence_packing.enabled: the model's attention implementation {impl!r} "
            f"({type(module).__name__}) does not build its mask from packed position ids, so samples packed in one "
            f"row would attend to each other; packing supports {list(PACKABLE_ATTENTION)}. Use "
            "policy.dynamic_batching instead (any attention), or a model with one of those")


def packed_forward(model, ids_bt: torch.Tensor, mask_bt: torch.Tensor, sequence_length_round: int = 1):
    """The logits of right-padded rows ``ids_bt`` from one packed row: ``(logits_1nv, ids_1n, source_n)``.

    ``source_n`` maps packed positions back to the ``[B, T]`` layout (`grpo.packing.packed_layout`); the logits at
    packed position n score the token at n + 1 only inside a sample (the contract's shift is the caller's, and
    position 0 of each sample must then be dropped: `unpack_aligned`)."""
    B, T = ids_bt.shape
    lengths_b = mask_bt.sum(dim=1).long().cpu()
    source_n, positions_n = packed_layout(lengths_b, sequence_length_round, seq_len=T)
    device = ids_bt.device
    flat_ids = ids_bt.reshape(-1)
    ids_1n = torch.where(source_n.to(device) >= 0, flat_ids[source_n.clamp(min=0).to(device)], 0)[None]
    logits = model(input_ids=ids_1n, position_ids=positions_n.to(device)[None], attention_mask=None,
                   use_cache=False).logits
    return logits, ids_1n, source_n


def unpack_aligned(values_1n: torch.Tensor, source_n: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    """Contract-aligned per-token values of a packed row (computed with the contract's shift over the whole row)
    back to ``[B, T, ...]``: 0 at each sample's position 0 (its packed value scored it with the previous
    sample's last logits) and on padding."""
    out = unpack(values_1n[0], source_n, tuple(mask_bt.shape))
    keep_bt = mask_bt > 0
    keep_bt[:, 0] = False
    return torch.where(keep_bt.reshape(*keep_bt.shape, *([1] * (out.dim() - 2))), out, 0.0)
