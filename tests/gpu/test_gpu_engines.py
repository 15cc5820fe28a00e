"""GPU only: DeepSpeed engines on CUDA (NCCL, one rank) over a ~9M-parameter Llama built locally: fp32 gradient
accumulation under bf16 ZeRO-3, the optimizer offload of the vLLM backend
(policy.generation.vllm_cfg.offload_optimizer_during_generation) on ZeRO-1/2/3, and bf16 against fp32 on fixed
batches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from grpo.system import engines, offload, weights
from grpo.system.training import train_on_batch
from grpo.config import MasterConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers.dist_train_step import batch_loss, make_batch  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
ZERO3 = "ds_configs/zero3.json"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo.tasks.toy import build_char_tokenizer, save_char_tokenizer

    out = str(tmp_path_factory.mktemp("llama9m"))
    tok = build_char_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, intermediate_size=1024, max_position_embeddings=256,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    save_char_tokenizer(tok, out)
    return out


def make_cfg(model_dir: str, precision: str, deepspeed_config: str = "auto") -> MasterConfig:
    """``deepspeed_config``: "auto" picks by world size (one rank: no ZeRO in fp32, ZeRO-1 in bf16); the ZeRO-3
    checks name ds_configs/zero3.json, since one GPU never gets ZeRO-3 from "auto"."""
    return MasterConfig.model_validate({
        "policy": {"model_name": model_dir, "precision": precision, "train_global_batch_size": 8,
                   "train_micro_batch_size": 2, "logprob_batch_size": 4, "max_grad_norm": 1.0,
                   "optimizer": {"lr": 1e-3}, "deepspeed_config": deepspeed_config},
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4}})


def train_steps(engine, steps: range) -> list[dict]:
    """train_on_batch over `dist_train_step.make_batch(step)`: 4 micro-batches of 2 rows each."""
    out = []
    for step in steps:
        batch = make_batch(step, engine.module.config.vocab_size)
        tokens = float(batch.token_mask_bt.sum())
        mbs = [batch.select(slice(i, i + 2)) for i in range(0, 8, 2)]
        out.append(train_on_batch(engine, mbs, lambda lp, mb: (batch_loss(lp.float(), mb, tokens), {})))
    return out


def check_zero3_bf16_accumulates_in_fp32(model_dir: str) -> None:
    """ZeRO-3 in bf16: DeepSpeed sums micro-batch gradients in an fp32 buffer on the engine's device, and two
    steps are finite. Also run on the CPU (tests/e2e/test_gpu_check.py), so this file cannot rot unseen."""
    engine = engines.build_policy_engine(make_cfg(model_dir, "bfloat16", ZERO3), 1, total_optimizer_steps=2)
    assert engine.zero_optimization_stage() == 3
    assert engine.get_data_types() == (torch.bfloat16, torch.float32)
    buffer = engine.optimizer.grad_partitions_flat_buffer
    assert buffer.dtype == torch.float32 and buffer.device.type == engine.device.type
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all() for r in train_steps(engine, range(2)))


def check_zero3_refit_gather_equals_the_export(model_dir: str, out_dir: str) -> None:
    """After a bf16 ZeRO-3 step, what the vLLM refit pushes (`grpo.system.weights.iter_gathered_params`, bucketed
    layer gathers) equals the consolidated HF export (the checkpoint a user loads) bit for bit, every exported
    tensor pushed. Also run on the CPU (tests/e2e/test_gpu_check.py)."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    engine = engines.build_policy_engine(make_cfg(model_dir, "bfloat16", ZERO3), 1, total_optimizer_steps=2)
    train_steps(engine, range(1))
    pushed = {n: t.detach().cpu().clone() for b in weights.iter_gathered_params(engine, 2**16) for n, t in b}
    weights.export_hf(engine, out_dir, AutoTokenizer.from_pretrained(model_dir))
    exported = load_file(str(Path(out_dir) / "model.safetensors"))
    assert exported and set(exported) <= set(pushed), sorted(set(exported) - set(pushed))
    differ = [n for n, t in exported.items() if t.dtype != pushed[n].dtype or not torch.equal(t, pushed[n])]
    assert differ == [], differ


def test_bf16_zero3_engine_accumulates_gradients_in_fp32(model_dir, nccl_group):
    check_zero3_bf16_accumulates_in_fp32(model_dir)


def test_zero3_refit_gather_equals_the_export_bit_for_bit(model_dir, nccl_group, tmp_path):
    check_zero3_refit_gather_equals_the_export(model_dir, str(tmp_path / "export"))


@pytest.mark.parametrize("deepspeed_config", ["auto", "ds_configs/zero2.json", ZERO3],
                         ids=["zero1-bf16-optimizer", "zero2", "zero3"])
def test_optimizer_offload_frees_the_gpu_and_training_goes_on_unchanged(model_dir, nccl_group, deepspeed_config):
    """auto on one GPU in bf16 is ZeRO-1 with DeepSpeed's BF16_Optimizer (parked in place by grpo.system.offload); ZeRO-2
    uses DeepSpeed's offload_states; ZeRO-3 moves the masters and moments itself (torch AdamW)."""
    cfg = make_cfg(model_dir, "bfloat16", deepspeed_config)
    engine = engines.build_policy_engine(cfg, 1, total_optimizer_steps=3)
    twin = engines.build_policy_engine(cfg, 1, total_optimizer_steps=3)
    train_steps(engine, range(1))
    twin_first = train_steps(twin, range(1))
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    moved = offload.offload_optimizer_states(engine)
    torch.cuda.synchronize()
    freed = before - torch.cuda.memory_allocated()
    assert freed >= 0.95 * 12 * n_params, (freed, n_params)  # fp32 master + two fp32 Adam moments at least
    assert all(b.device.type == "cpu" and b.is_pinned() for _, _, b in moved)
    offload.reload_optimizer_states(engine, moved)
    again = offload.offload_optimizer_states(engine, moved)  # the pinned host buffers are reused
    assert [b.data_ptr() for _, _, b in again] == [b.data_ptr() for _, _, b in moved]
    offload.reload_optimizer_states(engine, again)
    ours, theirs = train_steps(engine, range(1, 3)), train_steps(twin, range(1, 3))
    assert twin_first and [r["loss"] for r in ours] == pytest.approx([r["loss"] for r in theirs], rel=1e-3)
    a = {n: t.float().clone() for b in weights.iter_gathered_params(engine) for n, t in b}
    b = {n: t.float().clone() for b in weights.iter_gathered_params(twin) for n, t in b}
    for n in a:
        torch.testing.assert_close(a[n], b[n], atol=2e-2, rtol=2e-2)


def test_bf16_and_fp32_agree_on_the_same_batches(model_dir, nccl_group):
    """Same checkpoint, same 3 batches: bf16 losses within 3% of fp32 (bf16 keeps ~3 significant digits)."""
    fp32 = train_steps(engines.build_policy_engine(make_cfg(model_dir, "float32"), 1, 3), range(3))
    bf16 = train_steps(engines.build_policy_engine(make_cfg(model_dir, "bfloat16"), 1, 3), range(3))
    assert [r["loss"] for r in bf16] == pytest.approx([r["loss"] for r in fp32], rel=3e-2, abs=1e-3)
    assert [r["grad_norm"] for r in bf16] == pytest.approx([r["grad_norm"] for r in fp32], rel=5e-2)
