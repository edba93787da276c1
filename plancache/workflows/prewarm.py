"""Build plans ahead of time (``prewarm``) and load them at start-up (``warm_start``).

``prewarm`` is resumable: an entry whose plan is already stored is skipped (a hit), so a
run that was interrupted, or one over a manifest that grew, only builds what is missing.
One failing entry is reported and the others still run.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TextIO

from ..errors import ManifestError
from ..key import BuildOptions, environment_id
from ..priming import Primer
from .manifest import ManifestEntry, load_manifest

__all__ = ["Primer", "prewarm", "prime", "warm_start"]

log = logging.getLogger("plancache")

Entries = str | os.PathLike[str] | Iterable[ManifestEntry]


def _entries(
    source: Entries, *, allow_code: bool = True, listing: bool = False
) -> tuple[list[ManifestEntry], list[ManifestError]]:
    if isinstance(source, (str, os.PathLike)):
        return load_manifest(source, allow_code=allow_code, listing=listing)
    return list(source), []


def _error_record(error: ManifestError) -> dict[str, Any]:
    return {"index": error.fields.get("entry"), "line": error.fields.get("line"), "label": None, "key": None,
            "status": "failed", "error": error.message, "seconds": 0.0}  # fmt: skip


class _Progress:
    """done/total, hits skipped, failures, time of the last entry and ETA on stderr: tqdm
    when installed, else one self-rewritten line. Silent when stderr is not a terminal."""

    def __init__(self, total: int, enabled: bool, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled and total > 0 and self.stream.isatty()
        self.total, self.done, self.hits, self.failed = total, 0, 0, 0
        self.started = time.perf_counter()
        self.bar: Any = None
        if self.enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, file=self.stream, unit="graph", desc="prewarm", dynamic_ncols=True)

    def update(self, status: str, seconds: float) -> None:
        self.done += 1
        self.hits += status in ("hit", "stored")
        self.failed += status == "failed"
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(hits=self.hits, failed=self.failed, last=f"{seconds:.2f}s", refresh=False)
            self.bar.update(1)
            return
        elapsed = time.perf_counter() - self.started
        eta = elapsed / self.done * (self.total - self.done)
        self.stream.write(f"\rprewarm {self.done}/{self.total}  hits {self.hits}  failed {self.failed}  "
                          f"last {seconds:.2f}s  ETA {eta:.0f}s ")  # fmt: skip
        self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def _stored(cache: Any, digest: str) -> bool:
    """Whether a usable entry is stored under ``digest`` (read without counting a hit)."""
    try:
        entry = cache.store.get(digest)
    except Exception:  # a damaged store: let get() decide (it treats it as a miss)
        return False
    return entry is not None and entry.checksum_ok()


def _describe_failure(entry: ManifestEntry, exc: Exception) -> str:
    if isinstance(exc, ManifestError):  # already names the file, line and entry
        return exc.message
    return f"{entry.where}: {type(exc).__name__}: {getattr(exc, 'message', None) or exc}"


class KeySet(Protocol):
    """The keys met so far: a set in one process; with several devices, the parent's claims."""

    def __contains__(self, digest: object) -> bool: ...

    def add(self, digest: str) -> None: ...


def _run_one(cache: Any, entry: ManifestEntry, options: BuildOptions, dry_run: bool, seen: KeySet) -> dict[str, Any]:
    record: dict[str, Any] = {"index": entry.index, "line": entry.line, "label": entry.label, "key": None}
    if entry.listed_only:  # a dry run lists builder entries without importing them: no graph, no key
        record["status"] = "listed"
        return record
    graph = entry.build()
    opts = entry.build_options(options)
    key = cache.key(graph, opts)
    record["key"] = key.digest
    if key.digest in seen:
        record["status"] = "duplicate"
    elif _stored(cache, key.digest):
        record["status"] = "hit"
    elif dry_run:
        record["status"] = "would_build"
    else:
        before = dict(cache.counters)
        cache.get(graph, options=opts)
        built = cache.counters["builds"] + cache.counters["rebuilds"] - before["builds"] - before["rebuilds"]
        record["status"] = "built" if built else "hit"  # another process may have built it meanwhile
        if cache.counters.get("unpersisted", 0) > before.get("unpersisted", 0):
            record["status"] = "unpersisted"
    seen.add(key.digest)
    return record


def _attempt(cache: Any, entry: ManifestEntry, options: BuildOptions, dry_run: bool, seen: KeySet) -> dict[str, Any]:
    """``_run_one``, timed; an exception becomes a failed record (the caller logs it)."""
    t0 = time.perf_counter()
    try:
        record = _run_one(cache, entry, options, dry_run, seen)
    except Exception as exc:  # one bad entry is reported; the rest still run
        record = {"index": entry.index, "line": entry.line, "label": entry.label, "key": None, "status": "failed",
                  "error": _describe_failure(entry, exc)}  # fmt: skip
    record["seconds"] = time.perf_counter() - t0
    return record


def _report(records: list[dict[str, Any]], dry_run: bool, env_id: str, started: float) -> dict[str, Any]:
    """The report of a run from its records (the same with one device or several)."""
    count = {
        s: sum(r["status"] == s for r in records)
        for s in ("built", "hit", "failed", "would_build", "listed", "duplicate", "unpersisted")
    }
    return {
        "total": len(records),
        "built": count["built"] + count["unpersisted"],
        "hits": count["hit"],
        "failed": count["failed"],
        "would_build": count["would_build"],
        "listed": count["listed"],
        "duplicates": count["duplicate"],
        "unpersisted": count["unpersisted"],
        "dry_run": dry_run,
        "environment": env_id,
        "seconds": time.perf_counter() - started,
        "entries": records,
    }


def prewarm(
    cache: Any,
    entries: Entries,
    *,
    dry_run: bool = False,
    progress: bool = True,
    options: BuildOptions | None = None,
    allow_code: bool = True,
    devices: str | Sequence[int] | None = None,
    backend_factory: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """Build and autotune every entry of a manifest (a path or ``ManifestEntry`` list).

    Entries already stored are skipped and counted as hits; ``dry_run`` only computes the
    keys of template and graph entries, and lists builder entries of a manifest file
    without importing them (status ``listed``, no key) or touching ``sys.path``.
    ``allow_code=False`` refuses a manifest file's builder entries and ``pythonpath``
    (failed records). Entries without their own ``options`` use ``options`` (default: the
    cache's). Returns ``{"total", "built", "hits", "failed", "would_build", "listed",
    "duplicates", "seconds", "environment", "dry_run", "entries": [{"index", "line",
    "label", "key", "status", "seconds", "error"?}]}`` where status is built | hit |
    would_build | listed | duplicate | unpersisted | failed. A manifest's bad entries come
    back as failed records.

    ``devices`` ("all" or indices): the GPUs of this machine to share the entries across,
    one worker process each (``plancache.workflows.sharding``); workers build their
    backend with ``backend_factory`` (default: the cache backend's class). The report then
    also has ``devices`` and each record its ``device``.
    """
    if devices is not None:
        from .sharding import prewarm_on_devices  # multiprocessing only when asked for

        return prewarm_on_devices(cache, entries, devices, dry_run=dry_run, progress=progress, options=options,
                                  allow_code=allow_code, backend_factory=backend_factory)  # fmt: skip
    started = time.perf_counter()
    env_id = environment_id(cache.environment)  # no GPU: one clear error, not one per entry
    todo, load_errors = _entries(entries, allow_code=allow_code, listing=dry_run)
    options = options or cache.options
    records = [_error_record(e) for e in load_errors]
    seen: set[str] = set()
    bar = _Progress(len(todo), progress)
    try:
        for entry in todo:
            record = _attempt(cache, entry, options, dry_run, seen)
            if record["status"] == "failed":
                log.warning("plancache: prewarm: %s", record["error"])
            records.append(record)
            bar.update(record["status"], record["seconds"])
    finally:
        bar.close()
    return _report(records, dry_run, env_id, started)


def warm_start(
    cache: Any, manifest: Entries | None = None, *, options: BuildOptions | None = None, allow_code: bool = True
) -> dict[str, Any]:
    """Load every plan a model will need into memory before its first step.

    ``manifest``: a path or ``ManifestEntry`` list naming the graphs (their keys are
    computed here, no GPU work); None loads every stored entry of this environment. Later
    ``cache.get`` calls for these graphs are memory hits. Returns ``cache.preload``'s
    report (``loaded``, ``missing``, ``failed`` {key: reason}) plus ``errors`` (manifest
    entries that could not be built or keyed), ``labels`` {key: label} and ``seconds``.
    ``allow_code=False`` refuses a manifest file's builder entries and ``pythonpath``.
    """
    started = time.perf_counter()
    errors: list[dict[str, Any]] = []
    labels: dict[str, str] = {}
    keys: list[str] | None = None
    if manifest is not None:
        todo, load_errors = _entries(manifest, allow_code=allow_code)
        errors += [_error_record(e) for e in load_errors]
        keys = []
        for entry in todo:
            try:
                digest = cache.key(entry.build(), entry.build_options(options or cache.options)).digest
            except Exception as exc:  # reported; the other plans still load
                errors.append({"index": entry.index, "line": entry.line, "label": entry.label, "status": "failed",
                               "error": _describe_failure(entry, exc)})  # fmt: skip
                continue
            if digest not in labels:
                keys.append(digest)
                labels[digest] = entry.label
    report: dict[str, Any] = dict(cache.preload(keys))
    report["errors"] = errors
    report["labels"] = labels
    report["seconds"] = time.perf_counter() - started
    if report["missing"] or report["failed"] or errors:
        log.warning("plancache: warm start loaded %d plans; %d missing, %d failed, %d manifest errors",
                    len(report["loaded"]), len(report["missing"]), len(report["failed"]), len(errors))  # fmt: skip
    return report


def prime(cache: Any, keys: Iterable[str] | None = None) -> Primer:
    """Start loading ``keys`` (default: every stored entry of this environment) into the
    cache's memory on the current device, on a background thread, and return the
    ``Primer``; ``join()`` it to wait, or just go on: a lookup of a plan being loaded
    waits for that load, and the others never wait for the primer. Auto-prime does this
    by itself for the plans the application's latest run used (``PLANCACHE_AUTO_PRIME``)."""
    device = cache.backend.current_device()
    if keys is None:
        keys = cache.local.entries_of(environment_id(cache.environment_of(device)))
    primer = Primer(cache, [(digest, device) for digest in keys])
    primer.start()
    return primer


def summary_lines(report: Mapping[str, Any]) -> list[str]:
    """A short human summary of a prewarm report (used by the CLI)."""
    lines = []
    for r in report["entries"]:
        key = (r.get("key") or "-")[:12]
        where = f"#{r['index']}" + (f" (line {r['line']})" if r.get("line") else "") if r.get("index") is not None else "-"
        text = r.get("error") if r["status"] == "failed" else r.get("label")
        lines.append(f"{r['status']:12} {key:12} {where:16} {r.get('seconds', 0.0):7.2f}s  {text}")
    verb = "would build" if report["dry_run"] else "built"
    count = report["would_build"] if report["dry_run"] else report["built"]
    listed = f", {report['listed']} builder entries listed without importing them" if report.get("listed") else ""
    lines.append(f"{report['total']} entries: {count} {verb}{listed}, {report['hits']} already stored, "
                 f"{report['failed']} failed, {report['duplicates']} duplicates in {report['seconds']:.1f} s")  # fmt: skip
    return lines
