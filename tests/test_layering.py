"""The package's one-way layering (docs/architecture.md): a module imports only from its own
layer or the layers below, no import cycle exists between weft's modules, and no import is
hidden inside a function or behind a module `__getattr__` to dodge one."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import weft

SRC = Path(weft.__file__).parent
# Lowest first. A unit is a subpackage of weft or one of its top-level modules.
LAYERS = [
    {"distributed", "launch", "jsonfile", "precision", "profiling", "graphs", "testing", "cliargs",
     "hostcopy"},  # base
    # primitives: collectives, kernels, deferred-dW ops, tuning dictionary, Pro-Prophet's planner
    {"comm", "kernels", "ops", "tune", "balance"},
    {"moe", "tp"},  # the MoE layer, tensor-parallel dense blocks
    {"models"},
    {"overlap"},  # optimisers of a model
    {"train"},
    {"bench"},
    {"cli", "__main__"},
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the package's own __init__ (public re-exports)


def _imports(path: Path, module: str) -> list[tuple[str, ast.stmt, bool]]:
    """(imported weft module, statement, at module level) for every import in the file."""
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                names = [".".join(base + ([node.module] if node.module else []))]
            else:
                names = [node.module or ""]
            # `from weft.x import y` imports the module weft.x.y when there is one.
            names = [f"{names[0]}.{a.name}" if f"{names[0]}.{a.name}" in MODULES else names[0] for a in node.names]
        found += [(n, node, id(node) in top) for n in names if n == "weft" or n.startswith("weft.")]
    return found


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in MODULES} - {None}
    assert units <= set(RANK), f"give these a layer in LAYERS: {sorted(units - set(RANK))}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_only_go_down(module):
    unit = _unit(module)
    for imported, node, _ in _imports(MODULES[module], module):
        target = _unit(imported)
        if unit is None or target is None or target == unit:
            continue
        assert RANK[target] <= RANK[unit] and (RANK[target] < RANK[unit] or target in LAYERS[RANK[unit]]), (
            f"{module} (layer {RANK[unit]}) imports {imported} (layer {RANK[target]}), line {node.lineno}")
        assert RANK[target] < RANK[unit] or _no_cycle_within_layer(unit, target), (
            f"{module} imports {imported}: units of one layer import each other")


def _no_cycle_within_layer(unit: str, target: str) -> bool:
    """Units of one layer may use each other only one way."""
    back = [m for m in MODULES if _unit(m) == target
            for imported, _, _ in _imports(MODULES[m], m) if _unit(imported) == unit]
    return not back


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_dodges(module):
    """weft imports sit at module level, and no module defines `__getattr__` to import lazily."""
    tree = ast.parse(MODULES[module].read_text())
    lazy = [f"line {node.lineno}: {imported}" for imported, node, top in _imports(MODULES[module], module) if not top
            and not _under_type_checking(tree, node)]
    assert not lazy, f"{module} imports inside a function: {lazy}"
    assert not any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body), (
        f"{module} defines a module __getattr__")


def _under_type_checking(tree: ast.Module, node: ast.stmt) -> bool:
    for block in tree.body:
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test):
            if any(child is node for child in ast.walk(block)):
                return True
    return False


def test_no_cycle_between_modules():
    """Depth-first search over the module-level import graph of weft's modules."""
    graph = {m: sorted({_resolve(i) for i, _, top in _imports(p, m) if top} - {m, None}) for m, p in MODULES.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in graph.get(m, []):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(n):] + [m, n]))
            if n not in state:
                visit(n, path + [m])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])


def _resolve(imported: str) -> str | None:
    """The weft module an import statement names (`from weft.x import y`: weft.x.y if that is a
    module, else weft.x)."""
    while imported and imported not in MODULES:
        imported = imported.rpartition(".")[0]
    return imported or None


def test_the_checks_catch_an_upward_import(tmp_path):
    """The rule itself: moe importing models would be reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("from weft.models.gpt import GPT\n")
    (imported, node, top), = _imports(bad, "weft.moe.bad")
    assert _unit(imported) == "models" and top and RANK["models"] > RANK["moe"]
