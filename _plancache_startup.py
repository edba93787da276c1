"""``PLANCACHE_PATCH_CUDNN=1 python app.py``: plancache for a program that never imports it.

``plancache-startup.pth``, installed into site-packages with plancache (by a regular and an
editable install alike: see setup.py), imports this module at interpreter start-up, and
only when ``PLANCACHE_PATCH_CUDNN`` is set; without the variable nothing runs but that one
lookup.

This module imports neither plancache nor cuDNN, and does not read the variable's value
itself. It waits for the program's own ``import cudnn`` (a finder on ``sys.meta_path`` that
lets the usual finders find the module and runs plancache right after the module has
executed), and plancache then reads the variable with the parser of every on/off variable
(``plancache.config.PATCH_CUDNN``, read as every switch is: 1/true/yes/on patch, 0/false/no/off do not, any other
value is one warning and no patch). So a process that never uses cuDNN pays nothing (no
torch or CUDA library is loaded at start-up), and packages that site-packages sets up after
this line (other ``.pth`` files run in name order) are in place before cuDNN is imported.
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
    """Patch the frontend now that it is imported, as the variable says (plancache's own
    reading of it); never makes the import fail."""
    try:
        from plancache.integrations.startup import patch_cudnn_from_env

        patch_cudnn_from_env()
    except Exception as exc:  # plancache itself broken: say so, and run the program unpatched
        import warnings

        warnings.warn(f"plancache: {_VARIABLE} is set, but plancache could not patch cuDNN Frontend ({type(exc).__name__}: {exc})",
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
    """Have plancache read the variable, and patch cuDNN Frontend if it is on, when the
    program imports cuDNN (now, if it already has). Unset or blank: nothing at all."""
    if not os.environ.get(_VARIABLE, "").strip():
        return
    if "cudnn" in sys.modules:
        _install()
        return
    if not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


start()
