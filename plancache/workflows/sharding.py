"""Prewarm shared across the GPUs of one machine: one worker process per device.

Keys depend on the GPU model, driver and library versions, never on a device index, so a
plan built on device 1 is the plan device 0 would have built, provided both devices have
one environment (each worker reports its device's; nothing is built until all agree). Entries go to the workers one at a
time, each worker asking for the next when it is done: build times differ by 100x between
graphs, so a fixed split would leave devices idle. Workers are spawned, never forked (a
forked CUDA context is unusable), and each makes its device current before any CUDA work.

Protocol, over one pipe per worker. Nothing is shared between workers, so a worker that
dies, even halfway through a message, cannot block the others::

    worker -> parent   ("ready", env)      set up, on a device of environment ``env``
                       ("claim", digest)   may this entry build that key? (answer: a bool)
                       ("record", record)  the entry is done; send the next
                       ("error", text)     could not set up (then it exits)
    parent -> worker   position | None (no more work) | bool (a claim's answer)
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
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError
from ..errors import NoGpuError
from ..key import BuildOptions, environment_id
from .manifest import ManifestEntry
from .steps import Entries, Interrupted, OnRecord, Progress, attempt, build_report, error_record, load_entries, run_here

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
        if records[first]["status"] != "failed":
            continue
        for p in positions[1:]:
            records[p].update(status="failed", key=None,
                              error=f"{todo[p].where}: not built: entry {todo[first].index} has the same key and failed")  # fmt: skip


# ---------------------------------------------------------------------- the worker


class _Claims:
    """The keys seen so far, as ``_run_one`` asks: ``digest in claims`` asks the parent,
    which answers False only to the first entry that reaches the key. Claiming at that
    question (not after the build) is what keeps two workers from building one key."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def __contains__(self, digest: object) -> bool:
        self.conn.send(("claim", digest))
        return not self.conn.recv()

    def add(self, digest: str) -> None:
        """Nothing to do: the key was claimed when it was first asked about."""


def _worker_main(device: int, conn: Any, factory: Callable[[], Any], config: dict[str, Any],
                 entries: list[ManifestEntry], options: BuildOptions) -> None:  # fmt: skip
    """A worker process: device ``device`` current, its own cache on the shared directory,
    then entries until the parent says stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops the workers
    try:
        backend = factory()
        backend.use_device(device)  # torch.cuda.set_device for cuDNN: before the cache does any CUDA work
        environment = backend.environment(device)
        from ..cache.cache import PlanCache

        remote_arguments = config.pop("remote")
        remote = None
        if remote_arguments is not None:
            from ..tiers.remote import RemoteTier

            remote = RemoteTier(**remote_arguments)
        cache = PlanCache(backend=backend, remote=remote, **config)
    except Exception as exc:  # reported by the parent with this worker's exit code
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from exc
    claims = _Claims(conn)
    try:
        conn.send(("ready", environment))
        while (position := conn.recv()) is not None:
            conn.send(("record", attempt(cache, entries[position], options, False, claims)))
    except (EOFError, BrokenPipeError):
        pass  # the parent is gone: nobody to build for
    finally:
        cache.close()


# ---------------------------------------------------------------------- the parent


@dataclass
class _Worker:
    """The parent's view of one worker process."""

    device: int
    process: Any
    conn: Any
    position: int | None = None  # the entry it is on
    ready: bool = False
    stopped: bool = False  # told there is no more work
    alive: bool = True
    environment: dict[str, Any] | None = None  # its device's, from its "ready"
    error: str | None = None  # why it could not set up
    reason: str = ""  # how it ended, once it has


def _exit_text(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit code {code}"


class _Shard:
    """Starts one worker per device, hands out entries as workers ask, answers claims,
    and turns a worker's death into failed records instead of a hang."""

    def __init__(self, todo: list[ManifestEntry], devices: list[int], bar: Progress, on_record: OnRecord | None = None) -> None:
        self.todo = todo
        self.devices = devices
        self.bar = bar
        self.on_record = on_record
        self.pending: deque[int] = deque(range(len(todo)))
        self.records: dict[int, dict[str, Any]] = {}
        self.claims: dict[int, str] = {}  # position -> the key it asked about
        self.owners: dict[str, int] = {}  # key -> the position that builds it
        self.workers: list[_Worker] = []
        self.env_id: str | None = None  # once every worker that started agrees

    def run(
        self, factory: Callable[[], Any], config: dict[str, Any], portable: list[ManifestEntry], options: BuildOptions
    ) -> list[dict[str, Any]]:
        import multiprocessing
        from multiprocessing.connection import wait

        # Spawned, not forked: a child forked from a process that has set up CUDA cannot use it.
        ctx = multiprocessing.get_context("spawn")
        try:
            for device in self.devices:
                here, there = ctx.Pipe()
                process = ctx.Process(target=_worker_main, args=(device, there, factory, config, portable, options),
                                      name=f"plancache-prewarm-{device}")  # fmt: skip
                process.start()
                there.close()  # the worker holds the only other end: its exit is an EOF here
                self.workers.append(_Worker(device, process, here))
            while len(self.records) < len(self.todo):
                live = [w for w in self.workers if w.alive]
                if not live:
                    self._orphan_pending()
                    break
                ready = set(wait([w.conn for w in live] + [w.process.sentinel for w in live]))
                for w in live:
                    if w.conn in ready or w.process.sentinel in ready:
                        self._serve(w)
        finally:
            self._stop()
        return [self.records[p] for p in range(len(self.todo))]

    def _serve(self, w: _Worker) -> None:
        """Every message ``w`` has sent; its end when it has exited."""
        while w.alive:
            try:
                if not w.conn.poll():
                    if not w.process.is_alive():
                        self._lost(w)
                    return
                message = w.conn.recv()
            except (EOFError, OSError):
                self._lost(w)
                return
            self._handle(w, message)

    def _handle(self, w: _Worker, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "claim":
            digest, position = message[1], w.position
            assert position is not None, "a claim comes from a worker on an entry"
            self.claims[position] = digest
            owner = self.owners.setdefault(digest, position)
            self._send(w, owner == position)
        elif kind == "record" and w.position is not None:
            self._done(w.position, {**message[1], "device": w.device})
            w.position = None
            self._next(w)
        elif kind == "ready":
            w.ready, w.environment = True, message[1]
            self._start_when_all_ready()
        elif kind == "error":
            w.error = message[1]

    def _start_when_all_ready(self) -> None:
        """Once every live worker is set up: check that their devices share one environment
        (a ``ConfigError`` otherwise, before anything is built), then give each an entry.
        Checked in the workers, not here: this process then never touches a GPU."""
        if self.env_id is not None or not all(w.ready for w in self.workers if w.alive):
            return
        ready = [w for w in self.workers if w.alive and w.ready]
        if not ready:
            return
        self.env_id = check_environments({w.device: w.environment or {} for w in ready})
        for w in ready:
            self._next(w)

    def _next(self, w: _Worker) -> None:
        if self.pending:
            w.position = self.pending.popleft()
            self._send(w, w.position)
        else:
            w.stopped = True
            self._send(w, None)

    def _send(self, w: _Worker, message: Any) -> None:
        try:
            w.conn.send(message)
        except OSError:  # it died since its last message
            if isinstance(message, int) and not isinstance(message, bool):
                self.pending.appendleft(message)  # it never started this one
                w.position = None
            self._lost(w)

    def _done(self, position: int, record: dict[str, Any]) -> None:
        if record["status"] == "failed":
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
        self._done(position, {"index": entry.index, "line": entry.line, "label": entry.label, "key": None,
                              "status": "failed", "error": f"{entry.where}: {error}", "seconds": 0.0, "device": device})  # fmt: skip

    def _lost(self, w: _Worker) -> None:
        """``w`` has exited (or closed its pipe): its entry, if it was on one, failed."""
        w.alive = False
        self._start_when_all_ready()  # the others may have been waiting for this one
        w.process.join(5)
        w.reason = _exit_text(w.process.exitcode) + (f": {w.error}" if w.error else "")
        if w.position is not None:
            self._failed(w.position, f"the worker of device {w.device} died while building this entry ({w.reason})", w.device)
            w.position = None
        elif not w.stopped:
            log.warning("plancache: prewarm: the worker of device %d stopped (%s); the others go on", w.device, w.reason)

    def _orphan_pending(self) -> None:
        ends = "; ".join(f"device {w.device}: {w.reason}" for w in self.workers)
        while self.pending:
            self._failed(self.pending.popleft(), f"not built: no worker left ({ends})", None)

    def _stop(self) -> None:
        """Let finished workers exit; end the others (an interrupt, or still starting up)."""
        for w in self.workers:
            if w.stopped:
                w.process.join(10)
            if w.process.is_alive():
                w.process.terminate()
                w.process.join(5)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.conn.close()


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
        getattr(entry.builder, "__module__", None) == "__main__"
        and getattr(sys.modules.get("__main__"), "__file__", None) is None
    ):
        return dataclasses.replace(entry, builder=None)
    try:
        pickle.dumps(entry.builder)
    except Exception:  # whatever pickling a user's callable raises
        return dataclasses.replace(entry, builder=None)
    return entry


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
    Ctrl-C as ``prewarm``'s: each record as its entry finishes (on any device), and an
    ``Interrupted`` whose report holds the entries finished on every device."""
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
            raise _interrupted(stopped.records, todo, load_errors, dry_run, env_id, started, chosen) from None
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
            raise _interrupted(done, todo, load_errors, dry_run, env, started, chosen) from None
        finally:
            bar.close()
        settle_duplicates(records, shard.claims, todo)
        env_id = shard.env_id or "unknown: no worker started"
    return {**_report(records, load_errors, dry_run, env_id, started, chosen), "interrupted": False, "not_run": 0}


def _report(records: list[dict[str, Any]], load_errors: list[Any], dry_run: bool, env_id: str, started: float,
            devices: list[int]) -> dict[str, Any]:  # fmt: skip
    errors = [{**error_record(e), "device": None} for e in load_errors]
    return {**build_report(errors + records, dry_run, env_id, started), "devices": devices}


def _interrupted(records: list[dict[str, Any]], todo: list[ManifestEntry], load_errors: list[Any], dry_run: bool, env_id: str,
                 started: float, devices: list[int]) -> Interrupted:  # fmt: skip
    """The ``Interrupted`` of a run across devices stopped by Ctrl-C: the report of the entries finished."""
    report = {**_report(records, load_errors, dry_run, env_id, started, devices), "interrupted": True,
              "not_run": len(todo) - len(records)}  # fmt: skip
    return Interrupted(records, report)
