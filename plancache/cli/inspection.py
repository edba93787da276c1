"""The commands that read the store and change nothing: ``env``, ``ls``, ``show``,
``diff``, ``stats`` and ``inspect``. A cache that does not exist yet reads as an empty
one; a row that cannot be decoded is left out with a warning on stderr."""

from __future__ import annotations

import contextlib
import json
import re
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import click

from ..config import MAX_SIZE, StrEnum, format_size
from ..errors import DamagedEntryError, EntryNotFoundError
from ..store import DB_NAME, Entry, Store, maintenance
from ..store.store import Stats
from ..workflows.report import age
from .common import EXIT_ERROR, Command, Context, emit, entry_named, table

__all__ = ["diff", "env", "inspect_plans", "list_entries", "show", "stats"]


@click.command(cls=Command)
def env() -> None:
    """The environment fingerprint that keys every plan on this machine, and the start-up hook."""
    from ..cudnn.backend import probe_environment
    from ..integrations.startup import startup_hook_status

    data = probe_environment()
    data["startup_hook"] = startup_hook_status()  # whether PLANCACHE_PATCH_CUDNN reaches programs that never import plancache
    emit(data, lambda d: (f"{name:24} {value}" for name, value in d.items()))


@click.command(name="ls", cls=Command)
@click.option("--env", "env_id", default=None, help="Only entries of this environment id, or a unique prefix of it.")
@click.pass_obj
def list_entries(obj: Context, env_id: str | None) -> None:
    """List stored plans, most recently used first (none yet: an empty list). A row that
    cannot be decoded is left out, with a warning on stderr."""
    rows, env_id = _list_entries(obj, env_id)
    now = time.time()

    def text(data: list[maintenance.Listed]) -> Iterable[str]:
        if not data:
            yield obj.nothing_yet() if env_id is None else f"no plans of environment {env_id} in {obj.cache_dir}"
            return
        yield from table(
            [[r["key"][:12], r["label"][:48], r["policy"], format_size(r["blob_size"]), f"{r['build_seconds']:.2f}s",
              str(r["hit_count"]), age(now - r["last_used_at"])] for r in data],
            ["KEY", "OPS", "POLICY", "BLOB", "BUILD", "HITS", "USED"],
        )  # fmt: skip

    emit(rows, text)


def _list_entries(obj: Context, env_id: str | None, store: Store | None = None) -> tuple[list[maintenance.Listed], str | None]:
    """The listing of the store (``store``, else the chosen directory's, closed after), of
    the environment ``env_id`` names (a unique prefix, or ``EntryNotFoundError``), and that
    environment's full id. Rows that cannot be decoded are reported and left out."""
    undecodable: dict[str, str] = {}
    with obj.reading() if store is None else contextlib.nullcontext(store) as store:
        if store is None:
            if env_id is not None:
                raise EntryNotFoundError(f"environment {env_id!r} names no environment: nothing is stored yet in "
                                         f"{obj.cache_dir}", key=env_id)  # fmt: skip
            return [], None
        rows = maintenance.list_entries(store, undecodable=undecodable)
    _warn_undecodable(undecodable)
    if env_id is not None:
        env_id = maintenance.environment_named(env_id, {row["env_id"] for row in rows}, str(store.path))
        rows = [row for row in rows if row["env_id"] == env_id]
    return rows, env_id


def _warn_undecodable(undecodable: Mapping[str, str]) -> None:
    """One line on stderr per row a read command left out because it cannot be decoded."""
    for key, why in undecodable.items():
        click.echo(f"plancache: warning: entry {key[:12]} left out: {why} ({maintenance.UNDECODABLE_HINT})", err=True)


def _entry_parts(entry: Entry) -> dict[str, Any]:
    from ..key import KEY_FORMAT

    return {"format": KEY_FORMAT, "graph": entry.description, "environment": entry.environment, "options": entry.options}


def _show_text(data: dict[str, Any]) -> Iterable[str]:
    yield f"key            {data['key']}"
    yield f"ops            {data['label']}"
    yield f"environment    {data['env_id']}  " + ", ".join(f"{k}={v}" for k, v in data["environment"].items())
    yield "options        " + ", ".join(f"{k}={v}" for k, v in data["options"].items())
    engine = data.get("engine") or {}
    yield f"engine         {engine.get('name', '?')} (id {engine.get('engine_id')}, knobs {engine.get('knobs')})"
    yield f"policy         {data['policy']}  build {data['build_seconds']:.3f}s, timing {data['autotune_seconds']:.3f}s"
    yield f"blob           {format_size(data['blob_size'])} sha256 {data['blob_sha256'][:16]}…  workspace {format_size(data['workspace_size'])}"
    yield f"hits           {data['hit_count']}"
    yield "tensors:"
    yield from ("  " + line for line in table(
        [[str(t["uid"]), t["name"], "out" if t["is_output"] else "in", str(t["dims"]), str(t["strides"]), str(t["dtype"])]
         for t in data["tensors"]], ["UID", "NAME", "IO", "DIMS", "STRIDES", "DTYPE"]))  # fmt: skip
    from ..autotuning.autotune import CandidateStatus, check_summary

    check = data.get("check") or {}
    yield f"check          {check_summary(check)}"
    for rejected in check.get("rejected") or []:
        worst = rejected.get("worst")
        far = f"the worst {worst:.3g} times its bound" if worst is not None else "non-finite or integer values differ"
        yield (f"  rejected     #{rejected.get('index')} {rejected.get('engine')}: disagrees, {rejected.get('outside')} elements "
               f"outside their bound ({100 * float(rejected.get('fraction') or 0):.2g}%), {far}")  # fmt: skip
    tried = [c for c in data["candidates"] if c.get("status") != CandidateStatus.NOT_BUILT]
    if tried:
        yield "candidates:"
        yield from ("  " + line for line in table(
            [[str(c["index"]), c["engine"].get("name", ""), c["status"],
              f"{c['median_ms']:.4f}" if c.get("median_ms") is not None else "-",
              f"{c['first_ms']:.4f}" if c.get("first_ms") is not None else "-",
              str(c["outside"]) if c.get("outside") is not None else "-",
              f"{c['deviation']:.3g}" if c.get("deviation") is not None else "-"] for c in tried],
            ["#", "ENGINE", "STATUS", "MEDIAN_MS", "FIRST_MS", "OUTSIDE", "WORST"]))  # fmt: skip
    if "explain" in data:
        yield "key parts:"
        for name, part in data["explain"].items():
            yield f"  {name:12} {part['sha256']}"


@click.command(cls=Command)
@click.argument("key")
@click.option("--explain", is_flag=True, help="Show each part of the key with its own hash.")
@click.pass_obj
def show(obj: Context, key: str, explain: bool) -> None:
    """Everything stored about one plan (KEY may be a unique prefix of 4 or more characters)."""
    with obj.reading() as store:
        entry = entry_named(store, key, obj)
    data = entry.header()
    data["blob_size"] = len(entry.blob)
    if explain:
        from ..key import CacheKey

        data["explain"] = CacheKey(digest="", parts=_entry_parts(entry)).explain()
    emit(data, _show_text)


@click.command(cls=Command)
@click.argument("key_a")
@click.argument("key_b")
@click.pass_obj
def diff(obj: Context, key_a: str, key_b: str) -> None:
    """Every difference between what two keys hash (graph, environment, options): one line
    per differing path with both values, e.g. ``graph.nodes[0].params.stride: [1, 1] -> [2, 2]``.
    With --json: a list of {path, a, b} (``absent``: the side that lacks the path). Exit code
    0 when the parts are identical, 1 when they differ (as diff(1))."""
    with obj.reading() as store:
        a, b = entry_named(store, key_a, obj), entry_named(store, key_b, obj)
    result = [_difference(path, va, vb) for path, va, vb in _differences(_entry_parts(a), _entry_parts(b), "")]

    def text(d: list[dict[str, Any]]) -> Iterable[str]:
        if not d:
            yield "the keys have identical parts"
        for row in d:
            va = "(absent)" if row.get("absent") is _Side.A else json.dumps(row["a"], sort_keys=True)
            vb = "(absent)" if row.get("absent") is _Side.B else json.dumps(row["b"], sort_keys=True)
            yield f"{row['path']}: {va} -> {vb}"

    emit(result, text)
    if result:
        sys.exit(EXIT_ERROR)


_ABSENT: Any = object()


class _Side(StrEnum):
    """The entry of a ``diff`` row that lacks its path (``absent``)."""

    A = "a"
    B = "b"


_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _differences(a: Any, b: Any, path: str) -> Iterator[tuple[str, Any, Any]]:
    """(path, a, b) for every leaf where two JSON values differ. Objects are compared key
    by key; lists holding objects or lists element by element; other lists (a stride, a
    shape) and scalars as whole values. A path only one side has gives ``_ABSENT``."""
    if isinstance(a, dict) and isinstance(b, dict):
        for name in sorted(set(a) | set(b), key=str):
            step = f"{path}.{name}" if _NAME.match(str(name)) else f"{path}[{json.dumps(name)}]"
            yield from _differences(a.get(name, _ABSENT), b.get(name, _ABSENT), step.lstrip("."))
    elif isinstance(a, list) and isinstance(b, list) and any(isinstance(x, (dict, list)) for x in (*a, *b)):
        for i in range(max(len(a), len(b))):
            yield from _differences(a[i] if i < len(a) else _ABSENT, b[i] if i < len(b) else _ABSENT, f"{path}[{i}]")
    elif a is _ABSENT or b is _ABSENT or json.dumps(a, sort_keys=True) != json.dumps(b, sort_keys=True):
        yield path, a, b


def _difference(path: str, a: Any, b: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"path": path, "a": None if a is _ABSENT else a, "b": None if b is _ABSENT else b}
    if a is _ABSENT or b is _ABSENT:
        row["absent"] = _Side.A if a is _ABSENT else _Side.B
    return row


@click.command(cls=Command)
@click.pass_obj
def stats(obj: Context) -> None:
    """Totals of the store: entries, bytes, hits, quarantined entries, counters (remote
    hits, misses, publishes and refusals among them, as flushed by every process), and the
    graphs whose plans cannot be stored, and why."""
    undecodable: dict[str, str] = {}
    with obj.reading() as store:
        data: dict[str, Any] = dict(store.stats() if store is not None else _empty_stats(obj.cache_dir))
        if store is not None:
            maintenance.list_entries(store, undecodable=undecodable)
    _warn_undecodable(undecodable)
    data["undecodable"] = undecodable  # counted in the totals (they are rows of the file), shown nowhere else
    data["max_size"] = MAX_SIZE.from_env()

    from ..tiers.remote import RemoteTier

    remote = RemoteTier.from_env()  # connects to nothing: its settings, and the secret's id
    if remote is not None:
        data["remote"] = {k: v for k, v in remote.stats().items() if k in ("url", "namespace", "key_id")}
        remote.close()

    def text(d: dict[str, Any]) -> Iterable[str]:
        if store is None:
            yield obj.nothing_yet()
        else:
            yield f"path          {d['path']}{' (read-only)' if d['read_only'] else ''}"
        yield f"entries       {d['entries']} in {d['environments']} environment(s)"
        yield f"blobs         {format_size(d['blob_bytes'])} (file {format_size(d['file_bytes'])})"
        yield f"hits          {d['hits']}"
        yield f"size limit    {format_size(d['max_size']) if d['max_size'] else 'none'} (PLANCACHE_MAX_SIZE)"
        yield f"build time    {d['build_seconds']:.1f} s stored (saved again on every hit)"
        yield "by policy     " + ", ".join(f"{k}: {v}" for k, v in d["by_policy"].items())
        yield f"quarantined   {d['quarantined']}"
        for row in d["unstored"]:  # built and not stored: every start of its program builds it again
            yield f"not stored    {row['key'][:12]} {row['label']} ({row['why']}, {row['times']} time(s)): {row['reason']}"
        if d["undecodable"]:
            yield f"undecodable   {len(d['undecodable'])} ({maintenance.UNDECODABLE_HINT})"
        for name, value in sorted(d["counters"].items()):
            yield f"{name:13} {value}"
        if "remote" in d:
            r = d["remote"]
            yield f"remote        {r['url']} namespace {r['namespace']} secret id {r['key_id']}"

    emit(data, text)


def _empty_stats(directory: Path) -> Stats:
    """``Store.stats()`` of a cache with nothing stored yet (and no file)."""
    return {"path": str(directory / DB_NAME), "read_only": False, "file_bytes": 0, "entries": 0, "blob_bytes": 0, "hits": 0,
            "environments": 0, "build_seconds": 0.0, "by_policy": {}, "quarantined": 0, "unstored": [], "counters": {}}  # fmt: skip


def _readable(store: Store, key: str) -> Entry | None:
    """The entry, or None for one row that cannot be decoded (reported on stderr): the
    other entries are still shown, as ``ls`` shows them."""
    try:
        return store.get(key)
    except DamagedEntryError as exc:
        _warn_undecodable({key: f"{exc.message.partition(': ')[2] or exc.message}"})
        return None


@click.command(name="inspect", cls=Command)
@click.argument("keys", nargs=-1)
@click.option("--env", "env_id", default=None, help="Only entries of this environment id, or a unique prefix of it.")
@click.pass_obj
def inspect_plans(obj: Context, keys: tuple[str, ...], env_id: str | None) -> None:
    """A readable report per stored plan (all, or each KEY prefix): ops, shapes, dtypes,
    chosen engine, the candidates' timings, speed-up over the heuristics' first choice,
    hits and age."""
    from ..workflows.report import entry_report, report_lines

    with obj.reading() as store:
        entries: list[Entry | None]
        if keys or (store is None and env_id is None):  # nothing stored yet: no entries, and no KEY can match
            entries = [entry_named(store, k, obj) for k in keys]
        else:
            rows, env_id = _list_entries(obj, env_id, store)
            entries = [_readable(store, r["key"]) for r in rows] if store is not None else []
        data = [entry_report(e) for e in entries if e is not None]

    def text(d: list[dict[str, Any]]) -> Iterable[str]:
        if not d:
            yield obj.nothing_yet() if env_id is None else f"no plans of environment {env_id} in {obj.cache_dir}"
        for i, report in enumerate(d):
            if i:
                yield ""
            yield from report_lines(report)

    emit(data, text)
