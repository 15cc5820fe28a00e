"""grpo/system/ds_config.py: a DeepSpeed JSON that DeepSpeed would refuse with the run's precision fails before any
engine is built, with the reason."""

from __future__ import annotations

import pytest
import torch

from grpo.config import PolicyConfig
from grpo.system.ds_config import build_ds_config, policy_ds_config_path, precision_problem


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_zero0_with_16_bit_precision_is_rejected_with_the_reason(precision):
    policy = PolicyConfig(deepspeed_config="ds_configs/zero0.json", precision=precision)
    with pytest.raises(ValueError, match="without ZeRO DeepSpeed accumulates gradients in the model's dtype only"):
        policy_ds_config_path(policy, 1)
    assert policy_ds_config_path(PolicyConfig(deepspeed_config="ds_configs/zero0.json", precision="float32"), 1)[0] \
        == "ds_configs/zero0.json"
    for path in ("ds_configs/zero1.json", "ds_configs/zero2.json", "ds_configs/zero3.json"):
        assert precision_problem(path, precision) is None
    assert policy_ds_config_path(PolicyConfig(precision=precision), 1)[0] == "ds_configs/zero1.json"  # auto


def test_deepspeed_itself_refuses_zero0_with_bf16_and_fp32_accumulation(tiny_model_dir):
    """The reason of the rejection above, checked against DeepSpeed (0.19.8) on the CPU."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    from grpo.system.dist import init_distributed

    init_distributed()
    policy = PolicyConfig(model_name=tiny_model_dir, precision="bfloat16", train_global_batch_size=2,
                          train_micro_batch_size=2)
    ds = build_ds_config("ds_configs/zero0.json", policy, 1, for_training=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="unsupported mix"):
        deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=ds)
