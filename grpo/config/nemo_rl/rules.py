"""What each key of a NeMo-RL GRPO recipe becomes in grpo-ds (`translate`), section by section.

Every leaf key of the resolved recipe gets exactly one fate, and a key that nothing claims is an error:

- honored: the same dotted key exists in `grpo.config.MasterConfig` and means the same: copied as is;
- translated: it becomes other grpo-ds keys (``policy.optimizer.kwargs.lr`` -> ``policy.optimizer.lr``, the
  scheduler list -> ``policy.scheduler``, ``data.train`` -> ``data.*``, ``env.math`` -> ``env``); a table row says
  what it became;
- ignored: it only configures a backend grpo-ds does not have (Megatron parallelism, DTensor internals, Ray ports,
  TRT-LLM, ...); a table row says why;
- refused: it changes the algorithm (or the data) and grpo-ds cannot do it; the `ConfigError` names the key and
  why. Every refusal of a recipe is reported at once.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from grpo.config import MasterConfig
from grpo.config.load import ConfigError, section_model
from grpo.config.nemo_rl.gym_rules import gym_data_and_env, gym_grpo_and_penalties, is_gym_recipe

REPO_ROOT = Path(__file__).resolve().parents[3]  # grpo/config/nemo_rl/rules.py -> the repository
PROMPTS_DIR = REPO_ROOT / "configs" / "prompts"  # our own wording of NeMo-RL's examples/prompts/*.txt names

ADAMW = ("torch.optim.AdamW", "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam")
DEEPSPEED = "grpo-ds trains with DeepSpeed ZeRO (ZeRO-3 shards weights, gradients and optimizer states over the ranks)"


def _flatten(node, prefix: str = "") -> dict[str, Any]:
    """Leaves by dotted key; an empty mapping, a list and null are leaves."""
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: node}


def native_field(key: str):
    """The `MasterConfig` field at dotted ``key``: its FieldInfo, "section" for a section, or None."""
    model, parts = MasterConfig, key.split(".")
    for i, part in enumerate(parts):
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return None
        sub = section_model(field.annotation)
        if i == len(parts) - 1:
            return "section" if sub is not None else field
        model = sub
    return None


_ABSENT = object()


class Walk:
    """The resolved recipe, what has been decided about its keys, and the grpo-ds dict being built."""

    def __init__(self, nrl: dict, base_dir: Path):
        self.nrl, self.base_dir = nrl, base_dir
        self.leaves = _flatten(nrl)
        self.used: set[str] = set()
        self.out: dict = {}
        self.table: list[tuple[str, str, str]] = []
        self.errors: list[str] = []

    # -- reading ------------------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return any(k == key or k.startswith(key + ".") for k in self.leaves)

    def get(self, key: str, default=None):
        node: Any = self.nrl
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def take(self, key: str, default=None):
        """The value at ``key`` (a leaf or a section), marking it and everything under it decided."""
        self.used.update(k for k in self.leaves if k == key or k.startswith(key + "."))
        return self.get(key, default)

    def open_keys(self, prefix: str) -> list[str]:
        return [k for k in self.leaves if (k == prefix or k.startswith(prefix + ".")) and k not in self.used]

    # -- deciding -----------------------------------------------------------------------------------
    def set(self, key: str, value) -> None:
        node = self.out
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value

    def honor(self, key: str) -> None:
        if self.has(key):
            self.set(key, self.take(key))

    def translate(self, key: str, targets: dict[str, Any], note: str = "") -> None:
        """``key`` becomes ``targets`` (dotted grpo-ds key -> value); a table row says so."""
        self.take(key)
        for target, value in targets.items():
            self.set(target, value)
        what = ", ".join(f"{t}={value!r}" for t, value in targets.items())
        self.table.append(("translated", key, f"-> {what}{'; ' + note if note else ''}" if what else note))

    def ignore(self, key: str, why: str) -> None:
        """Ignore what is still open under ``key`` (one table row), if anything is."""
        if self.open_keys(key):
            self.take(key)
            self.table.append(("ignored", key, why))

    def refuse(self, key: str, why: str, value=_ABSENT) -> None:
        taken = self.take(key)
        self.errors.append(f"{key}={_short(taken if value is _ABSENT else value)}: {why}")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _enabled(section) -> bool:
    return isinstance(section, dict) and bool(section.get("enabled"))


def _flag(w: Walk, key: str, default: bool = False) -> bool:
    """The boolean at ``key`` as grpo-ds's own loader reads one (pydantic: true / false, yes / no, on / off, 1 / 0,
    any case); anything else is refused, naming the key. NeMo-RL's own code tests the value's truth, so the string
    "false" would turn a feature on there: read as false here, as a native config reads it."""
    from pydantic import TypeAdapter, ValidationError

    value = w.get(key, default)
    try:
        return TypeAdapter(bool).validate_python(value)
    except ValidationError:
        w.refuse(key, "expected a boolean (true or false)")
        return False


def _section_on(w: Walk, key: str) -> bool:
    """Whether the feature section at ``key`` (``{enabled: ..., ...}``; absent or null: off) is on; a section that is
    not a mapping is refused, naming it."""
    section = w.get(key)
    if section is None:
        return False
    if not isinstance(section, dict):
        w.refuse(key, "expected a mapping with an enabled key (NeMo-RL's LoRA config: enabled, target_modules, "
                 "exclude_modules, dim, alpha, ...)")
        return False
    return _flag(w, f"{key}.enabled")


def _module_names(w: Walk, key: str) -> list[str]:
    """A list of module names at ``key``. A single string is one name, as NeMo-RL reads it (Automodel's
    ModuleMatcher, which its DTensor LoRA uses, wraps a string into a one-entry list); null is no names; anything
    else (a number, a mapping, a list holding non-strings) is refused, naming the key."""
    value = w.get(key)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    w.refuse(key, "expected a list of module names (or one name)")
    return []


# --------------------------------------------------------------------------------------------------
# The translation
# --------------------------------------------------------------------------------------------------
def translate(nrl: dict, base_dir: Path | str = ".") -> tuple[dict, list[tuple[str, str, str]]]:
    """A resolved NeMo-RL recipe -> (raw grpo-ds config dict, table rows). Raises `ConfigError` listing every
    refused key."""
    w = Walk(nrl, Path(base_dir))
    _policy(w)
    _generation(w)
    _data_and_env(w)
    _loss(w)
    _grpo(w)
    _checkpointing(w)
    _logger_cluster_rest(w)
    for key in [k for k in w.leaves if k not in w.used]:  # same name, same meaning
        field, value = native_field(key), w.leaves[key]
        if field == "section" and value in (None, {}):  # `async_grpo: null`: the defaults
            w.take(key)
        elif field is not None and field != "section":
            w.honor(key)
    for key in [k for k in w.leaves if k not in w.used]:
        w.refuse(key, "no translation: grpo-ds does not know this NeMo-RL key, so it cannot promise to honor it "
                      f"(delete it with the override ~{key}, or file an issue)")
    if w.errors:
        raise Refused(w.errors, w.out)
    return w.out, w.table


class Refused(ConfigError):
    """The keys of a recipe grpo-ds cannot honor (``errors``: a line each, naming the key and why), with what the
    other keys translated to (``out``), so that the caller can report that config's own errors in the same run."""

    def __init__(self, errors: list[str], out: dict):
        super().__init__("NeMo-RL recipe: keys grpo-ds cannot honor:\n  " + "\n  ".join(errors))
        self.errors, self.out = list(errors), out


# -- policy -------------------------------------------------------------------------------------------
def _policy(w: Walk) -> None:
    model = w.get("policy.model_name")
    if w.has("policy.tokenizer.name"):
        name = w.get("policy.tokenizer.name")
        w.take("policy.tokenizer.name")
        if name not in (None, model):
            w.set("policy.tokenizer.name", name)
    _chat_template(w)
    # The template's extra variables (enable_thinking), in every rendering: NeMo-RL binds them to
    # tokenizer.apply_chat_template (nemo_rl/algorithms/utils.py:394-403); grpo.system.chat passes them the same way.
    w.honor("policy.tokenizer.chat_template_kwargs")
    w.ignore("policy.tokenizer.use_fastokens", "a faster tokenizer implementation (same tokens); grpo-ds uses "
             "transformers' tokenizer")
    # Applied to the policy, the reference and vLLM's hf_overrides, as NeMo-RL does (models/automodel/setup.py:309-334,
    # algorithms/grpo.py:1345-1346): grpo.system.model_config; a key the model config lacks fails at load.
    w.honor("policy.hf_config_overrides")
    # NeMo-RL loads the processor when it is set (examples/nemo_gym/run_grpo_nemo_gym.py); grpo-ds follows the
    # checkpoint and checks the key against it at model load (grpo.system.vision.check_policy).
    w.honor("policy.is_vlm")
    w.ignore("policy.activation_checkpointing_enabled", "NeMo-RL reads no such key (a stale key of this recipe; "
             "dtensor_cfg / megatron_cfg.activation_checkpointing are the ones read)")
    w.ignore("policy.offload_optimizer_for_logprob", "memory placement for non-colocated generation only")
    w.ignore("policy.make_sequence_length_divisible_by", "padding for tensor/context parallelism, which grpo-ds "
             "does not have")
    _token_batching(w)
    if _enabled(w.get("policy.draft")):
        w.refuse("policy.draft.enabled", "trains a speculative-decoding draft model beside the policy (an extra loss "
                 "and weights); grpo-ds has none")
    w.ignore("policy.draft", "draft.enabled=false: no draft model (as in NeMo-RL)")

    quant = [k for k in ("policy.quant_cfg", "policy.generation.quant_cfg") if w.get(k)]
    if quant:
        w.refuse(quant[0], "quantization (NVIDIA ModelOpt: fake-quantized training and/or quantized rollouts) "
                 "changes the model that is trained and sampled; grpo-ds trains and generates in policy.precision")
    for k in ("quant_cfg", "quant_calib_data", "quant_calib_size", "quant_batch_size", "quant_sequence_length",
              "disable_modelopt_layer_spec", "generation.quant_cfg", "generation.real_quant",
              "generation.real_quant_ignore"):
        w.take(f"policy.{k}")
    if _enabled(w.get("policy.router_replay")):
        w.refuse("policy.router_replay.enabled", "rollout routing replay (R3): training reuses the MoE routing of "
                 "generation, which changes the trained logprobs; grpo-ds routes afresh")
    w.ignore("policy.router_replay", "router_replay.enabled=false: MoE routing is recomputed, as grpo-ds does")
    w.ignore("policy.refit_buffer_size_gb", "weight-refit transfer buffer; grpo-ds refits in buckets of "
             "policy.generation.refit_bucket_numel")
    megatron = _enabled(w.get("policy.megatron_cfg"))
    dtensor = w.get("policy.dtensor_cfg")
    if megatron:
        _megatron(w)
        w.ignore("policy.dtensor_cfg", "megatron_cfg.enabled=true: NeMo-RL does not use dtensor_cfg either")
        w.ignore("policy.optimizer", "megatron_cfg.enabled=true: NeMo-RL trains with megatron_cfg.optimizer "
                 "(translated instead)")
        w.ignore("policy.scheduler", "megatron_cfg.enabled=true: NeMo-RL trains with megatron_cfg.scheduler "
                 "(translated instead)")
        return
    w.ignore("policy.megatron_cfg", "megatron_cfg.enabled=false: NeMo-RL does not use it either")
    if isinstance(dtensor, dict):
        if _section_on(w, "policy.dtensor_cfg.lora_cfg"):
            _lora(w, "policy.dtensor_cfg.lora_cfg")
        w.ignore("policy.dtensor_cfg.lora_cfg", "lora_cfg.enabled=false: full fine-tuning, as grpo-ds does")
        if w.has("policy.dtensor_cfg.activation_checkpointing"):
            w.translate("policy.dtensor_cfg.activation_checkpointing",
                        {"policy.activation_checkpointing": bool(dtensor.get("activation_checkpointing"))})
        if dtensor.get("cpu_offload"):
            w.translate("policy.dtensor_cfg.cpu_offload", {"policy.deepspeed_config": "ds_configs/zero3_offload.json"},
                        "ZeRO-3 with parameters and optimizer states on the host")
        w.take("policy.dtensor_cfg.cpu_offload")
        if (dtensor.get("tensor_parallel_size") or 1) > 1:
            w.ignore("policy.dtensor_cfg.tensor_parallel_size", f"training tensor parallelism; {DEEPSPEED} instead "
                     "(the same math)")
        w.ignore("policy.dtensor_cfg", f"DTensor (FSDP2) internals: parallel sizes, plans, automodel kwargs; {DEEPSPEED}")
    _torch_optimizer(w)
    _torch_scheduler(w)


# Megatron's module names (megatron_cfg.peft.target_modules) as the Hugging Face models' (Llama / Qwen / Mistral)
MEGATRON_LINEARS = {"linear_qkv": ["q_proj", "k_proj", "v_proj"], "linear_proj": ["o_proj"],
                    "linear_fc1": ["gate_proj", "up_proj"], "linear_fc2": ["down_proj"]}


PACKING_KEYS = ("train_mb_tokens", "logprob_mb_tokens", "algorithm", "microbatch_order", "sequence_length_round")


def _token_batching(w: Walk) -> None:
    """``policy.sequence_packing`` / ``policy.dynamic_batching`` -> the native sections of the same names and
    meanings (grpo/packing.py, grpo/system/packed.py); a disabled one is written as disabled, so the recipe's
    choice stands whatever grpo-ds's default. NeMo-RL packs each sample padded to make_sequence_length_divisible_by
    (tensor parallelism, which grpo-ds has not) and reads no sequence_length_round for packing; grpo-ds pads each
    packed row to it (shape steadiness only: the same values)."""
    for section, keys in (("sequence_packing", PACKING_KEYS),
                          ("dynamic_batching", ("train_mb_tokens", "logprob_mb_tokens", "sequence_length_round"))):
        key = f"policy.{section}"
        if not w.has(key):
            continue
        cfg = w.get(key) or {}
        if not _enabled(cfg):
            w.translate(key, {f"{key}.enabled": False})
            continue
        out = {f"{key}.enabled": True, **{f"{key}.{k}": cfg[k] for k in keys if cfg.get(k) is not None}}
        w.translate(key, out, "same values as the padded forward, other speed and memory")


def _lora(w: Walk, key: str, megatron: bool = False) -> None:
    """An enabled ``dtensor_cfg.lora_cfg`` (or ``megatron_cfg.peft``) -> ``policy.lora``, peft on DeepSpeed
    (grpo/system/engines.py apply_lora). NeMo-RL's meanings (docs/guides/lora.md, models/policy/__init__.py:95-106,
    models/automodel/setup.py:662-672): match_all_linear adapts every linear layer and overrides target_modules;
    empty target_modules adapt every linear layer; alpha / dim scales the adapter; B starts at zero."""
    cfg = w.get(key)
    out: dict[str, Any] = {"enabled": True}
    mods = {field: _module_names(w, f"{key}.{field}") for field in ("target_modules", "exclude_modules")}
    note = []
    if megatron:  # Megatron's layer names -> the HF model's; its LoRA has no match_all_linear (empty = all)
        kept = sorted({m for ms in mods.values() for m in ms if m.rsplit(".", 1)[-1] not in MEGATRON_LINEARS})
        if kept:
            note.append(f"{kept} kept as they are: matched against the Hugging Face model's module names")
        mods = {f: [m.rsplit(".", 1)[0] + "." + hf if "." in m else hf for m in ms
                    for hf in MEGATRON_LINEARS.get(m.rsplit(".", 1)[-1], [m.rsplit(".", 1)[-1]])]
                for f, ms in mods.items()}
        match_all = not mods["target_modules"]
    else:
        match_all = _flag(w, f"{key}.match_all_linear") or not mods["target_modules"]
    if match_all and mods["target_modules"]:
        note.append(f"target_modules={mods['target_modules']} ignored: match_all_linear=true overrides them (NeMo-RL)")
        mods["target_modules"] = []
    out.update(match_all_linear=match_all, **mods)
    for src, dst in (("dim", "dim"), ("alpha", "alpha"), ("dropout", "dropout"),
                     ("dropout_position", "dropout_position"),
                     ("lora_A_init_method" if megatron else "lora_A_init", "lora_A_init")):
        if src in cfg:
            out[dst] = cfg[src]
    if out.get("dropout_position", "post") not in ("pre", "post"):
        w.refuse(f"{key}.dropout_position", "NeMo-RL's dropout positions are pre and post")
    if out.get("lora_A_init", "xavier") not in ("xavier", "uniform"):
        w.refuse(f"{key}.{'lora_A_init_method' if megatron else 'lora_A_init'}", "the A initializations NeMo-RL "
                 "documents are xavier and uniform (grpo-ds implements those two)")
    if megatron:
        if cfg.get("lora_B_init_method", "zero") != "zero":
            w.refuse(f"{key}.lora_B_init_method", "B starts at zero in grpo-ds (the adapted model starts as the base)")
        w.take(f"{key}.lora_B_init_method")
        if cfg.get("lora_dtype") not in (None, "None", "none", "null"):
            w.refuse(f"{key}.lora_dtype", "grpo-ds's adapters take the model's dtype (policy.precision; DeepSpeed "
                     "keeps fp32 master weights)")
        w.ignore(f"{key}.lora_dtype", "null: the adapters follow the base layer's dtype, as grpo-ds's do")
        w.ignore(f"{key}.a2a_experimental", "Megatron's all-to-all communication strategy; the same math")
    else:
        w.ignore(f"{key}.use_triton", "Triton LoRA kernels: a speed choice of NeMo-RL's DTensor v2 path (the same "
                 "math); grpo-ds runs peft's layers")
    known = {"enabled", "target_modules", "exclude_modules", "match_all_linear", "dim", "alpha", "dropout",
             "dropout_position", "lora_A_init", "lora_A_init_method"}
    for extra in w.open_keys(key):
        if extra.split(".")[len(key.split("."))] not in known:
            w.refuse(extra, "a LoRA setting grpo-ds does not know")
    w.translate(key, {"policy.lora": out}, "; ".join(["peft LoRA on DeepSpeed; the reference is the policy with its "
                                                      "adapters off"] + note))


def _chat_template(w: Walk) -> None:
    key = "policy.tokenizer.chat_template"
    if not w.has(key):  # NeMo-RL: no chat_template key = the tokenizer's own
        w.table.append(("translated", key, "-> policy.tokenizer.chat_template='default'; absent in the recipe: "
                        "NeMo-RL applies the tokenizer's own chat template"))
        w.set(key, "default")
        return
    value = w.get(key)
    if value is None:
        w.translate(key, {key: None}, "NeMo-RL's passthrough template: the prompt text as is (plain text here)")
    elif isinstance(value, str) and value.lower() == "default":
        w.translate(key, {key: "default"})
    elif isinstance(value, str) and value.endswith(".jinja"):
        path = _find_file(w, value)
        if path is None:
            w.refuse(key, f"the template file {value} is not found (looked in the working directory and above the "
                     "recipe)")
        else:
            w.translate(key, {key: path.read_text(encoding="utf-8")}, f"the contents of {path}")
    else:
        w.honor(key)


def _torch_optimizer(w: Walk) -> None:
    opt = w.get("policy.optimizer")
    if not isinstance(opt, dict):
        w.refuse("policy.optimizer", "no optimizer while megatron_cfg.enabled=false: NeMo-RL's DTensor path needs "
                 "policy.optimizer (name and kwargs)")
        return
    name = opt.get("name")
    kw = dict(opt.get("kwargs") or {})
    fused = name == "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam"
    if fused and kw.get("adam_w_mode", True) is False and kw.get("weight_decay"):
        name = "FusedAdam with adam_w_mode=false"
    if name not in ADAMW and not (name == "torch.optim.Adam" and not kw.get("weight_decay")):
        w.refuse("policy.optimizer.name", "grpo-ds's optimizer is AdamW (torch.optim.AdamW, Transformer Engine's "
                 "FusedAdam; also torch.optim.Adam without weight decay, which is the same update)")
        w.take("policy.optimizer")
        return
    w.take("policy.optimizer.name")
    kw.pop("adam_w_mode", None)
    for k in ("master_weights", "store_param_remainders", "exp_avg_dtype", "exp_avg_sq_dtype", "master_weight_dtype"):
        if k in kw:
            kw.pop(k)
            w.ignore(f"policy.optimizer.kwargs.{k}", "Transformer Engine FusedAdam's state precision and master "
                     "weights; grpo-ds's torch AdamW keeps fp32 states (the same update up to rounding)")
    targets = {}
    for src, dst in (("lr", "lr"), ("weight_decay", "weight_decay"), ("betas", "betas"), ("eps", "eps")):
        if src in kw:
            targets[f"policy.optimizer.{dst}"] = kw.pop(src)
    for speed in ("foreach", "fused", "capturable", "differentiable"):
        if speed in kw:
            kw.pop(speed)
            w.ignore(f"policy.optimizer.kwargs.{speed}", "an implementation choice of torch's AdamW (same update)")
    if kw.pop("amsgrad", False):
        w.refuse("policy.optimizer.kwargs.amsgrad", "AMSGrad changes the update; grpo-ds's AdamW runs without it")
    for k in kw:
        w.refuse(f"policy.optimizer.kwargs.{k}", "an AdamW argument grpo-ds does not pass")
    short = name.rsplit(".", 1)[-1]
    w.translate("policy.optimizer", {**targets}, f"{short}{' (the same update as AdamW)' if short != 'AdamW' else ''}")


def _torch_scheduler(w: Walk) -> None:
    """NeMo-RL's scheduler list (torch schedulers chained by SequentialLR at ``milestones``) -> policy.scheduler."""
    key = "policy.scheduler"
    sched = w.get(key)
    if sched is None:
        w.translate(key, {"policy.scheduler.name": "constant"}, "no scheduler: constant learning rate")
        return
    items = [s for s in sched if isinstance(s, dict) and "name" in s] if isinstance(sched, list) else None
    milestones = next((s["milestones"] for s in sched if isinstance(s, dict) and "milestones" in s), []) \
        if isinstance(sched, list) else []
    shape = " + ".join(str(s.get("name", "?")).rsplit(".", 1)[-1] for s in items or []) or repr(sched)
    bad = f"scheduler {shape} (milestones {milestones}): grpo-ds's policy.scheduler expresses LinearLR warmup " \
          "(end_factor 1) + ConstantLR(factor 1) or CosineAnnealingLR, chained at the end of the warmup"
    if not items or len(items) > 2 or len(milestones) != len(items) - 1:
        w.refuse(key, bad)
        return
    names = [s["name"].rsplit(".", 1)[-1] for s in items]
    kws = [dict(s.get("kwargs") or {}) for s in items]
    out: dict[str, Any] = {"policy.scheduler.name": "constant", "policy.scheduler.warmup_steps": 0}
    rest_names, rest_kws = names, kws
    if names[0] == "LinearLR":
        start, end = kws[0].get("start_factor", 1 / 3), kws[0].get("end_factor", 1.0)
        total = int(kws[0].get("total_iters", 5))
        if end != 1.0 or (milestones and milestones[0] != total):
            w.refuse(key, bad)
            return
        out.update({"policy.scheduler.warmup_steps": total, "policy.scheduler.warmup_start_factor": float(start)})
        rest_names, rest_kws = names[1:], kws[1:]
    if rest_names:
        name, kw = rest_names[0], rest_kws[0]
        if name == "ConstantLR" and kw.get("factor", 1 / 3) == 1.0:
            pass
        elif name == "CosineAnnealingLR" and "T_max" in kw:
            lr = float(w.get("policy.optimizer.kwargs.lr", 0) or 0)
            eta_min = float(kw.get("eta_min", 0.0))
            out.update({"policy.scheduler.name": "cosine", "policy.scheduler.decay_steps":
                        out["policy.scheduler.warmup_steps"] + int(kw["T_max"]),
                        "policy.scheduler.min_lr_ratio": eta_min / lr if lr else 0.0})
        else:
            w.refuse(key, bad)
            return
    w.translate(key, out, shape)


def _megatron(w: Walk) -> None:
    """megatron_cfg.enabled=true: NeMo-RL trains with megatron_cfg.optimizer and .scheduler; translate those."""
    m = "policy.megatron_cfg"
    w.translate(f"{m}.enabled", {}, f"Megatron-Core training -> {DEEPSPEED}")
    if _section_on(w, f"{m}.peft"):
        _lora(w, f"{m}.peft", megatron=True)
    w.ignore(f"{m}.peft", "peft.enabled=false: full fine-tuning, as grpo-ds does")
    if w.has(f"{m}.activation_checkpointing"):
        w.translate(f"{m}.activation_checkpointing",
                    {"policy.activation_checkpointing": bool(w.get(f"{m}.activation_checkpointing"))})
    if (w.get(f"{m}.mtp_num_layers") or 0) > 0 and (w.get(f"{m}.mtp_loss_scaling_factor") or 0) > 0:
        w.refuse(f"{m}.mtp_loss_scaling_factor", "adds a multi-token-prediction loss to the policy's; grpo-ds has none")
    o = w.get(f"{m}.optimizer") or {}
    if o.get("optimizer", "adam") != "adam":
        w.refuse(f"{m}.optimizer.optimizer", "grpo-ds's optimizer is AdamW (Megatron's adam, decoupled weight decay)")
        return
    lr = float(o.get("lr", 0))
    opt = {"policy.optimizer.lr": lr}
    if "weight_decay" in o:
        opt["policy.optimizer.weight_decay"] = float(o["weight_decay"])
    opt["policy.optimizer.betas"] = [float(o.get("adam_beta1", 0.9)), float(o.get("adam_beta2", 0.999))]
    if "adam_eps" in o:
        opt["policy.optimizer.eps"] = float(o["adam_eps"])
    if o.get("clip_grad") is not None:
        opt["policy.max_grad_norm"] = float(o["clip_grad"]) or None
    for k in ("optimizer", "lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad", "min_lr"):
        w.take(f"{m}.optimizer.{k}")
    w.translate(f"{m}.optimizer", opt, "Megatron's adam (decoupled weight decay) is AdamW")
    w.ignore(f"{m}.optimizer", "Megatron optimizer internals (precision flags, distributed optimizer, host offload, "
             "SGD momentum): the same AdamW update")
    s = w.get(f"{m}.scheduler") or {}
    style = s.get("lr_decay_style", "constant")
    wd0, wd1 = s.get("start_weight_decay", o.get("weight_decay")), s.get("end_weight_decay", o.get("weight_decay"))
    if s.get("weight_decay_incr_style", "constant") != "constant" or wd0 != wd1:
        w.refuse(f"{m}.scheduler.weight_decay_incr_style", "a weight-decay schedule; grpo-ds's weight decay is "
                 "constant (start_weight_decay = end_weight_decay with style constant)")
    if style not in ("constant", "cosine", "linear"):
        w.refuse(f"{m}.scheduler.lr_decay_style", "grpo-ds's schedules after warmup are constant, cosine and linear")
        return
    if s.get("lr_warmup_fraction") is not None:
        w.refuse(f"{m}.scheduler.lr_warmup_fraction", "warmup as a fraction of the run; give lr_warmup_iters")
    warmup = int(s.get("lr_warmup_iters") or 0)
    sched: dict[str, Any] = {"policy.scheduler.name": style, "policy.scheduler.warmup_steps": warmup}
    if warmup:
        sched["policy.scheduler.warmup_start_factor"] = float(s.get("lr_warmup_init", 0.0)) / lr if lr else 0.0
    if style != "constant":
        sched["policy.scheduler.min_lr_ratio"] = float(o.get("min_lr", 0.0)) / lr if lr else 0.0
        if s.get("lr_decay_iters") is not None:
            sched["policy.scheduler.decay_steps"] = int(s["lr_decay_iters"])
    for k in ("lr_decay_style", "lr_warmup_iters", "lr_warmup_init", "lr_decay_iters", "start_weight_decay",
              "end_weight_decay", "weight_decay_incr_style", "lr_warmup_fraction"):
        w.take(f"{m}.scheduler.{k}")
    w.translate(f"{m}.scheduler", sched, "Megatron's OptimizerParamScheduler")
    w.ignore(f"{m}.scheduler", "Megatron scheduler internals")
    if _enabled(w.get(f"{m}.fp8_cfg")):
        w.ignore(f"{m}.fp8_cfg", "FP8 training kernels: grpo-ds trains in policy.precision (numerics differ a little, "
                 "the algorithm is the same)")
    w.ignore(m, "Megatron parallelism (tensor, pipeline, expert, context), fusions, kernels, MoE router settings, "
             "checkpoint format: " + DEEPSPEED)


# -- generation ---------------------------------------------------------------------------------------
def _generation(w: Walk) -> None:
    g = "policy.generation"
    backend = w.get(f"{g}.backend")
    if backend in ("megatron", "sglang", "trtllm", "dynamo"):
        w.translate(f"{g}.backend", {f"{g}.backend": "vllm"}, f"{backend} is another inference engine for the "
                    "same sampling; grpo-ds generates with vLLM (or hf)")
    non_colocated = w.get(f"{g}.colocated.enabled", True) is False
    if _enabled(w.get("grpo.async_grpo")) and (backend or "vllm") != "hf" and not non_colocated:
        w.translate(f"{g}.backend", {f"{g}.backend": "hf"}, "grpo.async_grpo.enabled=true with colocated "
                    "generation: grpo-ds's async loop generates with vLLM on generation ranks of its own only "
                    "(colocated.enabled=false); colocated, with the hf backend on its own copy of the weights")
    for k in ("val_temperature", "val_top_p", "val_top_k"):
        key = f"{g}.{k}"
        if w.has(key) and native_field(key) is None:  # TODO(names helper): fields not there yet
            if w.get(key) == w.get(f"{g}.{k[4:]}"):
                w.take(key)
            else:
                w.refuse(key, "validation's own sampling is not in this grpo-ds yet")
    w.honor(f"{g}.port_range_low")  # the endpoint's ports (grpo/wings/agents/endpoint.py)
    w.honor(f"{g}.port_range_high")
    for k in ("refit_transport", "real_quant_export_cpu_offload", "refit_cfg"):
        w.ignore(f"{g}.{k}", "weight-refit transport (IPC, NCCL, NIXL, ZMQ); grpo-ds pushes the weights in process")
    w.ignore(f"{g}.mcore_generation_config", "Megatron-Core inference engine settings (generation.backend=megatron)")
    w.ignore(f"{g}.sglang_cfg", "SGLang engine settings")
    w.ignore(f"{g}.trtllm_cfg", "TRT-LLM engine settings")
    w.ignore(f"{g}.trtllm_kwargs", "TRT-LLM engine settings")
    w.ignore(f"{g}.dynamo_cfg", "NVIDIA Dynamo serving settings (frontend, router, workers)")
    w.ignore(f"{g}.use_async_rollouts", "rollouts through vLLM's async engine (speed); grpo-ds batches them")
    v = f"{g}.vllm_cfg"
    mode = w.get(f"{v}.logprobs_mode", "processed_logprobs")
    if mode != "processed_logprobs":
        w.refuse(f"{v}.logprobs_mode", "grpo-ds's vLLM returns processed_logprobs (the distribution sampled from), "
                 "which its importance weights and token_mult_prob_error assume")
    w.take(f"{v}.logprobs_mode")
    precision = w.get(f"{v}.precision")
    if precision is not None and precision == w.get("policy.precision"):
        w.take(f"{v}.precision")  # vLLM runs in policy.precision here too
    elif precision is not None:
        w.ignore(f"{v}.precision", f"vLLM in {precision} (e.g. FP8 rollouts): grpo-ds's vLLM runs in "
                 "policy.precision; importance sampling sees the difference either way")
    if w.get(f"{v}.kv_cache_dtype", "auto") == "auto":
        w.take(f"{v}.kv_cache_dtype")
    else:
        w.ignore(f"{v}.kv_cache_dtype", "KV-cache quantisation: grpo-ds's vLLM keeps the KV cache in the model dtype")
    if (w.get(f"{v}.pipeline_parallel_size") or 1) > 1 or (w.get(f"{v}.expert_parallel_size") or 1) > 1:
        w.ignore(f"{v}.pipeline_parallel_size", "vLLM pipeline/expert parallelism: grpo-ds's engines use tensor "
                 "parallelism only (same samples)")
    for k in ("tensor_parallel_size", "gpu_memory_utilization", "max_model_len", "enforce_eager",
              "expose_http_server"):
        w.honor(f"{v}.{k}")
    _serving_chat_kwargs(w, f"{v}.http_server_serving_chat_kwargs")
    _parser_plugins(w, v)
    w.ignore(v, "vLLM engine internals without an algorithmic effect (async engine, tqdm, DeepGEMM, bf16 layers, "
             "metrics logger, refit server ports)")
    kw = dict(w.get(f"{g}.vllm_kwargs") or {})
    if kw:
        own = {f"{v}.{k}": kw.pop(k) for k in list(kw) if k in VLLM_FIELDS}  # vllm_cfg has a field for it
        w.translate(f"{g}.vllm_kwargs", {**own, **({f"{v}.vllm_kwargs": kw} if kw else {})})
    w.take(f"{g}.vllm_kwargs")
    colocated = w.get(f"{g}.colocated.enabled", True)
    if colocated is False:  # the last colocated.resources ranks of the launch generate (grpo.system.generation.remote)
        for k in ("enabled", "resources.gpus_per_node", "resources.num_nodes"):
            w.honor(f"{g}.colocated.{k}")
        w.ignore(f"{g}.colocated", "Ray placement of the inference cluster; grpo-ds's generation ranks are the last "
                 "ranks the launcher starts")
    else:
        w.take(f"{g}.colocated.enabled")
        w.ignore(f"{g}.colocated", "dedicated generation resources, used only when colocated.enabled=false")


# vLLM OpenAIServingChat arguments the endpoint implements (grpo.config.ServingChatKwargs); the others are vLLM's
# serving internals (request logging, content format, auto tools: always on here).
SERVING_CHAT_KEYS = ("tool_parser", "reasoning_parser", "chat_template", "default_chat_template_kwargs",
                     "chat_template_kwargs")


def _serving_chat_kwargs(w: Walk, key: str) -> None:
    """NeMo-RL's ``http_server_serving_chat_kwargs``: the keys the endpoint implements are kept, a null section is
    none, vLLM's serving internals are ignored (one row)."""
    value = w.get(key)
    if not isinstance(value, dict):
        w.take(key)
        return
    for k in SERVING_CHAT_KEYS:
        w.honor(f"{key}.{k}")
    w.ignore(key, "vLLM serving internals (request logger, content format, auto tools): the endpoint renders "
             "with the chat template and always parses tools with the configured parser")


def _parser_plugins(w: Walk, v: str) -> None:
    """``vllm_cfg.{reasoning,tool}_parser_plugin``: a Python file NeMo-RL's vLLM worker imports into vLLM's parser
    registry before it serves (vllm_worker_async.py:382-392), so that http_server_serving_chat_kwargs can name the
    parser it registers (NeMo-Gym's recipes: nano_v3). grpo-ds's endpoint imports no plugin files, so such a name would
    fail when the endpoint starts: refused here, naming the plugin and the parser, like a parser name nobody has."""
    for kind in ("reasoning", "tool"):
        key = f"{v}.{kind}_parser_plugin"
        plugin = w.get(key)
        if plugin in (None, ""):
            w.take(key)
            continue
        parser = w.get(f"{v}.http_server_serving_chat_kwargs.{kind}_parser")
        w.refuse(key, f"a {kind}-parser plugin file NeMo-RL imports into vLLM's registry"
                 f"{f' (for {kind}_parser={parser!r})' if parser else ''}; grpo-ds's endpoint imports no plugin: "
                 f"name a parser vLLM or grpo-ds has in http_server_serving_chat_kwargs.{kind}_parser and delete this "
                 f"key (~{key})")


VLLM_FIELDS = ("kv_cache_memory_bytes", "enforce_eager", "gpu_memory_utilization", "max_model_len",
               "enable_prefix_caching")


# -- data and environments -------------------------------------------------------------------------------
# NeMo-RL's dataset names -> (hub name, split, input key, output key, hub config); nemo_rl/data/datasets.
DATASETS = {
    "OpenMathInstruct-2": ("nvidia/OpenMathInstruct-2", "train_1M", "problem", "expected_answer", None),
    "DAPOMath17K": ("BytedTsinghua-SIA/DAPO-Math-17k", "train", "prompt.0.content", "reward_model.ground_truth", None),
    "DAPOMathAIME2024": ("BytedTsinghua-SIA/AIME-2024", "train", "prompt.0.content", "reward_model.ground_truth", None),
    "DeepScaler": ("agentica-org/DeepScaleR-Preview-Dataset", "train", "problem", "answer", None),
    "AIME2024": ("HuggingFaceH4/aime_2024", "train", "problem", "answer", None),
    "AIME2026": ("MathArena/aime_2026", "train", "problem", "answer", None),
    "gsm8k": ("openai/gsm8k", "train", "question", "answer", "main"),
    "GSM8K": ("openai/gsm8k", "train", "question", "answer", "main"),
}
# NeMo-RL's image datasets (run_vlm_grpo.py; response_datasets/{clevr,geometry3k,refcoco}.py): its split -> (hub
# name, hub split); grpo-ds reads their columns with data.row_format, from data_path (a local file: grpo-ds's addition,
# NeMo-RL always loads the hub) or else the hub. RefCOCO's loader downloads COCO's images and an annotation archive:
# only a local file of its rows here.
VLM_DATASETS = {
    "clevr-cogent": {"train": ("MMInstruction/Clevr_CoGenT_TrainA_70K_Complex", "train"),
                     "valA": ("MMInstruction/Clevr_CoGenT_ValA", "train"),
                     "valB": ("MMInstruction/Clevr_CoGenT_ValB", "train")},
    "geometry3k": {s: ("hiyouga/geometry3k", s) for s in ("train", "validation", "test")},
    "refcoco": {},
}
VLM_PROCESSOR = "vlm_hf_data_processor"
# Which datasets take which keys (NeMo-RL passes every key to the class, which ignores those it has no use for).
SPLITTABLE = {"OpenMathInstruct-2", "ResponseDataset"}
SPEC_KEYS = {"dataset_name", "data_path", "input_key", "output_key", "split", "subset", "split_validation_size",
             "seed", "prompt_file", "system_prompt_file", "processor", "env_name", "repeat", "extract_answer"}
ENV_REFUSED = {
    "nemo_gym": "NeMo-Gym environments (agent servers over HTTP); grpo-ds runs its own environments in process",
    "code": "the code-execution environment; grpo-ds's tool sandbox is not that environment",
    "code_jaccard": "the code Jaccard-similarity reward; grpo-ds has none",
}


def _specs(w: Walk, key: str) -> list[dict] | None:
    """``data.train`` / ``data.validation`` as a list of dataset specs (one spec or NeMo-RL's list of them)."""
    value = w.get(key)
    if value is None:
        w.take(key)
        return None
    specs = [value] if isinstance(value, dict) else value
    if not isinstance(specs, list) or not specs or not all(isinstance(s, dict) for s in specs):
        w.refuse(key, "expected a dataset spec or a list of them")
        w.take("data")
        return None
    return specs


def _source(w: Walk, key: str, spec: dict, default: dict) -> dict | None:
    """One NeMo-RL dataset spec (``data.train`` merged over ``data.default``) -> where grpo-ds reads it."""
    # NeMo-RL's update_single_dataset_config fills only the keys a spec does not have: a spec's null wins
    full = {**{k: v for k, v in default.items() if v is not None}, **spec}
    name = full.get("dataset_name")
    for k in full:
        if k not in SPEC_KEYS:
            w.refuse(f"{key}.{k}", f"a dataset key grpo-ds does not translate (dataset {name})")
    src: dict[str, Any] = {"name": name, "split_validation_size": 0, "seed": full.get("seed"), "repeat": 1}
    if name == "ResponseDataset":
        if not full.get("data_path"):
            w.refuse(f"{key}.data_path", "ResponseDataset needs data_path (a local file or a hub name)")
            return None
        path = str(full["data_path"])
        src.update(path=path, split=full.get("split"), subset=full.get("subset"),
                   input_key=full.get("input_key", "input"), output_key=full.get("output_key", "output"))
    elif name in DATASETS:
        hub, split, ikey, okey, subset = DATASETS[name]
        if name == "OpenMathInstruct-2":
            split, okey = full.get("split", split), full.get("output_key", okey)
            src["split_validation_size"] = 0.05  # the class's default
        if name.lower() == "gsm8k":
            split, subset = full.get("split", split), full.get("subset") or subset
            if full.get("extract_answer", True) is False:
                w.refuse(f"{key}.extract_answer", "the gold answer as the whole solution; grpo-ds's math "
                         "environment scores against the text after ####")
        src.update(path=hub, split=split, subset=subset, input_key=ikey, output_key=okey)
    elif name in VLM_DATASETS:
        if not _vlm_source(w, key, full, src):
            return None
    elif isinstance(name, str) and _builtin_task(name):
        src.update(path=name, split=None, subset=None, input_key="input", output_key="output", builtin=True)
    else:
        w.refuse(f"{key}.dataset_name", f"grpo-ds has no translation of NeMo-RL's dataset {name!r} (known: "
                 f"{sorted([*DATASETS, 'ResponseDataset'])}, or a grpo-ds built-in task)", value=name)
        return None
    if "split_validation_size" in full:
        if name in SPLITTABLE:
            src["split_validation_size"] = full["split_validation_size"] or 0
        else:
            w.table.append(("ignored", f"{key}.split_validation_size",
                            f"NeMo-RL's {name} takes no split_validation_size (it warns and ignores it)"))
    if full.get("repeat") is not None:
        src["repeat"] = int(full["repeat"])
    src["prompt_file"] = full.get("prompt_file")
    src["system_prompt_file"] = full.get("system_prompt_file")
    processor = full.get("processor", "math_hf_data_processor")
    if name in VLM_DATASETS and processor != VLM_PROCESSOR:
        w.refuse(f"{key}.processor", f"NeMo-RL formats {name}'s rows with {VLM_PROCESSOR} (its image and problem), "
                 "which grpo-ds reads them as (data.row_format)", value=processor)
    elif name not in VLM_DATASETS and processor not in ("math_hf_data_processor", "default", "math_data_processor"):
        w.refuse(f"{key}.processor", "a NeMo-RL data processor grpo-ds does not have (grpo-ds formats prompts as "
                 "math_hf_data_processor does: prompt file, system prompt, chat template)")
    src["env_name"] = full.get("env_name")
    return src


def _vlm_source(w: Walk, key: str, full: dict, src: dict) -> bool:
    """One of NeMo-RL's image datasets (`VLM_DATASETS`) into ``src``: its rows' columns (row_format) from
    ``data_path`` when given (a local file), else from the hub name of its split. False (refused) for a split NeMo-RL
    does not have, or RefCOCO without data_path."""
    name, split = full["dataset_name"], full.get("split") or "train"
    splits = VLM_DATASETS[name]
    if full.get("data_path"):
        path, hub_split = str(full["data_path"]), None
    elif not splits:
        w.refuse(f"{key}.dataset_name", f"NeMo-RL's {name} downloads COCO's images and its annotation archive; "
                 f"grpo-ds reads {name}'s rows (image_path, captions, bbox, split) from a local file: set "
                 f"{key}.data_path", value=name)
        return False
    elif split not in splits:
        w.refuse(f"{key}.split", f"{name} has the splits {sorted(splits)} (NeMo-RL raises on another)", value=split)
        return False
    else:
        path, hub_split = splits[split]
    src.update(path=path, split=hub_split, subset=None, input_key="input", output_key="output", row_format=name)
    return True


def _builtin_task(name: str) -> bool:
    from grpo.tasks.catalogue import dataset_task

    return dataset_task(name) is not None


def _find_file(w: Walk, path: str) -> Path | None:
    """``path`` as NeMo-RL finds it (relative to the working directory), else relative to a directory above the
    recipe (a NeMo-RL checkout's examples/...); None if neither has it."""
    candidates = [Path(path)] + [parent / path for parent in [w.base_dir, *w.base_dir.parents]]
    return next((p.resolve() for p in candidates if p.is_file()), None)


def _prompt_file(w: Walk, key: str, path: str | None) -> str | None:
    if path is None:
        return None
    found = _find_file(w, path)
    if found is not None:
        return str(found)
    ours = PROMPTS_DIR / Path(path).name
    if ours.is_file():
        w.table.append(("translated", key, f"{path} is not here -> {os.path.relpath(ours, REPO_ROOT)} (grpo-ds's own "
                        "wording of the same instruction)"))
        return str(ours)
    w.refuse(key, f"the prompt file {path} is not found (working directory, above the recipe, configs/prompts/)")
    return None


def _multiple_dataloader(w: Walk) -> None:
    """NeMo-RL's use_multiple_dataloader (nemo_rl/algorithms/grpo.py:560-630, data/dataloader.py): one loader per
    dataset, each batch drawn by a user function (data.custom_dataloader) from the loaders' iterators."""
    if w.get("data.use_multiple_dataloader"):
        w.refuse("data.use_multiple_dataloader", "one data loader per dataset, each step's prompts drawn by the Python "
                 "function data.custom_dataloader (which may read training records, set_records) from endless "
                 "iterators; grpo-ds draws each step from one seeded, resumable loader over the concatenated sources "
                 "(data.train_sources; a source's repeat weights it in the mix)")
    else:
        w.ignore("data.num_prompts_per_dataloader", "used only with data.use_multiple_dataloader=true")
        w.ignore("data.custom_dataloader", "used only with data.use_multiple_dataloader=true")
    w.take("data.use_multiple_dataloader")


def _data_and_env(w: Walk) -> None:
    _multiple_dataloader(w)
    if is_gym_recipe(w):  # NeMo-Gym rows and env.nemo_gym (grpo.config.nemo_rl.gym_rules)
        gym_data_and_env(w)
        return
    if w.get("env.sliding_puzzle_game") is not None:  # run_grpo_sliding_puzzle.py never reads data.train
        _sliding_puzzle(w)
        return
    default = w.get("data.default") or {}
    w.take("data.default")
    train_specs = _specs(w, "data.train")
    val_specs = _specs(w, "data.validation") or []
    if not train_specs:
        if not w.errors and w.get("data.train") is None:
            w.refuse("data.train", "no training data")
        w.take("env")
        w.take("data")
        return

    def key(side: str, i: int, specs: list) -> str:
        return side if isinstance(w.get(side), dict) else f"{side}.{i}"

    trains = [_source(w, key("data.train", i, train_specs), s, default) for i, s in enumerate(train_specs)]
    vals = [_source(w, key("data.validation", i, val_specs), s, default) for i, s in enumerate(val_specs)]
    w.take("data.train")
    w.take("data.validation")
    if None in trains or None in vals:
        _nemo_gym_env(w)
        w.take("env")
        return
    envs = {s["env_name"] or ("arithmetic" if s.get("builtin") else "math") for s in trains + vals}
    images = all(s.get("row_format") for s in trains + vals)  # run_vlm_grpo.py: one VLMEnvironment per env_name
    if len(envs) > 1 and not images:
        w.refuse("data.default.env_name", f"the datasets name several NeMo-RL environments ({sorted(envs)}); grpo-ds "
                 "routes rows by task (data.train_sources[].task_name, env.tasks), but this translation maps one "
                 "environment section: write the run as a native config", value=sorted(envs))
    problems = _single_form_problems(trains, vals)
    if problems:
        _several_sources(w, trains, vals, problems, by_env=len(envs) > 1)
    else:
        _single_source(w, trains[0], vals[0] if vals else None)
    if not vals and not any(s["split_validation_size"] > 0 for s in trains) and not all(
            s.get("builtin") for s in trains):
        w.table.append(("translated", "data.validation", "-> grpo.val_period=0, val_at_start=false, val_at_end=false; "
                        "no validation data (null, and no split_validation_size): NeMo-RL does not validate either"))
        for k, value in (("val_period", 0), ("val_at_start", False), ("val_at_end", False)):
            w.take(f"grpo.{k}")
            w.set(f"grpo.{k}", value)
    train = trains[0]
    _env(w, train.get("env_name") or ("arithmetic" if train.get("builtin") else "math"), train,
         others=sorted(envs - {train.get("env_name")}) if images else [])


def _single_form_problems(trains: list[dict], vals: list[dict]) -> list[str]:
    """Why the datasets need data.train_sources / val_sources (empty: data.dataset_name & co. say it exactly)."""
    if len(trains) > 1 or len(vals) > 1:
        return [f"{len(trains)} training and {len(vals)} validation datasets"]
    train, val = trains[0], (vals[0] if vals else None)
    if val is None:
        return []
    problems = []
    if train["split_validation_size"] > 0 and val["repeat"] > 1:
        problems.append("held-out rows and a repeated validation dataset")
    if (val["input_key"], val["output_key"]) != (train["input_key"], train["output_key"]) and not val.get("builtin"):
        problems.append("other input/output keys")
    if (val["subset"] or train["subset"]) and val["subset"] != train["subset"]:
        problems.append("another hub config")
    if val.get("builtin") and (not train.get("builtin") or val["path"] != train["path"]):
        problems.append("a built-in task other than the training one")
    if any(val[k] != train[k] for k in ("prompt_file", "system_prompt_file")):
        problems.append("another prompt file")
    if val.get("row_format") != train.get("row_format"):
        problems.append("another dataset's columns")
    if val.get("env_name") != train.get("env_name"):
        problems.append("another environment")
    return problems


def _where(path: str) -> str:
    return str(Path(path).expanduser().resolve()) if _local(path) else path


def _single_source(w: Walk, train: dict, val: dict | None) -> None:
    """One training and at most one validation dataset that data.dataset_name & co. say exactly."""
    d: dict[str, Any] = {}
    if train.get("builtin") or not _local(train["path"]):
        d["dataset_name"] = train["path"]
    else:
        d["train_data_path"] = _where(train["path"])
    if train["split"]:
        d["train_split"] = train["split"]
    if train["subset"]:
        d["dataset_config"] = train["subset"]
    d["input_key"], d["output_key"] = train["input_key"], train["output_key"]
    if train.get("row_format"):
        d["row_format"] = train["row_format"]
    if train["split_validation_size"] > 0:  # with a validation dataset too: the held-out rows join it (NeMo-RL)
        d["split_validation_size"] = float(train["split_validation_size"])
        if train["seed"] is not None:
            d["split_validation_seed"] = int(train["seed"])
    if val is not None:
        if val["path"] == train["path"] and not _local(val["path"]):
            d["val_split"] = val["split"]
        elif not val.get("builtin"):
            d["val_data_path"] = _where(val["path"])
            if val["split"]:
                d["val_split"] = val["split"]
        if val["repeat"] > 1:
            d["val_repeat"] = val["repeat"]
    d["prompt_file"] = _prompt_file(w, "data.default.prompt_file", train["prompt_file"])
    d["system_prompt_file"] = _prompt_file(w, "data.default.system_prompt_file", train["system_prompt_file"])
    w.table.append(("translated", "data.train", f"{train['name']} -> " + ", ".join(
        f"data.{k}={v!r}" for k, v in d.items()
        if v is not None and k not in ("prompt_file", "system_prompt_file") and not k.startswith("val_"))))
    if val is not None:
        where = {k: d[k] for k in ("val_data_path", "val_split", "val_repeat") if k in d}
        w.table.append(("translated", "data.validation", f"{val['name']} -> " + ", ".join(
            f"data.{k}={v!r}" for k, v in where.items())))
    for k, v in d.items():
        if v is not None:
            w.set(f"data.{k}", v)


def _several_sources(w: Walk, trains: list[dict], vals: list[dict], problems: list[str], by_env: bool = False) -> None:
    """NeMo-RL's lists (nemo_rl/data/utils.py setup_response_data): training datasets concatenated into one loader,
    validation = each training dataset's split_validation_size part, then the validation datasets; every spec
    already merged over data.default, so each source gives every field (nothing falls back to data.*). An image
    dataset's source reads its columns (row_format); ``by_env``: each source's rows go to the task named by its
    env_name (NeMo-RL's task_to_env; `_vlm_env` makes one environment per name)."""
    def source(s: dict, side: str, i: int) -> dict:
        src: dict[str, Any] = {"dataset_name": s["path"] if s.get("builtin") else _where(s["path"]),
                               "split": s["split"], "dataset_config": s["subset"],
                               "input_key": s["input_key"], "output_key": s["output_key"],
                               "row_format": s.get("row_format"), "task_name": s["env_name"] if by_env else None}
        for k in ("prompt_file", "system_prompt_file"):
            src[k] = _prompt_file(w, f"{side}.{i}.{k}" if len(trains if side == 'data.train' else vals) > 1 else
                                  f"{side}.{k}", s[k])
        if side == "data.train" and s["split_validation_size"] > 0:
            src["split_validation_size"] = float(s["split_validation_size"])
            if s["seed"] is not None:
                src["split_validation_seed"] = int(s["seed"])
        if s["repeat"] > 1:
            src["repeat"] = s["repeat"]
        return src

    train_sources = [source(s, "data.train", i) for i, s in enumerate(trains)]
    val_sources = [source(s, "data.validation", i) for i, s in enumerate(vals)]
    w.set("data.train_sources", train_sources)
    w.table.append(("translated", "data.train", f"{', '.join(s['name'] for s in trains)} -> data.train_sources "
                    f"({'; '.join(problems)}): " + "; ".join(_brief(s) for s in train_sources)))
    if val_sources:
        w.set("data.val_sources", val_sources)
        w.table.append(("translated", "data.validation", f"{', '.join(s['name'] for s in vals)} -> data.val_sources "
                        "(after the training sources' split_validation_size rows, as NeMo-RL): " +
                        "; ".join(_brief(s) for s in val_sources)))


def _brief(src: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in src.items() if v is not None and k not in (
        "prompt_file", "system_prompt_file", "input_key", "output_key"))


# NeMo-RL's run_grpo_sliding_puzzle.py reads no data section: its dataset is endless (num_prompts_per_step x
# num_generations_per_prompt x max_num_steps puzzles drawn on the fly). grpo-ds draws and tokenises its rows at
# start (100k rows: ~7 s to draw, 1-3 ms each to render and tokenise under Qwen2.5's template, ~1.2 GB), so at
# most this many; more epochs over them reach max_num_steps.
SLIDING_PUZZLE_MAX_ROWS = 100_000


def _sliding_puzzle(w: Walk) -> None:
    """NeMo-RL's sliding-puzzle recipe (examples/run_grpo_sliding_puzzle.py) -> grpo-ds's built-in task."""
    game = w.get("env.sliding_puzzle_game.cfg.game_config") or {}
    size, shuffle = int(game.get("size", 3)), int(game.get("shuffle_moves", 10))
    max_moves = int(w.get("env.sliding_puzzle_game.cfg.max_moves", 40))
    w.translate("env.sliding_puzzle_game", {
        "env.name": "sliding_puzzle", "env.task_name": "sliding_puzzle_game", "env.kwargs": {"max_moves": max_moves},
        "env.observation_format": "raw", "data.dataset_name": f"sliding_puzzle:size={size},shuffle_moves={shuffle}"},
        "observations appended raw, as NeMo-RL's rollout does")
    w.ignore("env", "run_grpo_sliding_puzzle.py builds only the sliding-puzzle environment")
    g = w.get("grpo") or {}
    per_step = int(g.get("num_prompts_per_step", 32)) * (
        int(g.get("batch_multiplier", 1)) if (g.get("use_dynamic_sampling") or False) else 1)
    wanted = per_step * int(g.get("max_num_steps", 1000000))
    rows = min(wanted, SLIDING_PUZZLE_MAX_ROWS)
    epochs = max(int(g.get("max_num_epochs", 1)), math.ceil(wanted / rows))
    note = (f"NeMo-RL's puzzles are endless; {rows} rows = num_prompts_per_step x max_num_steps" if rows == wanted else
            f"NeMo-RL's puzzles are endless; num_prompts_per_step x max_num_steps = {wanted} rows capped at {rows} "
            f"(all drawn and tokenised at start), grpo.max_num_epochs={epochs} so that max_num_steps is reached")
    targets = {"data.num_train_samples": rows}
    if epochs != int(g.get("max_num_epochs", 1)):
        w.take("grpo.max_num_epochs")
        targets["grpo.max_num_epochs"] = epochs
    w.translate("grpo.max_num_steps", {"grpo.max_num_steps": int(g.get("max_num_steps", 1000000)), **targets}, note)
    val = w.get("grpo.max_val_samples")
    if val:
        w.set("data.num_val_samples", int(val))
        w.table.append(("translated", "grpo.max_val_samples", f"-> grpo.max_val_samples={int(val)}, "
                        f"data.num_val_samples={int(val)} (NeMo-RL's val_length)"))
        w.honor("grpo.max_val_samples")
    w.ignore("data.add_system_prompt", "passed to apply_chat_template as a template variable that Qwen's and "
             "Llama's templates do not read (Qwen2.5's adds its default system message there as here)")
    for k in ("shuffle", "num_workers"):
        w.honor(f"data.{k}")
    w.ignore("data", "run_grpo_sliding_puzzle.py reads no dataset (data.train, data.validation, data.default, "
             "prompts): its prompts come from the environment's puzzles")


def _nemo_gym_env(w: Walk) -> None:
    if w.get("env.should_use_nemo_gym"):
        w.refuse("env.should_use_nemo_gym", ENV_REFUSED["nemo_gym"])
    w.ignore("env.should_log_nemo_gym_responses", "NeMo-Gym logging")
    w.honor("env.should_mask_flagged_samples")  # the same key (grpo-ds: a flagged sample leaves the baseline too)


def _local(path: str) -> bool:
    return path.endswith((".jsonl", ".json", ".parquet", ".arrow")) or path.startswith((".", "/", "~")) or \
        os.path.exists(path)


def _env(w: Walk, env_name: str, train: dict, others: list[str] = ()) -> None:
    """The environment of ``env_name`` (the first training dataset's); ``others``: the image datasets' other
    env_names, each its own task (`_vlm_env`)."""
    _nemo_gym_env(w)
    env = {k: v for k, v in (w.get("env") or {}).items() if isinstance(v, dict) or v is None}
    for name in list(env):
        if name in ENV_REFUSED and env[name] is not None and (name == env_name or name == "nemo_gym"):
            w.refuse(f"env.{name}", ENV_REFUSED[name])
    if env_name in ENV_REFUSED:
        if f"env.{env_name}" not in " ".join(w.errors):
            w.refuse("data.default.env_name", ENV_REFUSED[env_name])
        w.take("env")
        return
    section = env.get(env_name) or {}
    if train.get("row_format") or env_name == "vlm":  # run_vlm_grpo.py: every env section is a VLMEnvironment
        _vlm_env(w, env_name, env, others)
        return
    if env_name == "reward_model":
        _reward_model(w)
        for name in env:
            w.ignore(f"env.{name}", f"not the data's env_name ({env_name}): unused, as in NeMo-RL")
        w.take("env")
        return
    if train.get("builtin"):
        w.set("env.name", train["path"].split(":")[0])
    elif env_name in ("math", "math_default", "dapo"):
        w.set("env.name", "math")
    elif env_name == "math_multi_reward":  # grpo.tasks.math_multi_reward: NeMo-RL's three components, for GDPO
        w.set("env.name", "math_multi_reward")
    else:
        w.refuse("data.default.env_name", f"NeMo-RL's environment {env_name!r} has no grpo-ds translation")
        return
    if not isinstance(section, dict):
        section = {}
    impl = section.get("math_verify_impl", "hf_math_verify")  # read by NeMo-RL's HFVerifyWorker.verify
    if impl == "dapo_math_verify" and w.out["env"]["name"] == "math":
        w.translate(f"env.{env_name}.math_verify_impl", {"env.math_verify_impl": impl},
                    "DAPO's verifier: the last 'Answer:' line, normalised, equals the gold (grpo.tasks.math)")
    elif impl != "hf_math_verify" and env_name == "math_multi_reward":
        w.refuse(f"env.{env_name}.math_verify_impl", "NeMo-RL's MathMultiRewardEnvironment has hf_math_verify alone "
                 "(for any other value its worker raises and every component scores 0)")
    elif impl != "hf_math_verify":
        w.refuse(f"env.{env_name}.math_verify_impl", "grpo-ds's math task has the verifiers hf_math_verify and "
                 "dapo_math_verify (NeMo-RL's too: for any other value, null included, its verifier raises and "
                 "every sample scores 0)")
    w.take(f"env.{env_name}.math_verify_impl")
    if "num_workers" in section:
        w.translate(f"env.{env_name}.num_workers", {"env.num_workers": int(section["num_workers"])})
    for k in section:
        if f"env.{env_name}.{k}" not in w.used:
            w.refuse(f"env.{env_name}.{k}", "a math-environment key grpo-ds does not translate")
    w.take(f"env.{env_name}")
    w.table.append(("translated", f"env.{env_name}", "-> env.name=" + repr(w.out["env"]["name"]) +
                    (f" ({'DAPO' if impl == 'dapo_math_verify' else 'math-verify'}, as NeMo-RL's {impl})"
                     if w.out["env"]["name"] == "math" else
                     " (reward/correctness, reward/integer, reward/format: NeMo-RL's components, string equality)"
                     if env_name == "math_multi_reward" else "")))
    for name in env:
        if f"env.{name}" not in " ".join(w.errors):
            w.ignore(f"env.{name}", f"not the data's env_name ({env_name}): unused, as in NeMo-RL")
    w.take("env")


def _vlm_env(w: Walk, env_name: str, env: dict, others: list[str] = ()) -> None:
    """``env.<env_name>`` of a VLM recipe (NeMo-RL's VLMEnvironment) -> env.name=vlm with its reward_functions
    (`grpo.tasks.vlm`: the same functions, weights renormalised). ``others``: the env_names of the run's other image
    datasets: each becomes ``env.tasks.<name>`` (NeMo-RL's task_to_env), the first one's task is ``env_name``."""
    from grpo.tasks.vlm import reward_problem

    if others:
        w.set("env.task_name", env_name)
    for name in [env_name, *others]:
        target = "env" if name == env_name else f"env.tasks.{name}"
        section = env.get(name)
        k = f"env.{name}"
        specs = section.get("reward_functions") if isinstance(section, dict) else None
        if not isinstance(specs, list) or not specs:
            w.refuse(f"{k}.reward_functions", "NeMo-RL's VLMEnvironment needs a list of {name, weight, kwargs}")
        else:
            w.errors += [p for i, spec in enumerate(specs)
                         if (p := reward_problem(spec, f"{k}.reward_functions.{i}")) is not None]
            w.translate(f"{k}.reward_functions", {f"{target}.name": "vlm",
                                                  f"{target}.kwargs": {"reward_functions": specs}},
                        "NeMo-RL's VLMEnvironment: the weighted sum of these rewards (grpo.tasks.vlm), weights "
                        "renormalised to 1" + (f"; the rows of env_name {name}" if others else ""))
        w.ignore(f"{k}.num_workers", "NeMo-RL's Ray verify workers; grpo-ds scores these rewards in the trainer process")
        for sub in (section if isinstance(section, dict) else {}):
            if f"{k}.{sub}" not in w.used:
                w.refuse(f"{k}.{sub}", "a VLM-environment key grpo-ds does not translate")
        w.take(k)
    for name in env:
        if name not in (env_name, *others) and f"env.{name}" not in " ".join(w.errors):
            w.ignore(f"env.{name}", f"not the data's env_name ({env_name}): unused, as in NeMo-RL")
    w.take("env")


# NeMo-RL's RewardModelEnvironment asserts these (nemo_rl/environments/reward_model_environment.py at 7ea279a).
REWARD_MODEL_ASSERTS = (("dtensor_cfg.enabled", True, "NeMo-RL's reward model runs on DTensor only"),
                        ("dtensor_cfg.cpu_offload", False, "CPU offload is not supported with the reward model"),
                        ("dtensor_cfg.activation_checkpointing", False, "activation checkpointing is not supported "
                         "with the reward model"),
                        ("dynamic_batching.enabled", False, "dynamic batching is not supported with the reward model"),
                        ("sequence_packing.enabled", False, "sequence packing is not supported with the reward model"),
                        ("max_grad_norm", None, "max grad norm must be None in the reward model environment"))


def _reward_model(w: Walk) -> None:
    """``env.reward_model`` -> ``env.name=reward_model`` with the same section (`grpo.config.RewardModelConfig`);
    NeMo-RL's asserts kept, its placement and DTensor keys named."""
    k = "env.reward_model"
    w.set("env.name", "reward_model")
    for sub, expected, why in REWARD_MODEL_ASSERTS:
        value = w.get(f"{k}.{sub}", expected if sub != "dtensor_cfg.enabled" else None)
        if value != expected and not (sub.endswith("enabled") and expected is False and value is None):
            w.refuse(f"{k}.{sub}", f"expected {expected!r}: {why} (NeMo-RL asserts it)")
        w.take(f"{k}.{sub}")
    for key in ("model_name", "precision", "batch_size", "max_model_len", "checkpoint_path", "tokenizer.name",
                "reward_model_cfg.enabled", "reward_model_cfg.reward_model_type",
                "placement", "offload"):  # (the last two are grpo-ds's own: grpo.config.RewardModelConfig)
        w.honor(f"{k}.{key}")
    for key in w.open_keys(f"{k}.tokenizer"):
        w.refuse(key, "a reward-model tokenizer key grpo-ds does not translate (tokenizer.name is the one it reads)")
    resources = w.get(f"{k}.resources") or {}
    w.ignore(f"{k}.resources", f"NeMo-RL's own GPUs for the reward model ({resources.get('gpus_per_node')} per node x "
             f"{resources.get('num_nodes')} nodes, which NeMo-RL takes out of cluster.gpus_per_node on one node and as whole "
             "nodes on several); grpo-ds has no reward-model ranks: every launched rank trains (generates, with "
             "colocated.enabled=false), and grpo-ds runs it on the training ranks, beside the policy: a frozen "
             "copy on each, or a ZeRO-3 engine sharded over them (env.reward_model.placement, auto: by size), scored "
             "at one point of each rollout; with cluster.gpus_per_node=1 it shares the one rank, with generation on "
             "ranks of its own the trainers score (grpo/wings/reward_model/scorer.py)")
    w.ignore(f"{k}.dtensor_cfg", "DTensor parallel sizes and plans: grpo-ds's reward model is a frozen copy per rank "
             "or ZeRO-3 data-parallel shards (no tensor or context parallelism)")
    w.ignore(f"{k}.offload_optimizer_for_logprob", "the reward model has no optimizer")
    w.ignore(f"{k}.processor", "NeMo-RL's RewardModelEnvironment reads no processor (data.default.processor formats "
             "the prompts)")
    for key in ("logprob_batch_size", "generation", "enabled"):
        w.ignore(f"{k}.{key}", "a key of NeMo-RL's RewardModelEnvironmentConfig that its scoring path does not read")
    for key in w.open_keys(k):
        w.refuse(key, "a reward-model key grpo-ds does not translate")
    w.take(k)
    w.table.append(("translated", "data.default.env_name", "reward_model -> env.name='reward_model': the "
                    "conversation rendered with the reward model's own chat template, scored by its head logit"))


# -- loss, grpo, checkpointing, the rest ---------------------------------------------------------------
def _loss(w: Walk) -> None:
    w.honor("loss_fn.use_cispo")  # grpo.loss.cispo_objective; the config rejects what NeMo-RL's loss rejects
    key = "loss_fn.positive_example_nll_weight"
    mu = w.get(key)
    if isinstance(mu, (int, float)) and not isinstance(mu, bool) and mu > 0:
        w.translate(key, {key: mu}, "VAPO's NLL on the samples with reward > 0, normalised by the step's count of "
                    "their tokens; NeMo-RL's GRPO loop never hands its loss the rewards (only ppo.py does), so "
                    "there this weight has no effect: set it to 0 to train as NeMo-RL's GRPO does")
    else:
        w.honor(key)


def _grpo(w: Walk) -> None:
    from grpo.config import AsyncGRPOConfig

    a = w.get("grpo.async_grpo")
    if _enabled(a) and a.get("recompute_kv_cache_after_weight_updates") and not a.get("in_flight_weight_updates"):
        w.ignore("grpo.async_grpo.recompute_kv_cache_after_weight_updates", "without in-flight weight updates "
                 "grpo-ds's generation starts on a fresh KV cache after every refit: holds by construction")
    if isinstance(a, dict) and not a.get("enabled"):
        defaults = AsyncGRPOConfig().model_dump()
        w.take("grpo.async_grpo.enabled")
        if all(defaults.get(k, _ABSENT) == v for k, v in a.items() if k != "enabled"):
            w.take("grpo.async_grpo")
        else:
            w.ignore("grpo.async_grpo", "async_grpo.enabled=false: the asynchronous loop's settings are unused (as "
                     "in NeMo-RL)")
    # Stale keys of NeMo-Gym recipes (examples/nemo_gym): NeMo-RL's GRPOConfig (extra="allow") accepts them and no
    # code at 7ea279a reads them; its message-level penalties are grpo.*_advantage alone (grpo.py:1945-1963).
    for key, instead in (("penalize_invalid_tool_call", "invalid_tool_call_advantage"),
                         ("invalid_tool_call_strategy", "invalid_tool_call_advantage"),
                         ("penalize_malformed_thinking", "malformed_thinking_advantage")):
        w.ignore(f"grpo.{key}", f"NeMo-RL reads no such key (a stale key of NeMo-Gym recipes: no code at 7ea279a "
                 f"reads it); the penalty it names is grpo.{instead} alone, set or null")
    w.ignore("grpo.debug_payload_metrics", "NeMo-RL's telemetry of the bytes its Ray actors pass (serialised "
             "again to measure them); grpo-ds passes no Ray payloads and logs a step's media figures whenever it has "
             "images (train/payload_bytes/policy_train/*), and it changes no sample or update")
    gym_grpo_and_penalties(w)
    _reward_shaping(w)
    period = w.get("grpo.val_period")
    if isinstance(period, int) and period < 0:
        w.translate("grpo.val_period", {"grpo.val_period": 0}, "NeMo-RL validates periodically only for val_period > 0")
    _rollout_failure(w)
    rl = w.get("async_rl")
    if isinstance(rl, dict):
        sampler = rl.get("sampler") or {}
        if sampler.get("name") == "in_order" and not sampler.get("max_lookahead_versions"):
            w.ignore("async_rl", "NeMo-RL's single-controller trainer in its synchronous mode (in-order sampler, no "
                     "lookahead): the same on-policy steps as train_grpo.py")
        else:
            w.refuse("async_rl", "NeMo-RL's single-controller streaming trainer (run_grpo_single_controller.py, "
                     "off-policy samplers); grpo-ds's async loop is grpo.async_grpo (max_trajectory_age_steps)")
    elif rl is None:
        w.take("async_rl")


OVERLONG_KEYS = ("overlong_buffer_length", "overlong_buffer_penalty", "max_response_length")


def _reward_shaping(w: Walk) -> None:
    """``grpo.reward_shaping`` with ``stop_properly_penalty_coef`` set: NeMo-RL's apply_reward_shaping scales the
    truncated samples' rewards by it and returns before DAPO's overlong buffer, printing that the overlong keys are
    ignored (nemo_rl/algorithms/reward_functions.py:67-110); ProRLv2's recipes inherit those keys from DAPO's.
    The same here: they are ignored, named with that reason (grpo-ds's own config refuses the pair, so a native
    config says which one it means). The rest of the section is honored by name."""
    coef = w.get("grpo.reward_shaping.stop_properly_penalty_coef")
    if coef is None:
        return
    for name in OVERLONG_KEYS:
        if w.get(f"grpo.reward_shaping.{name}") is not None:
            w.ignore(f"grpo.reward_shaping.{name}", f"stop_properly_penalty_coef={coef!r} is set: NeMo-RL shapes with "
                     "it alone and ignores DAPO's overlong buffer (its [WARN] says so); grpo-ds does the same")


# NeMo-RL's async_rl.rollout_failure (single_controller_utils/config.py): the keys grpo-ds has, and why the others
# have no meaning here.
ROLLOUT_FAILURE_KEYS = ("max_infra_attempts_per_prompt", "max_data_attempts_per_prompt", "backoff_base_s",
                        "max_backoff_s", "min_step_batch_fraction")
ROLLOUT_FAILURE_IGNORED = {
    "max_skipped_prompts": "grpo-ds drops no prompt: a sample still failing after its retries is masked (out of the "
                           "loss and its group's baseline), and the step budget (min_step_batch_fraction, "
                           "max_consecutive_skipped_steps) bounds an outage",
    "max_consecutive_dropped_prompts": "grpo-ds drops no prompt; an outage is bounded by "
                                       "grpo.rollout_failure.max_consecutive_skipped_steps (skipped steps in a row)",
    "on_dropped_prompt": "the streaming trainer's refill of a short step; a grpo-ds step keeps its batch size (dynamic "
                         "sampling draws more prompts, else the step is skipped)",
    "max_replacement_attempts": "the streaming trainer's refill of a short step (on_dropped_prompt)",
    "replacement_reserve_prompts": "the streaming trainer's spare-prompt pool (on_dropped_prompt)",
    "native": "the single-controller rollout path's timeouts; grpo-ds's are env.step_timeout_s and env.timeout_s",
    "nemo_gym": "the single-controller NeMo-Gym path's settings",
}


def _rollout_failure(w: Walk) -> None:
    """``async_rl.rollout_failure.*`` -> ``grpo.rollout_failure.*`` (both loops); the rest named with the reason."""
    key = "async_rl.rollout_failure"
    section = w.get(key)
    if not isinstance(section, dict):
        return
    for name in ROLLOUT_FAILURE_KEYS:
        if name in section:
            note = ("grpo-ds counts samples that did not fail (NeMo-RL: prompt groups); a short step is skipped, "
                    "not shrunk" if name == "min_step_batch_fraction" else "")
            w.translate(f"{key}.{name}", {f"grpo.rollout_failure.{name}": section[name]}, note)
    for name, why in ROLLOUT_FAILURE_IGNORED.items():
        w.ignore(f"{key}.{name}", why)


# What NeMo-Gym recipes rank checkpoints by: a rollout metric NeMo-RL's validate adds only on the NeMo-Gym path
# (run_nemo_gym_rollout's calculate_single_metric over the results' rewards; nemo_rl/algorithms/grpo.py:3866-3925,
# nemo_rl/experience/rollouts.py:2697-2702).
GYM_VAL_REWARD = "val:total_reward/mean"


def _checkpointing(w: Walk) -> None:
    key = "checkpointing.metric_name"
    name = w.get(key)
    if name == GYM_VAL_REWARD and is_gym_recipe(w):
        w.translate(key, {key: "val:accuracy"}, "NeMo-RL's NeMo-Gym validation reports its rollout metrics beside "
                    "accuracy, total_reward/mean among them: the mean of the same rewards (penalties applied) over "
                    "the validation batch, which is the whole validation set with NeMo-Gym's val_batch_size=null; "
                    "grpo-ds's val:accuracy is that mean over the whole set")
    elif isinstance(name, str) and name.startswith(("val:", "train:")):
        if _accepts_metric_name(name):
            w.honor(key)
        else:  # TODO(names helper): pass "val:accuracy" through once CheckpointingConfig accepts NeMo-RL's form
            from grpo.config import VALIDATION_METRIC_ALIASES

            split, _, metric = name.partition(":")
            if split == "val":
                metric = VALIDATION_METRIC_ALIASES.get(metric, metric)
            w.translate(key, {key: f"{split}/{metric}"})
    if w.get("checkpointing.model_save_format") in (None, "safetensors"):
        w.take("checkpointing.model_save_format")
    else:
        w.ignore("checkpointing.model_save_format", "grpo-ds exports safetensors (the weights, not the algorithm)")
    deadline = w.get("checkpointing.checkpoint_must_save_by")
    if deadline is not None and w.get("checkpointing.enabled") is False:  # nemo_rl/algorithms/grpo.py:3519, 3797
        w.ignore("checkpointing.checkpoint_must_save_by", f"checkpointing.enabled=false: NeMo-RL stops the run at this "
                 f"time limit ({deadline}) and saves nothing; grpo-ds saves before a time limit only with checkpointing "
                 "on, so it runs on to max_num_steps or the job's own limit: the same samples and updates until then, "
                 "nothing saved either way")
    for k in ("ft_save_period", "ft_keep_latest_k"):  # nemo_rl/utils/checkpoint.py:109-112, 440-500
        w.ignore(f"checkpointing.{k}", "NeMo-RL's fault-tolerance checkpoints: extra saves every ft_save_period steps "
                 "for crash recovery, the newest ft_keep_latest_k of them kept; they change no sample or update, only "
                 "how many steps a crash loses. grpo-ds saves every checkpointing.save_period steps (the newest always "
                 "kept; checkpoint_must_save_by saves before a time limit) and resumes from the newest: lower "
                 "save_period for the same protection")
    if w.get("checkpointing.save_optimizer", True):
        w.take("checkpointing.save_optimizer")
    else:
        w.ignore("checkpointing.save_optimizer", "grpo-ds's checkpoints always hold the optimizer state (an exact "
                 "resume needs it)")


def _accepts_metric_name(name: str) -> bool:
    from pydantic import ValidationError

    try:
        MasterConfig.model_validate({"checkpointing": {"metric_name": name, "keep_top_k": 1}})
        return True
    except ValidationError:
        return False


def _logger_cluster_rest(w: Walk) -> None:
    for k, why in (("mlflow_enabled", "MLflow"), ("swanlab_enabled", "SwanLab"), ("mlflow", "MLflow"),
                   ("swanlab", "SwanLab")):
        w.ignore(f"logger.{k}", f"{why} logging; grpo-ds logs to metrics.jsonl, tensorboard and wandb")
    w.ignore("logger.tensorboard", "tensorboard writer options; grpo-ds's tensorboard logging takes none")
    w.ignore("logger.gpu_monitoring", "GPU monitor intervals; grpo-ds adds GPU memory to every metrics row "
             "(logger.monitor_gpus)")
    w.ignore("logger.wandb.log_nemo_gym_full_result_tables", "NeMo-Gym result tables")
    for k in list((w.get("cluster") or {})):
        if k not in ("gpus_per_node", "num_nodes"):
            w.ignore(f"cluster.{k}", "Ray cluster ports and topology; the launcher (deepspeed / torchrun) starts grpo-ds")
    w.ignore("data_plane", "the TransferQueue data plane moves batches between Ray actors; grpo-ds's loop runs in "
             "process")
    w.ignore("_teachers", "a holder of teacher checkpoints that on_policy_distillation.teacher_model_by_agent_name "
             "interpolates (${_teachers.<role>}, resolved above); NeMo-RL's code reads no such key")
    opd = w.get("on_policy_distillation")
    if _enabled(opd):
        _on_policy_distillation(w)
    elif opd is not None:
        w.ignore("on_policy_distillation", "enabled=false: no distillation")
    w.take("on_policy_distillation")


def _on_policy_distillation(w: Walk) -> None:
    """NeMo-RL's multi-teacher on-policy distillation (nemo_rl/algorithms/opd.py): its routing keys mean the same in
    grpo-ds (`grpo.distillation`), whose teachers run on the training ranks, plain or ZeRO-3 as the reference, or on
    ranks of their own (``non_colocated_teachers``)."""
    key = "on_policy_distillation"
    estimator = w.get("grpo.adv_estimator.name") or "grpo"
    if estimator == "opd":
        w.honor(f"{key}.enabled")
    else:  # nemo_rl/algorithms/grpo.py: only OPDAdvantageEstimator reads teacher_logprobs
        w.translate(f"{key}.enabled", {f"{key}.enabled": True, f"{key}.kl_coef": 0.0},
                    f"grpo.adv_estimator.name={estimator!r} ignores the teachers' logprobs in NeMo-RL (only 'opd' "
                    "reads them); grpo-ds's other estimators would add kl_coef times the teacher-student gap")
    for name in ("teacher_model_by_agent_name", "default_teacher_alias", "strict_agent_name_match",
                 "deduplicate_shared_teacher_checkpoints"):
        w.honor(f"{key}.{name}")
    for name, off in (("use_orm_advantage", False), ("orm_advantage_weight", 0.0)):  # read by no code at 7ea279a
        if w.get(f"{key}.{name}", off) in (off, None):
            w.ignore(f"{key}.{name}", f"{name}={off}: NeMo-RL 7ea279a reads no such key (its OnPolicyDistillationConfig "
                     "takes extra keys)")
        else:
            w.refuse(f"{key}.{name}", "NeMo-RL 7ea279a reads no such key, so no reward advantage joins the teachers' "
                     "there; grpo-ds adds on_policy_distillation.kl_coef times the teacher-student gap to another "
                     "estimator's advantages")
    if _enabled(w.get(f"{key}.non_colocated_teachers")):
        _non_colocated_teachers(w, f"{key}.non_colocated_teachers")
    else:
        w.ignore(f"{key}.non_colocated_teachers", "non_colocated_teachers.enabled=false: the teachers run on the "
                 "training ranks (NeMo-RL loads teachers only on GPUs of their own)")


def _non_colocated_teachers(w: Walk, nct: str) -> None:
    """NeMo-RL's teachers on GPUs of their own (nemo_rl/models/policy/teacher_worker_group.py): a worker group per
    loaded teacher, each ``default_teacher_cfg.gpus_per_node x num_nodes`` GPUs; in grpo-ds a block of teacher ranks
    per loaded teacher, the same sizes (`grpo.system.teacher`)."""
    w.honor(f"{nct}.enabled")
    d = f"{nct}.default_teacher_cfg"
    for name in ("gpus_per_node", "num_nodes", "micro_batch_size"):
        w.honor(f"{d}.{name}")
    w.ignore(d, "Megatron parallel sizes, precision and megatron_cfg_overrides of NeMo-RL's teacher workers: "
             "grpo-ds's teacher runs in policy.precision, whole on each of its ranks where it fits, else as a ZeRO-3 "
             "inference engine over them (the same logprobs)")
    if w.get(f"{nct}.teacher_overrides"):
        w.refuse(f"{nct}.teacher_overrides", "per-teacher sizes: grpo-ds gives every teacher default_teacher_cfg's "
                 "ranks (size those for the largest teacher and delete the overrides)")
    else:
        w.ignore(f"{nct}.teacher_overrides", "no per-teacher sizes: every teacher gets default_teacher_cfg's ranks")
