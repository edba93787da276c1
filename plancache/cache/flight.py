"""Single flight per key: of all threads, processes and machines missing one key, one
builds it and the others wait for it, while lookups of every other key go on.

Three locks, taken in order, each only around the build of its key:

1. a thread lock per key (threads of this process);
2. a file lock per key in ``<cache>/locks/`` (processes of this machine), held with
   ``flock`` and removed by its holder after the build, so locks/ does not keep a file per
   key ever seen. A waiter that wakes up holding a file that was meanwhile removed (or
   replaced) retries on the current one: two holders of one key are impossible. A lock
   file is never opened through a link, and one another user owns or can write is not used;
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..config import Refused, argument, read_regular, wait_seconds
from ..errors import LockTimeoutError
from ..store.files import PRIVATE, Modes, check_trusted, create_directory, lock_file

log = logging.getLogger("plancache")

__all__ = ["HEARTBEAT_S", "STALLED_AFTER_S", "SingleFlight", "lock_timeout_of"]

#: How often a process touches the build-lock files it holds (their modification time).
HEARTBEAT_S = 2.0
#: A build-lock file untouched this long has a holder that makes no progress (a process
#: stopped, or every thread of it stuck): its waiters build the plan themselves. Well above
#: the longest a build holds the GIL (the heartbeat is a Python thread).
STALLED_AFTER_S = 60.0


class _KeyLocks:
    """One ``threading.Lock`` per key, dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, int]] = {}

    @contextlib.contextmanager
    def hold(self, key: str, timeout: float) -> Iterator[bool]:
        with self._guard:
            lock, users = self._locks.get(key, (threading.Lock(), 0))
            self._locks[key] = (lock, users + 1)
        try:
            waited = not lock.acquire(blocking=False)
            # math.inf waits as long as the build takes (acquire() would overflow on it)
            if waited and not lock.acquire(timeout=-1 if math.isinf(timeout) else timeout):
                raise LockTimeoutError(
                    f"waited {timeout:.0f} s for another thread to build plan {key[:12]}", key=key, waited_s=timeout
                )
            try:
                yield waited
            finally:
                lock.release()
        finally:
            with self._guard:
                lock, users = self._locks[key]
                if users <= 1:
                    del self._locks[key]
                else:
                    self._locks[key] = (lock, users - 1)


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

    def __init__(self, lock_dir: Path | None, *, timeout: float, modes: Modes = PRIVATE, remote: Any = None,
                 warn: Callable[..., None] | None = None, count: Callable[[str], None] | None = None) -> None:  # fmt: skip
        self.lock_dir = lock_dir
        self.modes = modes
        self._count = count or (lambda name: None)
        self.timeout = lock_timeout_of(timeout, "SingleFlight(timeout)")
        # Build locks this process holds, by descriptor: a forked child closes its copies
        # (a flock belongs to the open file, which the child's copy keeps open: the lock
        # would outlive a parent killed mid-build for as long as the child lives).
        self._held: dict[int, int] = {}  # fd -> pid of the process that took it
        # Guards _held against the heartbeat: a descriptor is touched only while it is held,
        # never after its close (its number could then be another file's).
        self._beat_lock = threading.Lock()
        self._beating = False
        self.remote = remote
        self._warn = warn or (lambda *args: None)
        self._threads = _KeyLocks()

    @contextlib.contextmanager
    def hold(self, key: str, env_id: str, label: str = "", *, started: float | None = None) -> Iterator[None]:
        """Hold the key's locks; ``label`` (an op summary) names it in log lines. The holder
        looks the key up again before building: whoever held it first may have stored the
        plan meanwhile, and another machine may have published it. ``started``
        (``time.monotonic``, default now): when the lookup began to wait, so that every
        wait of one lookup together stays within ``timeout``."""
        started = time.monotonic() if started is None else started
        left = max(0.0, self.timeout - (time.monotonic() - started))
        with self._threads.hold(key, left) as thread_waited, self._file_lock(key, label, started) as file_waited:
            if thread_waited or file_waited:
                log.info("plancache: waited %.1f s for another build of %s", time.monotonic() - started, key[:12])
            if self.remote is None:
                yield
                return
            remaining = max(0.0, self.timeout - (time.monotonic() - started))
            with self.remote.lock(key, env_id, wait=remaining):
                yield

    @contextlib.contextmanager
    def _file_lock(self, key: str, label: str, started: float) -> Iterator[bool]:
        if self.lock_dir is None:
            yield False
            return
        path = self.lock_dir / f"{key[:32]}.lock"
        held: int | None
        try:
            create_directory(self.lock_dir, self.modes)
            check_trusted(self.lock_dir, self.modes.group)  # a link, or a folder others can write: no lock there (OSError)
            try:
                held, waited = lock_file(path, time.monotonic(), self.modes)  # one try: is another process building it?
            except TimeoutError:
                self._count("waits")
                log.info(
                    "plancache: waiting up to %.0f s for another process to build %s (%s); lock %s",
                    self.timeout,
                    key[:12],
                    label,
                    path,
                )
                held, waited = self._wait_for(path, started + self.timeout), True
        except TimeoutError as exc:
            raise LockTimeoutError(
                f"waited {time.monotonic() - started:.0f} s for another process to build plan {key[:12]} "
                f"(lock {path}); the lock goes when its holder exits, so that process is still "
                "building or hung. Raise lock_timeout for very long autotuning",
                key=key,
                waited_s=time.monotonic() - started,
            ) from exc
        except OSError as exc:  # no lock file (disk full, odd permissions, a file not ours): still a plan, maybe built twice
            self._warn("lock", "plancache: cannot take the build lock in %s (%s); building without it", self.lock_dir, exc)
            yield False
            return
        if held is None:  # its holder makes no progress: built here, without the lock
            yield True
            return
        fd = held
        with contextlib.suppress(OSError):  # who holds it, for a waiter's warning
            os.ftruncate(fd, 0)
            os.write(fd, b"%d\n" % os.getpid())
        with self._beat_lock:
            self._held[fd] = os.getpid()
            if not self._beating:
                self._beating = True
                threading.Thread(target=self._beat, name="plancache-build-lock-heartbeat", daemon=True).start()
        try:
            yield waited
        finally:
            with self._beat_lock:
                if self._held.pop(fd, None) == os.getpid():  # not a child's copy, closed at the fork
                    # Remove before unlocking: a waiter that then locks the removed file sees
                    # that the path no longer names it and retries (see store.files.lock_file).
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                    os.close(fd)

    def _wait_for(self, path: Path, deadline: float) -> int | None:
        """The locked descriptor of ``path`` once its holder lets go, or None once the file
        has gone untouched for ``STALLED_AFTER_S`` (one warning). ``TimeoutError`` past
        ``deadline``."""
        while True:
            try:
                return lock_file(path, min(deadline, time.monotonic() + HEARTBEAT_S), self.modes)[0]
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
            try:
                idle = time.time() - os.stat(path).st_mtime
            except FileNotFoundError:  # let go meanwhile: the next try takes it
                continue
            if idle >= STALLED_AFTER_S:
                try:  # as every file beside the store is read: never through a link, never a FIFO
                    holder = read_regular(path, 64)[0].decode(errors="replace").strip() or "unknown"
                except (OSError, Refused):
                    holder = "unknown"
                self._warn("stalled", "plancache: the build of %s has not moved for %.0f s (lock %s, process %s: "
                           "stopped?); building it here instead", path.stem, idle, path, holder)  # fmt: skip
                return None

    def _beat(self) -> None:
        """Touch every build-lock file this process holds, every ``HEARTBEAT_S``, until it
        holds none: its waiters read the files' age as the holder's progress."""
        while True:
            time.sleep(HEARTBEAT_S)
            with self._beat_lock:
                held = [fd for fd, pid in self._held.items() if pid == os.getpid()]
                if not held:
                    self._beating = False
                    return
                for fd in held:
                    with contextlib.suppress(OSError):
                        os.utime(fd)

    def after_fork(self) -> None:
        """A forked child starts with no locks held: the parent's threads are gone, and its
        copies of the parent's build-lock descriptors are closed (not unlocked, which would
        unlock the parent's too)."""
        self._threads = _KeyLocks()
        self._beat_lock, self._beating = threading.Lock(), False  # the parent's heartbeat is not the child's
        inherited, self._held = self._held, {}
        for fd in inherited:
            with contextlib.suppress(OSError):
                os.close(fd)
