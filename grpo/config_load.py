"""Loading a run config: YAML recipes with ``defaults:`` inheritance, dotted overrides, readable errors.

    cfg = load_config("configs/cpu_demo.yaml", ["grpo.num_prompts_per_step=8", "policy.generation.top_k=null"])

A recipe may inherit from others (``defaults: base.yaml`` or a list, relative to the recipe; later ones
win); overrides are ``dotted.key=value`` with the value parsed as YAML. Every failure is a `ConfigError`
whose message names the file or the dotted key, the value and what was expected. Imports only pydantic
and yaml, so a bad config fails before torch is imported.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from pydantic import ValidationError

from grpo.config import MasterConfig


class ConfigError(ValueError):
    """A config that cannot run. The message names the dotted key, the value and what was expected."""


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def load_yaml(path: str | os.PathLike, _seen: tuple = ()) -> dict:
    """Read a recipe; ``defaults: other.yaml`` (or a list of them), relative to this file, is merged under it."""
    path = Path(path).resolve()
    if path in _seen:
        raise ConfigError(f"defaults: recipe inheritance loops through {path}")
    if not path.exists():
        raise ConfigError(f"--config {path}: file not found")
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    parents = raw.pop("defaults", None)
    if parents is None:
        return raw
    merged: dict = {}
    for parent in [parents] if isinstance(parents, str) else parents:
        merged = _deep_merge(merged, load_yaml(path.parent / parent, _seen + (path,)))
    return _deep_merge(merged, raw)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides; values are parsed as YAML (``8``, ``true``, ``null``, ``[1,2]``)."""
    raw = dict(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected dotted.key=value")
        key, _, value = item.partition("=")
        key = key.strip().lstrip("+")
        parts = key.split(".")
        node = raw
        for part in parts[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = {}
            elif not isinstance(nxt, dict):
                raise ConfigError(f"override {key}: {part!r} is a value, not a section")
            node[part] = dict(nxt)
            node = node[part]
        node[parts[-1]] = yaml.safe_load(value) if value != "" else None
    return raw


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(x) for x in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key (value {e.get('input')!r}); check the spelling against grpo/config.py")
        elif e["type"] == "value_error":
            # Our own checks already name the dotted key(s).
            msg = str(e["ctx"]["error"]) if "ctx" in e else e["msg"]
            lines.append(msg if not key else (msg if msg.split("=")[0].count(".") else f"{key}: {msg}"))
        else:
            lines.append(f"{key}={e.get('input')!r}: {e['msg']}")
    return "invalid config:\n  " + "\n  ".join(lines)


def build_config(raw: dict) -> MasterConfig:
    try:
        return MasterConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> MasterConfig:
    """Load a run config: YAML recipe (``None``: all defaults) + dotted overrides -> validated MasterConfig."""
    raw = load_yaml(path) if path is not None else {}
    return build_config(apply_overrides(raw, list(overrides or [])))

