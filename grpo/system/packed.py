"""The packed forward: a micro-batch's samples back to back in K rows, positions restarting at 0 in each sample.

    rows [B, T] (right-padded)  ->  ids [K, R], position_ids [K, R]  ->  model  ->  logits [K, R, V]
                                ->  per-token values [K, R]  ->  back to [B, T] (`grpo.packing.unpack`)

The row shape follows the attention kernel (`packed_rows`): flash attention gets ONE row of all the samples
(K = 1, R = Σ lengths rounded up to ``sequence_length_round``; its varlen kernel computes each sample's own
attention only, as NeMo-RL packs); sdpa / eager / flex get rows as long as the longest sample (rounded), the
samples bin-packed into them: those kernels mask the cross-sample scores but still compute them, R² a row,
so a row longer than the padded forward's would cost more attention than the padding it saves. No attention
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

from dataclasses import dataclass

from grpo.packing import pack_bins, packed_layout, round_up, unpack
from grpo.system.vision import is_vision_config

# attn_implementation values whose mask transformers builds from packed position ids (see the docstring)
PACKABLE_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


@dataclass(frozen=True)
class Packing:
    """How a forward packs: rows padded to a multiple of ``sequence_length_round``; ``always``: packed even where the
    padded rows or shared prompts run fewer slots (`grpo.system.training.logprob_forward` picks the cheapest otherwise)."""

    sequence_length_round: int = 1
    always: bool = False


def attention_implementation(module: torch.nn.Module) -> str:
    """The model's attention implementation (its config's ``_attn_implementation``; peft wrappers too)."""
    config = getattr(module, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    return str(impl) if impl is not None else "unknown"


def unpackable_reason(module: torch.nn.Module) -> str | None:
    """Why packed rows would let ``module``'s samples see each other (its attention implementation does not build
    the mask from packed position ids, or it is a vision-language model, whose images packed rows do not carry yet),
    or None when it can run packed."""
    if is_vision_config(getattr(module, "config", None)):
        return f"{type(module).__name__} is a vision-language model, whose images packed rows do not carry yet"
    impl = attention_implementation(module)
    if impl in PACKABLE_ATTENTION:
        return None
    return (f"the model's attention implementation {impl!r} ({type(module).__name__}) does not build its mask from "
            "packed position ids")


def check_packable(module: torch.nn.Module) -> None:
    """ValueError naming the attention implementation when packed rows would let samples see each other."""
    reason = unpackable_reason(module)
    if reason is not None and is_vision_config(getattr(module, "config", None)):
        raise ValueError(f"policy.sequence_packing.enabled: {reason}; use policy.dynamic_batching instead")
    if reason is not None:
        raise ValueError(
            f"policy.sequence_packing.enabled: {reason}, so samples packed in one row would attend to each other; "
            f"packing supports {list(PACKABLE_ATTENTION)}. Use policy.dynamic_batching instead (any attention), or a "
            "model with one of those")


def settle_packing(policy_cfg, module: torch.nn.Module) -> str | None:
    """Whether ``module`` runs packed under ``policy_cfg`` (a `grpo.config.PolicyConfig`, changed in place): where
    ``policy.sequence_packing.enabled`` was asked for, a model that cannot is a ValueError (`check_packable`);
    where packing is on by default, it gives way: turned off, and the reason returned (said at startup). None
    when nothing changed."""
    if not policy_cfg.sequence_packing.enabled:
        return None
    if "enabled" in policy_cfg.sequence_packing.model_fields_set:
        check_packable(module)
        return None
    reason = unpackable_reason(module)
    if reason is not None:
        policy_cfg.sequence_packing.enabled = False
    return reason


def packed_rows(lengths: list[int], attention: str, sequence_length_round: int = 1,
                algorithm: str = "first_fit_decreasing") -> tuple[list[list[int]], int]:
    """(the samples of each packed row, the row length) for samples of ``lengths`` under ``attention``: one row of
    them all for flash attention, else rows of the longest sample's length packed by ``algorithm``; the row length
    rounded up to ``sequence_length_round``.

        >>> packed_rows([5, 2, 3, 1], "flash_attention_2", 4)
        ([[0, 1, 2, 3]], 12)
        >>> packed_rows([5, 2, 3, 1], "sdpa")
        ([[0], [2, 1], [3]], 5)
    """
    if attention.startswith("flash_attention"):
        return [list(range(len(lengths)))], round_up(max(sum(lengths), 1), sequence_length_round)
    row_len = round_up(max(lengths, default=1), sequence_length_round)
    return pack_bins(lengths, row_len, algorithm), row_len


def packed_row_tokens(lengths: list[int], attention: str, sequence_length_round: int = 1) -> int:
    """Slots the packed rows of samples of ``lengths`` take (K x R of `packed_rows`): what a packed forward costs.

        >>> packed_row_tokens([5, 2, 3, 1], "sdpa"), packed_row_tokens([5, 2, 3, 1], "flash_attention_2", 4)
        (15, 12)
    """
    rows, row_len = packed_rows(lengths, attention, sequence_length_round)
    return len(rows) * row_len


def packed_forward(model, attention: str, ids_bt: torch.Tensor, mask_bt: torch.Tensor, sequence_length_round: int = 1,
                   algorithm: str = "first_fit_decreasing"):
    """The logits of right-padded rows ``ids_bt`` from packed rows (`packed_rows`):
    ``(logits_krv, ids_kr, source_kr)``.

    ``source_kr`` maps packed slots back to the ``[B, T]`` layout (`grpo.packing.packed_layout`); the logits at slot
    r of a row score the token at r + 1 only inside a sample (the contract's shift is the caller's, and position 0
    of each sample must then be dropped: `unpack_aligned`)."""
    B, T = ids_bt.shape
    lengths_b = mask_bt.sum(dim=1).long().cpu()
    rows, row_len = packed_rows(lengths_b.tolist(), attention, sequence_length_round, algorithm)
    source_kr, positions_kr = packed_layout(lengths_b, rows, row_len, seq_len=T)
    device = ids_bt.device
    ids_kr = torch.where(source_kr.to(device) >= 0, ids_bt.reshape(-1)[source_kr.clamp(min=0).to(device)], 0)
    logits = model(input_ids=ids_kr, position_ids=positions_kr.to(device), attention_mask=None,
                   use_cache=False).logits
    return logits, ids_kr, source_kr


def unpack_aligned(values_kr: torch.Tensor, source_kr: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    """Contract-aligned per-token values of packed rows (computed with the contract's shift along each row) back to
    ``[B, T, ...]``: 0 at each sample's position 0 (its packed value scored it with the previous sample's last
    logits, or is a row start) and on padding."""
    out = unpack_rows(values_kr, source_kr, mask_bt)
    keep_bt = mask_bt > 0
    keep_bt[:, 0] = False
    return torch.where(keep_bt.reshape(*keep_bt.shape, *([1] * (out.dim() - 2))), out, 0.0)


def unpack_rows(values_kr: torch.Tensor, source_kr: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    """Per-slot values ``[K, R, ...]`` of packed rows back to ``[B, T, ...]`` (`grpo.packing.unpack`)."""
    return unpack(values_kr.reshape(-1, *values_kr.shape[2:]), source_kr.reshape(-1), tuple(mask_bt.shape))
