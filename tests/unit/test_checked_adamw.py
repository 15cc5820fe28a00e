"""grpo.system.engines.CheckedAdamW: AdamW in cache-sized chunks is bitwise torch's AdamW (a pure speed change)."""

import pytest
import torch

from grpo.system import engines
from grpo.system.engines import CheckedAdamW


def params_and_grads(seed=0):
    """A few parameters (one spanning several chunks, one without a gradient) and three steps' gradients."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((37, 29), (5,), (300,), (2, 3))]
    grads = [[torch.randn(p.shape, generator=g) * 3 if i != 3 else None for i, p in enumerate(params)]
             for _ in range(3)]
    return params, grads


def run(optimizer_of, steps_grads, params, lrs):
    opt = optimizer_of(params)
    for grads, lr in zip(steps_grads, lrs):
        for p, grad in zip(params, grads):
            p.grad = None if grad is None else grad.clone()
        for group in opt.param_groups:
            group["lr"] = lr   # as the LR schedule sets it
        opt.step()
    return opt


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_chunked_steps_are_bitwise_torch_adamw(weight_decay, monkeypatch):
    monkeypatch.setattr(engines, "ADAM_CHUNK", 64)   # the (37, 29) parameter and the 300 one: several chunks each
    adamw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay)
    lrs = [1e-2, 5e-3, 2e-3]
    params_a, grads = params_and_grads()
    params_b, _ = params_and_grads()
    ours = run(lambda ps: CheckedAdamW(ps, max_grad_norm=1.0, **adamw), grads, params_a, lrs)
    clipped = []   # torch's AdamW on the gradients CheckedAdamW clipped
    for step in grads:
        given = [g for g in step if g is not None]
        norm = torch.nn.utils.get_total_norm(given)
        holders = [torch.nn.Parameter(torch.empty_like(g)) for g in given]
        for h, g in zip(holders, given):
            h.grad = g.clone()
        torch.nn.utils.clip_grads_with_norm_(holders, 1.0, norm)
        it = iter(h.grad for h in holders)
        clipped.append([None if g is None else next(it) for g in step])
    torch_ = run(lambda ps: torch.optim.AdamW(ps, foreach=False, **adamw), clipped, params_b, lrs)
    assert ours._global_grad_norm > 1.0   # the clip acts
    for a, b in zip(params_a, params_b):
        assert torch.equal(a, b)
    for a, b in zip(params_a[:3], params_b[:3]):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(ours.state[a][key], torch_.state[b][key])
    assert params_a[3] not in ours.state   # no gradient: no state, as torch's
    assert ours.state_dict()["state"].keys() == torch_.state_dict()["state"].keys()
