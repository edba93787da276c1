"""Single flight per key: of all threads, processes and machines missing one key, one
builds it and the others wait for it, while lookups of every other key go on.

Three locks, taken in order, each only around the build of its key:

1. a thread lock (``threading.RLock``) per stripe (threads of this process), of the
   ``STRIPES`` that a hash of the key chooses from;
2. a file lock in ``<cache>/locks/`` (processes of this machine): filelock's ``FileLock``
   (``flock``) on the stripe's file. The files are never removed, as a lock file that is
   removed while held lets one process lock the removed file while another locks a new
   one; striping keeps their number bounded. Two keys of one stripe build one after the
   other, never at once; a lookup never waits. A process keeps one ``FileLock`` per
   stripe, which filelock makes re-entrant per thread, as the thread lock is: a build that
   looks up and builds another key of its stripe on its own thread goes on (a second
   ``FileLock`` of the file would wait for the first until ``timeout``). Both locks are of
   the stripe, not the key, so every thread takes them in one order: a thread lock per key
   let another thread missing the inner key hold that key's thread lock and wait for the
   stripe while the outer build held the stripe and waited for the key. A lock file is
   never opened through a link, and one another user owns or can write is not used;
3. the fleet lock in Redis, when there is a remote tier (machines of a fleet), renewed by
   the tier while held.

Every wait is bounded by ``timeout``: past it, ``LockTimeoutError`` names the lock. A holder
touches its lock file every ``HEARTBEAT_S`` while it builds; a waiter that finds the file
untouched for ``STALLED_AFTER_S`` (its holder stopped: Ctrl-Z, a debugger, a hung machine)
stops waiting and builds the plan itself, with one warning, rather than wait out ``timeout``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import Refused, argument, wait_seconds
from ..errors import LockTimeoutError
from ..store.files import PRIVATE, Modes, check_trusted, create_directory, file_lock, read_regular, ready_lock_file
from ..store.per_process import PerProcess
from .counters import Count

if TYPE_CHECKING:
    from filelock import BaseFileLock

    from ..tiers.remote import RemoteTier

log = logging.getLogger("plancache")

__all__ = ["HEARTBEAT_S", "STALLED_AFTER_S", "STRIPES", "SingleFlight", "lock_name", "lock_timeout_of"]

#: How many build-lock files ``locks/`` holds at most. More stripes make it rarer that two
#: builds of different plans at once wait for each other (of 8 such builds, two share a
#: stripe with a chance of about 1 in 10).
STRIPES = 256

#: How often a process touches the build-lock files it holds (their modification time).
HEARTBEAT_S = 2.0
#: A build-lock file untouched this long has a holder that makes no progress (a process
#: stopped, or every thread of it stuck): its waiters build the plan themselves. Well above
#: the longest a build holds the GIL (the heartbeat is a Python thread).
STALLED_AFTER_S = 60.0


#: How many build locks the calling thread holds (a build may nest another): a lookup inside
#: a build does not wait for another thread's load of its plan (``loads``), as that thread
#: may be waiting for this one's build lock.
_holding = threading.local()


def holds_a_build_lock() -> bool:
    """Whether the calling thread holds the locks of a build (its lookups are nested in it)."""
    return bool(getattr(_holding, "count", 0))


class _StripeLocks:
    """One ``threading.RLock`` per stripe, made at its first use: re-entrant, as a thread's
    build may build another key of its stripe inside."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[int, threading.RLock] = {}

    @contextlib.contextmanager
    def hold(self, key: str, timeout: float, on_wait: Callable[[], None]) -> Iterator[bool]:
        """Hold the key's stripe; ``on_wait`` is called once, before waiting, when another
        thread holds it."""
        stripe = _stripe_of(key)
        with self._guard:
            lock = self._locks.get(stripe)
            if lock is None:
                lock = self._locks[stripe] = threading.RLock()
        waited = not lock.acquire(blocking=False)
        if waited:
            on_wait()
        # math.inf waits as long as the build takes (acquire() would overflow on it)
        if waited and not lock.acquire(timeout=-1 if math.isinf(timeout) else timeout):
            raise LockTimeoutError(
                f"waited {timeout:.0f} s for another thread to build plan {key[:12]} (or another plan of its lock stripe)",
                key=key,
                waited_s=timeout,
            )
        _holding.count = getattr(_holding, "count", 0) + 1
        try:
            yield waited
        finally:
            _holding.count -= 1
            lock.release()


class _Process:
    """The locks of one process's builds: a forked child starts with none held (the
    parent's threads are gone, and filelock closed the child's copies of the parent's
    build-lock descriptors at the fork, which does not unlock the parent's), no heartbeat
    (the parent's thread is not the child's), and ``FileLock`` objects of its own."""

    def __init__(self) -> None:
        self.threads = _StripeLocks()
        self.lock = threading.Lock()  # guards held, beating and stripes against the heartbeat and other threads
        #: Build-lock files held, for the heartbeat: path -> holds (a thread may nest two builds of one stripe).
        self.held: dict[Path, int] = {}
        self.beating = False
        self.stripes: dict[Path, BaseFileLock] = {}  # path -> its FileLock, re-entrant per thread


def lock_timeout_of(value: object, where: str = "PlanCache(lock_timeout)") -> float:
    """``lock_timeout`` as seconds: a number above 0, ``math.inf`` for no limit; anything
    else (0, a negative number, NaN) is a ``ConfigError`` naming ``where``."""
    return argument(where, value, wait_seconds)


class SingleFlight:
    """Per-key mutual exclusion across threads, processes and (with ``remote``) machines.

    ``lock_dir``: where the file locks live (None: this process only, e.g. a read-only or
    unopenable store), made with the store's ``modes`` (a shared store's are its group's).
    ``remote``: an object with ``lock(key, env_id, wait)`` yielding True when this machine
    should build (the Redis tier). ``warn(topic, message, *args)`` logs once per topic.
    """

    def __init__(self, lock_dir: Path | None, *, timeout: float, modes: Modes = PRIVATE, remote: RemoteTier | None = None,
                 warn: Callable[..., None] | None = None, count: Callable[[Count], None] | None = None) -> None:  # fmt: skip
        self.lock_dir = lock_dir
        self.modes = modes
        self._count = count or (lambda name: None)
        self.timeout = lock_timeout_of(timeout, "SingleFlight(timeout)")
        # A forked child holds none of the parent's locks: filelock closes its copies of the
        # descriptors at the fork (a flock belongs to the open file, which a copy keeps open:
        # the lock would outlive a parent killed mid-build for as long as the child lives).
        self._process = PerProcess(_Process)
        self.remote = remote
        self._warn = warn or (lambda *args: None)

    @contextlib.contextmanager
    def hold(self, key: str, env_id: str, label: str = "", *, started: float | None = None) -> Iterator[None]:
        """Hold the key's locks; ``label`` (an op summary) names it in log lines. The holder
        looks the key up again before building: whoever held it first may have stored the
        plan meanwhile, and another machine may have published it. ``started``
        (``time.monotonic``, default now): when the lookup began to wait, so that every
        wait of one lookup together stays within ``timeout``."""
        started = time.monotonic() if started is None else started
        left = max(0.0, self.timeout - (time.monotonic() - started))
        process = self._process.get()

        def waiting_for_a_thread() -> None:  # counted and logged as a wait for another process is
            self._count(Count.WAITS)
            log.info("plancache: waiting up to %.0f s for another thread to build %s (%s) or a plan of its lock stripe",
                     left, key[:12], label)  # fmt: skip

        with (
            process.threads.hold(key, left, waiting_for_a_thread) as thread_waited,
            self._file_lock(process, key, label, started, counted=thread_waited) as file_waited,
        ):
            if thread_waited or file_waited:
                log.info("plancache: waited %.1f s for another build of %s", time.monotonic() - started, key[:12])
            if self.remote is None:
                yield
                return
            remaining = max(0.0, self.timeout - (time.monotonic() - started))
            with self.remote.lock(key, env_id, wait=remaining):
                yield

    @contextlib.contextmanager
    def _file_lock(self, process: _Process, key: str, label: str, started: float, *, counted: bool) -> Iterator[bool]:
        """The stripe's file lock; a wait for it is counted unless the lookup's wait for another
        thread was (``counted``): ``waits`` counts lookups that waited."""
        if self.lock_dir is None:
            yield False
            return
        path = self.lock_dir / lock_name(key)
        try:
            create_directory(self.lock_dir, self.modes)
            check_trusted(self.lock_dir, self.modes.group)  # a link, or a folder others can write: no lock there (OSError)
            lock = self._stripe(process, path)
            try:
                lock.acquire(timeout=0)  # one try: is another process building in this stripe?
                held, waited = True, False
            except TimeoutError:
                if not counted:
                    self._count(Count.WAITS)
                log.info("plancache: waiting up to %.0f s for another process to build %s (%s); lock %s",
                         self.timeout, key[:12], label, path)  # fmt: skip
                held, waited = self._wait_for(lock, path, started + self.timeout, key), True
        except TimeoutError as exc:
            raise LockTimeoutError(
                f"waited {time.monotonic() - started:.0f} s for another process to build plan {key[:12]} (lock {path}, "
                "which the builds of a few other plans share); the lock goes when its holder exits, so that process is "
                "still building or hung. Raise lock_timeout for very long autotuning",
                key=key,
                waited_s=time.monotonic() - started,
            ) from exc
        except OSError as exc:  # no lock file (disk full, odd permissions, a file not ours): still a plan, maybe built twice
            self._warn("lock", "plancache: cannot take the build lock in %s (%s); building without it", self.lock_dir, exc)
            yield False
            return
        if not held:  # its holder makes no progress: built here, without the lock
            yield True
            return
        with process.lock:
            process.held[path] = process.held.get(path, 0) + 1
            if not process.beating:
                process.beating = True
                threading.Thread(target=self._beat, args=(process,), name="plancache-build-lock-heartbeat", daemon=True).start()
        try:
            yield waited
        finally:
            # Not in a child forked meanwhile: filelock closed its copy at the fork, and the parent's lock holds.
            if self._process.made_here(process):
                with process.lock:
                    if process.held[path] > 1:
                        process.held[path] -= 1
                    else:
                        del process.held[path]
                lock.release()

    def _stripe(self, process: _Process, path: Path) -> BaseFileLock:
        """This process's ``FileLock`` of the stripe file ``path``: one object, which filelock
        makes re-entrant per thread (each thread opens the file and locks it on its own)."""
        with process.lock:
            lock = process.stripes.get(path)
        if lock is not None:
            ready_lock_file(path, self.modes)  # as file_lock checks a new one: never through a link
            return lock
        lock = file_lock(path, self.modes, then=_note_holder)
        with process.lock:
            return process.stripes.setdefault(path, lock)

    def _wait_for(self, lock: BaseFileLock, path: Path, deadline: float, key: str) -> bool:
        """True once ``lock`` is held, False once its file has gone untouched for
        ``STALLED_AFTER_S`` (one warning). ``TimeoutError`` past ``deadline``."""
        while True:
            try:
                lock.acquire(timeout=max(0.0, min(deadline, time.monotonic() + HEARTBEAT_S) - time.monotonic()))
                return True
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
            idle = time.time() - os.lstat(path).st_mtime
            if idle >= STALLED_AFTER_S:
                try:  # as every file beside the store is read: never through a link, never a FIFO
                    holder = read_regular(path, 64)[0].decode(errors="replace").strip() or "unknown"
                except (OSError, Refused):
                    holder = "unknown"
                self._warn("stalled", "plancache: the build of %s has not moved for %.0f s (lock %s, process %s: "
                           "stopped?); building it here instead", key[:12], idle, path, holder)  # fmt: skip
                return False

    def _beat(self, process: _Process) -> None:
        """Touch every build-lock file this process holds, every ``HEARTBEAT_S``, until it
        holds none: its waiters read the files' age as the holder's progress."""
        while True:
            time.sleep(HEARTBEAT_S)
            with process.lock:
                if not process.held:
                    process.beating = False
                    return
                for path in process.held:
                    with contextlib.suppress(OSError):
                        os.utime(path, follow_symlinks=False)


def lock_name(key: str) -> str:
    """The name, in ``locks/``, of the file whose lock stands for ``key``'s build: one of
    ``STRIPES``, chosen by a hash of the key."""
    return f"build-{_stripe_of(key):03d}.lock"


def _stripe_of(key: str) -> int:
    return zlib.crc32(key.encode()) % STRIPES


def _note_holder(fd: int) -> None:
    """Freshly touched, with this process's id in it: a file a holder left long ago would
    otherwise look stalled to the waiters, who name the holder in their warning."""
    with contextlib.suppress(OSError):
        os.utime(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, b"%d\n" % os.getpid(), 0)
