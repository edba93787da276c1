"""Plans that are never stored because they could not be loaded back.

Before a plan built on a miss is stored, it is loaded back from its blob the way lookups of
it will load it: by the lookup's own ``load`` (the frontend drop-in deserializes straight
into the caller's graph), else by the backend's ``load``. The plan loaded back is the one
this process then runs, so the process that built a plan launches it exactly as every
later process will. One that cannot be loaded back is used by the process that built it
(as built) and never stored or published: a later lookup would find a plan it cannot
load. Each is counted (``unloadable``), kept for ``stats`` (the latest ones) and told
once, with why.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..engines.backend import Backend, BuiltPlan, Load
from ..key import CacheKey
from ..store import summarize
from .counters import Counters

__all__ = ["KEPT", "Unloadable"]

#: The refused plans ``stats`` lists: the latest ones.
KEPT = 64


class Unloadable:
    """The plans a cache refused to store because they could not be loaded back."""

    def __init__(self, backend: Backend, counters: Counters, warn: Callable[..., None]) -> None:
        self.backend = backend
        self.counters = counters
        self._warn_once = warn
        self._lock = threading.Lock()
        self._refused: OrderedDict[str, tuple[str, str]] = OrderedDict()  # key -> (graph, why)

    def load_back(self, key: CacheKey, built: BuiltPlan, device: int, load: Load | None) -> Any:
        """``built`` loaded back from its blob as lookups of ``key`` will load it (``load``,
        else the backend's); None, counted, kept and told once, when it cannot be."""
        try:
            return (load or self.backend.load)(built.blob, built.tensors, device)
        except Exception as exc:  # the library refusing the blob it just wrote, or failing for now
            cause = f"{type(exc).__name__}: {str(exc)[:300]}"
        why, label = f"it could not be loaded back from its blob ({cause})", summarize(key.parts["graph"])
        with self._lock:
            self.counters.count("unloadable")
            self._refused[key.digest] = (label, why)
            while len(self._refused) > KEPT:
                self._refused.popitem(last=False)
        self._warn_once(f"unloadable-{key.digest}", "plancache: not storing the plan of %s (%s): %s", key.digest[:12], label, why)
        return None

    def why(self, digest: str) -> str | None:
        """Why the plan of ``digest`` was not stored (None: it was not refused here)."""
        with self._lock:
            refused = self._refused.get(digest)
        return refused[1] if refused is not None else None

    def report(self) -> dict[str, dict[str, str]]:
        """``{key: {"graph", "why"}}`` of the latest refused plans (``stats``)."""
        with self._lock:
            return {key: {"graph": label, "why": why} for key, (label, why) in self._refused.items()}
