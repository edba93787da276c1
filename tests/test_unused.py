"""No dead code in the package: a private name its module never uses, a name a module hands
on from another (so that one thing has two homes), or a function nothing calls.

Names are read from the source with ``ast``: a function counts as used when any file of
the repository (the package, tests, scripts, examples, the start-up hook) names it, as a
name, an attribute, an import or a string such as ``getattr``'s.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "plancache"
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


@cache
def _trees() -> dict[Path, ast.Module]:
    """The package's modules, parsed once for the module's tests (which only read them)."""
    return {path: ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.rglob("*.py"))}


def _names(tree: ast.AST) -> set[str]:
    """Every name ``tree`` uses: names, attributes, imported names and identifier strings."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.add(node.name.rpartition(".")[2])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _IDENTIFIER.fullmatch(node.value):
            found.add(node.value)
    return found


@cache
def _used_anywhere() -> frozenset[str]:
    files = [ROOT / "_plancache_startup.py", ROOT / "setup.py"]
    files += [p for folder in ("tests", "scripts", "examples") for p in (ROOT / folder).rglob("*.py")]
    used: set[str] = set()
    for tree in _trees().values():  # the package
        used |= _names(tree)
    for path in files:
        used |= _names(ast.parse(path.read_text(), str(path)))
    return frozenset(used)


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


def test_every_private_name_is_used_in_its_module() -> None:
    unused = []
    for path, tree in _trees().items():
        loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        loaded |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        unused += [f"{path.relative_to(ROOT)}: {name}" for name in _defined(tree)
                   if name.startswith("_") and not name.startswith("__") and name not in loaded]  # fmt: skip
    assert not unused, f"private names nothing uses: {unused}"


def test_a_module_exports_only_what_it_defines() -> None:
    """A name has one home: a module's ``__all__`` lists what it defines, never what it
    imports from another module (only a package's ``__init__`` hands names on)."""
    handed_on = []
    for path, tree in _trees().items():
        if path.name == "__init__.py":
            continue
        defined = set(_defined(tree))
        handed_on += [f"{path.relative_to(ROOT)}: {name}" for name in _exported(tree) if name not in defined]
    assert not handed_on, f"names exported by a module that only imports them: {handed_on}"


def _framework_hooks(tree: ast.Module) -> set[int]:
    """Ids of the functions that a framework calls rather than the code: those registered
    by a decorator call (``@cli.command()``) and the methods of classes that extend a class
    from outside the package (``click.ParamType.convert``, ``threading.Thread.run``)."""
    ours = set(_defined(tree))
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("plancache")):
            ours.update(alias.asname or alias.name for alias in node.names)
    hooks: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
            isinstance(d, ast.Call) for d in node.decorator_list
        ):
            hooks.add(id(node))
        if isinstance(node, ast.ClassDef) and any(isinstance(b, ast.Attribute) or (isinstance(b, ast.Name) and b.id not in ours)
                                                  for b in node.bases):  # fmt: skip
            hooks.update(id(item) for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return hooks


def test_every_function_is_used_somewhere() -> None:
    used = _used_anywhere()
    unused = []
    for path, tree in _trees().items():
        hooks = _framework_hooks(tree)
        for node in ast.walk(tree):
            function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("__")
            if function and node.name not in used and id(node) not in hooks:
                unused.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name}")
    assert not unused, f"functions nothing calls or names: {unused}"
