"""No dead code in the package: code nothing uses (vulture), a private name its module never
uses, or a name a module hands on from another (so that one thing has two homes).

vulture reads every file of the repository (the package, tests, scripts, examples, the
start-up hook and setup.py): a function, class, method, variable, attribute or import of the
package counts as used when any of them uses its name. What it cannot see used is listed in
``USED_UNSEEN`` with the reason; the two rules vulture has no check for are written here by
hand, on the source read with ``ast``, each test saying why.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import vulture

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "plancache"
#: What vulture reads: a name of the package counts as used when any of these uses it.
READ = ("plancache", "tests", "scripts", "examples", "_plancache_startup.py", "setup.py")

#: (file, name) -> why the name is used though no file of the repository uses it.
USED_UNSEEN = {
    ("plancache/__init__.py", "__dir__"): "PEP 562: dir(plancache) calls it",
    ("plancache/cli/maintenance.py", "get_metavar"): "click.ParamType's: click calls it for the option's help",
    ("plancache/store/connections.py", "row_factory"): "sqlite3.Connection's: sqlite3 reads it for every row",
    ("plancache/store/recovery.py", "row_factory"): "sqlite3.Connection's: sqlite3 reads it for every row",
    ("plancache/store/store.py", "row_factory"): "sqlite3.Connection's: sqlite3 reads it for every row",
    ("plancache/store/recovery.py", "moved_aside"): "a key of the Repaired TypedDict, read by subscript (cli/maintenance.py)",
    **{("plancache/store/maintenance.py", key): "a key of the verify and prune reports' TypedDicts, written as a literal and read "
       "by subscript" for key in ("checksum", "unreadable", "kernel_caches", "moved_aside", "kernel_caches_removed")},
    ("plancache/store/store.py", "file_bytes"): "a key of the Stats TypedDict, read by subscript (cli/inspection.py)",
    ("plancache/store/schema.py", "file_writable"): "a field of Access, unpacked by position (Store.__init__)",
    ("plancache/integrations/frontend.py", "stacklevel"): "plan_graph's keyword, accepted for compatibility (its docstring) and ignored",
}  # fmt: skip


@cache
def _trees() -> dict[Path, ast.Module]:
    """The package's modules, parsed once for the module's tests (which only read them)."""
    return {path: ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.rglob("*.py"))}


def _defined(tree: ast.Module) -> list[str]:
    """The names a module defines at its top level."""
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [target.id for target in node.targets if isinstance(target, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return names


def _exported(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


def test_vulture_finds_no_unused_code_in_the_package() -> None:
    scan = vulture.Vulture()
    scan.scavenge([str(ROOT / path) for path in READ])
    unused = [(item, str(Path(item.filename).relative_to(ROOT))) for item in scan.get_unused_code(min_confidence=0)]
    unused = [(item, path) for item, path in unused if path.startswith("plancache/")]
    found = [f"{path}:{item.first_lineno}: {item.message} ({item.confidence}% confidence)" for item, path in unused
             if (path, item.name) not in USED_UNSEEN]  # fmt: skip
    assert not found, "unused code (or, if a framework or Python uses it, a line of USED_UNSEEN):\n" + "\n".join(found)
    stale = set(USED_UNSEEN) - {(path, item.name) for item, path in unused}
    assert not stale, f"USED_UNSEEN names code vulture no longer reports: {sorted(stale)}"


def test_every_private_name_is_used_in_its_module() -> None:
    """vulture counts a name as used wherever the files it reads use it, not in the module
    that defines it, and it passes over unused variables named ``_x`` by design (the pylint
    convention): a private name of the package must be used in its own module."""
    unused = []
    for path, tree in _trees().items():
        loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        loaded |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        unused += [f"{path.relative_to(ROOT)}: {name}" for name in _defined(tree)
                   if name.startswith("_") and not name.startswith("__") and name not in loaded]  # fmt: skip
    assert not unused, f"private names nothing uses: {unused}"


def test_a_module_exports_only_what_it_defines() -> None:
    """A name has one home: a module's ``__all__`` lists what it defines, never what it
    imports from another module (only a package's ``__init__`` hands names on). vulture looks
    for code nothing uses, and a name in ``__all__`` counts as used: it has no rule on where
    a name lives."""
    handed_on = []
    for path, tree in _trees().items():
        if path.name == "__init__.py":
            continue
        defined = set(_defined(tree))
        handed_on += [f"{path.relative_to(ROOT)}: {name}" for name in _exported(tree) if name not in defined]
    assert not handed_on, f"names exported by a module that only imports them: {handed_on}"
