"""Prewarm shared across the GPUs of one machine: one worker process per device.

Keys depend on the GPU model, driver and library versions, never on a device index, so a
plan built on device 1 is the plan device 0 would have built, provided both devices have
one environment (each worker reports its device's; nothing is built until all agree). Entries go to the workers one at a
time, each worker getting the next when it is done: build times differ by 100x between
graphs, so a fixed split would leave devices idle. Each device has a ``ProcessPoolExecutor``
of one spawned process (a forked CUDA context is unusable) whose initializer makes the
device current before any CUDA work. An entry is a dry run first, then a build only for the
first entry to reach a key that is not stored (the parent decides), so no key is built twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import pickle
import re
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, BrokenExecutor, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError
from ..errors import NoGpuError
from ..key import BuildOptions, environment_id
from .manifest import ManifestEntry
from .steps import Entries, Interrupted, OnRecord, Progress, Status, attempt, build_report, error_record, load_entries, run_here

__all__ = ["check_environments", "parse_devices", "prewarm_on_devices", "resolve_devices", "settle_duplicates"]

log = logging.getLogger("plancache")

_HINT = "give 'all' or device indices such as 0,1"


# ---------------------------------------------------------------------- choosing devices


def parse_devices(text: str) -> str | list[int]:
    """``"all"`` or the indices of a ``--devices`` value (``"0,1"``); a ``ConfigError``
    naming the bad part for anything else (garbage, an empty item, an index given twice)."""
    if text.strip().lower() == "all":
        return "all"
    chosen: list[int] = []
    for part in text.split(","):
        item = part.strip()
        if not re.fullmatch(r"[0-9]+", item):
            what = f"{item!r} is not a device index" if item else f"{text!r} has an empty device index"
            raise ConfigError(f"{what}: {_HINT}", name="devices", value=text)
        if int(item) in chosen:
            raise ConfigError(f"device {int(item)} is listed twice in {text!r}", name="devices", value=text)
        chosen.append(int(item))
    return chosen


def resolve_devices(spec: str | Sequence[int], count: int) -> list[int]:
    """The device indices ``spec`` ("all" or indices) names on a machine of ``count``
    devices; a ``ConfigError`` for an index it lacks or one given twice."""
    if isinstance(spec, str):
        if spec != "all":
            return resolve_devices(parse_devices(spec), count)
        if count < 1:
            raise NoGpuError("--devices all: no device is visible, so there is none to prewarm on")
        return list(range(count))
    have = "none" if count < 1 else "device 0" if count == 1 else f"devices 0-{count - 1}"
    chosen: list[int] = []
    for index in spec:
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
            raise ConfigError(f"no device {index!r}: this machine has {have}", name="devices", value=list(spec))
        if index in chosen:
            raise ConfigError(f"device {index} is listed twice", name="devices", value=list(spec))
        chosen.append(index)
    if not chosen:
        raise ConfigError(f"no device chosen: {_HINT}", name="devices", value=list(spec))
    return chosen


def check_environments(environments: Mapping[int, Mapping[str, Any]]) -> str:
    """The one environment id of these devices' environments ({device: environment}).
    Devices of different environments get different keys for one graph, so sharing a
    prewarm across them would not build what a one-GPU prewarm builds: a ``ConfigError``
    naming the devices and the fields that differ."""
    ids = {device: environment_id(env) for device, env in environments.items()}
    if len(set(ids.values())) <= 1:
        return next(iter(ids.values()))
    groups: dict[str, list[int]] = {}
    for device, env_id in ids.items():
        groups.setdefault(env_id, []).append(device)
    names = sorted({name for env in environments.values() for name in env})
    differ = [n for n in names if len({json.dumps(env.get(n), default=str) for env in environments.values()}) > 1]
    shown = "; ".join(f"device{'s' if len(ds) > 1 else ''} {','.join(map(str, ds))}: "
                      f"{environments[ds[0]].get('gpu_name', '?')} [{env_id}]" for env_id, ds in groups.items())  # fmt: skip
    raise ConfigError(f"devices {','.join(map(str, ids))} have different environments ({shown}; they differ in "
                      f"{', '.join(differ)}): plans are keyed per environment, so choose devices of one environment",
                      name="devices", value=list(ids))  # fmt: skip


# ---------------------------------------------------------------------- the report


def settle_duplicates(records: list[dict[str, Any]], claims: Mapping[int, str], todo: Sequence[ManifestEntry]) -> None:
    """Make the report say what a one-device prewarm says, whatever order the workers
    reached keys in. ``claims``: {position: key} of every entry that got as far as its key,
    in the order the parent was asked; the first to ask for a key built it, the others were
    told "duplicate". The earliest entry of the manifest takes the builder's outcome and the
    others are duplicates; when the build failed they are failed too (one process would
    have tried again, and failed again)."""
    groups: dict[str, list[int]] = {}
    for position, digest in claims.items():
        groups.setdefault(digest, []).append(position)
    for asked in groups.values():
        builder, positions = asked[0], sorted(asked)
        first = positions[0]
        if builder != first:
            a, b = records[first], records[builder]
            for name in ("status", "key", "seconds", "device", "error"):
                a[name], b[name] = b.get(name), a.get(name)
            for record in (a, b):
                if record["error"] is None:
                    del record["error"]
        if records[first]["status"] == Status.FAILED:
            for p in positions[1:]:
                records[p].update(status=Status.FAILED, key=None,
                                  error=f"{todo[p].where}: not built: entry {todo[first].index} has the same key and failed")  # fmt: skip


# ---------------------------------------------------------------------- the worker

_here: dict[str, Any] = {}  # this worker process's cache, entries and options (or why it has none), set by _set_up


def _set_up(device: int, factory: Callable[[], Any], config: dict[str, Any], entries: list[ManifestEntry],
            options: BuildOptions) -> None:  # fmt: skip
    """The initializer of device ``device``'s worker: the device current, then its own cache
    on the shared directory. A failure is kept for ``_ready`` to report: an initializer that
    raises leaves only a traceback on stderr and a pool that says it broke, not why."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops the workers
    _here.update(entries=entries, options=options)
    try:
        backend = factory()
        backend.use_device(device)  # torch.cuda.set_device for cuDNN: before the cache does any CUDA work
        _here["environment"] = backend.environment(device)
        from ..cache.cache import PlanCache
        from ..tiers.remote import RemoteTier  # redis itself only once a tier connects

        remote = config.pop("remote")
        _here["cache"] = PlanCache(backend=backend, remote=RemoteTier(**remote) if remote else None, **config)
    except Exception as exc:  # the parent reports it, and leaves this device's entries to the others
        _here["error"] = f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class _SetUp:
    """A worker's answer once set up: its device's environment, or why it could not set up."""

    environment: Any = None
    error: str | None = None


def _ready() -> _SetUp:
    return _SetUp(error=_here["error"]) if "error" in _here else _SetUp(environment=_here["environment"])


def _attempt(position: int, spent: float | None = None) -> dict[str, Any]:
    """First a dry run of the entry (``spent`` None): its key, and whether it is stored
    (hit) or not (would_build). Then, for the first entry to reach a key not stored, its
    build, timed with the ``spent`` seconds of the dry run. The parent decides between the
    two, which is what keeps two workers from building one key."""
    record = attempt(_here["cache"], _here["entries"][position], _here["options"], spent is None, set())
    return {**record, "seconds": record["seconds"] + (spent or 0.0)}


def _close() -> None:
    _here["cache"].close()  # writes what is pending (hit counters) before the process exits


# ---------------------------------------------------------------------- the parent


@dataclass
class _Worker:
    """The parent's view of one device's worker: a pool of one process."""

    device: int
    pool: ProcessPoolExecutor
    future: Future[Any] | None  # the task in flight
    process: Any = None  # the pool's process (its exit code says how it died; ending it stops a build in flight)
    position: int | None = None  # the entry it is on
    ready: bool = False
    alive: bool = True
    environment: dict[str, Any] | None = None  # its device's, from _ready
    reason: str = ""  # why it could not set up, or how it ended


def _exit_text(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit code {code}"


class _Shard:
    """Starts one single-process pool per device, hands out entries as workers finish them,
    settles which entry builds a key, and turns a worker's death (a broken pool) into a
    failed record instead of a hang."""

    def __init__(self, todo: list[ManifestEntry], devices: list[int], bar: Progress, on_record: OnRecord | None = None) -> None:
        self.todo = todo
        self.devices = devices
        self.bar = bar
        self.on_record = on_record
        self.pending: deque[int] = deque(range(len(todo)))
        self.records: dict[int, dict[str, Any]] = {}
        self.claims: dict[int, str] = {}  # position -> its key, in the order keys came back
        self.owners: dict[str, int] = {}  # key -> the position that builds it
        self.workers: list[_Worker] = []
        self.env_id: str | None = None  # once every worker that started agrees

    def run(
        self, factory: Callable[[], Any], config: dict[str, Any], portable: list[ManifestEntry], options: BuildOptions
    ) -> list[dict[str, Any]]:
        import multiprocessing

        # Spawned, not forked: a child forked from a process that has set up CUDA cannot use it.
        ctx = multiprocessing.get_context("spawn")
        try:
            for device in self.devices:
                # A pool per device: the initializer makes one device current for the life of
                # the process, and a worker that dies breaks its own device's pool only.
                before = set(multiprocessing.active_children())
                pool = ProcessPoolExecutor(1, ctx, initializer=_set_up, initargs=(device, factory, config, portable, options))
                w = _Worker(device, pool, pool.submit(_ready))
                self.workers.append(w)
                # The pool does not expose its process: it is the child its first submit started.
                started = set(multiprocessing.active_children()) - before
                w.process = started.pop() if len(started) == 1 else None
            while len(self.records) < len(self.todo):
                running = {w.future: w for w in self.workers if w.future is not None}
                if not running:
                    self._orphan_pending()
                    break
                for future in wait(running, return_when=FIRST_COMPLETED).done:
                    self._serve(running[future], future)
        finally:
            self._stop()
        return [self.records[p] for p in range(len(self.todo))]

    def _serve(self, w: _Worker, future: Future[Any]) -> None:
        """What ``w``'s finished task says: set up, a key to claim, or an entry done."""
        w.future = None
        error = future.exception()
        if isinstance(error, BrokenExecutor):
            self._lost(w)
            return
        if not w.ready:
            self._started(w, future.result())
            return
        assert w.position is not None, "an entry's task"
        if error is not None:  # raised past timed(), a builder's sys.exit say: the entry failed, the worker goes on
            self._failed(w.position, f"{type(error).__name__}: {error}", w.device)
        else:
            record = {**future.result(), "device": w.device}
            if record["key"] is not None:  # the first entry to reach a key builds it; a later one is its duplicate
                self.claims[w.position] = record["key"]
                if self.owners.setdefault(record["key"], w.position) != w.position:
                    record["status"] = Status.DUPLICATE
                elif record["status"] == Status.WOULD_BUILD:  # the dry run's answer: now the build
                    self._submit(w, w.position, record["seconds"])
                    return
            self._done(w.position, record)
        w.position = None
        self._next(w)

    def _started(self, w: _Worker, answer: _SetUp) -> None:
        if answer.error is not None:
            self._end(w, answer.error)
            return
        w.ready, w.environment = True, answer.environment
        self._start_when_all_ready()

    def _start_when_all_ready(self) -> None:
        """Once every live worker is set up: check that their devices share one environment
        (a ``ConfigError`` otherwise, before anything is built), then give each an entry.
        Checked in the workers, not here: this process then never touches a GPU."""
        ready = [w for w in self.workers if w.alive]
        if self.env_id is not None or not ready or not all(w.ready for w in ready):
            return
        self.env_id = check_environments({w.device: w.environment or {} for w in ready})
        for w in ready:
            self._next(w)

    def _next(self, w: _Worker) -> None:
        if self.pending:
            w.position = self.pending.popleft()
            self._submit(w, w.position)

    def _submit(self, w: _Worker, position: int, spent: float | None = None) -> None:
        try:
            w.future = w.pool.submit(_attempt, position, spent)
        except BrokenExecutor:  # it died since its last task
            if spent is None:
                self.pending.appendleft(position)  # it never started this one
                w.position = None
            self._lost(w)

    def _done(self, position: int, record: dict[str, Any]) -> None:
        if record["status"] == Status.FAILED:
            log.warning("plancache: prewarm: %s", record["error"])
        self.records[position] = record
        self.bar.update(record["status"], record.get("seconds", 0.0))
        if self.on_record is not None:
            with self.bar.printing():
                self.on_record(record)

    def finished(self) -> list[dict[str, Any]]:
        """The records of the entries finished so far, in the manifest's order, duplicates
        settled among them (an interrupted run)."""
        order = sorted(self.records)
        at = {position: i for i, position in enumerate(order)}
        done = [self.records[p] for p in order]
        settle_duplicates(done, {at[p]: d for p, d in self.claims.items() if p in at}, [self.todo[p] for p in order])
        return done

    def _failed(self, position: int, error: str, device: int | None) -> None:
        entry = self.todo[position]
        self._done(position, entry.record(status=Status.FAILED, error=f"{entry.where}: {error}", seconds=0.0, device=device))

    def _lost(self, w: _Worker) -> None:
        """``w``'s process has exited: its pool is broken."""
        w.pool.shutdown()  # the pool has reaped its process by then: the exit code is known
        self._end(w, _exit_text(w.process.exitcode if w.process is not None else None))

    def _end(self, w: _Worker, reason: str) -> None:
        """``w`` does no more work: its entry, if it was on one, failed; the others go on."""
        w.alive, w.reason = False, reason
        if w.position is not None:
            self._failed(w.position, f"the worker of device {w.device} died while building this entry ({w.reason})", w.device)
            w.position = None
        else:
            log.warning("plancache: prewarm: the worker of device %d stopped (%s); the others go on", w.device, w.reason)
        self._start_when_all_ready()  # the others may have been waiting for this one

    def _orphan_pending(self) -> None:
        ends = "; ".join(f"device {w.device}: {w.reason}" for w in self.workers)
        while self.pending:
            self._failed(self.pending.popleft(), f"not built: no worker left ({ends})", None)

    def _stop(self) -> None:
        """Let idle workers close their caches and exit; end the others (an interrupt, or
        still starting up): a pool's shutdown waits for the task in flight, a build included."""
        for w in self.workers:
            if w.future is not None and w.process is not None:
                w.process.terminate()
            elif w.alive and w.ready:
                with contextlib.suppress(BrokenExecutor):
                    w.pool.submit(_close)
        for w in self.workers:
            if w.future is not None and w.process is not None:
                w.process.join(5)
                if w.process.is_alive():
                    w.process.kill()
            w.pool.shutdown()


def _worker_config(cache: Any) -> dict[str, Any]:
    """What a worker's ``PlanCache`` needs to match the caller's, its Redis tier included:
    the arguments of the caller's (a tier passed to ``PlanCache(remote=)`` is not the one
    the environment gives, and a worker without it would publish nothing and build without
    the fleet lock)."""
    read_only = cache.store is not None and cache.store.read_only
    remote = cache.remote
    if remote is not None and not callable(getattr(remote, "arguments", None)):
        raise ConfigError(f"the cache's remote tier ({type(remote).__name__}) cannot be built again in a worker process "
                          "(it has no arguments()): prewarm on one device", name="remote", value=repr(remote))  # fmt: skip
    return {"directory": str(cache.directory), "options": cache.options, "timing": cache.timing,
            "read_only": True if read_only else None, "max_size": cache.max_size or 0,
            "lock_timeout": cache.lock_timeout, "persist_kernel_cache": cache.persist_kernel_cache,
            "auto_prime": False, "remote": remote.arguments() if remote is not None else None}  # fmt: skip


def _portable(entry: ManifestEntry) -> ManifestEntry:
    """``entry`` as a worker can receive it: a builder function that does not pickle (a
    lambda, a local function) is left out, and the worker imports it by its name. So is
    one defined in a ``__main__`` that has no file (``python -c``, a notebook): it pickles
    by reference to ``__main__``, which a spawned worker cannot import, and the worker
    would die unpickling it before it could say why."""
    if entry.builder is None:
        return entry
    if (
        getattr(entry.builder, "__module__", None) != "__main__"
        or getattr(sys.modules.get("__main__"), "__file__", None) is not None
    ):
        try:
            pickle.dumps(entry.builder)
            return entry
        except Exception:  # whatever pickling a user's callable raises
            pass
    return dataclasses.replace(entry, builder=None)


def prewarm_on_devices(
    cache: Any,
    entries: Entries,
    devices: str | Sequence[int],
    *,
    dry_run: bool = False,
    progress: bool = True,
    options: BuildOptions | None = None,
    allow_code: bool = True,
    backend_factory: Callable[[], Any] | None = None,
    on_record: OnRecord | None = None,
) -> dict[str, Any]:
    """``prewarm`` across ``devices`` of this machine: one spawned worker per device, each
    with its own ``PlanCache`` on ``cache``'s directory and a backend from
    ``backend_factory`` (default: the class of ``cache.backend``, built without
    arguments; it must be importable by name). One device, or a dry run, runs in this
    process on the first device. The report is ``prewarm``'s, plus ``devices`` and each
    record's ``device`` (None for entries that never reached one). ``on_record`` and
    Ctrl-C as ``prewarm``'s, over the entries of every device."""
    started = time.perf_counter()
    backend = cache.backend
    chosen = resolve_devices(devices if isinstance(devices, str) else list(devices), backend.device_count())
    if not hasattr(backend, "use_device") and chosen != [backend.current_device()]:
        raise ConfigError(f"the {backend.name} backend cannot choose a device (it has no use_device)", name="devices",
                          value=chosen)  # fmt: skip
    todo, load_errors = load_entries(entries, allow_code=allow_code, listing=dry_run)
    options = options or cache.options
    if len(chosen) == 1 or dry_run or not todo:
        env_id = check_environments({d: backend.environment(d) for d in chosen})
        previous = backend.current_device()
        if hasattr(backend, "use_device"):
            backend.use_device(chosen[0])

        def on_device(record: dict[str, Any]) -> None:
            record["device"] = chosen[0]
            if on_record is not None:
                on_record(record)

        try:
            records = run_here(cache, todo, options, dry_run, progress, on_device)
        except Interrupted as stopped:
            report = _report(stopped.records, todo, load_errors, dry_run, env_id, started, chosen, interrupted=True)
            raise Interrupted(stopped.records, report) from None
        finally:
            if hasattr(backend, "use_device"):
                backend.use_device(previous)
    else:
        factory = backend_factory or type(backend)
        try:
            pickle.dumps(factory)
        except Exception as exc:  # a class defined inside a function, say
            raise ConfigError(f"the {backend.name} backend cannot be rebuilt in a worker process ({exc}); pass backend_factory",
                              name="backend_factory", value=repr(factory)) from exc  # fmt: skip
        bar = Progress(len(todo), progress)
        shard = _Shard(todo, chosen, bar, on_record)
        try:
            records = shard.run(factory, _worker_config(cache), [_portable(e) for e in todo], options)
        except KeyboardInterrupt:  # the workers are stopped (run's own clean-up); what they finished is reported
            done = shard.finished()
            env = shard.env_id or "unknown: no worker started"
            raise Interrupted(done, _report(done, todo, load_errors, dry_run, env, started, chosen, interrupted=True)) from None
        finally:
            bar.close()
        settle_duplicates(records, shard.claims, todo)
        env_id = shard.env_id or "unknown: no worker started"
    return _report(records, todo, load_errors, dry_run, env_id, started, chosen, interrupted=False)


def _report(records: list[dict[str, Any]], todo: list[ManifestEntry], load_errors: list[Any], dry_run: bool, env_id: str,
            started: float, devices: list[int], *, interrupted: bool) -> dict[str, Any]:  # fmt: skip
    """The report of a run across devices; ``interrupted``: of the entries finished before Ctrl-C."""
    errors = [{**error_record(e), "device": None} for e in load_errors]
    return build_report(errors + records, dry_run, env_id, started, devices=devices, interrupted=interrupted,
                        not_run=len(todo) - len(records) if interrupted else 0)  # fmt: skip
