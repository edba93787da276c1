"""The ``plancache`` command. Data goes to stdout (``--json`` for scripts), logs and
progress to stderr (progress only when stderr is a terminal).

``EXIT_CODES`` is the one table of exit codes (README.md shows it; ``plancache --help``
prints it); ``_one_line`` maps every error to one of them. ``--dir``, ``--json`` and
``--debug`` go before or after the command name. Every command reads the settings first
(``_check_settings``), then its input, then the GPU it needs, and only then creates a
cache: a command that fails early leaves no file behind.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import itertools
import json
import logging
import os
import re
import signal
import sqlite3
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from .config import (
    ALLOW_SHARED_DIR,
    BACKEND,
    CACHE_DIR,
    MAX_SIZE,
    PATCH_CUDNN,
    REDIS_SECRET,
    REDIS_SECRET_FILE,
    REDIS_SETTINGS,
    SETTINGS,
    ConfigError,
    format_size,
)
from .errors import BundleError, CacheDirError, DamagedEntryError, EntryNotFoundError, ManifestError, PlanCacheError, StoreError
from .store import DB_NAME, Entry, Store, check_private, default_cache_dir, maintenance

__all__ = ["EXIT_BROKEN_PIPE", "EXIT_CODES", "EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_PROBLEMS", "EXIT_USAGE", "main"]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_PROBLEMS = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a command Ctrl-C stopped
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as shells report a command whose reader went away (`| head`)

#: Every exit code of every command, and what it means (README.md, "Exit codes", is this).
EXIT_CODES: dict[int, str] = {
    EXIT_OK: "success; a command that reads a cache that does not exist yet reads an empty one",
    EXIT_ERROR: "the command failed: one line on stderr names what (a cache directory, a file, the store, a key, the "
                "GPU), or refused what needs `--force` (replacing a bundle, pruning plans used in the last day); "
                "`prewarm` built plans it could not store; `--debug` shows the traceback; `diff`: the two keys' parts "
                "differ (as diff(1) exits; the differences on stdout, nothing on stderr)",
    EXIT_USAGE: "bad usage or configuration: an unknown option, a bad argument or option value, or a bad `PLANCACHE_*` "
                "environment variable (named, with its value), checked before anything is created",
    EXIT_PROBLEMS: "the input has problems: `prewarm`'s manifest could not be used at all (missing, unreadable, invalid, "
                   "or running code without `--allow-code`) or had failing entries (`--dry-run` too); `import`'s bundle "
                   "could not be used (missing, not a bundle, truncated, tampered with, newer, unsafe); `verify` found "
                   "problems (also when `--fix` fixed them)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C, SIGTERM or SIGHUP): one line on stderr, no traceback; `prewarm` and `tune` "
                      "first report the entries they finished (as JSON with `--json`), and a run again resumes",
    EXIT_BROKEN_PIPE: "the reader of the output went away before its end (`plancache show KEY` piped into `head -1`): "
                      "nothing on stderr, as a command that SIGPIPE stopped",
}  # fmt: skip


class _Context:
    """What the options before and after the command name chose."""

    def __init__(self) -> None:
        #: What the last ``--dir`` said, before or after the command name (None: not given).
        self.dir_option: str | None = None
        self.directory: Path | None = None  # None: the default one
        #: What named the directory ("--dir", "PLANCACHE_DIR"), None for the default one.
        self.named_by: str | None = None
        self.debug = False
        self.as_json = False

    def choose_directory(self) -> None:
        """The directory ``--dir`` names, else ``PLANCACHE_DIR``'s, else the default one."""
        given = _named_dir(self.dir_option)
        if given is not None:
            self.directory, self.named_by = given, "--dir"
        else:
            self.directory = CACHE_DIR.from_env()
            self.named_by = CACHE_DIR.name if self.directory is not None else None

    @property
    def cache_dir(self) -> Path:
        return self.directory if self.directory is not None else default_cache_dir()

    def existing_store(self, *, read_only: bool | None = None, damaged_ok: bool = False) -> Store | None:
        """The store of the chosen directory, or None when nothing was cached there yet (no
        directory, or one without a plan store): the commands that read a cache read that
        as an empty cache, and create nothing. A directory named by ``--dir`` or
        ``PLANCACHE_DIR`` that does not exist gets a note on stderr (a typo?). A path that
        is not a directory, or one that another user owns or can write, is an error; so is
        a damaged store, unless ``damaged_ok`` (``verify`` reports it)."""
        directory = self.cache_dir
        if not directory.exists():
            blocker = next((parent for parent in directory.parents if parent.exists()), None)
            if blocker is not None and not blocker.is_dir():  # a typo it is not: no cache can ever be there
                raise CacheDirError(f"{directory} can never be a cache directory: {blocker} is not a directory",
                                    path=str(directory))  # fmt: skip
            if self.named_by is not None:
                click.echo(f"plancache: note: {self.named_by} names {directory}, which does not exist: nothing is cached "
                           "there yet", err=True)  # fmt: skip
            return None
        check_private(directory, ALLOW_SHARED_DIR.from_env())  # not a directory, or not the user's (or group's): refused
        if not (directory / DB_NAME).exists():
            return None
        return self._sound(Store(directory, read_only=read_only, repair=False), damaged_ok)

    def writable_store(self) -> Store:
        """The store of the chosen directory, created if needed, for a command that stores
        plans (``prewarm``, ``import``): one it could not write is an error before anything
        is built, never a run that stores nothing."""
        directory = self.cache_dir
        if directory.is_dir() and not os.access(directory, os.W_OK):
            raise StoreError(f"cannot store plans in {directory}: it is read-only to this user", path=str(directory))
        store = self._sound(Store(directory, repair=False), damaged_ok=False)
        if store.read_only:  # the directory can be written, its plans.db cannot
            store.close()
            raise StoreError(f"cannot store plans in {store.path}: it is read-only to this user", path=str(store.path))
        return store

    @staticmethod
    def _sound(store: Store, damaged_ok: bool) -> Store:
        """``store``, unless it is damaged and the command is not one that reports damage."""
        if store.damage is not None and not damaged_ok:
            store.close()
            raise StoreError(f"plan store {store.path} is damaged ({store.damage}): `plancache verify --fix` moves it aside "
                             "(kept) and copies its intact entries into a new store", path=str(store.path))  # fmt: skip
        return store

    def nothing_yet(self) -> str:
        """The line read commands print for a cache without plans."""
        return f"no plans yet in {self.cache_dir}"


def _context() -> _Context:
    obj = click.get_current_context().find_object(_Context)
    assert obj is not None, "the plancache group makes the context"
    return obj


def _emit(data: Any, text: Callable[[Any], Iterable[str]]) -> None:
    if _context().as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        for line in text(data):
            click.echo(line)


_size = format_size


def _stdout_is_terminal() -> bool:
    """Whether stdout is a terminal (tests patch this)."""
    return sys.stdout.isatty()


def _age(seconds: float) -> str:
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f}{unit}"
    return f"{seconds:.0f}s"


def _table(rows: list[list[str]], header: Sequence[str] = ()) -> list[str]:
    """A table's lines: each cell left-aligned in its column, as given (no number
    re-formatted, no space trimmed), under ``header`` unless it is empty."""
    from tabulate import tabulate  # ~75 ms to import: paid only by a command that prints a table

    return tabulate(rows, header, tablefmt="plain", disable_numparse=True, preserve_whitespace=True).splitlines()


def _entry(store: Store | None, prefix: str, obj: _Context) -> Entry:
    if store is None:  # nothing cached yet: no key can match
        raise EntryNotFoundError(f"no entry with key {prefix!r}: {obj.nothing_yet()}", key=prefix)
    entry = store.get(store.key_named(prefix))
    if entry is None:  # removed between the two reads
        raise EntryNotFoundError(f"no entry with key {prefix!r} in {store.path}", key=prefix)
    return entry


def _explain(parts: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    from .key import CacheKey

    return CacheKey(digest="", parts=dict(parts)).explain()


def _entry_parts(entry: Entry) -> dict[str, Any]:
    from .key import KEY_FORMAT

    return {"format": KEY_FORMAT, "graph": entry.description, "environment": entry.environment, "options": entry.options}


def _one_line(exc: BaseException) -> tuple[str, int]:
    """The one line and exit code (``EXIT_CODES``) of an error the user can act on."""
    from .workflows.bundle import TARGET_REFUSALS

    if isinstance(exc, ConfigError):
        return str(exc), EXIT_USAGE
    if isinstance(exc, ManifestError):  # the manifest as a whole: nothing was built
        return str(exc), EXIT_PROBLEMS
    if isinstance(exc, BundleError) and exc.fields.get("reason") not in TARGET_REFUSALS:  # a bundle import cannot use
        return str(exc), EXIT_PROBLEMS
    if isinstance(exc, PlanCacheError):
        return str(exc), EXIT_ERROR
    if isinstance(exc, OSError):
        where = f": {exc.filename}" if exc.filename else ""
        other = f" -> {exc.filename2}" if exc.filename2 else ""
        return f"{exc.strerror or exc}{where}{other}", EXIT_ERROR
    if isinstance(exc, sqlite3.Error):
        return f"the plan store failed: {exc}", EXIT_ERROR
    if isinstance(exc, MemoryError):
        return f"out of memory{f' ({exc})' if str(exc) else ''}", EXIT_ERROR
    return f"{type(exc).__name__}: {exc}" if not str(exc) else str(exc), EXIT_ERROR


def _report_json(ctx: click.Context, message: str, code: int, words: Sequence[str] = ()) -> None:
    """With ``--json``, an error is data on stdout too, so a script always reads JSON.
    ``words``: those click failed to read (an unknown option, an option without its value,
    an unknown command). It stops before it reads any option, ``--json`` too, so whether
    JSON was asked for is told from the words themselves (up to a ``--``)."""
    obj = ctx.find_object(_Context)
    words = words[: words.index("--")] if "--" in words else words
    if (obj is not None and obj.as_json) or "--json" in words:
        click.echo(json.dumps({"error": message, "exit_code": code}, indent=2, sort_keys=True))


def _named_dir(value: str | None) -> Path | None:
    """The directory ``--dir`` names (before or after the command), None when not given. An
    empty one is refused: it is a variable that expanded to nothing, not the default cache."""
    if value is not None and not value.strip():
        raise ConfigError("--dir is empty: name a directory, or leave --dir out for the default cache",
                          name=CACHE_DIR.name, value=value)  # fmt: skip
    return CACHE_DIR.of(value, "--dir")


def _set_dir(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    """Kept as given: it is checked when the command runs (``_Command.invoke``), where its
    error is one line and exit code 2, whichever side of the command name it stood on."""
    if value is not None:
        ctx.ensure_object(_Context).dir_option = value


def _set_json(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        ctx.ensure_object(_Context).as_json = True


def _set_debug(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        ctx.ensure_object(_Context).debug = True
        logging.getLogger().setLevel(logging.DEBUG)


def _show_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """``--version``: not eager, so it runs after --json (eager) and prints JSON when asked
    for, on either side of it (click's version_option prints its text line only)."""
    if not value or ctx.resilient_parsing:
        return
    from . import __version__

    obj = ctx.find_object(_Context)
    click.echo(json.dumps({"version": __version__}) if obj is not None and obj.as_json else f"plancache, version {__version__}")
    ctx.exit()


def _shared_options() -> list[click.Parameter]:
    """``--dir``, ``--json`` and ``--debug``, which the root group and every command take
    (``_Command``), so they go before or after the command name; the last one given counts.
    ``--json`` is eager: read first, so that the error of any other option or argument is
    JSON too."""
    return [
        click.Option(["--dir"], metavar="PATH", expose_value=False, callback=_set_dir,
                     help="Cache directory (default: $PLANCACHE_DIR, else the user cache directory)."),
        click.Option(["--json"], is_flag=True, is_eager=True, expose_value=False, callback=_set_json,
                     help='Print JSON: the command\'s data, or {"error", "exit_code"} when it fails.'),
        click.Option(["--debug"], is_flag=True, expose_value=False, callback=_set_debug, help="Show tracebacks and debug logs."),
    ]  # fmt: skip


def _check_settings() -> None:
    """Read every setting a command's cache reads, through its declaration, before the
    command creates or reads anything: a bad value is exit code 2 whichever command runs.
    Not here: ``PLANCACHE_BACKEND``, read by the commands that use a backend (it imports
    code), and ``PLANCACHE_PATCH_CUDNN``, which ``import plancache`` reads (never failing
    for it) and no command uses."""
    from .tiers.remote import settings_from_env

    for setting in SETTINGS:
        if setting not in (BACKEND, PATCH_CUDNN, *REDIS_SETTINGS):
            setting.from_env()
    settings_from_env()  # the Redis tier's, when PLANCACHE_REDIS_URL is set


class _Command(click.Command):
    """A plancache command: it takes the shared options after its name too, and reads the
    cache directory they chose and every setting before it runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params[:0] = _shared_options()

    def invoke(self, ctx: click.Context) -> Any:
        ctx.ensure_object(_Context).choose_directory()
        _check_settings()
        return super().invoke(ctx)


class _Group(click.Group):
    """The one place that maps errors to one line on stderr and an exit code (``_one_line``):
    plancache's own errors, OSError, ValueError, SQLite's errors, running out of memory and
    Python's recursion limit give exit code 1, a bad
    setting (``ConfigError``) 2, a manifest refused as a whole (``ManifestError``) or a bundle
    that cannot be imported 3. With ``--json`` the line is also printed on stdout as
    ``{"error": ..., "exit_code": ...}``, click's usage errors too. ``--debug`` shows the
    traceback instead."""

    command_class = _Command

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        words = list(args)  # click's parser consumes the list it reads
        try:
            return super().parse_args(ctx, args)
        except click.ClickException as exc:  # before the root command runs: its invoke never sees it
            _report_json(ctx, exc.format_message(), exc.exit_code, words)
            raise

    def invoke(self, ctx: click.Context) -> Any:
        obj = ctx.ensure_object(_Context)
        words = list(ctx.args)  # the words after the command name, which click reads only now
        try:
            try:
                return super().invoke(ctx)
            finally:
                sys.stdout.flush()  # a reader gone away is met here, not at the interpreter's exit
        except click.ClickException as exc:
            _report_json(ctx, exc.format_message(), exc.exit_code, words)
            raise
        except KeyboardInterrupt:  # click would print "Aborted!" and exit 1
            if obj.debug:
                raise
            click.echo("plancache: interrupted", err=True)
            _report_json(ctx, "interrupted", EXIT_INTERRUPTED)
            ctx.exit(EXIT_INTERRUPTED)
        except (PlanCacheError, OSError, ValueError, sqlite3.Error, RecursionError, MemoryError) as exc:
            if isinstance(exc, OSError) and exc.errno == errno.EPIPE:
                # stdout closed early (`plancache show KEY | head -1`): quietly, with the code
                # of a command SIGPIPE stopped; what is still buffered goes nowhere.
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                os.close(devnull)
                ctx.exit(EXIT_BROKEN_PIPE)
            if obj.debug:
                raise
            message, code = _one_line(exc)
            message = " ".join(message.split())
            click.echo(f"plancache: error: {message}", err=True)
            _report_json(ctx, message, code)
            ctx.exit(code)


@click.group(cls=_Group, params=_shared_options())
@click.option("--version", is_flag=True, expose_value=False, callback=_show_version,
              help='Show the version and exit (as {"version": ...} with --json).')  # fmt: skip
@click.pass_obj
def cli(obj: _Context) -> None:
    """plancache: a persistent, autotuning plan cache for cuDNN Frontend graphs."""
    logging.basicConfig(level=logging.DEBUG if obj.debug else logging.INFO, format="%(message)s", stream=sys.stderr)


def _exit_code_help() -> str:
    lines = [textwrap.fill(text.replace("`", ""), width=78, initial_indent=f"{code}  ", subsequent_indent="   ")
             for code, text in EXIT_CODES.items()]  # fmt: skip
    return "\n\n\b\nExit codes:\n" + "\n".join(lines)


cli.help = (cli.help or "") + _exit_code_help()


@cli.command()
def env() -> None:
    """The environment fingerprint that keys every plan on this machine, and the start-up hook."""
    from .engines.cudnn_backend import probe_environment
    from .integrations.startup import startup_hook_status

    data = probe_environment()
    data["startup_hook"] = startup_hook_status()  # whether PLANCACHE_PATCH_CUDNN reaches programs that never import plancache

    def text(d: dict[str, Any]) -> Iterable[str]:
        for name, value in d.items():
            yield f"{name:24} {value}"

    _emit(data, text)


@cli.command(name="ls")
@click.option("--env", "env_id", default=None, help="Only entries of this environment id, or a unique prefix of it.")
@click.pass_obj
def list_entries(obj: _Context, env_id: str | None) -> None:
    """List stored plans, most recently used first (none yet: an empty list). A row that
    cannot be decoded is left out, with a warning on stderr."""
    rows, env_id = _list_entries(obj, env_id)
    now = time.time()

    def text(data: list[dict[str, Any]]) -> Iterable[str]:
        if not data:
            yield obj.nothing_yet() if env_id is None else f"no plans of environment {env_id} in {obj.cache_dir}"
            return
        yield from _table(
            [[r["key"][:12], r["label"][:48], r["policy"], _size(r["blob_size"]), f"{r['build_seconds']:.2f}s",
              str(r["hit_count"]), _age(now - r["last_used_at"])] for r in data],
            ["KEY", "OPS", "POLICY", "BLOB", "BUILD", "HITS", "USED"],
        )  # fmt: skip

    _emit(rows, text)


def _list_entries(obj: _Context, env_id: str | None, store: Store | None = None) -> tuple[list[dict[str, Any]], str | None]:
    """The listing of the store (``store``, else the chosen directory's, closed after), of
    the environment ``env_id`` names (a unique prefix, or ``EntryNotFoundError``), and that
    environment's full id. Rows that cannot be decoded are reported and left out."""
    opened = store is None
    store = obj.existing_store() if store is None else store
    if store is None:
        if env_id is not None:
            raise EntryNotFoundError(f"environment {env_id!r} names no environment: nothing is stored yet in {obj.cache_dir}",
                                     key=env_id)  # fmt: skip
        return [], None
    undecodable: dict[str, str] = {}
    try:
        rows = maintenance.list_entries(store, undecodable=undecodable)
    finally:
        if opened:
            store.close()
    _warn_undecodable(undecodable)
    if env_id is not None:
        env_id = maintenance.environment_named(env_id, {row["env_id"] for row in rows}, str(store.path))
        rows = [row for row in rows if row["env_id"] == env_id]
    return rows, env_id


def _warn_undecodable(undecodable: Mapping[str, str]) -> None:
    """One line on stderr per row a read command left out because it cannot be decoded."""
    for key, why in undecodable.items():
        click.echo(f"plancache: warning: entry {key[:12]} left out: {why} ({maintenance.UNDECODABLE_HINT})", err=True)


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
    from .engines.autotune import check_summary

    check = data.get("check") or {}
    yield f"check          {check_summary(check)}"
    for rejected in check.get("rejected") or []:
        worst = rejected.get("worst")
        far = f"the worst {worst:.3g} times its bound" if worst is not None else "non-finite or integer values differ"
        yield (f"  rejected     #{rejected.get('index')} {rejected.get('engine')}: disagrees, {rejected.get('outside')} elements "
               f"outside their bound ({100 * float(rejected.get('fraction') or 0):.2g}%), {far}")  # fmt: skip
    tried = [c for c in data["candidates"] if c.get("status") != "not_built"]
    if tried:
        yield "candidates:"
        yield from ("  " + line for line in _table(
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


@cli.command()
@click.argument("key")
@click.option("--explain", is_flag=True, help="Show each part of the key with its own hash.")
@click.pass_obj
def show(obj: _Context, key: str, explain: bool) -> None:
    """Everything stored about one plan (KEY may be a unique prefix of 4 or more characters)."""
    store = obj.existing_store()
    try:
        entry = _entry(store, key, obj)
    finally:
        if store is not None:
            store.close()
    data = entry.header()
    data["blob_size"] = len(entry.blob)
    if explain:
        data["explain"] = _explain(_entry_parts(entry))
    _emit(data, _show_text)


@cli.command()
@click.argument("key_a")
@click.argument("key_b")
@click.pass_obj
def diff(obj: _Context, key_a: str, key_b: str) -> None:
    """Every difference between what two keys hash (graph, environment, options): one line
    per differing path with both values, e.g. ``graph.nodes[0].params.stride: [1, 1] -> [2, 2]``.
    With --json: a list of {path, a, b} (``absent``: the side that lacks the path). Exit code
    0 when the parts are identical, 1 when they differ (as diff(1))."""
    store = obj.existing_store()
    try:
        a, b = _entry(store, key_a, obj), _entry(store, key_b, obj)
    finally:
        if store is not None:
            store.close()
    result = [_difference(path, va, vb) for path, va, vb in _differences(_entry_parts(a), _entry_parts(b), "")]

    def text(d: list[dict[str, Any]]) -> Iterable[str]:
        if not d:
            yield "the keys have identical parts"
        for row in d:
            va = "(absent)" if row.get("absent") == "a" else json.dumps(row["a"], sort_keys=True)
            vb = "(absent)" if row.get("absent") == "b" else json.dumps(row["b"], sort_keys=True)
            yield f"{row['path']}: {va} -> {vb}"

    _emit(result, text)
    if result:
        sys.exit(EXIT_ERROR)


_ABSENT: Any = object()
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
        row["absent"] = "a" if a is _ABSENT else "b"
    return row


@cli.command()
@click.pass_obj
def stats(obj: _Context) -> None:
    """Totals of the store: entries, bytes, hits, quarantined entries, counters (remote
    hits, misses, publishes and refusals among them, as flushed by every process), and the
    graphs whose plans cannot be stored, and why."""
    store = obj.existing_store()
    undecodable: dict[str, str] = {}
    if store is None:
        data = _empty_stats(obj.cache_dir)
    else:
        try:
            data = store.stats()
            maintenance.list_entries(store, undecodable=undecodable)
        finally:
            store.close()
    _warn_undecodable(undecodable)
    data["undecodable"] = undecodable  # counted in the totals (they are rows of the file), shown nowhere else
    data["max_size"] = MAX_SIZE.from_env()

    from .tiers.remote import RemoteTier

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
        yield f"blobs         {_size(d['blob_bytes'])} (file {_size(d['file_bytes'])})"
        yield f"hits          {d['hits']}"
        yield f"size limit    {_size(d['max_size']) if d['max_size'] else 'none'} (PLANCACHE_MAX_SIZE)"
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

    _emit(data, text)


def _empty_stats(directory: Path) -> dict[str, Any]:
    """``Store.stats()`` of a cache with nothing stored yet (and no file)."""
    return {"path": str(directory / DB_NAME), "read_only": False, "file_bytes": 0, "entries": 0, "blob_bytes": 0, "hits": 0,
            "environments": 0, "build_seconds": 0.0, "by_policy": {}, "quarantined": 0, "unstored": [], "counters": {}}  # fmt: skip


@cli.command()
@click.argument("keys", nargs=-1, required=True)
@click.pass_obj
def rm(obj: _Context, keys: tuple[str, ...]) -> None:
    """Remove stored plans (each KEY may be a unique prefix of 4 or more characters).
    Every KEY is resolved first: if one is too short, unknown or ambiguous, nothing is
    removed."""
    store = obj.existing_store()
    if store is None:
        raise EntryNotFoundError(f"nothing removed: {obj.nothing_yet()}", key=keys[0])
    try:
        chosen: dict[str, str] = {}
        problems: dict[str, str] = {}
        for prefix in keys:
            try:
                chosen.setdefault(store.key_named(prefix), prefix)
            except EntryNotFoundError as exc:
                problems[prefix] = str(exc).replace(f" in {store.path}", "")
        if problems:
            raise EntryNotFoundError(f"nothing removed: {'; '.join(problems.values())} in {store.path}", key=next(iter(problems)))
        removed = [key for key in chosen if store.delete(key)]
    finally:
        store.close()
    _emit({"removed": removed}, lambda d: (f"removed {k}" for k in d["removed"]))


# ---------------------------------------------------------------------- verify, prune


def _backend_from_env() -> Any:
    """The backend named by ``PLANCACHE_BACKEND=module:Class`` (tests name the CPU one);
    None, so PlanCache uses cuDNN, when unset."""
    ref = BACKEND.from_env()
    if ref is None:
        return None
    from .engines.backend import Backend
    from .workflows.manifest import resolve_builder

    hint = "set it to module:Class, e.g. plancache.testing:CpuTestBackend, or unset it for cuDNN"
    try:
        target = resolve_builder(ref, BACKEND.name)
    except LookupError as exc:
        raise ConfigError(f"{exc}; {hint}", name=BACKEND.name, value=ref) from exc
    if not inspect.isclass(target):
        raise ConfigError(f"{BACKEND.name}={ref!r} is a {type(target).__name__}, not a backend class: {hint}",
                          name=BACKEND.name, value=ref)  # fmt: skip
    try:
        backend = target()
    except Exception as exc:  # the user's class: whatever its constructor raises
        raise ConfigError(f"{BACKEND.name}={ref!r}: {target.__name__}() failed: {type(exc).__name__}: {exc}",
                          name=BACKEND.name, value=ref) from exc  # fmt: skip
    if not isinstance(backend, Backend):
        members = {*Backend.__annotations__, *(n for n in vars(Backend) if not n.startswith("_"))}
        missing = sorted(m for m in members if not hasattr(backend, m))
        raise ConfigError(f"{BACKEND.name}={ref!r}: {target.__name__} is not a backend class"
                          f"{' (it lacks ' + ', '.join(missing) + ')' if missing else ''}: {hint}",
                          name=BACKEND.name, value=ref)  # fmt: skip
    return backend


def _backend() -> Any:
    """The ``PLANCACHE_BACKEND`` backend, else cuDNN's."""
    backend = _backend_from_env()
    if backend is None:
        from .engines.cudnn_backend import CudnnBackend

        backend = CudnnBackend()
    return backend


def _current_backend(why: str) -> Any:
    """``_backend()`` with its environment id. Without a GPU the cuDNN backend raises
    NoGpuError, reported as one line saying what needed it."""
    from .errors import NoGpuError
    from .key import environment_id

    backend = _backend()
    try:
        return backend, environment_id(backend.environment(backend.current_device()))
    except NoGpuError as exc:
        raise NoGpuError(f"{why} needs this machine's GPU environment: {exc}") from exc


def _verify_text(d: dict[str, Any]) -> Iterable[str]:
    yield f"checked {d['entries']} entries in {d['path']}"
    if d["deserialize"] is not None:
        ds = d["deserialize"]
        yield f"deserialized {ds['checked']} of environment {ds['env_id']} ({ds['skipped']} of other environments skipped)"
    yield from (f"problem: {p}" for p in d["problems"])
    fixed = d["fixed"]
    if fixed.get("moved_aside"):
        yield f"fixed: moved the damaged file to {fixed['moved_aside']} (kept); copied {fixed['salvaged']} intact entries"
    yield from (f"fixed: quarantined {k}" for k in fixed.get("quarantined", []))
    yield from (f"fixed: removed the kernel cache of {e}" for e in fixed.get("kernel_caches_removed", []))
    if not d["problems"]:
        yield "ok"
    elif not fixed:
        yield f"{len(d['problems'])} problem(s); `plancache verify --fix` quarantines entries and sets a damaged file aside"


@cli.command()
@click.option("--fix", is_flag=True, help="Quarantine bad entries; move a damaged file aside (kept) and copy its intact entries.")
@click.option("--deserialize", is_flag=True, help="Also load every blob of this machine's environment (needs the GPU).")
@click.pass_obj
def verify(obj: _Context, fix: bool, deserialize: bool) -> None:
    """Check the store: SQLite integrity, every blob's checksum, every entry's key against
    what it records, kernel caches. Exit code 3 when problems were found (also when --fix
    fixed them: run it again to confirm). Nothing is ever deleted: see docs/reliability.md."""
    store = obj.existing_store(damaged_ok=True)
    if store is None:  # nothing stored yet: nothing to check, and nothing that needs the GPU
        report = _empty_verify(obj.cache_dir, fix=fix, deserialize=deserialize)
        _emit(report, lambda d: [f"{obj.nothing_yet()}: nothing to check", "ok"])
        return
    try:
        load, env_id = None, None
        if deserialize:
            from .key import TensorSpec

            backend, env_id = _current_backend("verify --deserialize")
            load = lambda e: backend.load(e.blob, [TensorSpec.from_dict(t) for t in e.tensors])  # noqa: E731
        report = maintenance.verify(store, fix=fix, load=load, env_id=env_id)
    finally:
        store.close()
    _emit(report, _verify_text)
    if report["problems"]:
        sys.exit(EXIT_PROBLEMS)


def _empty_verify(directory: Path, *, fix: bool, deserialize: bool) -> dict[str, Any]:
    """``maintenance.verify``'s report on a cache with nothing stored yet."""
    report: dict[str, Any] = {"path": str(directory / DB_NAME), "entries": 0, "integrity": [], "checksum": [], "foreign": {},
                              "damaged": {}, "unreadable": [], "kernel_caches": [], "deserialize": None, "fixed": {},
                              "problems": []}  # fmt: skip
    if deserialize:
        report["deserialize"] = {"env_id": None, "checked": 0, "skipped": 0, "failed": {}}
    if fix:
        report["fixed"] = {"quarantined": [], "kernel_caches_removed": []}
    return report


class _Days(click.ParamType):
    """A number of days, 0 or more: ``30``, ``0.5`` (12 hours)."""

    name = "days"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:  # ctx: click >= 8.2
        return "DAYS"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            return value
        try:
            days = float(value)
        except (TypeError, ValueError):
            days = float("nan")
        if not days >= 0 or days == float("inf"):  # also NaN
            self.fail(f"{value!r} is not a number of days: write 0 or more, such as 30, or 0.5 for 12 hours", param, ctx)
        return days


#: An ``--older-than`` below this many days may remove plans that running jobs still use
#: (last use is written in batches): it needs ``--force`` when it would.
RECENT_DAYS = 1.0


def _refuse_recent(report: Mapping[str, Any], days: float) -> None:
    """Refuse, naming what would go, an age prune that removes entries used within the last
    ``RECENT_DAYS``."""
    now = time.time()
    recent = [r for r in report["removed"] if r["reason"].startswith("unused") and now - r["last_used_at"] < RECENT_DAYS * 86400]
    if not recent:
        return
    newest = _age(max(0.0, now - max(r["last_used_at"] for r in recent)))
    aged = [r for r in report["removed"] if r["reason"].startswith("unused")]
    raise PlanCacheError(
        f"refused: --older-than {days:g} would remove {len(aged)} entries ({_size(sum(r['blob_size'] for r in aged))}), "
        f"{len(recent)} of them used in the last day (the latest {newest} ago), which running jobs may still be using; "
        "pass --force to remove them, or --dry-run to list them"
    )


@cli.command()
@click.option("--other-environments", is_flag=True, help="Entries of any other GPU, driver, CUDA, cuDNN or frontend version.")
@click.option("--older-than", "days", type=_Days(), default=None,
              help="Entries unused for more than DAYS days (0.5: 12 hours). Below 1 day, removing entries used in the "
                   "last day needs --force.")  # fmt: skip
@click.option("--quarantined", is_flag=True, help="Every quarantined entry.")
@click.option("--dry-run", is_flag=True, help="Only say what would be removed.")
@click.option("--force", is_flag=True, help="With --older-than below 1 day: remove entries used in the last day too.")
@click.pass_obj
def prune(obj: _Context, other_environments: bool, days: float | None, quarantined: bool, dry_run: bool, force: bool) -> None:
    """Remove entries of other environments, entries unused for DAYS days, quarantined
    entries (any combination), in small transactions that running jobs hardly notice.

    An --older-than below 1 day that would remove entries used in the last day (plans a
    running job may be using: --older-than 0 removes every entry) is refused, saying what
    it would remove, unless --force."""
    if not (other_environments or days is not None or quarantined):
        raise click.UsageError("say what to prune: --other-environments, --older-than DAYS and/or --quarantined")
    store = obj.existing_store()
    if store is None:  # nothing stored yet: nothing to remove, and nothing that needs the GPU
        report: dict[str, Any] = {"dry_run": dry_run, "removed": [], "bytes": 0, "kernel_caches": [], "quarantined": 0}
    else:
        try:
            keep = {_current_backend("prune --other-environments")[1]} if other_environments else None
            older_than_s = days * 86400 if days is not None else None
            if days is not None and days < RECENT_DAYS and not (force or dry_run):
                _refuse_recent(maintenance.prune(store, older_than_s=older_than_s, dry_run=True), days)
            report = maintenance.prune(store, env_ids_keep=keep, older_than_s=older_than_s, quarantined=quarantined,
                                       dry_run=dry_run)  # fmt: skip
        finally:
            store.close()

    def text(d: dict[str, Any]) -> Iterable[str]:
        if store is None:
            yield f"{obj.nothing_yet()}: nothing to remove"
        verb = "would remove" if d["dry_run"] else "removed"
        for row in d["removed"]:
            yield f"{verb} {row['key'][:12]}  {row['label'][:40]}  ({row['reason']})"
        yield f"{verb} {len(d['removed'])} entries ({_size(d['bytes'])}), {d['quarantined']} quarantined entries, " \
              f"{len(d['kernel_caches'])} kernel caches"  # fmt: skip

    _emit(report, text)


# ---------------------------------------------------------------------- prewarm, bundles, inspect


def _prewarm_dry_run(obj: _Context, manifest: Path, options: Any, *, progress: bool) -> dict[str, Any]:
    """``prewarm --dry-run``: the manifest checked without a cache, on any machine. The
    cuDNN backend is never set up (no GPU, no CUDA); a ``PLANCACHE_BACKEND`` gives keys, and
    an existing store, opened read-only, the entries already stored. Nothing is written."""
    from .workflows.prewarm import dry_run

    backend = _backend_from_env()
    environment = backend.environment(backend.current_device()) if backend is not None else None
    store = obj.existing_store(read_only=True) if backend is not None else None
    try:
        return dry_run(manifest, environment=environment, store=store, options=options, progress=progress)
    finally:
        if store is not None:
            store.close()


def _devices_option(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | list[int] | None:
    """``--devices``: "all" or indices, checked before anything is created (the indices
    against the machine's devices once the backend is known)."""
    if value is None:
        return None
    from .workflows.sharding import parse_devices

    try:
        return parse_devices(value)
    except ConfigError as exc:
        raise click.BadParameter(exc.message) from exc


def _resolve_devices(backend: Any, spec: str | list[int]) -> list[int]:
    """The ``--devices`` indices on this machine: an index it lacks is a usage error."""
    from .errors import NoGpuError
    from .workflows.sharding import resolve_devices

    count = backend.device_count()
    if count < 1:
        raise NoGpuError(f"prewarm --devices needs this machine's GPUs, and the {backend.name} backend sees none")
    try:
        return resolve_devices(spec, count)
    except ConfigError as exc:
        raise click.BadParameter(exc.message, param_hint="'--devices'") from exc


@cli.command()
@click.argument("manifest", type=click.Path(path_type=Path))
@click.option("--dry-run", is_flag=True, help="Check the manifest on any machine (no GPU needed): build nothing, write nothing.")
@click.option("--policy", type=click.Choice(["topk", "exhaustive", "heuristic"]), default=None,
              help="Build policy of entries without their own options (default: topk, as PlanCache uses).")  # fmt: skip
@click.option("--no-progress", is_flag=True, help="No progress bar (shown only when stderr is a terminal).")
@click.option("--allow-code", is_flag=True,
              help="Run the manifest's builder entries (they import and call module:function) and apply its "
                   "pythonpath. Only for manifests you trust.")  # fmt: skip
@click.option("--devices", "devices_spec", metavar="all|LIST", callback=_devices_option,
              help="Share the entries across these GPUs of this machine, one worker process each: 'all' or "
                   "indices such as 0,1 (default: the current GPU, in this process). Not used by --dry-run.")  # fmt: skip
@click.pass_obj
def prewarm(
    obj: _Context,
    manifest: Path,
    dry_run: bool,
    policy: str | None,
    no_progress: bool,
    allow_code: bool,
    devices_spec: str | list[int] | None,
) -> None:
    """Build and autotune every graph MANIFEST names (JSON or TOML; see docs/prewarm.md).

    Plans already stored are skipped (counted as hits), so an interrupted run resumes.
    A failing entry is reported and the others still run; the exit code is 3 if any failed,
    1 if a plan was built but could not be stored.

    Before anything is created, the manifest is read whole (a manifest that cannot be read
    or is invalid is refused: exit code 3), then the GPU is set up and the cache directory
    checked: one that cannot be created or written, or that other users can write, is an
    error, never a run that stores nothing.

    Builder entries and "pythonpath" run code: they are refused (nothing is built, exit
    code 3) unless --allow-code; then builder modules import from the current directory and the
    manifest's "pythonpath".

    --dry-run checks the manifest on any machine, GPU or not, and writes nothing: every
    entry's graph is built and described, duplicates and failing entries are reported,
    builder entries are listed without being imported. Keys depend on the GPU, which a dry
    run never sets up, so entries are "checked" without a key; with PLANCACHE_BACKEND (the
    CPU test backend, say) they get that backend's keys, and an existing cache tells which
    are already stored.

    --devices shares the entries across several GPUs of one environment (same model,
    driver and libraries), one worker process per GPU; the keys are those of a one-GPU
    prewarm.
    """
    from .key import BuildOptions
    from .workflows.manifest import refuse_unusable
    from .workflows.prewarm import prewarm as run_prewarm
    from .workflows.prewarm import record_line, summary_lines
    from .workflows.sharding import check_environments

    refuse_unusable(manifest, allow_code=allow_code or dry_run)
    options = BuildOptions(policy=policy) if policy else None
    if dry_run:
        report = _prewarm_dry_run(obj, manifest, options, progress=not no_progress)
        _emit(report, summary_lines)
        if report["failed"]:
            sys.exit(EXIT_PROBLEMS)
        return
    from .cache.cache import PlanCache
    from .tiers.remote import RemoteTier

    backend = _backend()
    devices = _resolve_devices(backend, devices_spec) if devices_spec is not None else None
    if devices:  # devices of one environment, or one line naming how they differ, before anything is created
        check_environments({device: backend.environment(device) for device in devices})
    else:
        backend.environment(None)  # no GPU: one line, and nothing created yet
    remote = RemoteTier.from_env()  # without redis-py installed: one line, and nothing created yet
    obj.writable_store().close()
    if allow_code and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would: builder modules next to the user
    # No auto-prime: a command looks plans up once, it does not run a model's steps.
    cache = PlanCache(obj.directory, backend=backend, remote=remote, auto_prime=False)
    # On a terminal each entry's row is printed as it finishes; a pipe or --json gets the report at the end.
    live = not obj.as_json and _stdout_is_terminal()
    on_record = (lambda record: click.echo(record_line(record))) if live else None
    try:
        with _stoppable(functools.partial(summary_lines, rows=not live)):
            report = run_prewarm(cache, manifest, progress=not no_progress, options=options, allow_code=allow_code,
                                 devices=devices, on_record=on_record)  # fmt: skip
    finally:
        cache.close()
    _emit(report, functools.partial(summary_lines, rows=not live))
    if report["unpersisted"]:
        sys.exit(EXIT_ERROR)
    if report["failed"]:
        sys.exit(EXIT_PROBLEMS)


@cli.command()
@click.argument("keys", nargs=-1)
@click.option("--no-progress", is_flag=True, help="No progress bar (shown only when stderr is a terminal).")
@click.pass_obj
def tune(obj: _Context, keys: tuple[str, ...], no_progress: bool) -> None:
    """Finish the autotuning that a miss's time budget cut short (PLANCACHE_AUTOTUNE_BUDGET).

    Every entry of this GPU's environment whose miss stopped at the budget (or only KEYS,
    keys or unique prefixes, whatever their record says) has its graph replayed from its
    description and autotuned again on this GPU with no budget; the choice replaces the
    entry, and later lookups run it. Needs the GPU the entries were built for. The exit
    code is 3 if an entry could not be tuned.
    """
    from .cache.cache import PlanCache
    from .workflows.tune import tune as run_tune
    from .workflows.tune import tune_report

    store = obj.existing_store()
    try:
        digests = [_entry(store, key, obj).key for key in keys] if keys else None
    finally:
        if store is not None:
            store.close()
    if store is None:  # nothing cached yet: nothing to tune, and nothing created
        _emit(tune_report([]), _tune_text)
        return
    backend = _backend()
    backend.environment()  # no GPU: one line, before anything is opened for writing
    obj.writable_store().close()
    # No auto-prime: a command that replays graphs runs no model.
    cache = PlanCache(obj.directory, backend=backend, auto_prime=False)
    try:
        with _stoppable(_tune_text):
            report = run_tune(cache, digests, progress=not no_progress)
    finally:
        cache.close()
    _emit(report, _tune_text)
    if report["failed"]:
        sys.exit(EXIT_PROBLEMS)


@contextlib.contextmanager
def _stoppable(lines: Callable[[Mapping[str, Any]], Iterable[str]]) -> Iterator[None]:
    """A long command (``prewarm``, ``tune``) that Ctrl-C, SIGTERM or SIGHUP stops (what
    ``timeout``, CI runners, Kubernetes and Slurm send: before, it died silently) reports
    what it finished, as ``lines`` or JSON, then one line, exit 130. The first signal only:
    a second does not cut the report short."""
    from .workflows.steps import Interrupted

    def stop(_signum: int, _frame: Any) -> None:
        for number in _STOPPING:
            signal.signal(number, signal.SIG_IGN)
        raise KeyboardInterrupt

    main = threading.current_thread() is threading.main_thread()  # only the main thread sets handlers
    previous = {number: signal.signal(number, stop) for number in _STOPPING} if main else {}
    try:
        yield
    except Interrupted as stopped:
        if stopped.report is None:  # not the command's own: nothing to report
            raise
        _emit(stopped.report, lines)
        click.echo("plancache: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


_STOPPING = (signal.SIGTERM, signal.SIGHUP)  # SIGINT raises KeyboardInterrupt already


def _tune_text(report: Mapping[str, Any]) -> Iterable[str]:
    for row in report["rows"]:
        before, after = row.get("before") or {}, row.get("after") or {}
        if row["status"] == "tuned":
            yield (f"{row['key'][:12]}  tuned {before.get('tuned')} -> {after.get('tuned')} of {after.get('candidates')} "
                   f"candidates: {before.get('engine')} -> {after.get('engine')} ({row['seconds']:.2f}s)")  # fmt: skip
        else:
            yield f"{row['key'][:12]}  failed: {row.get('error')}"
    why = report.get("why")
    stopped = f"; interrupted, {report['not_run']} not run (run it again to tune them)" if report.get("interrupted") else ""
    yield (
        why
        if why
        else f"{report['tuned']} tuned, {report['failed']} failed{stopped}"
        if report["rows"] or stopped
        else "nothing to tune"
    )


@cli.command(name="export")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--env", "env_id", default=None,
              help="Only entries of this environment id, or a unique prefix of it (see `plancache ls --json`).")  # fmt: skip
@click.option("--key", "keys", multiple=True, help="Only this entry (a key or a unique prefix, 4 or more characters); repeatable.")  # fmt: skip
@click.option("--force", is_flag=True, help="Replace FILE if it exists (a regular file only).")
@click.pass_obj
def export_cmd(obj: _Context, file: Path, env_id: str | None, keys: tuple[str, ...], force: bool) -> None:
    """Write stored plans to one portable bundle FILE, to ship inside a container image
    or to another machine (`plancache import` merges it there). An existing FILE is
    refused unless --force; a symlink, FIFO or device is never replaced. With
    PLANCACHE_REDIS_SECRET_FILE or PLANCACHE_REDIS_SECRET set, the bundle is signed."""
    from .workflows.bundle import export_bundle

    if not force and file.is_file() and not file.is_symlink():  # special files: export_bundle names what they are
        raise PlanCacheError(f"refused: {file} exists; pass --force to replace it", path=str(file))
    store = obj.existing_store()
    try:
        report = export_bundle(store, file, env_id=env_id, keys=list(keys) or None, replace=force)
    finally:
        if store is not None:
            store.close()

    def text(d: dict[str, Any]) -> Iterable[str]:
        if store is None:
            yield f"{obj.nothing_yet()}: the bundle is empty"
        yield f"exported {d['entries']} plans ({_size(d['bytes'])}) to {d['path']}"
        yield (f"  signed with secret key id {d['key_id']}" if d["key_id"] else
               f"  unsigned: no {REDIS_SECRET_FILE.name} or {REDIS_SECRET.name} is set, so importing it needs --allow-unsigned")  # fmt: skip
        for env_id, summary in d["environments"].items():
            yield f"  environment {env_id}: {summary}"
        for key, reason in d["skipped"].items():
            yield f"  left out {key[:12]}: {reason}"

    _emit(report, text)


@cli.command(name="import")
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--replace", is_flag=True, help="Replace plans the cache already has (default: keep the sound ones).")
@click.option("--env", "env_id", default=None, help="Only import entries of this environment id, or a unique prefix of it.")
@click.option("--allow-unsigned", is_flag=True,
              help="Import a bundle that is unsigned or signed with another secret (only from a source you trust).")  # fmt: skip
@click.pass_obj
def import_cmd(obj: _Context, file: Path, replace: bool, env_id: str | None, allow_unsigned: bool) -> None:
    """Merge bundle FILE into the cache. The whole bundle is verified first (signature,
    format, checksums, keys, environments, member names): an unsigned or foreign-signed
    bundle (without --allow-unsigned), a truncated, tampered, newer-format or unsafe one,
    or a FILE that is no regular file is refused (exit code 3) and the cache is left
    unchanged: a cache that did not exist yet is not created. The signature is checked
    under PLANCACHE_REDIS_SECRET_FILE or PLANCACHE_REDIS_SECRET, the sender's secret."""
    from .workflows.bundle import bundle_environment, import_bundle, read_bundle

    bundle = read_bundle(file, allow_unsigned=allow_unsigned)
    if env_id is not None:
        env_id = bundle_environment(bundle, env_id)  # a typo, before the cache is created
    store = obj.writable_store()
    try:
        report = import_bundle(store, bundle, replace=replace, env_id=env_id)
    finally:
        store.close()

    def text(d: dict[str, Any]) -> Iterable[str]:
        yield (f"imported {len(d['imported'])} plans, replaced {len(d['replaced'])}, kept {len(d['kept'])} existing, "
               f"skipped {len(d['skipped'])} of other environments (bundle of {d['entries']})")  # fmt: skip
        yield "  signature verified" if d["signature"] == "verified" else f"  signature {d['signature']} (--allow-unsigned)"
        for env_id, summary in d["environments"].items():
            yield f"  environment {env_id}: {summary}"

    _emit(report, text)


def _readable(store: Store, key: str) -> Entry | None:
    """The entry, or None for one row that cannot be decoded (reported on stderr): the
    other entries are still shown, as ``ls`` shows them."""
    try:
        return store.get(key)
    except DamagedEntryError as exc:
        _warn_undecodable({key: f"{exc.message.partition(': ')[2] or exc.message}"})
        return None


@cli.command(name="inspect")
@click.argument("keys", nargs=-1)
@click.option("--env", "env_id", default=None, help="Only entries of this environment id, or a unique prefix of it.")
@click.pass_obj
def inspect_plans(obj: _Context, keys: tuple[str, ...], env_id: str | None) -> None:
    """A readable report per stored plan (all, or each KEY prefix): ops, shapes, dtypes,
    chosen engine, the candidates' timings, speed-up over the heuristics' first choice,
    hits and age."""
    from .workflows.report import entry_report, report_lines

    store = obj.existing_store()
    try:
        entries: list[Entry | None]
        if keys or (store is None and env_id is None):  # nothing stored yet: no entries, and no KEY can match
            entries = [_entry(store, k, obj) for k in keys]
        else:
            rows, env_id = _list_entries(obj, env_id, store)
            entries = [_readable(store, r["key"]) for r in rows] if store is not None else []
        data = [entry_report(e) for e in entries if e is not None]
    finally:
        if store is not None:
            store.close()

    def text(d: list[dict[str, Any]]) -> Iterable[str]:
        if not d:
            yield obj.nothing_yet() if env_id is None else f"no plans of environment {env_id} in {obj.cache_dir}"
        for i, report in enumerate(d):
            if i:
                yield ""
            yield from report_lines(report)

    _emit(data, text)


# ---------------------------------------------------------------------- sql

#: Views ``plancache sql`` adds for scripts, so that they need not decode the JSON columns
#: of ``plans``. They are TEMP views of the command's own read-only connection: the store
#: is never changed, and an older plancache reads it as before.
SQL_VIEWS: dict[str, str] = {
    "entries": "SELECT key, env_id, label, json_extract(environment_json, '$.gpu_name') AS gpu, "
               "json_extract(engine_json, '$.name') AS engine, policy, backend, length(blob) AS blob_size, workspace_size, "
               "build_seconds, autotune_seconds, hit_count, datetime(created_at, 'unixepoch') AS created, "
               "datetime(last_used_at, 'unixepoch') AS last_used FROM plans",
    "quarantined": "SELECT id, key, reason, datetime(quarantined_at, 'unixepoch') AS quarantined, length(blob) AS blob_size "
                   "FROM quarantine",
}  # fmt: skip


def _empty_schema() -> sqlite3.Connection:
    """The tables of a store with nothing in it, in memory: a cache that does not exist yet
    is queried as an empty one."""
    from .store import migrations

    conn = sqlite3.connect(":memory:", isolation_level=None)
    for _number, _name, script in migrations():
        conn.executescript(script)
    return conn


def _cell(value: Any, *, as_json: bool) -> Any:
    """A value of a row as printed: a blob by its size (or base64 in JSON, as sqlite-utils
    writes it)."""
    if isinstance(value, bytes):
        if as_json:
            import base64

            return {"$base64": True, "encoded": base64.b64encode(value).decode()}
        return f"<{len(value)} bytes>"
    return value


@cli.command()
@click.argument("query", required=False)
@click.option("-p", "--param", "params", nargs=2, multiple=True, metavar="NAME VALUE",
              help="A value for :NAME in QUERY (repeatable).")  # fmt: skip
@click.option("--csv", "as_csv", is_flag=True, help="Print CSV, with a header row.")
@click.pass_obj
def sql(obj: _Context, query: str | None, params: tuple[tuple[str, str], ...], as_csv: bool) -> None:
    """Run a read-only SQL QUERY on the store and print its rows (a table, --json or --csv);
    without QUERY, list the tables and views with their columns and rows.

    Besides the store's tables (plans, quarantine, counters, kernel_caches, app_plans) two
    views read well from scripts: entries (one row per plan: key, env_id, label, gpu,
    engine, policy, backend, blob_size, workspace_size, build_seconds, autotune_seconds,
    hit_count, created, last_used) and quarantined. The store is opened read-only: a query
    that would change it fails. For example:

        plancache sql "SELECT label, engine, hit_count FROM entries ORDER BY hit_count DESC LIMIT 5"
    """
    import sqlite_utils  # the one user of sqlite-utils: off the library's import path and the other commands'

    store = obj.existing_store(read_only=True)
    db = sqlite_utils.Database(store.connection() if store is not None else _empty_schema())
    try:
        # The views live in this connection's temporary schema, never in plans.db; the
        # store's query_only guard (see Store.connection) is lifted only while they are made.
        db.execute("PRAGMA query_only = OFF")
        for name, select in SQL_VIEWS.items():
            db.execute(f"CREATE TEMP VIEW {name} AS {select}")
        db.execute("PRAGMA query_only = ON")
        # query_only refuses writes to tables, not a pragma that changes the file (a journal
        # mode, say): the user's query may read, and ask the pragmas that only read.
        refused: list[str] = []  # what the authorizer refused, to say so (SQLite says only "not authorized")
        db.conn.set_authorizer(functools.partial(_reads_only, refused))
        if query is None:
            names = [*(n for n in db.table_names() if not n.startswith("sqlite_")), *SQL_VIEWS]
            data: list[dict[str, Any]] = [{"name": name, "kind": "view" if name in SQL_VIEWS else "table",
                                           "columns": [d[0] for d in db.execute(f"SELECT * FROM [{name}] LIMIT 0").description],
                                           "rows": db[name].count} for name in names]  # fmt: skip
            _emit(data, lambda d: (f"{t['kind']:5} {t['name']:14} {t['rows']:>7} rows  {', '.join(t['columns'])}" for t in d))
        else:  # printed as the rows come, with the store still open: a result can be larger than memory
            columns, rows = _query(db.conn, query, dict(params), refused, as_json=obj.as_json)
            if obj.as_json:
                _print_json_rows(rows)
            elif as_csv:
                _print_csv(columns, rows)
            else:
                _print_table(columns, rows)
    finally:
        db.close()
        if store is not None:
            store.close()


#: What reading takes: selects, reads, recursive queries and sqlite-utils' savepoint (functions: ``_PURE``).
_READING = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE, sqlite3.SQLITE_SAVEPOINT,
                      sqlite3.SQLITE_TRANSACTION})  # fmt: skip
#: The functions a query may call: SQLite's core, date, math, JSON, aggregate and window
#: functions, which compute a value and change nothing. Left out: those with side effects
#: (load_extension loads native code, fts3_tokenizer can register one, sqlite_log writes
#: the error log) and those of full-text and R-tree tables, which plans.db has none of.
_PURE = frozenset({
    "abs", "changes", "char", "coalesce", "format", "glob", "hex", "ifnull", "iif", "instr", "last_insert_rowid",
    "length", "like", "likelihood", "likely", "lower", "ltrim", "max", "min", "nullif", "printf", "quote", "random",
    "randomblob", "replace", "round", "rtrim", "sign", "soundex", "sqlite_compileoption_get", "sqlite_compileoption_used",
    "sqlite_source_id", "sqlite_version", "substr", "substring", "total_changes", "trim", "typeof", "unicode", "unlikely",
    "upper", "zeroblob", "subtype",
    "date", "time", "datetime", "julianday", "unixepoch", "strftime", "current_date", "current_time", "current_timestamp",
    "acos", "acosh", "asin", "asinh", "atan", "atan2", "atanh", "ceil", "ceiling", "cos", "cosh", "degrees", "exp",
    "floor", "ln", "log", "log10", "log2", "mod", "pi", "pow", "power", "radians", "sin", "sinh", "sqrt", "tan", "tanh",
    "trunc",
    "json", "json_array", "json_array_length", "json_extract", "->", "->>", "json_insert", "json_object", "json_patch",
    "json_quote", "json_remove", "json_replace", "json_set", "json_type", "json_valid", "json_group_array",
    "json_group_object", "json_each", "json_tree",
    "avg", "count", "group_concat", "sum", "total", "cume_dist", "dense_rank", "first_value", "lag", "last_value", "lead",
    "nth_value", "ntile", "percent_rank", "rank", "row_number",
})  # fmt: skip
#: Pragmas that only read, asked without a value (``PRAGMA table_info(plans)`` passes its
#: table as the value, and is allowed by name).
_READ_PRAGMAS = frozenset({"table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo",
                           "foreign_key_list", "database_list", "collation_list", "function_list", "module_list",
                           "pragma_list", "compile_options", "user_version", "schema_version", "application_id",
                           "page_count", "page_size", "freelist_count", "journal_mode", "encoding", "quick_check",
                           "integrity_check"})  # fmt: skip
_WITH_TABLE = frozenset({"table_info", "table_xinfo", "index_list", "index_info", "index_xinfo", "foreign_key_list",
                         "quick_check", "integrity_check"})  # fmt: skip


def _reads_only(
    refused: list[str], action: int, first: str | None, second: str | None, _database: str | None, _trigger: str | None
) -> int:
    """A SQLite authorizer for ``plancache sql``: reads (in sqlite-utils' savepoint), pure
    functions and pragmas that only read. What it refuses is added to ``refused``, in words."""
    if action in _READING or (action == sqlite3.SQLITE_FUNCTION and (second or "").lower() in _PURE):
        return sqlite3.SQLITE_OK
    pragma = (first or "").lower()
    reads = action == sqlite3.SQLITE_PRAGMA and pragma in _READ_PRAGMAS and (second is None or pragma in _WITH_TABLE)
    if not reads:
        refused.append(_refused_action(action, first, second))
    return sqlite3.SQLITE_OK if reads else sqlite3.SQLITE_DENY


#: SQLite's authorizer actions, by code (the sqlite3 module has them as constants only).
_ACTIONS = {getattr(sqlite3, f"SQLITE_{name}"): name.replace("_", " ").lower() for name in (
    "CREATE_INDEX", "CREATE_TABLE", "CREATE_TEMP_INDEX", "CREATE_TEMP_TABLE", "CREATE_TEMP_TRIGGER", "CREATE_TEMP_VIEW",
    "CREATE_TRIGGER", "CREATE_VIEW", "DELETE", "DROP_INDEX", "DROP_TABLE", "DROP_TEMP_INDEX", "DROP_TEMP_TABLE",
    "DROP_TEMP_TRIGGER", "DROP_TEMP_VIEW", "DROP_TRIGGER", "DROP_VIEW", "INSERT", "UPDATE", "ATTACH", "DETACH",
    "ALTER_TABLE", "REINDEX", "ANALYZE", "CREATE_VTABLE", "DROP_VTABLE") if hasattr(sqlite3, f"SQLITE_{name}")}  # fmt: skip


_ACTIONS.update({sqlite3.SQLITE_DELETE: "delete from", sqlite3.SQLITE_INSERT: "insert into", sqlite3.SQLITE_ATTACH: "attach"})


def _refused_action(action: int, first: str | None, second: str | None) -> str:
    if action == sqlite3.SQLITE_FUNCTION:
        return f"call {second}(), which is not one of the functions it allows (those that only compute a value)"
    if action == sqlite3.SQLITE_PRAGMA:
        return f"set PRAGMA {first} = {second}" if second is not None else f"run PRAGMA {first}, which can change the file"
    what = _ACTIONS.get(action, f"run SQLite action {action}")
    return f"{what} {first}" if first else f"{what} a database (VACUUM does)" if action == sqlite3.SQLITE_ATTACH else what


def _query(
    conn: sqlite3.Connection, query: str, params: Mapping[str, str], refused: list[str], *, as_json: bool
) -> tuple[list[str], Iterator[dict[str, Any]]]:
    """The column names and the rows, as they are read, of the user's one reading statement;
    a refusal or failure in plancache's words (SQLite says only "not authorized" for a
    write, and sqlite-utils named its own methods for a statement without rows)."""

    def failed(exc: sqlite3.Error) -> PlanCacheError:
        if refused:
            return PlanCacheError(f"the query failed: it would {', '.join(dict.fromkeys(refused))}, and plancache sql only "
                                  "reads (the store is opened read-only; the other commands change it)")  # fmt: skip
        if "one statement at a time" in str(exc):
            return PlanCacheError("the query failed: it holds more than one statement; give one")
        return PlanCacheError(f"the query failed: {exc}")

    try:
        cursor = conn.execute(query, params)
    except sqlite3.Error as exc:
        raise failed(exc) from exc
    if cursor.description is None:
        raise PlanCacheError("the query failed: it returns no rows (plancache sql runs one SELECT, or a pragma that "
                             "only reads)")  # fmt: skip
    names = [column[0] for column in cursor.description]

    def rows() -> Iterator[dict[str, Any]]:
        try:
            for row in cursor:
                yield {name: _cell(value, as_json=as_json) for name, value in zip(names, row)}
        except sqlite3.Error as exc:  # a failure part-way (an error a row's value raises)
            raise failed(exc) from exc

    return names, rows()


#: Rows a table is aligned over: a longer result is printed as it is read, each block of
#: this many rows aligned on its own (a table is aligned over all of its rows, which a
#: result larger than memory cannot wait for), the header above the first.
TABLE_BLOCK = 1000


def _print_table(columns: list[str], rows: Iterator[dict[str, Any]]) -> None:
    header: Sequence[str] = columns
    for block in iter(lambda: list(itertools.islice(rows, TABLE_BLOCK)), []):
        click.echo("\n".join(_table([[str(v) for v in row.values()] for row in block], header)))
        header = ()
    if header:
        click.echo("(no rows)")


def _print_json_rows(rows: Iterator[dict[str, Any]]) -> None:
    """The rows as one JSON array, written as they are read: the same text as ``_emit``'s."""
    out = sys.stdout
    first = True
    for row in rows:
        out.write(("[\n" if first else ",\n") + textwrap.indent(json.dumps(row, indent=2, sort_keys=True, default=str), "  "))
        first = False
    out.write("[]\n" if first else "\n]\n")


def _print_csv(columns: list[str], rows: Iterator[dict[str, Any]]) -> None:
    import csv

    writer = None
    for row in rows:
        if writer is None:
            writer = csv.DictWriter(sys.stdout, fieldnames=columns, lineterminator="\n")
            writer.writeheader()
        writer.writerow({k: v if not isinstance(v, list) else ", ".join(v) for k, v in row.items()})


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``plancache`` console script."""
    cli.main(args=argv, prog_name="plancache")
