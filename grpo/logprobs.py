"""Token logprobs from logits with bounded memory (temperature, top-k / top-p), logprob-error metrics and masking.

Alignment contract: per-token tensors are ``[B, T]`` and position t holds log p(token_t | tokens_<t).
:func:`token_logprobs` itself does no shifting (``logits[b, t]`` scores ``tokens[b, t]``);
:func:`aligned_logprobs_from_logits` applies the contract's shift to a causal LM's output.
"""

from __future__ import annotations

from typing import Optional

import torch


DEFAULT_CHUNK_ELEMENTS = 1 << 24  # rows per chunk = max(1, this // V): 64 MiB of fp32 working memory


def filter_keep_mask(x_bv: torch.Tensor, top_k: int | None = None, top_p: float = 1.0) -> torch.Tensor:
    """The top-k / top-p keep mask (True = kept) of already temperature-scaled logits ``x [..., V]``.

    THE definition of the filter, shared by the sampler (`grpo.system.generation.sampling.filter_logits`)
    and the trainer's logprobs (`token_logprobs`): top-k keeps x_v >= the k-th largest x (ties kept);
    top-p then keeps the smallest set of most likely tokens whose softmax mass (over the top-k
    survivors) reaches top_p: sorted ascending, a token is removed when the cumulative mass up to and
    including it is <= 1 - top_p (the most likely token always stays). Same rules as transformers'
    TopK/TopP warpers; same operations, sort included, as vLLM's ``apply_top_k_top_p`` (CPU / PyTorch
    path) and NeMo-RL's training-side filter, so that equal logits split by the top-p cut are split
    alike (the warpers sort after top-k and may split such ties differently).
    ``top_k`` None (or >= V) and ``top_p`` 1 turn a filter off.

        >>> filter_keep_mask(torch.tensor([[0.0, 1.0, 1.0, 2.0]]), top_k=2)   # ties at the k-th value stay
        tensor([[False,  True,  True,  True]])
        >>> filter_keep_mask(torch.tensor([[0.0, 0.0, 3.0]]), top_p=0.9)      # softmax [.045, .045, .91]
        tensor([[False, False,  True]])
    """
    vocab = x_bv.shape[-1]
    use_top_k = top_k is not None and top_k < vocab
    if top_p >= 1.0:
        if not use_top_k:
            return torch.ones_like(x_bv, dtype=torch.bool)
        return x_bv >= torch.topk(x_bv, top_k, dim=-1).values[..., -1:]
    # vLLM's order of operations: sort the raw logits once, top-k and top-p on the sorted values (so
    # tied logits split by the top-p cut are split the way vLLM splits them).
    sorted_bv, order_bv = torch.sort(x_bv, dim=-1)
    keep_sorted_bv = torch.ones_like(sorted_bv, dtype=torch.bool)
    if use_top_k:
        keep_sorted_bv = sorted_bv >= sorted_bv[..., vocab - top_k: vocab - top_k + 1]
        sorted_bv = sorted_bv.masked_fill(~keep_sorted_bv, float("-inf"))
    cum_bv = sorted_bv.softmax(dim=-1).cumsum(dim=-1)
    # 1 - top_p in float32 as vLLM computes it (its top_p is a float32 tensor): equal probabilities
    # often sum to exactly the cut, and a python-float cut would decide those tokens differently.
    keep_sorted_bv &= cum_bv > 1.0 - torch.tensor(top_p, dtype=torch.float32, device=x_bv.device)
    keep_sorted_bv[..., -1] = True
    return keep_sorted_bv.scatter(-1, order_bv, keep_sorted_bv)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half / bf16 / fp32 logits, fp64 for fp64 (so gradcheck can run)."""
    return torch.promote_types(dtype, torch.float32)


def needs_filter(top_k: Optional[int], top_p: float) -> bool:
    """True when top-k (``top_k`` not None) or top-p (``top_p < 1``) filtering is on.

        >>> needs_filter(None, 1.0), needs_filter(20, 1.0), needs_filter(None, 0.9)
        (False, True, True)
    """
    return top_k is not None or top_p < 1.0


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """Filtered and unfiltered token logprobs, row chunk by row chunk, with x = logits / τ:

        full[n] = x[n, tok_n] − logsumexp_v x[n, v]
        lp[n]   = x[n, tok_n] − logsumexp_{v ∈ K_n} x[n, v]   if tok_n ∈ K_n, else −inf

    K_n = `filter_keep_mask` (top-k / top-p) of row n; without a filter
    K_n is the whole vocabulary and lp = full. K_n is a constant of the forward (as in NeMo-RL's
    ``_ApplyTopKTopP``): gradients flow through the kept logits only,

        ∂full[n]/∂x[n, v] = (1[v = tok_n] − softmax(x[n])_v) / τ
        ∂lp[n]/∂x[n, v]   = (1[v = tok_n] − softmax_K(x[n])_v) / τ   (softmax_K = 0 outside K_n;
                                                                      0 everywhere when tok_n ∉ K_n)

    Saves only the (already existing) logits, the tokens and two logsumexps per row; the backward
    recomputes the chunk's softmax (and its filter, deterministically: same input, same ops) and writes
    the gradient straight into one gradient buffer, so the working memory is one chunk, not [N, V].
    """

    @staticmethod
    def forward(ctx, logits_nv, tokens_n, temperature: float, chunk_rows: int, top_k: Optional[int], top_p: float):
        cdtype = _compute_dtype(logits_nv.dtype)
        filtering = needs_filter(top_k, top_p)
        num_rows = logits_nv.shape[0]
        lp_n = torch.empty(num_rows, dtype=cdtype, device=logits_nv.device)
        full_n = torch.empty(num_rows, dtype=cdtype, device=logits_nv.device)
        lse_n = torch.empty(num_rows, dtype=cdtype, device=logits_nv.device)
        lse_full_n = torch.empty(num_rows, dtype=cdtype, device=logits_nv.device)
        for start in range(0, num_rows, chunk_rows):
            stop = min(start + chunk_rows, num_rows)
            x = logits_nv[start:stop].to(cdtype) / temperature
            tok = tokens_n[start:stop, None]
            x_tok = x.gather(-1, tok).squeeze(-1)
            lse_full = torch.logsumexp(x, dim=-1)
            lse_full_n[start:stop] = lse_full
            full_n[start:stop] = x_tok - lse_full
            if filtering:
                keep = filter_keep_mask(x, top_k, top_p)
                kept_tok = keep.gather(-1, tok).squeeze(-1)
                lse = torch.logsumexp(x.masked_fill_(~keep, float("-inf")), dim=-1)
                lse_n[start:stop] = lse
                lp_n[start:stop] = torch.where(kept_tok, x_tok - lse, float("-inf"))
                del keep
            else:
                lse_n[start:stop] = lse_full
                lp_n[start:stop] = x_tok - lse_full
            del x
        ctx.save_for_backward(logits_nv, tokens_n, lse_n, lse_full_n)
        ctx.temperature, ctx.chunk_rows, ctx.top_k, ctx.top_p = temperature, chunk_rows, top_k, top_p
        ctx.set_materialize_grads(False)
        return lp_n, full_n

    @staticmethod
    def backward(ctx, grad_lp_n, grad_full_n):
        logits_nv, tokens_n, lse_n, lse_full_n = ctx.saved_tensors
        temperature, chunk_rows, top_k, top_p = ctx.temperature, ctx.chunk_rows, ctx.top_k, ctx.top_p
        filtering = needs_filter(top_k, top_p)
        cdtype = lse_n.dtype
        if not filtering and grad_lp_n is not None and grad_full_n is not None:  # the same function twice
            grad_lp_n, grad_full_n = grad_lp_n + grad_full_n, None
        grad_nv = torch.empty_like(logits_nv)
        for start in range(0, logits_nv.shape[0], chunk_rows):
            stop = min(start + chunk_rows, logits_nv.shape[0])
            x = logits_nv[start:stop].to(cdtype) / temperature
            tok = tokens_n[start:stop, None]
            chunk = torch.zeros_like(x)
            if grad_full_n is not None:
                g = grad_full_n[start:stop, None].to(cdtype)
                chunk.sub_(torch.exp(x - lse_full_n[start:stop, None]).mul_(g))
                chunk.scatter_add_(-1, tok, g)
            if grad_lp_n is not None:
                g = grad_lp_n[start:stop, None].to(cdtype)
                if filtering:
                    keep = filter_keep_mask(x, top_k, top_p)
                    g = torch.where(keep.gather(-1, tok), g, 0.0)  # a removed token's −inf is flat
                    x = x.masked_fill_(~keep, float("-inf"))
                    del keep
                chunk.sub_(torch.exp(x - lse_n[start:stop, None]).mul_(g))
                chunk.scatter_add_(-1, tok, g)
            grad_nv[start:stop] = chunk.div_(temperature)
            del x, chunk
        return grad_nv, None, None, None, None, None


def token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
    *,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    return_unfiltered: bool = False,
):
    """Logprobs of ``tokens`` under the sampling distribution: ``[..., V]`` x ``[...]`` -> ``[...]``.

        x = logits / temperature,   K = top-k / top-p keep set of x (`filter_keep_mask`, the sampler's filter)
        lp[b, t] = x[b, t, tok] − logsumexp_{v ∈ K} x[b, t, v]      (−inf when tok ∉ K)

    Without a filter (``top_k=None``, ``top_p=1``: the defaults) K is the whole vocabulary: plain
    log_softmax(logits / temperature). These are the logprobs the generation backends report
    (vLLM's ``processed_logprobs``, `grpo.system.generation.sampling.processed_logprobs`), so importance
    weights and token_mult_prob_error compare like with like. ``return_unfiltered=True`` returns
    ``(lp, full)`` with full = log_softmax(x)[tok] (temperature only) from the same pass.

    No second ``[B, T, V]`` tensor is made: rows (B·T of them) go ``chunk_size`` at a time, in
    forward and backward (default: 2^24 / V rows, a quarter of that with top-p, whose sort needs more
    working memory). Differentiable (the filter is a constant: gradients flow through the kept logits
    only); returns fp32 (fp64 for fp64 logits). Pass contiguous logits: a non-contiguous ``[..., V]``
    view is copied once to flatten it.

        >>> token_logprobs(torch.zeros(1, 2, 4), torch.tensor([[0, 3]]))   # uniform over 4: log(1/4)
        tensor([[-1.3863, -1.3863]])
        >>> token_logprobs(torch.tensor([[0.0, 1.0, 1.0]]), torch.tensor([1]), top_k=2)  # 1/2 of the mass
        tensor([-0.6931])
    """
    if temperature <= 0:
        raise ValueError(f"token_logprobs: temperature={temperature}: expected > 0")
    if top_k is not None and top_k < 1:
        raise ValueError(f"token_logprobs: top_k={top_k}: expected None (off) or >= 1")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"token_logprobs: top_p={top_p}: expected 0 < top_p <= 1 (1: off)")
    vocab = logits.shape[-1]
    lead_shape = logits.shape[:-1]
    if tokens.shape != lead_shape:
        raise ValueError(f"token_logprobs: tokens {tuple(tokens.shape)} must match logits {tuple(logits.shape)}[:-1]")
    if chunk_size is not None:
        rows = chunk_size
    else:
        rows = max(1, DEFAULT_CHUNK_ELEMENTS // vocab // (4 if top_p < 1.0 else 1))
    lp, full = _ChunkedTokenLogprobs.apply(
        logits.reshape(-1, vocab), tokens.reshape(-1).long(), float(temperature), int(rows),
        None if top_k is None else int(top_k), float(top_p),
    )
    if return_unfiltered:
        return lp.reshape(lead_shape), full.reshape(lead_shape)
    return lp.reshape(lead_shape)


def aligned_logprobs_from_logits(
    logits_btv: torch.Tensor,
    input_ids_bt: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
    *,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    return_unfiltered: bool = False,
):
    """Contract-aligned logprobs ``[B, T]`` from a causal LM's logits ``[B, T, V]``.

        out[:, 0] = 0,   out[:, t] = log p(input_ids[t] | input_ids[<t])
                                   = token_logprobs(logits[:, t−1], input_ids[t])

    with the temperature and the top-k / top-p filter of :func:`token_logprobs` (−inf where the
    token is outside the filter; ``return_unfiltered=True``: ``(filtered, temperature only)``).
    The logits are not sliced (that would copy them in backward): the last position scores a dummy
    token and is dropped.
    """
    next_ids = torch.cat([input_ids_bt[:, 1:], torch.zeros_like(input_ids_bt[:, :1])], dim=1)
    lp, full = token_logprobs(logits_btv, next_ids, temperature, chunk_size, top_k=top_k, top_p=top_p,
                              return_unfiltered=True)

    def shift(x):
        return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)

    return (shift(lp), shift(full)) if return_unfiltered else shift(lp)


def mask_out_of_filter(logprobs_bt: torch.Tensor, mask_bt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NeMo-RL's ``mask_out_neg_inf_logprobs``: 0 where ``mask_bt`` is 0 or the logprob is −inf.

    A token the sampler kept can fall outside the trainer's top-k / top-p set (logits differ by float
    rounding between engines); its −inf would make the loss NaN. Returns (logprobs, number of positions
    in the mask whose logprob was −inf, a 0-dim tensor: no device sync). The gradient is 0 at the
    replaced positions.

        >>> mask_out_of_filter(torch.tensor([[-1.0, float("-inf"), float("-inf")]]), torch.tensor([[1, 1, 0]]))
        (tensor([[-1.,  0.,  0.]]), tensor(1))
    """
    keep_bt = mask_bt > 0
    finite_bt = torch.isfinite(logprobs_bt)
    return torch.where(keep_bt & finite_bt, logprobs_bt, 0.0), (keep_bt & ~finite_bt).sum()


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


def _min_mean_max(values: torch.Tensor, suffix: str = "") -> dict:
    """``{min,mean,max}_seq_mult_prob_error<suffix>`` of ``values`` (NeMo-RL's names; 0 for none)."""
    stats = (values.min().item(), values.mean().item(), values.max().item()) if values.numel() else (0.0,) * 3
    return {f"{stat}_seq_mult_prob_error{suffix}": v for stat, v in zip(("min", "mean", "max"), stats)}


def skipped_seq_logprob_error_metrics() -> dict:
    """The sequence logprob-error metrics of a step whose previous-policy logprobs were not computed (the pass is
    skipped): every one 0, as NeMo-RL's ``_placeholder_seq_logprob_error_metrics`` (nemo_rl/algorithms/grpo.py
    at 7ea279a), so a dashboard's series has a point at every step. 0 is not a value the error takes (it is >= 1).

        >>> skipped_seq_logprob_error_metrics()["max_seq_mult_prob_error_after_mask"]
        0.0
    """
    none = torch.empty(0)
    return {"num_masked_seqs_by_logprob_error": 0, "masked_correct_pct": 0.0,
            **_min_mean_max(none), **_min_mean_max(none, "_after_mask")}


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

    As NeMo-RL's ``compute_and_apply_seq_logprob_error_masking`` (nemo_rl/algorithms/grpo.py:2513-2631 at 7ea279a).
    ``e_b`` uses the mask m = token_mask · sample_mask, as the loss's token_mult_prob_error does. Metrics, in
    NeMo-RL's names: num_masked_seqs_by_logprob_error; masked_correct_pct: the fraction (0-1) of the masked
    sequences whose reward is exactly 1; {min,mean,max}_seq_mult_prob_error over the sequences with a token in m,
    and {min,mean,max}_seq_mult_prob_error_after_mask over those of them that are kept (0 when there are none;
    without a threshold, the same as before).
    """
    keep_before = sample_mask > 0
    err_b = seq_logprob_error(generation_logprobs, prev_logprobs, token_mask * sample_mask[:, None])
    has_tokens = (token_mask * sample_mask[:, None]).sum(-1) > 0  # a sequence with no token has no error
    if threshold is None:
        keep_after = keep_before
    else:
        keep_after = keep_before & (err_b <= threshold)
    masked = keep_before & ~keep_after
    num_masked = int(masked.sum().item())
    correct = int((masked & (rewards == 1)).sum().item())
    metrics = {
        "num_masked_seqs_by_logprob_error": num_masked,
        "masked_correct_pct": correct / num_masked if num_masked else 0.0,
        **_min_mean_max(err_b[has_tokens]),
        **_min_mean_max(err_b[keep_after & has_tokens], "_after_mask"),
    }
    return sample_mask * keep_after.to(sample_mask.dtype), metrics


# --------------------------------------------------------------------------------------------------
# Entropy of the policy's distribution (for loss terms that ask for it: `grpo.loss.LossInputs`)
# --------------------------------------------------------------------------------------------------
class _ChunkedEntropy(torch.autograd.Function):
    """H[n] = −Σ_v p[n, v] log p[n, v],  p = softmax(logits[n] / τ), row chunk by row chunk.

        ∂H[n]/∂logits[n, v] = −p_v (log p_v + H[n]) / τ

    Saves the (already existing) logits and two numbers per row; the backward recomputes the chunk's
    softmax, so the working memory is one chunk, not [N, V] (as `_ChunkedTokenLogprobs`)."""

    @staticmethod
    def forward(ctx, logits_nv, temperature: float, chunk_rows: int):
        cdtype = _compute_dtype(logits_nv.dtype)
        num_rows = logits_nv.shape[0]
        h_n = torch.empty(num_rows, dtype=cdtype, device=logits_nv.device)
        lse_n = torch.empty(num_rows, dtype=cdtype, device=logits_nv.device)
        for start in range(0, num_rows, chunk_rows):
            stop = min(start + chunk_rows, num_rows)
            x = logits_nv[start:stop].to(cdtype) / temperature
            lse = torch.logsumexp(x, dim=-1, keepdim=True)
            logp = x.sub_(lse)
            p = torch.exp(logp)
            h_n[start:stop] = -torch.where(p > 0, p * logp, 0.0).sum(-1)  # 0·log 0 = 0 (masked-out logits)
            lse_n[start:stop] = lse.squeeze(-1)
            del x, logp, p
        ctx.save_for_backward(logits_nv, lse_n, h_n)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        return h_n

    @staticmethod
    def backward(ctx, grad_h_n):
        logits_nv, lse_n, h_n = ctx.saved_tensors
        temperature, chunk_rows = ctx.temperature, ctx.chunk_rows
        grad_nv = torch.empty_like(logits_nv)
        for start in range(0, logits_nv.shape[0], chunk_rows):
            stop = min(start + chunk_rows, logits_nv.shape[0])
            logp = logits_nv[start:stop].to(lse_n.dtype) / temperature - lse_n[start:stop, None]
            p = torch.exp(logp)
            chunk = torch.where(p > 0, p * (logp + h_n[start:stop, None]), 0.0)
            grad_nv[start:stop] = chunk.mul_(-grad_h_n[start:stop, None].to(chunk.dtype) / temperature)
            del logp, p, chunk
        return grad_nv, None, None


def token_entropy(logits: torch.Tensor, temperature: float = 1.0, chunk_size: Optional[int] = None) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per row: ``[..., V]`` -> ``[...]``, differentiable, without a
    second ``[..., V]`` tensor (``chunk_size`` rows at a time; default as `token_logprobs`). fp32 (fp64 for
    fp64 logits).

        >>> token_entropy(torch.zeros(1, 4))     # uniform over 4: log 4
        tensor([1.3863])
    """
    if temperature <= 0:
        raise ValueError(f"token_entropy: temperature={temperature}: expected > 0")
    vocab = logits.shape[-1]
    rows = chunk_size if chunk_size is not None else max(1, DEFAULT_CHUNK_ELEMENTS // vocab)
    return _ChunkedEntropy.apply(logits.reshape(-1, vocab), float(temperature), int(rows)).reshape(logits.shape[:-1])


def aligned_entropy_from_logits(logits_btv: torch.Tensor, attention_mask_bt: torch.Tensor, temperature: float = 1.0,
                                chunk_size: Optional[int] = None) -> torch.Tensor:
    """Per-token entropy ``[B, T]`` aligned like the logprobs: position t holds the entropy of the distribution
    token t was drawn from (`token_entropy` of ``logits[:, t − 1] / temperature``); 0 at position 0 and
    where ``attention_mask_bt`` is 0 (the last position's logits score nothing and are dropped)."""
    h_bt = token_entropy(logits_btv, temperature, chunk_size)
    h_bt = torch.cat([torch.zeros_like(h_bt[:, :1]), h_bt[:, :-1]], dim=1)
    return torch.where(attention_mask_bt > 0, h_bt, 0.0)
