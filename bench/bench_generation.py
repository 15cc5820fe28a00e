#!/usr/bin/env python
"""Time the hf backend's two decode loops on the benchmark workload's prompts, alternating in one process.

    python bench/bench_generation.py --model bench --max-new-tokens 256 --rounds 3      # the long-tail workload
    python bench/bench_generation.py --model tiny --max-new-tokens 32 --rounds 5        # the tiny one

One generation call = one GRPO step's generation: 8 prompts x 8 samples at temperature 1, seeds as a step's
(`grpo.system.rollout.sample_seed`). ``policy.generation.hf_drop_finished_rows`` true (the own loop: ended rows
leave the batch) and false (transformers' generate) alternate, each round on new seeds; both sample the same
completions, which the script checks. Prints one JSON line: per-variant seconds per call, completion tokens.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default=str(REPO / "bench_workload"))
    ap.add_argument("--model", default="bench", choices=["bench", "tiny"])
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.config import MasterConfig
    from grpo.system.generation.hf import HFGeneration
    from grpo.system.rollout import sample_seed

    torch.set_num_threads(args.threads)
    from bench.bench_step import build_workload  # the one builder of the shared workload (no download)

    build_workload(Path(args.workload))
    tok = AutoTokenizer.from_pretrained(f"{args.workload}/tokenizer")
    with open(f"{args.workload}/data/train.jsonl") as f:
        prompts = [tok(json.loads(line)["prompt"])["input_ids"] for line in f][:8]
    prompts = [p for p in prompts for _ in range(8)]
    model = AutoModelForCausalLM.from_pretrained(f"{args.workload}/models/{args.model}", dtype=torch.float32)
    gens = {}
    for drop in (True, False):
        cfg = MasterConfig.model_validate({"policy": {
            "model_name": "unused", "precision": "float32", "generation_batch_size": 64,
            "max_total_sequence_length": 32 + args.max_new_tokens,
            "generation": {"max_new_tokens": args.max_new_tokens, "hf_drop_finished_rows": drop}}}).policy
        gens[drop] = HFGeneration(cfg, tok, model.config, "cpu", model=model)
    times = {True: [], False: []}
    tokens = []
    for r in range(args.rounds):
        seeds = [sample_seed(42, r, i) for i in range(len(prompts))]
        outs = {}
        for drop in ((True, False) if r % 2 == 0 else (False, True)):
            t0 = time.perf_counter()
            outs[drop] = gens[drop].generate(prompts, seeds)
            times[drop].append(time.perf_counter() - t0)
        lens = [len(o.completion_ids) for o in outs[True]]
        same = sum(a.completion_ids == b.completion_ids for a, b in zip(outs[True], outs[False]))
        tokens.append({"sum": sum(lens), "max": max(lens), "same_completions": same})
        print(f"round {r + 1}: drop {times[True][-1]:.2f} s, generate {times[False][-1]:.2f} s, {tokens[-1]}",
              file=sys.stderr, flush=True)
    print(json.dumps({"model": args.model, "max_new_tokens": args.max_new_tokens, "rows": len(prompts),
                      "drop_finished_s": [round(t, 3) for t in times[True]],
                      "generate_s": [round(t, 3) for t in times[False]],
                      "ratio_median": round(statistics.median(times[True]) / statistics.median(times[False]), 3),
                      "tokens": tokens}))


if __name__ == "__main__":
    main()
