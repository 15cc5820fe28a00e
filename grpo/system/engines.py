"""DeepSpeed engines: ZeRO configs, policy and reference engines, the learning-rate schedule, the end of a
run's process (the process group itself: `grpo.system.dist`; logprobs and the training step on these
engines: `grpo.system.training`; getting the weights out of them: `grpo.system.weights`).

Every forward of a ZeRO-3 engine is a collective: all ranks call `grpo.system.training`'s functions (and
`grpo.system.weights`' gathers and export) together.
"""

from __future__ import annotations

import math
import os
import sys
from contextlib import contextmanager
from functools import cache, partial
from typing import NoReturn

import torch
import torch.distributed as dist

from grpo.system.dist import comm_device
from grpo.system.ds_config import build_ds_config, policy_ds_config_path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _policy(cfg):
    """Accept the MasterConfig or its PolicyConfig."""
    return getattr(cfg, "policy", cfg)


# --------------------------------------------------------------------------------------------------
# The end of a run's processes
# --------------------------------------------------------------------------------------------------
def local_world_size() -> int | None:
    """Ranks on this node, as the launcher says (LOCAL_WORLD_SIZE; None when it does not)."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else None


def shutdown() -> None:
    """End of a run: wait until every rank is here (no rank closes its sockets while a peer is still in
    a collective), then destroy the process group."""
    if dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def exit_process(status: int | str | None = 0) -> NoReturn:
    """Leave a launched script without interpreter finalization: call it last, after `shutdown`.
    ``status`` as `SystemExit` takes it: None or an int is the exit status; a message is printed to
    stderr and the status is 1.

    DeepSpeed's engines outlive `destroy_process_group` (its hooks are held by C++ autograd nodes and
    `deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK`), and with them the gloo process
    groups and their worker threads. A gloo worker that drops the last reference to a finished
    collective's tensors takes the GIL to free them; during finalization that cancels the thread
    inside C++ and the process aborts with "terminate called without an active exception" (SIGABRT,
    about one exit in 20 with two ranks; pytorch/pytorch PR 179291 describes it). main() has closed
    the logger, the scoring pool and the generation engine by then: flush the standard streams and
    `os._exit`.
    """
    if isinstance(status, str):
        print(status, file=sys.stderr)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status or 0)


# --------------------------------------------------------------------------------------------------
# Learning-rate schedule
# --------------------------------------------------------------------------------------------------
def lr_lambda(step: int, *, name: str, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0,
              warmup_start_factor: float | None = None, decay_steps: int | None = None) -> float:
    """Multiplier of the base lr at optimizer step ``step`` (0-based).

    Warmup while step < warmup_steps: (step + 1) / warmup_steps (the first step is not wasted at 0), or with
    s = warmup_start_factor, s + (1 - s) * step / warmup_steps (torch's LinearLR; Megatron's warmup from
    lr_warmup_init). Then, with D = decay_steps or total_steps, p = clamp((step - warmup_steps) /
    max(1, D - warmup_steps), 0, 1) and m = min_lr_ratio: cosine m + (1 - m) * (1 + cos(pi * p)) / 2; linear
    m + (1 - m) * (1 - p); constant 1.

        >>> lr_lambda(0, name="cosine", warmup_steps=2, total_steps=6)
        0.5
        >>> lr_lambda(4, name="cosine", warmup_steps=2, total_steps=6)
        0.5
        >>> lr_lambda(0, name="constant", warmup_steps=50, total_steps=100, warmup_start_factor=0.1)
        0.1
    """
    if step < warmup_steps:
        if warmup_start_factor is not None:
            return warmup_start_factor + (1.0 - warmup_start_factor) * step / warmup_steps
        return (step + 1) / warmup_steps
    if name == "constant":
        return 1.0
    end = decay_steps if decay_steps is not None else total_steps
    p = min(max((step - warmup_steps) / max(1, end - warmup_steps), 0.0), 1.0)
    if name == "cosine":
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))
    if name == "linear":
        return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - p)
    raise ValueError(f"policy.scheduler.name={name!r}: expected one of ['constant', 'cosine', 'linear']")


# --------------------------------------------------------------------------------------------------
# Engines
# --------------------------------------------------------------------------------------------------
def _load_model(policy, ds_config: dict):
    """``from_pretrained`` (the config with ``policy.hf_config_overrides``: `grpo.system.model_config`); under
    ZeRO-3 a live HfDeepSpeedConfig makes it load straight into partitioned parameters (no rank ever holds the
    whole model). It is dropped right after, so later plain models (the generation copy) are not partitioned."""
    from grpo.system.model_config import load_model_config
    from grpo.system.vision import attach_dummy_image, auto_model_class, check_positions, load_processor, prepare_model

    config = load_model_config(policy)  # a vision-language checkpoint loads as image-text-to-text (vision.py)
    with zero3_loading(ds_config):
        model = auto_model_class(config).from_pretrained(
            policy.model_name, config=config, dtype=DTYPES[policy.precision],
            trust_remote_code=policy.trust_remote_code
        )
    check_positions(model)  # M-RoPE positions other than Qwen2-VL's are not computed yet: refused by name
    if ds_config.get("zero_optimization", {}).get("stage", 0) == 3:  # forwards without images run a dummy one
        attach_dummy_image(model, load_processor(policy, config))
    return prepare_model(model, policy.vision.train_vision_tower, policy.cpu_linear_kernel)


@contextmanager
def zero3_loading(ds_config: dict):
    """Inside: under a ZeRO-3 ``ds_config``, transformers' ``from_pretrained`` loads straight into partitioned
    parameters (a live HfDeepSpeedConfig); outside, later plain models are not partitioned. No-op below stage 3."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    live = HfDeepSpeedConfig(ds_config) if ds_config.get("zero_optimization", {}).get("stage", 0) == 3 else None
    try:
        yield
    finally:
        del live
        unset_hf_deepspeed_config()


def _hidden_size(policy) -> int | None:
    from grpo.system.model_config import load_model_config

    mc = load_model_config(policy)
    return getattr(mc.get_text_config(), "hidden_size", None)


def build_policy_engine(cfg, world_size: int, total_optimizer_steps: int):
    """The trainable ZeRO engine: model, torch AdamW (policy.optimizer), warmup + schedule (lr_lambda). With
    ``policy.lora.enabled`` the module is a peft model (`apply_lora`) whose adapters are the only trainable
    parameters, and the only ones the optimizer holds.

    The DeepSpeed config is `grpo.system.ds_config.policy_ds_config_path` (``auto``: no ZeRO on one rank in fp32,
    ZeRO-1 on one rank in 16-bit, ZeRO-3 on several). torch AdamW in every configuration, offload while
    generating included (`grpo.system.offload`; DeepSpeed's FusedAdam would need nvcc and ninja to JIT-build its op);
    without ZeRO in fp32 it is `CheckedAdamW`, which clips and skips non-finite steps as ZeRO's optimizers do."""
    import deepspeed

    policy = _policy(cfg)
    path, _ = policy_ds_config_path(policy, world_size)
    ds_config = build_ds_config(path, policy, world_size, for_training=True, hidden_size=_hidden_size(policy))
    if "offload_optimizer" in ds_config.get("zero_optimization", {}):
        # torch AdamW on the offloaded fp32 partitions: no C++ op to build (DeepSpeedCPUAdam is faster).
        ds_config.setdefault("zero_force_ds_cpu_optimizer", False)
    model = _load_model(policy, ds_config)
    if policy.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if policy.lora.enabled:  # before DeepSpeed: its optimizer and ZeRO partitions see the adapters only as trainable
        model = apply_lora(model, policy.lora, seed=getattr(getattr(cfg, "grpo", None), "seed", 0),
                           vision_tower=policy.vision.lora_vision_tower)
    trainable = [p for p in model.parameters() if p.requires_grad]
    o, s = policy.optimizer, policy.scheduler
    adamw = dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    no_zero_fp32 = ds_config.get("zero_optimization", {}).get("stage", 0) == 0 and policy.precision == "float32"
    if no_zero_fp32:  # DeepSpeed's own fp32 clipping records no norm: the optimizer clips
        optimizer = CheckedAdamW(trainable, max_grad_norm=ds_config.get("gradient_clipping", 0.0), **adamw)
        ds_config["gradient_clipping"] = 0.0
    else:
        optimizer = torch.optim.AdamW(trainable, **adamw)
    schedule = partial(lr_lambda, name=s.name, warmup_steps=s.warmup_steps, total_steps=total_optimizer_steps,
                       min_lr_ratio=s.min_lr_ratio, warmup_start_factor=s.warmup_start_factor,
                       decay_steps=s.decay_steps)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                      lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
    if no_zero_fp32 and engine.dp_world_size == 1:
        engine.enable_backward_allreduce = False  # an all-reduce over one rank copies every gradient twice
    return engine


# --------------------------------------------------------------------------------------------------
# LoRA (policy.lora): peft adapters on the policy; the reference is the same module with them off
# --------------------------------------------------------------------------------------------------
def lora_targets(names: list[str]) -> list[str] | str | None:
    """peft's ``target_modules`` / ``exclude_modules`` for NeMo-RL's module names: a list of a module's own names as
    is (peft matches a name or a dotted suffix), or, when one has a ``*``, one regex over the full dotted name
    (peft full-matches a string): ``*`` is any text, a plain name matches as the last component.

        >>> lora_targets(["q_proj", "v_proj"])
        ['q_proj', 'v_proj']
        >>> print(lora_targets(["*.layers.0.*.q_proj", "v_proj"]))
        (?:.*\\.layers\\.0\\..*\\.q_proj|(?:.*\\.)?v_proj)
        >>> lora_targets([]) is None
        True
    """
    import re

    if not names:
        return None
    if not any("*" in n for n in names):
        return list(names)
    parts = [".*".join(re.escape(piece) for piece in n.split("*")) if "*" in n else r"(?:.*\.)?" + re.escape(n)
             for n in names]
    return "(?:" + "|".join(parts) + ")"


def peft_lora_config(lora):
    """peft's ``LoraConfig`` for ``policy.lora``: r = dim, lora_alpha = alpha (scaling alpha / r), lora_dropout,
    target_modules = all-linear (match_all_linear: peft's, without the output head) or `lora_targets`,
    exclude_modules. B starts at zero (init_lora_weights=True); `apply_lora` initializes A and moves dropout."""
    from peft import LoraConfig

    config = LoraConfig(task_type="CAUSAL_LM", r=lora.dim, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules="all-linear" if lora.match_all_linear else lora_targets(lora.target_modules),
                        exclude_modules=lora_targets(lora.exclude_modules), bias="none", init_lora_weights=True)
    config._register_custom_module({torch.nn.Linear: in_place_lora_linear()})  # peft's API for its own layer classes
    return config


@cache
def in_place_lora_linear() -> type:
    """peft's LoRA ``Linear`` with the same forward values and fewer temporaries (the class `peft_lora_config`
    gives peft for every adapted ``torch.nn.Linear``).

    peft computes ``result = result + lora_B(lora_A(dropout(x))) * scaling``: three new [tokens, out_features]
    tensors per adapted layer and forward (the product, the scaled product, the sum), freed again at once with the
    base layer's output. Here ``result.add_(lora_B(lora_A(dropout(x))).mul_(scaling))`` runs the same kernels on the
    same values in place: one new tensor, bit for bit the same output and gradients. On the CPU, glibc's heap keeps
    such short-lived blocks it cannot reuse: on the bench model peft's layers made a LoRA step's peak RSS 250-300 MB
    higher (bench/bench_lora_memory.py). Anything else (adapters off, merged, mixed adapter batches, a peft variant
    such as DoRA) is peft's own forward."""
    from peft.tuners.lora import Linear as LoraLinear

    class InPlaceLoraLinear(LoraLinear):
        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            variant = getattr(self, "lora_variant", None)  # DoRA and peft's other variants
            if self.disable_adapters or self.merged or "adapter_names" in kwargs or variant:
                return super().forward(x, *args, **kwargs)
            result = self.base_layer(x, *args, **kwargs)
            dtype = result.dtype
            for adapter in self.active_adapters:
                if adapter not in self.lora_A:
                    continue
                lora_A, lora_B = self.lora_A[adapter], self.lora_B[adapter]
                x_a = self._cast_input_dtype(x, lora_A.weight.dtype)
                result.add_(lora_B(lora_A(self.lora_dropout[adapter](x_a))).mul_(self.scaling[adapter]))
            return result.to(dtype)

    return InPlaceLoraLinear


class _PostDropout:
    """Forward hook on a ``lora_B``: dropout on the adapter's output (``dropout_position: post``), in training only.
    peft scales B's output by alpha / r after it: dropout and a constant factor commute."""

    def __init__(self, owner: torch.nn.Module, p: float):
        self.owner, self.p = owner, p

    def __call__(self, module, inputs, output):
        return torch.nn.functional.dropout(output, self.p, training=self.owner.training)


def apply_lora(model, lora, seed: int = 0, adapter: str = "default", vision_tower: bool = False):
    """``model`` as a peft model with LoRA adapters (`peft_lora_config`); only the adapters require grad.

    What peft cannot say is done here: A is initialized with ``lora.lora_A_init`` (xavier: xavier_normal_;
    uniform: kaiming_uniform_(a=sqrt(5))) from a generator seeded with ``seed``, so every rank and every resume
    starts from the same adapters; ``dropout_position: post`` moves the dropout from A's input to B's output
    (`_PostDropout`). The adapters keep the model's dtype (DeepSpeed holds the fp32 master copy). Only linear
    layers can be adapted (the merged export folds B @ A into their weights): another target is an error. A
    vision-language model's vision tower is never adapted unless ``vision_tower`` (``policy.vision.lora_vision_tower``).
    """
    import math

    from peft import get_peft_model
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    if not vision_tower:
        from grpo.system.vision import lora_without_tower

        lora = lora_without_tower(model, lora)
    model = get_peft_model(model, peft_lora_config(lora), adapter_name=adapter, autocast_adapter_dtype=False)
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]
    if not layers:
        raise ValueError(f"policy.lora: no module of the model matches (target_modules={lora.target_modules}, "
                         f"match_all_linear={lora.match_all_linear}, exclude_modules={lora.exclude_modules})")
    odd = [name for name, m in layers if not isinstance(m, LoraLinear) or m.fan_in_fan_out]
    if odd:
        raise ValueError(f"policy.lora: only linear layers can be adapted (the export merges B @ A into their "
                         f"weights); these are not: {odd[:5]}. Exclude them (policy.lora.exclude_modules)")
    _warn_rank_over_width(lora.dim, layers)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in layers:
            a = m.lora_A[adapter].weight
            init = torch.empty(a.shape, dtype=torch.float32)
            if lora.lora_A_init == "xavier":
                torch.nn.init.xavier_normal_(init, generator=g)
            else:
                torch.nn.init.kaiming_uniform_(init, a=math.sqrt(5), generator=g)
            a.copy_(init)
            if lora.dropout_position == "post" and lora.dropout > 0:
                m.lora_dropout[adapter] = torch.nn.Identity()
                m.lora_B[adapter].register_forward_hook(_PostDropout(m, lora.dropout))
    return model


def _warn_rank_over_width(dim: int, layers: list) -> None:
    """One warning when ``policy.lora.dim`` exceeds the width (min of in and out features) of adapted layers: B @ A
    of such a layer has rank at most its width, so the extra rank only costs parameters, memory and time."""
    import warnings

    narrow = sorted((min(m.in_features, m.out_features), name) for name, m in layers
                    if dim > min(m.in_features, m.out_features))
    if narrow:
        width, name = narrow[0]
        warnings.warn(f"policy.lora.dim={dim} is larger than the width of {len(narrow)} of the {len(layers)} adapted "
                      f"layers (the narrowest: {name.removeprefix('base_model.model.')}, {width}): an adapter's rank "
                      f"cannot exceed min(in, out) of its layer, so the extra rank only adds parameters and memory; "
                      f"policy.lora.dim <= {width} adapts every layer as fully", UserWarning, stacklevel=3)


def is_lora(module) -> bool:
    """Whether ``module`` (an engine's) is a peft model."""
    return hasattr(module, "peft_config") and hasattr(module, "disable_adapter")


class AdaptersOff:
    """The policy engine with its LoRA adapters off: the base model, the reference of a LoRA run (no second copy
    of the weights). Every call runs under peft's ``disable_adapter``; everything else is the engine's (``module``,
    ``device``, ``eval``, ``zero_optimization_stage``, ...). A ZeRO-3 forward stays a collective, as the engine's."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def __call__(self, **inputs):
        with self.engine.module.disable_adapter():
            return self.engine(**inputs)


class CheckedAdamW(torch.optim.AdamW):
    """torch AdamW that clips the gradient norm and skips a non-finite step, for DeepSpeed without ZeRO (whose
    fp32 path applies whatever gradient it gets).

    ``step()``: g = ||grad||_2 over every parameter; if g is inf or NaN the step is skipped (weights, moments,
    step count unchanged) and ``overflow`` is True, which DeepSpeed reads to count the skip
    (``engine.skipped_steps``, ``engine.was_step_applied()``) and to hold the LR schedule, as ZeRO does;
    otherwise the gradients are scaled by min(1, max_grad_norm / (g + 1e-6)) (``max_grad_norm`` 0: no
    clipping) and AdamW steps. ``_global_grad_norm`` = g (before clipping) is what
    ``engine.get_global_grad_norm()`` reports.
    """

    def __init__(self, params, *, max_grad_norm: float = 0.0, **adamw):
        super().__init__(params, **adamw)
        self.max_grad_norm, self.overflow, self._global_grad_norm = max_grad_norm, False, None

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.zeros(())
        self._global_grad_norm = float(norm)
        self.overflow = not math.isfinite(self._global_grad_norm)
        if self.overflow:
            return None
        if self.max_grad_norm:
            torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, norm)
        return super().step(closure)


class FrozenModel:
    """A frozen model behind the few methods the logprob path calls on a DeepSpeed engine (``module``,
    ``device``, ``eval``, ``train``, ``zero_optimization_stage``, calling it): a reference or teacher that fits
    on each rank runs as a plain module, without ZeRO's per-module hooks."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.module = module.to(device).eval().requires_grad_(False)
        self.device = device

    def __call__(self, **inputs):
        return self.module(**inputs)

    def eval(self) -> None:
        self.module.eval()

    def train(self, mode: bool = True) -> None:
        """Frozen: stays in eval mode."""

    @staticmethod
    def zero_optimization_stage() -> int:
        return 0


def reference_placement(policy, world_size: int, num_params: int, free_bytes: int | None) -> str:
    """Where a frozen model (reference, teacher) runs: ``policy.reference_placement``, or for ``auto`` a plain
    module on each rank when there is one rank or its weights take at most a quarter of the free device
    memory (``free_bytes``; None: unknown), else a ZeRO-3 inference engine sharded over the ranks.

        >>> from grpo.config import PolicyConfig
        >>> reference_placement(PolicyConfig(precision="bfloat16"), 8, num_params=1_500_000_000, free_bytes=80 * 2**30)
        'plain'
        >>> reference_placement(PolicyConfig(precision="bfloat16"), 8, num_params=70_000_000_000, free_bytes=80 * 2**30)
        'zero3'
    """
    return frozen_placement(policy.reference_placement, policy.precision, world_size, num_params, free_bytes)


def frozen_placement(placement: str, precision: str, world_size: int, num_params: int, free_bytes: int | None) -> str:
    """`reference_placement`'s rule for any frozen model (the reward model's ``env.reward_model.placement`` too):
    ``placement`` unless it is ``auto``; then plain on one rank or when the weights in ``precision`` take at most a
    quarter of ``free_bytes``, else zero3.

        >>> frozen_placement("auto", "float32", 2, num_params=1000, free_bytes=None)
        'zero3'
    """
    if placement != "auto":
        return placement
    if world_size == 1:
        return "plain"
    nbytes = num_params * DTYPES[precision].itemsize
    return "plain" if free_bytes is not None and nbytes <= free_bytes / 4 else "zero3"


def free_device_bytes(device: torch.device) -> int | None:
    """Free memory of ``device``: CUDA's free memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def build_reference_engine(cfg, world_size: int, device: torch.device | None = None):
    """The frozen reference (or, with its ``model_name``, a teacher): a `FrozenModel` or a ZeRO-3 inference
    engine (``policy.reference_deepspeed_config``, no optimizer), per `reference_placement`."""
    import deepspeed

    from grpo.system.model_config import load_model_config

    policy = _policy(cfg)
    device = device or comm_device()
    mc = load_model_config(policy)  # with policy.hf_config_overrides, as the policy's
    placement = reference_placement(policy, world_size, _num_params(mc), free_device_bytes(device))
    if placement == "plain":
        from grpo.system.vision import auto_model_class, prepare_model

        model = auto_model_class(mc).from_pretrained(policy.model_name, config=mc, dtype=DTYPES[policy.precision],
                                                     trust_remote_code=policy.trust_remote_code)
        return FrozenModel(prepare_model(model, linear_kernel=policy.cpu_linear_kernel), device)
    ds_config = build_ds_config(policy.reference_deepspeed_config, policy, world_size, for_training=False,
                                hidden_size=_hidden_size(policy))
    model = _load_model(policy, ds_config)
    model.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    engine.eval()
    return engine


def _num_params(model_config) -> int:
    """Parameters of a model, from its config alone (the meta device: nothing allocated)."""
    from grpo.system.vision import auto_model_class

    with torch.device("meta"):
        model = auto_model_class(model_config).from_config(model_config)
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------------
# ZeRO-3 parameters
# --------------------------------------------------------------------------------------------------
def release_params(engine) -> None:
    """Re-partition every ZeRO-3 parameter, waiting for in-flight prefetches.

    A no-grad forward after a training step leaves parameters prefetched along the training trace
    "in flight"; a later `GatheredParameters` (refit, export) then fails with "Cannot partition a
    param in flight". No-op for ZeRO-1/2 engines and frozen plain models. (DeepSpeed's own
    ``engine.empty_partition_cache`` adds a ``gc.collect()``: 0.2 s a call, for nothing here.)
    """
    if engine.zero_optimization_stage() == 3:
        engine.optimizer.empty_partition_cache()
