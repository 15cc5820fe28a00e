"""Token logprobs from logits with bounded memory, logprob-error metrics and masking, teacher logprobs.

Alignment contract: per-token tensors are ``[B, T]`` and position t holds log p(token_t | tokens_<t).
:func:`token_logprobs` itself does no shifting (``logits[b, t]`` scores ``tokens[b, t]``);
:func:`aligned_logprobs_from_logits` applies the contract's shift to a causal LM's output.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

DEFAULT_CHUNK_ELEMENTS = 1 << 24  # rows per chunk = max(1, this // V): 64 MiB of fp32 working memory


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half / bf16 / fp32 logits, fp64 for fp64 (so gradcheck can run)."""
    return torch.promote_types(dtype, torch.float32)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """lp[n] = x[n, tok_n]/τ − logsumexp(x[n]/τ), row chunk by row chunk.

    Saves only the (already existing) logits, the tokens and the per-row logsumexp; the backward
    recomputes softmax one chunk at a time and writes the gradient
        ∂lp[n]/∂x[n, v] = (1[v = tok_n] − softmax(x[n]/τ)_v) / τ
    straight into the gradient buffer, so the working memory is one chunk, not [N, V].
    """

    @staticmethod
    def forward(ctx, logits_nv, tokens_n, temperature: float, chunk_rows: int):
        cdtype = _compute_dtype(logits_nv.dtype)
        num_rows = logits_nv.shape[0]
        out_n = torch.empty(num_rows, dtype=cdtype, device=logits_nv.device)
        lse_n = torch.empty(num_rows, dtype=cdtype, device=logits_nv.device)
        for start in range(0, num_rows, chunk_rows):
            stop = min(start + chunk_rows, num_rows)
            x = logits_nv[start:stop].to(cdtype) / temperature
            lse = torch.logsumexp(x, dim=-1)
            lse_n[start:stop] = lse
            out_n[start:stop] = x.gather(-1, tokens_n[start:stop, None]).squeeze(-1) - lse
            del x
        ctx.save_for_backward(logits_nv, tokens_n, lse_n)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        return out_n

    @staticmethod
    def backward(ctx, grad_n):
        logits_nv, tokens_n, lse_n = ctx.saved_tensors
        temperature, chunk_rows = ctx.temperature, ctx.chunk_rows
        cdtype = lse_n.dtype
        grad_nv = torch.empty_like(logits_nv)
        grad_n = grad_n.to(cdtype)
        for start in range(0, logits_nv.shape[0], chunk_rows):
            stop = min(start + chunk_rows, logits_nv.shape[0])
            g = grad_n[start:stop, None]
            probs = torch.exp(logits_nv[start:stop].to(cdtype) / temperature - lse_n[start:stop, None])
            chunk = probs.mul_(-g)
            chunk.scatter_add_(-1, tokens_n[start:stop, None], g)
            grad_nv[start:stop] = chunk.div_(temperature)
            del probs, chunk
        return grad_nv, None, None, None


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, chunk_size: Optional[int] = None
) -> torch.Tensor:
    """log_softmax(logits / temperature) gathered at ``tokens``: ``[..., V]`` x ``[...]`` -> ``[...]``.

        lp[b, t] = logits[b, t, tok]/τ − logsumexp_v(logits[b, t, v]/τ)

    No second ``[B, T, V]`` tensor is made: rows (B·T of them) go ``chunk_size`` at a time, in
    forward and backward (default: 2^24 / V rows). Differentiable; returns fp32 (fp64 for fp64
    logits). Pass contiguous logits: a non-contiguous ``[..., V]`` view is copied once to flatten it.

        >>> token_logprobs(torch.zeros(1, 2, 4), torch.tensor([[0, 3]]))   # uniform over 4: log(1/4)
        tensor([[-1.3863, -1.3863]])
    """
    if temperature <= 0:
        raise ValueError(f"token_logprobs: temperature={temperature}: expected > 0")
    vocab = logits.shape[-1]
    lead_shape = logits.shape[:-1]
    if tokens.shape != lead_shape:
        raise ValueError(f"token_logprobs: tokens {tuple(tokens.shape)} must match logits {tuple(logits.shape)}[:-1]")
    rows = chunk_size if chunk_size is not None else max(1, DEFAULT_CHUNK_ELEMENTS // vocab)
    flat = _ChunkedTokenLogprobs.apply(
        logits.reshape(-1, vocab), tokens.reshape(-1).long(), float(temperature), int(rows)
    )
    return flat.reshape(lead_shape)


def aligned_logprobs_from_logits(
    logits_btv: torch.Tensor, input_ids_bt: torch.Tensor, temperature: float = 1.0, chunk_size: Optional[int] = None
) -> torch.Tensor:
    """Contract-aligned logprobs ``[B, T]`` from a causal LM's logits ``[B, T, V]``.

        out[:, 0] = 0,   out[:, t] = log p(input_ids[t] | input_ids[<t]) = log_softmax(logits[:, t−1]/τ)[input_ids[t]]

    The logits are not sliced (that would copy them in backward): the last position scores a
    dummy token and is dropped.
    """
    next_ids = torch.cat([input_ids_bt[:, 1:], torch.zeros_like(input_ids_bt[:, :1])], dim=1)
    lp = token_logprobs(logits_btv, next_ids, temperature, chunk_size)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp[:, :-1]], dim=1)


# --------------------------------------------------------------------------------------------------
# Generation-vs-training logprob error
# --------------------------------------------------------------------------------------------------
def seq_logprob_error(
    generation_logprobs: torch.Tensor, prev_logprobs: torch.Tensor, token_mask: torch.Tensor
) -> torch.Tensor:
    """Per-sequence multiplicative probability error ``[B]`` (1 = the engines agree; 0 for an empty mask).

        e_b = Σ_t m_bt · exp(|gen_bt − prev_bt|) / Σ_t m_bt
    """
    mask = token_mask.to(prev_logprobs.dtype)
    err = torch.where(mask > 0, torch.exp((generation_logprobs - prev_logprobs).abs()), 0.0)
    return (err * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def _min_mean_max(values: torch.Tensor, prefix: str) -> dict:
    if values.numel() == 0:
        return {f"{prefix}_min": 0.0, f"{prefix}_mean": 0.0, f"{prefix}_max": 0.0}
    return {f"{prefix}_min": values.min().item(), f"{prefix}_mean": values.mean().item(),
            f"{prefix}_max": values.max().item()}


def mask_by_seq_logprob_error(
    generation_logprobs: torch.Tensor,
    prev_logprobs: torch.Tensor,
    token_mask: torch.Tensor,
    sample_mask: torch.Tensor,
    rewards: torch.Tensor,
    threshold: Optional[float],
) -> tuple[torch.Tensor, dict]:
    """Drop (sample_mask = 0) the sequences whose ``seq_logprob_error`` exceeds ``threshold``.

        new_sample_mask_b = sample_mask_b · 1[e_b ≤ threshold]        (threshold None: unchanged)

    ``e_b`` uses the mask token_mask · sample_mask, as the loss's token_mult_prob_error does.
    Metrics: num_masked_seqs; masked_correct_pct (100 · share of masked sequences with reward > 0);
    seq_logprob_error_{min,mean,max} over the samples in the mask before masking, and
    seq_logprob_error_after_{min,mean,max} over those kept (0 when there are none).
    """
    keep_before = sample_mask > 0
    err_b = seq_logprob_error(generation_logprobs, prev_logprobs, token_mask * sample_mask[:, None])
    if threshold is None:
        keep_after = keep_before
    else:
        keep_after = keep_before & (err_b <= threshold)
    masked = keep_before & ~keep_after
    num_masked = int(masked.sum().item())
    correct = int((masked & (rewards > 0)).sum().item())
    metrics = {
        "num_masked_seqs": num_masked,
        "masked_correct_pct": 100.0 * correct / num_masked if num_masked else 0.0,
        **_min_mean_max(err_b[keep_before], "seq_logprob_error"),
        **_min_mean_max(err_b[keep_after], "seq_logprob_error_after"),
    }
    return sample_mask * keep_after.to(sample_mask.dtype), metrics


# --------------------------------------------------------------------------------------------------
# On-policy distillation
# --------------------------------------------------------------------------------------------------
def pad_teacher_logprobs(
    teacher_logprobs_list: Sequence[Sequence[float] | torch.Tensor],
    T: int,
    pad_value: float = 0.0,
    starts: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """Ragged teacher logprobs -> ``[B, T]`` in the contract's alignment.

    ``teacher_logprobs_list[b][j]`` is the teacher's log p of the j-th completion token of sample b;
    it lands at position ``starts[b] + j`` (``starts[b]`` = position of the first completion token,
    i.e. the prompt length; default 0). Every other position holds ``pad_value``.

        >>> pad_teacher_logprobs([[-1.0, -2.0], [-3.0]], T=4, starts=[1, 2])
        tensor([[ 0., -1., -2.,  0.],
                [ 0.,  0., -3.,  0.]])
    """
    out = torch.full((len(teacher_logprobs_list), T), float(pad_value), dtype=torch.float32)
    for b, row in enumerate(teacher_logprobs_list):
        values = torch.as_tensor(row, dtype=torch.float32).reshape(-1)
        start = 0 if starts is None else int(starts[b])
        if start < 0 or start + values.numel() > T:
            raise ValueError(
                f"pad_teacher_logprobs: sample {b} has {values.numel()} teacher logprobs from position {start}, "
                f"which does not fit in T={T}"
            )
        out[b, start:start + values.numel()] = values
    return out
