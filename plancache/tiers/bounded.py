"""Bounds on one Redis operation as a whole: a deadline, and the bytes its replies may take.

redis-py has neither: its ``socket_timeout`` bounds one read, so a server that sends one byte
just before each timeout keeps a call going for as long as it likes, and a value of any size
is read whole before plancache sees how large it is. So every command the tier makes runs
``within`` an operation's bounds (the breaker opens them around each call), and each
connection's socket is a ``BoundedSocket`` that checks them before every read and write
(``recv``, and ``recv_into`` for redis-py's hiredis parser): the socket timeout shrinks to
what is left of the deadline, and a reply larger than the operation may read is cut off.
Either ends the call with an error redis-py handles as a broken connection: the connection
is dropped, never reused half-read.
"""

from __future__ import annotations

import contextlib
import errno
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["BoundedSocket", "bounded_connection", "within"]


class _Bounds:
    """What is left to the operation running on this thread."""

    def __init__(self, deadline: float, max_bytes: int) -> None:
        self.deadline = deadline  # monotonic
        self.bytes_left = max_bytes


_current = threading.local()


@contextlib.contextmanager
def within(seconds: float, max_bytes: int) -> Iterator[None]:
    """Run the commands of the block as one operation: they end by ``seconds`` from now and
    read at most ``max_bytes`` from the server, however the server sends them."""
    outer = getattr(_current, "bounds", None)
    _current.bounds = _Bounds(time.monotonic() + seconds, max_bytes)
    try:
        yield
    finally:
        _current.bounds = outer


class BoundedSocket:
    """A connection's socket, held to the bounds of the operation that uses it.

    Outside an operation (redis-py closing a connection, say) it is the socket it wraps.
    ``settimeout`` is kept as redis-py asks (0 for its non-blocking peek at a pooled
    connection), and only shortened to the deadline before each call.
    """

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._timeout: float | None = sock.gettimeout()

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout
        self._sock.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self._timeout

    # recv_into and flags: how redis-py's hiredis parser (its choice where hiredis is
    # installed) reads, and peeks (MSG_PEEK, counted as read: a byte at most) at a pooled
    # connection to see whether the server closed it.
    def recv(self, size: int, flags: int = 0) -> bytes:
        data: bytes = self._sock.recv(self._readable(size), flags)
        self._spent(len(data))
        return data

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        count: int = self._sock.recv_into(buffer, self._readable(nbytes or len(buffer)), flags)
        self._spent(count)
        return count

    def sendall(self, data: Any) -> None:
        self._bound()
        self._sock.sendall(data)  # with a timeout, sendall's is for the whole send

    def __getattr__(self, name: str) -> Any:  # fileno, shutdown, close...: the socket's own
        return getattr(self._sock, name)

    def _readable(self, size: int) -> int:
        """``size`` cut to what the operation may still read."""
        bounds = self._bound()
        if bounds is None:
            return size
        if bounds.bytes_left <= 0:
            raise OSError(errno.EMSGSIZE, "the reply is larger than a Redis operation of plancache may read")
        return min(size, bounds.bytes_left)

    def _spent(self, size: int) -> None:
        bounds: _Bounds | None = getattr(_current, "bounds", None)
        if bounds is not None:
            bounds.bytes_left -= size

    def _bound(self) -> _Bounds | None:
        bounds: _Bounds | None = getattr(_current, "bounds", None)
        if bounds is None:
            return None
        left = bounds.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the Redis operation ran past its deadline")  # what a socket timeout raises
        self._sock.settimeout(left if self._timeout is None else min(self._timeout, left))
        return bounds


def bounded_connection(base: Any) -> type:
    """``base`` (the redis-py connection class a URL picked: TCP, TLS or Unix socket) with
    its socket wrapped in a ``BoundedSocket``, the TLS layer, if any, inside it."""

    def _connect(self: Any) -> BoundedSocket:
        return BoundedSocket(base._connect(self))

    return type(f"Bounded{base.__name__}", (base,), {"_connect": _connect})
