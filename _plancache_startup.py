"""``PLANCACHE_PATCH_CUDNN=1 python app.py``: plancache for a program that never imports it.

``plancache-startup.pth``, installed into site-packages with plancache, imports this
module at interpreter start-up, and only when ``PLANCACHE_PATCH_CUDNN`` is ``1``; without
the variable nothing runs but that one comparison.

This module imports neither plancache nor cuDNN. It waits for the program's own
``import cudnn`` (a finder on ``sys.meta_path`` that lets the usual finders find the
module and runs ``plancache.integrations.frontend.install_from_environment()`` right after the module
has executed). So a process that never uses cuDNN pays nothing (no torch or CUDA library
is loaded at start-up), and packages that site-packages sets up after this line (other
``.pth`` files run in name order) are in place before cuDNN is imported.
"""

from __future__ import annotations

import os
import sys

# Nothing else is imported here: this runs at start-up of every process of the environment
# that has the variable set, and typing or threading alone would cost milliseconds there.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType

_VARIABLE = "PLANCACHE_PATCH_CUDNN"


def _install() -> None:
    """Patch the frontend now that it is imported; never makes its import fail."""
    try:
        from plancache.integrations.frontend import install_from_environment

        install_from_environment()
    except Exception as exc:  # plancache itself broken: say so, and run the program unpatched
        import warnings

        warnings.warn(f"plancache: {_VARIABLE}=1, but plancache could not patch cuDNN Frontend ({type(exc).__name__}: {exc})",
                      RuntimeWarning, stacklevel=2)  # fmt: skip


class _PatchOnImport:
    """Finds nothing itself: when ``cudnn`` is imported, asks the other finders for it and
    makes the found loader install plancache after executing the module (once)."""

    def __init__(self) -> None:
        # One flag, no lock: the import system holds the module lock of "cudnn" while it
        # looks for it, so two threads never ask at once.
        self._finding = False

    def find_spec(self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname != "cudnn" or self._finding:
            return None
        import importlib.util

        self._finding = True
        try:
            spec = importlib.util.find_spec(fullname)  # the usual finders (this one declines while busy)
        finally:
            self._finding = False
        loader = spec.loader if spec is not None else None
        execute = getattr(loader, "exec_module", None)
        if spec is None or loader is None or execute is None:
            return None

        def exec_module(module: ModuleType) -> None:
            execute(module)
            self.remove()
            _install()

        loader.exec_module = exec_module  # type: ignore[method-assign]  # this loader object only
        return spec

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def start() -> None:
    """Patch cuDNN Frontend when the program imports it (now, if it already has)."""
    if os.environ.get(_VARIABLE, "").strip() != "1":
        return
    if "cudnn" in sys.modules:
        _install()
        return
    if not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


start()
