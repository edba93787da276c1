"""The commands that build and autotune plans: ``prewarm`` (a manifest's graphs, on one
GPU or several) and ``tune`` (what a miss's time budget cut short). Both report what they
finished when a signal stops them, and a run again resumes."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import click

from ..config import ConfigError
from .common import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_PROBLEMS,
    Command,
    Context,
    backend_from_env,
    chosen_backend,
    emit,
    entry_named,
)

__all__ = ["prewarm", "tune"]


def _stdout_is_terminal() -> bool:
    """Whether stdout is a terminal (tests patch this)."""
    return sys.stdout.isatty()


def _prewarm_dry_run(obj: Context, manifest: Path, options: Any, *, progress: bool) -> dict[str, Any]:
    """``prewarm --dry-run``: the manifest checked without a cache, on any machine. The
    cuDNN backend is never set up (no GPU, no CUDA); a ``PLANCACHE_BACKEND`` gives keys, and
    an existing store, opened read-only, the entries already stored. Nothing is written."""
    from ..workflows.prewarm import dry_run

    backend = backend_from_env()
    environment = backend.environment(backend.current_device()) if backend is not None else None
    with obj.reading(read_only=True) if backend is not None else contextlib.nullcontext() as store:
        return dry_run(manifest, environment=environment, store=store, options=options, progress=progress)


def _devices_option(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | list[int] | None:
    """``--devices``: "all" or indices, checked before anything is created (the indices
    against the machine's devices once the backend is known)."""
    if value is None:
        return None
    from ..workflows.sharding import parse_devices

    try:
        return parse_devices(value)
    except ConfigError as exc:
        raise click.BadParameter(exc.message) from exc


def _resolve_devices(backend: Any, spec: str | list[int]) -> list[int]:
    """The ``--devices`` indices on this machine: an index it lacks is a usage error."""
    from ..errors import NoGpuError
    from ..workflows.sharding import resolve_devices

    count = backend.device_count()
    if count < 1:
        raise NoGpuError(f"prewarm --devices needs this machine's GPUs, and the {backend.name} backend sees none")
    try:
        return resolve_devices(spec, count)
    except ConfigError as exc:
        raise click.BadParameter(exc.message, param_hint="'--devices'") from exc


@click.command(cls=Command)
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
    obj: Context,
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
    from ..key import BuildOptions, Policy
    from ..workflows.manifest import refuse_unusable
    from ..workflows.prewarm import prewarm as run_prewarm
    from ..workflows.prewarm import record_line, summary_lines
    from ..workflows.sharding import check_environments

    refuse_unusable(manifest, allow_code=allow_code or dry_run)
    options = BuildOptions(policy=Policy(policy)) if policy else None
    if dry_run:
        report = _prewarm_dry_run(obj, manifest, options, progress=not no_progress)
        emit(report, summary_lines)
        if report["failed"]:
            sys.exit(EXIT_PROBLEMS)
        return
    from ..cache.cache import PlanCache
    from ..tiers.remote import RemoteTier

    backend = chosen_backend()
    devices = _resolve_devices(backend, devices_spec) if devices_spec is not None else None
    if devices:  # devices of one environment, or one line naming how they differ, before anything is created
        check_environments({device: backend.environment(device) for device in devices})
    else:
        backend.environment(None)  # no GPU: one line, and nothing created yet
    remote = RemoteTier.from_env()  # without redis-py installed: one line, and nothing created yet
    obj.writable_store().close()
    if allow_code and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would: builder modules next to the user
    # On a terminal each entry's row is printed as it finishes; a pipe or --json gets the report at the end.
    live = not obj.as_json and _stdout_is_terminal()
    on_record = (lambda record: click.echo(record_line(record))) if live else None
    # No auto-prime: a command looks plans up once, it does not run a model's steps.
    with (
        PlanCache(obj.directory, backend=backend, remote=remote, auto_prime=False) as cache,
        _stoppable(functools.partial(summary_lines, rows=not live)),
    ):
        report = run_prewarm(cache, manifest, progress=not no_progress, options=options, allow_code=allow_code,
                             devices=devices, on_record=on_record)  # fmt: skip
    emit(report, functools.partial(summary_lines, rows=not live))
    if report["unpersisted"]:
        sys.exit(EXIT_ERROR)
    if report["failed"]:
        sys.exit(EXIT_PROBLEMS)


@click.command(cls=Command)
@click.argument("keys", nargs=-1)
@click.option("--no-progress", is_flag=True, help="No progress bar (shown only when stderr is a terminal).")
@click.pass_obj
def tune(obj: Context, keys: tuple[str, ...], no_progress: bool) -> None:
    """Finish the autotuning that a miss's time budget cut short (PLANCACHE_AUTOTUNE_BUDGET).

    Every entry of this GPU's environment whose miss stopped at the budget (or only KEYS,
    keys or unique prefixes, whatever their record says) has its graph replayed from its
    description and autotuned again on this GPU with no budget; the choice replaces the
    entry, and later lookups run it. Needs the GPU the entries were built for. The exit
    code is 3 if an entry could not be tuned.
    """
    from ..cache.cache import PlanCache
    from ..workflows.tune import tune as run_tune
    from ..workflows.tune import tune_report

    with obj.reading() as store:
        digests = [entry_named(store, key, obj).key for key in keys] if keys else None
    if store is None:  # nothing cached yet: nothing to tune, and nothing created
        emit(tune_report([]), _tune_text)
        return
    backend = chosen_backend()
    backend.environment()  # no GPU: one line, before anything is opened for writing
    obj.writable_store().close()
    # No auto-prime: a command that replays graphs runs no model.
    with PlanCache(obj.directory, backend=backend, auto_prime=False) as cache, _stoppable(_tune_text):
        report = run_tune(cache, digests, progress=not no_progress)
    emit(report, _tune_text)
    if report["failed"]:
        sys.exit(EXIT_PROBLEMS)


@contextlib.contextmanager
def _stoppable(lines: Callable[[Mapping[str, Any]], Iterable[str]]) -> Iterator[None]:
    """A long command (``prewarm``, ``tune``) that Ctrl-C, SIGTERM or SIGHUP stops (what
    ``timeout``, CI runners, Kubernetes and Slurm send) reports
    what it finished, as ``lines`` or JSON, then one line, exit 130. The first signal only:
    a second does not cut the report short."""
    from ..workflows.steps import Interrupted

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
        emit(stopped.report, lines)
        click.echo("plancache: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


_STOPPING = (signal.SIGTERM, signal.SIGHUP)  # SIGINT raises KeyboardInterrupt already


def _tune_text(report: Mapping[str, Any]) -> Iterable[str]:
    from ..workflows.steps import Status

    for row in report["rows"]:
        before, after = row.get("before") or {}, row.get("after") or {}
        if row["status"] == Status.TUNED:
            yield (f"{row['key'][:12]}  tuned {before.get('tuned')} -> {after.get('tuned')} of {after.get('candidates')} "
                   f"candidates: {before.get('engine')} -> {after.get('engine')} ({row['seconds']:.2f}s)")  # fmt: skip
        else:
            yield f"{row['key'][:12]}  failed: {row.get('error')}"
    stopped = f"; interrupted, {report['not_run']} not run (run it again to tune them)" if report.get("interrupted") else ""
    done = f"{report['tuned']} tuned, {report['failed']} failed{stopped}" if report["rows"] or stopped else "nothing to tune"
    yield report.get("why") or done
