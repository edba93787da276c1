"""The judgement of a stored plan, kept in its row (``store.kept``, ``cache.judging``).

A process that judged a stored plan sound and loaded it keeps the judgement and the load's
record in the row, written in the background with its hit counts; a later process's hit
of that row, under the same code, reads them instead of decoding and judging the blob.
What is kept is taken only for the row's own blob and metadata, and the code that made it:
anything else is judged again, as if nothing were kept. Every other check of a hit stands.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from graphs import ConvBiasRelu, assert_runs_correctly
from test_hit_path import _counting
from test_judge import RECORDED

from plancache import PlanCache
from plancache.cache import judging
from plancache.formats import plan_blob
from plancache.formats.plan_blob import PlanBlob
from plancache.guest.native import record
from plancache.store import entry as store_entry
from plancache.store import kept as store_kept
from plancache.testing import CpuTestBackend

MakeCache = Callable[..., PlanCache]
Db = Callable[[], sqlite3.Connection]


def _judgement(db: Db, key: str) -> Any:
    return db().execute("SELECT judgement FROM plans WHERE key = ?", (key,)).fetchone()[0]


def _stored_and_kept(make_cache: MakeCache, spec: ConvBiasRelu) -> str:
    """A plan stored by one process (its miss judged it as later lookups do, and kept that)."""
    cache = make_cache(auto_prime=False)
    key = cache.get(spec.graph()).key
    cache.close()
    return key


def _counting_judge(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    judged: list[str] = []
    judge = store_entry.judge

    def counting(blob: Any, description: Any, form: Any = None) -> Any:
        judged.append("judge")
        return judge(blob, description, form)

    monkeypatch.setattr(store_entry, "judge", counting)
    return judged


def test_a_kept_judgement_spares_a_later_process_decoding_and_judging_the_blob(make_cache: MakeCache, db: Db,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    spec = ConvBiasRelu()
    key = _stored_and_kept(make_cache, spec)
    assert _judgement(db, key) is not None, "the miss that stored the plan kept its judgement"
    backend = CpuTestBackend()
    cache = make_cache(backend=backend, auto_prime=False)
    cache.environment  # noqa: B018 - read once per process
    decoded, ready = _counting(monkeypatch, backend)
    judged = _counting_judge(monkeypatch)
    plan = cache.get(spec.graph())
    assert plan.source == "loaded" and cache.counters["hits"] == 1
    assert decoded == [] and judged == [], "neither decoded nor judged: the kept judgement and record stood in"
    assert ready == [0] and backend.native_fallbacks == {}
    assert_runs_correctly(plan, spec)


def test_a_judgement_is_written_off_the_hit_path_and_only_where_none_is_kept(make_cache: MakeCache, db: Db) -> None:
    spec = ConvBiasRelu()
    key = _stored_and_kept(make_cache, spec)
    db().execute("UPDATE plans SET judgement = NULL WHERE key = ?", (key,))  # as a row of an older plancache
    cache = make_cache(auto_prime=False)
    assert cache.get(spec.graph()).source == "loaded"
    assert _judgement(db, key) is None, "the hit wrote nothing"
    cache.close()
    kept = _judgement(db, key)
    assert kept is not None, "kept at close, with the hit counts"
    again = make_cache(auto_prime=False)
    again.get(spec.graph())
    again.close()
    assert _judgement(db, key) == kept


@pytest.mark.parametrize("damage", ["another version", "a changed character", "another row's", "a changed record"])
def test_a_judgement_of_other_code_other_bytes_or_damaged_is_judged_again(make_cache: MakeCache, db: Db, damage: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    spec, other = ConvBiasRelu(), ConvBiasRelu(n=4)
    key = _stored_and_kept(make_cache, spec)
    other_key = _stored_and_kept(make_cache, other)
    kept = _judgement(db, key)
    if damage == "another version":
        monkeypatch.setattr(judging, "code_version", lambda: "0" * 64)
    elif damage == "a changed character":
        db().execute("UPDATE plans SET judgement = ? WHERE key = ?", (kept.replace('"dumps":0', '"dumps":1'), key))
    elif damage == "another row's":
        db().execute("UPDATE plans SET judgement = ? WHERE key = ?", (_judgement(db, other_key), key))
    else:  # the record changed and its checksum made again: the judge is skipped, the record's gate still holds
        body = kept.split(" ", 1)[1]
        assert '"variant_pack_uids":[' in body
        body = body.replace('"variant_pack_uids":[', '"variant_pack_uids":[999,', 1)
        db().execute(
            "UPDATE plans SET judgement = ? WHERE key = ?", (f"{store_kept._digest(key, *_sums(db, key), body)} {body}", key)
        )
    backend = CpuTestBackend()
    cache = make_cache(backend=backend, auto_prime=False)
    cache.environment  # noqa: B018
    decoded, _ = _counting(monkeypatch, backend)
    plan = cache.get(spec.graph())
    assert plan.source in ("loaded", "rebuilt", "built")
    assert_runs_correctly(plan, spec)
    if damage == "a changed record":
        # A kept record is only as trusted as the row's other bytes: its uids still meet the
        # gate, which leaves a plan needing a tensor the table lacks to the frontend's path.
        assert backend.native_fallbacks, backend.native_fallbacks
        return
    blob = cache.store.get(key).blob
    assert decoded == [blob], "judged again, from the blob"
    assert plan.source == "loaded" and cache.counters["corrupt"] == 0, "nothing of the entry is wrong: it is served"


def _sums(db: Db, key: str) -> tuple[str, str]:
    row = db().execute("SELECT blob_sha256, meta_sha256 FROM plans WHERE key = ?", (key,)).fetchone()
    return row[0], row[1]


def test_a_row_stored_again_starts_without_a_judgement(make_cache: MakeCache, db: Db) -> None:
    spec = ConvBiasRelu()
    key = _stored_and_kept(make_cache, spec)
    cache = make_cache(auto_prime=False)
    cache.store.put(cache.store.get(key))  # a rebuild or an import writes the row again
    assert _judgement(db, key) is None


@pytest.mark.parametrize("recorded", RECORDED, ids=[r.name for r in RECORDED])
def test_a_kept_record_is_the_record_read_from_the_blob(recorded: Any) -> None:
    """Every real blob recorded on a GPU: the record a store keeps reads back as the one
    parsed from the bytes, its representation taken from where it lies in the blob."""
    read = PlanBlob(recorded.blob)
    parsed = record.parse(read)
    kept = record.kept_form(read)
    assert kept is not None
    fresh = PlanBlob(recorded.blob)
    record.keep(fresh, orjson.loads(orjson.dumps(kept)))  # as stored: JSON
    assert record.parse(fresh) == parsed
    assert fresh._fields is plan_blob._UNREAD, "the kept record was read, not the blob"


def test_the_code_version_covers_every_module_the_judge_and_the_record_reader_import() -> None:
    """A change to any plancache module the judge, the frontend form or the record reader
    runs is another version: each of their plancache imports is among the digested modules."""
    import ast
    import importlib

    covered = set(judging.JUDGING_MODULES)
    for name in ("plancache.store.judge", "plancache.key.frontend_form", "plancache.formats.plan_graph",
                 "plancache.formats.plan_blob", "plancache.store.kept"):  # fmt: skip
        module = importlib.import_module(name)
        tree = ast.parse(Path(module.__file__).read_text())
        package = name.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
                assert target in covered or target == "plancache.key", (name, target)
    assert judging.code_version() is not None and len(judging.code_version() or "") == 64
