"""DeepSpeed engines: process group, ZeRO configs, policy and reference engines, logprobs and the
training step (getting the weights out of them: `grpo.weights`).

Data parallelism: every rank holds the same global rollout batch and trains on its own shard, with a
loss normalised by GLOBAL counts, so the per-rank losses sum to the full-batch loss. DeepSpeed
averages gradients over ranks and divides by gradient_accumulation_steps; `train_on_batch` undoes
both, so one process on the full batch and N processes on shards apply the same update.

Every forward of a ZeRO-3 engine is a collective: all ranks call `compute_logprobs`,
`train_on_batch` (and `grpo.weights`' gathers and export) together.
"""

from __future__ import annotations

import math
import os
import socket
import sys
from collections.abc import Callable
from functools import partial
from typing import NoReturn

import torch
import torch.distributed as dist

from grpo.ds_config import build_ds_config, policy_ds_config_path
from grpo.logprobs import aligned_logprobs_from_logits, mask_out_of_filter, needs_filter

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _policy(cfg):
    """Accept the MasterConfig or its PolicyConfig."""
    return getattr(cfg, "policy", cfg)


# --------------------------------------------------------------------------------------------------
# Process group
# --------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(local_rank: int | None = None) -> tuple[int, int, int, torch.device]:
    """Start (or join) the process group; return ``(rank, local_rank, world_size, device)``.

    Launchers: torchrun, the ``deepspeed`` launcher and ``accelerate launch`` set RANK / LOCAL_RANK /
    WORLD_SIZE / MASTER_ADDR / MASTER_PORT; a plain ``python script.py`` sets none, and we fill in a
    one-process group on a free port. ``local_rank`` is the ``--local_rank=N`` argument the deepspeed
    launcher appends (it also sets LOCAL_RANK). Backend: nccl with CUDA, gloo without. Idempotent.
    """
    import deepspeed
    import deepspeed.ops

    # ZeRO never uses the shm comm op, and its first use JIT-compiles C++ for minutes.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if local_rank is not None:
        os.environ["LOCAL_RANK"] = str(local_rank)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
    return dist.get_rank(), local_rank, dist.get_world_size(), device


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


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank (a collective)."""
    return bool(_all_reduce(torch.tensor([float(flag)], device=_comm_device()), op="max").item())


def _all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t


# --------------------------------------------------------------------------------------------------
# Learning-rate schedule
# --------------------------------------------------------------------------------------------------
def lr_lambda(step: int, *, name: str, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> float:
    """Multiplier of the base lr at optimizer step ``step`` (0-based).

    Warmup: (step + 1) / warmup_steps while step < warmup_steps (the first step is not wasted at 0).
    Then, with p = clamp((step - warmup_steps) / max(1, total_steps - warmup_steps), 0, 1) and
    m = min_lr_ratio: cosine m + (1 - m) * (1 + cos(pi * p)) / 2; linear m + (1 - m) * (1 - p);
    constant 1.

        >>> lr_lambda(0, name="cosine", warmup_steps=2, total_steps=6)
        0.5
        >>> lr_lambda(4, name="cosine", warmup_steps=2, total_steps=6)
        0.5
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if name == "constant":
        return 1.0
    p = min(max((step - warmup_steps) / max(1, total_steps - warmup_steps), 0.0), 1.0)
    if name == "cosine":
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))
    if name == "linear":
        return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - p)
    raise ValueError(f"policy.scheduler.name={name!r}: expected one of ['constant', 'cosine', 'linear']")


# --------------------------------------------------------------------------------------------------
# Engines
# --------------------------------------------------------------------------------------------------
def _load_model(policy, ds_config: dict):
    """``from_pretrained``; under ZeRO-3 a live HfDeepSpeedConfig makes it load straight into
    partitioned parameters (no rank ever holds the whole model). It is dropped right after, so later
    plain models (the generation copy) are not partitioned."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    zero3 = ds_config.get("zero_optimization", {}).get("stage", 0) == 3
    live = HfDeepSpeedConfig(ds_config) if zero3 else None
    try:
        return AutoModelForCausalLM.from_pretrained(
            policy.model_name, dtype=DTYPES[policy.precision], trust_remote_code=policy.trust_remote_code
        )
    finally:
        del live
        unset_hf_deepspeed_config()


def _hidden_size(policy) -> int | None:
    from transformers import AutoConfig

    mc = AutoConfig.from_pretrained(policy.model_name, trust_remote_code=policy.trust_remote_code)
    return getattr(mc.get_text_config(), "hidden_size", None)


def build_policy_engine(cfg, world_size: int, total_optimizer_steps: int):
    """The trainable ZeRO engine: model, torch AdamW (policy.optimizer), warmup + schedule (lr_lambda).

    The DeepSpeed config is `grpo.ds_config.policy_ds_config_path` (``auto``: no ZeRO on one rank in fp32,
    ZeRO-1 on one rank in 16-bit, ZeRO-3 on several). torch AdamW in every configuration, offload while
    generating included (`grpo.offload`; DeepSpeed's FusedAdam would need nvcc and ninja to JIT-build its op);
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
    o, s = policy.optimizer, policy.scheduler
    adamw = dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    no_zero_fp32 = ds_config.get("zero_optimization", {}).get("stage", 0) == 0 and policy.precision == "float32"
    if no_zero_fp32:  # DeepSpeed's own fp32 clipping records no norm: the optimizer clips
        optimizer = CheckedAdamW(model.parameters(), max_grad_norm=ds_config.get("gradient_clipping", 0.0), **adamw)
        ds_config["gradient_clipping"] = 0.0
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **adamw)
    schedule = partial(lr_lambda, name=s.name, warmup_steps=s.warmup_steps, total_steps=total_optimizer_steps,
                       min_lr_ratio=s.min_lr_ratio)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                      lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
    if no_zero_fp32 and engine.dp_world_size == 1:
        engine.enable_backward_allreduce = False  # an all-reduce over one rank copies every gradient twice
    return engine


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
    if policy.reference_placement != "auto":
        return policy.reference_placement
    if world_size == 1:
        return "plain"
    nbytes = num_params * DTYPES[policy.precision].itemsize
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
    from transformers import AutoConfig

    policy = _policy(cfg)
    device = device or _comm_device()
    mc = AutoConfig.from_pretrained(policy.model_name, trust_remote_code=policy.trust_remote_code)
    placement = reference_placement(policy, world_size, _num_params(mc), free_device_bytes(device))
    if placement == "plain":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(policy.model_name, dtype=DTYPES[policy.precision],
                                                     trust_remote_code=policy.trust_remote_code)
        return FrozenModel(model, device)
    ds_config = build_ds_config(policy.reference_deepspeed_config, policy, world_size, for_training=False,
                                hidden_size=_hidden_size(policy))
    model = _load_model(policy, ds_config)
    model.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    engine.eval()
    return engine


def _num_params(model_config) -> int:
    """Parameters of a model, from its config alone (the meta device: nothing allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------------
# Logprobs and training
# --------------------------------------------------------------------------------------------------
def forward_logprobs(engine, input_ids_bt, attention_mask_bt, temperature: float = 1.0, chunk_size=None, *,
                     top_k: int | None = None, top_p: float = 1.0, return_unfiltered: bool = False,
                     prompt_lens_b: torch.Tensor | None = None):
    """Aligned token logprobs [B, T] with grad: 0 at position 0 and on padding, and at t

        log softmax_K(logits[t - 1] / temperature)[input_ids[t]]   (right-padded batches)

    with K the sampler's top-k / top-p keep set (`grpo.logprobs.token_logprobs`; the defaults filter
    nothing). A token outside K gets 0, as NeMo-RL's ``mask_out_neg_inf_logprobs`` does (see
    `grpo.logprobs.mask_out_of_filter`). ``return_unfiltered=True`` returns ``(filtered, unfiltered)``,
    the second with the temperature only, from the same pass over the logits.

    ``prompt_lens_b``: the rows' prompt lengths (`grpo.shared_prefix.prompt_lengths`); given, a prompt that
    several rows share goes through the model once (`grpo.shared_prefix`: same values up to rounding). Not
    under ZeRO-3, where every forward is a collective and ranks would have to agree on sharing.
    """
    from grpo.shared_prefix import plan_shared_prefix

    device = engine.device
    ids_bt, mask_bt = input_ids_bt.to(device), attention_mask_bt.to(device)

    def logprobs(logits_nlv, ids_nl):
        return aligned_logprobs_from_logits(logits_nlv, ids_nl, temperature, chunk_size, top_k=top_k, top_p=top_p,
                                            return_unfiltered=True)

    checkpointed = torch.is_grad_enabled() and getattr(engine.module, "is_gradient_checkpointing", False)
    can_share = prompt_lens_b is not None and not checkpointed and engine.zero_optimization_stage() != 3
    plan = plan_shared_prefix(ids_bt, mask_bt, prompt_lens_b) if can_share else None
    shared = plan.logprobs(engine, logprobs) if plan is not None else None
    if shared is not None:
        lp_bt, full_bt = shared
    else:
        lp_bt, full_bt = logprobs(engine(input_ids=ids_bt, attention_mask=mask_bt, use_cache=False).logits, ids_bt)
    lp_bt, _ = mask_out_of_filter(lp_bt, mask_bt)
    if return_unfiltered:
        return lp_bt, torch.where(mask_bt > 0, full_bt, 0.0)
    return lp_bt


@torch.no_grad()
def compute_logprobs(engine, input_ids_bt, attention_mask_bt, temperature: float, micro_batch_size: int,
                     chunk_size=None, *, top_k: int | None = None, top_p: float = 1.0,
                     prompt_lens_b: torch.Tensor | None = None) -> torch.Tensor:
    """`forward_logprobs` without grad, micro-batch by micro-batch; returns [B, T] fp32 on the CPU.

    ``top_k`` / ``top_p``: the sampler's filter (policy.generation.top_k / top_p) for the previous-policy
    logprobs; leave them off for the reference policy (NeMo-RL: its top-k set is not the policy's).
    Ranks may hold different numbers of rows: every rank runs as many forwards as the busiest one
    (the extra ones on a dummy row), since each ZeRO-3 forward is a collective.
    """
    was_training = engine.module.training
    engine.eval()
    B = input_ids_bt.shape[0]
    n_local = math.ceil(B / micro_batch_size)
    n_all = int(_all_reduce(torch.tensor([n_local], device=_comm_device()), op="max").item())
    out = []
    for i in range(n_all):
        if i < n_local:
            sl = slice(i * micro_batch_size, (i + 1) * micro_batch_size)
            out.append(forward_logprobs(engine, input_ids_bt[sl], attention_mask_bt[sl], temperature, chunk_size,
                                        top_k=top_k, top_p=top_p,
                                        prompt_lens_b=None if prompt_lens_b is None else prompt_lens_b[sl],
                                        ).float().cpu())
        else:
            dummy = torch.zeros((1, 2), dtype=torch.long)
            forward_logprobs(engine, dummy, torch.ones_like(dummy), temperature, chunk_size, top_k=top_k, top_p=top_p)
    release_params(engine)
    engine.train(was_training)
    return torch.cat(out) if out else torch.zeros(input_ids_bt.shape, dtype=torch.float32)


def _to_python(v):
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.detach().cpu().tolist()
    return v


def release_params(engine) -> None:
    """Re-partition every ZeRO-3 parameter, waiting for in-flight prefetches.

    A no-grad forward after a training step leaves parameters prefetched along the training trace
    "in flight"; a later `GatheredParameters` (refit, export) then fails with "Cannot partition a
    param in flight". No-op for ZeRO-1/2 engines and frozen plain models. (DeepSpeed's own
    ``engine.empty_partition_cache`` adds a ``gc.collect()``: 0.2 s a call, for nothing here.)
    """
    if engine.zero_optimization_stage() == 3:
        engine.optimizer.empty_partition_cache()


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


LossClosure = Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]]


def train_on_batch(engine, micro_batches: list[dict], loss_closure: LossClosure, *, temperature: float = 1.0,
                   chunk_size=None, top_k: int | None = None, top_p: float = 1.0, share_prompts: bool = False) -> dict:
    """One optimizer step over this rank's micro-batches; returns metrics, loss, grad_norm, lr.

    A micro-batch is a `grpo.batch.TrainBatch` (or a dict with its field names): its ``input_ids_bt`` and
    ``attention_mask_bt`` go through the model; the closure gets it with its tensors on the engine's device.
    ``logprobs_bt`` are `forward_logprobs` with ``temperature`` and the sampler's ``top_k`` / ``top_p``
    filter (policy.generation.*). With a filter on, the micro-batch also holds ``unfiltered_logprobs_bt``
    (temperature only, with grad, from the same forward): NeMo-RL's ``curr_logprobs_unfiltered``, for the
    KL term (`grpo.loss.clipped_pg_loss`'s ``unfiltered_logprobs``). ``share_prompts``: rows that share a
    prompt run it once (`grpo.shared_prefix`; prompts end where ``token_mask_bt`` starts).

    ``loss_closure(logprobs_bt, mb) -> (loss, metrics)`` must normalise by GLOBAL counts (all
    micro-batches of all ranks), so the losses sum to the full-batch loss L. DeepSpeed applies
    (1 / world) * sum_ranks (1 / GAS) * sum_mb grad(loss_mb); backward on world * loss_mb without
    the 1/GAS scaling makes that sum_ranks sum_mb grad(loss_mb) = grad(L).

    Returns ``loss`` = L (summed over micro-batches and ranks), the closure's metrics aggregated over
    micro-batches and ranks by `grpo.metrics.aggregate_rollout_metrics` (mean; min / max by name),
    ``grad_norm`` = |grad(L)| before clipping, and ``lr``, the learning rate this step used.
    """
    from grpo.batch import get, to_device, with_fields
    from grpo.metrics import aggregate_rollout_metrics
    from grpo.shared_prefix import prompt_lengths
    from grpo.rollout import all_gather_objects

    gas = engine.gradient_accumulation_steps()
    if len(micro_batches) != gas:
        raise ValueError(
            f"train_on_batch got {len(micro_batches)} micro-batches but DeepSpeed steps every "
            f"gradient_accumulation_steps={gas}: each rank needs policy.train_global_batch_size / world_size "
            "rows split into micro-batches of policy.train_micro_batch_size"
        )
    world = engine.dp_world_size
    lr = engine.get_lr()[0]
    engine.train()
    loss_sum, mb_metrics = 0.0, []
    for mb in micro_batches:
        mb = to_device(mb, engine.device)
        ids_bt, mask_bt = get(mb, "input_ids_bt"), get(mb, "attention_mask_bt")
        prompt_lens_b = prompt_lengths(get(mb, "token_mask_bt"), mask_bt) if share_prompts else None
        if needs_filter(top_k, top_p):
            logprobs_bt, unfiltered_bt = forward_logprobs(engine, ids_bt, mask_bt, temperature, chunk_size,
                                                          top_k=top_k, top_p=top_p, return_unfiltered=True,
                                                          prompt_lens_b=prompt_lens_b)
            mb = with_fields(mb, unfiltered_logprobs_bt=unfiltered_bt)
        else:
            logprobs_bt = forward_logprobs(engine, ids_bt, mask_bt, temperature, chunk_size,
                                           prompt_lens_b=prompt_lens_b)
        loss, metrics = loss_closure(logprobs_bt, mb)
        engine.backward(loss * world, scale_wrt_gas=False)
        engine.step()
        loss_sum += float(loss.detach())
        mb_metrics.append({k: _to_python(v) for k, v in metrics.items()})
    total = _all_reduce(torch.tensor([loss_sum], dtype=torch.float64, device=_comm_device()))
    grad_norm = engine.get_global_grad_norm()
    return {**aggregate_rollout_metrics(all_gather_objects(mb_metrics)), "loss": float(total.item()),
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"), "lr": lr}
