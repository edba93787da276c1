"""Issue #34: a stored blob is bound to its key, and every decode of stored data is total.

A plan blob carries its graph (``tensors`` and ``nodes`` at its top level); ``store.entry``
compares it with the description the key is derived from, on every path a blob arrives by:
a hit, ``verify``, ``export``, bundle import and the Redis tier. A row whose fields have the
wrong type, range or depth is a damaged entry: a miss, quarantined, counted, one warning,
never an exception out of ``get``, ``verify`` or ``export``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import sqlite3
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))  # gpu_native: the recorded graphs

from graphs import CausalSdpa, ConvBiasRelu, MatmulBiasRelu, assert_runs_correctly

from plancache import PlanCache, Store
from plancache.formats.ubjson import decode as decode_ubjson
from plancache.formats.ubjson import encode as encode_ubjson
from plancache.store import Entry, maintenance, problem, sha256
from plancache.store.codec import ENTRY_MAGIC, decode_entry, encode_entry
from plancache.store.entry import INSERT_SQL
from plancache.workflows.bundle import BUNDLE_MAGIC, BundleError, export_bundle, import_bundle

MakeCache = Callable[..., PlanCache]
Connect = Callable[[], sqlite3.Connection]

OWN = ConvBiasRelu(n=1)
ANOTHER_GRAPH = "a plan of another graph"


def stored(make_cache: MakeCache, specs: list[Any]) -> list[str]:
    """Build and store ``specs`` with a cache that is then closed."""
    cache = make_cache()
    keys = [cache.get(spec.graph()).key for spec in specs]
    cache.close()
    return keys


def warnings_naming(caplog: pytest.LogCaptureFixture, key: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and key[:12] in r.getMessage()]


def without_graph(blob: bytes) -> bytes:
    """A CPU test plan as plancache wrote it before blobs carried their graph."""
    plan = decode_ubjson(blob)
    return encode_ubjson({name: value for name, value in plan.items() if name not in ("tensors", "nodes")})


#: Blobs an attacker (or an older plancache, or a bug) puts under a key, with every checksum
#: recomputed: ``(the key's graph, the graph whose blob it gets)``. Another graph's of the
#: same ops (other shapes), of the same shapes (another data type), of other ops, the key's
#: own blob stripped of its graph (None); and graphs that differ from the key's in one
#: setting only, whose blob computes the other graph (issue #44).
DONORS: dict[str, tuple[Any, Any]] = {
    "other shapes": (OWN, ConvBiasRelu(n=2)),
    "other data type": (OWN, ConvBiasRelu(n=1, dtype="HALF")),
    "other ops": (OWN, MatmulBiasRelu()),
    "no graph": (OWN, None),
    "attention causal / not causal": (CausalSdpa(scale_by_value=False), CausalSdpa(scale_by_value=False, causal=False)),
    "attention scale 0.25 / 0.5": (CausalSdpa(scale_by_value=False), CausalSdpa(scale_by_value=False, attn_scale=0.5)),
    "conv padding and dilation, same output shape": (OWN, ConvBiasRelu(n=1, padding=2, dilation=2)),
    "conv stride": (OWN, ConvBiasRelu(n=1, conv_stride=2)),
    "pointwise relu / tanh": (OWN, ConvBiasRelu(n=1, act="tanh")),
}
#: The donors that are graphs (all but the stripped blob).
GRAPH_DONORS = [name for name, (_, donor) in DONORS.items() if donor is not None]


def forged(make_cache: MakeCache, donor: str) -> tuple[Entry, Entry]:
    """The key's stored entry, and the same entry holding the donor's blob with its
    checksum recomputed (the metadata checksum does not cover the blob: it stays valid)."""
    own, spec = DONORS[donor]
    keys = stored(make_cache, [own] if spec is None else [own, spec])
    store = Store()
    entry = store.get(keys[0])
    assert entry is not None
    blob = without_graph(entry.blob) if spec is None else store.get(keys[1]).blob  # type: ignore[union-attr]
    store.close()
    return entry, dataclasses.replace(entry, blob=blob, blob_sha256=sha256(blob))


def refused_as_forged(reason: str) -> bool:
    return ANOTHER_GRAPH in reason or "carries no graph" in reason


def put_blob(db: Connect, entry: Entry) -> None:
    db().execute("UPDATE plans SET blob = ?, blob_sha256 = ?, blob_size = ? WHERE key = ?",
                 (entry.blob, entry.blob_sha256, len(entry.blob), entry.key))  # fmt: skip


# ---------------------------------------------------------------------------- another graph's blob


@dataclasses.dataclass(frozen=True)
class WithUnusedScalar(ConvBiasRelu):
    """OWN's graph holding one more tensor, a by-value scalar that no node takes, as cuDNN
    Frontend's own instance-norm test makes an epsilon its backward pass never reads. The
    frontend leaves such a tensor out of the plan it serializes (its graph and its backend
    plan hold the tensors of nodes), while the key's description has it."""

    def graph(self) -> Any:
        import cudnn

        graph = super().graph()
        graph.tensor(name="unused", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT,
                     is_pass_by_value=True, uid=9)  # fmt: skip
        return graph

    def tensors(self, seed: int = 0) -> dict[int, Any]:
        import torch

        return {**super().tensors(seed), 9: torch.tensor([[[[0.5]]]])}  # Plan.execute asks for every tensor of the table


def test_a_tensor_no_node_uses_is_not_asked_of_the_blob(make_cache: MakeCache, caplog: pytest.LogCaptureFixture) -> None:
    """Found on the H200: such a graph's stored plan was refused as another graph's, and
    quarantined and autotuned again in every process."""
    spec = WithUnusedScalar(n=1)
    [key] = stored(make_cache, [spec])
    cache = make_cache()
    plan = cache.get(spec.graph())
    assert plan.source == "loaded" and cache.counters["corrupt"] == 0, (plan.source, warnings_naming(caplog, key))
    assert_runs_correctly(plan, spec)
    assert sum(cache.lookup.backend.native_fallbacks.values()) == 0  # loaded natively: the gate let it through
    cache.close()


@pytest.mark.parametrize("donor", list(DONORS))
def test_a_hit_refuses_and_quarantines_another_graphs_blob(
    make_cache: MakeCache, db: Connect, caplog: pytest.LogCaptureFixture, donor: str
) -> None:
    own, swapped = forged(make_cache, donor)
    put_blob(db, swapped)
    cache = make_cache()
    spec = DONORS[donor][0]
    plan = cache.get(spec.graph())
    assert plan.source == "rebuilt"  # from its engine id and knobs, on a graph replayed from its description
    assert_runs_correctly(plan, spec)
    [quarantined] = cache.store.quarantined()
    assert quarantined["key"] == own.key and refused_as_forged(quarantined["reason"])
    assert cache.counters["corrupt"] == 1
    assert len(warnings_naming(caplog, own.key)) == 1
    assert cache.store.get(own.key).blob != swapped.blob  # type: ignore[union-attr]  # the rebuilt entry's own


@pytest.mark.parametrize("donor", list(DONORS))
def test_verify_and_export_refuse_another_graphs_blob(make_cache: MakeCache, db: Connect, tmp_path: Path, donor: str) -> None:
    own, swapped = forged(make_cache, donor)
    put_blob(db, swapped)
    store = Store()
    report = maintenance.verify(store)
    assert own.key in report["foreign"], report["problems"]
    assert refused_as_forged(report["foreign"][own.key])
    exported = export_bundle(store, tmp_path / "plans.bundle")
    assert own.key not in exported["keys"] and own.key in exported["skipped"]
    fixed = maintenance.verify(store, fix=True)
    assert fixed["fixed"]["quarantined"] == [own.key]
    store.close()


def _forge_bundle(path: Path, forged_entry: Entry, secret: bytes | None = None) -> None:
    """Put ``forged_entry`` in the bundle in place of the member of its key, with every
    checksum recomputed, unsigned (a forger without the secret) or signed with ``secret``
    (one who holds the fleet's secret)."""
    from plancache.tiers.remote import secret_id
    from plancache.workflows.bundle import _tag

    data = path.read_bytes()
    (length,) = struct.unpack_from(">Q", data, len(BUNDLE_MAGIC))
    start = len(BUNDLE_MAGIC) + 8 + 32
    header, payload = json.loads(data[start : start + length]), data[start + length :]
    header.pop("signature", None)
    members, out = header["entries"], b""
    for member in members:
        raw = payload[member["offset"] : member["offset"] + member["size"]]
        if member["key"] == forged_entry.key:
            raw = encode_entry(forged_entry)
        member.update(offset=len(out), size=len(raw), sha256=hashlib.sha256(raw).hexdigest())
        out += raw
    header["payload_size"] = len(out)
    if secret is not None:
        header["signature"] = {"algorithm": "hmac-sha256", "key_id": secret_id(secret).hex(), "tag": _tag(secret, header, out)}
    text = json.dumps(header, sort_keys=True).encode()
    path.write_bytes(BUNDLE_MAGIC + struct.pack(">Q", len(text)) + hashlib.sha256(text).digest() + text + out)


FLEET_SECRET = b"fleet-secret-0123456789abcdef!!!"


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "allow-unsigned"])
@pytest.mark.parametrize("donor", GRAPH_DONORS)
def test_bundle_import_refuses_another_graphs_blob(make_cache: MakeCache, tmp_path: Path, donor: str, signed: bool) -> None:
    _, swapped = forged(make_cache, donor)
    bundle = tmp_path / "plans.bundle"
    source = Store()
    export_bundle(source, bundle, secret=FLEET_SECRET)
    source.close()
    _forge_bundle(bundle, swapped, FLEET_SECRET if signed else None)
    target = Store(tmp_path / "target")
    options: dict[str, Any] = {"secret": FLEET_SECRET} if signed else {"allow_unsigned": True}
    with pytest.raises(BundleError, match=ANOTHER_GRAPH):
        import_bundle(target, bundle, **options)
    assert target.keys() == []
    target.close()


@pytest.mark.parametrize("donor", list(DONORS))
def test_the_redis_tiers_judge_refuses_another_graphs_blob(make_cache: MakeCache, donor: str) -> None:
    own, swapped = forged(make_cache, donor)
    assert problem(own) is None
    reason = problem(swapped)
    assert reason is not None and refused_as_forged(reason)
    with pytest.raises(ValueError, match=ANOTHER_GRAPH if DONORS[donor][1] is not None else "carries no graph"):
        decode_entry(encode_entry(swapped))  # what the Redis tier and bundle import decode with


def test_a_trigger_that_swaps_blobs_is_caught_by_the_blob_check(
    make_cache: MakeCache, cache_dir: Path, tmp_path: Path, db: Connect
) -> None:
    """A trigger added by hand gives each new row the blob (and blob checksum) of the first
    row: every checksum holds, and only the blob's graph tells."""
    stored(make_cache, [MatmulBiasRelu()])
    elsewhere = make_cache(directory=tmp_path / "elsewhere")
    own_key = elsewhere.get(OWN.graph()).key
    own = elsewhere.store.get(own_key)
    assert own is not None
    conn = db()
    conn.execute("CREATE TRIGGER swap AFTER INSERT ON plans BEGIN UPDATE plans SET "
                 "blob = (SELECT blob FROM plans WHERE key <> NEW.key ORDER BY rowid LIMIT 1), "
                 "blob_sha256 = (SELECT blob_sha256 FROM plans WHERE key <> NEW.key ORDER BY rowid LIMIT 1) "
                 "WHERE key = NEW.key; END")  # fmt: skip
    conn.execute(INSERT_SQL, own.row())
    conn.execute("DROP TRIGGER swap")  # gone again: what it did stays
    assert bytes(conn.execute("SELECT blob FROM plans WHERE key = ?", (own_key,)).fetchone()[0]) != own.blob
    cache = make_cache()
    plan = cache.get(OWN.graph())
    assert plan.source == "rebuilt"
    assert_runs_correctly(plan, OWN)
    assert [(q["key"], ANOTHER_GRAPH in q["reason"]) for q in cache.store.quarantined()] == [(own_key, True)]


# ---------------------------------------------------------------------------- every decode total


def _meta(entry: Entry, **changes: Any) -> str:
    """The metadata checksum a forger recomputes for ``entry`` with ``changes``."""
    return dataclasses.replace(entry, **changes).meta_digest()


DEEP = "[" * 100_000 + "]" * 100_000

#: Damage to OWN's row: ``(SQL assignments, parameters)`` given its stored entry. Where the
#: metadata checksum covers the field, it is recomputed, as a forger would.
DAMAGE: dict[str, Callable[[Entry], tuple[str, tuple[Any, ...]]]] = {
    "deep graph_json": lambda e: ("graph_json = ?", (DEEP,)),
    "deep timing_json": lambda e: ("timing_json = ?", (DEEP,)),
    "infinite workspace size": lambda e: ("workspace_size = 9e999", ()),
    "workspace size 2**62": lambda e: ("workspace_size = ?, meta_sha256 = ?", (2**62, _meta(e, workspace_size=2**62))),
    "negative workspace size": lambda e: ("workspace_size = -1, meta_sha256 = ?", (_meta(e, workspace_size=-1),)),
    "workspace size of a fraction": lambda e: ("workspace_size = workspace_size + 0.5", ()),  # the column keeps '0' text as 0
    "infinite creation time": lambda e: ("created_at = 9e999", ()),
    "hit count of a fraction": lambda e: ("hit_count = 0.5", ()),
    "timing of the wrong shape": lambda e: ("timing_json = '[1, 2]'", ()),
    "candidates of the wrong shape": lambda e: ("candidates_json = '\"fast\"'", ()),
}


#: Damage in the records a store hit does not read (how the plan was chosen and timed): a hit
#: serves the sound plan, and verify finds the row.
UNREAD_BY_HITS = {"deep timing_json", "timing of the wrong shape", "candidates of the wrong shape"}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_field_of_the_wrong_type_range_or_depth_is_a_damaged_entry(
    make_cache: MakeCache, db: Connect, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    [key] = stored(make_cache, [OWN])
    store = Store()
    entry = store.get(key)
    assert entry is not None
    assignments, values = DAMAGE[damage](entry)
    db().execute(f"UPDATE plans SET {assignments} WHERE key = ?", (*values, key))
    report = maintenance.verify(store)  # no exception: the row is reported
    assert report["damaged"] or key in report["foreign"], report
    exported = export_bundle(store, tmp_path / "plans.bundle")  # no exception: the row is left out
    assert exported["keys"] == [] and key in exported["skipped"]
    store.close()
    cache = make_cache()
    plan = cache.get(OWN.graph())  # never an exception
    assert_runs_correctly(plan, OWN)
    if damage in UNREAD_BY_HITS:  # the plan is sound and served; the row stays for verify --fix
        assert plan.source == "loaded" and cache.store.quarantined() == [] and cache.counters["corrupt"] == 0
        assert maintenance.verify(cache.store, fix=True)["fixed"]["quarantined"]  # the damaged row (verify names it by row)
        assert [q["key"] for q in cache.store.quarantined()] == [key]
        return
    assert plan.source in ("built", "rebuilt")  # a miss
    assert [q["key"] for q in cache.store.quarantined()] == [key]
    assert cache.counters["corrupt"] == 1
    assert len(warnings_naming(caplog, key)) == 1


@pytest.mark.parametrize(
    "field, value",
    [("workspace_size", float("inf")), ("workspace_size", 2**62), ("workspace_size", -1), ("hit_count", "7"), ("timing", [1]),
     ("description", DEEP)],
    ids=["infinite workspace", "workspace 2**62", "negative workspace", "hit count as text", "timing a list", "deep description"],
)  # fmt: skip
def test_a_bundle_or_fleet_entry_with_a_bad_field_is_refused_as_malformed(make_cache: MakeCache, field: str, value: Any) -> None:
    [key] = stored(make_cache, [OWN])
    store = Store()
    entry = store.get(key)
    store.close()
    assert entry is not None
    header = entry.header()
    header[field] = {"deep": 1} if field == "description" else value
    raw = json.dumps(header, sort_keys=True).encode().replace(b'{"deep": 1}', DEEP.encode())  # nested beyond any description
    data = ENTRY_MAGIC + struct.pack(">Q", len(raw)) + raw + entry.blob
    with pytest.raises(ValueError, match="malformed entry"):
        decode_entry(data)


def test_sizes_come_from_the_blobs_not_the_stored_blob_size(make_cache: MakeCache, db: Connect) -> None:
    keys = stored(make_cache, [ConvBiasRelu(n=n) for n in (1, 2, 3)])
    conn = db()
    lengths = dict(conn.execute("SELECT key, length(blob) FROM plans").fetchall())
    conn.execute("UPDATE plans SET blob_size = 0")  # what eviction used to read, and the size total followed
    store = Store()
    assert store.total_size() == sum(lengths.values())
    assert store.stats()["blob_bytes"] == sum(lengths.values())
    assert {r["key"]: r["blob_size"] for r in maintenance.list_entries(store)} == lengths
    assert store.evict_to(lengths[keys[2]]) == 2  # the two least recently used, by their blobs' real sizes
    assert store.keys() == [keys[2]] and store.total_size() == lengths[keys[2]]
    store.close()


@pytest.mark.parametrize(
    "change, reason",
    [(lambda t: {**t, "dims": [d + 1 for d in t["dims"]]}, "tensor table does not match the graph"),
     (lambda t: {**t, "dims": "3,8,6,6"}, "malformed entry"),
     (lambda t: {**t, "uid": 999}, "tensor table does not match the graph")],
    ids=["another shape", "a shape that is not a list", "a uid the graph lacks"],
)  # fmt: skip
def test_a_tensor_table_that_contradicts_the_graph_is_refused(make_cache: MakeCache, change: Callable[[dict[str, Any]], Any],
                                                              reason: str) -> None:  # fmt: skip
    # Its metadata checksum recomputed, as a writer that stored a wrong table would have: an
    # input's shape the graph contradicts would make every execute refuse right tensors.
    [key] = stored(make_cache, [OWN])
    store = Store()
    entry = store.get(key)
    store.close()
    assert entry is not None
    tensors = list(entry.tensors)
    first_input = next(i for i, t in enumerate(tensors) if not t.get("is_output"))
    tensors[first_input] = change(dict(tensors[first_input]))
    altered = dataclasses.replace(entry, tensors=tensors, meta_sha256=None)
    altered = dataclasses.replace(altered, meta_sha256=altered.meta_digest())
    assert problem(entry) is None
    found = problem(altered)
    assert found is not None and reason in found, found
