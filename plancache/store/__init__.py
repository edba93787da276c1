"""Storage: the SQLite plan store (``store``), what a row holds and the one check of
whether it may be served (``entry``), what keeps the store sound across damage, forks
and other users (each module says its part), and the state of one process that a forked
child makes anew (``per_process``)."""

from .entry import NEVER_CHECKED, Entry, Sound, Unsound, held_to, judged, problem, sha256, summarize, unsound
from .recovery import DB_NAME
from .schema import BUSY_TIMEOUT_MS, check_private, default_cache_dir, migrations
from .store import Store

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
