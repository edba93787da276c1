"""The kernel cache of dynamic-shape builds, kept in the store per environment.

cuDNN shares compiled kernels between the dynamic-shape graphs of a process through one
kernel cache. With ``persist_kernel_cache``, the stored one of this environment (never
another's: it is stored under the environment id) is restored before the process's first
dynamic-shape build, and stored again after a build that changed it, so a later process
compiles fewer kernels. A kernel cache the backend refuses only costs compile time.

Whether it was restored, and what was stored, are the process's own: a forked child's
backend starts with a fresh kernel cache, which the child restores before its first
dynamic-shape build (else it would store its smaller one over the stored one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..guest.backend import Backend
from ..store import sha256
from ..store.per_process import PerProcess
from ..tiers.local import LocalTier
from .counters import Count, Counters

__all__ = ["KernelCache"]


@dataclasses.dataclass
class _Process:
    restored: bool = False
    digest: str | None = None  # of the blob stored or restored last


@dataclasses.dataclass
class KernelCache:
    """Restores and saves one environment's kernel cache for a lookup's dynamic builds."""

    backend: Backend
    local: LocalTier
    counters: Counters
    warn_once: Callable[..., None]
    persist: bool
    _process: PerProcess[_Process] = dataclasses.field(default_factory=lambda: PerProcess(_Process), init=False)

    def restore(self, env_id: str) -> None:
        """Before this process's first dynamic-shape build: load the stored kernel cache of
        ``env_id``, once."""
        process = self._process.get()
        if process.restored or not self.persist:
            return
        process.restored = True
        blob = self.local.kernel_cache(env_id)
        if blob is None:
            return
        try:
            self.backend.restore_kernel_cache(blob)
        except Exception as exc:  # a refused kernel cache only costs compile time
            self.warn_once("kernel-cache", "plancache: the stored kernel cache was refused (%s); building without it", exc)
            return
        process.digest = sha256(blob)
        self.counters.count(Count.KERNEL_CACHE_RESTORES)

    def save(self, env_id: str) -> None:
        """After a dynamic-shape build: store the kernel cache if it changed."""
        if not self.persist:
            return
        process = self._process.get()
        blob = self.backend.kernel_cache_blob()
        if blob and sha256(blob) != process.digest and self.local.put_kernel_cache(env_id, blob):
            process.digest = sha256(blob)
