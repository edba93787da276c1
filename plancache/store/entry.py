"""The data model of a stored plan: ``Entry`` (one row of the plan store), its checksums,
and ``problem``: the one place that judges whether a stored entry may be served (hits,
``verify``, bundle import, salvage and the Redis tier all ask it). No SQLite, no GPU.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import operator
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..formats.check import CHECK_RULE
from ..formats.plan_blob import PlanBlob
from ..key import JSON, KEY_FORMAT, CacheKey, TensorSpec, canonical_json, environment_id
from .judge import form_of, judge
from .kept import Kept

__all__ = [
    "INSERT_COLUMNS",
    "INSERT_SQL",
    "MAX_DEPTH",
    "MAX_WORKSPACE",
    "NEVER_CHECKED",
    "Entry",
    "Sound",
    "Unsound",
    "held_to",
    "judged",
    "load_json",
    "problem",
    "sha256",
    "summarize",
    "unsound",
]


#: What ``problem`` says of an entry stored before plancache checked candidates element by
#: element (never, or under rule 1): sound but not known right, so a lookup autotunes (and
#: checks) the graph again and replaces it, instead of quarantining it.
NEVER_CHECKED = "not checked element by element: stored before plancache compared every output element, so it is chosen again"


#: Stored JSON nested deeper than this is damage (a description nests five levels or so):
#: decoding it would end in RecursionError, and every later walk of it could too.
MAX_DEPTH = 64

#: The largest workspace a stored plan may ask for, 1 TiB: more than any GPU has (an H200
#: has 141 GB), so a larger size is damage, and far below 2**63, so no size the native path
#: computes from it overflows the C types it passes it in.
MAX_WORKSPACE = 1 << 40

_MAX_COUNT = (1 << 63) - 1  # what SQLite's INTEGER holds


def load_json(text: object, what: str) -> JSON:
    """The JSON value of stored ``text``; ``ValueError`` naming ``what`` for anything else."""
    if not isinstance(text, (str, bytes)):
        raise ValueError(f"{what} is a {type(text).__name__}, not JSON text")
    try:
        value: JSON = orjson.loads(text)
    except orjson.JSONDecodeError:
        # What orjson refuses that Python's json reads: NaN and the infinities, integers
        # past 64 bits, lone surrogates (records written by json.dumps may hold them);
        # JSON it cannot read either is refused there.
        try:
            value = json.loads(text)
        except RecursionError:
            raise ValueError(f"{what} nests deeper than {MAX_DEPTH} levels") from None
    opened = text.count("[") + text.count("{") if isinstance(text, str) else text.count(b"[") + text.count(b"{")
    if opened <= MAX_DEPTH:  # fewer brackets than the limit (strings' own included): no deeper nesting
        return value
    pending: list[dict[str, JSON] | list[JSON]] = [value] if isinstance(value, (dict, list)) else []
    depth = 0
    while pending:  # one level of containers at a time: no recursion, however deep
        depth += 1
        if depth > MAX_DEPTH:
            raise ValueError(f"{what} nests deeper than {MAX_DEPTH} levels")
        pending = [v for c in pending for v in (c.values() if isinstance(c, dict) else c) if isinstance(v, (dict, list))]
    return value


def summarize(description: Mapping[str, object]) -> str:
    """A short op summary of a canonical description, an entry's label:
    ``CONV_FPROP+POINTWISE(relu)``; TypeError for a description of the wrong shape."""
    nodes = description.get("nodes", [])
    if not isinstance(nodes, (list, tuple)):  # a tuple: a description made in this process
        raise TypeError(f"a {type(nodes).__name__} where a list belongs")
    parts = []
    for node in nodes:
        if not isinstance(node, dict):
            raise TypeError(f"a {type(node).__name__} where a mapping belongs")
        params = node.get("params")
        mode = params.get("mode") if isinstance(params, dict) else None
        parts.append(f"{node['type']}({mode})" if mode else str(node["type"]))
    return "+".join(parts)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _meta_digest(tensors_json: object, engine_json: object, workspace_size: int, check_json: object) -> str:
    text = f"{tensors_json}\n{engine_json}\n{int(workspace_size)}"
    # The check record joins the checksum when there is one: rows stored before it existed
    # keep the digest they were written with.
    return sha256((text if check_json is None else f"{text}\n{check_json}").encode())


@dataclass
class Entry:
    """One stored plan with everything known about how it was made."""

    key: str
    env_id: str
    label: str
    description: dict[str, JSON]
    environment: dict[str, JSON]
    options: dict[str, JSON]
    tensors: list[dict[str, JSON]]
    blob: bytes
    blob_sha256: str
    engine: dict[str, JSON] | None
    workspace_size: int
    policy: str
    candidates: list[dict[str, JSON]]
    timing: dict[str, JSON]
    build_seconds: float
    autotune_seconds: float
    backend: str
    created_at: float = field(default_factory=time.time)
    last_used_at: float = 0.0
    hit_count: int = 0
    meta_sha256: str | None = None  # None: written by schema 1, before this checksum existed
    #: How the choice was checked against the other candidates (``autotuning.autotune``);
    #: None: stored before plancache checked candidates, so not to be served.
    check: dict[str, JSON] | None = None
    #: The texts of the columns the metadata checksum covers, as read from a row (None for an
    #: entry made otherwise, or by ``dataclasses.replace``): ``meta_ok`` hashes them as read.
    row_texts: tuple[object, object, int, object] | None = field(default=None, init=False, repr=False, compare=False)
    #: The row's kept judgement, as read (``store.kept``); None for an entry made any other way.
    judgement: object = field(default=None, init=False, repr=False, compare=False)

    def header(self) -> dict[str, object]:
        """Every field but the blob (and not what was kept of the row it was read from):
        what a bundle, the fleet and ``plancache show`` carry beside the blob."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init and f.name != "blob"}

    def checksum_ok(self) -> bool:
        return len(self.blob) > 0 and sha256(self.blob) == self.blob_sha256

    @property
    def checked(self) -> bool:
        """Whether its engine was checked against the other candidates element by element
        (under ``CHECK_RULE``); an entry that was not is sound but chosen again."""
        return isinstance(self.check, dict) and self.check.get("rule") == CHECK_RULE

    def meta_digest(self) -> str:
        """SHA-256 of the canonical text of what the plan executes with besides its blob."""
        return _meta_digest(*self._meta_columns())

    def meta_ok(self) -> bool:
        """Whether the metadata checksum holds (an entry of schema 1 has none). Only a row whose
        texts are not the canonical ones ``row`` writes (an older writer's) is encoded again."""
        if self.meta_sha256 is None:
            return True
        if self.row_texts is not None and _meta_digest(*self.row_texts) == self.meta_sha256:
            return True
        return self.meta_digest() == self.meta_sha256

    def _meta_columns(self) -> tuple[str, str | None, int, str | None]:
        # Canonical (sorted) JSON: the same text whatever order a decoder gave the keys.
        engine = canonical_json(self.engine) if self.engine is not None else None
        check = canonical_json(self.check) if self.check is not None else None
        return canonical_json(self.tensors), engine, self.workspace_size, check

    def row(self) -> dict[str, object]:
        tensors, engine, _, check = self._meta_columns()
        return {
            **{name: getattr(self, name) for name in _AS_IS},
            # Canonical, as the key hashes them: a lookup compares these columns with its key's
            # own texts instead of decoding them (``from_row``'s ``known``).
            "graph_json": canonical_json(self.description),
            "environment_json": canonical_json(self.environment),
            "options_json": canonical_json(self.options),
            "tensors_json": tensors,
            "blob_size": len(self.blob),
            "engine_json": engine,
            "candidates_json": json.dumps(self.candidates),
            "timing_json": json.dumps(self.timing),
            "last_used_at": self.last_used_at or self.created_at,
            "meta_sha256": self.meta_sha256 or self.meta_digest(),
            "check_json": check,
        }

    @classmethod
    def from_row(cls, row: Mapping[str, object], known: Mapping[str, tuple[str, JSON]] | None = None,
                 details: bool = True) -> Entry:  # fmt: skip
        """The entry a row of ``plans`` holds; ``ValueError`` for a field of the wrong type,
        range or depth (``validated``). ``known``: column -> (text, value) the caller decoded
        already (a lookup: its key's graph, environment and options), taken for a column of
        that text without decoding. ``details=False`` leaves the candidates and the timing
        records empty: what a store hit reads, and never writes back."""
        columns = row.keys()
        known = known or {}
        check_json = row["check_json"] if "check_json" in columns else None  # a row of schema 4 or earlier has none

        def column(name: str) -> JSON:
            text = row[name]
            found = known.get(name)
            return found[1] if found is not None and found[0] == text else load_json(text, name)

        entry = cls.validated({
            **dict(zip(_AS_IS, _read_as_is(row))),
            "description": column("graph_json"),
            "environment": column("environment_json"),
            "options": column("options_json"),
            "tensors": load_json(row["tensors_json"], "tensors_json"),
            "engine": load_json(row["engine_json"], "engine_json") if row["engine_json"] else None,
            "candidates": load_json(row["candidates_json"], "candidates_json") if details else [],
            "timing": load_json(row["timing_json"], "timing_json") if details else {},
            "meta_sha256": row["meta_sha256"] if "meta_sha256" in columns else None,
            "check": load_json(check_json, "check_json") if check_json else None,
        })  # fmt: skip
        entry.row_texts = (row["tensors_json"], row["engine_json"], entry.workspace_size, check_json)
        entry.judgement = row["judgement"] if "judgement" in columns else None
        return entry

    @classmethod
    def validated(cls, fields: Mapping[str, object]) -> Entry:
        """An entry of decoded ``fields`` (a row's, a bundle's or the fleet's), each checked
        for its type and range; ``ValueError`` naming the first that is wrong. ``problem``
        judges the bytes; this only makes sure nothing read from them raises later (a
        workspace size of 2**62 or infinity, a list where a mapping belongs)."""
        read: dict[str, Any] = dict(fields)  # Any: each field is checked against _FIELD_TYPES, which mypy cannot follow
        if read.keys() != _DEFAULTS.keys():  # a row has every field: only a bundle's may lack some
            unknown = read.keys() - _DEFAULTS.keys()
            missing = _REQUIRED - read.keys()
            if unknown or missing:
                raise ValueError(f"entry fields unknown ({sorted(unknown)}) or missing ({sorted(missing)})")
            read.update((name, d() if callable(d) else d) for name, d in _DEFAULTS.items() if name not in fields)
        for name, kinds in _FIELD_TYPES.items():
            value = read[name]
            if not isinstance(value, kinds) or type(value) is bool:  # bool has no subclasses
                raise ValueError(f"entry field {name} is a {type(value).__name__}")
        for name in ("tensors", "candidates"):
            if not all(isinstance(item, dict) for item in read[name]):
                raise ValueError(f"entry field {name} holds something other than mappings")
        for name, high in (("workspace_size", MAX_WORKSPACE), ("hit_count", _MAX_COUNT)):
            if not 0 <= read[name] <= high:
                raise ValueError(f"entry field {name} is {read[name]}, outside 0..{high}")
        for name in _TIMES:
            value = read[name] = float(read[name])
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"entry field {name} is {fields[name]}, not a time")
        read["blob"] = bytes(read["blob"])
        return cls(**read)


#: The columns of ``plans`` that hold the entry's field of their name as it is (``row``
#: writes ``last_used_at`` as ``created_at`` while it is 0).
_AS_IS = ("key", "env_id", "label", "blob", "blob_sha256", "workspace_size", "policy", "build_seconds", "autotune_seconds",
          "backend", "created_at", "last_used_at", "hit_count")  # fmt: skip
_read_as_is = operator.itemgetter(*_AS_IS)

#: Each field of an entry and its default or default factory (a bundle written before a
#: field existed lacks it); MISSING: required.
_DEFAULTS: dict[str, object] = {
    f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory
    for f in dataclasses.fields(Entry)
    if f.init
}
_REQUIRED = frozenset(name for name, default in _DEFAULTS.items() if default is dataclasses.MISSING)
_TIMES = ("build_seconds", "autotune_seconds", "created_at", "last_used_at")  # seconds: finite, not negative


def sound_use(hit_count: object, last_used_at: object) -> bool:
    """Whether a row's record of use reads back as an entry's (``Entry.validated``'s bounds)."""
    return (isinstance(hit_count, int) and not isinstance(hit_count, bool) and 0 <= hit_count <= _MAX_COUNT
            and isinstance(last_used_at, (int, float)) and math.isfinite(last_used_at) and last_used_at >= 0)  # fmt: skip


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    **dict.fromkeys(("key", "env_id", "label", "blob_sha256", "policy", "backend"), str),
    **dict.fromkeys(("description", "environment", "options", "timing"), dict),
    **dict.fromkeys(("tensors", "candidates"), list),
    **dict.fromkeys(("engine", "check"), (dict, type(None))),
    **dict.fromkeys(_TIMES, (int, float)),
    "blob": (bytes, bytearray, memoryview),
    "workspace_size": int,
    "hit_count": int,
    "meta_sha256": (str, type(None)),
}


def problem(entry: Entry, environment: Mapping[str, object] | None = None) -> str | None:
    """Why ``entry`` must not be served (for a key of ``environment``, when given), or None.

    Checks everything a plan executes with and everything its key promises: the blob's and
    the metadata's checksums, the environment, the key and environment id re-derived from
    the row (a row altered, copied under another key, or of an older key format), the tensor
    table against the graph, and the blob's own graph against it (``store.judge``: a blob of
    another graph, its checksum recomputed). Costs a JSON encoding, two SHA-256 hashes and a
    read of the blob's graph (``scripts/bench_blob_check.py``); ``judged`` gives the verdict
    typed. An entry of the wrong shapes (a bundle's or the fleet's bytes are only
    checksummed by their sender) is judged malformed, never an exception of the caller's.
    """
    return unsound(entry, environment) or (None if entry.checked else NEVER_CHECKED)


def unsound(entry: Entry, environment: Mapping[str, object] | None = None) -> str | None:
    """What ``problem`` says but never NEVER_CHECKED: why ``entry`` cannot be trusted at
    all, or None for a sound entry (``Entry.checked`` then says whether it is known right)."""
    verdict = judged(entry, environment)
    return verdict.reason if isinstance(verdict, Unsound) else None


@dataclass(frozen=True)
class Sound:
    """An entry found sound, with what was read to find it so, for its load to use: the blob
    decoded once (the judge read its graph, the load reads its record), the tensor table
    read once. ``unproven``: as ``store.judge.Judgement``'s."""

    entry: Entry
    blob: PlanBlob
    tensors: tuple[TensorSpec, ...]
    unproven: tuple[str, ...] = ()
    kept: bool = False  # the judgement kept in its row stood in for the judge's reading of the blob


@dataclass(frozen=True)
class Unsound:
    """An entry that cannot be trusted at all, and why."""

    reason: str


#: A key's environment must be its entry's: the plan is of its GPU, driver and library versions.
_OTHER_ENVIRONMENT = Unsound("environment differs from the key's")


def judged(entry: Entry, environment: Mapping[str, object] | None = None, env_id: str | None = None,
           key: CacheKey | None = None, blob: PlanBlob | None = None, kept: Kept | None = None) -> Sound | Unsound:  # fmt: skip
    """``entry`` judged as ``problem`` describes (but for NEVER_CHECKED: ``Entry.checked``),
    for a key of ``environment`` when given. ``env_id``: that environment's id, when the
    caller knows it (not derived again per row); ``key``: the lookup's key the entry was
    read for (``Entry.from_row``'s ``known``); ``blob``: the entry's blob decoded already;
    ``kept``: the row's kept judgement (``store.kept``), which stands in for the judge's
    reading of the blob, every other check made."""
    if blob is not None and blob.data != entry.blob:
        return Unsound("the blob handed to the judge is not the entry's")
    try:
        if not entry.checksum_ok():
            return Unsound("blob checksum mismatch")
        if environment is not None and entry.environment != environment:
            return _OTHER_ENVIRONMENT
        if entry.env_id != (env_id if environment is not None and env_id is not None else environment_id(entry.environment)):
            return Unsound("env_id does not match the recorded environment")
        # An entry of the key's own graph and options objects under its digest (``Entry.from_row``'s
        # ``known``, or made from the key) was hashed from them already: its key is not derived again.
        held = (key is not None and entry.key == key.digest and entry.description is key.parts["graph"]
                and entry.options is key.parts["options"] and entry.environment == key.parts["environment"])  # fmt: skip
        if not held:
            parts = {"format": KEY_FORMAT, "graph": entry.description, "environment": entry.environment, "options": entry.options}
            if entry.key != sha256(canonical_json(parts).encode()):
                return Unsound("key does not match the recorded graph, environment and options")
        if not entry.meta_ok():
            return Unsound("metadata checksum mismatch (tensor table, engine, workspace size or check record altered)")
        if entry.check is not None and not isinstance(entry.check, dict):
            return Unsound(f"malformed entry (its check record is a {type(entry.check).__name__})")
        refusal = _tensor_problem(entry)
        if refusal is not None:
            return Unsound(refusal)
        blob = blob if blob is not None else PlanBlob(entry.blob)
        if kept is not None:
            unproven = kept.unproven
        else:
            judgement = judge(blob, entry.description, form_of(entry.key, entry.description))
            if judgement.refusal is not None:
                return Unsound(judgement.refusal)
            unproven = judgement.unproven
        return Sound(entry, blob, tuple(map(TensorSpec.from_dict, entry.tensors)), unproven, kept is not None)
    except (AttributeError, TypeError, KeyError, ValueError) as exc:
        return Unsound(f"malformed entry ({type(exc).__name__}: {exc})")


def held_to(verdict: Sound | Unsound, environment: Mapping[str, object]) -> Sound | Unsound:
    """A verdict of ``judged(entry)`` (judged ahead of the device, by the primer) held to a
    key of ``environment``: what ``judged(entry, environment)`` would say."""
    if isinstance(verdict, Sound) and verdict.entry.environment != environment:
        return _OTHER_ENVIRONMENT
    return verdict


def _tensor_problem(entry: Entry) -> str | None:
    """Whether the tensor table contradicts the key's graph (a damaged input shape would make
    every ``execute`` refuse the right tensors). Output shapes, inferred at build time, are not compared."""
    # On every store hit's path: the types are narrowed inline (a helper is a Python call each).
    described = entry.description.get("tensors") or {}
    if not isinstance(described, dict):
        raise TypeError(f"a {type(described).__name__} where the description's tensors belong")
    for spec in entry.tensors:
        graph_tensor = described.get(f"u{spec.get('uid')}")
        if (
            not isinstance(graph_tensor, dict)
            or graph_tensor.get("is_virtual")
            or bool(graph_tensor.get("is_output")) != bool(spec.get("is_output"))
        ):
            return f"tensor table does not match the graph (uid {spec.get('uid')})"
        if graph_tensor.get("is_output"):
            continue
        dims, strides = spec.get("dims") or [], spec.get("strides") or []
        if not isinstance(dims, (list, tuple)) or not isinstance(strides, (list, tuple)):
            raise TypeError(f"a stored shape of uid {spec.get('uid')} that is not a list")
        stored = (list(dims), list(strides), spec.get("dtype"))
        if stored != (graph_tensor.get("dim"), graph_tensor.get("stride"), graph_tensor.get("dtype")):
            return f"tensor table does not match the graph (uid {spec.get('uid')}: {stored[:2]})"
    return None


INSERT_COLUMNS = (
    "key", "env_id", "label", "graph_json", "environment_json", "options_json", "tensors_json",
    "blob", "blob_sha256", "blob_size", "engine_json", "workspace_size", "policy",
    "candidates_json", "timing_json", "build_seconds", "autotune_seconds", "backend",
    "created_at", "last_used_at", "hit_count", "meta_sha256", "check_json",
)  # fmt: skip
#: Insert (or replace) one ``Entry.row()``.
INSERT_SQL = f"INSERT OR REPLACE INTO plans ({', '.join(INSERT_COLUMNS)}) VALUES ({', '.join(':' + c for c in INSERT_COLUMNS)})"
