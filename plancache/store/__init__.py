"""Storage: the SQLite plan store (``store``), what a row holds and the one check of
whether it may be served (``entry``), what keeps the store sound across damage, forks
and other users (each module says its part), and the state of one process that a forked
child makes anew (``per_process``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import lazy_getattr

# The names load on first use (PEP 562), as the package root's do: importing a light module
# of this folder (``per_process``, which the start-up hook's import of the frontend
# integration brings in every process that sets PLANCACHE_PATCH_CUDNN) imports neither the
# store nor orjson nor sqlite3.
_LAZY = {
    "NEVER_CHECKED": "entry", "Entry": "entry", "Sound": "entry", "Unsound": "entry", "held_to": "entry", "judged": "entry",
    "problem": "entry", "sha256": "entry", "summarize": "entry", "unsound": "entry",
    "DB_NAME": "recovery",
    "BUSY_TIMEOUT_MS": "schema", "check_private": "schema", "default_cache_dir": "schema", "migrations": "schema",
    "Store": "store",
}  # fmt: skip
#: This folder's modules, loaded on first use as attributes (``plancache.store.maintenance``).
_SUBMODULES = frozenset({"bookkeeping", "codec", "connections", "entry", "files", "judge", "kept", "maintenance", "per_process",
                         "quarantine", "recovery", "schema", "store"})  # fmt: skip

if TYPE_CHECKING:
    from .entry import NEVER_CHECKED, Entry, Sound, Unsound, held_to, judged, problem, sha256, summarize, unsound
    from .recovery import DB_NAME
    from .schema import BUSY_TIMEOUT_MS, check_private, default_cache_dir, migrations
    from .store import Store


if not TYPE_CHECKING:  # to a type checker, a name missing from the imports above is an error
    __getattr__ = lazy_getattr(__name__, _LAZY, _SUBMODULES)


__all__ = [
    "BUSY_TIMEOUT_MS",
    "DB_NAME",
    "NEVER_CHECKED",
    "Entry",
    "Sound",
    "Store",
    "Unsound",
    "check_private",
    "default_cache_dir",
    "held_to",
    "judged",
    "migrations",
    "problem",
    "sha256",
    "summarize",
    "unsound",
]
