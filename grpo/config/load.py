"""Loading a run config: YAML recipes with ``defaults:`` inheritance, dotted overrides, readable errors.

    cfg = load_config("configs/cpu_demo.yaml", ["grpo.num_prompts_per_step=8", "policy.generation.top_k=null"])
    cfg = load_config("my.yaml", ["my_algo.entropy_coef=0.01"], config_cls=MyConfig)   # a fork's config

A fork adds sections and fields by subclassing `grpo.config.MasterConfig` and passing the class
(``setup(..., config_cls=MyConfig)`` in its copy of the script); its keys are validated, shown by
``--help-config`` and recorded in the run fingerprint like the built-in ones. Every section of such a class
must refuse unknown keys (``class MyAlgo(BaseModel, extra="forbid")``), so that a misspelt key fails too.

A recipe may inherit from others (``defaults: base.yaml`` or a list, relative to the recipe; later ones
win); overrides are ``dotted.key=value`` with the value parsed as YAML. Every failure is a `ConfigError`
whose message names the file or the dotted key, the value and what was expected. Imports only pydantic
and yaml, so a bad config fails before torch is imported.
"""

from __future__ import annotations

import os
import reprlib
import stat
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


def yaml_error(where: str, err: yaml.YAMLError, text: str) -> str:
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
    shown = ""
    if mark.line < len(lines):  # the line, cut to a window around the column on a long one
        start = max(0, mark.column - 100)
        line = lines[mark.line][start: mark.column + 100]
        shown = f"\n    {'...' if start else ''}{line}\n    {' ' * (mark.column - start + (3 if start else 0))}^"
    return f"{where}, line {mark.line + 1}, column {mark.column + 1}: invalid YAML: {problem}{shown}"


def _utf8(data: bytes, where: str) -> str:
    """``data`` decoded as UTF-8, or a ConfigError naming the line and column of the first bad byte.

    >>> _utf8(b"a: 1\\nb: \\xff\\n", "x.yaml")
    Traceback (most recent call last):
    ...
    grpo.config.load.ConfigError: x.yaml, line 2, column 4: byte 0xff is not UTF-8; save the file as UTF-8
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise ConfigError(f"{where}, line {line}, column {column}: byte 0x{data[err.start]:02x} is not UTF-8; "
                          "save the file as UTF-8") from None


# A config holds hundreds of values; aliases (``*name``) may repeat a collection, but not into a "billion laughs"
# bomb whose expanded size would hang validation and the error message (the limits count the expanded tree).
MAX_YAML_VALUES = 100_000
MAX_YAML_DEPTH = 64
# The largest recipe file read (the biggest shipped recipe is a few KB): a path like /dev/zero or a data file passed
# as --config would otherwise be read whole into memory.
MAX_CONFIG_BYTES = 1 << 20


def _expanded_size(node, where: str) -> int:
    """Values in the tree under ``node`` with every alias expanded (linear in the distinct nodes: sizes are
    memoised), or a ConfigError for a tree over `MAX_YAML_VALUES` / `MAX_YAML_DEPTH` or a recursive alias."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(n, depth: int) -> int:
        key = id(n)
        if key in sizes:
            return sizes[key]
        line = f"{where}, line {n.start_mark.line + 1}" if n.start_mark is not None else where
        if key in active:
            raise ConfigError(f"{line}: this alias refers to a collection that contains it (a recursive value "
                              "cannot be a config value)")
        if depth > MAX_YAML_DEPTH:
            raise ConfigError(f"{line}: values nested more than {MAX_YAML_DEPTH} deep; a config is a few levels deep")
        total = 1
        if isinstance(n, (yaml.SequenceNode, yaml.MappingNode)):
            active.add(key)
            children = n.value if isinstance(n, yaml.SequenceNode) else [c for kv in n.value for c in kv]
            for child in children:
                total += size(child, depth + 1)
                if total > MAX_YAML_VALUES:
                    raise ConfigError(
                        f"{line}: more than {MAX_YAML_VALUES:,} values here (an alias, *name, counts at its full "
                        "size); a config holds far fewer: a YAML alias bomb, or data that belongs in a data file")
            active.discard(key)
        sizes[key] = total
        return total

    return size(node, 0)


def bounded_yaml(text: str, where: str):
    """``yaml.safe_load(text)``, refusing (`ConfigError`) what expands past `MAX_YAML_VALUES` values through aliases,
    nests deeper than `MAX_YAML_DEPTH` or holds a recursive alias: checked on the composed nodes, before any
    Python value is built. YAML syntax errors raise ``yaml.YAMLError`` as from ``safe_load``."""
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise ConfigError(f"{where}: values nested too deep to read; a config is a few levels deep") from None
        if node is None:
            return None
        _expanded_size(node, where)
        return loader.construct_document(node)
    finally:
        loader.dispose()


_FILE_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def recipe_paths(path: str | os.PathLike) -> tuple[Path, Path]:
    """``(named, real)``: the recipe as named, made absolute (what is opened and named when it cannot be read:
    ``/dev/stdin`` stays itself, where resolving it gives ``/proc/<pid>/fd/pipe:[N]``, a name nothing can open, so a
    pipe read "file not found"), and its real path (which file it is: inheritance loops are found by it, and a
    relative ``defaults:`` entry is relative to its folder).

        >>> recipe_paths("/dev/stdin")[0]
        PosixPath('/dev/stdin')
    """
    return Path(os.path.abspath(path)), Path(path).resolve()


def read_config_text(path: Path) -> str:
    """The text of the recipe file at ``path``: only a regular file is read (a FIFO, a device or a socket is
    refused at once, without waiting for a writer: opened non-blocking, checked with fstat), up to
    `MAX_CONFIG_BYTES`, as UTF-8; every failure is a `ConfigError` naming the file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: file not found") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read it ({err.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
            raise ConfigError(f"{path}: {kind}, not a regular file: a recipe is a YAML file on disk")
        try:
            data = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as err:
            raise ConfigError(f"{path}: cannot read it ({err.strerror})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES >> 20} MiB, which no config is (is it a data "
                          "file?); a recipe holds a few hundred values")
    return _utf8(data, str(path))


def null_key_error(node, where: str, path: str = "") -> str | None:
    """The error of the first null key under ``node`` (YAML's ``~:`` or ``null:``: a key that reads as nothing, which
    neither pydantic nor OmegaConf takes), naming ``where`` (the file) and the dotted key path that holds it, or None.

        >>> null_key_error({"policy": {"optimizer": {None: 3}}}, "run.yaml")
        "run.yaml: policy.optimizer: a null key (~: or null:, holding 3): keys are names; quote 'null' for the word"
        >>> null_key_error({"a": [{"b": 1}]}, "run.yaml") is None
        True
    """
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        if k is None and isinstance(node, dict):
            return (f"{where}: {path or 'the top level'}: a null key (~: or null:, holding {_short_repr(v)}): keys "
                    "are names; quote 'null' for the word")
        found = null_key_error(v, where, f"{path}.{k}" if path and isinstance(node, dict) else
                               f"{path}[{k}]" if isinstance(node, list) else str(k))
        if found is not None:
            return found
    return None


def defaults_entries(path: Path, parents) -> list[str]:
    """A recipe's ``defaults:`` value as the list of recipe paths it names: one path, a list of paths, or null
    (none); anything else (a number, a mapping, a list holding something but paths) is a `ConfigError` naming
    the recipe.

    >>> defaults_entries(Path("a.yaml"), "base.yaml"), defaults_entries(Path("a.yaml"), None)
    (['base.yaml'], [])
    >>> defaults_entries(Path("a.yaml"), 5)
    Traceback (most recent call last):
    ...
    grpo.config.load.ConfigError: a.yaml: defaults: 5: expected a recipe path or a list of recipe paths
    """
    if parents is None:
        return []
    if isinstance(parents, str):
        parents = [parents]
    if isinstance(parents, (list, tuple)) and all(isinstance(p, str) and p for p in parents):
        return list(parents)
    short = reprlib.Repr()
    short.maxstring, short.maxother, short.maxlist, short.maxdict = 80, 80, 4, 4
    shown = short.repr(parents)
    raise ConfigError(f"{path}: defaults: {shown}: expected a recipe path or a list of recipe paths")


def load_yaml(path: str | os.PathLike, _seen: tuple = ()) -> dict:
    """Read a recipe; ``defaults: other.yaml`` (or a list of them), relative to this file, is merged under it.
    An empty file, bytes that are not UTF-8, a file that is not a regular file, YAML syntax errors and a malformed
    ``defaults:`` are `ConfigError`s naming the file (and line)."""
    named, path = recipe_paths(path)
    if path in _seen:
        raise ConfigError(f"defaults: recipe inheritance loops through {path}")
    text = read_config_text(named)
    try:
        raw = bounded_yaml(text, str(path))
    except yaml.YAMLError as err:
        raise ConfigError(yaml_error(str(path), err, text)) from None
    if raw is None or raw == {}:
        raise ConfigError(
            f"{path}: the config file is empty. A config holds what a run changes from the defaults (at least "
            "policy.model_name and data.dataset_name; the default model is a hub download): start from "
            "configs/cpu_demo.yaml, or inherit a recipe with `defaults: <recipe>.yaml` and change what differs")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    if (null := null_key_error(raw, str(path))) is not None:
        raise ConfigError(null)
    parents = defaults_entries(path, raw.pop("defaults", None))
    if not parents:
        return raw
    merged: dict = {}
    for parent in parents:
        merged = _deep_merge(merged, load_yaml(parent_recipe(path, parent), _seen + (path,)))
    return _deep_merge(merged, raw)


def parent_recipe(path: Path, parent) -> Path:
    """The file a recipe's ``defaults:`` entry names: absolute, or relative to the recipe (``path``); a missing
    one is a `ConfigError` naming the recipe that refers to it."""
    parent_path = path.parent / str(parent)  # an absolute entry replaces the recipe's folder
    if not parent_path.exists():
        raise ConfigError(f"{path}: defaults: {str(parent)!r}: file not found ({parent_path}; a relative path is "
                          "relative to the recipe that names it)")
    return parent_path


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides; values are parsed as YAML (``8``, ``true``, ``null``, ``[1,2]``).
    ``~a.b.c`` deletes a key the recipe sets (it then takes its default), ``~a.b.c=value`` only while it holds
    ``value``; a key the recipe does not set, or holding another value, is a `ConfigError` naming it."""
    raw = dict(raw)
    for item in overrides:
        if item.startswith("~"):
            key, sep, value = item[1:].partition("=")
            raw = _delete_key(raw, key.strip(), _override_value(key.strip(), value) if sep else _ANY)
            continue
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected dotted.key=value (or ~dotted.key to delete a key)")
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
        node[parts[-1]] = _override_value(key, value)
    return raw


def _override_value(key: str, value: str):
    """An override's value, parsed as YAML (empty: null); a `ConfigError` naming ``key`` for bytes that are not
    UTF-8, bad YAML or a null key inside."""
    bad = next((c for c in value if "\udc80" <= c <= "\udcff"), None)  # undecodable bytes of the command line
    if bad is not None:
        raise ConfigError(f"override {key}: byte 0x{ord(bad) - 0xDC00:02x} is not UTF-8; pass the value as UTF-8")
    try:
        parsed = bounded_yaml(value, f"override {key}") if value != "" else None
    except yaml.YAMLError as err:
        raise ConfigError(yaml_error(f"override {key}={_short_repr(value)}", err, value).replace(", line 1,", ",") +
                          "\n  (quote a string holding YAML syntax: " + f"{key}='\"...\"')") from None
    if (null := null_key_error(parsed, "override", key)) is not None:
        raise ConfigError(null)
    return parsed


_ANY = object()


def _delete_key(raw: dict, key: str, expected=_ANY) -> dict:
    """``raw`` without the dotted ``key`` (the sections on its way copied, ``raw`` itself untouched); with
    ``expected``, only if the key holds that value.

        >>> _delete_key({"grpo": {"seed": 1, "val_period": 5}}, "grpo.seed")
        {'grpo': {'val_period': 5}}
    """
    *parents, last = key.split(".")
    out = dict(raw)
    node = out
    for part in parents:
        if not isinstance(node.get(part), dict):
            node = None
            break
        node[part] = dict(node[part])
        node = node[part]
    if node is None or last not in node:
        raise ConfigError(f"override ~{key}: the config sets no such key to delete; check the spelling (a key the "
                          "config does not set already has its default)")
    if expected is not _ANY and node[last] != expected:
        raise ConfigError(f"override ~{key}={_short_repr(expected)}: the config's {key} is {_short_repr(node[last])}; "
                          f"nothing deleted (~{key} deletes it whatever it holds)")
    del node[last]
    return out


def _short_repr(value) -> str:
    """A repr of at most a few hundred characters, whatever the size of ``value`` (bounded in time too).

    >>> _short_repr(list(range(1000)))
    '[0, 1, 2, 3, 4, 5, ...]'
    """
    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxtuple, r.maxdict, r.maxset, r.maxstring, r.maxother = 3, 6, 6, 6, 6, 80, 80
    return r.repr(value)


MAX_ERROR_LINES = 20
MAX_ERROR_LINE_CHARS = 1000


def _format_validation_error(err: ValidationError, config_cls: type = MasterConfig) -> str:
    """``invalid config:`` and one line per error (the first `MAX_ERROR_LINES`), each naming the dotted key and a
    bounded repr of the value: a huge value never makes a huge message."""
    errors = err.errors(include_url=False)
    lines = []
    for e in errors[:MAX_ERROR_LINES]:
        key = ".".join(str(x) for x in e["loc"])
        value = _short_repr(e.get("input"))
        if e["type"] == "extra_forbidden":
            found = [f"{key}: unknown key (value {value}); check the spelling against {_declared_in(config_cls)}"]
        elif e["type"] == "value_error":
            # Our own checks already name the dotted key(s); a rule set reports each broken rule on its own line.
            msg = str(e["ctx"]["error"]) if "ctx" in e else e["msg"]
            found = [m if not key or m.split("=")[0].count(".") else f"{key}: {m}" for m in msg.splitlines() or [""]]
        else:
            found = [f"{key}={value}: {e['msg']}"]
        lines += [line if len(line) <= MAX_ERROR_LINE_CHARS else line[:MAX_ERROR_LINE_CHARS] + " ..." for line in found]
    if len(errors) > MAX_ERROR_LINES:
        lines.append(f"... and {len(errors) - MAX_ERROR_LINES} more errors")
    return "invalid config:\n  " + "\n  ".join(lines)


def _declared_in(config_cls: type) -> str:
    """Where the fields of ``config_cls`` are declared, for the unknown-key message."""
    if config_cls is MasterConfig:
        return "grpo/config/"
    return f"{config_cls.__module__}.{config_cls.__qualname__} and grpo/config/"


def check_config_cls(config_cls: type) -> type:
    """``config_cls`` itself when it is `grpo.config.MasterConfig` or a subclass whose every section (nested
    ones too) refuses unknown keys; a TypeError naming the section model otherwise (a fork's mistake, found
    before any config is read)."""
    if not (isinstance(config_cls, type) and issubclass(config_cls, MasterConfig)):
        raise TypeError(f"config_cls={config_cls!r}: expected grpo.config.MasterConfig or a subclass of it")
    seen: set[type] = set()

    def walk(model: type, key: str) -> None:
        if model in seen:
            return
        seen.add(model)
        if model.model_config.get("extra") != "forbid":
            raise TypeError(f"config_cls={config_cls.__qualname__}: the section {key or '(top level)'} "
                            f"({model.__qualname__}) accepts unknown keys; declare it with extra='forbid' "
                            f"(class {model.__name__}(BaseModel, extra=\"forbid\")) so a misspelt key fails")
        for name, f in model.model_fields.items():
            sub = section_model(f.annotation)
            if sub is not None:
                walk(sub, f"{key}.{name}" if key else name)

    walk(config_cls, "")
    return config_cls


def build_config(raw: dict, config_cls: type[MasterConfig] = MasterConfig) -> MasterConfig:
    """Validate a raw config dict against ``config_cls`` (`grpo.config.MasterConfig`, or a fork's subclass with
    more sections: `check_config_cls`); checks that need more than one section's fields (the estimator name
    against `grpo.registry`) run here too."""
    from grpo.registry import estimator_names, needs_group

    check_config_cls(config_cls)
    try:
        cfg = config_cls.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, config_cls)) from None
    name = cfg.grpo.adv_estimator.name
    if name not in estimator_names():
        raise ConfigError(f"invalid config:\n  grpo.adv_estimator.name={name!r}: expected one of {estimator_names()} "
                          "(a fork registers its own with grpo.advantages.register_estimator before main())")
    n = cfg.grpo.num_generations_per_prompt
    if n < 2 and needs_group(name, cfg.grpo.adv_estimator) and not cfg.on_policy_distillation.enabled:
        raise ConfigError(
            f"invalid config:\n  grpo.num_generations_per_prompt={n}: the {name!r} advantage estimator compares the "
            "samples of a prompt with each other (a per-prompt baseline), so one sample per prompt makes every "
            "advantage, loss and gradient 0 and the run learns nothing. Set grpo.num_generations_per_prompt >= 2, "
            "or use an estimator with a global baseline (grpo.adv_estimator.name=reinforce_plus_plus with "
            "grpo.adv_estimator.minus_baseline=false)")
    return cfg


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None,
                config_cls: type[MasterConfig] = MasterConfig) -> MasterConfig:
    """Load a run config: YAML recipe (``None``: all defaults) + dotted overrides -> validated ``config_cls``
    (`grpo.config.MasterConfig` or a fork's subclass of it)."""
    raw = load_yaml(path) if path is not None else {}
    return build_config(apply_overrides(raw, list(overrides or [])), config_cls)



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


def section_model(annotation):
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
        sub = section_model(f.annotation)
        if sub is not None:
            rows += config_fields(sub, f"{key}.")
            continue
        default = f.default_factory() if f.default_factory is not None else f.default
        rows.append((key, _type_name(f.annotation), repr(default) if not isinstance(default, str) else default,
                     f.description or ""))
    return rows


def config_help(section: str | None = None, config_cls: type[MasterConfig] = MasterConfig) -> str:
    """The config reference as text: every field of ``config_cls`` under ``section`` (a dotted prefix; None:
    all) with its type, default and description. An unknown section is a `ConfigError` listing the sections."""
    all_rows = config_fields(config_cls)
    rows = all_rows
    if section:
        rows = [r for r in rows if r[0] == section or r[0].startswith(section.rstrip(".") + ".")]
        if not rows:
            sections = sorted({r[0].split(".")[0] for r in all_rows})
            raise ConfigError(f"--help-config {section!r}: no such section or field (sections: {sections})")
    lines = []
    for key, type_name, default, description in rows:
        lines.append(f"{key}  ({type_name}, default {default})")
        if description:
            lines.append(f"    {description}")
    return "\n".join(lines)
