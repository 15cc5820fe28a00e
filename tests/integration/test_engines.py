"""grpo/system/engines.py: DeepSpeed config filling, LR schedule, ZeRO-3 logprobs, the DP-invariant training
step (1 process vs 2 processes vs plain PyTorch), layer-bucketed gathering and HF export.

The engines run for real (ZeRO-3, gloo, fp32) on a tiny Llama; the process group of this pytest
process has one rank; the 2-rank run is a torchrun subprocess.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch

from grpo.system import ds_config, engines, offload, weights
from grpo.system.dist import init_distributed
from grpo.system.training import compute_logprobs, train_on_batch
from grpo.config import MasterConfig
from grpo.tasks.toy import build_char_tokenizer, save_tiny_model

from tests.helpers import dist_train_step
from tests.helpers.batches import train_batch

REPO = Path(__file__).resolve().parents[2]
DS_CONFIGS = sorted((REPO / "ds_configs").glob("*.json"))


def make_cfg(model_dir="unused", **policy) -> MasterConfig:
    base = {"model_name": model_dir, "precision": "float32", "train_global_batch_size": 8,
            "train_micro_batch_size": 2, "logprob_batch_size": 3, "max_grad_norm": 0.5,
            "deepspeed_config": "ds_configs/zero3.json", "reference_placement": "zero3"}  # ZeRO-3 even on one rank
    base.update(policy)
    return MasterConfig.model_validate({"policy": base,
                                        "grpo": {"num_prompts_per_step": 12, "num_generations_per_prompt": 4}})


# --------------------------------------------------------------------------------------------------
# ds config
# --------------------------------------------------------------------------------------------------
def _autos(node, prefix=""):
    if isinstance(node, dict):
        return [k for key, v in node.items() for k in _autos(v, f"{prefix}{key}.")]
    return [prefix] if node == "auto" else []


def test_ds_configs_exist_and_keep_auto():
    names = {p.name for p in DS_CONFIGS}
    assert {"zero3.json", "zero3_offload.json", "zero2.json", "zero3_reference.json"} <= names
    for p in DS_CONFIGS:
        raw = json.loads(p.read_text())
        assert raw["train_micro_batch_size_per_gpu"] == "auto", p.name
        assert "optimizer" not in raw and "scheduler" not in raw, p.name


@pytest.mark.parametrize("path", DS_CONFIGS, ids=lambda p: p.name)
@pytest.mark.parametrize("for_training", [True, False])
def test_build_ds_config_fills_every_auto(path, for_training):
    cfg = make_cfg(precision="bfloat16", train_global_batch_size=16)
    ds = ds_config.build_ds_config(str(path), cfg, world_size=2, for_training=for_training, hidden_size=64)
    assert _autos(ds) == []
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    if for_training:
        # 16 = micro 2 x GAS 4 x world 2
        assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) \
            == (16, 2, 4)
        if path.name != "zero3_reference.json":  # the reference config has no clipping key
            assert ds["gradient_clipping"] == 0.5
    else:
        # inference engines: micro = logprob_batch_size, no accumulation, no clipping
        assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) \
            == (6, 3, 1)
        assert "gradient_clipping" not in ds
    zero = ds["zero_optimization"]
    if "reduce_bucket_size" in zero:
        assert zero["reduce_bucket_size"] == 64 * 64
    if "stage3_param_persistence_threshold" in zero:
        assert zero["stage3_param_persistence_threshold"] == 640
        assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)


def test_build_ds_config_precision_and_relative_path():
    ds = ds_config.build_ds_config("ds_configs/zero3.json", make_cfg(precision="float16", max_grad_norm=None), 1,
                                 for_training=True)
    assert ds["fp16"]["enabled"] is True and ds["bf16"]["enabled"] is False
    assert ds["gradient_clipping"] == 0.0
    assert ds["gradient_accumulation_steps"] == 4
    # without a hidden size the bucket sizes are left to DeepSpeed
    assert "stage3_param_persistence_threshold" not in ds["zero_optimization"]
    assert ds["zero_optimization"]["stage"] == 3


def test_build_ds_config_rejects_non_divisible_batch():
    cfg = make_cfg(train_global_batch_size=12, train_micro_batch_size=4)
    with pytest.raises(ValueError, match=r"train_global_batch_size=12.*train_micro_batch_size=4.*world_size=2"):
        ds_config.build_ds_config("ds_configs/zero3.json", cfg, world_size=2, for_training=True)
    # the same sizes are fine for one rank (GAS 3)
    ds = ds_config.build_ds_config("ds_configs/zero3.json", cfg, world_size=1, for_training=True)
    assert ds["gradient_accumulation_steps"] == 3


def test_build_ds_config_rejects_optimizer_section_and_unknown_auto(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"train_batch_size": "auto", "optimizer": {"type": "AdamW"}}))
    with pytest.raises(ValueError, match="optimizer"):
        ds_config.build_ds_config(str(p), make_cfg(), 1, for_training=True)
    p.write_text(json.dumps({"train_batch_size": "auto", "zero_optimization": {"sub_group_size": "auto"}}))
    with pytest.raises(ValueError, match="zero_optimization.sub_group_size"):
        ds_config.build_ds_config(str(p), make_cfg(), 1, for_training=True, hidden_size=64)


@pytest.mark.parametrize("path", [p for p in DS_CONFIGS if p.name != "zero3_reference.json"], ids=lambda p: p.name)
def test_zero_training_configs_accumulate_gradients_in_fp32(path):
    """bf16 / fp16 training: gradients of the micro-batches are summed in fp32 (the JSONs say so)."""
    assert json.loads(path.read_text())["data_types"] == {"grad_accum_dtype": "fp32"}
    for precision in ("bfloat16", "float16", "float32"):
        ds = ds_config.build_ds_config(str(path), make_cfg(precision=precision), 1, for_training=True)
        assert ds["data_types"]["grad_accum_dtype"] == "fp32", precision


def test_build_ds_config_adds_fp32_accumulation_to_a_16_bit_zero_json_without_it(tmp_path):
    raw = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    del raw["data_types"]
    p = tmp_path / "mine.json"
    p.write_text(json.dumps(raw))
    bf16 = ds_config.build_ds_config(str(p), make_cfg(precision="bfloat16"), 1, for_training=True)
    assert bf16["data_types"] == {"grad_accum_dtype": "fp32"}
    assert "data_types" not in ds_config.build_ds_config(str(p), make_cfg(precision="float32"), 1, for_training=True)
    assert "data_types" not in ds_config.build_ds_config(str(p), make_cfg(precision="bfloat16"), 1, for_training=False)
    raw["data_types"] = {"grad_accum_dtype": "bf16"}  # an explicit choice is kept
    p.write_text(json.dumps(raw))
    kept = ds_config.build_ds_config(str(p), make_cfg(precision="bfloat16"), 1, for_training=True)
    assert kept["data_types"] == {"grad_accum_dtype": "bf16"}


# --------------------------------------------------------------------------------------------------
# lr schedule
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("status, code, err", [("3", 3, "err"), ("'stopped'", 1, "errstopped\n")])
def test_exit_process_flushes_and_skips_finalization(status, code, err):
    """`exit_process` keeps what was printed, exits with the status (a message: printed, status 1) and runs
    no exit-time Python code (no atexit handler, no finalization, where a gloo worker's GIL take aborts)."""
    prog = ("import atexit, sys; from grpo.system.engines import exit_process; atexit.register(lambda: print('atexit ran'));"
            f" print('out'); sys.stderr.write('err'); exit_process({status})")
    p = subprocess.run([sys.executable, "-c", prog], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (p.returncode, p.stdout, p.stderr[-len(err):]) == (code, "out\n", err)


def test_lr_lambda_values():
    f = partial(engines.lr_lambda, warmup_steps=2, total_steps=6)
    # warmup: (step + 1) / 2
    assert [f(s, name="constant") for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    # cosine over 4 decay steps: p = (s - 2) / 4 -> 0, 1/4, 1/2, 3/4, 1 (clamped after)
    cos = [f(s, name="cosine") for s in range(2, 8)]
    assert cos == pytest.approx([1.0, (1 + 2**-0.5) / 2, 0.5, (1 - 2**-0.5) / 2, 0.0, 0.0])
    lin = [f(s, name="linear", min_lr_ratio=0.2) for s in range(2, 7)]
    assert lin == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    assert f(4, name="cosine", min_lr_ratio=0.2) == pytest.approx(0.2 + 0.8 * 0.5)
    assert engines.lr_lambda(0, name="cosine", warmup_steps=0, total_steps=1) == 1.0
    with pytest.raises(ValueError, match="scheduler.name"):
        f(3, name="exp")


# --------------------------------------------------------------------------------------------------
# live engines (one rank)
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny")), seed=3)


@pytest.fixture(scope="module")
def plain_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def dist_group():
    """This process as a one-rank group (gloo)."""
    rank, _, world, device = init_distributed()
    assert (rank, world, device.type) == (0, 1, "cpu")


@pytest.fixture(scope="module")
def policy_engine(model_dir, dist_group):
    return engines.build_policy_engine(make_cfg(model_dir), 1, total_optimizer_steps=10)


def test_policy_engine_is_really_partitioned(policy_engine, plain_model):
    params = dict(policy_engine.module.named_parameters())
    assert set(params) == {n for n, _ in plain_model.named_parameters()}
    assert any(p.numel() == 0 and p.ds_numel > 0 for p in params.values())
    assert sum(p.ds_numel for p in params.values()) == sum(p.numel() for p in plain_model.parameters())


def _reference_logprobs(model, ids_bt, mask_bt, temperature):
    """Row by row, unpadded: lp[t] = log_softmax(logits[t-1] / T)[ids[t]]."""
    out = torch.zeros(ids_bt.shape)
    with torch.no_grad():
        for b in range(ids_bt.shape[0]):
            n = int(mask_bt[b].sum())
            logits = model(ids_bt[b: b + 1, :n]).logits[0].double()
            lp = torch.log_softmax(logits[:-1] / temperature, dim=-1)
            out[b, 1:n] = lp.gather(-1, ids_bt[b, 1:n, None])[:, 0].float()
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_compute_logprobs_matches_plain_hf(policy_engine, plain_model, temperature):
    g = torch.Generator().manual_seed(0)
    lens = [9, 4, 7, 2, 9]
    ids = torch.zeros((5, 9), dtype=torch.long)
    mask = torch.zeros((5, 9), dtype=torch.long)
    for b, n in enumerate(lens):
        ids[b, :n] = torch.randint(3, 80, (n,), generator=g)
        mask[b, :n] = 1
    expected = _reference_logprobs(plain_model, ids, mask, temperature)
    got = compute_logprobs(policy_engine, ids, mask, temperature, micro_batch_size=2)
    assert got.shape == (5, 9)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert (got[:, 0] == 0).all() and (got[mask == 0] == 0).all()
    assert (got[:, 1][mask[:, 1] == 1] < 0).all()


def _filtered_reference(model, ids_bt, mask_bt, temperature, top_k, top_p):
    """Plain autograd, unpadded rows: lp[t] = log_softmax(filter_logits(logits[t-1]))[ids[t]], 0 when the
    token is outside the filter or on padding; and the unfiltered (temperature-only) logprobs."""
    from grpo.system.generation.sampling import filter_logits

    lp_bt, full_bt = torch.zeros(ids_bt.shape), torch.zeros(ids_bt.shape)
    for b in range(ids_bt.shape[0]):
        n = int(mask_bt[b].sum())
        logits = model(ids_bt[b: b + 1, :n]).logits[0, :-1]
        tok = ids_bt[b, 1:n, None]
        lp = torch.log_softmax(filter_logits(logits, temperature, top_k, top_p), -1).gather(-1, tok)[:, 0]
        lp_bt[b, 1:n] = torch.where(torch.isfinite(lp), lp, 0.0)
        full_bt[b, 1:n] = torch.log_softmax(logits / temperature, -1).gather(-1, tok)[:, 0]
    return lp_bt, full_bt


def test_compute_logprobs_with_top_k_top_p_matches_plain_filtered(policy_engine, plain_model):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 80, (4, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    ids[1, 5:] = 0
    with torch.no_grad():
        expected, full = _filtered_reference(plain_model, ids, mask, 0.7, 20, 0.9)
    got = compute_logprobs(policy_engine, ids, mask, 0.7, micro_batch_size=3, top_k=20, top_p=0.9)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    inside = int((got[:, 1:][mask[:, 1:] > 0] != 0).sum())
    assert 0 < inside < int(mask[:, 1:].sum())  # random ids: some are in the top-k / top-p set, most are not
    unfiltered = compute_logprobs(policy_engine, ids, mask, 0.7, micro_batch_size=3)
    torch.testing.assert_close(unfiltered, full, atol=1e-5, rtol=0)


def test_train_on_batch_with_top_k_top_p_gives_the_plain_gradient(model_dir, plain_model, dist_group):
    """The filtered logprobs and the micro-batch's unfiltered_logprobs both carry the right gradient."""
    from transformers import AutoModelForCausalLM

    engine = engines.build_policy_engine(make_cfg(model_dir, train_global_batch_size=2), 1, total_optimizer_steps=1)
    ids = torch.randint(3, 80, (2, 9), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    seen = {}

    def closure(lp, mb):
        seen["unfiltered"] = mb.unfiltered_logprobs_bt is not None
        return ((lp ** 2).sum() + 0.5 * (mb.unfiltered_logprobs_bt ** 2).sum()) / 14, {}

    out = train_on_batch(engine, [train_batch(input_ids_bt=ids, attention_mask_bt=mask)], closure,
                                 temperature=0.7, top_k=20, top_p=0.9)
    assert seen["unfiltered"]
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lp, full = _filtered_reference(plain, ids, mask, 0.7, 20, 0.9)
    ((lp ** 2).sum() + 0.5 * (full ** 2).sum()).div(14).backward()
    grad_norm = torch.sqrt(sum((p.grad ** 2).sum() for p in plain.parameters() if p.grad is not None))
    assert out["grad_norm"] == pytest.approx(float(grad_norm), rel=1e-4)
    assert out["loss"] == pytest.approx(float(((lp ** 2).sum() + 0.5 * (full ** 2).sum()).detach() / 14), rel=1e-5)


def test_train_on_batch_hands_entropy_and_logits_to_a_loss_that_needs_them(model_dir, dist_group):
    """``needs=("entropy", "logits")``: the closure gets the aligned, masked entropy (with grad, the
    temperature's) and the raw logits from the same forward; the gradient is the plain-PyTorch one."""
    from transformers import AutoModelForCausalLM

    engine = engines.build_policy_engine(make_cfg(model_dir, train_global_batch_size=2), 1, total_optimizer_steps=1)
    ids = torch.randint(3, 80, (2, 9), generator=torch.Generator().manual_seed(9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    seen = {}

    def closure(lp, mb, entropy_bt, logits_btv):
        seen.update(entropy=entropy_bt.detach().cpu(), logits=logits_btv.detach().cpu())
        return (entropy_bt.sum() - 0.1 * (lp ** 2).sum()) / 14, {}

    out = train_on_batch(engine, [train_batch(input_ids_bt=ids, attention_mask_bt=mask)], closure, temperature=0.7,
                         needs=("entropy", "logits"))
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    logits = plain(input_ids=ids, attention_mask=mask).logits
    logp = torch.log_softmax(logits / 0.7, dim=-1)
    h = torch.cat([torch.zeros(2, 1), -(logp.exp() * logp).sum(-1)[:, :-1]], dim=1) * mask
    lp = torch.cat([torch.zeros(2, 1), logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)], dim=1) * mask
    torch.testing.assert_close(seen["logits"], logits.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(seen["entropy"], h.detach(), atol=1e-5, rtol=0)
    assert seen["entropy"][1, 6:].eq(0).all() and seen["entropy"][:, 0].eq(0).all()
    ((h.sum() - 0.1 * (lp ** 2).sum()) / 14).backward()
    grad_norm = torch.sqrt(sum((p.grad ** 2).sum() for p in plain.parameters() if p.grad is not None))
    assert out["grad_norm"] == pytest.approx(float(grad_norm), rel=1e-4)


@pytest.mark.parametrize("placement", ["zero3", "plain"])
def test_reference_engine_matches_and_is_frozen(model_dir, plain_model, dist_group, placement):
    ref = engines.build_reference_engine(make_cfg(model_dir, reference_placement=placement), 1)
    assert (ref.zero_optimization_stage(), type(ref).__name__ == "FrozenModel") == ((3, False) if placement == "zero3"
                                                                                    else (0, True))
    assert not ref.module.training
    assert not any(p.requires_grad for p in ref.module.parameters())
    ids = torch.randint(3, 80, (3, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    got = compute_logprobs(ref, ids, mask, 1.0, micro_batch_size=3)
    torch.testing.assert_close(got, _reference_logprobs(plain_model, ids, mask, 1.0), atol=1e-5, rtol=0)


def test_auto_placement_and_zero_stage_follow_the_world_size(model_dir, dist_group):
    from grpo.system.ds_config import policy_ds_config_path, zero_stage

    cfg = make_cfg(model_dir, deepspeed_config="auto", reference_placement="auto")
    assert [zero_stage(policy_ds_config_path(cfg.policy, n)[0]) for n in (1, 2, 8)] == [0, 3, 3]
    bf16 = make_cfg(model_dir, deepspeed_config="auto", precision="bfloat16")
    assert [zero_stage(policy_ds_config_path(bf16.policy, n)[0]) for n in (1, 2)] == [1, 3]
    assert type(engines.build_reference_engine(cfg, 1)).__name__ == "FrozenModel"
    engine = engines.build_policy_engine(cfg, 1, total_optimizer_steps=2)
    assert engine.zero_optimization_stage() == 0 and type(engine.optimizer).__name__ == "CheckedAdamW"
    assert all(p.numel() > 0 for p in engine.module.parameters())  # whole weights: generation can use them


def _check_buckets(buckets, plain_model):
    expected = dict(plain_model.named_parameters())
    names = [n for bucket in buckets for n, _ in bucket]
    assert sorted(names) == sorted(expected) and len(names) == len(set(names))
    for bucket in buckets:
        layers = {re.search(r"\.layers\.(\d+)\.", n).group(1) if ".layers." in n else None for n, _ in bucket}
        assert None not in layers or layers == {None}, "a bucket mixes layer and non-layer parameters"
    for i in range(plain_model.config.num_hidden_layers):
        holding = [k for k, bucket in enumerate(buckets) if any(f".layers.{i}." in n for n, _ in bucket)]
        assert len(holding) == 1, f"layer {i} split over buckets {holding}"
    for bucket in buckets:
        for n, t in bucket:
            torch.testing.assert_close(t, expected[n].detach(), atol=0, rtol=0)


@pytest.mark.parametrize("bucket_numel,n_layer_buckets", [(1, 2), (10**9, 1)])
def test_iter_gathered_params_whole_layers(policy_engine, plain_model, bucket_numel, n_layer_buckets):
    buckets = []
    for bucket in weights.iter_gathered_params(policy_engine, bucket_numel):
        buckets.append([(n, t.clone()) for n, t in bucket])
    _check_buckets(buckets, plain_model)
    n_layer = sum(any(".layers." in n for n, _ in b) for b in buckets)
    assert n_layer == n_layer_buckets
    # embeddings alone first; final norm and lm_head together last
    assert [n for n, _ in buckets[0]] == ["model.embed_tokens.weight"]
    assert [n for n, _ in buckets[-1]] == ["model.norm.weight", "lm_head.weight"]


def test_layer_buckets_packs_whole_layers_by_ds_numel():
    class P:
        def __init__(self, n):
            self.ds_numel = n

        def numel(self):
            return 0  # partitioned: the size is ds_numel

    named = [("model.embed.weight", P(50))]
    for i in range(5):
        named += [(f"model.layers.{i}.a", P(6)), (f"model.layers.{i}.b", P(4))]
    named += [("model.norm.weight", P(1)), ("lm_head.weight", P(50))]
    buckets = weights.layer_buckets(named, bucket_numel=25)
    sizes = [[n for n, _ in b] for b in buckets]
    assert sizes[0] == ["model.embed.weight"]
    # 10 elements per layer, 25 per bucket: layers {0,1}, {2,3}, {4}
    assert [sorted({n.split(".")[2] for n in b}) for b in sizes[1:4]] == [["0", "1"], ["2", "3"], ["4"]]
    assert sizes[4] == ["model.norm.weight", "lm_head.weight"]


def test_export_hf_roundtrip(policy_engine, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = build_char_tokenizer()
    out = tmp_path / "export"
    for _ in range(2):  # the second export (of the same run) replaces the first
        weights.export_hf(policy_engine, str(out), tok, run_id="run-1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"], "temporary directories left behind"
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    gathered = {n: t.clone() for b in weights.iter_gathered_params(policy_engine) for n, t in b}
    assert set(gathered) == {n for n, _ in reloaded.named_parameters()}
    for n, p in reloaded.named_parameters():
        torch.testing.assert_close(p, gathered[n], atol=0, rtol=0)
    tok2 = AutoTokenizer.from_pretrained(str(out))
    assert tok2("1+2= ab")["input_ids"] == tok("1+2= ab")["input_ids"]


def test_logprobs_gather_export_interleave_with_training(model_dir, dist_group, tmp_path):
    """train -> logprobs -> gather -> export -> train: a no-grad forward after a step leaves ZeRO-3
    prefetches in flight, which must not break the gathers that follow."""
    from transformers import AutoModelForCausalLM

    cfg = make_cfg(model_dir, train_global_batch_size=2, optimizer={"lr": 1e-2})
    engine = engines.build_policy_engine(cfg, 1, total_optimizer_steps=4)
    ids = torch.randint(3, 80, (2, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mbs = [train_batch(input_ids_bt=ids, attention_mask_bt=mask)]
    closure = lambda lp, mb: (-lp.sum() / 12, {})
    for _ in range(2):
        train_on_batch(engine, mbs, closure)
        got = compute_logprobs(engine, ids, mask, 1.0, micro_batch_size=2)
        gathered = {n: t.clone() for b in weights.iter_gathered_params(engine) for n, t in b}
        weights.export_hf(engine, str(tmp_path / "hf"), build_char_tokenizer(), run_id="run-1")
        plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
        for n, p in plain.named_parameters():
            torch.testing.assert_close(p, gathered[n], atol=0, rtol=0)
        torch.testing.assert_close(got, _reference_logprobs(plain, ids, mask, 1.0), atol=1e-5, rtol=0)


def _one_step(cfg):
    engine = engines.build_policy_engine(cfg, 1, total_optimizer_steps=1)
    assert engine.module.is_gradient_checkpointing == cfg.policy.activation_checkpointing
    ids = torch.randint(3, 80, (2, 9), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    out = train_on_batch(engine, [train_batch(input_ids_bt=ids, attention_mask_bt=mask)],
                                 lambda lp, mb: ((lp**2).sum() / 14, {}))
    return out, {n: t.clone() for b in weights.iter_gathered_params(engine) for n, t in b}


def test_no_zero_clips_and_steps_as_zero3(model_dir, dist_group):
    """One rank in fp32 runs without ZeRO (`CheckedAdamW` clips): the same step as ZeRO-3, clipping active."""
    base = {"train_global_batch_size": 2, "optimizer": {"lr": 1e-2}, "max_grad_norm": 0.05}
    out_3, w_3 = _one_step(make_cfg(model_dir, **base))
    out_0, w_0 = _one_step(make_cfg(model_dir, deepspeed_config="ds_configs/zero0.json", **base))
    assert out_3["grad_norm"] > 0.05  # the clip acts
    assert out_0["grad_norm"] == pytest.approx(out_3["grad_norm"], rel=1e-5) and out_0["lr"] == out_3["lr"]
    for n in w_3:
        torch.testing.assert_close(w_0[n], w_3[n], atol=1e-5, rtol=0)  # Adam rescales rounding noise


def test_activation_checkpointing_gives_the_same_step(model_dir, dist_group):
    base = {"train_global_batch_size": 2, "optimizer": {"lr": 1e-2}}
    out_a, w_a = _one_step(make_cfg(model_dir, **base))
    out_b, w_b = _one_step(make_cfg(model_dir, activation_checkpointing=True, **base))
    assert out_b["grad_norm"] == pytest.approx(out_a["grad_norm"], rel=1e-5)
    for n in w_a:
        torch.testing.assert_close(w_b[n], w_a[n], atol=1e-6, rtol=0)


@pytest.mark.slow
def test_bf16_smoke(model_dir, plain_model, dist_group):
    """bf16 engine (5-30x slower than fp32 on these CPUs): logprobs near fp32, a finite step."""
    cfg = make_cfg(model_dir, precision="bfloat16", train_global_batch_size=2)
    engine = engines.build_policy_engine(cfg, 1, total_optimizer_steps=1)
    ids = torch.randint(3, 80, (2, 8), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    got = compute_logprobs(engine, ids, mask, 1.0, micro_batch_size=2)
    torch.testing.assert_close(got, _reference_logprobs(plain_model, ids, mask, 1.0), atol=0.1, rtol=0.02)
    out = train_on_batch(engine, [train_batch(input_ids_bt=ids, attention_mask_bt=mask)],
                                 lambda lp, mb: (-lp.sum() / 14, {}))
    assert torch.isfinite(torch.tensor([out["loss"], out["grad_norm"]])).all()


def test_deepspeed_takes_fp32_gradient_accumulation_for_a_bf16_zero3_engine(model_dir, dist_group):
    cfg = make_cfg(model_dir, precision="bfloat16", train_global_batch_size=2)
    engine = engines.build_policy_engine(cfg, 1, total_optimizer_steps=1)
    assert engine.get_data_types() == (torch.bfloat16, torch.float32)
    assert engine.optimizer.gradient_accumulation_dtype == torch.float32
    assert engine.optimizer.grad_partitions_flat_buffer.dtype == torch.float32  # where micro-batches sum


# --------------------------------------------------------------------------------------------------
# optimizer states off the accelerator (policy.generation.vllm_cfg.offload_optimizer_during_generation)
# --------------------------------------------------------------------------------------------------
def _two_steps(engine, offload_between: bool):
    ids = torch.randint(3, 80, (2, 7), generator=torch.Generator().manual_seed(5))
    mbs = [train_batch(input_ids_bt=ids, attention_mask_bt=torch.ones_like(ids))]
    closure = lambda lp, mb: (-(lp**2).sum() / 12, {})
    moved = []
    results = [train_on_batch(engine, mbs, closure)]
    if offload_between:
        for _ in range(2):  # the second round reuses the first one's host buffers
            moved = offload.offload_optimizer_states(engine, moved)
            offload.reload_optimizer_states(engine, moved)
    results.append(train_on_batch(engine, mbs, closure))
    return results, {n: t.clone() for b in weights.iter_gathered_params(engine) for n, t in b}


def test_offload_works_with_torch_adamw_and_training_goes_on_unchanged(model_dir, dist_group):
    """DeepSpeed's own ZeRO-3 offload_states asserts FusedAdam; ours moves the same tensors for the
    torch AdamW in use. On the CPU nothing leaves the device, so this checks the bookkeeping: the
    gradient buffers DeepSpeed offloads and rebuilds, and a step after a round trip equals one without."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

    cfg = make_cfg(model_dir, train_global_batch_size=2, optimizer={"lr": 1e-2})
    engine = engines.build_policy_engine(cfg, 1, total_optimizer_steps=4)
    assert type(engine.optimizer.optimizer) is torch.optim.AdamW
    with pytest.raises(AssertionError, match="FusedAdam"):
        engine.offload_states(include=[OffloadStateTypeEnum.optim_states], pin_memory=False)
    plain_results, plain_weights = _two_steps(engine, offload_between=False)
    engine = engines.build_policy_engine(cfg, 1, total_optimizer_steps=4)
    results, got = _two_steps(engine, offload_between=True)
    assert [r["loss"] for r in results] == [r["loss"] for r in plain_results]
    for n, w in got.items():
        torch.testing.assert_close(w, plain_weights[n], atol=0, rtol=0)


def test_optimizer_state_tensors_are_the_master_weights_and_adam_moments(model_dir, dist_group):
    engine = engines.build_policy_engine(make_cfg(model_dir, train_global_batch_size=2), 1, total_optimizer_steps=1)
    ids = torch.randint(3, 80, (2, 5), generator=torch.Generator().manual_seed(6))
    train_on_batch(engine, [train_batch(input_ids_bt=ids, attention_mask_bt=torch.ones_like(ids))],
                           lambda lp, mb: (-lp.sum() / 8, {}))  # Adam creates its moments at the first step
    zero = engine.optimizer
    tensors = offload.optimizer_state_tensors(engine)
    state = next(iter(zero.optimizer.state.values()))
    masters = [t for t in zero.fp32_partitioned_groups_flat
               if all(t is not m for m in zero.fp16_partitioned_groups_flat)]
    assert [id(t) for t in tensors] == [id(t) for t in masters] + [id(state["exp_avg"]), id(state["exp_avg_sq"])]
    n_params = sum(p.ds_numel for p in engine.module.parameters())
    assert all(t.numel() == n_params and t.dtype == torch.float32 for t in tensors)
    assert all(t is not m for t in tensors for m in zero.fp16_partitioned_groups_flat)  # never the model itself


def test_offload_is_a_no_op_under_zero_cpu_offload(model_dir, dist_group):
    cfg = make_cfg(model_dir, train_global_batch_size=2, deepspeed_config="ds_configs/zero3_offload.json")
    engine = engines.build_policy_engine(cfg, 1, total_optimizer_steps=1)
    assert offload.offload_optimizer_states(engine) == []
    offload.reload_optimizer_states(engine, [])


def test_train_on_batch_checks_micro_batch_count(policy_engine):
    mb = train_batch(input_ids_bt=torch.ones((2, 3), dtype=torch.long))
    with pytest.raises(ValueError, match="gradient_accumulation_steps=4"):
        train_on_batch(policy_engine, [mb], lambda lp, m: (lp.sum(), {}))


# --------------------------------------------------------------------------------------------------
# data parallelism: 1 process == 2 processes == plain PyTorch on the full batch
# --------------------------------------------------------------------------------------------------
def _plain_pytorch_reference(model_dir):
    """Full-batch loss, backward, clip, AdamW, LambdaLR(lr_lambda): what DeepSpeed must reproduce."""
    from transformers import AutoModelForCausalLM

    run = dist_train_step.RUN
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=run["lr"], eps=run["eps"], weight_decay=run["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, partial(engines.lr_lambda, name="cosine",
                                                           warmup_steps=run["warmup_steps"],
                                                           total_steps=dist_train_step.STEPS))
    results = []
    for step in range(dist_train_step.STEPS):
        batch = dist_train_step.make_batch(step, model.config.vocab_size)
        ids, mask = batch.input_ids_bt, batch.attention_mask_bt
        logits = model(input_ids=ids, attention_mask=mask).logits
        lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        lp = torch.nn.functional.pad(lp, (1, 0)) * mask
        loss = dist_train_step.batch_loss(lp, batch, float(batch.token_mask_bt.sum()))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), run["max_grad_norm"])
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        opt.zero_grad()
        results.append({"loss": loss.item(), "grad_norm": norm.item(), "lr": lr})
    rows = dist_train_step.make_batch(dist_train_step.STEPS, model.config.vocab_size)
    logprobs = _reference_logprobs(model, rows.input_ids_bt[:5], rows.attention_mask_bt[:5], 1.0)
    return {n: p.detach() for n, p in model.named_parameters()}, results, logprobs


def _compare(weights, results, logprobs, ref_weights, ref_results, ref_logprobs, label):
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-4, rtol=0)
    assert set(weights) == set(ref_weights)
    for n, w in weights.items():
        torch.testing.assert_close(w, ref_weights[n], atol=1e-5, rtol=0, msg=lambda m, n=n: f"{label} {n}: {m}")
    for got, exp in zip(results, ref_results, strict=True):
        assert got["loss"] == pytest.approx(exp["loss"], rel=1e-5), label
        assert got["grad_norm"] == pytest.approx(exp["grad_norm"], rel=1e-4), label
        assert got["lr"] == pytest.approx(exp["lr"]), label


@pytest.fixture(scope="module")
def reference_run(model_dir):
    return _plain_pytorch_reference(model_dir)


def test_one_process_train_step_equals_plain_pytorch(dist_group, model_dir, reference_run):
    weights, results, logprobs = dist_train_step.train_and_collect(model_dir)  # this process: 1 rank, GAS 4
    assert [r["lr"] for r in results] == pytest.approx([0.025, 0.05])  # warmup over 2 steps
    assert results[0]["tokens"] > 0
    moved = max((weights[n] - p).abs().max().item()
                for n, p in _initial_weights(model_dir).items())
    assert moved > 1e-3, "the step did not change the weights"
    _compare(weights, results, logprobs, *reference_run, "1 process")


def _initial_weights(model_dir):
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())


@pytest.mark.slow  # two ranks end to end: test_train_grpo.py::test_one_and_two_processes_give_the_same_loss
def test_two_processes_on_halves_equal_full_batch(model_dir, reference_run, tmp_path):
    out, export = tmp_path / "two.pt", tmp_path / "hf"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(REPO)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "tests" / "helpers" / "dist_train_step.py"), model_dir, str(out), str(export)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = torch.load(out)
    assert saved["world"] == 2
    _compare(saved["weights"], saved["results"], saved["logprobs"], *reference_run, "2 processes")
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32)
    for n, p in exported.named_parameters():
        torch.testing.assert_close(p, saved["weights"][n], atol=0, rtol=0)
