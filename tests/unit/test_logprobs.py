"""grpo.logprobs: chunked token logprobs (values, gradients, saved memory), logprob errors, teacher padding."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo.logprobs import (
    aligned_logprobs_from_logits,
    mask_by_seq_logprob_error,
    seq_logprob_error,
    token_logprobs,
)


def naive(logits, tokens, temperature=1.0):
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


# ----------------------------------------------------------------------------------------------
# token_logprobs
# ----------------------------------------------------------------------------------------------
def test_token_logprobs_by_hand():
    logits = torch.tensor([[[0.0, LOG2, 0.0]]])  # softmax = [1/4, 2/4, 1/4]
    torch.testing.assert_close(token_logprobs(logits, torch.tensor([[1]])), torch.tensor([[math.log(0.5)]]))
    # temperature 2: logits/2 = [0, log2/2, 0] -> p(1) = sqrt2 / (2 + sqrt2)
    expected = math.log(math.sqrt(2) / (2 + math.sqrt(2)))
    torch.testing.assert_close(token_logprobs(logits, torch.tensor([[1]]), temperature=2.0), torch.tensor([[expected]]))


LOG2 = math.log(2.0)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 3), st.integers(1, 7), st.integers(2, 40),
    st.sampled_from([1.0, 0.7, 1.6]), st.one_of(st.none(), st.integers(1, 9)), st.integers(0, 10_000),
)
def test_token_logprobs_matches_log_softmax_values_and_gradients(B, T, V, temperature, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(B, T, V, generator=g)).requires_grad_(True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    upstream = torch.randn(B, T, generator=g)
    ours = token_logprobs(logits, tokens, temperature, chunk_size=chunk)
    (ours * upstream).sum().backward()
    grad_ours = logits.grad.clone()
    logits.grad = None
    ref = naive(logits, tokens, temperature)
    (ref * upstream).sum().backward()
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(grad_ours, logits.grad)


def test_token_logprobs_gradcheck_float64():
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 5, (2, 3))
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, tokens, 1.3, chunk_size=2), (logits,))


def test_token_logprobs_non_contiguous_and_bf16():
    logits = torch.randn(7, 2, 11)  # transpose -> [2, 7, 11] non-contiguous
    tokens = torch.randint(0, 11, (2, 7))
    view = logits.transpose(0, 1)
    torch.testing.assert_close(token_logprobs(view, tokens, chunk_size=3), naive(view, tokens))
    half = torch.randn(2, 4, 9, dtype=torch.bfloat16, requires_grad=True)
    toks = torch.randint(0, 9, (2, 4))
    out = token_logprobs(half, toks, chunk_size=3)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert half.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out, naive(half.detach(), toks))


def test_token_logprobs_saves_no_extra_vocab_sized_tensor():
    """Autograd keeps only the logits (already alive) plus per-row tensors, unlike log_softmax."""
    B, T, V = 2, 8, 1000
    logits = torch.randn(B, T, V, requires_grad=True)
    tokens = torch.randint(0, V, (B, T))

    def saved_bytes(fn):
        sizes = []

        def pack(x):
            if x.data_ptr() != logits.data_ptr():  # the logits themselves are not extra memory
                sizes.append(x.numel() * x.element_size())
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            fn()
        return sum(sizes)

    ours = saved_bytes(lambda: token_logprobs(logits, tokens, 0.9, chunk_size=4))
    reference = saved_bytes(lambda: naive(logits, tokens, 0.9))
    assert ours <= 4 * B * T * 8  # tokens (int64) + logsumexp per row
    assert reference >= B * T * V * 4  # log_softmax keeps a full [B, T, V] output


def test_token_logprobs_validates_inputs():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="must match"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long))


def test_aligned_logprobs_shift():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, requires_grad=True)
    ids = torch.randint(0, 7, (2, 5))
    out = aligned_logprobs_from_logits(logits, ids, temperature=1.0, chunk_size=3)
    assert torch.equal(out[:, 0], torch.zeros(2))
    for t in range(1, 5):
        torch.testing.assert_close(out[:, t], torch.log_softmax(logits[:, t - 1], -1).gather(-1, ids[:, t, None])[:, 0])
    out.sum().backward()
    assert torch.equal(logits.grad[:, -1], torch.zeros(2, 7))  # the last position scores nothing


# ----------------------------------------------------------------------------------------------
# seq_logprob_error and masking
# ----------------------------------------------------------------------------------------------
def test_seq_logprob_error_by_hand():
    gen = torch.tensor([[0.0, math.log(2.0), 5.0], [0.0, 0.0, 0.0]])
    prev = torch.tensor([[0.0, 0.0, 0.0], [math.log(3.0), 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    torch.testing.assert_close(seq_logprob_error(gen, prev, mask), torch.tensor([1.5, 3.0]))
    torch.testing.assert_close(seq_logprob_error(gen, prev, torch.zeros(2, 3)), torch.zeros(2))


def test_mask_by_seq_logprob_error_by_hand():
    # errors: [1.5, 3.0, 1.0, 4.0]; sample 3 already masked.
    gen = torch.tensor([[0.0, math.log(2.0)], [math.log(3.0), 0.0], [0.0, 0.0], [math.log(4.0), 0.0]])
    prev = torch.zeros(4, 2)
    tm = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    sm = torch.tensor([1.0, 1.0, 1.0, 0.0])
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0])
    new, m = mask_by_seq_logprob_error(gen, prev, tm, sm, rewards, threshold=2.0)
    torch.testing.assert_close(new, torch.tensor([1.0, 0.0, 1.0, 0.0]))
    assert m["num_masked_seqs_by_logprob_error"] == 1 and m["masked_correct_pct"] == 1.0  # a fraction, as NeMo-RL
    assert m["max_seq_mult_prob_error"] == pytest.approx(3.0) and m["min_seq_mult_prob_error"] == pytest.approx(1.0)
    assert m["mean_seq_mult_prob_error"] == pytest.approx(5.5 / 3)
    assert m["max_seq_mult_prob_error_after_mask"] == pytest.approx(1.5)
    assert m["mean_seq_mult_prob_error_after_mask"] == pytest.approx(1.25)
    same, m2 = mask_by_seq_logprob_error(gen, prev, tm, sm, rewards, threshold=None)
    torch.testing.assert_close(same, sm)
    assert m2["num_masked_seqs_by_logprob_error"] == 0 and m2["max_seq_mult_prob_error_after_mask"] == pytest.approx(3.0)
    _, m3 = mask_by_seq_logprob_error(gen, prev, tm, sm, torch.tensor([0.0, 0.0, 1.0, 1.0]), threshold=1.2)
    assert m3["num_masked_seqs_by_logprob_error"] == 2 and m3["masked_correct_pct"] == 0.0


# ----------------------------------------------------------------------------------------------
# Teacher logprobs
# ----------------------------------------------------------------------------------------------


def naive_filtered(logits, tokens, temperature, top_k, top_p):
    """Plain autograd: log_softmax of the sampler's own filtered logits (the filter is a constant mask)."""
    from grpo.logprobs import filter_keep_mask

    x = logits / temperature
    keep = filter_keep_mask(x.detach(), top_k, top_p)
    return torch.log_softmax(x.masked_fill(~keep, float("-inf")), dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 3), st.integers(1, 6), st.integers(2, 40), st.sampled_from([1.0, 0.7, 1.6]),
    st.one_of(st.none(), st.integers(1, 12)), st.sampled_from([1.0, 0.95, 0.9, 0.5]),
    st.one_of(st.none(), st.integers(1, 9)), st.integers(0, 10_000),
)
def test_filtered_token_logprobs_match_autograd_values_and_gradients(B, T, V, temperature, top_k, top_p, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(B, T, V, generator=g)).requires_grad_(True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    up_lp, up_full = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)

    def loss(lp, full):  # a removed token's -inf contributes nothing (as the engines mask it)
        return (torch.where(torch.isfinite(lp), lp, 0.0) * up_lp).sum() + (full * up_full).sum()

    lp, full = token_logprobs(logits, tokens, temperature, chunk_size=chunk, top_k=top_k, top_p=top_p,
                              return_unfiltered=True)
    loss(lp, full).backward()
    grad_ours = logits.grad.clone()
    logits.grad = None
    ref_lp, ref_full = naive_filtered(logits, tokens, temperature, top_k, top_p), naive(logits, tokens, temperature)
    loss(ref_lp, ref_full).backward()
    assert torch.equal(torch.isinf(lp), torch.isinf(ref_lp))
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(full, ref_full)
    torch.testing.assert_close(grad_ours, logits.grad)
    # the filtered value alone, and no filter = the plain path
    torch.testing.assert_close(token_logprobs(logits, tokens, temperature, chunk, top_k=top_k, top_p=top_p), lp)
    if top_k is None and top_p == 1.0:
        torch.testing.assert_close(lp, full)


def test_filtered_token_logprobs_gradcheck_float64():
    g = torch.Generator().manual_seed(3)
    logits = (2 * torch.randn(3, 4, 9, dtype=torch.float64, generator=g)).requires_grad_(True)
    x = logits.detach() / 0.7
    from grpo.logprobs import filter_keep_mask

    keep = filter_keep_mask(x, 5, 0.8)
    tokens = torch.multinomial(keep.reshape(-1, 9).double(), 1, generator=g).reshape(3, 4)  # kept tokens only
    assert 1 < int(keep[0, 0].sum()) < 9  # the filter bites

    def both(z):
        lp, full = token_logprobs(z, tokens, 0.7, chunk_size=5, top_k=5, top_p=0.8, return_unfiltered=True)
        return lp, full

    assert torch.autograd.gradcheck(both, (logits,))
    assert torch.autograd.gradcheck(lambda z: token_logprobs(z, tokens, 0.7, chunk_size=2, top_k=5, top_p=0.8),
                                    (logits,))


def test_filtered_logprobs_by_hand_and_ties():
    # x = [0, 1, 1, 2]: top_k=2 keeps the tie at the 2nd value: K = {1, 2, 3}
    logits = torch.tensor([[0.0, 1.0, 1.0, 2.0]] * 2)
    lse = math.log(2 * math.e + math.e ** 2)
    got = token_logprobs(logits, torch.tensor([0, 3]), top_k=2)
    assert got[0] == float("-inf")
    torch.testing.assert_close(got[1], torch.tensor(2.0 - lse))
    # top-p 0.5 on softmax [.0871, .2369, .2369, .6439]: only the last token (cum .3561 <= .5 removed)
    torch.testing.assert_close(token_logprobs(logits[:1], torch.tensor([3]), top_p=0.5), torch.tensor([0.0]))
    with pytest.raises(ValueError, match="top_k"):
        token_logprobs(logits, torch.tensor([0, 3]), top_k=0)
    with pytest.raises(ValueError, match="top_p"):
        token_logprobs(logits, torch.tensor([0, 3]), top_p=1.5)


def test_filtered_token_logprobs_save_no_extra_vocab_sized_tensor():
    B, T, V = 2, 8, 1000
    logits = torch.randn(B, T, V, requires_grad=True)
    tokens = torch.randint(0, V, (B, T))
    sizes = []

    def pack(x):
        if x.data_ptr() != logits.data_ptr():
            sizes.append(x.numel() * x.element_size())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        lp, full = token_logprobs(logits, tokens, 0.7, chunk_size=4, top_k=20, top_p=0.9, return_unfiltered=True)
    assert sum(sizes) <= 4 * B * T * 8  # tokens (int64) + two logsumexps per row
    # the filtered path of NeMo-RL / plain autograd keeps at least one [B, T, V] tensor
    sizes.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        naive_filtered(logits, tokens, 0.7, 20, 0.9)
    assert sum(sizes) >= B * T * V * 4


def test_aligned_logprobs_filtered_and_mask_out_of_filter():
    from grpo.logprobs import mask_out_of_filter

    torch.manual_seed(1)
    logits = torch.randn(2, 6, 11)
    ids = torch.randint(0, 11, (2, 6))
    lp, full = aligned_logprobs_from_logits(logits, ids, 0.8, top_k=3, return_unfiltered=True)
    assert torch.equal(lp[:, 0], torch.zeros(2)) and torch.equal(full[:, 0], torch.zeros(2))
    for t in range(1, 6):
        torch.testing.assert_close(lp[:, t], naive_filtered(logits[:, t - 1], ids[:, t], 0.8, 3, 1.0))
        torch.testing.assert_close(full[:, t], naive(logits[:, t - 1], ids[:, t], 0.8))
    assert torch.isinf(lp).any()  # random tokens: some fall outside the top 3
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    clean, n_out = mask_out_of_filter(lp, mask)
    assert torch.isfinite(clean).all() and (clean[mask == 0] == 0).all()
    assert int(n_out) == int((torch.isinf(lp) & (mask > 0)).sum()) > 0
    torch.testing.assert_close(clean[torch.isfinite(lp) & (mask > 0)], lp[torch.isfinite(lp) & (mask > 0)])


# --------------------------------------------------------------------------------------------------
# token_entropy / aligned_entropy_from_logits
# --------------------------------------------------------------------------------------------------
def _reference_entropy(logits, temperature):
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk_size", [None, 1, 3, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_entropy_matches_the_definition_and_its_gradient(chunk_size, temperature):
    from grpo.logprobs import token_entropy

    x = torch.randn(2, 5, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    h = token_entropy(x, temperature, chunk_size)
    ref = _reference_entropy(x, temperature)
    assert h.shape == (2, 5) and torch.allclose(h, ref, atol=1e-12)
    w = torch.randn(2, 5, dtype=torch.float64)
    (g,) = torch.autograd.grad((h * w).sum(), x)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), x)
    assert torch.allclose(g, g_ref, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: token_entropy(t, temperature, chunk_size), (x[:1, :2],))


def test_token_entropy_of_masked_out_logits_is_finite():
    from grpo.logprobs import token_entropy

    x = torch.tensor([[0.0, 0.0, float("-inf"), float("-inf")]], requires_grad=True)
    h = token_entropy(x)
    h.sum().backward()
    assert torch.allclose(h, torch.tensor([math.log(2)])) and torch.isfinite(x.grad).all()
    assert torch.allclose(token_entropy(torch.zeros(1, 4)), torch.tensor([math.log(4)]))
    assert token_entropy(torch.zeros(3, 8, dtype=torch.bfloat16)).dtype == torch.float32


def test_aligned_entropy_is_shifted_and_masked_like_the_logprobs():
    from grpo.logprobs import aligned_entropy_from_logits

    x = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    h = aligned_entropy_from_logits(x, mask, 0.5)
    ref = _reference_entropy(x, 0.5)
    assert torch.equal(h[:, 0], torch.zeros(2)) and h[0, 3] == 0
    assert torch.allclose(h[0, 1:3], ref[0, :2]) and torch.allclose(h[1, 1:], ref[1, :3])
