"""The house, as a ratchet: one-way arrows between packages, no circles, small files.

Every import of every module of ``planner`` and ``runtime`` is read from the
source (those inside functions and under ``TYPE_CHECKING`` too), so a lazy
import does not hide an arrow. The rules are those of ``shared/DESIGN.md``
(section "Layout"), with the allowances written below.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import networkx as nx
import pytest
from repo import ROOT

PACKAGES = ("planner", "runtime")

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80

# What each part of the planner may import, besides itself (None: anything). The flow of
# DESIGN.md: the plan is the contract and imports nothing else; the solver is pure numbers;
# the cost model prices, the search searches, the report renders.
ALLOWED: dict[str, set[str] | None] = {
    "planner.plan": set(),
    "planner.cache": {"planner.plan"},  # the one atomic write
    "planner.solve": set(),
    "planner.options": {"planner.plan", "planner.solve"},  # the solver names, to check them
    "planner.devices": {"planner.plan", "planner.cache"},
    "planner.capture": {"planner.plan"},
    "planner.profile": {
        "planner.plan",
        "planner.cache",
        "planner.capture",
        "planner.devices",
        "planner.options",
    },
    "planner.cost": {"planner.plan", "planner.devices", "planner.options"},
    "planner.search": {
        "planner.plan",
        "planner.devices",
        "planner.options",
        "planner.cost",
        "planner.solve",
    },
    "planner.report": {"planner.plan", "planner.devices", "planner.cost"},
    # fit the cost model to a run, keep the fit, plan again (the run is passed in by the CLI)
    "planner.calibrate": {
        "planner.plan",
        "planner.cache",
        "planner.cost",
        "planner.devices",
        "planner.options",
        "planner.profile",
        "planner.planning",
    },
    "planner.planning": None,  # sizes -> profiles -> search -> Plan: every part of the planner
    "planner.auto": None,  # the one module of the planner that imports the runtime ...
    "planner.cli": None,  # ... and the command line, for `planner run`
    "planner": set(),  # the package's lazy names are strings
    "planner.__main__": {"planner.cli"},
}
# The runtime imports the contract, nothing else of the planner.
RUNTIME_MAY_IMPORT = "planner.plan"
# Only these modules of the planner may import the runtime.
IMPORTS_RUNTIME = {"planner.auto", "planner.cli"}
# Pure parts: importing any of their modules loads no torch (and the cost model no PuLP).
NO_TORCH = ("planner.cost", "planner.search", "planner.solve", "planner.report", "planner.devices")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the module imported (the longest project module the name resolves to)
    names: tuple[str, ...]  # the names imported from it (from-imports)
    line: int


@cache
def modules() -> dict[str, Path]:
    """Every module of the packages: dotted name -> file."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(name: str) -> str | None:
    """The project module ``name`` (a module, or a name inside one) belongs to."""
    mods = modules()
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> Iterator[Import]:
    path = modules()[module]
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name)
                if target is not None and alias.name.split(".")[0] in PACKAGES:
                    yield Import(module, target, (), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            if source.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                target = _resolve(f"{source}.{alias.name}") or source
                yield Import(module, target, (alias.name,), node.lineno)


@cache
def graph() -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(modules())
    for module in modules():
        for imp in imports_of(module):
            if imp.target != module:
                g.add_edge(module, imp.target, line=imp.line)
    return g


def _part(module: str) -> str:
    """The part of the house a module belongs to (its entry in ALLOWED)."""
    for name in sorted(ALLOWED, key=len, reverse=True):
        if module == name or module.startswith(name + "."):
            return name
    raise AssertionError(f"{module} belongs to no part of the house: add it to ALLOWED")


def test_no_import_circles() -> None:
    circles = sorted(nx.simple_cycles(graph()), key=len)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles[:10])


def test_every_arrow_runs_the_way_the_design_says() -> None:
    bad = []
    for a, b, data in graph().edges(data=True):
        where = f"{modules()[a].relative_to(ROOT)}:{data['line']}: {a} imports {b}"
        if a.startswith("runtime"):
            if b.startswith("planner") and _part(b) != RUNTIME_MAY_IMPORT:
                bad.append(f"{where} (the runtime imports only {RUNTIME_MAY_IMPORT})")
            continue
        if b.startswith("runtime"):
            if a not in IMPORTS_RUNTIME:
                bad.append(f"{where} (only {sorted(IMPORTS_RUNTIME)} import the runtime)")
            continue
        allowed = ALLOWED[_part(a)]
        if allowed is not None and _part(b) != _part(a) and _part(b) not in allowed:
            bad.append(f"{where} ({_part(a)} may import only {sorted(allowed)})")
    assert not bad, "arrows the design forbids:\n" + "\n".join(bad)


def test_no_private_name_is_imported_from_another_module() -> None:
    bad = [
        f"{modules()[imp.module].relative_to(ROOT)}:{imp.line}: {name} from {imp.target}"
        for module in modules()
        for imp in imports_of(module)
        for name in imp.names
        if name.startswith("_") and not name.startswith("__") and imp.target != module
    ]
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_every_module_says_what_it_exports() -> None:
    missing = []
    for module, path in modules().items():
        tree = ast.parse(path.read_text())
        targets = [
            t.id
            for node in tree.body
            if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Name)
        ]
        if "__all__" not in targets:
            missing.append(module)
    assert not missing, f"modules without __all__: {missing}"


def _python_files() -> Iterator[Path]:
    for folder in (*PACKAGES, "tests"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_no_file_is_over_the_limit() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in _python_files()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, f"files over {MAX_FILE_LINES} lines (split them by concept): {long}"


def test_no_function_is_over_the_limit() -> None:
    long = {}
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{module}.{node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def _modules_of(part: str) -> list[str]:
    return [m for m in modules() if m == part or m.startswith(part + ".")]


def _loaded_after_importing(names: list[str]) -> set[str]:
    """Top-level packages loaded by importing the modules ``names``, in a fresh process."""
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


@pytest.mark.parametrize("part", NO_TORCH)
def test_pure_parts_load_no_torch(part: str) -> None:
    assert "torch" not in _loaded_after_importing(_modules_of(part))


def test_the_cost_model_loads_no_pulp() -> None:
    assert "pulp" not in _loaded_after_importing(_modules_of("planner.cost"))


def test_the_plan_package_loads_no_torch_by_itself() -> None:
    pure = ["planner.plan", "planner.plan.schema", "planner.plan.files", "planner.plan.fields"]
    assert "torch" not in _loaded_after_importing(pure)
