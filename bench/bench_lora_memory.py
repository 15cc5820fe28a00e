#!/usr/bin/env python
"""Peak RSS of one bare forward + backward of the bench model, plain or with peft's LoRA, no trainer around it.

    python bench/bench_lora_memory.py full; python bench/bench_lora_memory.py lora

One process per case (ru_maxrss only grows). 64 sequences of 57 tokens, as one bench step's training micro-batch;
LoRA as bench_step.py --lora (r 8, alpha 32, all-linear, dropout 0). It separates what the adapters cost in
activations from the weight state (gradients, Adam moments, a reference copy) that they save.
"""

import resource
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

WORKLOAD = Path(__file__).resolve().parents[1] / "bench_workload"     # bench/make_workload.py --dir bench_workload


def main() -> None:
    case = sys.argv[1] if len(sys.argv) > 1 else "full"
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(WORKLOAD / "models" / "bench", dtype=torch.float32)
    if case == "lora":
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    ids = torch.randint(3, 58, (64, 57))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    model(input_ids=ids).logits.log_softmax(-1).mean().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{case}: rss before the forward {before:.0f} MB, peak after forward + backward {peak:.0f} MB")


if __name__ == "__main__":
    main()
