"""DeepSpeed JSON configs: which one a run uses (``"auto"``: by world size), and every ``"auto"`` value filled
from the run config.

    path, why = policy_ds_config_path(cfg.policy, world_size)      # ds_configs/zero1.json, "one rank: ..."
    ds_config = build_ds_config(path, cfg.policy, world_size, for_training=True, hidden_size=h)

ZeRO-3 partitions parameters, gradients and optimizer states across ranks; on a single rank there is nothing
to partition, and its per-module gather hooks are pure overhead (every forward, every refit). So
``policy.deepspeed_config: auto`` takes, on one rank, no ZeRO at all in fp32 (ds_configs/zero0.json: the
module and torch AdamW as they are; `grpo.system.engines.CheckedAdamW` clips and skips non-finite steps) and ZeRO-1
in 16-bit (its fp32 master weights and overflow check), and ZeRO-3 on several ranks; a path forces a config.
"""

from __future__ import annotations

import json
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# ZeRO bucket sizes filled from the model's hidden size (DeepSpeed's defaults without it).
_BUCKET_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                "stage3_param_persistence_threshold")
AUTO_CONFIGS = {"one_rank_fp32": "ds_configs/zero0.json", "one_rank_16bit": "ds_configs/zero1.json",
                "several_ranks": "ds_configs/zero3.json"}


def policy_ds_config_path(policy, world_size: int) -> tuple[str, str]:
    """``(path, why)`` of the policy's DeepSpeed config: ``policy.deepspeed_config``, or for ``"auto"``
    no ZeRO on one rank in fp32, ZeRO-1 on one rank in 16-bit, ZeRO-3 on several.

        >>> from grpo.config import PolicyConfig
        >>> policy_ds_config_path(PolicyConfig(deepspeed_config="auto", precision="float32"), 1)
        ('ds_configs/zero0.json', 'auto: one rank in float32, nothing to partition')
        >>> policy_ds_config_path(PolicyConfig(deepspeed_config="auto", precision="bfloat16"), 1)[0]
        'ds_configs/zero1.json'
    """
    if policy.deepspeed_config != "auto":
        problem = precision_problem(policy.deepspeed_config, policy.precision)
        if problem:
            raise ValueError(problem)
        return policy.deepspeed_config, "policy.deepspeed_config"
    if world_size == 1 and policy.precision == "float32":
        return AUTO_CONFIGS["one_rank_fp32"], "auto: one rank in float32, nothing to partition"
    if world_size == 1:
        return AUTO_CONFIGS["one_rank_16bit"], f"auto: one rank in {policy.precision} (ZeRO-1 keeps fp32 masters)"
    return AUTO_CONFIGS["several_ranks"], f"auto: {world_size} ranks"


def precision_problem(path: str, precision: str) -> str | None:
    """Why DeepSpeed would refuse the DeepSpeed JSON at ``path`` with ``precision``, or None.

    Without ZeRO, DeepSpeed accumulates gradients in the model's dtype only: a 16-bit model with
    ``data_types.grad_accum_dtype`` fp32 (as ds_configs/zero0.json sets) raises NotImplementedError
    ("unsupported mix of model_dtype and grad_accum_dtype", deepspeed 0.19.8 engine
    ``_do_optimizer_sanity_check``) when the engine is built. `policy_ds_config_path` raises this before.

        >>> precision_problem("ds_configs/zero0.json", "float32") is None
        True
        >>> precision_problem("ds_configs/zero0.json", "bfloat16").split(":")[0]
        'policy.deepspeed_config=ds_configs/zero0.json with policy.precision=bfloat16'
    """
    with open(_resolve_path(path)) as f:
        ds = json.load(f)
    accum = ds.get("data_types", {}).get("grad_accum_dtype")
    names = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    if int(ds.get("zero_optimization", {}).get("stage", 0)) > 0 or accum is None or accum == names[precision]:
        return None
    return (f"policy.deepspeed_config={path} with policy.precision={precision}: without ZeRO DeepSpeed accumulates "
            f"gradients in the model's dtype only, and this file sets data_types.grad_accum_dtype={accum} "
            "(DeepSpeed raises NotImplementedError). Use deepspeed_config auto (ZeRO-1 on one rank in 16-bit, "
            "with fp32 accumulation), ds_configs/zero1.json, or policy.precision=float32")


def zero_stage(path: str) -> int:
    """The ZeRO stage a DeepSpeed JSON sets (0 without ``zero_optimization``)."""
    with open(_resolve_path(path)) as f:
        return int(json.load(f).get("zero_optimization", {}).get("stage", 0))


def _resolve_path(path: str) -> Path:
    """As given if it exists, else relative to the repository root (``ds_configs/zero3.json``)."""
    p = Path(path)
    return p if p.exists() or p.is_absolute() else REPO_ROOT / p


def _find_auto(node, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [k for key, v in node.items() for k in _find_auto(v, f"{prefix}{key}.")]
    return [prefix.rstrip(".")] if node == "auto" else []


def build_ds_config(json_path: str, cfg, world_size: int, *, for_training: bool,
                    hidden_size: int | None = None) -> dict:
    """Load a DeepSpeed JSON config and fill every ``"auto"`` from the run config.

    - train_micro_batch_size_per_gpu = policy.train_micro_batch_size (training) or
      policy.logprob_batch_size (inference engines),
    - train_batch_size = policy.train_global_batch_size (training) or micro * world_size,
    - gradient_accumulation_steps = global // (micro * world_size), an error when not divisible,
    - gradient_clipping = policy.max_grad_norm (0: off), bf16/fp16.enabled from policy.precision,
    - with ``hidden_size`` = h (as transformers does): reduce_bucket_size = allgather_bucket_size =
      h*h, stage3_prefetch_bucket_size = 0.9*h*h, stage3_param_persistence_threshold = 10*h;
      without it those keys fall back to DeepSpeed's defaults;
    - training with ZeRO in bf16 / fp16: data_types.grad_accum_dtype = "fp32" unless the JSON sets it
      (DeepSpeed otherwise sums the micro-batch gradients in the model's 16-bit dtype).

    The optimizer and LR schedule come from policy.optimizer / policy.scheduler, never from the JSON.
    """
    policy = getattr(cfg, "policy", cfg)
    path = _resolve_path(json_path)
    with open(path) as f:
        ds = json.load(f)
    for key in ("optimizer", "scheduler"):
        if key in ds:
            raise ValueError(f"{path}: remove the {key!r} section; it is built from policy.optimizer / "
                             "policy.scheduler of the run config")
    if for_training:
        micro, global_bs = policy.train_micro_batch_size, policy.train_global_batch_size
        if global_bs % (micro * world_size):
            raise ValueError(
                f"policy.train_global_batch_size={global_bs} must be a multiple of "
                f"policy.train_micro_batch_size={micro} x world_size={world_size} = {micro * world_size} "
                "(DeepSpeed train_batch_size = micro x gradient_accumulation_steps x world_size)"
            )
    else:
        micro = policy.logprob_batch_size
        global_bs = micro * world_size
    values = {
        "train_batch_size": global_bs,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": global_bs // (micro * world_size),
        "gradient_clipping": policy.max_grad_norm or 0.0,
        "bf16.enabled": policy.precision == "bfloat16",
        "fp16.enabled": policy.precision == "float16",
    }
    if hidden_size is not None:
        h = hidden_size
        sizes = (h * h, h * h, int(0.9 * h * h), 10 * h)
        values.update({f"zero_optimization.{k}": v for k, v in zip(_BUCKET_KEYS, sizes)})
    for key in _find_auto(ds):
        *parents, leaf = key.split(".")
        node = ds
        for p in parents:
            node = node[p]
        if key in values:
            node[leaf] = values[key]
        elif parents == ["zero_optimization"] and leaf in _BUCKET_KEYS:
            del node[leaf]  # no hidden size: DeepSpeed's default
        else:
            raise ValueError(f"{path}: no value for {key}='auto' (fillable keys: {sorted(values)})")
    if not for_training:
        ds.pop("gradient_clipping", None)
    elif policy.precision != "float32" and ds.get("zero_optimization", {}).get("stage", 0) > 0:
        ds.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")
    return ds
