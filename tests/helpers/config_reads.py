"""Which config fields the code reads, by dotted path (`tests/unit/test_config_used.py`).

A field counts as read where an attribute chain of the code denotes its whole dotted path: ``cfg.grpo.seed``
reads ``grpo.seed``; so does ``g.seed`` after ``g = cfg.grpo``, or ``lora.dim`` in a function whose parameter is
``lora: LoraConfig`` (or plainly named ``lora``). A chain's root is resolved, within its function or class, by

- names of the whole config: ``cfg``, ``config``, ``master_cfg``, ``master_config``, and ``.cfg`` / ``.config``
  attributes, or an annotation ``MasterConfig``;
- assignments of a resolved chain to a name (``g = run.cfg.grpo``) or to ``self.x`` (seen by the class's methods);
- annotations naming a section's model (``cfg: LoggerConfig`` reads ``logger.*``; a model used in several places
  reads all of them);
- names equal to a section's own name, or to it with ``_cfg`` / ``_config`` / ``_spec`` (``lora``, ``vllm_cfg``,
  ``env_spec``);
- ``getattr(x, "name")`` with a resolved ``x``.

Matching by the last name part alone (the test before this one) counted ``enabled`` as read for every one of
the ten sections that have it as soon as one was read anywhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

from pydantic import BaseModel

from grpo.config import MasterConfig
from grpo.config.load import section_model

ROOT_NAMES = frozenset({"cfg", "config", "master_cfg", "master_config"})


def section_paths(model=MasterConfig) -> dict[str, set[str]]:
    """Model class name -> the dotted paths of the sections it is (its base models too, so ``EnvSpec`` names
    ``env``); the root is ``""``."""
    out: dict[str, set[str]] = {}

    def walk(m, path: str) -> None:
        for cls in m.__mro__:  # the model and its base models that declare fields (EnvConfig -> EnvSpec)
            if cls is m or (issubclass(cls, BaseModel) and cls.__name__ != "_Section" and cls is not BaseModel):
                out.setdefault(cls.__name__, set()).add(path)
        for name, f in m.model_fields.items():
            sub = section_model(f.annotation)
            if sub is not None:
                walk(sub, f"{path}.{name}".lstrip("."))

    walk(model, "")
    return out


class _Reads(ast.NodeVisitor):
    """The dotted paths (sections and fields) that one module's attribute chains denote."""

    def __init__(self, classes: dict[str, set[str]]):
        self.classes = classes
        self.sections = {p for ps in classes.values() for p in ps}
        self.by_name: dict[str, set[str]] = {}
        for p in self.sections - {""}:
            self.by_name.setdefault(p.rsplit(".", 1)[-1], set()).add(p)
        self.reads: set[str] = set()
        self.scopes: list[dict[str, set[str]]] = [{}]

    # -- what a name or an annotation denotes --------------------------------------------------------
    def _named(self, name: str) -> set[str]:
        if name in ROOT_NAMES:
            return {""}
        for suffix in ("_cfg", "_config", "_spec"):
            if name.endswith(suffix) and name[: -len(suffix)] in self.by_name:
                return set(self.by_name[name[: -len(suffix)]])
        return set(self.by_name.get(name, ()))

    def _annotation(self, ann) -> set[str]:
        if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
            try:
                ann = ast.parse(ann.value, mode="eval").body
            except SyntaxError:
                return set()
        if isinstance(ann, ast.BinOp):  # X | None
            return self._annotation(ann.left) | self._annotation(ann.right)
        if isinstance(ann, ast.Subscript):  # Optional[X]
            return self._annotation(ann.slice)
        name = ann.id if isinstance(ann, ast.Name) else ann.attr if isinstance(ann, ast.Attribute) else None
        return set(self.classes.get(name, ())) if name else set()

    def _lookup(self, key: str) -> set[str] | None:
        for scope in reversed(self.scopes):
            if key in scope:
                return scope[key]
        return None

    def resolve(self, node) -> set[str]:
        """The dotted paths ``node`` may denote (empty: none known)."""
        if isinstance(node, ast.Name):
            found = self._lookup(node.id)
            return found if found is not None else self._named(node.id)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                found = self._lookup("self." + node.attr)
                if found is not None:
                    return found
                return {""} if node.attr in ROOT_NAMES else self._named(node.attr)
            out = {f"{b}.{node.attr}".lstrip(".") for b in self.resolve(node.value)}
            if node.attr in ROOT_NAMES:
                out.add("")
            return out
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)):
            return {f"{b}.{node.args[1].value}".lstrip(".") for b in self.resolve(node.args[0])}
        return set()

    def _sections_of(self, node) -> set[str]:
        return {p for p in self.resolve(node) if p in self.sections}

    # -- scopes and aliases ---------------------------------------------------------------------------
    def visit_FunctionDef(self, node) -> None:
        scope = {}
        args = node.args
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            if a.annotation is not None and self._annotation(a.annotation):
                scope[a.arg] = self._annotation(a.annotation)
        self.scopes.append(scope)
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node) -> None:
        self.scopes.append({})
        self.generic_visit(node)
        self.scopes.pop()

    def _bind(self, target, paths: set[str]) -> None:
        if not paths:
            return
        if isinstance(target, ast.Name):
            self.scopes[-1][target.id] = paths
        elif (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
              and len(self.scopes) >= 3):
            self.scopes[-2]["self." + target.attr] = paths  # the enclosing class's scope: its methods see it

    def visit_Assign(self, node) -> None:
        for target in node.targets:
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                for t, v in zip(target.elts, node.value.elts):
                    self._bind(t, self._sections_of(v))
            else:
                self._bind(target, self._sections_of(node.value))
        self.generic_visit(node)

    def visit_AnnAssign(self, node) -> None:
        self._bind(node.target, self._annotation(node.annotation) or (
            self._sections_of(node.value) if node.value is not None else set()))
        self.generic_visit(node)

    def visit_Attribute(self, node) -> None:
        self.reads |= self.resolve(node)
        self.generic_visit(node)

    def visit_Call(self, node) -> None:
        self.reads |= self.resolve(node)
        self.generic_visit(node)


def dotted_reads(paths: list[Path], model=MasterConfig) -> set[str]:
    """Every dotted path (section or field) that an attribute chain of ``paths`` denotes."""
    classes = section_paths(model)
    out: set[str] = set()
    for path in paths:
        visitor = _Reads(classes)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        out |= visitor.reads
    return out
