"""The commands that look after the store: ``rm``, ``verify`` (and ``--fix``) and
``prune``. Nothing is removed that a running job may still use without ``--force``, and
``verify --fix`` keeps what it sets aside."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import click

from ..config import format_size
from ..errors import EntryNotFoundError, PlanCacheError
from ..store import DB_NAME, maintenance
from ..workflows.report import age
from .common import EXIT_PROBLEMS, Command, Context, current_backend, emit

__all__ = ["RECENT_DAYS", "prune", "rm", "verify"]


@click.command(cls=Command)
@click.argument("keys", nargs=-1, required=True)
@click.pass_obj
def rm(obj: Context, keys: tuple[str, ...]) -> None:
    """Remove stored plans (each KEY may be a unique prefix of 4 or more characters).
    Every KEY is resolved first: if one is too short, unknown or ambiguous, nothing is
    removed."""
    with obj.reading() as store:
        if store is None:
            raise EntryNotFoundError(f"nothing removed: {obj.nothing_yet()}", key=keys[0])
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
    emit({"removed": removed}, lambda d: (f"removed {k}" for k in d["removed"]))


def _verify_text(d: maintenance.VerifyReport) -> Iterable[str]:
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


@click.command(cls=Command)
@click.option("--fix", is_flag=True, help="Quarantine bad entries; move a damaged file aside (kept) and copy its intact entries.")
@click.option("--deserialize", is_flag=True, help="Also load every blob of this machine's environment (needs the GPU).")
@click.pass_obj
def verify(obj: Context, fix: bool, deserialize: bool) -> None:
    """Check the store: SQLite integrity, every blob's checksum, every entry's key against
    what it records, kernel caches. Exit code 3 when problems were found (also when --fix
    fixed them: run it again to confirm). Nothing is ever deleted: see docs/reliability.md."""
    with obj.reading(damaged_ok=True) as store:
        if store is None:  # nothing stored yet: nothing to check, and nothing that needs the GPU
            report = _empty_verify(obj.cache_dir, fix=fix, deserialize=deserialize)
            emit(report, lambda d: [f"{obj.nothing_yet()}: nothing to check", "ok"])
            return
        load, env_id = None, None
        if deserialize:
            from ..key import TensorSpec

            backend, env_id = current_backend("verify --deserialize")
            load = lambda e: backend.load(e.blob, [TensorSpec.from_dict(t) for t in e.tensors])  # noqa: E731
        report = maintenance.verify(store, fix=fix, load=load, env_id=env_id)
    emit(report, _verify_text)
    if report["problems"]:
        sys.exit(EXIT_PROBLEMS)


def _empty_verify(directory: Path, *, fix: bool, deserialize: bool) -> maintenance.VerifyReport:
    """``maintenance.verify``'s report on a cache with nothing stored yet."""
    return {"path": str(directory / DB_NAME), "entries": 0, "integrity": [], "checksum": [], "foreign": {}, "damaged": {},
            "unreadable": [], "kernel_caches": [], "problems": [],
            "deserialize": {"env_id": None, "checked": 0, "skipped": 0, "failed": {}} if deserialize else None,
            "fixed": {"quarantined": [], "kernel_caches_removed": []} if fix else {}}  # fmt: skip


class _Days(click.ParamType):  # type: ignore[type-arg]  # generic only in newer clicks; pyproject allows 8.1
    """A number of days, 0 or more: ``30``, ``0.5`` (12 hours)."""

    name = "days"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:  # ctx: click >= 8.2
        return "DAYS"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            days = float(value)
        except (TypeError, ValueError):
            days = math.nan
        if not 0 <= days < math.inf:  # also NaN
            self.fail(f"{value!r} is not a number of days: write 0 or more, such as 30, or 0.5 for 12 hours", param, ctx)
        return days


#: An ``--older-than`` below this many days may remove plans that running jobs still use
#: (last use is written in batches): it needs ``--force`` when it would.
RECENT_DAYS = 1.0


def _refuse_recent(report: maintenance.PruneReport, days: float) -> None:
    """Refuse, naming what would go, an age prune (``report``: its dry run) that removes
    entries used within the last ``RECENT_DAYS``."""
    now = time.time()
    aged = report["removed"]  # of an age prune alone: every one unused since the cutoff
    recent = [r for r in aged if now - r["last_used_at"] < RECENT_DAYS * 86400]
    if not recent:
        return
    newest = age(max(0.0, now - max(r["last_used_at"] for r in recent)))
    raise PlanCacheError(
        f"refused: --older-than {days:g} would remove {len(aged)} entries ({format_size(sum(r['blob_size'] for r in aged))}), "
        f"{len(recent)} of them used in the last day (the latest {newest} ago), which running jobs may still be using; "
        "pass --force to remove them, or --dry-run to list them"
    )


@click.command(cls=Command)
@click.option("--other-environments", is_flag=True, help="Entries of any other GPU, driver, CUDA, cuDNN or frontend version.")
@click.option("--older-than", "days", type=_Days(), default=None,
              help="Entries unused for more than DAYS days (0.5: 12 hours). Below 1 day, removing entries used in the "
                   "last day needs --force.")  # fmt: skip
@click.option("--quarantined", is_flag=True, help="Every quarantined entry.")
@click.option("--dry-run", is_flag=True, help="Only say what would be removed.")
@click.option("--force", is_flag=True, help="With --older-than below 1 day: remove entries used in the last day too.")
@click.pass_obj
def prune(obj: Context, other_environments: bool, days: float | None, quarantined: bool, dry_run: bool, force: bool) -> None:
    """Remove entries of other environments, entries unused for DAYS days, quarantined
    entries (any combination), in small transactions that running jobs hardly notice.

    An --older-than below 1 day that would remove entries used in the last day (plans a
    running job may be using: --older-than 0 removes every entry) is refused, saying what
    it would remove, unless --force."""
    if not (other_environments or days is not None or quarantined):
        raise click.UsageError("say what to prune: --other-environments, --older-than DAYS and/or --quarantined")
    with obj.reading() as store:
        if store is None:  # nothing stored yet: nothing to remove, and nothing that needs the GPU
            report: maintenance.PruneReport = {"dry_run": dry_run, "removed": [], "bytes": 0, "kernel_caches": [],
                                               "quarantined": 0}  # fmt: skip
        else:
            keep = {current_backend("prune --other-environments")[1]} if other_environments else None
            older_than_s = days * 86400 if days is not None else None
            if days is not None and days < RECENT_DAYS and not (force or dry_run):
                _refuse_recent(maintenance.prune(store, older_than_s=older_than_s, dry_run=True), days)
            report = maintenance.prune(store, env_ids_keep=keep, older_than_s=older_than_s, quarantined=quarantined,
                                       dry_run=dry_run)  # fmt: skip

    def text(d: maintenance.PruneReport) -> Iterable[str]:
        if store is None:
            yield f"{obj.nothing_yet()}: nothing to remove"
        verb = "would remove" if d["dry_run"] else "removed"
        for row in d["removed"]:
            yield f"{verb} {row['key'][:12]}  {row['label'][:40]}  ({row['reason']})"
        yield f"{verb} {len(d['removed'])} entries ({format_size(d['bytes'])}), {d['quarantined']} quarantined entries, " \
              f"{len(d['kernel_caches'])} kernel caches"  # fmt: skip

    emit(report, text)
