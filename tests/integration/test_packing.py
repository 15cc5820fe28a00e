"""Sequence packing and dynamic batching in the logprob and training forwards: the same logprobs and gradients as
the padded forward (to float rounding), with real attention implementations (sdpa, eager) and ragged lengths."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from grpo.system.engines import FrozenModel
from grpo.system.packed import Packing, check_packable, unpackable_reason
from grpo.system.training import TokenBatching, logprob_forward, compute_logprobs


def make_model(attn: str, arch: str = "llama"):
    torch.manual_seed(0)
    common = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, attn_implementation=attn))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, attn_implementation=attn))
    assert model.config._attn_implementation == attn
    return model.float()


def ragged_rows(lengths=(9, 1, 23, 4, 17, 2, 30, 6), seed=1, vocab=40):
    """Right-padded rows of these lengths (one of a single token), random ids, random token mask."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.zeros((len(lengths), T), dtype=torch.long)
    attn = torch.zeros((len(lengths), T), dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(3, vocab, (n,), generator=g)
        attn[b, :n] = 1
    tmask = attn * (torch.rand(attn.shape, generator=g) < 0.7)
    return ids, attn, tmask.float()


@pytest.mark.parametrize("attn,arch,top", [("sdpa", "llama", {}), ("eager", "llama", {}),
                                           ("sdpa", "qwen2", {"top_k": 7, "top_p": 0.9}),
                                           ("eager", "qwen2", {"top_k": 7})])
@pytest.mark.parametrize("layout", ["rows", "one_row"])
def test_packed_logprobs_and_gradients_equal_the_padded_forward(attn, arch, top, layout, monkeypatch):
    """``rows``: the layout of sdpa / eager (rows of the longest sample); ``one_row``: flash attention's (every sample in
    one row; flash kernels are not on the CPU, so the row runs through sdpa / eager, which read the same positions)."""
    if layout == "one_row":
        monkeypatch.setattr("grpo.system.training.attention_implementation", lambda module: "flash_attention_2")
    model = make_model(attn, arch)
    engine = FrozenModel(model, torch.device("cpu"))
    model.requires_grad_(True)
    ids, mask, tmask = ragged_rows()
    outs, grads = [], []
    for packing in (None, Packing(1), Packing(8, always=True)):
        model.zero_grad()
        lp, full, extras = logprob_forward(engine, ids, mask, 0.7, needs=("entropy", "logits"), packing=packing,
                                    **top)
        loss = (lp * tmask).sum() + 0.3 * (full * tmask).sum() + 0.1 * (extras["entropy_bt"] * tmask).sum() \
            + 0.01 * (extras["logits_btv"] * tmask[..., None]).sum()
        loss.backward()
        outs.append((lp.detach(), full.detach(), extras["entropy_bt"].detach(),
                     extras["logits_btv"].detach() * mask[..., None]))
        grads.append([p.grad.clone() for p in model.parameters()])
    model.requires_grad_(False)
    for packed in outs[1:]:
        for a, b in zip(outs[0], packed):
            torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-5)
        assert (packed[0][:, 0] == 0).all() and (packed[0][mask == 0] == 0).all()
    for g in grads[1:]:
        for g_plain, g_packed in zip(grads[0], g):
            torch.testing.assert_close(g_packed, g_plain, atol=1e-5, rtol=1e-4)


def grouped_rows(prompt_len, completion_lens, groups=3, seed=2):
    """``groups`` prompts of ``prompt_len`` tokens, each with completions of ``completion_lens``: (ids, mask, token mask)."""
    g = torch.Generator().manual_seed(seed)
    rows, tm = [], []
    for _ in range(groups):
        prompt = torch.randint(3, 40, (prompt_len,), generator=g).tolist()
        for c in completion_lens:
            rows.append(prompt + torch.randint(3, 40, (c,), generator=g).tolist())
            tm.append([0] * prompt_len + [1] * c)
    T = max(map(len, rows))
    return (torch.tensor([r + [0] * (T - len(r)) for r in rows]), torch.tensor([[1] * len(r) + [0] * (T - len(r))
            for r in rows]), torch.tensor([m + [0] * (T - len(m)) for m in tm], dtype=torch.float32))


@pytest.mark.parametrize("prompt_len, completions, shares", [
    (20, (2, 3, 2, 4), True),        # long shared prompts, short completions: sharing runs fewer tokens
    (3, (1, 30, 2, 2, 25, 1), True),   # ragged completions, continuations in length groups: 231 slots, packed 264
    (2, (31, 16, 13), False),         # short prompts, completions that pair up to the longest: packing fills rows
])
def test_a_packed_micro_batch_shares_prompts_where_that_runs_fewer_tokens(prompt_len, completions, shares,
                                                                          monkeypatch):
    from grpo.system import shared_prefix
    from grpo.system.shared_prefix import prompt_lengths

    calls = []
    original = shared_prefix.SharedPrefixPlan.logprobs
    monkeypatch.setattr(shared_prefix.SharedPrefixPlan, "logprobs",
                        lambda self, *a: calls.append(self.tokens()) or original(self, *a))
    model = make_model("sdpa")
    engine = FrozenModel(model, torch.device("cpu"))
    ids, mask, tmask = grouped_rows(prompt_len, completions)
    with torch.no_grad():
        plain, _, _ = logprob_forward(engine, ids, mask, 0.9)
        got, _, _ = logprob_forward(engine, ids, mask, 0.9, prompt_lens_b=prompt_lengths(tmask, mask), packing=Packing())
    assert bool(calls) == shares
    torch.testing.assert_close(got, plain, atol=2e-5, rtol=1e-5)


def test_packing_without_the_position_ids_would_mix_samples():
    """The test above can fail: the same packed row with positions running on (no restart) gives other logprobs."""
    model = make_model("sdpa")
    ids, mask, _ = ragged_rows(lengths=(5, 7))
    with torch.no_grad():
        row = torch.cat([ids[0, :5], ids[1, :7]])[None]
        restart = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
        a = model(input_ids=row, position_ids=restart, use_cache=False).logits
        b = model(input_ids=row, position_ids=torch.arange(12)[None], use_cache=False).logits
        alone = model(input_ids=ids[1:, :7], use_cache=False).logits
    torch.testing.assert_close(a[0, 5:], alone[0], atol=1e-5, rtol=1e-5)
    assert (b[0, 5:] - alone[0]).abs().max() > 1e-3


@pytest.mark.parametrize("batching", [TokenBatching(True, 40), TokenBatching(True, 64, 16, "first_fit_decreasing",
                                                                               "largest_first", always_pack=True),
                                      TokenBatching(False, 48), TokenBatching(False, 64, 8)])
def test_compute_logprobs_by_token_budget_equal_fixed_micro_batches(batching):
    model = make_model("sdpa")
    engine = FrozenModel(model, torch.device("cpu"))
    ids, mask, _ = ragged_rows()
    plain = compute_logprobs(engine, ids, mask, 0.8, micro_batch_size=3)
    by_tokens = compute_logprobs(engine, ids, mask, 0.8, micro_batch_size=3, batching=batching)
    torch.testing.assert_close(by_tokens, plain, atol=2e-5, rtol=1e-5)
    assert (by_tokens[mask == 0] == 0).all()


def test_an_attention_that_ignores_packed_positions_is_refused():
    model = make_model("sdpa")
    check_packable(model)
    assert unpackable_reason(model) is None
    model.config._attn_implementation = "paged|sdpa"
    with pytest.raises(ValueError, match="'paged\\|sdpa'.*dynamic_batching"):
        check_packable(model)
    assert "'paged|sdpa'" in unpackable_reason(model)  # what the startup line says when the default gives way


# --------------------------------------------------------------------------------------------------
# The training step on real DeepSpeed engines: one rank in this process, two ranks under torchrun
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_model_dir(tmp_path_factory):
    from grpo.tasks.toy import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("tiny")), seed=3)


@pytest.fixture(scope="module")
def plain_run(engine_model_dir):
    from tests.integration.test_engines import _plain_pytorch_reference

    return _plain_pytorch_reference(engine_model_dir)


@pytest.mark.parametrize("name, ds", [("packed", "auto"), ("dynamic", "auto"), ("packed", "ds_configs/zero3.json")])
def test_one_rank_steps_by_token_budget_equal_plain_pytorch(name, ds, engine_model_dir, plain_run):
    """One rank (auto: no ZeRO in fp32; and ZeRO-3; GAS 4 in both) with another number of micro-batches a step: the
    boundary set by hand steps once per call, with the full-batch gradient."""
    from grpo.system.dist import init_distributed
    from tests.helpers import dist_train_step
    from tests.integration.test_engines import _compare

    init_distributed()
    weights, results, logprobs = dist_train_step.train_and_collect(engine_model_dir, deepspeed_config=ds,
                                                                   batching=dist_train_step.batchings()[name])
    gas = dist_train_step.GLOBAL_BATCH // dist_train_step.MICRO_BATCH
    assert any(r["micro_batches"] != [gas] for r in results), "every step had GAS micro-batches: nothing tested"
    _compare(weights, results, logprobs, *plain_run, f"1 rank, {name}, {ds}")


@pytest.mark.slow  # about 15 s (two torchrun ranks); fast twins: the one-rank tests above and the packed-forward tests
def test_two_ranks_zero3_by_token_budget_equal_plain_pytorch(engine_model_dir, plain_run, tmp_path):
    """Two ZeRO-3 ranks whose shards split into different numbers of micro-batches (the short rank runs dummy
    micro-batches): the same steps as one process on the full batch, packed and dynamically batched."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.integration.test_engines import _compare

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "two.pt"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(repo)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(repo / "tests" / "helpers" / "dist_train_step.py"), engine_model_dir, str(out), "-", "packed,dynamic"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = torch.load(out)
    assert saved["world"] == 2
    for name in ("packed", "dynamic"):
        weights, results, logprobs = saved[name]
        assert any(len(set(r["micro_batches"])) > 1 for r in results), f"{name}: the ranks had equal counts"
        _compare(weights, results, logprobs, *plain_run, f"2 ranks, {name}")
