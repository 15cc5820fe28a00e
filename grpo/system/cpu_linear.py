"""Linear layers on oneDNN's fp32 matmul on the CPU (``policy.cpu_linear_kernel``, issue 50).

torch runs ``F.linear`` on the CPU with MKL's sgemm. On an AMD CPU MKL takes its AVX2 path even where the chip has
AVX-512, while oneDNN (bundled with every x86 torch build, ``torch.ops.mkldnn._linear_pointwise``) uses AVX-512:
on the 2-core AMD EPYC the project measures on, a ``[4096, 512] x [512, 1536]`` fp32 matmul runs at about 210
GFLOP/s in MKL and about 490 in oneDNN, and a decode step's ``[64, 512] x [512, 1536]`` at about 165 against 330
(380 with the weight packed: `packed_weights`); ``bench/roofline.py`` probes both kernels and takes the better as the
machine's peak. Both accumulate in fp32: results differ from MKL's at rounding level (on the bench model logits by
up to 3e-6, gradients by 3e-6 of their largest entry), as MKL's own do between batch sizes.

`use_onednn_linears` swaps the class of a model's plain ``nn.Linear`` modules for `OneDNNLinear`, whose forward
(and backward: ``dx = dy W``, ``dW = dy^T x``, each a oneDNN matmul) takes oneDNN only where it pays, per call
(`takes_onednn`): fp32 tensors on the CPU, no autocast, a parameter that is not a ZeRO-3 partition, and a matmul
of at least ``ONEDNN_MIN_MACS`` multiply-adds (oneDNN's fixed cost is about 10 us a call against MKL's 2: a tiny
model's layers stay on MKL). Anywhere else it is ``nn.Linear``'s own forward, so the same model runs on a GPU,
in bf16 or under ZeRO-3 unchanged. State dicts, peft and ``save_pretrained`` see ``nn.Linear``.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

ONEDNN_MIN_MACS = 1 << 21  # multiply-adds a call; below it MKL's smaller fixed cost wins (measured, 2 threads)
# "auto" swaps a model's layers from this size up: a smaller one's calls are mostly under ONEDNN_MIN_MACS, and the
# demos (models under 10M parameters) keep MKL's numbers bit for bit.
AUTO_MIN_PARAMS = 10_000_000
KERNELS = ("auto", "onednn", "torch")
# `packed_weights` keeps a second copy of the weights for its block: not for models whose linear weights pass this.
PACK_MAX_BYTES = 512 << 20
# ... nor for calls of fewer rows: the reordering (one pass over the weights) pays back over a batch's decode steps
# (13% of each step's matmuls on the bench model); one row's matmuls are under ONEDNN_MIN_MACS anyway.
PACK_MIN_ROWS = 16


def onednn_available() -> bool:
    """This torch build has oneDNN's linear op (x86 CPU builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_matmul(x_mk: torch.Tensor, w_nk: torch.Tensor, bias_n: torch.Tensor | None = None) -> torch.Tensor:
    """``x w^T + b`` by oneDNN: ``x`` ``[..., K]``, ``w`` ``[N, K]`` (any strides) -> ``[..., N]``."""
    return torch.ops.mkldnn._linear_pointwise(x_mk, w_nk, bias_n, "none", [], "")


def onednn_weight(weight: torch.Tensor) -> bool:
    """Whether oneDNN may multiply by ``weight``: a whole fp32 matrix on the CPU (not a ZeRO-3 partition)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and not hasattr(weight, "ds_id")
            and weight.dim() == 2)


def takes_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x w^T`` runs on oneDNN: fp32 CPU tensors (`onednn_weight`), autocast off, at least
    ``ONEDNN_MIN_MACS`` multiply-adds."""
    return (onednn_weight(weight) and x.device.type == "cpu" and x.dtype == torch.float32
            and not torch.is_autocast_enabled("cpu") and x.numel() * weight.shape[0] >= ONEDNN_MIN_MACS)


class _OneDNNLinearFn(torch.autograd.Function):
    """``y = x W^T + b`` on 2-D ``x`` ``[M, K]``; backward ``dx = dy W``, ``dW = dy^T x``, ``db = sum dy``, each
    matmul on oneDNN where `takes_onednn` (torch's otherwise)."""

    @staticmethod
    def forward(ctx, x_mk, weight, bias):
        ctx.save_for_backward(x_mk, weight)
        ctx.has_bias = bias is not None
        return onednn_matmul(x_mk, weight, bias)

    @staticmethod
    def backward(ctx, dy_mn):
        x_mk, weight = ctx.saved_tensors
        dx = dw = db = None
        if ctx.needs_input_grad[0]:  # [M, N] x [N, K]: oneDNN's "weight" is W^T as a view
            dx = onednn_matmul(dy_mn, weight.t()) if takes_onednn(dy_mn, weight.t()) else dy_mn @ weight
        if ctx.needs_input_grad[1]:  # [N, M] x [M, K]
            dw = onednn_matmul(dy_mn.t(), x_mk.t()) if takes_onednn(dy_mn.t(), x_mk.t()) else dy_mn.t() @ x_mk
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy_mn.sum(0)
        return dx, dw, db


_packed_here = threading.local()  # .weights: {id(layer): its weight in oneDNN's blocked layout}, this thread's


class OneDNNLinear(nn.Linear):
    """``nn.Linear`` whose matmuls run on oneDNN where `takes_onednn` (see the module's docstring); without autograd
    inside `packed_weights` on this thread, with the weight in oneDNN's own layout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not takes_onednn(x, self.weight):
            return F.linear(x, self.weight, self.bias)
        x_mk = x.reshape(-1, x.shape[-1])
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad
                                        or (self.bias is not None and self.bias.requires_grad)):
            y_mn = _OneDNNLinearFn.apply(x_mk, self.weight, self.bias)
        else:
            packed = getattr(_packed_here, "weights", {}).get(id(self))
            y_mn = onednn_matmul(x_mk, self.weight if packed is None else packed, self.bias)
        # reshaped out here, not inside the Function: a caller may add to it in place (peft's LoRA, ours)
        return y_mn.reshape(*x.shape[:-1], y_mn.shape[-1])


def use_onednn_linears(model: nn.Module, kernel: str = "auto") -> int:
    """``policy.cpu_linear_kernel`` on ``model``: with "onednn" (or "auto" and a model of at least
    ``AUTO_MIN_PARAMS`` parameters) and oneDNN in this torch, every plain ``nn.Linear`` becomes a `OneDNNLinear`,
    in place (the same parameters); "torch" leaves them. Returns how many were swapped.

        >>> use_onednn_linears(nn.Sequential(nn.Linear(4, 4)), "auto"), use_onednn_linears(nn.Linear(4, 4), "torch")
        (0, 0)
    """
    if kernel not in KERNELS:
        raise ValueError(f"policy.cpu_linear_kernel={kernel!r}: expected one of {list(KERNELS)}")
    if kernel == "torch" or not onednn_available():
        return 0
    if kernel == "auto" and sum(p.numel() for p in model.parameters()) < AUTO_MIN_PARAMS:
        return 0
    swapped = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDNNLinear
            swapped += 1
    return swapped


@contextmanager
def packed_weights(model: nn.Module, rows: int):
    """For the block, on this thread, ``model``'s `OneDNNLinear` layers run their no-grad matmuls with the weight
    reordered once into oneDNN's blocked layout for ``rows``-row inputs (``_reorder_linear_weight``), instead of
    reordering it inside every call: a decode step's ``[64, 512] x [512, 1536]`` matmul takes 206 us against 238
    on the bench model, and an hf generate call of its workload 0.55 s against 0.62 with the reordering (25 ms)
    included. The weights must not change inside the block (generation's do not). No-op where nothing is swapped,
    under ``PACK_MIN_ROWS`` rows, and for models whose linear weights pass ``PACK_MAX_BYTES`` (the copy would cost
    too much memory); values are oneDNN's either way, up to rounding."""
    layers = [m for m in model.modules() if type(m) is OneDNNLinear and onednn_weight(m.weight)]
    if not layers or rows < PACK_MIN_ROWS or sum(m.weight.numel() * 4 for m in layers) > PACK_MAX_BYTES:
        yield
        return
    saved = getattr(_packed_here, "weights", None)
    _packed_here.weights = {id(m): torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), rows)
                            for m in layers}
    try:
        yield
    finally:
        _packed_here.weights = saved if saved is not None else {}
