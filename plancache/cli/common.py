"""What every ``plancache`` command shares: the exit codes (``EXIT_CODES``), the options
that go before or after the command name (``shared_options``), the command class that
reads them and every setting before a command runs (``Command``), the context they fill
(``Context``), how a command prints its data (``emit``, ``table``), and the backend a
command builds or checks plans with."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import click

from ..config import ALLOW_SHARED_DIR, BACKEND, CACHE_DIR, PATCH_CUDNN, REDIS_SETTINGS, SETTINGS, ConfigError
from ..errors import CacheDirError, EntryNotFoundError, StoreError
from ..store import DB_NAME, Entry, Store, check_private, default_cache_dir

__all__ = ["EXIT_BROKEN_PIPE", "EXIT_CODES", "EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_PROBLEMS", "EXIT_USAGE", "Command",
           "Context", "backend_from_env", "chosen_backend", "current_backend", "emit", "entry_named", "shared_options",
           "table"]  # fmt: skip

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


@dataclasses.dataclass
class Context:
    """What the options before and after the command name chose."""

    #: What the last ``--dir`` said, before or after the command name (None: not given).
    dir_option: str | None = None
    directory: Path | None = None  # None: the default one
    #: What named the directory ("--dir", "PLANCACHE_DIR"), None for the default one.
    named_by: str | None = None
    debug: bool = False
    as_json: bool = False

    def choose_directory(self) -> None:
        """The directory ``--dir`` names, else ``PLANCACHE_DIR``'s, else the default one. An
        empty ``--dir`` is refused: it is a variable that expanded to nothing, not the default cache."""
        if self.dir_option is not None:
            if not self.dir_option.strip():
                raise ConfigError("--dir is empty: name a directory, or leave --dir out for the default cache",
                                  name=CACHE_DIR.name, value=self.dir_option)  # fmt: skip
            self.directory, self.named_by = CACHE_DIR.of(self.dir_option, "--dir"), "--dir"
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

    @contextlib.contextmanager
    def reading(self, *, read_only: bool | None = None, damaged_ok: bool = False) -> Iterator[Store | None]:
        """``existing_store``, closed when the block ends."""
        store = self.existing_store(read_only=read_only, damaged_ok=damaged_ok)
        try:
            yield store
        finally:
            if store is not None:
                store.close()

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


def emit(data: Any, text: Callable[[Any], Iterable[str]]) -> None:
    obj = click.get_current_context().find_object(Context)
    assert obj is not None, "the plancache group makes the context"
    if obj.as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        for line in text(data):
            click.echo(line)


def table(rows: list[list[str]], header: Sequence[str] = ()) -> list[str]:
    """A table's lines: each cell left-aligned in its column, as given (no number
    re-formatted, no space trimmed), under ``header`` unless it is empty."""
    from tabulate import tabulate  # ~75 ms to import: paid only by a command that prints a table

    text: str = tabulate(rows, header, tablefmt="plain", disable_numparse=True, preserve_whitespace=True)
    return text.splitlines()


def entry_named(store: Store | None, prefix: str, obj: Context) -> Entry:
    """The entry a key or a unique prefix of it names; ``EntryNotFoundError`` when none does."""
    if store is None:  # nothing cached yet: no key can match
        raise EntryNotFoundError(f"no entry with key {prefix!r}: {obj.nothing_yet()}", key=prefix)
    entry = store.get(store.key_named(prefix))
    if entry is None:  # removed between the two reads
        raise EntryNotFoundError(f"no entry with key {prefix!r} in {store.path}", key=prefix)
    return entry


def _set_dir(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    """Kept as given: it is checked when the command runs (``Command.invoke``), where its
    error is one line and exit code 2, whichever side of the command name it stood on."""
    if value is not None:
        ctx.ensure_object(Context).dir_option = value


def _set_json(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        ctx.ensure_object(Context).as_json = True


def _set_debug(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        ctx.ensure_object(Context).debug = True
        logging.getLogger().setLevel(logging.DEBUG)


def shared_options() -> list[click.Parameter]:
    """``--dir``, ``--json`` and ``--debug``, which the root group and every command take
    (``Command``), so they go before or after the command name; the last one given counts.
    ``--json`` is eager: read first, so that the error of any other option or argument is
    JSON too."""
    return [
        click.Option(["--dir"], metavar="PATH", expose_value=False, callback=_set_dir,
                     help="Cache directory (default: $PLANCACHE_DIR, else the user cache directory)."),
        click.Option(["--json"], is_flag=True, is_eager=True, expose_value=False, callback=_set_json,
                     help='Print JSON: the command\'s data, or {"error", "exit_code"} when it fails.'),
        click.Option(["--debug"], is_flag=True, expose_value=False, callback=_set_debug, help="Show tracebacks and debug logs."),
    ]  # fmt: skip


class Command(click.Command):
    """A plancache command: it takes the shared options after its name too, and reads the
    cache directory they chose and every setting before it runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params[:0] = shared_options()

    def invoke(self, ctx: click.Context) -> Any:
        """Reads every setting a command's cache reads before the command creates or reads
        anything: a bad value is exit code 2 whichever command runs. Not here:
        ``PLANCACHE_BACKEND``, read by the commands that use a backend (it imports code), and
        ``PLANCACHE_PATCH_CUDNN``, which ``import plancache`` reads (never failing for it) and
        no command uses."""
        from ..tiers.remote import settings_from_env

        ctx.ensure_object(Context).choose_directory()
        for setting in SETTINGS:
            if setting not in (BACKEND, PATCH_CUDNN, *REDIS_SETTINGS):
                setting.from_env()
        settings_from_env()  # the Redis tier's, when PLANCACHE_REDIS_URL is set
        return super().invoke(ctx)


def backend_from_env() -> Any:
    """The backend named by ``PLANCACHE_BACKEND=module:Class`` (tests name the CPU one);
    None, so PlanCache uses cuDNN, when unset."""
    ref = BACKEND.from_env()
    if ref is None:
        return None
    from ..guest.backend import Backend
    from ..workflows.manifest import resolve_builder

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


def chosen_backend() -> Any:
    """The ``PLANCACHE_BACKEND`` backend, else cuDNN's."""
    backend = backend_from_env()
    if backend is None:
        from ..cudnn.backend import CudnnBackend

        backend = CudnnBackend()
    return backend


def current_backend(why: str) -> Any:
    """``chosen_backend()`` with its environment id. Without a GPU the cuDNN backend raises
    NoGpuError, reported as one line saying what needed it."""
    from ..errors import NoGpuError
    from ..key import environment_id

    backend = chosen_backend()
    try:
        return backend, environment_id(backend.environment(backend.current_device()))
    except NoGpuError as exc:
        raise NoGpuError(f"{why} needs this machine's GPU environment: {exc}") from exc
