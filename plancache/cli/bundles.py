"""The commands that ship plans between machines: ``export`` writes a bundle (signed when
a fleet secret is set), ``import`` verifies a whole bundle before it merges any of it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import click

from ..config import REDIS_SECRET, REDIS_SECRET_FILE, format_size
from ..errors import PlanCacheError
from .common import Command, Context, emit

__all__ = ["export_cmd", "import_cmd"]


@click.command(name="export", cls=Command)
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--env", "env_id", default=None,
              help="Only entries of this environment id, or a unique prefix of it (see `plancache ls --json`).")  # fmt: skip
@click.option("--key", "keys", multiple=True, help="Only this entry (a key or a unique prefix, 4 or more characters); repeatable.")  # fmt: skip
@click.option("--force", is_flag=True, help="Replace FILE if it exists (a regular file only).")
@click.pass_obj
def export_cmd(obj: Context, file: Path, env_id: str | None, keys: tuple[str, ...], force: bool) -> None:
    """Write stored plans to one portable bundle FILE, to ship inside a container image
    or to another machine (`plancache import` merges it there). An existing FILE is
    refused unless --force; a symlink, FIFO or device is never replaced. With
    PLANCACHE_REDIS_SECRET_FILE or PLANCACHE_REDIS_SECRET set, the bundle is signed."""
    from ..workflows.bundle import export_bundle

    if not force and file.is_file() and not file.is_symlink():  # special files: export_bundle names what they are
        raise PlanCacheError(f"refused: {file} exists; pass --force to replace it", path=str(file))
    with obj.reading() as store:
        report = export_bundle(store, file, env_id=env_id, keys=list(keys) or None, replace=force)

    def text(d: dict[str, Any]) -> Iterable[str]:
        if store is None:
            yield f"{obj.nothing_yet()}: the bundle is empty"
        yield f"exported {d['entries']} plans ({format_size(d['bytes'])}) to {d['path']}"
        yield (f"  signed with secret key id {d['key_id']}" if d["key_id"] else
               f"  unsigned: no {REDIS_SECRET_FILE.name} or {REDIS_SECRET.name} is set, so importing it needs --allow-unsigned")  # fmt: skip
        for env_id, summary in d["environments"].items():
            yield f"  environment {env_id}: {summary}"
        for key, reason in d["skipped"].items():
            yield f"  left out {key[:12]}: {reason}"

    emit(report, text)


@click.command(name="import", cls=Command)
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--replace", is_flag=True, help="Replace plans the cache already has (default: keep the sound ones).")
@click.option("--env", "env_id", default=None, help="Only import entries of this environment id, or a unique prefix of it.")
@click.option("--allow-unsigned", is_flag=True,
              help="Import a bundle that is unsigned or signed with another secret (only from a source you trust).")  # fmt: skip
@click.pass_obj
def import_cmd(obj: Context, file: Path, replace: bool, env_id: str | None, allow_unsigned: bool) -> None:
    """Merge bundle FILE into the cache. The whole bundle is verified first (signature,
    format, checksums, keys, environments, member names): an unsigned or foreign-signed
    bundle (without --allow-unsigned), a truncated, tampered, newer-format or unsafe one,
    or a FILE that is no regular file is refused (exit code 3) and the cache is left
    unchanged: a cache that did not exist yet is not created. The signature is checked
    under PLANCACHE_REDIS_SECRET_FILE or PLANCACHE_REDIS_SECRET, the sender's secret."""
    from ..workflows.bundle import Signature, bundle_environment, import_bundle, read_bundle

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
        yield f"  signature {d['signature']}" + ("" if d["signature"] is Signature.VERIFIED else " (--allow-unsigned)")
        for env_id, summary in d["environments"].items():
            yield f"  environment {env_id}: {summary}"

    emit(report, text)
