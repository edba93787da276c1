"""How a lookup judges a stored entry: with the judgement kept in its row (``store.kept``)
where that is this code's, else by reading its blob; and, once a plan judged the long way
has loaded, what it keeps for the next process.

A kept judgement is bound to the version of the code that made it: a digest of the source
of every module whose code decides what the judge and the reader of the load's record find
(``JUDGING_MODULES``). Any change to that code is another version, whose lookups judge each
blob again and keep their own judgement; a plancache whose source cannot be read keeps
none and reads none.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
from collections.abc import Mapping
from pathlib import Path

from ..formats.plan_blob import PlanBlob
from ..guest.backend import Backend
from ..key import CacheKey
from ..store import Entry, Sound, Unsound, judged
from ..store.kept import keep, kept
from ..tiers.local import LocalTier

__all__ = ["JUDGING_MODULES", "Judging", "code_version"]

#: The modules whose code decides a judgement: the blob's decoding, the judge and the
#: frontend form it holds a blob to (and what that form is derived with), the kept
#: judgement's own form, and the reader of the load's record (and the tensor specs it keeps).
JUDGING_MODULES = ("plancache.formats.ubjson", "plancache.formats.plan_blob", "plancache.formats.plan_graph",
                   "plancache.key.frontend_form", "plancache.key.description", "plancache.key.lowering",
                   "plancache.key.key", "plancache.store.judge", "plancache.store.kept",
                   "plancache.store.per_process", "plancache.guest.native.record")  # fmt: skip


@functools.cache
def code_version() -> str | None:
    """A digest of the source of ``JUDGING_MODULES``; None where one cannot be read."""
    digest = hashlib.sha256()
    for name in JUDGING_MODULES:
        path = getattr(importlib.import_module(name), "__file__", None)
        if not path or not path.endswith(".py"):
            return None
        try:
            digest.update(Path(path).read_bytes())
        except OSError:
            return None
    return digest.hexdigest()


class Judging:
    """Judges entries for a lookup and the primer, and queues the judgements to keep."""

    def __init__(self, backend: Backend, local: LocalTier) -> None:
        self.backend = backend
        self.local = local

    def judge(self, entry: Entry, environment: Mapping[str, object] | None = None, env_id: str | None = None,
              key: CacheKey | None = None, blob: PlanBlob | None = None) -> Sound | Unsound:  # fmt: skip
        """``store.judged`` of ``entry`` (``blob``: its bytes as the caller read them), the
        judgement kept in its row standing in for the judge's reading of the blob where it is
        this code's and its record reads."""
        blob = blob if blob is not None else PlanBlob(entry.blob)
        taken = kept(entry.judgement, entry.key, entry.blob_sha256, entry.meta_sha256, code_version())
        if taken is not None and not self.backend.keep_record(blob, taken.record):
            taken = None
        return judged(entry, environment, env_id, key, blob=blob, kept=taken)

    def loaded(self, sound: Sound) -> None:
        """After ``sound`` loaded: its judgement and record, queued to be kept in its row
        (written in the background with the hit counts), unless they were read from there."""
        version = code_version()
        if sound.kept or version is None:
            return
        record = self.backend.kept_record(sound.blob)
        if record is None:
            return
        entry = sound.entry
        text = keep(entry.key, entry.blob_sha256, entry.meta_sha256, version, sound.unproven, record)
        self.local.note_judgement(entry.key, entry.blob_sha256, text)
