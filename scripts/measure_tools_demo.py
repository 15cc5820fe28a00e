"""Measure the CPU tools demo's starting policy: reward with the calculator tool vs. with tools disabled.

    OMP_NUM_THREADS=1 python scripts/measure_tools_demo.py [--model DIR] [--rows 64] [--samples 4]

Builds the starting policy (`grpo.tasks.calculator.make_calculator_demo_model`, timed) unless ``--model``
is given, then samples validation rows at temperature 1 with a minimal multi-turn sampler (HF generate on
the plain-text conversation: prompt, assistant turns and tool results concatenated; stop at the format's
closing tag or <eos>) against the ToolEnvironment, with tools and with ``disable_tools=True`` (the
ablation). ``--pg-steps N`` then runs N steps of a bare group-normalised policy gradient (no KL, no
clipping, one update per batch) for each variant and measures again: a check that the task is
learnable with the tool and not without. A measurement, not a test: the training loops have their own
multi-turn rollout and GRPO.
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

from grpo.tasks.calculator import calculator_rows, make_calculator_demo_model  # noqa: E402
from grpo.tasks.interface import check_return  # noqa: E402
from grpo.tasks.tools import ToolEnvironment  # noqa: E402
from grpo.system.generation.base import cut_completion  # noqa: E402


def sample_rollouts(model, tok, env, rows: list[dict], samples: int, max_turns: int = 3, max_new_tokens: int = 24,
                    seed: int = 0) -> tuple[dict, list[dict]]:
    """Mean reward (0 for samples still talking after ``max_turns``), pass@``samples``, env metrics, an
    example; and the conversations (``ids``, ``mask``: 1 on generated tokens, ``reward``)."""
    torch.manual_seed(seed)
    convs = [{"ids": tok(r["question"])["input_ids"], "log": [{"role": "user", "content": r["question"]}],
              "meta": {**r, "task_name": "calculator"}, "reward": 0.0, "done": False}
             for r in rows for _ in range(samples)]
    for c in convs:
        c["mask"] = [0] * len(c["ids"])
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
            c["ids"], c["mask"] = c["ids"] + new, c["mask"] + [1] * len(new)
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
                obs = tok(message["content"], add_special_tokens=False)["input_ids"]
                c["ids"], c["mask"] = c["ids"] + obs, c["mask"] + [0] * len(obs)
    rewards = torch.tensor([c["reward"] for c in convs]).view(len(rows), samples)
    _, metrics = env.global_post_process_and_metrics([])
    return {"reward": rewards.mean().item(), "pass_at_k": (rewards.max(dim=1).values > 0).float().mean().item(),
            "frac_groups_with_signal": (rewards.std(dim=1) > 0).float().mean().item(),
            "tool_calls_per_sample": metrics.get("tool_calls_per_sample"),
            "samples_with_tool_calls": metrics.get("samples_with_tool_calls"),
            "tool_error_rate": metrics.get("tool_error_rate"),
            "example": tok.decode(convs[0]["ids"], skip_special_tokens=False)}, convs


def policy_gradient(model, tok, env, rows: list[dict], steps: int, prompts: int = 16, samples: int = 8,
                    lr: float = 1e-3, seed: int = 0) -> None:
    """``steps`` updates of -mean_t(A * logprob) over generated tokens, A = group-normalised reward."""
    import random

    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for step in range(steps):
        _, convs = sample_rollouts(model, tok, env, rng.sample(rows, prompts), samples, seed=seed + 1 + step)
        rewards_b = torch.tensor([c["reward"] for c in convs])
        groups = rewards_b.view(prompts, samples)
        adv_b = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).view(-1)
        width = max(len(c["ids"]) for c in convs)
        ids_bt = torch.tensor([c["ids"] + [tok.pad_token_id] * (width - len(c["ids"])) for c in convs])
        mask_bt = torch.tensor([c["mask"] + [0] * (width - len(c["mask"])) for c in convs], dtype=torch.float32)
        attention_bt = torch.tensor([[1] * len(c["ids"]) + [0] * (width - len(c["ids"])) for c in convs])
        model.train()
        logits = model(input_ids=ids_bt, attention_mask=attention_bt).logits[:, :-1]
        logprobs_bt = torch.log_softmax(logits.float(), -1).gather(-1, ids_bt[:, 1:, None]).squeeze(-1)
        loss = -(adv_b[:, None] * logprobs_bt * mask_bt[:, 1:]).sum() / mask_bt[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.eval()
        print(json.dumps({"pg_step": step, "train_reward": rewards_b.mean().item()}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a built starting policy (default: build one into a temp dir)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pg-steps", type=int, default=0, help="policy-gradient steps per variant (0: none)")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = args.model
    if model_dir is None:
        model_dir = tempfile.mkdtemp(prefix="calc-demo-")
        start = time.perf_counter()
        make_calculator_demo_model(model_dir, seed=args.seed)
        print(json.dumps({"sft_s": round(time.perf_counter() - start, 1), "model": model_dir}), flush=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = calculator_rows(args.rows, seed=42, split="val")
    for name, disable in (("tools", False), ("tools_disabled", True)):
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        env = ToolEnvironment(["grpo.tasks.calculator:calc"], "grpo.tasks.arithmetic:arithmetic_reward",
                              tool_call_format="compact", timeout_s=10, num_workers=1, disable_tools=disable)
        start = time.perf_counter()
        result, _ = sample_rollouts(model, tok, env, rows, args.samples, seed=args.seed)
        print(json.dumps({"variant": name, "seconds": round(time.perf_counter() - start, 1), **result}), flush=True)
        if args.pg_steps:
            start = time.perf_counter()
            policy_gradient(model, tok, env, calculator_rows(512, seed=42, split="train"), args.pg_steps, seed=args.seed)
            result, _ = sample_rollouts(model, tok, env, rows, args.samples, seed=args.seed)
            print(json.dumps({"variant": name, "after_pg_steps": args.pg_steps,
                              "seconds": round(time.perf_counter() - start, 1), **result}), flush=True)
        env.shutdown()


if __name__ == "__main__":
    main()
