"""The local tier: this machine's SQLite store, seen by a cache that must never stall.

Every failure of the store (busy, full, read-only, damaged, not even openable) is logged
once, counted and turned into a miss or an unpersisted plan: the caller always gets a
working plan. Reads never write. Hit counts are batched in memory and written by a
background thread (and at close) without waiting: when another process holds the write
lock, the batch is kept for the next try rather than stalling anyone.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..config import CACHE_DIR
from ..errors import CacheDirError, DamagedEntryError, SchemaTooNewError, StoreError
from ..store import Entry, Store, bookkeeping, default_cache_dir
from ..store.connections import GATE
from ..store.files import PRIVATE, Modes

__all__ = ["HIT_FLUSH_SECONDS", "LocalTier"]

log = logging.getLogger("plancache")

#: How often batched hit counts are written: last-used times feed eviction, which works in
#: hours, so a minute of lag costs nothing.
HIT_FLUSH_SECONDS = 30.0


class LocalTier:
    """``get``/``put`` of entries in the SQLite store of ``directory``.

    ``warn(topic, message, *args)`` logs once per topic; ``count(name)`` bumps a counter
    of the owning cache. A store that cannot be opened for a reason other than the
    caller's configuration (a full disk, an I/O error) leaves the tier ``available``
    False: plans still work, unpersisted, and the warning says why.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None,
        *,
        read_only: bool | None,
        max_bytes: int | None,
        warn: Callable[..., None],
        count: Callable[[str], None],
        app: str | None = None,
    ) -> None:
        named = CACHE_DIR.of(directory, "directory")
        #: The application whose plan use is recorded for auto-prime (None: not recorded).
        self.app = app
        self._new_run()
        self.max_bytes = max_bytes
        self._warn = warn
        self._count = count
        self.store: Store | None = None
        #: Why the store was refused (a newer or foreign schema, a directory or file not the user's); None if not.
        self.refused: str | None = None
        self._forked_busy: str | None = None  # why a forked child left the store, until told
        self.directory: Path = named if named is not None else Path()
        try:
            if named is None:
                self.directory = default_cache_dir()
            self.store = Store(self.directory, read_only=read_only)
        except (CacheDirError, SchemaTooNewError) as exc:
            if named is None and not self.directory.parts:  # the default refused: it is named in the error
                self.directory = Path(exc.fields.get("path") or ".")
            # Refused for a reason only the user can fix (a directory or file another user owns or
            # can write, a foreign schema, a store of a newer plancache): nothing of it is read;
            # lookups build plans in memory, which are not stored; one warning says why.
            self.refused = str(exc)
            count("store_errors")
            warn("open", "plancache: not storing plans: %s", exc)
        except (StoreError, OSError, sqlite3.Error) as exc:
            count("store_errors")
            warn("open", "plancache: cannot open the plan store in %s (%s); plans work but are not stored", self.directory, exc)
        self._hits: dict[str, tuple[int, float]] = {}
        self._uses: dict[tuple[str, int], int] = {}  # (key, device) -> order of first use, not yet written
        self._judgements: dict[str, tuple[str, str]] = {}  # key -> (blob_sha256, judgement to keep), not yet written
        self._hits_lock = threading.Lock()
        # One flush at a time: a flush takes the whole batch out before writing it, so a
        # second flush running beside it would find nothing and return before the first
        # has written (or, the store being busy, put the batch back). flush(wait=True)
        # must see what the background writer has in hand.
        self._flush_lock = threading.Lock()
        self._flusher: threading.Thread | None = None
        self._stop = threading.Event()

    def _new_run(self) -> None:
        self.run_started = time.time()
        self.run = f"{os.getpid()}-{self.run_started:.6f}"
        self._use_seq = 0

    @property
    def available(self) -> bool:
        return self.store is not None

    @property
    def read_only(self) -> bool:
        return self.store is None or self.store.read_only

    @property
    def modes(self) -> Modes:
        """How files beside the store are made (the build locks): the store's, or private without one."""
        return self.store.modes if self.store is not None else PRIVATE

    # ------------------------------------------------------------------ reads

    def get(self, key: str, known: Mapping[str, tuple[str, Any]] | None = None, details: bool = True) -> Entry | None:
        """The entry under ``key`` (``known``, ``details``: see ``Entry.from_row``); the
        store's failures are misses. An entry that cannot be decoded raises ``DamagedEntryError``."""
        if self.store is None:
            if self._forked_busy is not None:
                self._count("store_errors")
                self._warn("open", "plancache: not using the plan store in %s (%s); plans are built and kept in memory",
                           self.directory, self._forked_busy)  # fmt: skip
                self._forked_busy = None
            return None
        try:
            return self.store.get(key, known, details)
        except DamagedEntryError:
            raise
        except (StoreError, sqlite3.Error, OSError) as exc:  # a damaged or busy store is a miss
            self._count("store_errors")
            self._warn("read", "plancache: reading %s failed (%s); treating as a miss", self.store.path, exc)
            return None

    def entries_of(self, env_id: str) -> list[str]:
        """Keys stored for one environment, most recently used first ([] on failure)."""
        if self.store is None:
            return []
        try:
            rows = self.store.connection().execute(
                "SELECT key FROM plans WHERE env_id = ? ORDER BY last_used_at DESC, key", (env_id,)
            )
            return [r[0] for r in rows]
        except (StoreError, sqlite3.Error, OSError) as exc:
            self._warn("read", "plancache: listing %s failed (%s)", self.store.path, exc)
            return []

    def latest_run(self) -> list[tuple[str, int]]:
        """``[(key, device)]`` of this application's latest recorded run, in order of
        first use ([] without an application, a record, or a readable store)."""
        if self.store is None or not self.app:
            return []
        try:
            return bookkeeping.latest_run(self.store, self.app)
        except (StoreError, sqlite3.Error, OSError) as exc:
            self._warn("read", "plancache: reading %s failed (%s)", self.store.path, exc)
            return []

    # ------------------------------------------------------------------ writes

    def put(self, entry: Entry) -> bool:
        """Store ``entry`` (evicting inside the same write when over ``max_bytes``);
        False when it could not be stored (read-only, full, damaged: logged once)."""
        if self.store is None or self.store.read_only:
            return False
        try:
            evicted = self.store.put(entry, max_bytes=self.max_bytes)
        except (StoreError, OSError, sqlite3.Error) as exc:
            self._count("store_errors")
            self._warn("write", "plancache: could not store plan %s (%s); it is used from memory only", entry.key[:12], exc)
            return False
        if evicted:
            log.info("plancache: evicted %d least recently used plans to stay under %d bytes", evicted, self.max_bytes)
        return True

    def note_unstored(self, key: str, label: str, why: str, reason: str) -> None:
        """Record that this process built the plan of ``key`` and did not store it
        (``Store.note_unstored``); best effort: a store that cannot take it is told once."""
        if self.store is None or self.store.read_only:
            return
        try:
            self.store.note_unstored(key, label, why, reason)
        except (StoreError, OSError, sqlite3.Error) as exc:
            self._warn("unstored", "plancache: could not record why %s was not stored: %s", key[:12], exc)

    def quarantine(self, key: str, judged: Entry | None, reason: str) -> None:
        """Take the judged row out of service (matched by key, recorded checksum and
        creation time); a row another process has since rewritten is left alone. None:
        the row could not even be decoded, so the key's row is the judged one."""
        if self.store is None or self.store.read_only:
            return
        identity = (judged.blob_sha256, judged.created_at) if judged is not None else None
        try:
            self.store.quarantine(key, reason, identity=identity)
        except StoreError as exc:
            self._warn("quarantine", "plancache: could not quarantine %s: %s", key[:12], exc)

    def kernel_cache(self, env_id: str) -> bytes | None:
        if self.store is None:
            return None
        try:
            stored = self.store.get_kernel_cache(env_id)
        except (StoreError, sqlite3.Error) as exc:
            self._warn("kernel-cache", "plancache: cannot read the stored kernel cache: %s", exc)
            return None
        return stored[0] if stored is not None else None

    def put_kernel_cache(self, env_id: str, blob: bytes) -> bool:
        if self.store is None or self.store.read_only:
            return False
        try:
            self.store.put_kernel_cache(env_id, blob, None)
            return True
        except (StoreError, sqlite3.Error) as exc:
            self._warn("kernel-cache-write", "plancache: cannot store the kernel cache: %s", exc)
            return False

    # ------------------------------------------------------------------ hit counts

    def note_hit(self, key: str) -> None:
        """Count a hit in memory; a background thread writes the counts. Never blocks on
        the store."""
        now = time.time()
        with self._hits_lock:
            count, _ = self._hits.get(key, (0, 0.0))
            self._hits[key] = (count + 1, now)
            if self._flusher is None:  # under the lock: one writer thread, however many threads hit
                self._start_flusher()

    def note_use(self, key: str, device: int) -> None:
        """Record (in memory, written with the hit counts) that this run used ``key`` on
        ``device``; called once per key and device by the cache."""
        if not self.app:
            return
        with self._hits_lock:
            self._use_seq += 1
            self._uses.setdefault((key, device), self._use_seq)
            self._start_flusher()

    def note_judgement(self, key: str, blob_sha256: str, text: str) -> None:
        """Keep ``text``, the judgement of the row of ``key`` with blob ``blob_sha256``
        (``store.kept``), in that row: written in the background with the hit counts."""
        with self._hits_lock:
            self._judgements[key] = (blob_sha256, text)
            self._start_flusher()

    def start_flusher(self) -> None:
        """Start the thread that writes hit counts now, not at the first hit: starting a
        thread waits for it to run, which a lookup should not."""
        with self._hits_lock:
            self._start_flusher()

    def _start_flusher(self) -> None:
        if self._flusher is None and self.store is not None and not self.store.read_only:
            self._flusher = threading.Thread(target=self._flush_loop, name="plancache-hits", daemon=True)
            self._flusher.start()

    def _flush_loop(self) -> None:
        while not self._stop.wait(HIT_FLUSH_SECONDS):
            self.flush(wait=False)

    def flush(self, *, wait: bool = False) -> bool:
        """Write batched hit counts and plan use. ``wait=False`` skips (keeping the batch)
        when another process holds the write lock. Returns whether everything pending was
        written."""
        with self._flush_lock:
            return self._flush(wait=wait)

    def _flush(self, *, wait: bool) -> bool:
        with self._hits_lock:
            hits, self._hits = self._hits, {}
            uses, self._uses = self._uses, {}
            judgements, self._judgements = self._judgements, {}
        if (not hits and not uses and not judgements) or self.store is None or self.store.read_only:
            return True
        # A write that fails (a busy or full store) keeps its batch for the next try:
        # nothing counted is lost.
        written_hits = written_uses = False
        try:
            written_hits = bookkeeping.record_hits(self.store, hits, wait=wait)
        except (StoreError, sqlite3.Error, OSError) as exc:
            self._warn("hits", "plancache: could not record hit counts yet: %s", exc)
        try:
            written_uses = bookkeeping.record_usage(self.store, self.app or "", self.run, self.run_started, uses, wait=wait)
        except (StoreError, sqlite3.Error, OSError) as exc:
            self._warn("hits", "plancache: could not record plan use yet: %s", exc)
        try:  # kept judgements only save later lookups work: one that cannot be written now is dropped
            bookkeeping.record_judgements(self.store, judgements, wait=wait)
        except (StoreError, sqlite3.Error, OSError) as exc:
            self._warn("hits", "plancache: could not keep judgements: %s", exc)
        if not written_hits:
            self._merge_back(hits)
        if not written_uses:
            with self._hits_lock:
                for slot, seq in uses.items():
                    self._uses.setdefault(slot, seq)
        return written_hits and written_uses

    def _merge_back(self, pending: Mapping[str, tuple[int, float]]) -> None:
        with self._hits_lock:
            for key, (count, used) in pending.items():
                now_count, now_used = self._hits.get(key, (0, 0.0))
                self._hits[key] = (count + now_count, max(used, now_used))

    def bump_counters(self, deltas: Mapping[str, int], *, wait: bool) -> None:
        """Add to the store's persistent counters. ``wait=False`` (at close) skips them when
        another process holds the write lock: counters are not worth a stall."""
        if self.store is None or self.store.read_only or not any(deltas.values()):
            return
        try:
            bookkeeping.record_counters(self.store, deltas, wait=wait)
        except (StoreError, sqlite3.Error) as exc:
            self._warn("hits", "plancache: could not record counters: %s", exc)

    def stats(self) -> dict[str, Any]:
        if self.store is None:
            return {"path": str(self.directory), "available": False}
        return self.store.stats()

    def close(self) -> None:
        self._stop.set()
        self.flush(wait=False)
        if self.store is not None:
            self.store.close()

    def after_fork(self) -> None:
        """In a forked child: new locks, no flusher (threads do not survive a fork), and
        none of the parent's pending counts (the parent writes those)."""
        self._hits = {}
        self._uses = {}
        self._judgements = {}
        self._new_run()  # the child is a run of its own
        self._hits_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._flusher = None
        self._stop = threading.Event()
        if self.store is not None and GATE.refusal is not None:
            # Forked while another thread was inside SQLite: the store's connections here may
            # hold a lock no thread of this process will release. Told at the first lookup,
            # not here: a forked child that never looks a plan up hears nothing of it.
            self.store, self._forked_busy = None, GATE.refusal
