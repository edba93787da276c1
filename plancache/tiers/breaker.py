"""The Redis tier's calls, and its counters and warnings.

Each call is one attempt that never raises. A call that gets no answer (refused, timed
out, reset) starts an outage: calls are skipped for a backoff that doubles up to
``backoff_max``, and once failed calls have cost ``max_stall`` seconds the tier is off for
the rest of the process (the bound this makes: "Bounded delay" in ``remote``). A Redis
that answers with an error (full, read-only replica, no permission) is up: only that call
fails. Each kind of trouble is one warning, then debug lines. Every call runs within the
bounds of one operation (``bounded.within``): a deadline for the whole call, however the
server sends its reply, and a cap on the bytes it may read; past either the call is a
failure like a timeout.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from ..config import StrEnum
from ..store.per_process import PerProcess
from .bounded import within

__all__ = ["FAILED", "Breaker", "Call", "CallMode", "RemoteCount"]

log = logging.getLogger("plancache.remote")
T = TypeVar("T")


class RemoteCount(StrEnum):
    """The tier's counters, in the order its stats list them."""

    REMOTE_HITS = "remote_hits"
    REMOTE_MISSES = "remote_misses"
    PUBLISHES = "publishes"
    REFUSED = "refused"
    ERRORS = "errors"
    LOCK_WAITS = "lock_waits"
    SKIPPED = "skipped"


class Call(StrEnum):
    """A Redis call of the tier, as its messages and warnings name it."""

    GET = "get"
    PUT = "put"
    LOCK = "lock"
    UNLOCK = "unlock"
    RENEW = "renew"


class CallMode(enum.Enum):
    """How the tier makes one call."""

    NORMAL = "normal"  # skipped while the tier backs off
    # Attempted even then (a release), counted against max_stall, skipped only once the tier is switched off.
    ALWAYS = "always"
    # From the lock's own thread: it delays no caller, so it is made whatever the tier's state
    # and is not counted against max_stall.
    BACKGROUND = "background"


# What a write that Redis refuses for lack of memory costs, per call, for its one warning.
_WHEN_FULL = {
    Call.PUT: "the plan is still served from the local store",
    Call.LOCK: "building without the fleet lock (another node may build the same plan)",
}

_monotonic = time.monotonic  # one name, so tests can drive the backoff clock


class _Failed(enum.Enum):
    FAILED = "failed"


FAILED = _Failed.FAILED
#: The backoff doubles at most this many times: 2**63 s is past any backoff_max.
_MAX_DOUBLINGS = 63


class Breaker:
    """Runs the tier's Redis commands (``call``) and keeps its counters and warnings.
    ``redis``: the redis-py module (its error classes tell an outage from a refusal); ``url``:
    the tier's URL, password hidden; ``deadline`` (seconds), ``max_reply`` (bytes): each
    call's bounds."""

    def __init__(self, redis: Any, url: str, *, backoff_max: float, max_stall: float, deadline: float, max_reply: int) -> None:
        self.url = url
        self.backoff_max = backoff_max
        self.max_stall = max_stall
        self.deadline = deadline
        self.max_reply = max_reply
        self._redis = redis
        # Connection trouble backs the tier off; a server that answers with an error is up.
        self._outage_errors = (redis.ConnectionError, redis.TimeoutError, OSError)
        self._counters = dict.fromkeys([c.value for c in RemoteCount], 0)
        # A forked child keeps the counters and the backoff, not the locks (a thread of the
        # parent may have held one at the fork).
        self._counter_lock = PerProcess(threading.Lock)
        self._state_lock = PerProcess(threading.Lock)
        self._failures = 0  # consecutive failed attempts of the current outage
        self._retry_at = 0.0  # monotonic time before which calls are skipped
        self._stalled = 0.0  # seconds spent in failed calls, this process
        self._disabled = False  # max_stall spent
        self._outage_warned = False
        self._warned: set[str] = set()

    @property
    def available(self) -> bool:
        """Whether the next call would reach out to Redis (not backing off, not switched off)."""
        with self._state_lock.get():
            return not self._disabled and _monotonic() >= self._retry_at

    def count(self, name: RemoteCount, by: int = 1) -> None:
        with self._counter_lock.get():
            self._counters[name] += by

    def counters(self) -> dict[str, int]:
        with self._counter_lock.get():
            return dict(self._counters)

    def warn_once(self, topic: str, message: str, *args: Any) -> None:
        """A warning the first time per topic, debug lines after."""
        with self._counter_lock.get():
            first = topic not in self._warned
            self._warned.add(topic)
        log.log(logging.WARNING if first else logging.DEBUG, message, *args)

    def call(self, what: Call, op: Callable[[], T], mode: CallMode = CallMode.NORMAL) -> T | Literal[_Failed.FAILED]:
        """Run one Redis command, or skip it while backing off (``CallMode``); never raises."""
        if mode is not CallMode.BACKGROUND:
            with self._state_lock.get():
                skip = self._disabled or (mode is CallMode.NORMAL and _monotonic() < self._retry_at)
            if skip:
                self.count(RemoteCount.SKIPPED)
                return FAILED
        started = time.perf_counter()  # real time even when tests drive _monotonic
        try:
            with within(self.deadline, self.max_reply):
                result = op()
        except Exception as exc:
            if isinstance(exc, self._redis.RedisError) and not isinstance(exc, self._outage_errors):
                self._recovered()
                self._rejected(what, exc)
                return FAILED
            # No answer (refused, timed out, reset, past the deadline), or one redis-py could not
            # read (no Redis sends it: a hostile or broken server): an outage either way.
            if mode is CallMode.BACKGROUND:  # the caller-facing calls warn about the outage
                log.debug("plancache: Redis %s did not answer %s (%s: %s)", self.url, what, type(exc).__name__, exc)
            else:
                self._outage(what, exc, time.perf_counter() - started)
            return FAILED
        self._recovered()
        return result

    def script_call(self, what: Call, op: Callable[[], Any], mode: CallMode) -> int | None:
        """``call`` for the lock's scripts, whose replies are integers: None when it failed."""
        result = self.call(what, op, mode)
        return None if result is FAILED else int(result)

    def _rejected(self, what: Call, exc: BaseException) -> None:
        """Redis answered with an error: it is up (no backoff); only this call failed."""
        self.count(RemoteCount.ERRORS)
        if isinstance(exc, self._redis.exceptions.OutOfMemoryError) and what in _WHEN_FULL:
            # maxmemory reached, under any policy: allkeys-lru first evicts what it can,
            # then still refuses a value larger than the memory that frees.
            self.warn_once(f"full-{what}", "plancache: Redis %s rejected %s: it is full (%s); %s. Logged once, counted in `errors`",
                           self.url, "a publish" if what is Call.PUT else "the fleet lock", exc, _WHEN_FULL[what])  # fmt: skip
        else:
            self.warn_once(f"rejected-{what}", "plancache: Redis %s rejected %s (%s); continuing locally", self.url, what, exc)

    def _outage(self, what: Call, exc: BaseException, elapsed: float) -> None:
        self.count(RemoteCount.ERRORS)
        with self._state_lock.get():
            now = _monotonic()
            self._stalled += elapsed
            if now >= self._retry_at:  # concurrent failures of one attempt back off once
                self._failures += 1
                # The exponent is capped: after an outage of days, 2.0 ** failures would
                # overflow a float and raise from every later call.
                self._retry_at = now + min(self.backoff_max, 2.0 ** min(self._failures - 1, _MAX_DOUBLINGS))
            first, self._outage_warned = not self._outage_warned, True
            give_up = self._stalled >= self.max_stall and not self._disabled
            self._disabled = self._disabled or give_up
            delay = self._retry_at - now
        if first:
            log.warning("plancache: Redis tier %s unreachable on %s (%s: %s); working locally, retrying in %.0f s (backing off "
                        "to %.0f s)", self.url, what, type(exc).__name__, exc, delay, self.backoff_max)  # fmt: skip
        if give_up:
            log.warning("plancache: Redis tier %s cost %.1f s in failed calls (max_stall %.1f s); switched off until this "
                        "process restarts", self.url, self._stalled, self.max_stall)  # fmt: skip

    def _recovered(self) -> None:
        if not self._outage_warned:  # the common case: no lock taken
            return
        with self._state_lock.get():
            failures, self._failures, self._retry_at, self._outage_warned = self._failures, 0, 0.0, False
        log.info("plancache: Redis tier %s answers again (after %d failed attempts)", self.url, failures)
