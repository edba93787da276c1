"""Priming: loading stored plans into memory on a background thread, before they are asked for.

A warm start spends its time in cuDNN's first use of each engine family (loading kernels,
tens of milliseconds each) and in creating handles; a lookup pays it whether or not the
plan was built in this process. Paid on a background thread while the program imports and
loads its weights, it is gone from the first step.

Auto-prime needs no code: each process records, per application, which plans it used
(``LocalTier.note_use``, written with the hit counts), and a cache that opens starts a
``Primer`` over the plans the application's latest run used, in the order it used them
(``PLANCACHE_AUTO_PRIME=0`` turns it off). The application is ``PLANCACHE_APP``, else the
entry script (plus the local rank when a launcher sets ``LOCAL_RANK``, since each rank uses
its own device). Use is recorded with priming off too, so turning it on works at the next
start.

It is on by default because stored plans load through cuDNN's C API, which captures,
allocates and synchronizes nothing and holds no GIL (the frontend's own deserialize can
break a capture the program makes at the same moment: docs/priming.md). A blob that only
the frontend's path can load is loaded that way as a guest, one such load at a time.

The primer never sets a device up: it waits until the program's own work has created
the device's CUDA context (``Backend.device_in_use``), so a program that runs on another
GPU than its last run did never gets a context on the old one (memory there, taken from
whoever runs on it). It gives up on a device the program has not used within
``DEVICE_WAIT_S``.

A primed plan is loaded exactly as a lookup loads it (judged sound, then deserialized on
its device) and kept in the memory tier, so the lookup is a memory hit. What needs no
device is done before the device is ready: cuDNN's libraries are opened (with the GIL
released, so the device's first query is then quick) and the entries read and judged, all
but their environment (``READ_AHEAD``). Once the device is ready, what is left is cuDNN's
handle, made once per device, and each plan's finalize. A lookup of a plan being primed
waits for that load instead of loading it twice; the primer starts a load only while no
lookup is loading or building, and never writes to the store.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import NotRequired, TypedDict

from ..config import APP
from ..store import Entry, Sound, Unsound
from ..store.per_process import PerProcess
from .lookup import Lookup, Primed, Priming

__all__ = ["DEVICE_WAIT_S", "THREADS", "Primer", "app_name"]

log = logging.getLogger("plancache")

#: How long the primer waits for the program to set up a device its last run used.
DEVICE_WAIT_S = 300.0
_POLL_S = 0.01  # how often it looks (one driver call)
#: Plans whose stored entries the primer reads and judges before the program's device is
#: ready (the rest as they are loaded): reading, decoding and judging them is host work
#: that needs no device, taken off the time between the device's readiness and the
#: weights' end, when the program's own CUDA work slows every CUDA call of the primer.
READ_AHEAD = 256  # each holds its decoded blob (about its size again) until its load
#: Threads the primer loads on. A native load is mostly cuDNN's finalize, which holds no GIL
#: and runs on the host, so loads on several threads overlap, and each engine family's first
#: finalize (tens of ms, its kernels loaded) holds up only its own family (docs/priming.md
#: has the runs). Four where the process may use 16 CPUs or more, else two: more compete
#: with the program's own start-up.
THREADS = 4 if (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1) >= 16 else 2


def app_name() -> str:
    """The application whose plan use is recorded: ``PLANCACHE_APP``, else the entry
    script's absolute path (``python -m pkg.mod``: the module's file), else ``python``
    for an interactive interpreter; with ``#rank{LOCAL_RANK}`` when a launcher sets it."""
    name = APP.from_env()
    if not name:
        main = sys.modules.get("__main__")
        script = getattr(main, "__file__", None) or (sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c") else None)
        name = str(Path(script).resolve()) if script else "python"
    rank = os.environ.get("LOCAL_RANK", "").strip()
    return f"{name}#rank{rank}" if rank else name


class PrimerReport(TypedDict):
    """``Primer.report``: plans primed and loaded, those skipped (key -> why), seconds."""

    primed: int
    loaded: int
    skipped: dict[str, str]
    seconds: float
    libraries_opened: NotRequired[int]


class Primer(threading.Thread):
    """Loads stored plans into a cache's memory tier, in order, on a daemon thread.

    ``plans``: ``(key, device)`` pairs. ``report`` (complete after ``join``): ``primed``
    (loaded by the primer), ``loaded`` (already in memory or loaded by a lookup
    meanwhile), ``skipped`` {key: why: not stored, unsound, another environment, no such
    device}, ``seconds``, and ``timeline()`` (seconds from the primer's creation, which is
    the cache's opening). Priming is an optimization: it never raises and never writes.
    """

    def __init__(self, lookup: Lookup, plans: Iterable[tuple[str, int]] | None = None) -> None:
        super().__init__(name="plancache-primer", daemon=True)
        self.lookup = lookup  # the cache's Lookup: its store, backend and loads
        self.plans = list(plans) if plans is not None else None  # None: the app's latest run, read on the thread
        self.report: PrimerReport = {"primed": 0, "loaded": 0, "skipped": {}, "seconds": 0.0}
        self.stopping = threading.Event()  # set by stop(): close() and interpreter exit
        # Per process: a forked child may still ask a primer of its parent's for its report
        # or timeline (kept), while a thread of the parent may have been inside the lock.
        self._lock = PerProcess(threading.Lock)
        # Held while a device's environment is asked for (CUDA calls, waits for the program),
        # only by the primer's own threads: a forked child has none, and a thread is started once.
        self._asking = threading.Lock()
        self._environments: dict[int, dict[str, object] | str] = {}
        self.opened = time.perf_counter()
        self._ready: dict[int, float] = {}  # device -> when its environment was known
        self._handles: dict[int, tuple[float, float]] = {}  # device -> when its cuDNN handle was made
        self._libraries: tuple[float, float] | None = None  # when cuDNN's libraries were opened
        #: (key, device, outcome, marks, label) of each plan taken, in order
        self._spans: list[tuple[str, int, Primed, dict[str, tuple[float, float]], str]] = []
        #: read ahead: key -> (entry, its verdict judged without an environment, when)
        self._entries: dict[str, tuple[Entry, Sound | Unsound, tuple[float, float]]] = {}

    def run(self) -> None:
        started = time.perf_counter()
        try:
            plans = self.plans if self.plans is not None else self.lookup.local.latest_run()
            self._read_ahead(plans[:READ_AHEAD])
            self._prime(self._families_first(plans))
        except Exception as exc:  # never an error for the program: its lookups still work
            log.warning("plancache: priming stopped: %s: %s", type(exc).__name__, exc)
        self.report["seconds"] = time.perf_counter() - started

    def _read_ahead(self, plans: list[tuple[str, int]]) -> None:
        """Before any device is ready: open cuDNN's libraries, then read the entries (host work only)."""
        if not plans:
            return
        started = time.perf_counter()
        try:
            self.report["libraries_opened"] = self.lookup.backend.open_libraries()
        except Exception as exc:  # the first load opens them itself
            log.debug("plancache: the primer could not open cuDNN's libraries: %s: %s", type(exc).__name__, exc)
        self._libraries = (started, time.perf_counter())
        for digest, _ in plans:
            if self.stopping.is_set():
                return
            began = time.perf_counter()
            try:
                entry = self.lookup.local.get(digest, details=False)  # a hit's read: no candidates or timing records
            except Exception:  # an undecodable row: read again, and judged, when it is primed
                continue
            if entry is None:
                continue
            # Judged whole but for the environment, which needs the device (``store.held_to``),
            # and the load's record read from the blob the judge decoded: after the device is
            # ready, a primed plan costs its finalize and little else.
            verdict = self.lookup.judging.judge(entry)
            if isinstance(verdict, Sound):
                self.lookup.backend.read_ahead(verdict.blob)
            self._entries[digest] = (entry, verdict, (began, time.perf_counter()))

    def _families_first(self, plans: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """``plans`` with the first of each family (its graph's first op, on its device) put
        first, the rest in order. A family's first finalize loads its kernels (tens of ms,
        against a fraction of one for each later plan; docs/priming.md): in order of use,
        the primer's threads would all wait on one family's load, then on the next; begun
        together, they overlap."""
        first: list[tuple[str, int]] = []
        rest: list[tuple[str, int]] = []
        seen: set[tuple[str, int]] = set()
        for digest, device in plans:
            held = self._entries.get(digest)
            family = (held[0].label.split("+", 1)[0], device) if held is not None else None
            if family is not None and family not in seen:
                seen.add(family)
                first.append((digest, device))
            else:
                rest.append((digest, device))
        return first + rest

    def _prime(self, plans: list[tuple[str, int]]) -> None:
        """Load ``plans`` in order on ``THREADS`` threads (this one among them): a load
        through cuDNN's C API holds no GIL, so loads on two threads overlap."""
        todo = collections.deque(plans)
        helpers = [threading.Thread(target=self._work, args=(todo,), name=f"plancache-primer-{i}", daemon=True)
                   for i in range(1, min(THREADS, len(plans)))]  # fmt: skip
        for helper in helpers:
            helper.start()
        self._work(todo)
        for helper in helpers:
            helper.join()

    def _work(self, todo: collections.deque[tuple[str, int]]) -> None:
        try:
            self._load_each(todo)
        except Exception as exc:  # on a helper thread too: never the program's threading.excepthook
            log.warning("plancache: priming stopped: %s: %s", type(exc).__name__, exc)

    def _load_each(self, todo: collections.deque[tuple[str, int]]) -> None:
        lookup, report = self.lookup, self.report
        while not (lookup.closed or self.stopping.is_set()):
            try:
                digest, device = todo.popleft()
            except IndexError:
                return
            environment = self._environment(device)
            if isinstance(environment, str):
                with self._lock.get():
                    report["skipped"][digest] = environment
                continue
            lookup.backend.use_device(device)
            marks: dict[str, tuple[float, float]] = {}
            entry, verdict, read = self._entries.pop(digest, (None, None, None))
            outcome = lookup.prime(digest, environment, device, stop=self.stopping, marks=marks, entry=entry, ahead=verdict)
            if read is not None:
                marks["read"] = read
            with self._lock.get():
                self._spans.append((digest, device, outcome, marks, entry.label if entry is not None else ""))
                if outcome.outcome is Priming.SKIPPED:
                    report["skipped"][digest] = outcome.why
                elif outcome.outcome is Priming.PRIMED:
                    report["primed"] += 1
                else:
                    report["loaded"] += 1

    def _environment(self, device: int) -> dict[str, object] | str:
        with self._lock.get():
            known = self._environments.get(device)
        if known is None:
            # Asked once per device: the other threads wait for the answer rather than ask
            # CUDA again while the program's own CUDA work makes every call slow.
            with self._asking:
                with self._lock.get():
                    known = self._environments.get(device)
                if known is None:
                    known = self._environment_of(device)  # may wait for the program: not under self._lock
                    with self._lock.get():
                        self._environments[device] = known
        return known

    def timeline(self) -> dict[str, object]:
        """What the primer did when, in seconds from the cache's opening: the opening of
        cuDNN's libraries, each device's readiness (its environment known, after the
        program set it up) and the making of its cuDNN handle, then each plan in the order
        the primer took it: its wait for builds to finish, its read and judgement (ahead of
        the device, when it was), its finalize, and when this run's first lookup asked for
        it (None: not yet)."""
        since = self.opened
        with self._lock.get():
            spans = list(self._spans)
            ready = dict(self._ready)
            handles = dict(self._handles)
        asked = dict(self.lookup.first_asked)
        plans = []
        for digest, device, outcome, marks, label in spans:
            plan: dict[str, object] = {"key": digest[:12], "label": label, "device": device, "outcome": str(outcome)}
            for stage, (start, end) in marks.items():
                plan[stage] = [round(start - since, 4), round(end - since, 4)]
            first = asked.get((digest, device))
            plan["asked"] = round(first - since, 4) if first is not None else None
            plans.append(plan)
        return {"libraries": [round(t - since, 4) for t in self._libraries] if self._libraries else None,
                "device_ready": {str(d): round(t - since, 4) for d, t in ready.items()},
                "handle": {str(d): [round(s - since, 4), round(e - since, 4)] for d, (s, e) in handles.items()},
                "plans": plans}  # fmt: skip

    def _environment_of(self, device: int) -> dict[str, object] | str:
        """The environment of ``device`` once the program uses it, or why its plans are
        skipped."""
        backend = self.lookup.backend
        try:
            # Nothing of CUDA (cuInit included) before the program's own first use: a
            # program may still fork its CUDA workers, and CUDA in such children is undefined.
            if not self._wait_until_used(device):
                return f"device {device} was not used by this process within {DEVICE_WAIT_S:.0f} s"
            if not 0 <= device < backend.device_count():
                return f"no device {device} here"
            backend.use_device(device)  # this thread's device: a new thread starts on device 0
            environment: dict[str, object] = dict(self.lookup.environment(device)[0])
            began = time.perf_counter()
            with self._lock.get():
                self._ready[device] = began
            # cuDNN's handle, once for every thread: it waits for the work the program
            # queued on the legacy stream (a copy of its weights, say), so it is a stage of its own.
            backend.prepare(device)
            with self._lock.get():
                self._handles[device] = (began, time.perf_counter())
            return environment
        except Exception as exc:  # no GPU now, a driver problem: the lookups will say
            return f"device {device} unusable: {type(exc).__name__}: {exc}"

    def _wait_until_used(self, device: int) -> bool:
        deadline = time.monotonic() + DEVICE_WAIT_S
        while not self.lookup.backend.device_in_use(device):
            if self.stopping.wait(_POLL_S) or time.monotonic() > deadline:
                return False
        return True

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the load under way (if any) and wait for the thread, up to ``timeout``."""
        self.stopping.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)
