"""NeMo-RL's own GRPO recipes as they are: recognised by their shape, loaded with NeMo-RL's ``defaults:`` and
``${...}`` interpolation, translated key by key into a grpo-ds config.

    cfg, table = load_recipe("examples/configs/grpo_math_1B.yaml", ["policy.model_name=Qwen/Qwen2.5-0.5B"])
    print(format_table(table))          # "translated: ..." and "ignored: <dotted key>: <why>" lines

Loading follows ``nemo_rl/utils/config.py``: ``defaults:`` (a path or a list, relative to the file that names
it, depth first, later ones win) merged with OmegaConf (a section marked ``_override_: true`` replaces its
parent's instead of merging), then the command-line overrides in NeMo-RL's key names (hydra's forms:
``key=value`` for a key the recipe has, ``+key=value`` to add one, ``++key=value`` either way), and only then
interpolation with NeMo-RL's resolvers ``mul``, ``add``, ``div``, ``max``: ``${policy.max_total_sequence_length}``
follows an override of it.

Then every key gets one fate (`grpo.config.nemo_rl.rules`): honored (same name, same meaning: copied), translated
(another grpo-ds key that means the same), ignored (it configures a backend grpo-ds does not have: listed in the
table with the reason), or refused (it changes the algorithm and grpo-ds cannot do it: a `ConfigError` naming the
key and why). A key no rule knows is refused too. The result is validated by `grpo.config.MasterConfig` like any
native config; native configs never come here (`is_nemo_rl_recipe`).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import yaml

from grpo.config import MasterConfig
from grpo.config.load import (
    ConfigError, build_config, defaults_entries, load_yaml, null_key_error, parent_recipe, recipe_paths,
)

# NeMo-RL's resolvers on numbers: a chain of ${mul:...} squares its way to integers of billions of digits (Python
# computes them exactly, for good); strings and lists grow by add / mul the same way. A config's numbers are far
# smaller: a result past these bounds is a ConfigError (`_bounded`).
MAX_RESOLVED_INT_BITS = 256
MAX_RESOLVED_LEN = 1 << 16
# OmegaConf resolves a chain ${a} -> ${b} -> ... again for every key on it (quadratic work): NeMo-RL's largest
# recipes hold a few dozen interpolations; more than this many ${ in one recipe is refused before resolving.
MAX_INTERPOLATIONS = 1000

# Where NeMo-RL's structure differs from grpo-ds's (each would be an unknown key in a native config).
FREE_TEXT_KEYS = ("prompt_template", "system_prompt", "chat_template", "stop_strings")


def looks_like_nemo_rl(raw: dict) -> str | None:
    """The first NeMo-RL-only marker in a merged recipe dict, or None for a native grpo-ds config.

    Markers (none can appear in a valid native config): ``policy.dtensor_cfg`` / ``megatron_cfg``,
    ``policy.optimizer.kwargs``, a scheduler list, ``data.train`` / ``data.validation`` / ``data.default``,
    an ``env.<name>:`` section (a mapping under a key that is not an env field), ``${...}`` outside free text.

        >>> looks_like_nemo_rl({"policy": {"optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-6}}}})
        'policy.optimizer.kwargs'
        >>> looks_like_nemo_rl({"policy": {"optimizer": {"lr": 1e-6}}}) is None
        True
    """
    from grpo.config import EnvConfig

    policy = raw.get("policy") if isinstance(raw.get("policy"), dict) else {}
    data = raw.get("data") if isinstance(raw.get("data"), dict) else {}
    env = raw.get("env") if isinstance(raw.get("env"), dict) else {}
    for key in ("dtensor_cfg", "megatron_cfg"):
        if key in policy:
            return f"policy.{key}"
    if isinstance(policy.get("optimizer"), dict) and "kwargs" in policy["optimizer"]:
        return "policy.optimizer.kwargs"
    if isinstance(policy.get("scheduler"), list):
        return "policy.scheduler (a list)"
    for key in ("train", "validation", "default"):
        if key in data:
            return f"data.{key}"
    for key, value in env.items():
        if isinstance(value, dict) and key not in EnvConfig.model_fields:
            return f"env.{key}"
    return _interpolation(raw, "")


def _interpolation(node, key: str) -> str | None:
    if isinstance(node, dict):
        for k, v in node.items():
            if k in FREE_TEXT_KEYS:
                continue
            found = _interpolation(v, f"{key}.{k}" if key else str(k))
            if found:
                return found
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found = _interpolation(v, f"{key}[{i}]")
            if found:
                return found
    elif isinstance(node, str) and "${" in node and "}" in node:
        return f"{key}: {node}"
    return None


def is_nemo_rl_recipe(path: str | os.PathLike | None) -> bool:
    """Whether the recipe at ``path`` (its ``defaults:`` chain merged) is NeMo-RL's format. A file that does not
    load is not (the native loader then reports why)."""
    if path is None:
        return False
    try:
        return looks_like_nemo_rl(load_yaml(path)) is not None
    except (ConfigError, RecursionError):
        return False


# --------------------------------------------------------------------------------------------------
# NeMo-RL's loading: defaults, overrides, interpolation
# --------------------------------------------------------------------------------------------------
def register_resolvers() -> None:
    """NeMo-RL's OmegaConf resolvers (``nemo_rl.utils.config.register_omegaconf_resolvers``)."""
    import warnings

    from omegaconf import OmegaConf

    warnings.filterwarnings("ignore", message="register_new_resolver", category=UserWarning)  # omegaconf 2.4
    for name, fn in (("add", lambda a, b: a + b), ("mul", lambda a, b: a * b), ("div", lambda a, b: a / b),
                     ("max", lambda a, b: max(a, b))):
        OmegaConf.register_new_resolver(name, _bounded(name, fn), replace=True)


class _TooLarge(ValueError):
    pass


def _bounded(name: str, fn):
    """NeMo-RL's resolver ``fn`` (``${name:a,b}``), refusing before computing a result past
    `MAX_RESOLVED_INT_BITS` (integers) or `MAX_RESOLVED_LEN` items (strings, lists), so interpolation work stays small.

    >>> _bounded("mul", lambda a, b: a * b)(2 ** 200, 2 ** 100)
    Traceback (most recent call last):
    ...
    grpo.config.nemo_rl.recipe._TooLarge: ${mul:...} would make an integer of about 302 bits (more than 256): no config value is that large
    """
    def size(v) -> tuple[str, int]:
        if isinstance(v, bool) or v is None:
            return "other", 0
        if isinstance(v, int):
            return "int", v.bit_length()
        if isinstance(v, (str, list, tuple)):
            return "seq", len(v)
        return "other", 0

    def run(a, b):
        (ka, sa), (kb, sb) = size(a), size(b)
        if ka == kb == "int":
            bits = sa + sb if name == "mul" else max(sa, sb) + 1
            if bits > MAX_RESOLVED_INT_BITS:
                raise _TooLarge(f"${{{name}:...}} would make an integer of about {bits} bits (more than "
                                f"{MAX_RESOLVED_INT_BITS}): no config value is that large")
        elif "seq" in (ka, kb):
            n = sa * (b if kb == "int" else a if ka == "int" else 1) if name == "mul" else sa + sb
            if n > MAX_RESOLVED_LEN:
                raise _TooLarge(f"${{{name}:...}} would make a value of {n:,} items (more than {MAX_RESOLVED_LEN:,})")
        return fn(a, b)

    return run


def _merge(base, over):
    """NeMo-RL's ``merge_with_override``: OmegaConf.merge, except that a section holding ``_override_: true``
    replaces the base's section; ``???`` (mandatory) values of ``over`` leave the base's value."""
    from omegaconf import DictConfig, OmegaConf

    for key in list(over.keys()):
        if OmegaConf.is_missing(over, key):
            continue
        if isinstance(over[key], DictConfig) and over[key].get("_override_", False):
            over[key].pop("_override_")
            if key in base:
                base.pop(key)
    return OmegaConf.merge(base, over)


def load_unresolved(path: str | os.PathLike, _seen: tuple = ()):
    """The recipe at ``path`` with its ``defaults:`` merged (NeMo-RL's ``load_config_with_inheritance``), not
    yet interpolated. Its YAML is read through grpo-ds's bounded reader (size, depth and alias limits)."""
    from omegaconf import DictConfig, OmegaConf

    named, path = recipe_paths(path)
    if path in _seen:
        raise ConfigError(f"defaults: recipe inheritance loops through {path}")
    raw = _read_one(named)
    parents = defaults_entries(path, raw.pop("defaults", None))
    with omegaconf_errors(str(path)):
        cfg = OmegaConf.create(raw)
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    if not parents:
        return cfg
    base = OmegaConf.create({})
    for parent in parents:
        parent_cfg = load_unresolved(parent_recipe(path, parent), _seen + (path,))
        with omegaconf_errors(f"{path}: defaults: {parent}"):
            base = _merge(base, parent_cfg)
    with omegaconf_errors(str(path)):
        return _merge(base, cfg)


@contextmanager
def omegaconf_errors(where: str):
    """Any failure of OmegaConf inside the block (a null or non-string key, a bad merge, a grammar error, an
    interpolation too deep for Python's stack) as one `ConfigError` naming ``where`` and OmegaConf's key."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        yield
    except ConfigError:
        raise
    except (OmegaConfBaseException, RecursionError, ValueError, TypeError, KeyError) as err:
        key = getattr(err, "full_key", None)
        text = str(err).splitlines()[0] if str(err) else ""
        raise ConfigError(f"{where}{f': {key}' if key else ''}: {type(err).__name__}: {text[:300]}") from None


def _read_one(path: Path) -> dict:
    """One recipe file (no defaults merged), through grpo.config.load's checks (missing, empty, not UTF-8, ...)."""
    from grpo.config.load import bounded_yaml, yaml_error, read_config_text

    text = read_config_text(path)
    try:
        bounded_yaml(text, str(path))  # the limits; then OmegaConf's YAML reading (1e-8 is a float there)
        raw = _omegaconf_yaml(text)
    except yaml.YAMLError as err:
        raise ConfigError(yaml_error(str(path), err, text)) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    if (null := null_key_error(raw, str(path))) is not None:  # OmegaConf's words: "Incompatible key type 'NoneType'"
        raise ConfigError(null)
    return raw


def _omegaconf_yaml(text: str):
    """YAML as OmegaConf (so NeMo-RL) reads it: ``1e-8`` is a float, duplicate keys are an error."""
    try:  # a private helper of OmegaConf: _yaml since 2.4, _utils before
        from omegaconf._yaml import get_yaml_loader
    except ImportError:
        from omegaconf._utils import get_yaml_loader

    return yaml.load(text, Loader=get_yaml_loader())


def apply_overrides(cfg, overrides: list[str]):
    """Hydra-style overrides in NeMo-RL's key names on the merged, unresolved recipe (so interpolations follow
    them): ``key=value`` changes a key the recipe has (hydra's struct mode: a misspelt key fails), ``+key=value``
    adds a new one, ``++key=value`` sets either way. Values are YAML (``8``, ``null``, ``[1,2]``, ``{a: 1}``,
    ``${policy.model_name}``); a mapping merges into the section it replaces, as in hydra. ``~key`` deletes a key
    (or a whole section) the recipe has, ``~key=value`` only while it holds that value (`delete_key`)."""
    problems = []
    for item in overrides:  # every bad override is reported, one line each
        try:
            if item.startswith("~"):
                delete_key(cfg, item)
            else:
                _apply_override(cfg, item)
        except ConfigError as err:
            problems.append(str(err))
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError("overrides that cannot apply:\n  " + "\n  ".join(problems))
    return cfg


def _apply_override(cfg, item: str) -> None:
    """One ``key=value`` / ``+key=value`` / ``++key=value`` override (`apply_overrides`)."""
    from omegaconf import OmegaConf

    key, sep, text = item.partition("=")
    if not sep:
        raise ConfigError(f"override {item!r}: expected key=value, +key=value, ++key=value or ~key")
    force, add = key.startswith("++"), key.startswith("+") and not key.startswith("++")
    key = key.lstrip("+").strip()
    try:
        value = _omegaconf_yaml(text) if text != "" else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override {key}={text!r}: invalid YAML ({err})") from None
    if (null := null_key_error(value, "override", key)) is not None:
        raise ConfigError(null)
    with omegaconf_errors(f"override {key}"):
        exists = _has_key(cfg, key)
    if add and exists:
        raise ConfigError(f"override +{key}: the recipe already has {key} (hydra: drop the + to change it, or "
                          f"use ++{key}=...)")
    if not (force or add or exists):
        raise ConfigError(f"override {key}: the recipe has no such key (hydra's struct mode); check the "
                          f"spelling, or add it with +{key}={text}")
    try:
        OmegaConf.update(cfg, key, value, merge=True, force_add=True)
    except Exception:  # a list over a mapping (or the reverse) replaces it
        try:
            OmegaConf.update(cfg, key, value, merge=False, force_add=True)
        except Exception as err:  # an override through a value that is not a section
            raise ConfigError(f"override {key}: {str(err).splitlines()[0]}") from None


def delete_key(cfg, item: str) -> None:
    """Hydra's delete override on the unresolved recipe: ``~key`` removes ``key`` (a leaf or a section) and
    ``~key=value`` removes it only if it holds ``value`` (as written in the recipe, before interpolation). A key the
    recipe does not have, or holding another value, is a `ConfigError` naming it (hydra's rule too)."""
    from omegaconf import OmegaConf

    key, sep, text = item[1:].partition("=")
    key = key.strip()
    with omegaconf_errors(f"override ~{key}"):
        exists = bool(key) and _has_key(cfg, key)
    if not exists:
        raise ConfigError(f"override ~{key}: the recipe has no such key to delete; check the spelling (the recipe's "
                          "keys after its defaults are merged)")
    *parents, last = key.split(".")
    parent = OmegaConf.select(cfg, ".".join(parents), throw_on_resolution_failure=False) if parents else cfg
    if sep:
        try:
            expected = _omegaconf_yaml(text) if text != "" else None
        except yaml.YAMLError as err:
            raise ConfigError(f"override ~{key}={text!r}: invalid YAML ({err})") from None
        node = parent._get_node(int(last) if OmegaConf.is_list(parent) else last)
        held = OmegaConf.to_container(node, resolve=False) if OmegaConf.is_config(node) else node._value()
        if held != expected:
            raise ConfigError(f"override ~{key}={text}: the recipe's {key} is {held!r}, not {expected!r}; nothing "
                              f"deleted (~{key} deletes it whatever it holds)")
    del parent[int(last) if OmegaConf.is_list(parent) else last]


def _has_key(cfg, key: str) -> bool:
    """Whether the unresolved recipe has the dotted ``key``, without resolving any value on the way (a key whose
    value is ``${mul:...}`` exists before the resolvers are registered, as in hydra)."""
    from omegaconf import OmegaConf

    node = cfg
    for part in key.split("."):
        if OmegaConf.is_dict(node):
            node = node._get_node(part, throw_on_missing_key=False)
        elif OmegaConf.is_list(node) and part.lstrip("-").isdigit() and -len(node) <= int(part) < len(node):
            node = node._get_node(int(part))
        else:
            return False
        if node is None:
            return False
    return True


def resolve(cfg) -> dict:
    """Interpolate (``${a.b}``, ``${.sibling}``, ``${mul:x,y}``) into a plain dict; a failure names the key."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    register_resolvers()
    count = _count_interpolations(OmegaConf.to_container(cfg, resolve=False))
    if count > MAX_INTERPOLATIONS:
        raise ConfigError(f"the recipe holds {count:,} interpolations (${{...}}), more than {MAX_INTERPOLATIONS:,}: "
                          "resolving them would take long; a recipe holds a few dozen")
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except RecursionError:
        raise ConfigError("interpolation nested too deep to resolve (${a} naming ${b} naming ... thousands deep); "
                          "a recipe's interpolations are a few levels deep") from None
    except (OmegaConfBaseException, ValueError, TypeError) as err:
        key = getattr(err, "full_key", None) or "?"
        msg = str(err).splitlines()[0] if str(err) else ""
        too_large = f"{_TooLarge.__name__} raised while resolving interpolation: "
        if too_large in msg:  # OmegaConf wraps a resolver's error into its own message
            raise ConfigError(f"{key}: cannot interpolate: {msg.split(too_large, 1)[1]}") from None
        hint = " (set it in the environment, as NeMo-RL needs it too)" if "Environment variable" in msg else ""
        raise ConfigError(f"{key}: cannot interpolate ({type(err).__name__}: {msg}){hint}") from None


def _count_interpolations(node) -> int:
    """How many ``${`` the unresolved values under ``node`` hold (nested ones too).

    >>> _count_interpolations({"a": "${mul:${b},2}", "b": [1, "${c}"]})
    3
    """
    if isinstance(node, dict):
        return sum(_count_interpolations(v) for v in node.values())
    if isinstance(node, list):
        return sum(_count_interpolations(v) for v in node)
    return node.count("${") if isinstance(node, str) else 0


def load_nemo_rl(path: str | os.PathLike, overrides: list[str] | None = None) -> dict:
    """The recipe at ``path`` as NeMo-RL reads it: defaults merged, overrides applied, interpolated."""
    return resolve(apply_overrides(load_unresolved(path), list(overrides or [])))


# --------------------------------------------------------------------------------------------------
# Translation
# --------------------------------------------------------------------------------------------------
def load_recipe(path: str | os.PathLike, overrides: list[str] | None = None,
                config_cls: type[MasterConfig] = MasterConfig) -> tuple[MasterConfig, list[tuple[str, str, str]]]:
    """A NeMo-RL recipe (+ overrides in NeMo-RL's key names) as a validated grpo-ds config, and the table of
    what was translated and ignored: ``[(kind, dotted key, why)]`` with kind "translated" or "ignored".

    A recipe with keys grpo-ds refuses is still validated (what its other keys translate to), so the `ConfigError`
    lists every problem of one run: each refused key, then each error of the translated config."""
    from grpo.config.nemo_rl.rules import Refused, translate

    try:
        raw, table = translate(load_nemo_rl(path, overrides), base_dir=Path(path).resolve().parent)
    except Refused as refused:
        raise Refused(refused.errors + _config_errors(refused.out, config_cls), refused.out) from None
    return build_config(raw, config_cls), table


def _config_errors(raw: dict, config_cls: type[MasterConfig]) -> list[str]:
    """The lines of `build_config`'s error for ``raw`` (one problem each), or none when it is valid."""
    try:
        build_config(raw, config_cls)
    except ConfigError as err:
        return [line.strip() for line in str(err).splitlines()[1:] if line.strip()]
    return []


def format_table(table: list[tuple[str, str, str]]) -> str:
    """One line per entry: ``ignored: <dotted key>: <why>`` / ``translated: <dotted key>: <what it became>``."""
    order = {"translated": 0, "ignored": 1}
    return "\n".join(f"{kind}: {key}: {why}" for kind, key, why in sorted(table, key=lambda r: order[r[0]]))


def dump_config(cfg: MasterConfig) -> str:
    """The grpo-ds config as YAML (what ``--check-config`` prints; it loads back as a native config)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=False, width=120)
