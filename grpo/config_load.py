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


def _yaml_error(where: str, err: yaml.YAMLError, text: str) -> str:
    """``where, line L, column C: invalid YAML: problem`` and the offending line, from a YAML error."""
    mark, context_mark = getattr(err, "problem_mark", None), getattr(err, "context_mark", None)
    problem, context = getattr(err, "problem", None) or str(err), getattr(err, "context", None)
    if mark is None:
        return f"{where}: invalid YAML ({problem})"
    if context and context_mark is not None and context_mark.line != mark.line:
        problem += f" ({context} started at line {context_mark.line + 1}, column {context_mark.column + 1})"
    elif context:
        problem = f"{context}: {problem}"
    lines = text.splitlines()
    shown = f"\n    {lines[mark.line]}\n    {' ' * mark.column}^" if mark.line < len(lines) else ""
    return f"{where}, line {mark.line + 1}, column {mark.column + 1}: invalid YAML: {problem}{shown}"


def _utf8(data: bytes, where: str) -> str:
    """``data`` decoded as UTF-8, or a ConfigError naming the line and column of the first bad byte.

    >>> _utf8(b"a: 1\\nb: \\xff\\n", "x.yaml")
    Traceback (most recent call last):
    ...
    grpo.config_load.ConfigError: x.yaml, line 2, column 4: byte 0xff is not UTF-8; save the file as UTF-8
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise ConfigError(f"{where}, line {line}, column {column}: byte 0x{data[err.start]:02x} is not UTF-8; "
                          "save the file as UTF-8") from None


def load_yaml(path: str | os.PathLike, _seen: tuple = ()) -> dict:
    """Read a recipe; ``defaults: other.yaml`` (or a list of them), relative to this file, is merged under it.
    An empty file, bytes that are not UTF-8 and YAML syntax errors are `ConfigError`s naming the file (and line)."""
    path = Path(path).resolve()
    if path in _seen:
        raise ConfigError(f"defaults: recipe inheritance loops through {path}")
    if not path.exists():
        raise ConfigError(f"--config {path}: file not found")
    try:
        text = _utf8(path.read_bytes(), str(path))
    except OSError as err:
        raise ConfigError(f"{path}: cannot read it ({err.strerror})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(_yaml_error(str(path), err, text)) from None
    if raw is None or raw == {}:
        raise ConfigError(
            f"{path}: the config file is empty. A config holds what a run changes from the defaults (at least "
            "policy.model_name and data.dataset_name; the default model is a hub download): start from "
            "configs/cpu_demo.yaml, or inherit a recipe with `defaults: <recipe>.yaml` and change what differs")
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
        bad = next((c for c in value if "\udc80" <= c <= "\udcff"), None)  # undecodable bytes of the command line
        if bad is not None:
            raise ConfigError(f"override {key}: byte 0x{ord(bad) - 0xDC00:02x} is not UTF-8; pass the value as UTF-8")
        try:
            node[parts[-1]] = yaml.safe_load(value) if value != "" else None
        except yaml.YAMLError as err:
            raise ConfigError(_yaml_error(f"override {key}={value!r}", err, value).replace(", line 1,", ",") +
                              "\n  (quote a string holding YAML syntax: " + f"{key}='\"...\"')") from None
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
    """Validate a raw config dict; checks that need more than one section's fields (the estimator name
    against `grpo.registry`) run here too."""
    from grpo.registry import estimator_names

    try:
        cfg = MasterConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None
    name = cfg.grpo.adv_estimator.name
    if name not in estimator_names():
        raise ConfigError(f"invalid config:\n  grpo.adv_estimator.name={name!r}: expected one of {estimator_names()} "
                          "(a fork registers its own with grpo.advantages.register_estimator before main())")
    return cfg


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> MasterConfig:
    """Load a run config: YAML recipe (``None``: all defaults) + dotted overrides -> validated MasterConfig."""
    raw = load_yaml(path) if path is not None else {}
    return build_config(apply_overrides(raw, list(overrides or [])))



# --------------------------------------------------------------------------------------------------
# The config reference (--help-config)
# --------------------------------------------------------------------------------------------------
def _type_name(annotation) -> str:
    """A readable type: ``Optional[int]`` -> ``int | None``, ``Literal['a', 'b']`` -> ``'a' | 'b'``."""
    import typing

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _section_model(annotation):
    """The config model a field holds (a section), or None for a leaf."""
    from pydantic import BaseModel

    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def config_fields(model=MasterConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """Every leaf field as ``(dotted key, type, default, description)``, sections walked depth first.

        >>> next(f for f in config_fields() if f[0] == "grpo.num_prompts_per_step")[1:3]
        ('int', '32')
    """
    rows = []
    for name, f in model.model_fields.items():
        key = f"{prefix}{name}"
        sub = _section_model(f.annotation)
        if sub is not None:
            rows += config_fields(sub, f"{key}.")
            continue
        default = f.default_factory() if f.default_factory is not None else f.default
        rows.append((key, _type_name(f.annotation), repr(default) if not isinstance(default, str) else default,
                     f.description or ""))
    return rows


def config_help(section: str | None = None) -> str:
    """The config reference as text: every field under ``section`` (a dotted prefix; None: all) with its
    type, default and description. An unknown section is a `ConfigError` listing the sections."""
    rows = config_fields()
    if section:
        rows = [r for r in rows if r[0] == section or r[0].startswith(section.rstrip(".") + ".")]
        if not rows:
            sections = sorted({r[0].split(".")[0] for r in config_fields()})
            raise ConfigError(f"--help-config {section!r}: no such section or field (sections: {sections})")
    lines = []
    for key, type_name, default, description in rows:
        lines.append(f"{key}  ({type_name}, default {default})")
        if description:
            lines.append(f"    {description}")
    return "\n".join(lines)
