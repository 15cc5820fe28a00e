"""grpo.system.shared_prefix: a shared prompt runs once, and logprobs and gradients equal the plain forward's."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from grpo.system.engines import FrozenModel
from grpo.system.training import forward_logprobs
from grpo.system.shared_prefix import plan_shared_prefix, prompt_lengths


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).float()


def group_batch(prompt_lens=(5, 3, 7), group=4, max_new=6, seed=1):
    """Right-padded rows: every prompt ``group`` times, each with a completion of its own length (1..max_new)."""
    g = torch.Generator().manual_seed(seed)
    rows, token_masks = [], []
    for p in prompt_lens:
        prompt = torch.randint(3, 40, (p,), generator=g).tolist()
        for _ in range(group):
            n = int(torch.randint(1, max_new + 1, (1,), generator=g))
            rows.append(prompt + torch.randint(3, 40, (n,), generator=g).tolist())
            token_masks.append([0] * p + [1] * n)
    T = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    attn = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    tmask = torch.tensor([m + [0] * (T - len(m)) for m in token_masks])
    return ids, attn, tmask


def test_prompt_lengths_and_the_plan_run_each_prompt_once():
    ids, attn, tmask = group_batch()
    p_b = prompt_lengths(tmask, attn)
    assert p_b.tolist() == [5] * 4 + [3] * 4 + [7] * 4
    plan = plan_shared_prefix(ids, attn, p_b)
    assert plan.prompt_ids_ul.shape == (3, 7) and plan.row_prompt_b.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    # the continuation starts at the prompt's last token, at its own position; that token's cache entry is masked
    assert plan.cont_ids_bc[0, 0] == ids[0, 4] and plan.cont_positions_bc[0, 0] == 4
    assert plan.cont_attention_bl[0, :7].tolist() == [1, 1, 1, 1, 0, 0, 0]


def test_nothing_to_share_runs_the_plain_forward():
    ids, attn, tmask = group_batch(group=1)
    assert plan_shared_prefix(ids, attn, prompt_lengths(tmask, attn)) is None   # no prompt repeats
    ids, attn, tmask = group_batch(prompt_lens=(1, 4))
    assert plan_shared_prefix(ids, attn, prompt_lengths(tmask, attn)) is None   # a 1-token prompt


@pytest.mark.parametrize("top", [{}, {"top_k": 5, "top_p": 0.9}])
def test_logprobs_and_gradients_equal_the_plain_forward(model, top):
    ids, attn, tmask = group_batch()
    assert_shared_equals_plain(model, ids, attn, tmask, **top)


def assert_shared_equals_plain(model, ids, attn, tmask, **top):
    """The shared-prompt forward's logprobs (filtered and not) and gradients equal the plain forward's, up to
    rounding; both 0 on padding."""
    engine = FrozenModel(model, torch.device("cpu"))
    model.requires_grad_(True)
    outs, grads = [], []
    for lens in (None, prompt_lengths(tmask, attn)):
        model.zero_grad()
        lp, full = forward_logprobs(engine, ids, attn, 0.7, return_unfiltered=True, prompt_lens_b=lens, **top)
        ((lp * tmask).sum() + 0.3 * (full * tmask).sum()).backward()
        outs.append((lp.detach(), full.detach()))
        grads.append([p.grad.clone() for p in model.parameters()])
    model.requires_grad_(False)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
        assert (a[attn == 0] == 0).all() and (b[attn == 0] == 0).all()
    for g_plain, g_shared in zip(*grads):
        torch.testing.assert_close(g_shared, g_plain, atol=1e-5, rtol=1e-4)


def test_multi_turn_rows_share_only_their_first_prompt(model):
    """A second assistant turn after an environment message: the prompt is what precedes the first turn."""
    ids, attn, tmask = group_batch(prompt_lens=(4, 6), group=3, max_new=8)
    tmask[:, :] = tmask * (torch.arange(ids.shape[1]) % 5 != 0)   # holes: environment tokens between turns
    p_b = prompt_lengths(tmask, attn)
    engine = FrozenModel(model, torch.device("cpu"))
    with torch.no_grad():
        plain = forward_logprobs(engine, ids, attn)
        shared = forward_logprobs(engine, ids, attn, prompt_lens_b=p_b)
    torch.testing.assert_close(shared, plain, atol=2e-5, rtol=0)


def test_continuations_run_in_length_groups_with_the_plain_forwards_numbers(model, monkeypatch):
    """Ragged completions: every continuation length a group of its own (a group costs no slots here), each group
    padded to its longest; logprobs and gradients stay the plain forward's (up to rounding)."""
    from grpo.system import shared_prefix

    monkeypatch.setattr(shared_prefix, "GROUP_CALL_SLOTS", 0)
    ids, attn, tmask = group_batch(max_new=12, seed=3)
    p_b = prompt_lengths(tmask, attn)
    plan = plan_shared_prefix(ids, attn, p_b)
    cont_len_b = attn.sum(dim=1) - p_b + 1
    assert len(plan.groups) == len(set(cont_len_b.tolist())) > 1
    assert sorted(b for rows, _ in plan.groups for b in rows.tolist()) == list(range(len(ids)))
    assert all(width == int(cont_len_b[rows].max()) for rows, width in plan.groups)
    assert plan.tokens() == plan.prompt_ids_ul.numel() + int(cont_len_b.sum()) < plan.prompt_ids_ul.numel() + \
        plan.cont_ids_bc.numel()
    assert_shared_equals_plain(model, ids, attn, tmask)


def test_logprob_passes_hand_grouped_query_heads_to_the_kernel_with_the_same_numbers(model, monkeypatch):
    """compute_logprobs (no grad) runs grouped-query attention on the key/value heads as they are (no copy per query
    head: `grpo.system.generation.hf.sdpa_sharing_kv_heads`), bitwise what the copying forward gives."""
    from transformers.integrations import sdpa_attention

    from grpo.system.training import compute_logprobs

    ids, attn, tmask = group_batch(max_new=9, seed=4)
    engine = FrozenModel(model, torch.device("cpu"))
    with torch.no_grad():
        copied = forward_logprobs(engine, ids, attn, 0.8, prompt_lens_b=prompt_lengths(tmask, attn))
    copies = []
    original = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: copies.append(1) or original(*a))
    shared = compute_logprobs(engine, ids, attn, 0.8, micro_batch_size=len(ids),
                              prompt_lens_b=prompt_lengths(tmask, attn))
    assert copies == []
    assert torch.equal(shared, copied)
