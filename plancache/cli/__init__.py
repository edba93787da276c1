"""The ``plancache`` command. Data goes to stdout (``--json`` for scripts), logs and
progress to stderr (progress only when stderr is a terminal).

``EXIT_CODES`` is the one table of exit codes (README.md shows it; ``plancache --help``
prints it); ``_one_line`` maps every error to one of them. ``--dir``, ``--json`` and
``--debug`` go before or after the command name. Every command reads the settings first
(``common.Command``), then its input, then the GPU it needs, and only then creates a
cache: a command that fails early leaves no file behind.

The commands live by what they do: ``inspection`` (env, ls, show, diff, stats, inspect),
``sql``, ``maintenance`` (rm, verify, prune), ``building`` (prewarm, tune) and
``bundles`` (export, import); ``common`` holds what they share. Imports run one way:
this module, then the command modules, then ``common``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sqlite3
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

import click

from ..config import ConfigError
from ..errors import BundleError, BundleTargetError, ManifestError, PlanCacheError
from . import building, bundles, inspection, maintenance, sql
from .common import (
    EXIT_BROKEN_PIPE,
    EXIT_CODES,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_USAGE,
    Context,
    shared_options,
)

__all__ = ["EXIT_BROKEN_PIPE", "EXIT_CODES", "EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_PROBLEMS", "EXIT_USAGE", "main"]


def _one_line(exc: BaseException) -> tuple[str, int]:
    """The one line and exit code (``EXIT_CODES``) of an error the user can act on."""
    if isinstance(exc, ConfigError):
        return str(exc), EXIT_USAGE
    if isinstance(exc, ManifestError):  # the manifest as a whole: nothing was built
        return str(exc), EXIT_PROBLEMS
    if isinstance(exc, BundleError) and not isinstance(exc, BundleTargetError):  # a bundle import cannot use
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
    obj = ctx.find_object(Context)
    words = words[: words.index("--")] if "--" in words else words
    if (obj is not None and obj.as_json) or "--json" in words:
        click.echo(json.dumps({"error": message, "exit_code": code}, indent=2, sort_keys=True))


def _show_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """``--version``: not eager, so it runs after --json (eager) and prints JSON when asked
    for, on either side of it (click's version_option prints its text line only)."""
    if not value or ctx.resilient_parsing:
        return
    from .. import __version__

    obj = ctx.find_object(Context)
    click.echo(json.dumps({"version": __version__}) if obj is not None and obj.as_json else f"plancache, version {__version__}")
    ctx.exit()


class _Group(click.Group):
    """The one place that maps errors (plancache's, OSError, ValueError, SQLite's, running out
    of memory or recursion) to one line on stderr and an exit code (``_one_line``); with
    ``--json`` also to ``{"error": ..., "exit_code": ...}`` on stdout, click's usage errors
    too. ``--debug`` shows the traceback instead."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        words = list(args)  # click's parser consumes the list it reads
        try:
            return super().parse_args(ctx, args)
        except click.ClickException as exc:  # before the root command runs: its invoke never sees it
            _report_json(ctx, exc.format_message(), exc.exit_code, words)
            raise

    def invoke(self, ctx: click.Context) -> Any:
        obj = ctx.ensure_object(Context)
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


@click.group(
    cls=_Group,
    params=shared_options(),
    commands=[inspection.env, inspection.list_entries, inspection.show, inspection.diff, inspection.stats, inspection.inspect_plans,
              sql.sql, maintenance.rm, maintenance.verify, maintenance.prune, building.prewarm, building.tune, bundles.export_cmd,
              bundles.import_cmd],
)  # fmt: skip
@click.option("--version", is_flag=True, expose_value=False, callback=_show_version,
              help='Show the version and exit (as {"version": ...} with --json).')  # fmt: skip
@click.pass_obj
def cli(obj: Context) -> None:
    """plancache: a persistent, autotuning plan cache for cuDNN Frontend graphs."""
    logging.basicConfig(level=logging.DEBUG if obj.debug else logging.INFO, format="%(message)s", stream=sys.stderr)


cli.help = (cli.help or "") + "\n\n\b\nExit codes:\n" + "\n".join(
    textwrap.fill(text.replace("`", ""), width=78, initial_indent=f"{code}  ", subsequent_indent="   ")
    for code, text in EXIT_CODES.items()
)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``plancache`` console script."""
    cli.main(args=argv, prog_name="plancache")
