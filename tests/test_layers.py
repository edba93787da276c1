"""The package's layers, as docs/architecture.md draws them: imports run one way, top to
bottom, with no cycle; only the cuDNN backend and the frontend integration import cuDNN;
and the package root holds the public names only.

import-linter checks the contracts of pyproject.toml's ``[tool.importlinter]``: the layers
(every folder and root module in its place), no cycle between the modules or folders of a
folder, who imports cuDNN Frontend and who sqlite-utils. Its graph (grimp's) holds every
``import`` statement: at module level, inside a function or under ``if TYPE_CHECKING:``. A
lazy import that runs back up is caught as well as an eager one, and so is an import made
only for type hints: two modules that name each other's classes are one module in two files,
whether or not the import runs. The rules import-linter has no contract for are checked
here, on the same graph or on the source, each test saying why.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import grimp
import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "plancache"
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]

#: The modules at the package root: the public names. Every other child is a folder.
ROOT_MODULES = {"__init__.py", "__main__.py", "config.py", "errors.py"}

#: Runs import-linter as ``lint-imports --no-cache`` does, without its logo. Out of this
#: process: it configures logging for the whole process (existing loggers turned off).
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"


@cache
def _graph() -> grimp.ImportGraph:
    """The package's import graph, as import-linter builds it (type-hint imports included)."""
    return grimp.build_graph("plancache", cache_dir=None)


def test_the_import_contracts_are_kept() -> None:
    assert CONFIG["exclude_type_checking_imports"] is False  # an import for type hints counts
    run = subprocess.run([sys.executable, "-c", LINT_IMPORTS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    if run.returncode:
        pytest.fail(f"import-linter: contracts broken (exit {run.returncode}):\n{run.stdout}{run.stderr}", pytrace=False)


def test_no_folder_is_in_a_cycle_with_its_own_modules() -> None:
    """import-linter's ``acyclic_siblings`` contract looks for cycles between the children of
    each folder, each child with all that is under it. A cycle through a folder's own
    ``__init__.py`` and a module under it (``cache/__init__.py`` imports ``cache.cache``, which
    takes a name from ``.``) has no two children in it, so the contract passes it. With the
    contract, no cycle is left unchecked: the modules of any cycle lie under one folder, the
    deepest such, and either that folder's ``__init__.py`` is in the cycle (here) or two of
    its children are (the contract)."""
    graph = _graph()
    cycles = []
    for package in sorted(m for m in graph.modules if graph.find_children(m)):
        for module in sorted(graph.find_modules_directly_imported_by(package)):
            if module.startswith(f"{package}.") and graph.chain_exists(importer=module, imported=package):
                cycles.append(" -> ".join([package, *graph.find_shortest_chain(importer=module, imported=package)]))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_a_module_takes_the_version_only_from_the_package_root() -> None:
    """The package root hands names on from every layer, so it is above them all: a module
    imports it for ``__version__`` only. import-linter's contracts say which module may import
    which, never which names: this one reads the names off grimp's graph."""
    graph = _graph()
    takes = [f"{d['importer']}:{d['line_number']}: {d['line_contents']}" for importer in sorted(graph.find_modules_that_directly_import("plancache"))
             for d in graph.get_import_details(importer=importer, imported="plancache")]  # fmt: skip
    strays = [line for line in takes if not re.search(r": from (\.+|plancache) import __version__(\s*#.*)?$", line)]
    assert not strays, f"imports from the package root other than its __version__: {strays}"


def test_no_module_imports_torch_or_cudnn_at_import() -> None:
    """Module-level imports only: what every ``import plancache.X`` costs. import-linter's
    graph holds one import however many statements make it, and not where they stand."""
    eager = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            eager += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in ("torch", "cudnn")]
    assert not eager, eager


def test_sqlite_utils_is_imported_inside_the_sql_command() -> None:
    """sqlite-utils serves ``plancache sql``: neither the library nor the other commands pay
    for importing it (once 91 of the command's 137 ms at start-up). The ``sqlite-utils``
    contract keeps it to ``cli/sql.py``; import-linter cannot say where in the module, so this
    test keeps it inside the command's function."""
    tree = ast.parse((PACKAGE / "cli" / "sql.py").read_text())
    inside_sql = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "sql" for n in ast.walk(f)}
    found = []
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(
            node, ast.ImportFrom) else []  # fmt: skip
        found += [id(node) in inside_sql for n in names if n.split(".")[0] == "sqlite_utils"]
    assert found and all(found), found


def test_the_package_root_holds_the_public_names_only() -> None:
    """The layers contract puts every child of the root in a layer, a module or a folder
    alike; import-linter has no rule on files. This test keeps the root's modules to the
    public ones, and every other layer a folder."""
    (layers,) = [c["layers"] for c in CONFIG["contracts"] if c["type"] == "layers"]
    modules = {p.name for p in PACKAGE.glob("*.py")}
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert modules == ROOT_MODULES, f"modules at the root beside the public ones: {sorted(modules - ROOT_MODULES)}"
    assert folders == set(layers) - {m.removesuffix(".py") for m in ROOT_MODULES}, f"folders at the root: {sorted(folders)}"
