#!/usr/bin/env python
"""Time TRL's GRPOTrainer on the benchmark workload and print one JSON line, as bench_step.py does for grpo-ds.

    python -m venv .venv-trl && .venv-trl/bin/pip install -r bench/requirements-trl.txt
    .venv-trl/bin/python bench/trl_step.py --workload bench_workload --model bench --steps 6
    .venv-trl/bin/python bench/trl_step.py --workload bench_workload --model bench --steps 6 --lora
    .venv-trl/bin/python bench/trl_step.py --workload bench_workload --model bench --steps 4 --max-completion-length 256

The settings are the workload's (bench/WORKLOAD.md), in TRL's names: 8 prompts x 8 generations, one
optimizer step per generation batch (no old-logprob pass), 32 new tokens (--max-completion-length; the long-tail
workload's: 256) at temperature 1, beta 0.04 with a
separate reference model, loss_type "grpo", group-std scaling, AdamW lr 1e-6 with linear decay, grad clip 1,
fp32 on the CPU, no gradient checkpointing, no saving, logging or evaluation in the loop.

Step k's time runs from the end of step k-1 to the end of step k (step 1 from its beginning), so it covers the
whole step: generation, reward, reference forward, policy forward and backward, AdamW. Printed: ``step_s``
(every step), ``completion_tokens_per_s`` (median over steps 2..N of kept completion tokens / step time),
``peak_rss_mb`` and ``time_to_first_step_s`` (from the kernel's process start to the end of step 1), the
same keys bench_step.py prints, so compare_trl.py reads both alike. ``--lora``: ``peft_config`` = the LoraConfig
of bench_step.py --lora (r 8, alpha 32, "all-linear", dropout 0); TRL then takes the reference logprobs from the
policy with its adapters disabled (no second copy), as grpo-ds does.
"""

import argparse
import json
import os
import re
import resource
import statistics
import time


def process_start_time() -> float:
    """Wall-clock time at which the kernel started this process (before the interpreter loaded)."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


T_START = process_start_time()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="bench_workload")
    ap.add_argument("--model", choices=["tiny", "bench"], default="bench")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-completion-length", type=int, default=32, help="the long-tail workload's: 256")
    ap.add_argument("--lora", action="store_true", help="train a peft LoraConfig (r 8, alpha 32, all-linear)")
    args = ap.parse_args()
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    os.environ.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")

    import tempfile

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(f"{args.workload}/tokenizer")
    with open(f"{args.workload}/data/train.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]

    completion_tokens = []      # kept completion tokens of each step (one reward call per step here)

    def addition_reward(completions, answer, completion_ids=None, **_):
        completion_tokens.append(sum(len(c) for c in completion_ids or []))
        firsts = [re.search(r"-?\d+", text) for text in completions]
        return [float(m is not None and int(m.group()) == int(a)) for m, a in zip(firsts, answer)]

    step_ends = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *_, **__):
            if not step_ends:
                step_ends.append(time.time())       # step 1 is timed from its beginning

        def on_step_end(self, *_, **__):
            step_ends.append(time.time())

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_step_"), per_device_train_batch_size=64,
        gradient_accumulation_steps=1, num_generations=8, num_iterations=1, max_steps=args.steps,
        use_vllm=False, max_completion_length=args.max_completion_length, temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0,
        learning_rate=1e-6, lr_scheduler_type="linear", max_grad_norm=1.0, beta=0.04, epsilon=0.2,
        loss_type="grpo", scale_rewards="group", bf16=False, fp16=False, use_cpu=True,
        gradient_checkpointing=False, model_init_kwargs={"dtype": torch.float32}, save_strategy="no",
        eval_strategy="no", report_to="none", log_completions=False, disable_tqdm=True, logging_steps=10**9,
        dataloader_num_workers=0, seed=42, data_seed=42)
    peft_config = None
    if args.lora:
        from peft import LoraConfig
        peft_config = LoraConfig(r=8, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", bias="none",
                                 task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=f"{args.workload}/models/{args.model}", reward_funcs=addition_reward,
                          args=config, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                          callbacks=[StepTimes()], peft_config=peft_config)
    trainer.train()

    step_s = [b - a for a, b in zip(step_ends, step_ends[1:])]
    tok_s = [n / s for n, s in zip(completion_tokens[1:], step_s[1:])]
    print(json.dumps({
        "trainer": "trl", "model": args.model, "lora": args.lora,
        "max_new_tokens": args.max_completion_length, "step_s": step_s,
        "step_s_median": statistics.median(step_s[1:]) if len(step_s) > 1 else None,
        "completion_tokens_per_s": statistics.median(tok_s) if tok_s else None,
        "completion_tokens_per_step": completion_tokens,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "time_to_first_step_s": step_ends[1] - T_START,
    }))


if __name__ == "__main__":
    main()
