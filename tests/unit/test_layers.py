"""The layer rule of `grpo/__init__.py`: imports run down, never up a layer, and never in a circle.

Reads the layer table from grpo's docstring and every module's imports from its source (ast; nothing is
imported): ``import`` / ``from ... import`` statements anywhere (inside functions too), ``importlib.import_module``
and ``__import__`` calls with a constant name, and string constants that are exactly a ``"grpo.module:name"``
spec (how the task catalogue and the estimator registry name what they load on first use). A spec counts for
the direction of imports, not for cycles: it is loaded when first called, never while its module imports
(the registry names `grpo.advantages`' estimators, which register more through it).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import grpo

ROOT = Path(grpo.__file__).resolve().parent
SPEC = re.compile(r"^(grpo(?:\.\w+)+):[\w.]+$")


def layer_table() -> list[tuple[str, list[str]]]:
    """``[(layer name, [module prefixes]), ...]`` from bottom to top, as grpo's docstring lists them."""
    rows = re.findall(r"^ {4}(\d+)\. (\w+) +(.+)$", grpo.__doc__, flags=re.M)
    assert [int(n) for n, _, _ in rows] == list(range(1, len(rows) + 1)), "the layer table must number 1..n"
    return [(name, prefixes.split()) for _, name, prefixes in rows]


def module_files() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported_names(path: Path, module: str, is_package: bool, specs: bool = True) -> set[str]:
    """Every dotted name ``module`` imports (resolved to absolute names; may name an attribute, not a module);
    ``specs``: with the modules of ``"grpo.module:name"`` strings."""
    package = module if is_package else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if fname in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
        elif specs and isinstance(node, ast.Constant) and isinstance(node.value, str) and SPEC.match(node.value):
            names.add(SPEC.match(node.value).group(1))
    return names


def import_graph(specs: bool = True) -> dict[str, set[str]]:
    """Module -> the grpo modules it imports (a name that is an attribute counts as its module)."""
    files = module_files()
    graph = {}
    for module, path in files.items():
        targets = set()
        for name in imported_names(path, module, path.name == "__init__.py", specs):
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != module and name != "grpo":
                targets.add(name)
        graph[module] = targets
    return graph


def layer_of(module: str, table) -> int | None:
    best = None  # (prefix length, layer index): the longest prefix wins
    for i, (_, prefixes) in enumerate(table):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), i)
    return None if best is None else best[1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    table = layer_table()
    assert [name for name, _ in table] == ["leaves", "tasks", "config", "algorithm", "system", "loading", "wings",
                                           "run", "tools"]
    missing = sorted(m for m in module_files() if m != "grpo" and layer_of(m, table) is None)
    assert not missing, f"modules in no layer of grpo/__init__.py's table: {missing}"


def test_folders_are_layers():
    """Every row names modules or folders that exist, and a folder (a package) is one layer: a folder below
    the root is named by a row, or all its modules share its parent folder's layer through the parent's prefix."""
    table = layer_table()
    files = module_files()
    stale = [p for _, prefixes in table for p in prefixes if p not in files]
    assert not stale, f"rows of grpo/__init__.py's table that name no module or folder: {stale}"
    folders = sorted(m for m, path in files.items() if path.name == "__init__.py" and m != "grpo")
    named = {p for _, prefixes in table for p in prefixes}
    for folder in folders:
        members = {layer_of(m, table) for m in files if m.startswith(folder + ".")}
        assert folder in named or members <= {layer_of(folder, table)}, (
            f"{folder}/ mixes layers {sorted(table[i][0] for i in members)} and no row of the table names it")


def test_no_import_runs_up_a_layer():
    table = layer_table()
    up = [f"{m} ({table[layer_of(m, table)][0]}) imports {t} ({table[layer_of(t, table)][0]})"
          for m, targets in sorted(import_graph().items()) if m != "grpo"
          for t in sorted(targets) if layer_of(t, table) > layer_of(m, table)]
    assert not up, "imports that run up a layer:\n" + "\n".join(up)


def test_no_core_module_imports_a_wing():
    """A wing (a folder of grpo.wings) plugs into the core's seams; nothing outside it names it: the run loads the
    wings through `grpo.wings.load` (the package), never one by name."""
    named = [f"{m} imports {t}" for m, targets in sorted(import_graph().items())
             if not m.startswith("grpo.wings.") for t in sorted(targets) if t.startswith("grpo.wings.")]
    assert not named, "core modules that import a wing:\n" + "\n".join(named)


def test_no_import_cycles():
    found = cycles(import_graph(specs=False))
    assert not found, f"import cycles: {found}"


def test_the_checks_see_what_they_must(tmp_path):
    """The parser sees imports in functions, importlib calls and specs; the checks catch a cycle and an up-import."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from grpo.system import engines\n    importlib.import_module('grpo.run.run')\n"
                   "    return 'grpo.tasks.math:math_reward', 'see grpo.loss:x for more'\n")
    assert imported_names(src, "grpo.m", False) == {"grpo.system.engines", "grpo.run.run", "grpo.tasks.math"}
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    table = layer_table()
    assert layer_of("grpo.step", table) < layer_of("grpo.system.engines", table) < layer_of("grpo.run.run", table)
    assert layer_of("grpo.config.policy", table) < layer_of("grpo.loss", table) < layer_of("grpo.config.load", table)
    assert layer_of("grpo.trajectory", table) < layer_of("grpo.tasks.pool", table) < layer_of("grpo.system.dist", table)
