"""The ``plancache`` command. Data goes to stdout (``--json`` for scripts), logs and
progress to stderr.

Exit codes: 0 success; 1 an error (one line on stderr; ``--debug`` for the traceback);
2 bad usage; 3 ``verify`` found problems or ``prewarm`` had failing entries.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import click

from .errors import EntryNotFoundError, PlanCacheError
from .store import Entry, Store

__all__ = ["main"]

EXIT_ERROR = 1
EXIT_PROBLEMS = 3


class _Context:
    def __init__(self, directory: Path | None, debug: bool) -> None:
        self.directory = directory
        self.debug = debug

    def store(self, *, read_only: bool | None = None) -> Store:
        return Store(self.directory, read_only=read_only)


def _emit(data: Any, as_json: bool, text: Callable[[Any], Iterable[str]]) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        for line in text(data):
            click.echo(line)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _age(seconds: float) -> str:
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f}{unit}"
    return f"{seconds:.0f}s"


def _table(rows: list[list[str]], header: list[str]) -> Iterable[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    yield "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()
    for row in rows:
        yield "  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip()


def _entry(store: Store, prefix: str) -> Entry:
    keys = store.resolve(prefix)
    if not keys:
        raise EntryNotFoundError(f"no entry with key {prefix!r} in {store.path}", key=prefix)
    if len(keys) > 1:
        raise EntryNotFoundError(f"key prefix {prefix!r} is ambiguous in {store.path}; give more characters", key=prefix)
    entry = store.get(keys[0])
    if entry is None:  # removed between the two reads
        raise EntryNotFoundError(f"no entry with key {prefix!r} in {store.path}", key=prefix)
    return entry


def _explain(parts: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    from .key import CacheKey

    return CacheKey(digest="", parts=dict(parts)).explain()


def _entry_parts(entry: Entry) -> dict[str, Any]:
    from .key import KEY_FORMAT

    return {"format": KEY_FORMAT, "graph": entry.description, "environment": entry.environment, "options": entry.options}


class _Group(click.Group):
    """Maps every PlanCacheError to one line on stderr and exit code 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PlanCacheError as exc:
            if ctx.obj is not None and getattr(ctx.obj, "debug", False):
                raise
            click.echo(f"plancache: error: {exc}", err=True)
            ctx.exit(EXIT_ERROR)


@click.group(cls=_Group)
@click.option("--dir", "directory", type=click.Path(path_type=Path), envvar="PLANCACHE_DIR",
              help="Cache directory (default: $PLANCACHE_DIR, else the user cache directory).")  # fmt: skip
@click.option("--debug", is_flag=True, help="Show tracebacks and debug logs.")
@click.version_option(package_name="plancache")
@click.pass_context
def cli(ctx: click.Context, directory: Path | None, debug: bool) -> None:
    """plancache: a persistent, autotuning plan cache for cuDNN Frontend graphs."""
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, format="%(message)s", stream=sys.stderr)
    ctx.obj = _Context(directory, debug)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def env(as_json: bool) -> None:
    """The environment fingerprint that keys every plan on this machine."""
    from .cudnn_backend import probe_environment

    data = probe_environment()

    def text(d: dict[str, Any]) -> Iterable[str]:
        for name, value in d.items():
            yield f"{name:24} {value}"

    _emit(data, as_json, text)


@cli.command(name="ls")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--env", "env_id", default=None, help="Only entries of this environment id.")
@click.pass_obj
def list_entries(obj: _Context, as_json: bool, env_id: str | None) -> None:
    """List stored plans, most recently used first."""
    rows = obj.store().list_entries(env_id)
    now = time.time()

    def text(data: list[dict[str, Any]]) -> Iterable[str]:
        if not data:
            yield "(no entries)"
            return
        yield from _table(
            [[r["key"][:12], r["label"][:48], r["policy"], _size(r["blob_size"]), f"{r['build_seconds']:.2f}s",
              str(r["hit_count"]), _age(now - r["last_used_at"])] for r in data],
            ["KEY", "OPS", "POLICY", "BLOB", "BUILD", "HITS", "USED"],
        )  # fmt: skip

    _emit(rows, as_json, text)


def _show_text(data: dict[str, Any]) -> Iterable[str]:
    yield f"key            {data['key']}"
    yield f"ops            {data['label']}"
    yield f"environment    {data['env_id']}  " + ", ".join(f"{k}={v}" for k, v in data["environment"].items())
    yield "options        " + ", ".join(f"{k}={v}" for k, v in data["options"].items())
    engine = data.get("engine") or {}
    yield f"engine         {engine.get('name', '?')} (id {engine.get('engine_id')}, knobs {engine.get('knobs')})"
    yield f"policy         {data['policy']}  build {data['build_seconds']:.3f}s, timing {data['autotune_seconds']:.3f}s"
    yield f"blob           {_size(data['blob_size'])} sha256 {data['blob_sha256'][:16]}…  workspace {_size(data['workspace_size'])}"
    yield f"hits           {data['hit_count']}"
    yield "tensors:"
    yield from ("  " + line for line in _table(
        [[str(t["uid"]), t["name"], "out" if t["is_output"] else "in", str(t["dims"]), str(t["strides"]), str(t["dtype"])]
         for t in data["tensors"]], ["UID", "NAME", "IO", "DIMS", "STRIDES", "DTYPE"]))  # fmt: skip
    timed = [c for c in data["candidates"] if c.get("median_ms") is not None or c.get("first_ms") is not None]
    if timed:
        yield "candidates:"
        yield from ("  " + line for line in _table(
            [[str(c["index"]), c["engine"].get("name", ""), c["status"],
              f"{c['median_ms']:.4f}" if c.get("median_ms") is not None else "-",
              f"{c['first_ms']:.4f}" if c.get("first_ms") is not None else "-"] for c in data["candidates"]],
            ["#", "ENGINE", "STATUS", "MEDIAN_MS", "FIRST_MS"]))  # fmt: skip
    if "explain" in data:
        yield "key parts:"
        for name, part in data["explain"].items():
            yield f"  {name:12} {part['sha256']}"


@cli.command()
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--explain", is_flag=True, help="Show each part of the key with its own hash.")
@click.pass_obj
def show(obj: _Context, key: str, as_json: bool, explain: bool) -> None:
    """Everything stored about one plan (KEY may be a unique prefix)."""
    entry = _entry(obj.store(), key)
    data = {k: v for k, v in vars(entry).items() if k != "blob"}
    data["blob_size"] = len(entry.blob)
    if explain:
        data["explain"] = _explain(_entry_parts(entry))
    _emit(data, as_json, _show_text)


@cli.command()
@click.argument("key_a")
@click.argument("key_b")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def diff(obj: _Context, key_a: str, key_b: str, as_json: bool) -> None:
    """Which parts of two keys differ: graph, environment or options (why a miss)."""
    store = obj.store()
    a, b = _entry(store, key_a), _entry(store, key_b)
    pa, pb = _entry_parts(a), _entry_parts(b)
    result: dict[str, Any] = {}
    for part in pa:
        if pa[part] != pb[part]:
            if isinstance(pa[part], dict):
                fields = sorted(set(pa[part]) | set(pb[part]))
                result[part] = {f: [pa[part].get(f), pb[part].get(f)] for f in fields if pa[part].get(f) != pb[part].get(f)}
            else:
                result[part] = [pa[part], pb[part]]

    def text(d: dict[str, Any]) -> Iterable[str]:
        if not d:
            yield "the keys have identical parts"
        for part, fields in d.items():
            yield f"{part}:"
            for name, (va, vb) in fields.items() if isinstance(fields, dict) else [("", fields)]:
                yield f"  {name}: {json.dumps(va, sort_keys=True)[:200]}  !=  {json.dumps(vb, sort_keys=True)[:200]}"

    _emit(result, as_json, text)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def stats(obj: _Context, as_json: bool) -> None:
    """Totals of the store: entries, bytes, hits, quarantined entries, counters."""
    data = obj.store().stats()

    def text(d: dict[str, Any]) -> Iterable[str]:
        yield f"path          {d['path']}{' (read-only)' if d['read_only'] else ''}"
        yield f"entries       {d['entries']} in {d['environments']} environment(s)"
        yield f"blobs         {_size(d['blob_bytes'])} (file {_size(d['file_bytes'])})"
        yield f"hits          {d['hits']}"
        yield f"build time    {d['build_seconds']:.1f} s stored (saved again on every hit)"
        yield "by policy     " + ", ".join(f"{k}: {v}" for k, v in d["by_policy"].items())
        yield f"quarantined   {d['quarantined']}"
        for name, value in sorted(d["counters"].items()):
            yield f"{name:13} {value}"

    _emit(data, as_json, text)


@cli.command()
@click.argument("keys", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def rm(obj: _Context, keys: tuple[str, ...], as_json: bool) -> None:
    """Remove stored plans (each KEY may be a unique prefix)."""
    store = obj.store()
    removed = []
    for prefix in keys:
        entry = _entry(store, prefix)
        if store.delete(entry.key):
            removed.append(entry.key)
    _emit({"removed": removed}, as_json, lambda d: (f"removed {k}" for k in d["removed"]))


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``plancache`` console script."""
    cli.main(args=argv, prog_name="plancache")
