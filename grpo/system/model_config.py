"""The model config every copy of the policy is built from: the checkpoint's, with ``policy.hf_config_overrides``
(NeMo-RL's ``hf_config_overrides``) applied: the training engine, the reference, the hf generation copy (built
from the policy module's config) and vLLM (``hf_overrides``).

How an override applies (`apply_overrides`), key by key, as transformers applies config kwargs of
``from_pretrained`` (``PreTrainedConfig.from_dict``) and vLLM its ``hf_overrides`` (``ModelConfig._apply_dict_overrides``):

- a dict into a sub-config (``text_config: {router_aux_loss_coef: 0.0}``) updates the sub-config's keys, each
  by these same rules;
- any other value replaces the attribute, a dict too (``rope_scaling: {...}`` is the whole new dict);
- a key the config does not have is an error naming it. transformers' ``AutoConfig.from_pretrained`` drops such
  a key without a word (NeMo-RL's DTensor path) and vLLM's ``config.update`` adds it: either way a misspelt key
  would change nothing, silently;
- RoPE, as a ``config.json`` with these values would load: a new ``rope_scaling`` / ``rope_parameters`` without
  ``rope_theta`` keeps the checkpoint's, the legacy ``type`` key names the ``rope_type``, then transformers
  standardizes and validates them; ``rope_theta`` alone (transformers 5 keeps it in ``rope_parameters``) sets the
  theta of ``rope_parameters``.

vLLM gets the result (`vllm_hf_overrides`), not the raw overrides, so that its model is the trainer's.
"""

from __future__ import annotations

import copy
from typing import Any

ROPE_KEYS = ("rope_scaling", "rope_parameters", "rope_theta")
PREFIX = "policy.hf_config_overrides"


class ModelConfigError(ValueError):
    """An override the model config cannot take."""


def load_model_config(policy, name: str | None = None):
    """``AutoConfig`` of ``name`` (default ``policy.model_name``) with ``policy.hf_config_overrides`` applied."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(name or policy.model_name, trust_remote_code=policy.trust_remote_code)
    return apply_overrides(config, policy.hf_config_overrides)


def apply_overrides(config, overrides: dict[str, Any], prefix: str = PREFIX):
    """A copy of ``config`` with ``overrides`` applied (the rules above); ``config`` itself when there are none.

        >>> from transformers import LlamaConfig
        >>> c = apply_overrides(LlamaConfig(), {"max_position_embeddings": 64, "rope_theta": 5.0})
        >>> c.max_position_embeddings, c.rope_parameters["rope_theta"]
        (64, 5.0)
        >>> apply_overrides(LlamaConfig(), {"max_position_embedings": 64})
        Traceback (most recent call last):
        ...
        grpo.system.model_config.ModelConfigError: policy.hf_config_overrides.max_position_embedings: LlamaConfig has no such attribute ...
    """
    if not overrides:
        return config
    config = copy.deepcopy(config)
    _apply(config, overrides, prefix)
    return config


def _apply(config, overrides: dict[str, Any], prefix: str) -> None:
    from transformers import PreTrainedConfig

    old_rope = copy.deepcopy(getattr(config, "rope_parameters", None))
    for key, value in overrides.items():
        name = f"{prefix}.{key}"
        if key == "rope_theta" and not hasattr(config, key) and _flat_rope(getattr(config, "rope_parameters", None)):
            config.rope_parameters = {**config.rope_parameters, "rope_theta": value}
            continue
        if not hasattr(config, key):
            raise ModelConfigError(f"{name}: {type(config).__name__} has no such attribute (the checkpoint's "
                                   f"config.json and transformers' defaults lack it); check the spelling")
        current = getattr(config, key)
        if isinstance(current, PreTrainedConfig) and isinstance(value, dict):
            _apply(current, value, name)
        else:
            setattr(config, key, copy.deepcopy(value))
    if any(k in overrides for k in ROPE_KEYS) and hasattr(config, "standardize_rope_params"):
        rope = getattr(config, "rope_parameters", None)
        if _flat_rope(rope) and "rope_theta" not in rope and _flat_rope(old_rope) and "rope_theta" in old_rope:
            rope["rope_theta"] = old_rope["rope_theta"]
        try:
            config.standardize_rope_params()
            config.validate_rope()  # transformers only warns about a rope_type it does not know: that is an error
            _check_rope_types(config.rope_parameters)
        except (KeyError, ValueError, TypeError) as err:
            raise ModelConfigError(f"{prefix}: the RoPE parameters {getattr(config, 'rope_parameters', None)} are "
                                   f"not valid for {type(config).__name__}: {type(err).__name__}: {err}") from err


def _check_rope_types(rope) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for params in [rope] if _flat_rope(rope) else [p for p in (rope or {}).values() if isinstance(p, dict)]:
        kind = params.get("rope_type", "default")
        if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"rope_type={kind!r}: expected one of {['default', *ROPE_INIT_FUNCTIONS]}")


def _flat_rope(rope) -> bool:
    """A single dict of RoPE parameters (not one per layer type)."""
    return isinstance(rope, dict) and not any(isinstance(v, dict) for v in rope.values())


def vllm_hf_overrides(config, overrides: dict[str, Any]) -> dict[str, Any]:
    """``hf_overrides`` for ``vllm.LLM``: each overridden key with its value in ``config`` (`apply_overrides`'s
    result), sub-configs key by key, the RoPE keys as the standardized ``rope_parameters`` (vLLM applies a dict
    override after its own RoPE patching, and ignores a top-level ``rope_theta`` once ``rope_parameters`` has one).

        >>> from transformers import LlamaConfig
        >>> ov = {"rope_theta": 5.0, "max_position_embeddings": 64}
        >>> sorted(vllm_hf_overrides(apply_overrides(LlamaConfig(), ov), ov).items())
        [('max_position_embeddings', 64), ('rope_parameters', {'rope_theta': 5.0, 'rope_type': 'default'})]
    """
    from transformers import PreTrainedConfig

    out: dict[str, Any] = {}
    for key, value in overrides.items():
        if key in ROPE_KEYS and hasattr(config, "rope_parameters"):
            out["rope_parameters"] = copy.deepcopy(config.rope_parameters)
            continue
        current = getattr(config, key)
        if isinstance(current, PreTrainedConfig) and isinstance(value, dict):
            out[key] = vllm_hf_overrides(current, value)
        else:
            out[key] = copy.deepcopy(current)
    return out
