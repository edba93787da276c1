#!/usr/bin/env python3
"""Record the plans real programs stored: the judge's corpus of real blobs.

Reads every entry of one or more plan stores (the ``PLANCACHE_DIR`` of a program run under
``PLANCACHE_PATCH_CUDNN=1`` on a GPU: cuDNN Frontend's own tests, FlashInfer's cuDNN
attention, the corpus programs) and writes each entry's description (what its key is
hashed from) with its blob, as cuDNN Frontend serialized it, into one compressed file:
``DIR/SOURCE.jsonl.xz``, a JSON line per entry (``source``, ``label``, ``key``,
``environment``'s versions, ``description``, ``blob`` in base64), entries already in the
file kept, none twice. ``tests/test_judge.py`` judges every recorded blob against every
recorded description.

Blobs larger than ``--max-blob`` bytes are left out (runtime-compiled attention plans
carry their kernels' source: 50-120 KB each), and the file stops growing at ``--max-file``
compressed bytes, so the corpus stays small in the repository.

    python3 scripts/record_plans.py --source frontend-tests --out tests/data/plans/real ~/.cache/plancache
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import lzma
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from plancache import Store  # noqa: E402
from plancache.key import canonical_json  # noqa: E402
from plancache.store import Entry  # noqa: E402

MAX_BLOB = 160_000
MAX_FILE = 3_000_000


def read(path: Path) -> list[dict[str, Any]]:
    """The entries of a corpus file (an empty list when there is none)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in lzma.decompress(path.read_bytes()).decode().splitlines() if line]


def blob_of(item: dict[str, Any]) -> bytes:
    return base64.b64decode(item["blob"])


def _stored(stores: Iterable[Path]) -> Iterator[Entry]:
    for directory in stores:
        store = Store(directory, read_only=True)
        try:
            for key in store.keys():  # noqa: SIM118 - Store is no mapping
                entry = store.get(key)
                if entry is not None:
                    yield entry
        finally:
            store.close()


def _items(entries: Iterable[Entry], source: str, max_blob: int) -> Iterator[dict[str, Any]]:
    for entry in entries:
        if len(entry.blob) > max_blob:
            continue
        versions = {k: entry.environment.get(k) for k in ("gpu_name", "cudnn_backend_version", "cudnn_frontend_version")}
        yield {"source": source, "label": entry.label, "key": entry.key, "environment": versions,
               "description": entry.description, "blob": base64.b64encode(entry.blob).decode()}  # fmt: skip


def record(stores: Iterable[Path], out: Path, *, source: str, max_blob: int = MAX_BLOB, max_file: int = MAX_FILE) -> int:
    """Add the entries of ``stores`` to ``out/SOURCE.jsonl.xz``; returns how many were added."""
    return record_entries(_stored(stores), out, source=source, max_blob=max_blob, max_file=max_file)


def record_entries(
    entries: Iterable[Entry], out: Path, *, source: str, max_blob: int = MAX_BLOB, max_file: int = MAX_FILE
) -> int:
    """Add ``entries`` (a cache's ``lookup.unstored.disagreements`` too: plans the judge
    refused, never stored) to ``out/SOURCE.jsonl.xz``; returns how many were added."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{source}.jsonl.xz"
    items = read(path)
    kept = len(items)
    seen = {_identity(item) for item in items}
    for item in _items(entries, source, max_blob):
        if _identity(item) not in seen:
            seen.add(_identity(item))
            items.append(item)
    encoded = _encode(items)
    while len(encoded) > max_file and len(items) > kept:  # the newest ones go first (compressed once per try)
        items = items[: kept + (len(items) - kept) * 3 // 4]
        encoded = _encode(items)
    path.write_bytes(encoded)
    return len(items) - kept


def _identity(item: dict[str, Any]) -> str:
    return hashlib.sha256((canonical_json(item["description"]) + item["blob"]).encode()).hexdigest()


def _encode(items: list[dict[str, Any]]) -> bytes:
    return lzma.compress("".join(json.dumps(item, sort_keys=True) + "\n" for item in items).encode(), preset=9)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stores", nargs="+", type=Path, help="plan store directories (PLANCACHE_DIR)")
    parser.add_argument("--source", required=True, help="what ran: the file's name (frontend-tests, flashinfer, corpus...)")
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "plans" / "real")
    parser.add_argument("--max-blob", type=int, default=MAX_BLOB)
    parser.add_argument("--max-file", type=int, default=MAX_FILE)
    args = parser.parse_args(argv)
    added = record(args.stores, args.out, source=args.source, max_blob=args.max_blob, max_file=args.max_file)
    total = len(read(args.out / f"{args.source}.jsonl.xz"))
    print(f"record_plans: {added} entries added to {args.out / (args.source + '.jsonl.xz')} ({total} in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
