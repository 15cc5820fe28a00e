"""grpo.update: the step phases both loops share (the heavier ones are covered end to end)."""

from __future__ import annotations

import torch

from grpo.config_load import build_config
from grpo.update import step_advantages


def _batch() -> dict:
    g = torch.Generator().manual_seed(0)
    B, T = 8, 6
    token_mask = torch.zeros(B, T)
    token_mask[:, 2:] = 1.0
    gen_lp = -torch.rand(B, T, generator=g) * token_mask
    prev_lp = gen_lp.clone()
    prev_lp[0] -= 3.0 * token_mask[0]  # sample 0 disagrees with its generation logprobs: masked
    return {"prompt_ids": torch.arange(B) // 4, "rewards": torch.rand(B, generator=g), "token_mask": token_mask,
            "sample_mask": torch.ones(B), "generation_logprobs": gen_lp, "prev_logprobs": prev_lp,
            "malformed_thinking": torch.zeros(B, dtype=torch.bool)}


def test_advantages_on_the_gpu_flag_gives_the_cpu_result_back_on_the_cpu(monkeypatch):
    cfg = build_config({"grpo": {"seq_logprob_error_threshold": 1.5}})
    cpu = _batch()
    cpu_metrics = step_advantages(cfg, cpu)
    assert cpu["sample_mask"][0] == 0 and cpu["sample_mask"][1:].all()

    # No GPU here: stand one in that copies tensors, and check what comes back and where it lands.
    moved = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: moved.append(1) or self.clone())
    on = _batch()
    gpu_cfg = build_config({"grpo": {"seq_logprob_error_threshold": 1.5, "calculate_advantages_on_gpu": True}})
    assert step_advantages(gpu_cfg, on).keys() == cpu_metrics.keys()
    assert len(moved) == len(on) - 1  # every tensor of the batch went over (advantages is new)
    for key in ("sample_mask", "advantages"):
        assert torch.equal(on[key], cpu[key]), key
