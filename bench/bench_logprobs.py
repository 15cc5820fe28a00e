"""Peak memory and time of token logprobs, forward + backward: chunked ``token_logprobs`` vs naive.

    python bench/bench_logprobs.py                       # B=8 T=512 V=32000, fp32, CUDA if present
    python bench/bench_logprobs.py --dtype bfloat16 --V 151936

Each variant runs in a fresh subprocess (so one cannot inherit the other's allocator state). The
peak is measured over the forward + backward only, after the logits exist:
  - CUDA: torch.cuda.max_memory_allocated() − memory allocated before the forward;
  - CPU:  ru_maxrss after − ru_maxrss before (the process high-water mark; a warm-up on a small
    input first, so thread pools and kernels are not counted).
Both variants include the gradient of the logits (one [B, T, V] tensor in the logits' dtype).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def naive_logprobs(logits, tokens, temperature: float):
    import torch

    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


def run_variant(variant: str, B: int, T: int, V: int, dtype_name: str, device: str, chunk_size) -> dict:
    """Forward + backward of one variant in this process; returns its peak extra memory and time."""
    import torch

    from grpo.logprobs import token_logprobs

    dtype = getattr(torch, dtype_name)
    fn = {
        "chunked": lambda x, tok: token_logprobs(x, tok, temperature=0.7, chunk_size=chunk_size),
        "naive": lambda x, tok: naive_logprobs(x, tok, 0.7),
    }[variant]

    def step(b, t, v):
        logits = torch.randn(b, t, v, device=device, dtype=dtype, requires_grad=True)
        tokens = torch.randint(0, v, (b, t), device=device)
        return logits, tokens

    warm_logits, warm_tokens = step(2, 8, 64)  # warm-up: kernels, thread pools
    fn(warm_logits, warm_tokens).sum().backward()
    torch.manual_seed(0)  # same logits in both subprocesses: lp_sum must agree
    logits, tokens = step(B, T, V)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    lp = fn(logits, tokens)
    lp.sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    seconds = time.perf_counter() - start
    return {"peak_mib": round(peak / 2**20, 1), "seconds": round(seconds, 3),
            "lp_sum": round(float(lp.sum()), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--B", type=int, default=8)
    parser.add_argument("--T", type=int, default=512)
    parser.add_argument("--V", type=int, default=32000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--chunk-size", type=int, default=None, help="rows per chunk (default: 2^24 / V)")
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # internal: run one variant
    args = parser.parse_args()

    if args.variant is not None:
        print(json.dumps(run_variant(args.variant, args.B, args.T, args.V, args.dtype, args.device, args.chunk_size)))
        return

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    result = {"B": args.B, "T": args.T, "V": args.V, "dtype": args.dtype, "device": device,
              "chunk_size": args.chunk_size,
              "logits_mib": round(args.B * args.T * args.V * torch.tensor([], dtype=getattr(torch, args.dtype))
                                  .element_size() / 2**20, 1)}
    for variant in ("chunked", "naive"):
        cmd = [sys.executable, __file__, "--variant", variant, "--B", str(args.B), "--T", str(args.T),
               "--V", str(args.V), "--dtype", args.dtype, "--device", device]
        if args.chunk_size is not None:
            cmd += ["--chunk-size", str(args.chunk_size)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
        result[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    result["peak_ratio_naive_over_chunked"] = round(
        result["naive"]["peak_mib"] / max(result["chunked"]["peak_mib"], 1e-9), 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
