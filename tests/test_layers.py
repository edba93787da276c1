"""The package's layers, as docs/architecture.md draws them: imports run one way, top to
bottom, with no cycle; only the cuDNN backend and the frontend integration import cuDNN;
and the package root holds the public names only.

The import graph is read from the source: every ``import`` statement, at module level,
inside a function or under ``if TYPE_CHECKING:``. A lazy import that runs back up is
caught as well as an eager one, and so is an import made only for type hints: two modules
that name each other's classes are one module in two files, whether or not the import runs.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "plancache"

#: Top to bottom. A module may import its own layer and the layers below it, never one
#: above. ``testing`` and ``cudnn`` are the two backends, over autotuning (the candidate
#: plumbing written once) and the guest (the seam, the driver and what runs over it).
LAYERS = ("__main__", "cli", "workflows", "integrations", "cache", "runtime", "tiers", "testing", "cudnn", "autotuning",
          "guest", "store", "key", "formats", "config", "errors")  # fmt: skip

#: What the package root holds: the public names, and a folder per layer.
ROOT_MODULES = {"__init__.py", "__main__.py", "config.py", "errors.py"}
ROOT_FOLDERS = {"autotuning", "cache", "cli", "cudnn", "formats", "guest", "integrations", "key", "runtime", "store", "testing", "tiers",
                "workflows"}  # fmt: skip

#: Modules that import cuDNN (lazily: none at module level).
CUDNN_IMPORTERS = ("cudnn.backend", "integrations.")


def _modules() -> dict[str, Path]:
    """Dotted module names (below ``plancache``; ``""`` for the package root) -> file."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(module: str) -> Iterator[tuple[str, str, int]]:
    """(imported module below ``plancache`` or an outside name, the names taken, line) for
    every import statement of ``module``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.name
                yield (name.removeprefix("plancache.") if name.startswith("plancache.") else f"<outside>{name}"), "", node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module == "plancache" or (node.module or "").startswith("plancache."):
                target = (node.module or "").removeprefix("plancache").removeprefix(".")
            else:
                target = f"<outside>{node.module}"
            for alias in node.names:
                # ``from . import x`` where x is a module imports that module
                sub = f"{target}.{alias.name}" if target else alias.name
                yield (sub if sub in MODULES else target), alias.name, node.lineno


def _layer(module: str) -> str:
    return module.split(".")[0]


def _edges() -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (for type hints too)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module in MODULES:
        for target, _, _ in _imports(module):
            if target in MODULES and target != module:
                graph[module].add(target)
    return graph


def test_every_layer_is_in_the_order() -> None:
    layers = {_layer(m) for m in MODULES if m}
    assert layers == set(LAYERS), f"layers missing from LAYERS, or gone: {sorted(layers ^ set(LAYERS))}"


def test_imports_run_down_the_layers() -> None:
    upward = []
    for module in MODULES:
        if not module:  # the package root hands names on from every layer
            continue
        rank = LAYERS.index(_layer(module))
        for target, name, line in _imports(module):
            if target.startswith("<outside>") or target not in MODULES:
                continue
            if not target:  # the package root is above every layer; it only lends its version
                if name != "__version__":
                    upward.append(f"plancache.{module}:{line} imports {name} from the package root")
                continue
            if LAYERS.index(_layer(target)) < rank:
                upward.append(f"plancache.{module}:{line} imports plancache.{target} (a higher layer)")
    assert not upward, "imports that run back up:\n" + "\n".join(upward)


def test_imports_have_no_cycle() -> None:
    graph = _edges()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, path)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(f"plancache.{m}" for m in c) for c in cycles)


def test_only_the_backend_and_the_frontend_integration_import_cudnn() -> None:
    found = []
    for module in MODULES:
        for target, _, line in _imports(module):
            if not target.startswith("<outside>"):  # plancache.cudnn is the package's own folder
                continue
            outside = target.removeprefix("<outside>")
            if outside == "cudnn" or outside.startswith("cudnn."):
                found.append((module, line))
    strays = [f"plancache.{m}:{line}" for m, line in found if not m.startswith(CUDNN_IMPORTERS)]
    assert not strays, f"cuDNN imported outside cudnn/backend.py and integrations/: {strays}"
    assert any(m == "cudnn.backend" for m, _ in found)


def test_no_module_imports_torch_or_cudnn_at_import() -> None:
    """Module-level imports only: what every ``import plancache.X`` costs."""
    eager = []
    for module, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            eager += [f"plancache.{module}: {n}" for n in names if n.split(".")[0] in ("torch", "cudnn")]
    assert not eager, eager


def test_the_package_root_holds_the_public_names_only() -> None:
    modules = {p.name for p in PACKAGE.glob("*.py")}
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert modules == ROOT_MODULES, f"modules at the root beside the public ones: {sorted(modules - ROOT_MODULES)}"
    assert folders == ROOT_FOLDERS, f"folders at the root: {sorted(folders ^ ROOT_FOLDERS)}"


def test_sqlite_utils_is_imported_by_the_sql_command_only() -> None:
    """sqlite-utils serves ``plancache sql``: neither the library nor the other commands pay
    for importing it (once 91 of the command's 137 ms at start-up)."""
    found = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        inside_sql = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "sql" for n in ast.walk(f)}
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(
                node, ast.ImportFrom) else []  # fmt: skip
            if any(n.split(".")[0] == "sqlite_utils" for n in names):
                found.append((module, id(node) in inside_sql))
    assert found == [("cli.sql", True)], found
