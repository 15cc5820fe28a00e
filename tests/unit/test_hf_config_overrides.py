"""policy.hf_config_overrides (NeMo-RL's hf_config_overrides): the checkpoint's model config with the overrides is
what every copy of the policy is built from (training engine, reference, hf generation copy, vLLM's hf_overrides);
how a key applies (grpo.system.model_config) and what it refuses."""

from __future__ import annotations


import pytest
import torch
from pydantic import ValidationError

from grpo.config import MasterConfig, PolicyConfig
from grpo.system.model_config import ModelConfigError, apply_overrides, load_model_config, vllm_hf_overrides

from tests.helpers.fake_vllm import install_fake_vllm

YARN = {"rope_type": "yarn", "rope_theta": 1000000, "factor": 2.0, "original_max_position_embeddings": 256,
        "truncate": True, "beta_fast": 32, "beta_slow": 1, "mscale": 1, "mscale_all_dim": 0}  # NeMo-RL's yarn recipe


def policy(model_dir, **overrides) -> PolicyConfig:
    return PolicyConfig(model_name=model_dir, precision="float32", hf_config_overrides=overrides)


# ---------------------------------------------------------------- how a key applies
def test_values_replace_and_sub_configs_merge():
    from transformers import LlavaConfig

    base = LlavaConfig()
    c = apply_overrides(base, {"image_token_id": 7, "text_config": {"max_position_embeddings": 64}})
    assert c.image_token_id == 7 and c.text_config.max_position_embeddings == 64
    assert c.text_config.hidden_size == base.text_config.hidden_size  # the sub-config's other keys stay
    assert base.text_config.max_position_embeddings != 64  # the checkpoint's config is not changed
    assert apply_overrides(base, {}) is base


def test_a_key_the_config_lacks_is_an_error_naming_it():
    from transformers import LlamaConfig, LlavaConfig

    with pytest.raises(ModelConfigError, match=r"policy\.hf_config_overrides\.max_position_embedings: LlamaConfig"):
        apply_overrides(LlamaConfig(), {"max_position_embedings": 64})
    with pytest.raises(ModelConfigError, match=r"policy\.hf_config_overrides\.text_config\.routr_aux_loss_coef"):
        apply_overrides(LlavaConfig(), {"text_config": {"routr_aux_loss_coef": 0.0}})


def test_rope_as_a_config_json_would_load():
    from transformers import Qwen2Config

    c = apply_overrides(Qwen2Config(rope_theta=3.0), {"rope_scaling": YARN})
    assert c.rope_parameters == YARN  # the whole new dict
    legacy = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}  # transformers 4's form
    c = apply_overrides(Qwen2Config(rope_theta=3.0), {"rope_scaling": legacy})
    assert c.rope_parameters["rope_type"] == "yarn" and c.rope_parameters["rope_theta"] == 3.0  # the theta stays
    c = apply_overrides(Qwen2Config(), {"rope_theta": 5.0})
    assert c.rope_parameters == {"rope_type": "default", "rope_theta": 5.0}
    with pytest.raises(ModelConfigError, match="rope_type='nonsense'"):
        apply_overrides(Qwen2Config(), {"rope_scaling": {"rope_type": "nonsense"}})


# ---------------------------------------------------------------- every copy of the policy
def test_policy_reference_and_hf_generation_load_the_overrides(tiny_model_dir, char_tokenizer):
    from grpo.system import engines
    from grpo.system.generation.hf import HFGeneration

    p = policy(tiny_model_dir, rope_scaling=YARN, max_position_embeddings=1024)
    trained = engines._load_model(p, {})
    reference = engines.build_reference_engine(p, 1, torch.device("cpu")).module
    copy = HFGeneration(p, char_tokenizer, trained.config, "cpu").model
    for model in (trained, reference, copy):
        assert model.config.rope_parameters == YARN and model.config.max_position_embeddings == 1024
        assert model.model.rotary_emb.rope_type == "yarn"
    plain = engines._load_model(policy(tiny_model_dir), {})
    assert plain.config.max_position_embeddings != 1024 and plain.model.rotary_emb.rope_type == "default"


def test_rope_theta_changes_the_logits_not_the_weights(tiny_model_dir):
    from grpo.system import engines

    base, theta = (engines._load_model(policy(tiny_model_dir, **ov), {}) for ov in ({}, {"rope_theta": 50.0}))
    assert theta.config.rope_parameters["rope_theta"] == 50.0
    assert all(torch.equal(a, b) for a, b in zip(base.state_dict().values(), theta.state_dict().values()))
    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        a, b = base(input_ids=ids).logits, theta(input_ids=ids).logits
    assert torch.allclose(a[:, 0], b[:, 0], atol=1e-6)  # position 0 rotates by nothing whatever the theta
    assert not torch.allclose(a[:, 1:], b[:, 1:], atol=1e-4)


def test_a_bad_key_fails_at_load(tiny_model_dir):
    with pytest.raises(ModelConfigError, match=r"policy\.hf_config_overrides\.rope_thetaa"):
        load_model_config(policy(tiny_model_dir, rope_thetaa=5.0))


# ---------------------------------------------------------------- vLLM
class RecordingLLM:
    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def sleep(self, level=1):
        pass


def vllm_backend(monkeypatch, cfg, tok):
    from grpo.system.generation import vllm as backend

    install_fake_vllm(monkeypatch, RecordingLLM)
    return backend.VllmGeneration(cfg, tok, None, torch.device("cpu"))


def test_vllm_gets_the_overrides_as_the_trainer_applies_them(monkeypatch, tiny_model_dir, char_tokenizer):
    legacy = {"type": "yarn", "factor": 2.0}
    cfg = MasterConfig.model_validate({"policy": {
        "model_name": tiny_model_dir, "generation": {"backend": "vllm"},
        "hf_config_overrides": {"rope_scaling": legacy, "max_position_embeddings": 1024}}})
    kw = vllm_backend(monkeypatch, cfg, char_tokenizer).llm.kwargs
    trained = load_model_config(cfg.policy)
    assert kw["hf_overrides"] == {"rope_parameters": trained.rope_parameters, "max_position_embeddings": 1024}
    assert kw["hf_overrides"]["rope_parameters"]["rope_type"] == "yarn"
    assert kw["hf_overrides"]["rope_parameters"]["original_max_position_embeddings"] == 1024  # as transformers does
    cfg = MasterConfig.model_validate({"policy": {"model_name": tiny_model_dir, "generation": {"backend": "vllm"}}})
    assert "hf_overrides" not in vllm_backend(monkeypatch, cfg, char_tokenizer).llm.kwargs


def test_vllm_overrides_of_a_sub_config():
    from transformers import LlavaConfig

    ov = {"text_config": {"max_position_embeddings": 64}, "image_token_id": 7}
    assert vllm_hf_overrides(apply_overrides(LlavaConfig(), ov), ov) == ov


def test_vllm_kwargs_may_not_set_hf_overrides():
    with pytest.raises(ValidationError, match=r"\['hf_overrides'\] are set by grpo-ds"):
        MasterConfig.model_validate({"policy": {"generation": {"vllm_cfg": {"vllm_kwargs": {"hf_overrides": {}}}}}})
