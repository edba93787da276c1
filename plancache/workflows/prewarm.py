"""Build plans ahead of time (``prewarm``) and load them at start-up (``warm_start``).

``prewarm`` is resumable: an entry whose plan is already stored is skipped (a hit), so a
run that was interrupted, or one over a manifest that grew, only builds what is missing.
One failing entry is reported and the others still run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..cache.priming import Primer
from ..key import BuildOptions, environment_id
from .steps import (
    Entries,
    Interrupted,
    OnRecord,
    Status,
    build_report,
    check_one,
    describe_failure,
    error_record,
    load_entries,
    run_each,
    run_here,
    timed,
)

__all__ = ["dry_run", "prewarm", "prime", "record_line", "summary_lines", "warm_start"]

log = logging.getLogger("plancache")


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
    on_record: OnRecord | None = None,
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

    ``on_record``: called with each entry's record as it finishes (in this process). Ctrl-C
    raises ``Interrupted`` (a ``KeyboardInterrupt``) whose ``report`` is this report of
    the entries finished, with ``interrupted`` True; a run again resumes.
    """
    if devices is not None:
        from .sharding import prewarm_on_devices  # multiprocessing only when asked for

        return prewarm_on_devices(cache, entries, devices, dry_run=dry_run, progress=progress, options=options,
                                  allow_code=allow_code, backend_factory=backend_factory, on_record=on_record)  # fmt: skip
    started = time.perf_counter()
    env_id = environment_id(cache.environment)  # no GPU: one clear error, not one per entry
    todo, load_errors = load_entries(entries, allow_code=allow_code, listing=dry_run)
    records = [error_record(e) for e in load_errors]
    try:
        records += run_here(cache, todo, options or cache.options, dry_run, progress, on_record)
    except Interrupted as stopped:
        stopped.report = build_report(records + stopped.records, dry_run, env_id, started, interrupted=True,
                                      not_run=len(todo) - len(stopped.records))  # fmt: skip
        raise
    return build_report(records, dry_run, env_id, started, interrupted=False, not_run=0)


def dry_run(
    entries: Entries,
    *,
    environment: Mapping[str, Any] | None = None,
    store: Any = None,
    options: BuildOptions | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """What ``prewarm`` would do, on any machine: no cache, no backend, no GPU, nothing
    written (what ``plancache prewarm --dry-run`` runs).

    Reads the manifest (builder entries are listed without importing them, ``sys.path``
    is left alone), builds and describes every other entry's graph, and finds duplicates
    and entries that fail. Keys depend on the GPU's environment: given ``environment`` (a
    backend's fingerprint) each entry gets its key, and ``store`` (an open ``Store``, read
    only; None: nothing stored) tells ``hit`` from ``would_build``; without it each sound
    entry is ``checked``, without a key. The report is ``prewarm``'s (``dry_run`` True,
    ``environment`` None without one)."""
    started = time.perf_counter()
    options = options or BuildOptions()
    todo, load_errors = load_entries(entries, listing=True)
    seen: set[str] = set()
    records = [error_record(e) for e in load_errors]
    records += run_each(todo, lambda e: timed(e, lambda: check_one(e, options, environment, store, seen)), progress)
    return build_report(records, True, environment_id(environment) if environment is not None else None, started)


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
        todo, load_errors = load_entries(manifest, allow_code=allow_code)
        errors += [error_record(e) for e in load_errors]
        keys = []
        for entry in todo:
            try:
                digest = cache.key(entry.build(), entry.build_options(options or cache.options)).digest
            except Exception as exc:  # reported; the other plans still load
                errors.append({"index": entry.index, "line": entry.line, "label": entry.label, "status": Status.FAILED,
                               "error": describe_failure(entry, exc)})  # fmt: skip
                continue
            if digest not in labels:
                keys.append(digest)
                labels[digest] = entry.label
    report = {**cache.preload(keys), "errors": errors, "labels": labels, "seconds": time.perf_counter() - started}
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
    primer = Primer(cache.lookup, [(digest, device) for digest in keys])
    primer.start()
    return primer


def record_line(r: Mapping[str, Any]) -> str:
    """One entry's row of a prewarm report."""
    key = (r.get("key") or "-")[:12]
    where = f"#{r['index']}" + (f" (line {r['line']})" if r.get("line") else "") if r.get("index") is not None else "-"
    text = r.get("error") if r["status"] == Status.FAILED else r.get("label")
    return f"{r['status']:12} {key:12} {where:16} {r.get('seconds', 0.0):7.2f}s  {text}"


def summary_lines(report: Mapping[str, Any], *, rows: bool = True) -> list[str]:
    """A short human summary of a prewarm report (used by the CLI); ``rows=False``: the
    last line only (the rows were printed as their entries finished)."""
    lines = [record_line(r) for r in report["entries"]] if rows else []
    if report.get("checked"):  # a dry run without keys: they need the GPU's environment
        done = f"{report['checked']} checked (keys need this machine's GPU: prewarm builds those not stored yet)"
    elif report["dry_run"]:
        done = f"{report['would_build']} would build"
    else:
        done = f"{report['built']} built"
        if report.get("unpersisted"):
            done += f" ({report['unpersisted']} of them not stored, as a warning said)"
    listed = f", {report['listed']} builder entries listed without importing them" if report.get("listed") else ""
    if report.get("interrupted"):
        listed += f"; interrupted, {report['not_run']} not run (run it again to resume)"
    lines.append(f"{report['total']} entries: {done}{listed}, {report['hits']} already stored, "
                 f"{report['failed']} failed, {report['duplicates']} duplicates in {report['seconds']:.1f} s")  # fmt: skip
    return lines
