"""grpo/system/generation/vllm.py without vLLM: the tensor-parallel gather (two gloo ranks, a fake engine), the
refit's warning filter and missing-weight check (a fake engine that logs what vLLM logs), and the
KV-cache sizing of the GPU recipes."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from grpo.system.generation.vllm import VllmGeneration, chunk_slices, generate_in_group, push_buckets
from grpo.system.generation.vllm_params import (
    PARAMS_NOT_LOADED, RELOAD_LOGGERS, kv_cache_bytes_for_step, kv_cache_bytes_per_token, kv_cache_shortfall,
    refit_problems, startup_memory_problem, step_kv_cache_bytes,
)

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------------
# Tensor-parallel groups: two gloo ranks, a fake engine
# --------------------------------------------------------------------------------------------------
def fake_engine(calls: list):
    """What a TP engine does with the group's batch: one output per prompt, a function of prompt and seed."""
    def run(prompts, seeds):
        calls.append([list(prompts), list(seeds)])
        return [f"{p}/{s}" for p, s in zip(prompts, seeds)]
    return run


def fake_backend(group, calls: list) -> VllmGeneration:
    """A `VllmGeneration` past construction and refit, whose vLLM engine is `fake_engine`."""
    from grpo.config import MasterConfig

    gen = VllmGeneration.__new__(VllmGeneration)
    gen._tp_group, gen._refitted, gen._asleep, gen.recorder, gen.images = group, True, False, [], None
    gen.cfg = MasterConfig.model_validate({"policy": {"max_total_sequence_length": 16,
                                                      "generation": {"max_new_tokens": 4}}})
    gen.sampling = gen.cfg.policy.generation.sampling()
    gen._run_engine = lambda p, s, greedy, sampling, caps, stops, media: fake_engine(calls)(p, s)
    return gen


# Per rank: the samples it holds in each scenario ([prompt, seed] pairs; prompts as lists of ids).
SCENARIOS = {
    "rank 1 has nothing": ([[[1], 10], [[2], 20], [[3], 30]], []),
    "nobody has anything": ([], []),
    "unequal shares": ([[[1, 1], 10]], [[[2], 20], [[3, 3, 3], 30]]),
}


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A hang (ranks in different collectives) fails after 60 s instead of blocking the suite.
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    group = dist.new_group([0, 1])
    result = {}
    for name, shares in SCENARIOS.items():
        mine = shares[rank]
        calls: list = []
        prompts, seeds = [p for p, _ in mine], [s for _, s in mine]
        direct = generate_in_group(prompts, seeds, group, fake_engine(calls))
        via_backend = fake_backend(group, calls).generate(prompts, seeds)
        result[name] = {"direct": direct, "backend": via_backend, "calls": calls}
    # A chunked caller with 3 vs 2 samples and chunks of 2: both ranks make ceil(3 / 2) = 2 calls.
    samples = [[[i], 100 + i] for i in range(5)]
    mine = samples[:3] if rank == 0 else samples[3:]
    calls = []
    outputs = []
    for sl in chunk_slices(len(mine), n_most=3, chunk_size=2):
        part = mine[sl]
        outputs += fake_backend(group, calls).generate([p for p, _ in part], [s for _, s in part])
    result["chunked"] = {"outputs": outputs, "calls": calls}
    dist.destroy_process_group()
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))


def test_tp_gather_with_empty_and_unequal_shares_on_two_ranks(tmp_path):
    from tests.helpers.e2e import free_port

    torch.multiprocessing.spawn(_rank_main, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
    for name, shares in SCENARIOS.items():
        group_batch = [[p for p, _ in shares[0] + shares[1]], [s for _, s in shares[0] + shares[1]]]
        for rank, res in ((0, r0[name]), (1, r1[name])):
            expected = [f"{p}/{s}" for p, s in shares[rank]]
            assert res["direct"] == expected and res["backend"] == expected, (name, rank, res)
            # every rank runs the group's whole batch (twice: direct and through the backend), or nothing
            assert res["calls"] == ([group_batch] * 2 if group_batch[0] else []), (name, rank)
    assert r0["chunked"]["outputs"] == [f"{[i]}/{100 + i}" for i in range(3)]
    assert r1["chunked"]["outputs"] == [f"{[i]}/{100 + i}" for i in (3, 4)]
    assert r0["chunked"]["calls"] == r1["chunked"]["calls"] and len(r0["chunked"]["calls"]) == 2


def test_without_a_group_generate_runs_alone_and_empty_is_empty():
    calls: list = []
    assert generate_in_group([], [], None, fake_engine(calls)) == [] and calls == []
    assert fake_backend(None, calls).generate([[5, 6]], [7]) == ["[5, 6]/7"]
    assert fake_backend(None, calls).generate([], []) == [] and len(calls) == 1


@given(st.integers(0, 40), st.integers(0, 40), st.integers(1, 9))
def test_chunk_slices_cover_the_share_in_as_many_calls_as_the_busiest_rank(a, b, chunk):
    n_local, n_most = min(a, b), max(a, b)
    slices = chunk_slices(n_local, n_most, chunk)
    assert len(slices) == math.ceil(n_most / chunk)
    assert [i for sl in slices for i in range(n_local)[sl]] == list(range(n_local))
    assert all(sl.stop - sl.start <= chunk for sl in slices)


# --------------------------------------------------------------------------------------------------
# Refit: vLLM's per-bucket warnings are dropped, a weight no bucket loads is reported
# --------------------------------------------------------------------------------------------------
class LoggingFakeLLM:
    """Logs what vLLM 0.32 logs at each in-place reload: one warning per layer the push did not touch, then
    the names of the parameters it did not load (model_executor/model_loader/reload/)."""

    def __init__(self, params: list[str]):
        self.params = params
        self.pushes: list[list[str]] = []

    def collective_rpc(self, method, kwargs):
        assert method == "reload_weights"
        names = [n for n, _ in kwargs["weights_iterator"]]
        self.pushes.append(names)
        layerwise, inplace = (logging.getLogger(n) for n in RELOAD_LOGGERS)
        missing = set(self.params) - set(names)
        for name in sorted(missing):
            layerwise.warning("%s: Failed to load weights", name.rsplit(".", 1)[0])
        if missing:
            inplace.warning("Following weights were not loaded from checkpoint: %s", missing)


PARAMS = ["embed.weight", "layers.0.w", "layers.1.w", "norm.weight"]


def test_bucketed_refit_logs_nothing_and_finds_nothing_missing(vllm_records):  # fixture: conftest.py
    llm = LoggingFakeLLM(PARAMS)
    buckets = [[("embed.weight", torch.zeros(1))], [("layers.0.w", torch.zeros(1)), ("layers.1.w", torch.zeros(1))],
               [("norm.weight", torch.zeros(1))]]
    pushed, never_loaded = push_buckets(llm, iter(buckets))
    assert pushed == PARAMS and never_loaded == set() and len(llm.pushes) == 3
    assert vllm_records == []  # 3 pushes x (3 or 2 layer warnings + 1 summary) dropped
    assert refit_problems(pushed, PARAMS, never_loaded) == []
    logging.getLogger(RELOAD_LOGGERS[0]).warning("%s: Failed to load weights", "Later")  # filter gone after
    assert len(vllm_records) == 1


def test_a_weight_no_bucket_loads_is_reported_and_other_warnings_pass(vllm_records):
    llm = LoggingFakeLLM(PARAMS)
    buckets = [[("embed.weight", torch.zeros(1))], [("layers.0.w", torch.zeros(1)), ("layers.1.w", torch.zeros(1))]]
    pushed, never_loaded = push_buckets(llm, buckets)
    assert never_loaded == {"norm.weight"}
    problems = refit_problems(pushed, PARAMS, never_loaded)
    assert problems == ["never pushed: ['norm.weight']",
                        "vLLM parameters no push loaded (they keep stale weights): ['norm.weight']"]
    assert vllm_records == []
    push_buckets(type("Other", (), {"collective_rpc": lambda self, m, kwargs: logging.getLogger(
        RELOAD_LOGGERS[1]).warning("something else")})(), [[("x", torch.zeros(1))]])
    assert [r.getMessage() for r in vllm_records] == ["something else"]


def test_refit_problems_names_duplicates_and_strangers():
    assert refit_problems(["a", "b"], ["a", "b"], set()) == []
    assert refit_problems(["a", "a", "z"], ["a"], set()) == ["pushed more than once: ['a']",
                                                              "pushed but not an engine parameter: ['z']"]
    many = refit_problems([], [f"p{i:02d}" for i in range(10)], set())
    assert many == ["never pushed: ['p00', 'p01', 'p02', 'p03', 'p04', 'p05', 'p06', 'p07'] and 2 more"]
    assert PARAMS_NOT_LOADED in "Following weights were not loaded from checkpoint: %s"


# --------------------------------------------------------------------------------------------------
# KV cache of the GPU recipes: sized from the step, not from gpu_memory_utilization
# --------------------------------------------------------------------------------------------------
# Qwen2.5-1.5B (config.json of the hub model): 28 layers, 2 KV heads, head size 1536 / 12 = 128, bf16.
QWEN25_15B_BYTES_PER_TOKEN = kv_cache_bytes_per_token(num_layers=28, num_kv_heads=2, head_dim=128, dtype_bytes=2)


@pytest.mark.parametrize("recipe, prompts_per_generation_batch", [
    ("grpo_math_qwen2.5_1.5b_vllm.yaml", lambda g: g.num_prompts_per_step),
    ("dapo_qwen2.5_1.5b.yaml", lambda g: int(g.num_prompts_per_step * g.batch_multiplier)),
])
def test_vllm_recipes_size_the_kv_cache_from_the_step(recipe, prompts_per_generation_batch):
    from grpo.config.load import load_config

    cfg = load_config(str(REPO / "configs" / recipe), [])
    v = cfg.policy.generation.vllm_cfg
    world = cfg.cluster.gpus_per_node * cfg.cluster.num_nodes
    expected = kv_cache_bytes_for_step(prompts_per_generation_batch(cfg.grpo), cfg.grpo.num_generations_per_prompt,
                                       cfg.policy.max_total_sequence_length, world // v.tensor_parallel_size,
                                       QWEN25_15B_BYTES_PER_TOKEN)
    assert v.kv_cache_memory_bytes == expected
    assert v.kv_cache_memory_bytes < 12 * 2**30  # not the ~35 GiB gpu_memory_utilization=0.5 reserved
    assert v.sleep_level == 1


def test_kv_cache_arithmetic():
    assert QWEN25_15B_BYTES_PER_TOKEN == 28 * 2 * 2 * 128 * 2
    # 2 KV heads over 4 GPUs: one (replicated) head each
    assert kv_cache_bytes_per_token(28, 2, 128, 2, tensor_parallel_size=4) == QWEN25_15B_BYTES_PER_TOKEN // 2
    assert kv_cache_bytes_per_token(32, 8, 128, 2, tensor_parallel_size=2) == 2 * 32 * 4 * 128 * 2
    one = kv_cache_bytes_for_step(1, 1, 1, 1, bytes_per_token=1, headroom=1.0)
    assert one == 2**20  # whole MiB
    assert kv_cache_bytes_for_step(3, 3, 100, 2, 1000, headroom=1.0) == math.ceil(5 * 100 * 1000 / 2**20) * 2**20


def qwen25_15b_config():
    """Qwen2.5-1.5B's shape (its hub config.json), built locally: nothing is downloaded."""
    from transformers import Qwen2Config

    return Qwen2Config(num_hidden_layers=28, hidden_size=1536, num_attention_heads=12, num_key_value_heads=2,
                       intermediate_size=8960, vocab_size=151936)


@pytest.mark.parametrize("recipe", ["grpo_math_qwen2.5_1.5b_vllm.yaml", "dapo_qwen2.5_1.5b.yaml"])
def test_the_engine_sizes_the_kv_cache_of_the_recipes_from_the_model_config(recipe):
    """The sizing the engine checks at start (`step_kv_cache_bytes`, from the run and the model's HF config) is
    what the recipes set; a step grown past it warns; the recipes' start-up gate covers weights + KV cache."""
    from grpo.config.load import load_config

    cfg = load_config(str(REPO / "configs" / recipe), [])
    v = cfg.policy.generation.vllm_cfg
    world = cfg.cluster.gpus_per_node * cfg.cluster.num_nodes
    assert step_kv_cache_bytes(cfg, qwen25_15b_config(), world) == v.kv_cache_memory_bytes
    assert kv_cache_shortfall(cfg, qwen25_15b_config(), world) is None
    bigger = cfg.model_copy(deep=True)
    bigger.grpo.num_prompts_per_step *= 4
    warning = kv_cache_shortfall(bigger, qwen25_15b_config(), world)
    assert warning and f"suggests {step_kv_cache_bytes(bigger, qwen25_15b_config(), world)}" in warning
    # vLLM refuses to start unless free >= gpu_memory_utilization x total, also with the KV cache set: the gate
    # must pass with the trainer's ~10 GB on an 80 GB GPU and still cover vLLM's own weights and cache
    total, weights = 80 * 10**9, 2 * 1.54e9
    assert startup_memory_problem(total - 10 * 10**9, total, v.gpu_memory_utilization) is None
    assert v.gpu_memory_utilization * total > weights + v.kv_cache_memory_bytes


def test_startup_memory_problem_names_the_gate_and_the_value_that_passes():
    msg = startup_memory_problem(30 * 2**30, 80 * 2**30, 0.5)
    assert "0.5 x 80.0 = 40.0 GiB" in msg and "30.0 GiB free" in msg and "at most 0.38" in msg
    assert startup_memory_problem(40 * 2**30, 80 * 2**30, 0.5) is None
