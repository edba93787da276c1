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
from ..store.per_process import PerProcess

__all__ = ["HIT_FLUSH_SECONDS", "LocalTier"]

log = logging.getLogger("plancache")

#: How often batched hit counts are written: last-used times feed eviction, which works in
#: hours, so a minute of lag costs nothing.
HIT_FLUSH_SECONDS = 30.0


class _Process:
    """What a forked child starts without: the parent's pending hit counts, uses and
    judgements (the parent writes those), its run (the child is a run of its own), its locks
    (another thread may have held one at the fork) and writer thread (threads do not
    survive a fork); and the store itself when the fork came while another thread was
    inside SQLite (``store.connections``: told at the child's first lookup, so a child that
    never looks a plan up hears nothing of it)."""

    def __init__(self, store: Store | None) -> None:
        self.store = store
        self.forked_busy: str | None = None  # why a forked child left the store, until told
        if store is not None and GATE.refusal is not None:
            self.store, self.forked_busy = None, GATE.refusal
        self.hits: dict[str, tuple[int, float]] = {}
        self.uses: dict[tuple[str, int], int] = {}  # (key, device) -> order of first use, not yet written
        self.judgements: dict[str, tuple[str, str]] = {}  # key -> (blob_sha256, judgement to keep), not yet written
        self.hits_lock = threading.Lock()
        # One flush at a time: a flush takes the whole batch out before writing it, so a
        # second one beside it would find nothing and return before the first has written
        # (or put a busy store's batch back): flush(wait=True) must see the writer's batch.
        self.flush_lock = threading.Lock()
        self.flusher: threading.Thread | None = None
        self.stop = threading.Event()
        self.run_started = time.time()
        self.run = f"{os.getpid()}-{self.run_started:.6f}"
        self.use_seq = 0


class LocalTier:
    """``get``/``put`` of entries in the SQLite store of ``directory``. ``warn(topic,
    message, *args)`` logs once per topic; ``store_error()`` counts a store error in the
    owning cache. A store that cannot be opened for a reason other than the caller's
    configuration (a full disk, an I/O error) leaves the tier ``available`` False: plans
    still work, unpersisted, and the warning says why."""

    def __init__(
        self,
        directory: str | os.PathLike[str] | None,
        *,
        read_only: bool | None,
        max_bytes: int | None,
        warn: Callable[..., None],
        store_error: Callable[[], None],
        app: str | None = None,
    ) -> None:
        named = CACHE_DIR.of(directory, "directory")
        #: The application whose plan use is recorded for auto-prime (None: not recorded).
        self.app = app
        self.max_bytes = max_bytes
        self._warn = warn
        self._store_error = store_error
        opened: Store | None = None
        #: Why the store was refused (a newer or foreign schema, a directory or file not the user's); None if not.
        self.refused: str | None = None
        self.directory: Path = named if named is not None else Path()
        try:
            if named is None:
                self.directory = default_cache_dir()
            opened = Store(self.directory, read_only=read_only)
        except (CacheDirError, SchemaTooNewError) as exc:
            if named is None and not self.directory.parts:  # the default refused: it is named in the error
                self.directory = Path(exc.fields.get("path") or ".")
            # Refused for a reason only the user can fix (a directory or file another user owns or
            # can write, a foreign schema, a store of a newer plancache): nothing of it is read;
            # lookups build plans in memory, which are not stored; one warning says why.
            self.refused = str(exc)
            store_error()
            warn("open", "plancache: not storing plans: %s", exc)
        except (StoreError, OSError, sqlite3.Error) as exc:
            store_error()
            warn("open", "plancache: cannot open the plan store in %s (%s); plans work but are not stored", self.directory, exc)
        self._process = PerProcess(lambda: _Process(opened))
        self._process.get()  # this process's run starts now

    @property
    def store(self) -> Store | None:
        """The plan store (None: not opened, refused, or not usable in this forked child)."""
        return self._process.get().store

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
        process = self._process.get()
        store = process.store
        if store is None:
            if process.forked_busy is not None:
                self._store_error()
                self._warn("open", "plancache: not using the plan store in %s (%s); plans are built and kept in memory",
                           self.directory, process.forked_busy)  # fmt: skip
                process.forked_busy = None
            return None
        try:
            return store.get(key, known, details)
        except DamagedEntryError:
            raise
        except (StoreError, sqlite3.Error, OSError) as exc:  # a damaged or busy store is a miss
            self._store_error()
            self._warn("read", "plancache: reading %s failed (%s); treating as a miss", store.path, exc)
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
            self._store_error()
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
        process = self._process.get()
        with process.hits_lock:
            count, _ = process.hits.get(key, (0, 0.0))
            process.hits[key] = (count + 1, now)
            if process.flusher is None:  # under the lock: one writer thread, however many threads hit
                self._start_flusher(process)

    def note_use(self, key: str, device: int) -> None:
        """Record (in memory, written with the hit counts) that this run used ``key`` on
        ``device``; called once per key and device by the cache."""
        if not self.app:
            return
        process = self._process.get()
        with process.hits_lock:
            process.use_seq += 1
            process.uses.setdefault((key, device), process.use_seq)
            self._start_flusher(process)

    def note_judgement(self, key: str, blob_sha256: str, text: str) -> None:
        """Keep ``text``, the judgement of the row of ``key`` with blob ``blob_sha256``
        (``store.kept``), in that row: written in the background with the hit counts."""
        process = self._process.get()
        with process.hits_lock:
            process.judgements[key] = (blob_sha256, text)
            self._start_flusher(process)

    def start_flusher(self) -> None:
        """Start the hit counts' writer now, not at the first hit: starting a thread waits
        for it to run, which a lookup should not."""
        process = self._process.get()
        with process.hits_lock:
            self._start_flusher(process)

    def _start_flusher(self, process: _Process) -> None:
        if process.flusher is None and process.store is not None and not process.store.read_only:
            process.flusher = threading.Thread(target=self._flush_loop, args=(process.stop,), name="plancache-hits", daemon=True)
            process.flusher.start()

    def _flush_loop(self, stop: threading.Event) -> None:
        while not stop.wait(HIT_FLUSH_SECONDS):
            self.flush(wait=False)

    def flush(self, *, wait: bool = False) -> bool:
        """Write batched hit counts and plan use. ``wait=False`` skips (keeping the batch)
        when another process holds the write lock. Returns whether everything pending was
        written."""
        process = self._process.get()
        with process.flush_lock:
            return self._flush(process, wait=wait)

    def _flush(self, process: _Process, *, wait: bool) -> bool:
        with process.hits_lock:
            hits, process.hits = process.hits, {}
            uses, process.uses = process.uses, {}
            judgements, process.judgements = process.judgements, {}
        store = process.store
        if (not hits and not uses and not judgements) or store is None or store.read_only:
            return True
        # A write that fails (a busy or full store) keeps its batch for the next try:
        # nothing counted is lost.
        written_hits = written_uses = False
        try:
            written_hits = bookkeeping.record_hits(store, hits, wait=wait)
        except (StoreError, sqlite3.Error, OSError) as exc:
            self._warn("hits", "plancache: could not record hit counts yet: %s", exc)
        try:
            written_uses = bookkeeping.record_usage(store, self.app or "", process.run, process.run_started, uses, wait=wait)
        except (StoreError, sqlite3.Error, OSError) as exc:
            self._warn("hits", "plancache: could not record plan use yet: %s", exc)
        try:  # kept judgements only save later lookups work: one that cannot be written now is dropped
            bookkeeping.record_judgements(store, judgements, wait=wait)
        except (StoreError, sqlite3.Error, OSError) as exc:
            self._warn("hits", "plancache: could not keep judgements: %s", exc)
        with process.hits_lock:
            if not written_hits:
                for key, (count, used) in hits.items():
                    now_count, now_used = process.hits.get(key, (0, 0.0))
                    process.hits[key] = (count + now_count, max(used, now_used))
            if not written_uses:
                for slot, seq in uses.items():
                    process.uses.setdefault(slot, seq)
        return written_hits and written_uses

    def bump_counters(self, deltas: Mapping[str, int], *, wait: bool) -> None:
        """Add to the store's persistent counters. ``wait=False`` (at close) skips them when
        another process holds the write lock: counters are not worth a stall."""
        if self.store is None or self.store.read_only or not any(deltas.values()):
            return
        try:
            bookkeeping.record_counters(self.store, deltas, wait=wait)
        except (StoreError, sqlite3.Error) as exc:
            self._warn("hits", "plancache: could not record counters: %s", exc)

    def stats(self) -> Mapping[str, object]:
        if self.store is None:
            return {"path": str(self.directory), "available": False}
        return self.store.stats()

    def close(self) -> None:
        self._process.get().stop.set()
        self.flush(wait=False)
        store = self.store
        if store is not None:
            store.close()
