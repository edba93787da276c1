"""The fleet lock: cross-node single flight for one plan key, kept in the shared Redis.

``FleetLock.hold(entry_name, wait)`` is what ``RemoteTier.lock`` returns: redis-py's lock
(``redis.lock.Lock``) on ``<entry_name>:lock``, whose scripts compare its random token first,
so after a lock expired and another node took it, a late renewal or release of the first
holder does nothing. It is taken by plancache's own attempt (``_ACQUIRE_LUA``; redis-py's is
a plain ``SET NX``), which also learns that the entry exists, or takes over a stale lock
(below); the attempts give up after ``wait`` seconds, or find Redis unusable (down, backing
off, full) and say "build locally".

While the with-block runs and this node holds the lock, a daemon thread renews it every
``lock_ttl / 3`` seconds, so an autotune may take longer than the lock's expiry, and a holder
that dies stops renewing, so its lock is gone one expiry later. A lock key with no expiry, or
with one beyond ``lock_ttl``, was set by no holder: it is stale and taken over as an expired
one would be, with one warning, so that a stray key cannot make every miss wait out its ``wait``.
A process that forks inside the block leaves the lock to the parent, which still builds: the
child's end of the block releases nothing, and the child has no thread to renew it.

Releasing is never skipped: it is attempted even while the tier backs off (counted against
``max_stall``, so the delay bound holds), and when Redis does not answer, the lock's thread
retries it until Redis answers or the lock would have expired anyway: a Redis restarted
from its append-only file keeps the lock, and the next node that needs the plan would wait
out its whole ``wait`` on a healthy Redis.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..config import REDIS_LOCK_TTL
from ..store.per_process import PerProcess
from .breaker import Call, CallMode, RemoteCount

__all__ = ["FleetLock", "ScriptCall"]

log = logging.getLogger("plancache.remote")

# (what, operation, mode) -> the operation's integer reply, or None when the call failed.
ScriptCall = Callable[[Call, Callable[[], Any], CallMode], int | None]

_POLL_FIRST, _POLL_MAX = 0.02, 0.25  # lock polling: quick for short builds, cheap for long ones
_RETRY_FIRST, _RETRY_MAX = 0.1, 1.0  # release retries: prompt once Redis is back, cheap while not

# Atomic "is it built? else try to take the lock": one round trip, and no window in which a
# node could take the lock just after the holder published and released it. A stale lock
# (see the module docstring) is taken over as an expired one would be (3).
_ACQUIRE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 2 end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
local left = redis.call('PTTL', KEYS[2])
if left == -1 or left > tonumber(ARGV[2]) then
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
  return 3
end
return 0
"""


class _Take(enum.Enum):
    """What asking for the fleet lock came to."""

    MINE = "mine"
    BUILT = "built"  # the entry exists
    TIMEOUT = "timeout"
    DOWN = "down"  # Redis cannot coordinate


class _Holds:
    """The locks this process's threads renew or release, and their lock: a forked child has
    none of its parent's (their threads are not the child's), and a thread of the parent
    may have held the lock at the fork."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holds: set[_Hold] = set()

    def add(self, hold: _Hold) -> None:
        with self._lock:
            self._holds.add(hold)

    def discard(self, hold: _Hold) -> None:
        with self._lock:
            self._holds.discard(hold)

    def listed(self) -> list[_Hold]:
        with self._lock:
            return list(self._holds)


class FleetLock:
    """Takes, renews and releases fleet locks through one Redis client. ``call`` runs one
    command with the tier's outage handling (``CallMode``); ``count`` and ``warn_once`` are
    the tier's counters and once-per-topic warnings."""

    def __init__(
        self,
        client: Any,
        call: ScriptCall,
        *,
        lock_ttl: float,
        count: Callable[[RemoteCount], None],
        warn_once: Callable[..., None],
    ) -> None:
        self.lock_ttl = lock_ttl
        self.renew_every = lock_ttl / 3  # two renewals may fail before the lock expires
        self._px = max(1, int(lock_ttl * 1000))
        self._client = client
        self._call = call
        self._count = count
        self._warn_once = warn_once
        self._acquire = client.register_script(_ACQUIRE_LUA)
        self._holds = PerProcess(_Holds)
        self.closed = threading.Event()

    @contextlib.contextmanager
    def hold(self, entry_name: str, wait: float) -> Iterator[bool]:
        """True: build now (this node holds the lock, or Redis cannot coordinate). False:
        the entry exists, or ``wait`` ran out."""
        # Not thread-local: the lock's own thread renews it, and may retry its release.
        lock = self._client.lock(entry_name + ":lock", timeout=self._px / 1000, thread_local=False)
        outcome, taken_at = self._take(entry_name, lock, wait)
        if outcome is not _Take.MINE:
            yield outcome is _Take.DOWN
            return
        hold = _Hold(self, lock, expires_at=taken_at + self.lock_ttl)
        holds = self._holds.get()
        holds.add(hold)
        hold.thread.start()
        try:
            yield True
        finally:
            # Not in a child forked meanwhile: the lock is the parent's, which still builds
            # and renews it; a release here, by the parent's token, would let another node
            # build too. The child has no thread of the hold, so nothing renews it there.
            if self._holds.made_here(holds):
                hold.leave()

    def close(self) -> None:
        """Stop renewing; try once more to release locks whose release is still pending.
        A lock still held (its with-block open) is left to expire: closing makes no promise
        that the build is over, and a block left after close touches Redis no more."""
        self.closed.set()
        holds = self._holds.get().listed()
        for hold in holds:
            hold.woken.set()
            if hold.pending:
                hold.release(CallMode.ALWAYS)

    # ------------------------------------------------------------------ internals

    def _take(self, entry_name: str, lock: Any, wait: float) -> tuple[_Take, float]:
        """(what asking came to, when the winning attempt was sent). Real time, not the
        tier's backoff clock: the wait is bounded by ``wait`` plus one attempt whatever the
        backoff state."""
        deadline = time.monotonic() + max(0.0, wait)
        token = secrets.token_hex(16).encode()  # only the owner's token renews or releases the lock
        pause = _POLL_FIRST
        waited = False
        unanswered: list[bool] = []  # the last attempt was sent and Redis did not answer it

        def acquire() -> Any:
            from redis.exceptions import ResponseError

            unanswered.append(True)
            try:
                result = self._acquire(keys=[entry_name, lock.name], args=[token, self._px])
            except ResponseError:  # Redis answered, refusing it (full, read-only): no lock was set
                unanswered.clear()
                raise
            unanswered.clear()
            return result

        while True:
            sent = time.monotonic()
            result = self._call(Call.LOCK, acquire, CallMode.NORMAL)
            if result is None:  # down, backing off, or refused (a full Redis): no coordination
                if unanswered:
                    self._unclaim(lock, token, sent)
                return _Take.DOWN, sent
            if result == 3:
                self._warn_once("lock-stale", "plancache: took over the fleet lock %s: it had no expiry or one beyond "
                                "lock_ttl (%.0f s), which no holder sets; give every node the same %s",
                                lock.name, self.lock_ttl, REDIS_LOCK_TTL.name)  # fmt: skip
            if result in (1, 3):
                lock.local.token = token  # held: redis-py's lock renews and releases it by this token
                return _Take.MINE, sent
            if result == 2:
                return _Take.BUILT, sent
            if not waited:
                waited = True
                self._count(RemoteCount.LOCK_WAITS)
                log.info("plancache: another node is building %s; waiting up to %.0f s", entry_name, wait)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return _Take.TIMEOUT, sent
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, _POLL_MAX)

    def _unclaim(self, lock: Any, token: bytes, sent: float) -> None:
        """An attempt whose reply was lost (timed out, a reset after the script ran) may still
        have set the lock: release it by its token on the lock's own thread, retried until
        Redis answers or the lock would have expired, so that no node waits on a lock nobody
        holds. Releasing a lock never set does nothing: the token is this attempt's alone."""
        lock.local.token = token
        hold = _Hold(self, lock, expires_at=sent + self.lock_ttl)
        hold.leave_to_thread()
        self._holds.get().add(hold)
        hold.thread.start()


def _answered(operation: Callable[[], Any]) -> int:
    """1 when one of redis-py's lock scripts acted, 0 when it found the lock no longer ours
    (expired, evicted, or another node's): either way Redis answered."""
    from redis.exceptions import LockNotOwnedError

    try:
        operation()
    except LockNotOwnedError:
        return 0
    return 1


class _Hold:
    """One lock this node holds: renewed by a daemon thread while the with-block runs, then
    released by the block's owner, or by the thread when that release could not reach Redis."""

    def __init__(self, owner: FleetLock, lock: Any, expires_at: float) -> None:
        self.owner = owner
        self.lock = lock
        self.token = lock.local.token
        self.expires_at = expires_at  # monotonic; by then Redis has dropped the lock anyway
        self.pending = False  # the block is over but the release has not reached Redis
        self._leaving = False  # set before the release, so a failed renewal is not "lost"
        self.woken = threading.Event()  # the block is over, or the tier closed
        self.thread = threading.Thread(target=self._run, name=f"plancache-lock-{lock.name.split(':')[-2][:12]}", daemon=True)

    def leave(self) -> None:
        """End of the with-block: release now, or leave it to the thread (never blocks on
        Redis for more than one attempt, and not at all once the tier is switched off)."""
        self._leaving = True
        if not self.owner.closed.is_set():  # once the tier is closed the lock expires by itself
            self.pending = not self.release(CallMode.ALWAYS)
            if not self.pending:
                self.owner._holds.get().discard(self)
        self.woken.set()

    def leave_to_thread(self) -> None:
        """The block is over without a release of its own: the thread retries it."""
        self.pending = self._leaving = True
        self.woken.set()

    def release(self, mode: CallMode) -> bool:
        """True once Redis answered: released, or already not ours (expired, taken)."""
        # do_release with the token kept here: redis-py's release() forgets the token first,
        # and a release that Redis did not answer is retried.
        if self.owner._call(Call.UNLOCK, lambda: _answered(lambda: self.lock.do_release(self.token)), mode) is None:
            return False
        self.pending = False
        return True

    def _run(self) -> None:
        try:
            self._renew_while_held()
            self._retry_release()
        except Exception as exc:  # a daemon thread must not die with a traceback; the lock expires
            log.debug("plancache: fleet lock thread for %s stopped: %r", self.lock.name, exc)
        finally:
            if not self.pending:
                self.owner._holds.get().discard(self)

    def _renew_while_held(self) -> None:
        while not self.woken.wait(self.owner.renew_every):
            if self._leaving or self.owner.closed.is_set():
                return
            sent = time.monotonic()
            result = self.owner._call(Call.RENEW, lambda: _answered(self.lock.reacquire), CallMode.BACKGROUND)
            if result == 1:
                self.expires_at = sent + self.owner.lock_ttl
            elif result == 0 and not self._leaving:
                # Expired during an outage longer than the expiry, evicted, or lost with a
                # Redis restarted without persistence: another node may build this plan too.
                self.owner._warn_once(
                    "lock-lost",
                    "plancache: lost the fleet lock %s while building (expired or evicted); another node may build the same plan",
                    self.lock.name,
                )
                return
            # None: Redis did not answer; try again next period while the lock may still exist.

    def _retry_release(self) -> None:
        self.woken.wait()
        pause = _RETRY_FIRST
        while self.pending and not self.owner.closed.is_set():
            remaining = self.expires_at - time.monotonic()
            if remaining <= 0:  # Redis has dropped the lock by itself
                self.pending = False
                return
            if self.owner.closed.wait(min(pause, remaining)):
                return
            if self.release(CallMode.BACKGROUND):
                log.info("plancache: released the fleet lock %s once Redis answered again", self.lock.name)
                return
            pause = min(pause * 2, _RETRY_MAX)
