"""Linear layers on oneDNN (grpo/system/cpu_linear.py, policy.cpu_linear_kernel): the same values as F.linear up to
rounding, forward and backward; oneDNN only where it pays; the model otherwise untouched."""

import copy

import pytest
import torch
from torch import nn

from grpo.system import cpu_linear
from grpo.system.cpu_linear import ONEDNN_MIN_MACS, OneDNNLinear, onednn_available, use_onednn_linears

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


@pytest.fixture
def onednn_calls(monkeypatch):
    """Counts the oneDNN matmuls (the module's `onednn_matmul`, which the layer and its backward call)."""
    calls = []

    def counted(x, w, b=None):
        calls.append((tuple(x.shape), tuple(w.shape)))
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")

    monkeypatch.setattr(cpu_linear, "onednn_matmul", counted)
    return calls


def pair(in_features, out_features, bias=True, seed=0):
    torch.manual_seed(seed)
    plain = nn.Linear(in_features, out_features, bias=bias)
    fast = copy.deepcopy(plain)
    assert use_onednn_linears(fast, "onednn") == 1 and type(fast) is OneDNNLinear
    return plain, fast


def close(a, b, rel=2e-6):
    """Equal up to fp32 rounding of a few hundred products: relative to the larger entry."""
    scale = b.abs().max().clamp_min(1e-12)
    assert (a - b).abs().max() / scale < rel, ((a - b).abs().max() / scale).item()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(96, 256), (3, 40, 256)])  # 2-D and a [batch, tokens, features] input
def test_forward_and_backward_are_f_linears_up_to_rounding_and_run_on_onednn(bias, shape, onednn_calls):
    plain, fast = pair(256, 384, bias)
    x = torch.randn(*shape, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    dy = torch.randn(*shape[:-1], 384)
    y_plain, y_fast = plain(x), fast(x2)
    (y_plain * dy).sum().backward()
    (y_fast * dy).sum().backward()
    assert y_fast.shape == y_plain.shape
    close(y_fast, y_plain)
    close(x2.grad, x.grad)
    close(fast.weight.grad, plain.weight.grad)
    if bias:
        close(fast.bias.grad, plain.bias.grad)
    # forward, dx = dy W, dW = dy^T x: three oneDNN matmuls, with the shapes of each
    tokens = x.numel() // 256
    assert onednn_calls == [((tokens, 256), (384, 256)), ((tokens, 384), (256, 384)),
                            ((384, tokens), (256, tokens))]


def test_a_frozen_layer_computes_no_weight_gradient(onednn_calls):
    """LoRA's base layers: the weight is frozen, only dx is needed (two matmuls, not three)."""
    plain, fast = pair(256, 384)
    for m in (plain, fast):
        m.requires_grad_(False)
    x = torch.randn(64, 256, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    plain(x).square().sum().backward()
    fast(x2).square().sum().backward()
    close(x2.grad, x.grad)
    assert fast.weight.grad is None and len(onednn_calls) == 2


def test_no_grad_runs_one_matmul_and_saves_nothing(onednn_calls):
    plain, fast = pair(256, 384)
    x = torch.randn(64, 256)
    with torch.no_grad():
        y = fast(x)
    close(y, plain(x).detach())
    assert y.grad_fn is None and len(onednn_calls) == 1


def test_small_calls_other_dtypes_and_autocast_stay_on_f_linear(onednn_calls):
    plain, fast = pair(64, 64)
    small = torch.randn(8, 64)  # 8 x 64 x 64 multiply-adds: far under ONEDNN_MIN_MACS
    assert small.numel() * 64 < ONEDNN_MIN_MACS
    assert torch.equal(fast(small), plain(small))
    big_plain, big_fast = pair(256, 384)
    x64 = torch.randn(64, 256, dtype=torch.float64)
    assert torch.equal(big_fast.double()(x64), big_plain.double()(x64))
    xb = torch.randn(64, 256)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        big_fast.float()(xb)
    assert onednn_calls == []
    big_fast(xb)  # the same layer on fp32 without autocast: oneDNN
    assert len(onednn_calls) == 1


def test_the_settings_and_the_size_rule():
    small = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    assert use_onednn_linears(copy.deepcopy(small), "auto") == 0  # under 10M parameters: MKL's numbers kept
    assert use_onednn_linears(copy.deepcopy(small), "torch") == 0
    swapped = copy.deepcopy(small)
    assert use_onednn_linears(swapped, "onednn") == 2
    big = nn.Sequential(nn.Linear(2048, 2560), nn.Linear(2560, 2048))  # 10.5M parameters
    assert use_onednn_linears(big, "auto") == 2
    with pytest.raises(ValueError, match=r"policy.cpu_linear_kernel='fast': expected one of \['auto', 'onednn', "):
        use_onednn_linears(small, "fast")


def test_a_swapped_model_is_still_nn_linear_to_state_dicts_copies_and_peft(tiny_model_dir, onednn_calls):
    """Class swap in place: parameters, state-dict keys and values unchanged; deepcopy keeps the class; peft's LoRA
    (our in-place layer, dispatched by isinstance) wraps the swapped base layers, and only the adapters train."""
    from transformers import AutoModelForCausalLM

    from grpo.config import LoraConfig
    from grpo.system.engines import apply_lora

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = [id(p) for p in model.parameters()]
    assert use_onednn_linears(model, "onednn") > 0
    assert [id(p) for p in model.parameters()] == params
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert type(copy.deepcopy(model).lm_head) is OneDNNLinear
    assert isinstance(model.lm_head, nn.Linear)

    peft_model = apply_lora(model, LoraConfig(enabled=True, dim=8, alpha=16))
    bases = [m.base_layer for m in peft_model.modules() if hasattr(m, "lora_A")]
    assert bases and all(type(b) is OneDNNLinear for b in bases)
    onednn_calls.clear()
    peft_model(input_ids=torch.randint(3, 40, (32, 80))).logits.square().mean().backward()
    trained = {n for n, p in peft_model.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in n for n in trained), trained
    assert onednn_calls  # the base layers ran on oneDNN (forward and dx)


def test_prepare_model_swaps_per_policy_cpu_linear_kernel(tiny_model_dir):
    """The load path every model goes through (policy, reference, generation copies): the setting reaches it, and
    the forward is transformers' own up to rounding."""
    from transformers import AutoModelForCausalLM

    from grpo.system.vision import prepare_model

    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.randint(3, 40, (32, 80))
    fast = prepare_model(copy.deepcopy(plain), linear_kernel="onednn")
    assert any(type(m) is OneDNNLinear for m in fast.modules())
    kept = prepare_model(copy.deepcopy(plain), linear_kernel="torch")
    assert not any(type(m) is OneDNNLinear for m in kept.modules())
    assert not any(type(m) is OneDNNLinear for m in prepare_model(copy.deepcopy(plain)).modules())  # auto, tiny
    with torch.no_grad():
        close(fast(input_ids=ids).logits, plain(input_ids=ids).logits, rel=1e-5)


def test_a_wrong_setting_fails_at_load_naming_the_key():
    from grpo.config.load import load_config

    with pytest.raises(Exception, match="cpu_linear_kernel"):
        load_config(None, ["policy.cpu_linear_kernel=fast"])


def test_packed_weights_serve_no_grad_calls_on_this_thread_only_and_only_inside_the_block(onednn_calls, monkeypatch):
    import threading

    from grpo.system.cpu_linear import packed_weights

    plain, fast = pair(256, 384)
    layout = []
    counted = cpu_linear.onednn_matmul
    monkeypatch.setattr(cpu_linear, "onednn_matmul",
                        lambda x, w, b=None: (layout.append(w.is_mkldnn), counted(x, w, b))[1])
    x = torch.randn(64, 256)
    with torch.no_grad():
        with packed_weights(fast, rows=64):
            y_packed = fast(x)
            other = []
            t = threading.Thread(target=lambda: other.append(fast(x)))
            t.start()
            t.join()
            x_grad = x.clone().requires_grad_(True)
            with torch.enable_grad():
                fast(x_grad).sum().backward()  # autograd: the parameter itself, never the packed copy
        y_after = fast(x)
    assert layout[:2] == [True, False], layout  # this thread packed; the other thread's call plain
    assert layout[2:] == [False] * 4, layout  # forward, dx and dW under autograd; after the block
    close(y_packed, plain(x).detach())
    close(y_after, y_packed)
    assert x_grad.grad is not None


def test_packed_weights_skip_small_batches_and_large_models(monkeypatch):
    from grpo.system.cpu_linear import PACK_MIN_ROWS, _packed_here, packed_weights

    _, fast = pair(256, 384)
    with packed_weights(fast, rows=PACK_MIN_ROWS - 1):
        assert not getattr(_packed_here, "weights", {})
    monkeypatch.setattr(cpu_linear, "PACK_MAX_BYTES", 256 * 384 * 4 - 1)
    with packed_weights(fast, rows=64):
        assert not getattr(_packed_here, "weights", {})
    monkeypatch.setattr(cpu_linear, "PACK_MAX_BYTES", 256 * 384 * 4)
    with packed_weights(fast, rows=64):
        assert list(_packed_here.weights) == [id(fast)]
    assert not _packed_here.weights
