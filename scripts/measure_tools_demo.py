"""Measure the CPU tools demo's starting policy: reward with the calculator tool vs. with tools disabled.

    OMP_NUM_THREADS=1 python scripts/measure_tools_demo.py [--model DIR] [--rows 64] [--samples 4]

Builds the starting policy (`grpo.envs.calculator.make_calculator_demo_model`, timed) unless ``--model``
is given, then samples validation rows at temperature 1 with a minimal multi-turn sampler (HF generate on
the plain-text conversation: prompt, assistant turns and tool results concatenated; stop at the format's
closing tag or <eos>) against the ToolEnvironment, with tools and with ``disable_tools=True`` (the
ablation). A measurement, not a test: the training loops have their own multi-turn rollout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpo.envs.calculator import calculator_rows, make_calculator_demo_model  # noqa: E402
from grpo.envs.interface import check_return  # noqa: E402
from grpo.envs.tools import ToolEnvironment  # noqa: E402
from grpo.generation.base import cut_completion  # noqa: E402


def sample_rollouts(model, tok, env, rows: list[dict], samples: int, max_turns: int = 3, max_new_tokens: int = 24,
                    seed: int = 0) -> dict:
    """Mean reward (0 for samples still talking after ``max_turns``), pass@``samples``, env metrics, an example."""
    torch.manual_seed(seed)
    convs = [{"ids": tok(r["question"])["input_ids"], "log": [{"role": "user", "content": r["question"]}],
              "meta": {**r, "task_name": "calculator"}, "reward": 0.0, "done": False}
             for r in rows for _ in range(samples)]
    eos, pad = tok.eos_token_id, tok.pad_token_id
    for _ in range(max_turns):
        active = [c for c in convs if not c["done"]]
        if not active:
            break
        width = max(len(c["ids"]) for c in active)
        input_ids = torch.tensor([[pad] * (width - len(c["ids"])) + c["ids"] for c in active])
        attention = (torch.arange(width)[None, :] >= torch.tensor([width - len(c["ids"]) for c in active])[:, None])
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=attention.long(), do_sample=True, temperature=1.0,
                                 top_p=1.0, top_k=0, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad,
                                 stop_strings=env.stop_strings or None, tokenizer=tok)
        for c, row in zip(active, out[:, width:].tolist()):
            n, _ = cut_completion(row, max_new_tokens, [eos], env.stop_strings, tok.decode)
            new = row[:n]
            c["ids"] = c["ids"] + new
            c["log"].append({"role": "assistant", "content": tok.decode([t for t in new if t != eos])})
        ret = check_return(env.step([c["log"] for c in active], [c["meta"] for c in active]), len(active))
        for i, c in enumerate(active):
            c["reward"] += float(ret.rewards[i])
            c["meta"] = ret.metadata[i]
            if ret.terminateds[i]:
                c["done"] = True
                continue
            for message in ret.observations[i]:
                c["log"].append(message)
                c["ids"] = c["ids"] + tok(message["content"], add_special_tokens=False)["input_ids"]
    rewards = torch.tensor([c["reward"] for c in convs]).view(len(rows), samples)
    _, metrics = env.global_post_process_and_metrics([])
    return {"reward": rewards.mean().item(), "pass_at_k": (rewards.max(dim=1).values > 0).float().mean().item(),
            "frac_groups_with_signal": (rewards.std(dim=1) > 0).float().mean().item(),
            "tool_calls_per_sample": metrics.get("tool_calls_per_sample"),
            "samples_with_tool_calls": metrics.get("samples_with_tool_calls"),
            "tool_error_rate": metrics.get("tool_error_rate"),
            "example": tok.decode(convs[0]["ids"], skip_special_tokens=False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a built starting policy (default: build one into a temp dir)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = args.model
    if model_dir is None:
        model_dir = tempfile.mkdtemp(prefix="calc-demo-")
        start = time.perf_counter()
        make_calculator_demo_model(model_dir, seed=args.seed)
        print(json.dumps({"sft_s": round(time.perf_counter() - start, 1), "model": model_dir}), flush=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rows = calculator_rows(args.rows, seed=42, split="val")
    for name, disable in (("tools", False), ("tools_disabled", True)):
        env = ToolEnvironment(["grpo.envs.calculator:calc"], "grpo.envs.arithmetic:arithmetic_reward",
                              tool_call_format="compact", timeout_s=10, num_workers=1, disable_tools=disable)
        start = time.perf_counter()
        result = sample_rollouts(model, tok, env, rows, args.samples, seed=args.seed)
        env.shutdown()
        print(json.dumps({"variant": name, "seconds": round(time.perf_counter() - start, 1), **result}), flush=True)


if __name__ == "__main__":
    main()
