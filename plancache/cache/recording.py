"""Recording the graphs a program looks up (``PLANCACHE_RECORD=path``) into a manifest of
replayable ``graph`` entries, for ``plancache prewarm`` on another machine or a later run.

Low in the layers: the cache calls it on every lookup, so it depends only on the key, on
how files are read (``store.files``) and on the manifest's file format (a JSON document
``{"version": 1, "entries": [...]}``).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import stat
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from ..config import RECORD, ConfigError, file_kind
from ..key import BuildOptions, CacheKey, canonical_json
from ..store.files import read_regular
from ..store.per_process import PerProcess

__all__ = ["MANIFEST_VERSION", "record_to", "recorder_from_env", "write_json"]

log = logging.getLogger("plancache")
#: ``record(graph, key)``, called for every graph a cache looks up (``PlanCache.add_recorder``).
Recorder = Callable[[object, CacheKey], None]

MANIFEST_VERSION = 1
#: A recording read back before each append: some thousands of graphs are a few MiB, so a
#: larger file is no recording of plancache's, and is not read into memory.
MAX_RECORDING = 256 << 20


def _kept_mode(path: Path) -> int:
    """The mode the manifest at ``path`` is written with: the existing file's (a 0600 file
    stays 0600, a shared 0644 one stays readable), else 0600, as plancache's other files
    (the store, bundles) are. A link or special file there is refused: the rename would
    replace it, and the user named it, not a file of plancache's."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return 0o600
    if not stat.S_ISREG(mode):
        raise ValueError(f"{path} is {file_kind(mode)}, not a regular file; plancache writes a manifest only to a regular file")
    return stat.S_IMODE(mode)


def write_json(path: Path, document: Mapping[str, object]) -> None:
    """Write atomically (a reader never sees half a manifest), keeping the file's mode."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = _kept_mode(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(document, f, indent=1, sort_keys=False)
            f.write("\n")
            os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)  # a link that appeared at path meanwhile is replaced, never written through
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class _Recorder:
    """Appends each new graph a cache looks up to a manifest, as a replayable ``graph`` entry."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: set[str] = set()
        # Per process: a thread of the parent may have held it (across the manifest's file
        # lock and its I/O) at a fork; that thread is not in the child, whose first lookup of
        # a new graph would wait for it forever.
        self._locks = PerProcess(threading.Lock)

    @property
    def _lock(self) -> threading.Lock:
        return self._locks.get()

    def __call__(self, graph: object, key: CacheKey) -> None:
        if key.digest in self._seen:  # every lookup calls this: a set lookup when nothing is new
            return
        with self._lock:
            if key.digest in self._seen:
                return
            self._seen.add(key.digest)
            entry: dict[str, object] = {"graph": key.parts["graph"]}
            options = key.parts["options"]
            if options != BuildOptions().to_dict():
                entry["options"] = {k: v for k, v in options.items() if not (k == "top_k" and v is None)}
            try:
                self._append(entry)
            except Exception as exc:
                # A manifest that cannot be written (a full disk, a bad path) loses this record
                # only: the lookup that asked for it, inside the caller's model, goes on.
                log.warning("plancache: could not record graph %s in %s: %s", key.digest[:12], self.path, exc)

    def _append(self, entry: dict[str, object]) -> None:
        # Several processes of one job may record into one file: read, merge, replace under a
        # lock. The lock is the directory's own (flock), so no <file>.lock is left beside the
        # recording; closing the descriptor releases it.
        fd = os.open(self.path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            entries: list[object] = []
            document: dict[str, object] = {"version": MANIFEST_VERSION, "entries": entries}
            if os.path.lexists(self.path):  # a link, a FIFO or a huge file is refused, never read through or waited on
                document = json.loads(read_regular(self.path, MAX_RECORDING)[0].decode("utf-8"))
                listed = document.get("entries") if isinstance(document, dict) else None
                if not isinstance(listed, list):
                    raise ValueError("the file exists and is not a manifest; not overwriting it")
                entries = listed
            text = canonical_json(entry)
            if any(canonical_json(e) == text for e in entries):
                return
            entries.append(entry)
            write_json(self.path, document)
        finally:
            os.close(fd)


_RECORDERS: dict[str, _Recorder] = {}


def record_to(path: str | os.PathLike[str]) -> Recorder:
    """A callback for ``PlanCache.add_recorder`` that appends every graph looked up to
    the manifest at ``path`` (created if needed, 0600, in a directory that exists; a
    ``.toml`` name, a link or a special file is refused; existing entries and the file's
    mode are kept). Recorded entries are ``graph`` entries: replaying them gives identical
    keys."""
    checked = RECORD.of(path, "record_to(path)")  # a .toml name, a link, or a directory that does not exist: refused
    if checked is None:
        raise ConfigError("record_to(path) needs a path", name=RECORD.name, value=path)
    absolute = Path(os.path.abspath(checked))  # not resolve(): a link there is refused, never followed to its target
    return _RECORDERS.setdefault(str(absolute), _Recorder(absolute))


def recorder_from_env(add_recorder: Callable[[Recorder], None]) -> None:
    """Record into ``$PLANCACHE_RECORD`` when it is set (``PlanCache`` calls this with its ``add_recorder``)."""
    target = RECORD.from_env()
    if target is not None:
        add_recorder(record_to(target))
