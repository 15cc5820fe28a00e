"""LoRA on the policy (policy.lora, issue 22): real DeepSpeed engines on a tiny Llama, one rank in this process.

Only the adapters train (base weights bit-identical after steps, only adapters in the optimizer), the reference
is the policy with its adapters off (equal to a separately loaded base model), the hf backend generates with the
adapters (shared module; a copy refitted with the adapters alone), checkpoints hold the adapters and resume
exactly, the merged export is a plain model with the peft model's logits, the adapter export loads with
``PeftModel.from_pretrained``. The 2-rank ZeRO-3 run is in tests/e2e/test_lora_e2e.py (slow).
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch

from grpo.config import CheckpointingConfig, LoraConfig, MasterConfig
from grpo.system import engines, weights
from grpo.system.checkpoint import CheckpointManager, GRPOSaveState
from grpo.system.dist import init_distributed
from grpo.system.training import compute_logprobs, train_on_batch
from grpo.batch import micro_batches

from tests.helpers.dist_train_step import batch_loss, make_batch

STAGES = ["zero0", "zero3"]  # no ZeRO (the one-rank fp32 default) and ZeRO-3 (several ranks' default)


def lora_cfg(model_dir: str, stage: str, **lora) -> MasterConfig:
    return MasterConfig.model_validate({
        "policy": {"model_name": model_dir, "precision": "float32", "train_global_batch_size": 8,
                   "train_micro_batch_size": 4, "deepspeed_config": f"ds_configs/{stage}.json",
                   "optimizer": {"lr": 0.01}, "generation": {"max_new_tokens": 6},
                   "lora": {"enabled": True, "dim": 4, "alpha": 8, **lora}},
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "seed": 7}})


@pytest.fixture(scope="module")
def dist_group():
    init_distributed()


def gathered(engine, **kw) -> dict[str, torch.Tensor]:
    return {n: t.clone() for b in weights.iter_gathered_params(engine, **kw) for n, t in b}


def train(engine, steps, first: int = 0) -> list[float]:
    vocab = engine.module.config.vocab_size
    losses = []
    for step in range(first, first + steps):
        batch = make_batch(step, vocab)
        n = float(batch.token_mask_bt.sum())
        r = train_on_batch(engine, micro_batches(batch, 4), lambda lp, mb, n=n: (batch_loss(lp, mb, n), {}))
        losses.append(r["loss"])
    return losses


# --------------------------------------------------------------------------------------------------
# config and peft mapping
# --------------------------------------------------------------------------------------------------
def test_lora_config_defaults_are_nemo_rl_s_and_contradictions_fail_at_load():
    c = LoraConfig()
    assert (c.enabled, c.target_modules, c.exclude_modules, c.match_all_linear, c.dim, c.alpha, c.dropout,
            c.dropout_position, c.lora_A_init) == (False, [], [], True, 8, 32, 0.0, "post", "xavier")
    with pytest.raises(ValueError, match="target_modules"):
        LoraConfig(enabled=True, target_modules=["q_proj"])  # match_all_linear would ignore them
    with pytest.raises(ValueError, match="adapts nothing"):
        LoraConfig(enabled=True, match_all_linear=False)
    with pytest.raises(ValueError):
        LoraConfig(lora_A_init="gaussian")


def test_peft_config_maps_the_names(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    pc = engines.peft_lora_config(LoraConfig(enabled=True, dim=16, alpha=32, dropout=0.1))
    assert (pc.r, pc.lora_alpha, pc.lora_dropout, pc.target_modules) == (16, 32, 0.1, "all-linear")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = engines.apply_lora(model, LoraConfig(enabled=True, match_all_linear=False,
                                                      target_modules=["*.layers.0.*.q_proj", "v_proj"]))
    adapted = sorted(n.removesuffix(".lora_A.default.weight") for n, _ in peft_model.named_parameters()
                     if "lora_A" in n)
    n_layers = model.config.num_hidden_layers
    assert len(adapted) == 1 + n_layers and sum("q_proj" in n for n in adapted) == 1
    assert all("lm_head" not in n for n, _ in peft_model.named_parameters() if "lora_" in n)


def test_lora_a_init_is_seeded_and_b_starts_at_zero(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    def adapters(init, seed):
        m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        m = engines.apply_lora(m, LoraConfig(enabled=True, lora_A_init=init), seed=seed)
        return {n: p.detach().clone() for n, p in m.named_parameters() if "lora_" in n}

    a, b, c, u = adapters("xavier", 1), adapters("xavier", 1), adapters("xavier", 2), adapters("uniform", 1)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert all(torch.count_nonzero(t) == 0 for n, t in a.items() if "lora_B" in n)
    name = next(n for n in a if "lora_A" in n)
    assert not torch.equal(a[name], c[name]) and not torch.equal(a[name], u[name])
    bound = 1 / a[name].shape[1] ** 0.5  # kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert u[name].abs().max() <= bound and a[name].abs().max() > bound  # xavier normal has tails past it


def test_post_dropout_drops_the_adapter_output_only_in_training(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    from peft.tuners.lora import LoraLayer

    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    m = engines.apply_lora(m, LoraConfig(enabled=True, dropout=0.5, dropout_position="post"))
    layer = next(x for x in m.modules() if isinstance(x, LoraLayer))
    assert isinstance(layer.lora_dropout["default"], torch.nn.Identity)
    torch.nn.init.normal_(layer.lora_B["default"].weight)
    x = torch.randn(3, layer.in_features)
    base = layer.base_layer(x)
    layer.train()
    delta = layer(x) - base
    assert (delta == 0).float().mean() > 0.2  # whole output entries dropped: dropout after B, not on x
    layer.eval()
    expect = layer.lora_B["default"](layer.lora_A["default"](x)) * layer.scaling["default"]
    torch.testing.assert_close(layer(x) - base, expect)


# --------------------------------------------------------------------------------------------------
# engines: training, reference, generation
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", STAGES)
def test_only_the_adapters_train_and_the_reference_is_the_base_model(tiny_model_dir, dist_group, stage):
    from transformers import AutoModelForCausalLM

    engine = engines.build_policy_engine(lora_cfg(tiny_model_dir, stage), 1, total_optimizer_steps=4)
    trainable = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    in_optimizer = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    if stage == "zero0":
        assert in_optimizer == {id(p) for p in engine.module.parameters() if p.requires_grad}
    else:  # ZeRO-3's fp32 partitions hold the adapters' elements only
        n_adapter = sum(p.ds_numel for p in engine.module.parameters() if p.requires_grad)
        assert sum(t.numel() for t in engine.optimizer.fp32_partitioned_groups_flat) == n_adapter
    before = gathered(engine)
    train(engine, 2)
    after = gathered(engine)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed == {n for n in trainable if "lora_B" in n or "lora_A" in n} and changed
    assert all(torch.equal(before[n], after[n]) for n in before if n not in trainable)  # base bit-identical

    batch = make_batch(9, engine.module.config.vocab_size)
    base = engines.FrozenModel(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                               torch.device("cpu"))
    lp_base = compute_logprobs(base, batch.input_ids_bt, batch.attention_mask_bt, 1.0, 4)
    lp_ref = compute_logprobs(engines.AdaptersOff(engine), batch.input_ids_bt, batch.attention_mask_bt, 1.0, 4)
    lp_policy = compute_logprobs(engine, batch.input_ids_bt, batch.attention_mask_bt, 1.0, 4)
    torch.testing.assert_close(lp_ref, lp_base, atol=1e-6, rtol=0)
    assert (lp_policy - lp_base).abs().max() > 1e-3  # the adapters are back on after the reference
    assert all(p.requires_grad for n, p in engine.module.named_parameters() if n in trainable)


@pytest.mark.parametrize("stage", STAGES)
def test_hf_generation_uses_the_adapters_and_refits_only_them(tiny_model_dir, dist_group, stage):
    from grpo.run.serving import build_generation_backend
    from grpo.system.chat import load_tokenizer
    from grpo.system.training import mult_prob_error

    cfg = lora_cfg(tiny_model_dir, stage)
    engine = engines.build_policy_engine(cfg, 1, total_optimizer_steps=4)
    gen = build_generation_backend(cfg, load_tokenizer(cfg.policy), engine, torch.device("cpu"))
    assert gen.shared == (stage != "zero3")
    gen.refit(engine)
    train(engine, 2)
    moved = []
    if not gen.shared:  # after the first refit only the adapters move
        real = weights.iter_gathered_params

        def spy(eng, bucket_numel, trainable_only=False):
            for bucket in real(eng, bucket_numel, trainable_only=trainable_only):
                moved.extend(n for n, _ in bucket)
                yield bucket

        weights_iter, gen_module = spy, __import__("grpo.system.generation.hf", fromlist=["x"])
        gen_module.iter_gathered_params = weights_iter
        try:
            gen.refit(engine)
        finally:
            gen_module.iter_gathered_params = real
        assert moved and all(".lora_" in n for n in moved)
    outs = gen.generate([[5, 6, 7], [8, 9]], seeds=[1, 2])
    assert abs(mult_prob_error(engine, outs, gen.pad_id) - 1.0) < 1e-4  # the generator has the trained adapters


# --------------------------------------------------------------------------------------------------
# checkpoints and exports
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", STAGES)
def test_checkpoint_holds_the_adapters_and_resumes_exactly(tiny_model_dir, dist_group, stage, tmp_path):
    cfg = lora_cfg(tiny_model_dir, stage)
    engine = engines.build_policy_engine(cfg, 1, total_optimizer_steps=6)
    train(engine, 2)
    ckpt = CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt")))
    path = ckpt.save(2, engine, GRPOSaveState(current_step=2))
    uninterrupted = train(engine, 2, first=2)

    saved = sum(f.stat().st_size for f in (path / "ds").rglob("*.pt"))
    numel = {n: getattr(p, "ds_numel", p.numel()) for n, p in engine.module.named_parameters()}
    adapter_bytes = 4 * sum(v for n, v in numel.items() if ".lora_" in n)
    assert saved < 4 * adapter_bytes + 2**16, (saved, adapter_bytes)  # adapters, Adam moments, ZeRO-3's placeholders
    assert 4 * sum(numel.values()) > 2 * saved  # the base weights are not in it

    resumed = engines.build_policy_engine(cfg, 1, total_optimizer_steps=6)
    ckpt.load(ckpt.latest(), resumed, need_dataloader=False)
    assert train(resumed, 2, first=2) == pytest.approx(uninterrupted, abs=1e-5)


@pytest.mark.parametrize("stage", STAGES)
def test_merged_export_is_a_plain_model_with_the_peft_logits_and_the_adapter_loads_with_peft(
        tiny_model_dir, dist_group, stage, tmp_path, char_tokenizer):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    engine = engines.build_policy_engine(lora_cfg(tiny_model_dir, stage), 1, total_optimizer_steps=4)
    train(engine, 2)
    weights.export_hf(engine, str(tmp_path / "merged"), char_tokenizer)
    weights.export_adapter(engine, str(tmp_path / "adapter"))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}

    batch = make_batch(11, engine.module.config.vocab_size)
    lp_engine = compute_logprobs(engine, batch.input_ids_bt, batch.attention_mask_bt, 1.0, 8)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    ids, mask = batch.input_ids_bt, batch.attention_mask_bt
    with torch.no_grad():
        logits_merged = merged(input_ids=ids, attention_mask=mask).logits
        logits_peft = with_adapter(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits_merged, logits_peft, atol=1e-5, rtol=0)
    lp_peft = compute_logprobs(engines.FrozenModel(with_adapter, torch.device("cpu")), ids, mask, 1.0, 8)
    torch.testing.assert_close(lp_peft, lp_engine, atol=1e-5, rtol=0)  # the adapter export is the trained one

    sd = weights.adapter_state_dict(engine)
    assert sd and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in sd)
    config = weights.peft_config_dict(engine)
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    assert isinstance(config["target_modules"], list)  # all-linear as peft resolved it: the modules' full names
    assert any(name.endswith("q_proj") for name in config["target_modules"])


def test_export_adapter_without_lora_is_an_error(tiny_model_dir, dist_group, tmp_path):
    cfg = lora_cfg(tiny_model_dir, "zero0", enabled=False)
    engine = engines.build_policy_engine(cfg, 1, total_optimizer_steps=4)
    with pytest.raises(weights.ExportError, match="policy.lora.enabled=false"):
        weights.export_adapter(engine, str(tmp_path / "adapter"))


# What a resume may not change (issue 37): (the checkpoint's policy.lora, the resumed run's, what the error names)
LORA_CHANGES = {
    "dim": ({}, {"dim": 8}, "policy.lora.dim=4 in the checkpoint, 8 in this run"),
    "alpha": ({}, {"alpha": 16}, "policy.lora.alpha=8 in the checkpoint, 16 in this run"),
    "off": ({}, {"enabled": False}, "policy.lora.enabled=true in the checkpoint, false in this run"),
    "on": ({"enabled": False}, {}, "policy.lora.enabled=false in the checkpoint, true in this run"),
    "targets": ({}, {"match_all_linear": False, "target_modules": ["q_proj", "v_proj"]},
                "policy.lora.target_modules / exclude_modules / match_all_linear: the checkpoint adapts"),
    "exclude": ({}, {"exclude_modules": ["down_proj"]}, "only in the checkpoint: model.layers.0.mlp.down_proj"),
}


@pytest.mark.parametrize("stage,change", [("zero0", c) for c in LORA_CHANGES] + [("zero3", "dim"), ("zero3", "on")])
def test_a_resume_with_other_lora_settings_is_refused_before_anything_loads(tiny_model_dir, dist_group, stage, change,
                                                                             tmp_path):
    """Every change of what shapes the adapters (on/off, rank, alpha, the adapted modules) is one CheckpointError
    naming the policy.lora key and both values, before DeepSpeed reads the checkpoint (two ranks under ZeRO-3:
    tests/e2e/test_lora_e2e.py, slow). checkpointing.allow_config_change does not open it."""
    from grpo.system.checkpoint import CheckpointError

    saved_lora, resumed_lora, expected = LORA_CHANGES[change]
    engine = engines.build_policy_engine(lora_cfg(tiny_model_dir, stage, **saved_lora), 1, total_optimizer_steps=4)
    ckpt = CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt")))
    ckpt.save(1, engine, GRPOSaveState(current_step=1))
    resumed = engines.build_policy_engine(lora_cfg(tiny_model_dir, stage, **resumed_lora), 1, total_optimizer_steps=4)

    def must_not_load(*a, **k):
        raise AssertionError("DeepSpeed read the checkpoint before the LoRA settings were checked")

    resumed.load_checkpoint = must_not_load
    with pytest.raises(CheckpointError) as err:
        ckpt.load(ckpt.latest(), resumed, need_dataloader=False)
    message = str(err.value)
    assert expected in message and "\n" not in message
    assert "Resume (or export) with the checkpoint's policy.lora" in message


def test_a_resume_with_another_lora_dropout_loads(tiny_model_dir, dist_group, tmp_path):
    """Dropout shapes no state (a training hyperparameter like the learning rate): with allow_config_change (the
    fingerprint refuses it otherwise) a resume may change it."""
    engine = engines.build_policy_engine(lora_cfg(tiny_model_dir, "zero0"), 1, total_optimizer_steps=4)
    ckpt = CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt")))
    ckpt.save(1, engine, GRPOSaveState(current_step=1))
    resumed = engines.build_policy_engine(lora_cfg(tiny_model_dir, "zero0", dropout=0.1, dropout_position="pre"), 1,
                                          total_optimizer_steps=4)
    assert ckpt.load(ckpt.latest(), resumed, need_dataloader=False)[0].current_step == 1


def test_a_lora_rank_larger_than_a_layer_s_width_warns_once(tiny_model_dir):
    """Issue 37: such a rank ran without a word (B @ A of a layer has rank at most min(in, out))."""
    import warnings

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    width = min(min(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engines.apply_lora(model, LoraConfig(enabled=True, dim=width + 1))
    ours = [w for w in caught if "policy.lora.dim" in str(w.message)]
    assert len(ours) == 1 and f"policy.lora.dim={width + 1} is larger than the width of" in str(ours[0].message)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engines.apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                           LoraConfig(enabled=True, dim=width))
    assert not [w for w in caught if "policy.lora.dim" in str(w.message)]
