"""Plans a process built and never stored, and why.

Before a plan built on a miss is stored, it is loaded back from its blob the way lookups of
it will load it: by the lookup's own ``load`` (the frontend drop-in deserializes straight
into the caller's graph), else by the backend's ``load``. The plan loaded back is the one
this process then runs, so the process that built a plan launches it exactly as every
later process will. Then the entry is judged as every later lookup will judge it
(``store.entry.unsound``: its checksums, its key, its blob against the key's graph).

A plan that cannot be loaded back, or that the judge refuses, is used by the process that
built it and never stored or published: a later lookup would find a plan it cannot load,
or refuse it, quarantine it and build it again on every start. A judge that refuses a plan
the frontend just built for this very graph is wrong about the frontend (a defect of
plancache): each is counted (``unloadable``, ``judge_disagreements``), kept for ``stats``
(the latest ones), written to the store for ``plancache stats`` (the graph, the reason and
how often), and told once per process with why.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from collections.abc import Callable

from ..formats.plan_blob import PlanBlob
from ..guest.backend import Backend, BuiltPlan, Load
from ..key import CacheKey
from ..store import Entry, summarize
from ..store.per_process import PerProcess
from ..tiers.local import LocalTier
from .counters import Count, Counters

__all__ = ["KEPT", "Unstored", "Why"]

#: The unstored plans ``stats`` lists: the latest ones.
KEPT = 64


class Why(enum.Enum):
    """Why a plan this process built was not stored (the value: its counter)."""

    UNLOADABLE = Count.UNLOADABLE  # it could not be loaded back from its blob
    JUDGE_DISAGREES = Count.JUDGE_DISAGREEMENTS  # the judge refused the plan the frontend built for this graph


class Unstored:
    """The plans a cache built and refused to store."""

    def __init__(self, backend: Backend, counters: Counters, local: LocalTier, warn: Callable[..., None]) -> None:
        self.backend = backend
        self.counters = counters
        self.local = local
        self._warn_once = warn
        self._lock = PerProcess(threading.Lock)  # the plans are kept in a forked child; the lock is not
        self._refused: OrderedDict[str, tuple[str, Why, str]] = OrderedDict()  # key -> (graph, why, reason)
        #: The entries the judge refused, the latest ones: the blob and description a report of
        #: the defect needs (``scripts/record_plans.py`` records them).
        self.disagreements: OrderedDict[str, Entry] = OrderedDict()
        #: The first reason the judge gave this process for refusing a plan just built.
        self.first_disagreement: str | None = None

    def load_back(self, key: CacheKey, built: BuiltPlan, blob: PlanBlob, device: int, load: Load | None) -> object:
        """``built`` loaded back from its blob (``blob``: its bytes, read once for this load
        and the judge) as lookups of ``key`` will load it (``load``, else the backend's);
        None, counted, kept and told once, when it cannot be."""
        try:
            return (load or self.backend.load)(blob, built.tensors, device)
        except Exception as exc:  # the library refusing the blob it just wrote, or failing for now
            cause = f"{type(exc).__name__}: {str(exc)[:300]}"
        self.note(key, Why.UNLOADABLE, f"it could not be loaded back from its blob ({cause})")
        return None

    def note(self, key: CacheKey, why: Why, reason: str, entry: Entry | None = None) -> None:
        """Count, keep, record in the store and tell once that the plan of ``key`` is not
        stored (``entry``: the one the judge refused)."""
        label = summarize(key.parts["graph"])
        with self._lock.get():
            self.counters.count(why.value)
            self._refused[key.digest] = (label, why, reason)
            if entry is not None:
                self.disagreements[key.digest] = entry
            for kept in (self._refused, self.disagreements):
                while len(kept) > KEPT:
                    kept.popitem(last=False)
            if why is Why.JUDGE_DISAGREES and self.first_disagreement is None:
                self.first_disagreement = reason
        self.local.note_unstored(key.digest, label, why.value, reason)
        if why is Why.JUDGE_DISAGREES:
            self._warn_once("judge-disagrees", "plancache: the judge refuses a plan cuDNN Frontend just built for its own "
                            "graph, %s (%s): %s. This is a defect of plancache: the plan is used, not stored; later ones "
                            "are counted in stats (judge_disagreements)", key.digest[:12], label, reason)  # fmt: skip
        else:
            self._warn_once(f"unloadable-{key.digest}", "plancache: not storing the plan of %s (%s): %s", key.digest[:12],
                            label, reason)  # fmt: skip

    def why(self, digest: str) -> tuple[Why, str] | None:
        """Why the plan of ``digest`` was not stored, and the reason in words (None: it was
        not refused here)."""
        with self._lock.get():
            refused = self._refused.get(digest)
        return (refused[1], refused[2]) if refused is not None else None

    def report(self) -> dict[str, dict[str, str]]:
        """``{key: {"graph", "why", "reason"}}`` of the latest unstored plans (``stats``)."""
        with self._lock.get():
            return {
                key: {"graph": label, "why": why.value, "reason": reason} for key, (label, why, reason) in self._refused.items()
            }
