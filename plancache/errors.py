"""Every error plancache raises. One base class; leaves also subclass the builtin a caller
already catches (``ValueError``, ``TimeoutError``, ``OSError``...).

This module imports nothing from plancache, so every other module may import it.
"""

from __future__ import annotations

import enum
import functools
from typing import Any

__all__ = ["BuildError", "BundleError", "BundleTargetError", "CacheDirError", "DamagedEntryError", "EntryNotFoundError",
           "ExecutionError", "InvalidGraphError", "LockTimeoutError", "ManifestError", "NativeError", "NativeLibrary", "NoGpuError",
           "PlanCacheError", "PlanCacheNotice", "RemoteError", "SchemaTooNewError", "StoreBusyError", "StoreError",
           "TensorMismatchError", "UnkeyableArgumentError", "UntaggedCallableError"]  # fmt: skip


class PlanCacheError(Exception):
    """Base class of every plancache error.

    Subclasses keep their fields as attributes and pickle across processes: the
    constructor's keyword arguments are kept in ``self.fields`` and replayed by
    ``__reduce__``.
    """

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields
        for name, value in fields.items():
            setattr(self, name, value)

    def __reduce__(self) -> tuple[Any, ...]:
        return (functools.partial(type(self), self.message, **self.fields), ())

    def __str__(self) -> str:
        return self.message


class InvalidGraphError(PlanCacheError, ValueError):
    """The caller's graph cannot be cached or built: a tensor without a uid, a node cuDNN
    rejects, an unsupported attribute. Fields: ``node`` (name or None), ``reason``."""


class UntaggedCallableError(InvalidGraphError):
    """The graph holds a callable (an attention ``score_mod``, say) and was described
    without a tag to stand for it: a function's behaviour cannot be keyed."""


class TensorMismatchError(PlanCacheError, ValueError):
    """Tensors passed to ``Plan.execute`` do not match the plan (missing, unknown, or of
    another shape, stride, dtype or device). Nothing was launched."""


class ExecutionError(PlanCacheError, RuntimeError):
    """The library failed to launch a plan whose tensors passed every check (a CUDA error,
    say). Fields: ``key``, ``device``; the library's own error is the cause."""


class UnkeyableArgumentError(PlanCacheError, TypeError):
    """An argument of a ``@cache.builder`` function has no value the builder can key its
    plan by (a mutable object, one hashed by identity, a callable without a tag): a plan
    remembered for it could be another graph's. Fields: ``argument`` (its position from 0,
    or its keyword)."""


class BuildError(PlanCacheError, RuntimeError):
    """No candidate plan of a valid graph could be built on this GPU."""


class NoGpuError(PlanCacheError, RuntimeError):
    """A GPU operation was asked for on a machine without a usable CUDA device."""


class StoreError(PlanCacheError, OSError):
    """The plan store could not be opened, read or written. Field: ``path``."""


class CacheDirError(StoreError):
    """The cache directory cannot be created, is not a directory, or is writable by
    other users. Field: ``path``."""


class SchemaTooNewError(StoreError):
    """The database was written by a newer plancache; it is left untouched.
    Fields: ``path``, ``found``, ``supported``."""


class DamagedEntryError(StoreError):
    """One stored entry cannot be decoded (a damaged text or JSON column); the rest of the
    store is fine. The cache quarantines it and rebuilds. Fields: ``path``, ``key``."""


class StoreBusyError(StoreError, TimeoutError):
    """The database stayed locked by other processes beyond the busy timeout."""


class LockTimeoutError(PlanCacheError, TimeoutError):
    """Waiting for another process to finish building the same plan took too long.
    Fields: ``key``, ``waited_s``."""


class EntryNotFoundError(PlanCacheError, KeyError):
    """No stored entry matches the given key or key prefix (its ``str`` is the message,
    unquoted: ``PlanCacheError.__str__`` comes before KeyError's). Field: ``key``."""


class ManifestError(PlanCacheError, ValueError):
    """A prewarm manifest is malformed. Fields: ``path``, ``entry`` (index or None),
    ``line`` (of the entry in the file, when known)."""


class BundleError(PlanCacheError, ValueError):
    """A bundle is truncated, tampered with, of a newer format, or unsafe. Fields: ``path``,
    ``reason``; ``found`` and ``supported`` for a newer format; ``key`` for a bad entry."""


class BundleTargetError(BundleError):
    """The file an export would write is refused: it exists, is not a regular file, cannot
    be written, or the bundle would be too large. Fields: ``path``, ``reason``."""


class RemoteError(PlanCacheError, ConnectionError):
    """The remote (Redis) tier failed or refused an entry."""


class CaptureInProgressError(PlanCacheError, RuntimeError):
    """A plan that is not loaded yet was asked for while the calling thread captures a CUDA
    graph: loading or building it would break the capture, so nothing was done. Look plans
    up (or call ``plan.prepare()``) before capturing. Field: ``key``."""


class TransientLoadError(PlanCacheError, RuntimeError):
    """A stored plan could not be loaded for a reason outside its entry (a CUDA-graph
    capture on another thread, no memory for the warm-up): the entry is kept and loaded
    again later. Raised by backends; a lookup turns it into an unstored build."""


#: cuDNN statuses that say nothing about the plan being loaded: host or device memory ran
#: out, or CUDA failed underneath (``CUDNN_STATUS_INTERNAL_ERROR_*_ALLOCATION_FAILED``, the
#: ``CUDNN_STATUS_EXECUTION_FAILED`` family). Every other status is cuDNN's word on the plan.
TRANSIENT_STATUSES = frozenset({4003, 4004, *range(5000, 5010)})


class NativeLibrary(enum.Enum):
    """Whose call failed, of a ``NativeError``."""

    CUDNN = "cudnn"  # cuDNN's C API
    CUDA = "cuda"  # the CUDA driver


class NativeError(PlanCacheError, RuntimeError):
    """A call into cuDNN's C API or the CUDA driver failed: ``call`` names it, ``status``
    is its status code, ``library`` says whose (a ``NativeLibrary``)."""

    call: str
    status: int
    library: NativeLibrary

    def __init__(self, message: str, *, call: str, status: int, library: NativeLibrary = NativeLibrary.CUDNN) -> None:
        super().__init__(message, call=call, status=status, library=library)

    @property
    def transient(self) -> bool:
        """Whether the failure is the process's, not the plan's: any CUDA driver failure,
        or a cuDNN status of ``TRANSIENT_STATUSES``."""
        return self.library is NativeLibrary.CUDA or self.status in TRANSIENT_STATUSES


class PlanCacheNotice(RuntimeWarning):
    """Why plancache leaves a graph to cuDNN Frontend's own planning (a graph it cannot
    key, a frontend version it was not made for, ...): once per reason and process, from
    ``plancache.integrations.frontend``. Never raised: under a filter that turns warnings into errors
    the notice is logged instead. Silence it with
    ``warnings.filterwarnings("ignore", category=plancache.PlanCacheNotice)``,
    ``-W ignore::plancache.PlanCacheNotice``, or in pytest's configuration
    ``filterwarnings = ["ignore::plancache.PlanCacheNotice"]``."""
