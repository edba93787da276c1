"""The process's SQLite connections, kept safe across ``fork()``.

SQLite says a connection must not cross a fork. A fork while another thread is inside
SQLite gives the child a copy of a mutex no thread of it will release: closing or using the
copy hangs the child. A fork inside a write transaction gives the child SQLite's record of
a lock it does not hold: its writes wait the busy timeout out. Nor can a child leave what
it inherited open: SQLite records per process which file locks it holds on each database;
the child inherits the record but not the (fcntl) locks, so while an inherited connection
is open its own connections take no shared lock, and a parent closing its last connection
checkpoints and deletes the -wal and -shm the child writes to: its plans are lost while
every put reports success.

So every call into SQLite through these connections (opening, statements, fetching rows,
closing) passes one gate (``GATE``). A fork waits, at most ``FORK_WAIT_S``, until no
thread is inside SQLite or a transaction, and holds the gate across the fork; a thread
inside a transaction finishes it, every other thread waits for the fork. The child then
closes what it inherited (safe now) before it opens a connection of its own. A fork that
could not wait that long (a write waiting for another process's lock) leaves its child
without SQLite: the inherited connections are never touched, ``GATE.refusal`` says why, and
the child keeps its plans in memory (``tiers.local`` says so once).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

__all__ = ["FORK_WAIT_S", "GATE", "GatedConnection", "Transaction", "connect"]

#: A store's short write transaction (``Store.transaction``), for the functions that write through it.
Transaction = Callable[[], contextlib.AbstractContextManager[sqlite3.Connection]]

#: The longest a fork waits for SQLite calls and transactions of other threads to end.
FORK_WAIT_S = 1.0


class GatedConnection(sqlite3.Connection):
    """A connection whose every call into SQLite passes ``GATE``; its cursors too."""

    closed = False

    # Any in these overrides: typeshed types the parameters by its private ``_Parameters``
    # (itself a union with Any) and ``cursor`` by overloads; a cursor's gated methods are Any.
    def cursor(self, factory: Any = None) -> Any:
        return super().cursor(factory or GatedCursor)

    def execute(self, sql: str, parameters: Any = (), /) -> Any:
        return self.cursor().execute(sql, parameters)

    def executemany(self, sql: str, parameters: Any, /) -> Any:
        return self.cursor().executemany(sql, parameters)

    def executescript(self, script: str, /) -> Any:
        return self.cursor().executescript(script)

    def one(self, sql: str, parameters: Sequence[object] | Mapping[str, object] = (), /) -> dict[str, object] | None:
        """The first row of ``sql`` as a dict by column name (None: no row), in one pass through
        ``GATE``: a store hit's read, where a ``Row``'s lookups by name cost microseconds."""
        GATE.enter(self)
        try:
            cursor = sqlite3.Cursor(self)
            cursor.row_factory = None
            row = cursor.execute(sql, parameters).fetchone()
            return None if row is None else dict(zip([column[0] for column in cursor.description], row))
        finally:
            GATE.leave()

    def close(self) -> None:
        with GATE.inside(self):
            super().close()
            self.closed = True

    def __del__(self) -> None:
        # Freed unclosed (its thread ended; the collector frees connections, in a cycle with their
        # statement cache, at any allocation of any thread): closed at the next call through the
        # gate, inside it, never here, where the gate may be held.
        if not self.closed:
            GATE.retire(self)


def _through_gate(method: Callable[..., Any]) -> Callable[..., Any]:
    """A cursor's method, called inside ``GATE``. (Typed by a ParamSpec, the wrapped method
    would not override typeshed's, which return ``Self``.)"""

    @functools.wraps(method)
    def call(self: sqlite3.Cursor, *args: Any) -> Any:
        GATE.enter(self.connection)
        try:
            return method(self, *args)
        finally:
            GATE.leave()

    return call


class GatedCursor(sqlite3.Cursor):
    """A cursor whose statements and row fetches pass ``GATE``. (A cursor freed in the
    middle of its rows resets its statement outside the gate; plancache reads each
    statement of a store to its end, as a single-row ``fetchone`` does.)"""

    execute = _through_gate(sqlite3.Cursor.execute)
    executemany = _through_gate(sqlite3.Cursor.executemany)
    executescript = _through_gate(sqlite3.Cursor.executescript)
    fetchone = _through_gate(sqlite3.Cursor.fetchone)
    fetchmany = _through_gate(sqlite3.Cursor.fetchmany)
    fetchall = _through_gate(sqlite3.Cursor.fetchall)
    __next__ = _through_gate(sqlite3.Cursor.__next__)
    close = _through_gate(sqlite3.Cursor.close)


def _in_transaction(conn: sqlite3.Connection) -> bool:
    try:
        return conn.in_transaction
    except sqlite3.Error:  # closed
        return False


def _close(conn: GatedConnection) -> None:
    """Close without the gate: for the caller already inside it, or a child's copies."""
    with contextlib.suppress(sqlite3.Error):
        sqlite3.Connection.close(conn)
    conn.closed = True


class ForkGate:
    """Counts the threads inside SQLite and holds them off across a fork (module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._inside = 0  # calls into SQLite under way, every thread's
        self._forking = False
        self._depth = threading.local()  # this thread's calls under way (a call may nest another)
        self._opened: weakref.WeakSet[GatedConnection] = weakref.WeakSet()
        self._retired: list[GatedConnection] = []  # freed unclosed, to be closed inside the gate
        self._holding: list[GatedConnection] = []  # strong references across a fork
        self._inherited: list[GatedConnection] = []  # a child's copies, closed before its first connection
        self._closing = threading.Lock()
        self._clean = True  # whether the last fork found no thread inside SQLite or a transaction
        #: Why this process must not use SQLite (forked while another thread was inside it); None when it may.
        self.refusal: str | None = None
        # Hooks at the fork itself, not state made at a child's first use (``per_process``): only
        # the parent, before the fork, can wait for other threads' SQLite calls and hold the gate;
        # and the child must learn at once, from what the fork found, which copies it must never touch.
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(before=self._before_fork, after_in_parent=self._after_in_parent,
                                after_in_child=self._after_in_child)  # fmt: skip

    # ------------------------------------------------------------------ every call

    def enter(self, conn: sqlite3.Connection | None) -> None:
        depth = getattr(self._depth, "n", 0)
        with self._cond:
            # A thread inside a transaction finishes it: the fork waits for that.
            while self._forking and depth == 0 and not (conn is not None and _in_transaction(conn)):
                self._cond.wait()
            self._inside += 1
        self._depth.n = depth + 1
        while self._retired and depth == 0:
            with contextlib.suppress(IndexError):  # another thread took the last one
                _close(self._retired.pop())

    def leave(self) -> None:
        self._depth.n -= 1
        with self._cond:
            self._inside -= 1
            if self._forking:
                self._cond.notify_all()

    @contextlib.contextmanager
    def inside(self, conn: sqlite3.Connection | None = None) -> Iterator[None]:
        """One region of SQLite calls (of ``conn``) that a fork must not split."""
        self.enter(conn)
        try:
            yield
        finally:
            self.leave()

    def retire(self, conn: GatedConnection) -> None:
        self._retired.append(conn)  # no lock: this runs wherever the collector does

    def add(self, conn: GatedConnection) -> None:
        with self._cond:
            self._opened.add(conn)

    def close_inherited(self) -> None:
        """In a forked child, close the parent's connections before the child opens its own (which
        joins the process's record of its file's locks)."""
        if self._inherited:
            with self._closing:
                inherited, self._inherited = self._inherited, []
                with self.inside():
                    for old in inherited:
                        _close(old)

    # ------------------------------------------------------------------ fork

    def _busy(self) -> bool:
        return self._inside > 0 or any(_in_transaction(c) for c in list(self._opened))

    def _before_fork(self) -> None:
        self._cond.acquire()  # held across the fork: no thread enters or leaves SQLite meanwhile
        self._forking = True
        inside_itself = getattr(self._depth, "n", 0) > 0  # forking from inside SQLite: no wait ends that
        deadline = time.monotonic() + FORK_WAIT_S
        while not inside_itself and self._busy() and (left := deadline - time.monotonic()) > 0:
            self._cond.wait(left)
        self._clean = not inside_itself and not self._busy()
        self._holding = [*self._opened, *self._retired]  # alive in the child until closed, or kept

    def _after_in_parent(self) -> None:
        self._holding = []
        self._forking = False
        self._cond.notify_all()
        self._cond.release()

    def _after_in_child(self) -> None:
        # The parent's other threads are gone, and so are their calls and waits.
        self._cond, self._closing = threading.Condition(threading.Lock()), threading.Lock()
        self._inside, self._forking, self._depth = 0, False, threading.local()
        self._inherited += self._holding
        self._holding, self._retired, self._opened = [], [], weakref.WeakSet()
        if not self._clean and self.refusal is None:
            # Never closed, never freed: any of them may hold a mutex no thread will release.
            self.refusal = f"this process was forked while another thread was inside SQLite for over {FORK_WAIT_S:g} s"
            _ABANDONED.extend(self._inherited)
            self._inherited = []


_ABANDONED: list[GatedConnection] = []  # a child's inherited connections it must never touch

GATE = ForkGate()


def connect(database: str | os.PathLike[str], *, timeout: float = 5.0, check_same_thread: bool = True, uri: bool = False,
            isolation_level: Literal["DEFERRED", "EXCLUSIVE", "IMMEDIATE"] | None = "DEFERRED") -> GatedConnection:  # fmt: skip
    """``sqlite3.connect`` through the gate: a ``GatedConnection``; refused
    (``sqlite3.OperationalError``) in a child forked while SQLite was busy."""
    if GATE.refusal is not None:
        raise sqlite3.OperationalError(GATE.refusal)
    GATE.close_inherited()
    with GATE.inside():
        conn = sqlite3.connect(database, timeout, isolation_level=isolation_level, check_same_thread=check_same_thread,
                               factory=GatedConnection, uri=uri)  # fmt: skip
    GATE.add(conn)
    return conn
