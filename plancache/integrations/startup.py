"""``PLANCACHE_PATCH_CUDNN``: patch cuDNN Frontend at ``import plancache`` or ``import cudnn``.

The one reading of the variable (``config.PATCH_CUDNN``, parsed as every switch is). A
program that never imports plancache is patched by the interpreter start-up hook
(``_plancache_startup``, outside the package), which calls ``patch_cudnn_from_env`` once the
program imports ``cudnn``; one that imports plancache is patched at that import.
``startup_hook_status`` is what ``plancache env`` says about the hook.
"""

from __future__ import annotations

import logging
import sys
import threading

from ..config import PATCH_CUDNN, ConfigError

__all__ = ["HOOK_FILE", "patch_cudnn_from_env", "startup_hook_status"]

#: The start-up hook's file, which a regular and an editable install put into site-packages.
HOOK_FILE = "plancache-startup.pth"

_warned = threading.Event()  # a bad value is told once per process, whoever reads it


def patch_cudnn_from_env() -> bool:
    """PLANCACHE_PATCH_CUDNN on (1/true/yes/on): existing cuDNN Frontend code (the five-step
    pipeline, build(), execute(), cudnn.jit, cudnn.graph_cache) gets persistent plans
    unchanged; only then is cuDNN imported, and where it cannot be, a notice says so. Never
    fails because of the variable: a value that is not a switch is one warning line per
    process, and nothing is patched. Returns whether the patch is in force."""
    try:
        patch = PATCH_CUDNN.from_env()
    except ConfigError as exc:
        if not _warned.is_set():
            _warned.set()
            logging.getLogger("plancache").warning("plancache: %s; cuDNN Frontend is not patched", exc)
        return False
    if not patch:
        return False
    from .frontend import install_from_environment

    return install_from_environment()


def _site_directories() -> list[str]:
    """Where this interpreter reads ``.pth`` files at start-up: its site-packages and the
    user's (when enabled)."""
    import site
    import sysconfig

    found = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    if site.ENABLE_USER_SITE:
        found.append(site.getusersitepackages())
    return list(dict.fromkeys(found))


def startup_hook_status() -> str:
    """One line: whether the start-up hook is installed for this interpreter, and whether it
    is active in this process (its variable on, and the hook ran at start-up)."""
    import importlib.util
    from pathlib import Path

    places = [d for d in _site_directories() if (Path(d) / HOOK_FILE).is_file()]
    if not places:
        return (f"not installed: no {HOOK_FILE} in this interpreter's site-packages, so PLANCACHE_PATCH_CUDNN patches only programs "
                "that import plancache (reinstall plancache: pip install -e . or pip install plancache)")  # fmt: skip
    if importlib.util.find_spec("_plancache_startup") is None:
        return (
            f"broken: {HOOK_FILE} is in {places[0]}, but its module _plancache_startup cannot be imported (reinstall plancache)"
        )
    installed = f"installed ({places[0]})"
    try:
        on = PATCH_CUDNN.from_env()
    except ConfigError as exc:
        return f"{installed}; inactive: {exc}"
    if not on:
        return f"{installed}; inactive: PLANCACHE_PATCH_CUDNN is not on"
    if "_plancache_startup" not in sys.modules:
        return f"{installed}; PLANCACHE_PATCH_CUDNN is on, but the hook did not run at this process's start-up (python -S, or no site)"
    return f"{installed}; active: PLANCACHE_PATCH_CUDNN is on, so a program's import cudnn patches cuDNN Frontend"
