#!/usr/bin/env python
"""The logprob pass and the training forward + backward of one GRPO batch, padded vs packed vs dynamically batched.

    python bench/bench_packing.py --cap 256                 # long-tail completions (the issue-24 workload's cap)
    python bench/bench_packing.py --cap 32 --reps 3         # the bench workload's lengths

The bench model of bench/WORKLOAD.md (built into --workload if missing), 8 prompts x 8 completions: prompts of
22-25 random tokens, completions of geometric(1/58) length capped at --cap (a random model's end-of-sequence rate
over the 58-token vocabulary). Modes, alternated rep by rep in one process (each the same rows):

    off_share  padded micro-batch, each distinct prompt run once (policy.shared_prompt_forward)
    off        padded micro-batch
    pack       policy.sequence_packing (the cheapest of packed / shared / padded per micro-batch)
    dyn_share  policy.dynamic_batching with shared prompts

Budgets are NeMo-RL's defaults: 64 rows x (cap + 32) tokens. Prints one JSON line: min and median seconds per mode.
"""

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default=str(REPO / "bench_workload"))
    ap.add_argument("--cap", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--modes", default="off_share,pack,dyn_share,off")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(REPO / "bench"))
    from bench_step import build_workload
    from grpo.system.engines import FrozenModel
    from grpo.system.shared_prefix import prompt_lengths
    from grpo.system.training import TokenBatching, logprob_forward, compute_logprobs, token_micro_batches
    from tests.helpers.batches import train_batch

    torch.set_num_threads(args.threads)
    build_workload(Path(args.workload))
    rng = random.Random(0)
    rows, token_masks = [], []
    for _ in range(8):
        p = rng.randint(22, 25)
        prompt = [rng.randint(3, 57) for _ in range(p)]
        for _ in range(8):
            c = 1
            while c < args.cap and rng.random() > 1 / 58:
                c += 1
            rows.append(prompt + [rng.randint(3, 57) for _ in range(c)])
            token_masks.append([0] * p + [1] * c)
    T = max(map(len, rows))
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    tmask = torch.tensor([m + [0] * (T - len(m)) for m in token_masks], dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(f"{args.workload}/models/bench", dtype=torch.float32)
    engine = FrozenModel(model, torch.device("cpu"))
    budget = len(rows) * (args.cap + 32)
    batch = train_batch(input_ids_bt=ids, attention_mask_bt=mask, token_mask_bt=tmask)
    modes = args.modes.split(",")
    times = {m: {"logprobs": [], "train": []} for m in modes}
    for _ in range(args.reps):
        for mode in modes:
            share = mode.endswith("share") or mode == "pack"   # packing picks sharing where that is cheaper
            batching = {"off": None, "pack": TokenBatching(True, budget),
                        "dyn": TokenBatching(False, budget)}[mode.split("_")[0]]
            model.eval().requires_grad_(False)
            t = time.perf_counter()
            compute_logprobs(engine, ids, mask, 1.0, len(rows), prompt_lens_b=prompt_lengths(tmask, mask) if share
                             else None, batching=batching)
            times[mode]["logprobs"].append(time.perf_counter() - t)
            model.train().requires_grad_(True)
            t = time.perf_counter()
            for mb in [batch] if batching is None else token_micro_batches(batch, batching):
                lens = prompt_lengths(mb.token_mask_bt, mb.attention_mask_bt) if share else None
                lp, _, _ = logprob_forward(engine, mb.input_ids_bt, mb.attention_mask_bt, prompt_lens_b=lens,
                                    packing=batching.packing() if batching is not None else None)
                (lp * mb.token_mask_bt).sum().backward()
            times[mode]["train"].append(time.perf_counter() - t)
            model.zero_grad(set_to_none=True)
    out = {"cap": args.cap, "T": T, "tokens": int(mask.sum()), "padded_tokens": ids.numel(), "budget": budget}
    for mode in modes:
        out[mode] = {k: {"min": round(min(v), 3), "median": round(statistics.median(v), 3)} for k, v in times[mode].items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
