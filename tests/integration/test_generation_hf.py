"""grpo/system/generation (hf backend): per-sample seeded sampling, processed logprobs, stops, refit.

A tiny random Llama whose lm_head is scaled up (peaked distributions: greedy paths are far from
ties, so float rounding between batch shapes never flips a token).
"""

from __future__ import annotations

import copy
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from grpo.config import MasterConfig
from grpo.system.generation.base import cut_completion, length_caps
from grpo.system.generation.hf import HFGeneration
from grpo.system.generation.sampling import SeededSampler, filter_logits
from grpo.tasks.toy import build_char_tokenizer, build_tiny_model
from tests.helpers.batches import train_batch

PROMPTS = ["1+2=", "hello there", "a", "xyz 12", "What is 7*6?", "ok"]


def policy_cfg(**gen):
    policy = {"model_name": "unused", "precision": "float32", "generation_batch_size": 8,
              "max_total_sequence_length": 64,
              "generation": {"max_new_tokens": 24, "temperature": 1.0, **gen}}
    return MasterConfig.model_validate({"policy": policy}).policy


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    m = build_tiny_model(tok, seed=1)
    with torch.no_grad():
        m.lm_head.weight.mul_(6.0)
    return m.eval()


def make_gen(tok, model, **kw):
    """An HFGeneration over a private copy of ``model`` (it installs its own generation config)."""
    bs = kw.pop("generation_batch_size", 8)
    max_total = kw.pop("max_total_sequence_length", 64)
    cfg = policy_cfg(**kw)
    cfg.generation_batch_size, cfg.max_total_sequence_length = bs, max_total
    m = copy.deepcopy(model)
    return HFGeneration(cfg, tok, m.config, "cpu", model=m)


def encode(tok, texts):
    return [tok(t)["input_ids"] for t in texts]


# --------------------------------------------------------------------------------------------------
# the sampling math
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, 1.0), (0.7, 5, 1.0), (1.3, None, 0.8),
                                                     (0.6, 12, 0.9), (1.0, 1, 0.5)])
def test_filter_logits_matches_transformers_warpers(temperature, top_k, top_p):
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 3
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k is not None:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(None, expected)
    got = filter_logits(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    keep = ~torch.isinf(expected)
    torch.testing.assert_close(got[keep], expected[keep], atol=1e-6, rtol=0)
    if top_k is not None:
        assert (keep.sum(-1) <= top_k).all()


def test_gumbel_sampler_draws_from_the_filtered_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 6000
    sampler = SeededSampler(list(range(n)), temperature=0.8, top_k=4, top_p=1.0, greedy=False, device="cpu")
    sampler(None, logits.expand(n, -1).clone())
    counts = torch.bincount(sampler.tokens[0], minlength=6).double() / n
    probs = torch.softmax(logits[0, :4] / 0.8, dim=0).double()
    assert counts[4:].sum() == 0, "top-k removed tokens were sampled"
    torch.testing.assert_close(counts[:4], probs, atol=0.025, rtol=0)  # ~4 standard errors
    # recorded logprobs are log p of the chosen token under that distribution
    chosen = sampler.tokens[0]
    torch.testing.assert_close(sampler.logprobs[0].double(), probs.log()[chosen], atol=1e-6, rtol=0)


def test_sampler_rows_depend_only_on_their_seed():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(2))
    a = SeededSampler([11, 22, 33], 1.0, None, 1.0, False, "cpu")
    b = SeededSampler([33, 11], 1.0, None, 1.0, False, "cpu")
    for _ in range(3):
        a(None, logits.clone())
        b(None, logits[[2, 0]].clone())
    assert [t[[2, 0]].tolist() for t in a.tokens] == [t.tolist() for t in b.tokens]


def test_filter_logits_copies_nothing_when_there_is_nothing_to_compute():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(3))
    assert filter_logits(logits) is logits                         # temperature 1, no filter: the logits themselves
    assert torch.equal(filter_logits(logits, temperature=0.5), logits / 0.5)


def test_length_caps_and_cut_completion():
    assert length_caps([3, 10], 8, 12) == [8, 2]
    with pytest.raises(ValueError, match="prompt 1 has 12 tokens"):
        length_caps([3, 12], 8, 12)
    dec = lambda ids: "".join(chr(96 + i) for i in ids)  # 1 -> "a", 2 -> "b", ...
    assert cut_completion([1, 2, 3, 4], cap=3, stop_token_ids=[9], stop_strings=None, decode=dec) == (3, "length")
    assert cut_completion([1, 9, 3], cap=5, stop_token_ids=[9], stop_strings=None, decode=dec) == (2, "stop")
    assert cut_completion([1, 2, 3, 4, 5], cap=5, stop_token_ids=[9], stop_strings=["cd"], decode=dec) == (4, "stop")
    # the stop token comes first
    assert cut_completion([1, 9, 3, 4], cap=5, stop_token_ids=[9], stop_strings=["cd"], decode=dec) == (2, "stop")
    # a stop string beyond the cap does not count
    assert cut_completion([1, 2, 3, 4], cap=3, stop_token_ids=[], stop_strings=["cd"], decode=dec) == (3, "length")


# --------------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------------
def _teacher_forced(model, prompt, completion, temperature, top_k, top_p):
    """Full forward over prompt + completion (no cache, no padding), transformers' warpers."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1: -1]
    x = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k is not None:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p)(None, x)
    return torch.log_softmax(x, dim=-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, 1.0), (0.7, 10, 0.9)])
def test_logprobs_equal_teacher_forced_recomputation(tok, model, temperature, top_k, top_p):
    gen = make_gen(tok, model, temperature=temperature, top_k=top_k, top_p=top_p)
    prompts = encode(tok, PROMPTS)
    outs = gen.generate(prompts, seeds=list(range(100, 100 + len(prompts))))
    for o, p in zip(outs, prompts):
        assert o.prompt_ids == p and len(o.logprobs) == len(o.completion_ids) > 0
        expected = _teacher_forced(model, p, o.completion_ids, temperature, top_k, top_p)
        torch.testing.assert_close(torch.tensor(o.logprobs), expected, atol=1e-5, rtol=0)


def test_same_seed_same_completion_whatever_the_batch(tok, model):
    prompts = encode(tok, PROMPTS)
    seeds = [7, 8, 9, 10, 11, 12]
    kw = {"temperature": 1.2, "top_p": 0.95}
    together = make_gen(tok, model, generation_batch_size=6, **kw).generate(prompts, seeds)
    in_pairs_reversed = make_gen(tok, model, generation_batch_size=2, **kw).generate(prompts[::-1], seeds[::-1])[::-1]
    one_by_one = make_gen(tok, model, generation_batch_size=1, **kw)
    alone = [one_by_one.generate([p], [s])[0] for p, s in zip(prompts, seeds)]
    for a, b, c in zip(together, in_pairs_reversed, alone):
        assert a.completion_ids == b.completion_ids == c.completion_ids
        assert a.finish_reason == b.finish_reason == c.finish_reason
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(c.logprobs), atol=1e-5, rtol=0)
    # and the seed matters: the same prompt under other seeds samples other completions
    again = make_gen(tok, model, **kw).generate([prompts[0]] * 4, [1, 2, 3, 4])
    assert len({tuple(o.completion_ids) for o in again + [together[0]]}) > 1


def test_a_prompt_shared_by_several_rows_is_prefilled_once_and_samples_as_alone(tok, model, monkeypatch):
    prompts = encode(tok, [PROMPTS[0]] * 3 + [PROMPTS[4]] * 3 + [PROMPTS[1]])   # groups, as GRPO generates
    seeds = list(range(20, 27))
    kw = {"temperature": 1.0, "top_k": 20}
    shared = make_gen(tok, model, **kw)
    shared.cfg = shared.cfg.model_copy(update={"shared_prompt_forward": True})   # auto: off for a tiny model
    calls = []
    real = HFGeneration._shared_prompt_cache
    monkeypatch.setattr(HFGeneration, "_shared_prompt_cache",
                        lambda self, *a: calls.append(a[0].shape) or real(self, *a))
    outs = shared.generate(prompts, seeds)
    assert [c[0] for c in calls] == [7]
    plain = make_gen(tok, model, **kw)
    plain.cfg = plain.cfg.model_copy(update={"shared_prompt_forward": False})
    expected = plain.generate(prompts, seeds)
    assert len(calls) == 1                                                      # the plain one never asked
    for a, b in zip(outs, expected):
        assert a.completion_ids == b.completion_ids and a.finish_reason == b.finish_reason
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    cache = shared._shared_prompt_cache(*_left_padded(tok, prompts))
    assert cache.get_seq_length() == max(len(p) for p in prompts) - 1 and cache.layers[0].keys.shape[0] == 7


def _left_padded(tok, prompts):
    L = max(len(p) for p in prompts)
    ids = torch.tensor([[tok.pad_token_id] * (L - len(p)) + p for p in prompts])
    return ids, (torch.arange(L)[None] >= torch.tensor([L - len(p) for p in prompts])[:, None]).long()


def test_greedy_equals_plain_generate(tok, model):
    gen = make_gen(tok, model, temperature=0.7, top_k=5, top_p=0.8, max_new_tokens=12)
    prompts = encode(tok, PROMPTS[:4])
    outs = gen.generate(prompts, seeds=[1, 2, 3, 4], greedy=True)
    for o, p in zip(outs, prompts):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=False, max_new_tokens=12, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
        assert o.completion_ids == ref[: len(o.completion_ids)]
        assert len(o.completion_ids) == (12 if o.finish_reason == "length" else ref.index(tok.eos_token_id) + 1)
    # greedy ignores the seeds
    assert [o.completion_ids for o in gen.generate(prompts, [9, 9, 9, 9], greedy=True)] == \
        [o.completion_ids for o in outs]


def test_finish_reasons_eos_stop_tokens_and_length_caps(tok, model):
    prompt = encode(tok, ["hello there"])[0]
    base = make_gen(tok, model, max_new_tokens=16).generate([prompt], [0], greedy=True)[0]
    assert base.finish_reason == "length" and len(base.completion_ids) == 16
    assert tok.eos_token_id not in base.completion_ids
    stop_tok = base.completion_ids[5]
    n_expected = base.completion_ids.index(stop_tok) + 1

    # a tokenizer whose EOS is that token: "stop", cut right after its first occurrence
    tok_eos = build_char_tokenizer()
    tok_eos.eos_token = tok.convert_ids_to_tokens(stop_tok)
    out = make_gen(tok_eos, model, max_new_tokens=16).generate([prompt], [0], greedy=True)[0]
    assert (out.finish_reason, out.completion_ids) == ("stop", base.completion_ids[:n_expected])
    assert out.completion_ids[-1] == stop_tok

    # policy.generation.stop_token_ids does the same
    out = make_gen(tok, model, max_new_tokens=16, stop_token_ids=[stop_tok]).generate([prompt], [0], greedy=True)[0]
    assert (out.finish_reason, out.completion_ids) == ("stop", base.completion_ids[:n_expected])

    # caps: max_new_tokens argument, and max_total_sequence_length - prompt length
    out = make_gen(tok, model).generate([prompt], [0], greedy=True, max_new_tokens=4)[0]
    assert (out.finish_reason, out.completion_ids) == ("length", base.completion_ids[:4])
    short = make_gen(tok, model, max_total_sequence_length=len(prompt) + 3)
    outs = short.generate([prompt, prompt[:2]], [0, 0], greedy=True)
    assert (outs[0].finish_reason, outs[0].completion_ids) == ("length", base.completion_ids[:3])
    assert len(outs[1].completion_ids) <= len(prompt) + 1  # its own, larger, budget


def test_stop_strings_greedy_cut_after_the_string(tok, model):
    prompt = encode(tok, ["hello there"])[0]
    base = make_gen(tok, model, max_new_tokens=16).generate([prompt], [0], greedy=True)[0]
    assert all(i >= 3 for i in base.completion_ids), "char tokens only: one token per character"
    s = base.text[4:6]
    n_expected = base.text.find(s) + len(s)
    out = make_gen(tok, model, max_new_tokens=16, stop_strings=["@@", s]).generate([prompt], [0], greedy=True)[0]
    assert out.finish_reason == "stop"
    assert out.completion_ids == base.completion_ids[:n_expected]
    assert out.text == base.text[:n_expected] and out.text.endswith(s)


def test_stop_strings_sampled_properties(tok, model):
    stops = ["e", "a", "7", "xy"]
    gen = make_gen(tok, model, max_new_tokens=30, stop_strings=stops, temperature=1.5)
    outs = gen.generate(encode(tok, PROMPTS), seeds=list(range(6)))
    assert any(o.finish_reason == "stop" for o in outs)
    for o in outs:
        assert len(o.logprobs) == len(o.completion_ids)
        if o.finish_reason == "stop" and not o.completion_ids[-1] in gen.stop_token_ids:
            assert any(o.text.endswith(s) for s in stops)
            assert not any(s in o.text[:-1] for s in stops), "cut after a later occurrence"
        elif o.finish_reason == "length":
            assert len(o.completion_ids) == 30 and not any(s in o.text for s in stops)


def test_generate_checks_arguments(tok, model):
    gen = make_gen(tok, model)
    with pytest.raises(ValueError, match="2 prompts but 1 seeds"):
        gen.generate(encode(tok, ["a", "b"]), [1])
    fresh = HFGeneration(policy_cfg(), tok, model.config, "cpu")
    with pytest.raises(RuntimeError, match="refit"):
        fresh.generate(encode(tok, ["a"]), [1])


# --------------------------------------------------------------------------------------------------
# refit from a ZeRO-3 engine
# --------------------------------------------------------------------------------------------------
def _engine_cfg(model_dir: str, deepspeed_config: str) -> MasterConfig:
    """A one-rank policy of 2-sample steps on ``model_dir`` (the refit and shared-module tests)."""
    return MasterConfig.model_validate({
        "policy": {"model_name": model_dir, "precision": "float32", "train_global_batch_size": 2,
                   "train_micro_batch_size": 2, "generation_batch_size": 4, "optimizer": {"lr": 0.05},
                   "deepspeed_config": deepspeed_config},
        "grpo": {"num_prompts_per_step": 1, "num_generations_per_prompt": 2},
    })


def test_refit_copies_the_engine_weights_after_a_step(tok, tmp_path):
    from transformers import AutoModelForCausalLM

    from grpo.system import engines, weights
    from grpo.system.dist import init_distributed
    from grpo.system.training import train_on_batch
    from grpo.tasks.toy import save_tiny_model

    model_dir = save_tiny_model(str(tmp_path / "m"), seed=5)
    init_distributed()
    cfg = _engine_cfg(model_dir, "ds_configs/zero3.json")
    engine = engines.build_policy_engine(cfg, 1, total_optimizer_steps=1)
    gen = HFGeneration(cfg.policy, tok, engine.module.config, "cpu", refit_bucket_numel=1)
    assert not any(p.numel() == 0 for p in gen.model.parameters()), "the copy must not be partitioned"

    def gathered():
        return {n: t.clone() for b in weights.iter_gathered_params(engine) for n, t in b}

    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():  # the copy starts as zeros: only a refit that copies every tensor passes below
        for p in gen.model.parameters():
            p.zero_()
    seconds = gen.refit(engine)
    assert isinstance(seconds, float) and seconds > 0.0, seconds  # it reports the time the copy took
    for n, p in initial.named_parameters():
        torch.testing.assert_close(dict(gen.model.named_parameters())[n], p, atol=0, rtol=0)

    ids = torch.tensor(encode(tok, ["1+2=3", "4+4=8"]))
    train_on_batch(engine, [train_batch(input_ids_bt=ids, attention_mask_bt=torch.ones_like(ids))],
                           lambda lp, mb: (-lp.sum() / lp.numel(), {}))
    after = gathered()
    assert max((after[n] - p).abs().max().item() for n, p in initial.named_parameters()) > 1e-3
    gen.refit(engine)
    for n, p in gen.model.named_parameters():
        torch.testing.assert_close(p, after[n], atol=0, rtol=0)
    # and it generates what a plain model with those weights generates
    ref = copy.deepcopy(initial)
    ref.load_state_dict(after, strict=False)
    prompt = encode(tok, ["1+2="])[0]
    out = gen.generate([prompt], [3], greedy=True, max_new_tokens=8)[0]
    with torch.no_grad():
        expected = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8,
                                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, len(prompt):]
    assert out.completion_ids == expected.tolist()[: len(out.completion_ids)]


def test_generation_on_the_shared_training_module_leaves_it_training_and_samples_like_a_copy(tok, tmp_path):
    """ZeRO-1 on one rank: generation runs on the engine's own module (nothing to refit) and samples exactly what
    a refitted copy samples; the module stays trainable, in train mode, with its own generation config."""
    from grpo.system import engines
    from grpo.system.dist import init_distributed
    from grpo.system.training import train_on_batch
    from grpo.tasks.toy import save_tiny_model

    model_dir = save_tiny_model(str(tmp_path / "m"), seed=6)
    init_distributed()
    cfg = _engine_cfg(model_dir, "ds_configs/zero1.json")
    engine = engines.build_policy_engine(cfg, 1, total_optimizer_steps=2)
    ids = torch.tensor(encode(tok, ["1+2=3", "4+4=8"]))
    train_on_batch(engine, [train_batch(input_ids_bt=ids, attention_mask_bt=torch.ones_like(ids))],
                           lambda lp, mb: (-lp.sum() / lp.numel(), {}))
    engine.train()
    own_config = engine.module.generation_config
    shared = HFGeneration(cfg.policy, tok, engine.module.config, "cpu", model=engine.module, shared=True)
    copy_ = HFGeneration(cfg.policy, tok, engine.module.config, "cpu")
    assert shared.refit(engine) == 0.0 and copy_.refit(engine) > 0
    prompts, seeds = encode(tok, ["1+2=", "3+3=", "9+9="]), [1, 2, 3]
    for a, b in zip(shared.generate(prompts, seeds), copy_.generate(prompts, seeds), strict=True):
        # the same tokens; logprobs to float rounding (the engine's flat-buffer views vs a copy's own tensors)
        assert a.completion_ids == b.completion_ids and a.text == b.text
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert engine.module.training and all(p.requires_grad for p in engine.module.parameters())
    assert engine.module.generation_config is own_config


# --------------------------------------------------------------------------------------------------
# policy.generation.hf_drop_finished_rows: the own decode loop against transformers' generate
# --------------------------------------------------------------------------------------------------
def _both_loops(tok, model, prompts, seeds, greedy=False, shared=False, **kw):
    """(outputs, rows each decode forward ran) of the dropping loop and of transformers' generate, alike otherwise."""
    results = []
    for drop in (True, False):
        gen = make_gen(tok, model, hf_drop_finished_rows=drop, **{k: v for k, v in kw.items() if k != "call"})
        gen.cfg = gen.cfg.model_copy(update={"shared_prompt_forward": shared})
        rows = []
        gen.model.register_forward_pre_hook(lambda m, a, k: rows.append(k["input_ids"].shape[0]), with_kwargs=True)
        results.append((gen.generate(prompts, seeds, greedy=greedy, **kw.get("call", {})), rows))
    return results


def _assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        assert (x.completion_ids, x.finish_reason, x.text) == (y.completion_ids, y.finish_reason, y.text)
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("greedy", [True, False])
def test_dropping_finished_rows_samples_what_generate_samples_and_runs_only_live_rows(tok, model, greedy,
                                                                                     monkeypatch):
    from grpo.system.generation import hf

    monkeypatch.setattr(hf, "DROP_ENDED_SHARE", 0.0)                # a row leaves as soon as it ends
    prompts = encode(tok, PROMPTS + ["1+2=", "hello there"])
    stop_ids = [tok.convert_tokens_to_ids(c) for c in "e 3"]    # frequent tokens: ragged ends
    (drop, drop_rows), (plain, plain_rows) = _both_loops(
        tok, model, prompts, list(range(40, 48)), greedy=greedy, temperature=1.4, top_k=30, top_p=0.95,
        stop_token_ids=stop_ids, max_new_tokens=20, call={"max_new_tokens": [20, 3, 20, 20, 9, 20, 20, 1]})
    _assert_same(drop, plain)
    lens = [len(o.completion_ids) for o in drop]
    assert len(set(lens)) >= 3 and {"stop", "length"} <= {o.finish_reason for o in drop}, lens
    # after the prefill, a row runs once per token it generates but its last: nothing for finished rows
    assert drop_rows[0] == plain_rows[0] == len(prompts)
    assert sum(drop_rows[1:]) == sum(n - 1 for n in lens)
    assert sum(plain_rows[1:]) == len(prompts) * (max(lens) - 1) > sum(drop_rows[1:])


def test_ended_rows_leave_once_they_are_a_quarter_of_the_batch(tok, model):
    prompts = encode(tok, PROMPTS * 3)
    stop_ids = [tok.convert_tokens_to_ids(c) for c in "e 3"]
    (drop, rows), (plain, _) = _both_loops(tok, model, prompts, list(range(80, 98)), temperature=1.4,
                                           stop_token_ids=stop_ids, max_new_tokens=24, generation_batch_size=18)
    _assert_same(drop, plain)
    lens = [len(o.completion_ids) for o in drop]
    live = [sum(n > t for n in lens) for t in range(1, max(lens))]  # rows still generating at each decode step
    assert all(live_t <= ran < max(live_t + 1, live_t * 4 / 3) for live_t, ran in zip(live, rows[1:])), (live, rows)
    assert rows[1:] != live and sum(rows[1:]) < len(prompts) * (max(lens) - 1)


def test_dropping_finished_rows_with_stop_strings_caps_and_a_shared_prompt_prefill(tok, model, monkeypatch):
    from grpo.system.generation import hf

    monkeypatch.setattr(hf, "DROP_ENDED_SHARE", 0.0)                # a row leaves as soon as it ends
    prompts = encode(tok, [PROMPTS[0]] * 3 + [PROMPTS[4]] * 3 + [PROMPTS[1]])
    short = {"max_total_sequence_length": len(prompts[4]) + 5}      # the long prompt's budget: 5 tokens
    (drop, drop_rows), (plain, _) = _both_loops(
        tok, model, prompts, list(range(60, 67)), shared=True, temperature=1.5, max_new_tokens=16,
        stop_strings=["e", "a", "7"], call={"stop_strings": [None] * 6 + [["xy", "o"]]}, **short)
    _assert_same(drop, plain)
    assert any(o.finish_reason == "stop" and o.completion_ids[-1] not in (tok.eos_token_id,) for o in drop)
    assert all(len(o.completion_ids) <= 5 for o in drop[3:6])
    # the shared prompt's prefill (3 distinct prompts), then every row from its last prompt token, then live rows
    assert drop_rows[:2] == [3, 7] and sum(drop_rows[2:]) == sum(len(o.completion_ids) - 1 for o in drop)


# --------------------------------------------------------------------------------------------------
# the decode step's copies: the KV cache written in place, grouped key/value heads given to the kernel
# --------------------------------------------------------------------------------------------------
def _kv(seed, batch, length):
    """Keys and values [batch, 2 heads, length, 4]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, length, 4, generator=g), torch.randn(batch, 2, length, 4, generator=g)


def test_the_preallocated_layer_holds_what_transformers_dynamic_layer_holds():
    from transformers.cache_utils import DynamicLayer

    from grpo.system.generation.hf import PreallocatedLayer

    ours, theirs = PreallocatedLayer(capacity=4), DynamicLayer()
    steps = [("update", _kv(0, 3, 2)), ("update", _kv(1, 3, 1)), ("select", torch.tensor([2, 0, 0])),
             ("update", _kv(2, 3, 1)), ("update", _kv(3, 3, 2)),     # past the capacity of 4: the buffers grow
             ("select", torch.tensor([1])), ("update", _kv(4, 1, 1))]
    buffer_ptrs = []
    for op, arg in steps:
        for layer in (ours, theirs):
            layer.update(*arg) if op == "update" else layer.batch_select_indices(arg)
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values), (op, len(buffer_ptrs))
        assert ours.get_seq_length() == theirs.get_seq_length()
        buffer_ptrs.append(ours.keys.data_ptr())
    # a step that fits is written in place (no new tensor); past the room, new buffers
    assert buffer_ptrs[2] == buffer_ptrs[3] != buffer_ptrs[4] and buffer_ptrs[5] == buffer_ptrs[6]
    assert ours.keys.shape[-2] == 7


def _transformers_own_decode(monkeypatch):
    """Generation as before: transformers' growing cache and its "sdpa" attention (which copies grouped heads)."""
    from contextlib import nullcontext

    from grpo.system.generation import hf

    monkeypatch.setattr(hf, "preallocated_cache", lambda model, capacity: None)
    monkeypatch.setattr(hf, "sharing_kv_heads", nullcontext)


@pytest.mark.parametrize("drop", [True, False])
def test_decode_writes_its_kv_cache_in_place_and_samples_the_same_numbers(tok, model, monkeypatch, drop):
    from grpo.system.generation import hf

    monkeypatch.setattr(hf, "DROP_ENDED_SHARE", 2.0)        # no row leaves: one batch, one buffer throughout
    prompts = encode(tok, PROMPTS)                          # ragged: left padding, so every attention has a mask
    gen = make_gen(tok, model, hf_drop_finished_rows=drop, temperature=1.3, max_new_tokens=12)
    key_ptrs = []
    gen.model.register_forward_hook(
        lambda m, a, k, out: key_ptrs.append(out.past_key_values.layers[0].keys.data_ptr()), with_kwargs=True)
    outs = gen.generate(prompts, list(range(6)))
    assert max(len(o.completion_ids) for o in outs) > 3
    assert len(set(key_ptrs[1:])) == 1, "a decode step reallocated the KV cache"
    _transformers_own_decode(monkeypatch)
    expected = make_gen(tok, model, hf_drop_finished_rows=drop, temperature=1.3, max_new_tokens=12).generate(
        prompts, list(range(6)))
    assert [(o.completion_ids, o.logprobs) for o in outs] == [(o.completion_ids, o.logprobs) for o in expected]


def test_generation_gives_grouped_heads_to_the_kernel_and_other_forwards_keep_transformers_attention(
        tok, model, monkeypatch):
    import threading

    from transformers.integrations import sdpa_attention

    from grpo.system.generation.hf import sharing_kv_heads

    assert model.config.num_key_value_heads < model.config.num_attention_heads
    copies = []
    real = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: copies.append(n) or real(x, n))
    prompts = encode(tok, PROMPTS)
    make_gen(tok, model, max_new_tokens=6).generate(prompts, list(range(6)))
    assert copies == [], "generation copied the key/value heads"
    ids, mask = _left_padded(tok, prompts)
    with torch.no_grad(), sharing_kv_heads():
        shared_heads = model(input_ids=ids, attention_mask=mask).logits
    assert copies == []
    with torch.no_grad():                                   # outside the block: transformers' own, the same numbers
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, shared_heads) and copies
    copies.clear()
    with sharing_kv_heads():                                # a forward with autograd (training) keeps transformers'
        model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    assert copies
    copies.clear()
    with torch.no_grad(), sharing_kv_heads():               # another thread (the trainer beside the async loop's)
        other = threading.Thread(target=torch.no_grad()(lambda: model(input_ids=ids, attention_mask=mask)))
        other.start()
        other.join()
    assert copies
    model.zero_grad(set_to_none=True)
