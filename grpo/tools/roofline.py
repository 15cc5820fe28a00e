"""The work each phase of a GRPO step must do, counted from the model's config and the batch, and how close a
measured time is to this machine's bound on it (`bench/roofline.py` prints it).

A phase's work is its FLOPs and the bytes it must move to or from memory. The counts are the minimum the phase
needs, not what an implementation happens to run: padding, rows decoded after they ended, a prompt run once per
sample instead of once per group, a weight read once per micro-batch are all work above the count, so they show
as a lower fraction of the bound, which is the point.

FLOPs: a matmul of an ``[n, a]`` input with an ``[a, b]`` weight is ``2 n a b``; the decoder layers' linear weights
(q, k, v, o, the MLP's gate, up and down) and the output head are the matmuls; norms, rotary embeddings, biases,
activations and the embedding lookup are left out (a few per cent on these models). Attention: each token and layer
does ``4 * heads * head_dim`` FLOPs per key it attends to (QK^T and the weighted sum of V), causal, so a block of
``n`` tokens after ``k`` cached ones attends to ``n k + n (n + 1) / 2`` keys. A backward is twice the forward
(gradients of the inputs and of the weights), once where the weights are frozen (LoRA's base).

Bytes: every weight of the forward is read once per pass (decode: once per decode step, shared by the batch's
rows); a decode step reads each row's KV cache; a training pass reads the weights twice (forward and backward) and
writes the gradients; Adam reads the parameter, gradient and both moments and writes the three it updates, in fp32
(`adam_bytes_per_param`); a refit reads and writes each weight once. Activations are not counted.

A phase is bound by compute where its FLOPs take longer at the peak rate than its bytes at the bandwidth, else by
memory (`achieved`); its fraction of the bound is the bound's time over the measured time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """What the counts need of a decoder-only transformer (Llama / Qwen2 / Mistral layout: attention with q, k, v, o
    projections, a gated MLP with three matmuls, an output head). ``bytes_per_param``: the weights' dtype size."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    bytes_per_param: int = 4

    @classmethod
    def from_config(cls, config, bytes_per_param: int = 4) -> ModelShape:
        """The shape of a transformers config (a multimodal model's text part: ``config.text_config``).

            >>> from transformers import Qwen2Config
            >>> s = ModelShape.from_config(Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            ...                                        num_key_value_heads=2, intermediate_size=128, vocab_size=58))
            >>> s.head_dim, s.kv_heads, s.layer_matmul_params, s.head_params
            (16, 2, 36864, 3712)
        """
        c = getattr(config, "text_config", None) or config
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        return cls(hidden=c.hidden_size, layers=c.num_hidden_layers, heads=heads,
                   kv_heads=getattr(c, "num_key_value_heads", None) or heads, head_dim=head_dim,
                   intermediate=c.intermediate_size, vocab=c.vocab_size, bytes_per_param=bytes_per_param)

    @property
    def layer_matmul_params(self) -> int:
        """One decoder layer's linear weights: q and o (``hidden x heads*head_dim``), k and v (``hidden x
        kv_heads*head_dim``), the MLP's gate, up and down (``hidden x intermediate`` each)."""
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 2 * d * q + 2 * d * kv + 3 * d * self.intermediate

    @property
    def head_params(self) -> int:
        """The output head: ``vocab x hidden``."""
        return self.vocab * self.hidden

    @property
    def weight_bytes(self) -> int:
        """The bytes a forward reads of the weights: every layer's linear weights and the head."""
        return (self.layers * self.layer_matmul_params + self.head_params) * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """One position's keys and values, all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param


@dataclass(frozen=True)
class Group:
    """Rows that share one prompt: its length and each row's completion length (the tokens after the prompt)."""

    prompt_len: int
    completions: tuple[int, ...]


@dataclass(frozen=True)
class Work:
    """A phase's FLOPs and bytes; they add."""

    flops: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(self.flops + other.flops, self.bytes + other.bytes)

    def scaled(self, flops: float = 1.0, bytes: float = 1.0) -> Work:
        return Work(self.flops * flops, self.bytes * bytes)


def groups_of(prompts: Sequence[Sequence[int]], completion_lens: Sequence[int]) -> list[Group]:
    """Rows grouped by identical prompt tokens, in order of first appearance.

        >>> groups_of([[1, 2], [3], [1, 2]], [4, 5, 6])
        [Group(prompt_len=2, completions=(4, 6)), Group(prompt_len=1, completions=(5,))]
    """
    by_prompt: dict[tuple, list[int]] = {}
    for prompt, n in zip(prompts, completion_lens, strict=True):
        by_prompt.setdefault(tuple(prompt), []).append(int(n))
    return [Group(len(p), tuple(ns)) for p, ns in by_prompt.items()]


def attended_keys(new: int, cached: int) -> int:
    """Keys a causal block of ``new`` tokens after ``cached`` ones attends to (each token sees itself).

        >>> attended_keys(3, 0), attended_keys(2, 5)
        (6, 13)
    """
    return new * cached + new * (new + 1) // 2


def body_flops(shape: ModelShape, new: int, cached: int = 0) -> int:
    """The decoder layers' forward FLOPs for ``new`` tokens after ``cached`` ones: linear weights and attention."""
    linear = 2 * shape.layers * shape.layer_matmul_params * new
    attention = 4 * shape.layers * shape.heads * shape.head_dim * attended_keys(new, cached)
    return linear + attention


def head_flops(shape: ModelShape, positions: int) -> int:
    """The output head's FLOPs for ``positions`` positions whose logits are used."""
    return 2 * shape.head_params * positions


def prefill_work(shape: ModelShape, groups: Sequence[Group]) -> Work:
    """Generation's prefill: each distinct prompt once (the rows of a group sample from its last logits), its
    weights read once and its KV cache written."""
    flops = sum(body_flops(shape, g.prompt_len) + head_flops(shape, 1) for g in groups)
    kv = sum(g.prompt_len for g in groups) * shape.kv_bytes_per_token
    return Work(flops, shape.weight_bytes + kv)


def decode_work(shape: ModelShape, groups: Sequence[Group]) -> Work:
    """Generation after the prefill: a row of ``c`` tokens feeds back its first ``c - 1``, each attending to the
    prompt and the tokens before it. The rows decode together: each step reads the weights once (``max(c) - 1``
    steps) and every live row's KV cache (as many positions as it attends to)."""
    flops, keys = 0, 0
    for g in groups:
        for c in g.completions:
            fed = max(c - 1, 0)
            flops += body_flops(shape, fed, g.prompt_len) + head_flops(shape, fed)
            keys += attended_keys(fed, g.prompt_len)
    steps = max((c for g in groups for c in g.completions), default=1) - 1
    return Work(flops, max(steps, 0) * shape.weight_bytes + keys * shape.kv_bytes_per_token)


def forward_work(shape: ModelShape, groups: Sequence[Group]) -> Work:
    """A logprob pass (previous policy, reference): each distinct prompt once, each row's completion after it but
    its last token (which predicts nothing), logits at the ``c`` positions that predict completion tokens; the
    weights read once."""
    flops = sum(body_flops(shape, g.prompt_len)
                + sum(body_flops(shape, max(c - 1, 0), g.prompt_len) + head_flops(shape, c) for c in g.completions)
                for g in groups)
    return Work(flops, shape.weight_bytes)


def train_work(shape: ModelShape, groups: Sequence[Group], trainable_params: int, weight_grads: bool = True,
               updates: int = 1) -> Work:
    """Training's forward and backward: the forward of `forward_work`, a backward of twice its FLOPs (once where
    ``weight_grads`` is False: frozen weights, LoRA's base, need only the inputs' gradients); for each of the
    step's ``updates`` optimizer updates (each over its share of the rows) the weights read twice and
    ``trainable_params`` gradients written."""
    fwd = forward_work(shape, groups)
    return Work(fwd.flops * (3 if weight_grads else 2),
                updates * (2 * shape.weight_bytes + trainable_params * shape.bytes_per_param))


ADAM_FLOPS_PER_PARAM = 12  # the two moment updates, bias corrections, the square root and the update: a handful


def adam_bytes_per_param(bytes_per_param: int) -> int:
    """Adam's traffic per trainable parameter: it reads the gradient, the fp32 parameter (or master copy) and both
    fp32 moments and writes the three it updates; 16-bit weights also get their 16-bit copy written.

        >>> adam_bytes_per_param(4), adam_bytes_per_param(2)
        (28, 28)
    """
    master = 0 if bytes_per_param == 4 else bytes_per_param  # the 16-bit copy written from the fp32 master
    return bytes_per_param + 2 * 4 + 2 * 2 * 4 + master


def optimizer_work(trainable_params: int, bytes_per_param: int = 4, updates: int = 1) -> Work:
    """``updates`` Adam(W) steps over ``trainable_params`` parameters."""
    return Work(updates * ADAM_FLOPS_PER_PARAM * trainable_params,
                updates * adam_bytes_per_param(bytes_per_param) * trainable_params)


def refit_work(params: int, bytes_per_param: int = 4) -> Work:
    """Copying ``params`` weights into the generation engine: each read once and written once."""
    return Work(0, 2 * params * bytes_per_param)


@dataclass(frozen=True)
class Achieved:
    """How a measured time compares with the phase's bound: ``bound`` is "compute" or "memory" (None: the phase
    has no work to bound, or took no time), ``fraction`` the bound's time over the measured time."""

    bound: str | None
    fraction: float | None
    bound_s: float


def achieved(work: Work, seconds: float, peak_flops: float, bandwidth: float) -> Achieved:
    """The roofline: the phase cannot take less than ``max(flops / peak_flops, bytes / bandwidth)`` seconds;
    whichever term is larger is its bound.

        >>> achieved(Work(flops=2e9, bytes=1e8), seconds=0.04, peak_flops=1e11, bandwidth=1e10)
        Achieved(bound='compute', fraction=0.5, bound_s=0.02)
        >>> achieved(Work(flops=1e6, bytes=1e9), seconds=0.2, peak_flops=1e11, bandwidth=1e10).bound
        'memory'
    """
    compute_s, memory_s = work.flops / peak_flops, work.bytes / bandwidth
    bound_s = max(compute_s, memory_s)
    if bound_s <= 0 or seconds <= 0:
        return Achieved(None, None, bound_s)
    return Achieved("compute" if compute_s >= memory_s else "memory", bound_s / seconds, bound_s)
