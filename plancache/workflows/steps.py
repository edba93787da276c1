"""One manifest entry's prewarm step, the progress bar and the report: the pieces that a
prewarm in one process (``prewarm``) and one across devices (``sharding``) share, so that
both judge entries, count them and report them alike."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TextIO, cast

from ..cache.recording import MANIFEST_VERSION
from ..config import StrEnum
from ..errors import ManifestError
from ..key import BuildOptions, canonical_json, describe, make_key
from ..store import problem
from .manifest import ManifestEntry, load_manifest, parse_manifest

__all__ = ["Entries", "Interrupted", "OnRecord", "Progress", "Status", "attempt", "build_report", "check_one", "describe_failure", "error_record",
           "load_entries", "run_here", "timed"]  # fmt: skip

log = logging.getLogger("plancache")

Entries = str | os.PathLike[str] | Mapping[str, Any] | Iterable[ManifestEntry] | Iterable[Mapping[str, Any]]


def load_entries(
    source: Entries, *, allow_code: bool = True, listing: bool = False
) -> tuple[list[ManifestEntry], list[ManifestError]]:
    """The entries of a manifest file, a manifest document (``{"version": 1, "entries":
    [...]}``, read as the file's JSON is), a list of entries of one, or of ``ManifestEntry``;
    and one error per bad entry. Anything else is a ``TypeError`` naming what is taken."""
    if isinstance(source, (str, os.PathLike)):
        return load_manifest(source, allow_code=allow_code, listing=listing)
    if isinstance(source, Mapping):
        return _parse_document(source, allow_code, listing)
    items = list(source) if isinstance(source, Iterable) else [source]
    if all(isinstance(item, ManifestEntry) for item in items):
        return [item for item in items if isinstance(item, ManifestEntry)], []
    if all(isinstance(item, Mapping) for item in items):
        return _parse_document({"version": MANIFEST_VERSION, "entries": items}, allow_code, listing)
    raise TypeError("entries are a manifest path, a manifest document ({'version': 1, 'entries': [...]}), or a list of "
                    "its entries or of ManifestEntry")  # fmt: skip


def _parse_document(
    document: Mapping[str, Any], allow_code: bool, listing: bool
) -> tuple[list[ManifestEntry], list[ManifestError]]:
    try:
        text = json.dumps(document)
    except (TypeError, ValueError) as exc:  # what a manifest file could not hold either
        error = ManifestError(f"<manifest>: not a manifest document: {exc}", path="<manifest>", entry=None, line=None)
        return [], [error]
    return parse_manifest(text, None, allow_code=allow_code, listing=listing)


class Status(StrEnum):
    """What became of one entry of a prewarm (or one plan of a tune): a record's ``status``."""

    BUILT = "built"
    HIT = "hit"
    FAILED = "failed"
    WOULD_BUILD = "would_build"
    CHECKED = "checked"
    LISTED = "listed"
    DUPLICATE = "duplicate"
    UNPERSISTED = "unpersisted"
    TUNED = "tuned"


def error_record(error: ManifestError) -> dict[str, Any]:
    return {"index": error.fields.get("entry"), "line": error.fields.get("line"), "label": None, "key": None,
            "status": Status.FAILED, "error": error.message, "seconds": 0.0}  # fmt: skip


class Progress:
    """A tqdm bar on stderr, only when stderr is a terminal: entries done of the total, how
    many ended in each status so far, the last entry's seconds, tqdm's rate and ETA. A line
    printed to stdout while it is shown goes through ``printing``: the bar is cleared
    first and drawn again after, so the line starts at its own left margin."""

    def __init__(self, total: int, enabled: bool, stream: TextIO | None = None, desc: str = "prewarm") -> None:
        stream = stream or sys.stderr
        self.statuses: collections.Counter[str] = collections.Counter()
        self.bar: Any = None
        if enabled and total > 0 and stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, file=stream, unit="graph", desc=desc, dynamic_ncols=True)

    def update(self, status: str, seconds: float) -> None:
        self.statuses[status] += 1
        if self.bar is not None:
            self.bar.set_postfix({**self.statuses, "last": f"{seconds:.2f}s"}, refresh=False)
            self.bar.update(1)

    def printing(self) -> contextlib.AbstractContextManager[Any]:
        """The block in which a caller prints to stdout while the bar may be shown."""
        if self.bar is None:
            return contextlib.nullcontext()
        return cast("contextlib.AbstractContextManager[Any]", self.bar.external_write_mode(file=sys.stdout))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def stored_in(store: Any, digest: str) -> bool:
    """Whether a usable entry is stored under ``digest`` in ``store`` (None: nothing
    stored), read without counting a hit."""
    if store is None:
        return False
    try:
        entry = store.get(digest)
    except Exception:  # a damaged store: let get() decide (it treats it as a miss)
        return False
    # The lookup's own judgement: an entry it would refuse (damaged metadata, never checked
    # element by element) is no reason to skip building, or the model autotunes at start-up.
    return entry is not None and problem(entry) is None


def describe_failure(entry: ManifestEntry, exc: Exception) -> str:
    if isinstance(exc, ManifestError):  # already names the file, line and entry
        return exc.message
    return f"{entry.where}: {type(exc).__name__}: {getattr(exc, 'message', None) or exc}"


def run_one(cache: Any, entry: ManifestEntry, options: BuildOptions, dry_run: bool, seen: set[str]) -> dict[str, Any]:
    record = entry.record()
    graph = entry.build()
    opts = entry.build_options(options)
    key = cache.key(graph, opts)
    record["key"] = key.digest
    if key.digest in seen:
        record["status"] = Status.DUPLICATE
    elif stored_in(cache.store, key.digest):
        record["status"] = Status.HIT
    elif dry_run:
        record["status"] = Status.WOULD_BUILD
    else:
        before = dict(cache.counters)
        cache.get(graph, options=opts)
        built = cache.counters["builds"] + cache.counters["rebuilds"] - before["builds"] - before["rebuilds"]
        record["status"] = Status.BUILT if built else Status.HIT  # another process may have built it meanwhile
        if not stored_in(cache.store, key.digest):  # no majority, not loadable back, a full disk: nothing kept
            record["status"] = Status.UNPERSISTED
    seen.add(key.digest)
    return record


def check_one(
    entry: ManifestEntry, options: BuildOptions, environment: Mapping[str, Any] | None, store: Any, seen: set[str]
) -> dict[str, Any]:
    """A dry run's step, without a cache or a backend: build the entry's graph and describe
    it (a graph that cannot be keyed fails here, as it would in a prewarm). Given an
    ``environment``, its key and whether ``store`` holds it (``hit`` or ``would_build``);
    without one (keys depend on the GPU), status ``checked`` and no key. Duplicates are
    found either way (same graph and options)."""
    record = entry.record()
    opts = entry.build_options(options)
    description = describe(entry.build())
    if environment is None:
        ident = hashlib.sha256(canonical_json({"graph": description, "options": opts.to_dict()}).encode()).hexdigest()
        status = Status.CHECKED
    else:
        ident = record["key"] = make_key(description, environment, opts).digest
        status = Status.HIT if stored_in(store, ident) else Status.WOULD_BUILD
    record["status"] = Status.DUPLICATE if ident in seen else status
    seen.add(ident)
    return record


def attempt(cache: Any, entry: ManifestEntry, options: BuildOptions, dry_run: bool, seen: set[str]) -> dict[str, Any]:
    """``run_one``, timed; an exception becomes a failed record (the caller logs it)."""
    return timed(entry, lambda: run_one(cache, entry, options, dry_run, seen))


def timed(entry: ManifestEntry, step: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``step()``'s record of ``entry`` with its ``seconds``; an exception becomes a failed
    record (the caller logs it). A builder entry read without importing it is ``listed``:
    no graph, no key."""
    t0 = time.perf_counter()
    try:
        record = entry.record(status=Status.LISTED) if entry.listed_only else step()
    except Exception as exc:  # one bad entry is reported; the rest still run
        record = entry.record(status=Status.FAILED, error=describe_failure(entry, exc))
    record["seconds"] = time.perf_counter() - t0
    return record


def build_report(records: list[dict[str, Any]], dry_run: bool, env_id: str | None, started: float, **more: Any) -> dict[str, Any]:
    """The report of a run from its records (the same with one device or several), ``more`` last."""
    count = collections.Counter(r["status"] for r in records)
    return {
        "total": len(records),
        "built": count[Status.BUILT] + count[Status.UNPERSISTED],
        "hits": count[Status.HIT],
        "failed": count[Status.FAILED],
        "would_build": count[Status.WOULD_BUILD],
        "checked": count[Status.CHECKED],
        "listed": count[Status.LISTED],
        "duplicates": count[Status.DUPLICATE],
        "unpersisted": count[Status.UNPERSISTED],
        "dry_run": dry_run,
        "environment": env_id,
        "seconds": time.perf_counter() - started,
        "entries": records,
        **more,
    }


class Interrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C (a ``KeyboardInterrupt`` still, for callers that catch
    that): ``records`` of the entries it finished, and ``report`` once the caller that
    knows the whole run (``prewarm``) has built it."""

    def __init__(self, records: list[dict[str, Any]], report: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.records = records
        self.report = report


#: Called with each record as its entry finishes (``plancache prewarm`` prints its row).
OnRecord = Callable[[dict[str, Any]], None]


def run_here(cache: Any, todo: list[ManifestEntry], options: BuildOptions, dry_run: bool, progress: bool,
             on_record: OnRecord | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Every entry of ``todo`` in this process, in order, with a progress bar: the records."""
    seen: set[str] = set()
    return run_each(todo, lambda entry: attempt(cache, entry, options, dry_run, seen), progress, on_record)


def run_each(todo: list[ManifestEntry], step: Callable[[ManifestEntry], dict[str, Any]], progress: bool,
             on_record: OnRecord | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """``step(entry)`` for every entry of ``todo``, in order, with a progress bar: the records.
    Ctrl-C raises ``Interrupted`` holding the records of the entries finished (the one
    being built is not stored: the next run builds it)."""
    records: list[dict[str, Any]] = []
    bar = Progress(len(todo), progress)
    try:
        for entry in todo:
            record = step(entry)
            if record["status"] == Status.FAILED:
                log.warning("plancache: prewarm: %s", record["error"])
            records.append(record)
            bar.update(record["status"], record["seconds"])
            if on_record is not None:
                with bar.printing():
                    on_record(record)
    except KeyboardInterrupt as exc:
        raise Interrupted(records) from exc
    finally:
        bar.close()
    return records
