"""What a serialized cuDNN Frontend plan holds, and how a launch lays out its variant pack.

A frontend plan blob (UBJSON, ``guest.native.ubjson``) carries the backend plan's JSON
representation (``cudnn_backend_data``) and what the frontend adds around the backend at
every launch:

* ``variant_pack_uids``: the tensors the backend plan reads and writes;
* ``pass_by_values``: scalars the graph holds, passed to the backend as host pointers;
* ``workspace_modifications``: per uid, an operation (0: copy these floats to the
  workspace, 1: zero this many bytes of it, anything else: only point the uid there), an
  offset into the frontend's part of the workspace, and the floats;
* ``variant_pack_replacements``: a uid pointed at another's pointer plus an offset;
* ``fe_workspace_size``: the frontend's part of the workspace, in front of the backend's;
* ``aligned_operands``: per uid, the alignment its pointer must have.

``Layout`` turns these into the order of the pack's slots exactly as the frontend's
``prepare_variant_pack_template`` does (cuDNN Frontend 1.32): the variant-pack uids and
the replacement sources, sorted; then the by-value uids and the workspace uids not among
them. A launch fills the caller's slots, the workspace slots, the replacements, and
hands the backend every slot but a replacement source that the plan does not read.

``parse`` reads uids, offsets and sizes as integers in range, every workspace change
inside the frontend's part of the workspace (on the GPU, anything else is an address in
another tensor), floats as the 32-bit words they are, and the non-virtual tensors of the
backend plan (its ``operationGraph``). ``refusal`` is the gate: a blob with a format
version, a field or a value this code was not tested on is left to the frontend's own
path; a blob that would hand cuDNN a pointer outside every tensor and the workspace
(``OUT_OF_BOUNDS``) is refused outright, since the frontend's path applies the same
offsets and slots.
"""

from __future__ import annotations

import enum
import math
import os
import re
import struct
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from ...formats.plan_blob import PlanBlob
from ...formats.plan_graph import float_bits, int_list
from ...formats.ubjson import UbjsonError
from ...key import TensorSpec
from ..tensors import DTYPE_BYTES, span, storage_geometry

__all__ = ["BY_VALUE_TYPES", "MEMORY_CEILING", "OUT_OF_BOUNDS", "TESTED_VERSIONS", "ByValue", "Fallback", "Layout", "PlanRecord",
           "WorkspaceChange", "keep", "kept_form", "lowered_layouts", "parse", "refusal", "workspace_fits"]  # fmt: skip

#: Plan formats (``json_version``) the native path was tested on, against real blobs
#: recorded on a GPU (tests/data/plans).
TESTED_VERSIONS = frozenset({"2.0"})
#: Top-level fields a load reads.
_READ = frozenset({"json_version", "cudnn_backend_data", "variant_pack_uids", "pass_by_values", "workspace_modifications",
                   "variant_pack_replacements", "fe_workspace_size", "aligned_operands", "tensors_to_dump"})  # fmt: skip
#: Fields that describe the graph or the plan for people and tools; a load does not need them.
_DESCRIPTIVE = frozenset({"behavior_notes", "gid", "context", "nodes", "tensors", "cudnn_backend_version",
                          "cudnn_frontend_version", "name"})  # fmt: skip
#: The frontend's by-value types, by its variant index: (name, struct format, bytes).
BY_VALUE_TYPES = {0: ("int64", "<q"), 1: ("int32", "<i"), 2: ("half", "<e"), 3: ("float", "<f"), 4: ("double", "<d"),
                  5: ("bfloat16", None)}  # fmt: skip


@dataclass(frozen=True)
class ByValue:
    """A scalar the frontend passes by value: its type and its bytes, little-endian."""

    kind: str
    data: bytes


@dataclass(frozen=True)
class WorkspaceChange:
    """What the frontend does to its part of the workspace before each launch."""

    operation: int  # 0: copy ``words`` there; 1: zero ``zero_bytes`` bytes; other: none
    offset: int
    #: The 32-bit words the frontend wrote as floats' bits, kept as bits: some are int32
    #: values (sequence lengths) whose bits are a denormal float, which a round trip
    #: through a float turns into 0 under flush-to-zero (``torch.set_flush_denormal``).
    words: tuple[int, ...]
    zero_bytes: int = 0


@dataclass(frozen=True)
class PlanRecord:
    """Everything a native load and launch needs of a frontend plan blob."""

    version: str
    representation: bytes  # UTF-8 JSON, handed to cuDNN as it is
    variant_pack_uids: tuple[int, ...]
    by_value: Mapping[int, ByValue]
    workspace: Mapping[int, WorkspaceChange]
    replacements: Mapping[int, tuple[int, int]]  # source uid -> (destination uid, byte offset)
    fe_workspace_size: int
    aligned: Mapping[int, int]  # uid -> alignment of its pointer, in bytes
    fields: frozenset[str]
    dumps: int  # tensors the frontend would dump at each launch (a debugging aid)
    #: The backend plan's non-virtual tensors by uid, as cuDNN reads them (its own JSON:
    #: what it finalizes, so what bounds its reads and writes); empty when it has none.
    backend_tensors: Mapping[int, TensorSpec] = field(default_factory=dict)


class RecordError(ValueError):
    """The blob is not a frontend plan this code can read."""


def _float_bits(value: Any) -> int:
    """The 32 bits of a float as the frontend writes it (``formats.plan_graph.float_bits``)."""
    try:
        return float_bits(value)
    except ValueError as exc:
        raise RecordError(str(exc)) from None


def _float_of(bits: int) -> float:
    return float(struct.unpack("<f", struct.pack("<I", bits))[0])


#: The range of cuDNN's int64 uids.
_INT64 = (-(2**63), 2**63 - 1)


def _int(value: Any, what: str, low: int | None = None, high: int | None = None) -> int:
    """``value`` when it is an integer within ``low``..``high``, else ``RecordError``: a
    uid, offset or size is never coerced from a string or a float, and never out of range
    (on the GPU it would be an address inside another tensor)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise RecordError(f"{what} must be an integer, not {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise RecordError(f"{what} {value} is outside {low if low is not None else ''}..{high if high is not None else ''}")
    return value


def _uid(value: Any) -> int:
    """A uid as a key of a map by uid: an integer, or (as a JSON object's key) its decimal
    digits."""
    if isinstance(value, str) and re.fullmatch(r"-?\d{1,19}", value):
        value = int(value)
    return _int(value, "a uid", *_INT64)


def _by_value(raw: Any) -> ByValue:
    if not isinstance(raw, Mapping) or "index" not in raw or "value" not in raw:
        raise RecordError(f"a pass-by-value entry must be {{index, value}}, not {raw!r}")
    index, value = int(raw["index"]), raw["value"]
    if index not in BY_VALUE_TYPES:
        raise RecordError(f"pass-by-value type index {index} is not one the native path knows")
    kind, fmt = BY_VALUE_TYPES[index]
    if kind == "bfloat16":  # the upper half of the float32's bits (exact: it came from a bfloat16)
        return ByValue(kind, struct.pack("<I", _float_bits(value))[2:])
    if kind == "float":  # the bits as written
        return ByValue(kind, struct.pack("<I", _float_bits(value)))
    if kind == "half":
        return ByValue(kind, struct.pack("<e", _float_of(_float_bits(value))))
    return ByValue(kind, struct.pack(fmt or "", float(value) if kind == "double" else int(value)))


def _uid_pairs(raw: Any) -> list[tuple[Any, Any]]:
    """A JSON map with integer keys: an object keyed by their decimal strings, or (as
    nlohmann writes a map whose keys are not strings) an array of ``[key, value]`` pairs."""
    if isinstance(raw, Mapping):
        return list(raw.items())
    if isinstance(raw, list) and all(isinstance(p, list) and len(p) == 2 for p in raw):
        return [(p[0], p[1]) for p in raw]
    raise RecordError(f"expected a map by uid, not {type(raw).__name__}")


def parse(blob: PlanBlob | bytes) -> PlanRecord:
    """The record of a frontend plan blob; raises ``RecordError`` for anything else. Reads
    the blob's decoding (``PlanBlob.fields``): on a store hit, the one the judge read. Read
    once per ``PlanBlob`` (``PlanBlob.read``): a plan the primer read ahead is not read again."""
    return PlanBlob.of(blob).read(_parse)


def _parse(blob: PlanBlob) -> PlanRecord:
    try:
        top = blob.fields
    except (UbjsonError, UnicodeDecodeError) as exc:
        raise RecordError(f"not a frontend plan: {exc}") from exc
    if not isinstance(top, Mapping) or not isinstance(top.get("cudnn_backend_data"), str):
        raise RecordError("not a frontend plan: no cudnn_backend_data")
    version = top.get("json_version", "")
    if not isinstance(version, str):  # the frontend refuses any other type
        raise RecordError(f"not a frontend plan: json_version is {type(version).__name__}, not text")
    try:
        fe_workspace_size = _int(top.get("fe_workspace_size", 0), "fe_workspace_size", 0, 2**62)
        workspace = {}
        for uid, change in _uid_pairs(top.get("workspace_modifications") or {}):
            workspace[_uid(uid)] = _workspace_change(change, fe_workspace_size)
        replacements = {}
        for source, target in _uid_pairs(top.get("variant_pack_replacements") or []):
            destination, offset = target
            replacements[_uid(source)] = (_uid(destination), _int(offset, "a replacement's offset", 0, 2**62))
        aligned = {}
        for uid, pair in _uid_pairs(top.get("aligned_operands") or {}):
            alignment = _int(pair[0], "an alignment", 1, 2**20)
            if alignment & (alignment - 1):
                raise RecordError(f"an alignment of {alignment} bytes is not a power of two")
            aligned[_uid(uid)] = alignment
        return PlanRecord(
            version=version,
            representation=top["cudnn_backend_data"].encode(),
            variant_pack_uids=tuple(sorted(_int(u, "a uid", *_INT64) for u in top.get("variant_pack_uids") or [])),
            by_value={_uid(uid): _by_value(raw) for uid, raw in _uid_pairs(top.get("pass_by_values") or {})},
            workspace=workspace,
            replacements=replacements,
            fe_workspace_size=fe_workspace_size,
            aligned=aligned,
            fields=frozenset(top),
            dumps=len(top.get("tensors_to_dump") or []),
            backend_tensors=_backend_tensors(top["cudnn_backend_data"]),
        )
    except RecordError:
        raise
    except (TypeError, ValueError, ArithmeticError, KeyError, IndexError, RecursionError, struct.error) as exc:
        raise RecordError(f"a frontend plan this code cannot read: {type(exc).__name__}: {exc}") from exc


def kept_form(blob: PlanBlob) -> dict[str, Any] | None:
    """The record ``parse`` read of ``blob`` already, as a store keeps it (``store.kept``),
    its representation by where it lies in the blob; None where none was read."""
    record = blob.known(_parse)
    if record is None:
        return None
    text = record.representation
    start = blob.data.find(text)
    if start < 0:  # the frontend escaped it in the blob: not kept, read from the blob each time
        return None
    return {
        "version": record.version,
        "representation": [start, start + len(text)],
        "variant_pack_uids": list(record.variant_pack_uids),
        "by_value": [[uid, value.kind, value.data.hex()] for uid, value in record.by_value.items()],
        "workspace": [[uid, c.operation, c.offset, list(c.words), c.zero_bytes] for uid, c in record.workspace.items()],
        "replacements": [[source, *target] for source, target in record.replacements.items()],
        "fe_workspace_size": record.fe_workspace_size,
        "aligned": [[uid, alignment] for uid, alignment in record.aligned.items()],
        "fields": sorted(record.fields),
        "dumps": record.dumps,
        "backend_tensors": [spec.to_dict() for spec in record.backend_tensors.values()],
    }


def keep(blob: PlanBlob, kept: Mapping[str, Any]) -> None:
    """Take the record a store kept of ``blob`` (``kept_form``) as its record: ``parse``
    then reads nothing. Raises ``RecordError`` for a kept form this code cannot read.

    Every store hit of a kept row runs this: each value is converted as ``PlanRecord``'s
    types say, but an empty list (most plans have no by-value scalar, workspace change or
    replacement) makes no comprehension, and the frozen record's fields are set at once,
    not by its ``__init__``'s eleven ``object.__setattr__`` calls."""
    try:
        start, end = kept["representation"]
        if not 0 <= start <= end <= len(blob.data):
            raise RecordError(f"a kept representation at bytes {start}-{end} of a blob of {len(blob.data)}")
        by_value, workspace, replacements, aligned = (kept["by_value"], kept["workspace"], kept["replacements"],
                                                      kept["aligned"])  # fmt: skip
        record = object.__new__(PlanRecord)
        record.__dict__.update(
            version=str(kept["version"]),
            representation=blob.data[start:end],
            variant_pack_uids=tuple(map(int, kept["variant_pack_uids"])),
            by_value={int(uid): ByValue(str(kind), bytes.fromhex(data)) for uid, kind, data in by_value} if by_value else {},
            workspace={
                int(uid): WorkspaceChange(int(op), int(offset), tuple(map(int, words)), int(zero))
                for uid, op, offset, words, zero in workspace
            } if workspace else {},
            replacements={int(source): (int(target), int(offset)) for source, target, offset in replacements}
            if replacements else {},
            fe_workspace_size=int(kept["fe_workspace_size"]),
            aligned={int(uid): int(alignment) for uid, alignment in aligned} if aligned else {},
            fields=frozenset(map(str, kept["fields"])),
            dumps=int(kept["dumps"]),
            backend_tensors={spec.uid: spec for spec in map(TensorSpec.from_dict, kept["backend_tensors"])},
        )  # fmt: skip
    except RecordError:
        raise
    except (TypeError, ValueError, KeyError) as exc:
        raise RecordError(f"a kept record this code cannot read: {type(exc).__name__}: {exc}") from exc
    blob.know(_parse, record)


def _workspace_change(change: Any, fe_workspace_size: int) -> WorkspaceChange:
    """One ``workspace_modifications`` entry, every byte it touches inside the frontend's
    part of the workspace (a launch writes there before cuDNN runs: an offset or size past
    it would be a write into another tensor)."""
    operation, offset, values = change
    operation = _int(operation, "a workspace operation")
    offset = _int(offset, "a workspace offset", 0, fe_workspace_size)
    words = tuple(_float_bits(v) for v in values or [])
    zero_bytes = 0
    if operation == 0:
        end = offset + 4 * len(words)
    elif operation == 1:
        size = _float_of(words[0]) if words else 0.0
        if not (math.isfinite(size) and size >= 0 and size == int(size)):
            raise RecordError(f"a workspace zeroing of {size!r} bytes")
        zero_bytes = int(size)
        end = offset + zero_bytes
    else:
        end = offset
    if end > fe_workspace_size:
        raise RecordError(f"a workspace change at byte {offset} ends at {end}, past the frontend's {fe_workspace_size} bytes")
    return WorkspaceChange(operation, offset, words, zero_bytes)


def _int64s(values: Any, what: str) -> tuple[int, ...]:
    """A list of int64s as a tuple (None: empty); ``RecordError`` for anything else."""
    if int_list(values) and (not values or _INT64[0] <= min(values) <= max(values) <= _INT64[1]):
        return tuple(values)  # most lists: checked whole, in C
    return tuple(_int(value, what, *_INT64) for value in values or [])


def _backend_tensors(text: str) -> dict[int, TensorSpec]:
    """The non-virtual tensors of a backend plan's JSON by uid: ``operationGraph.tensors``
    (each named by its uid, in cuDNN's data types) and the ragged-offset tensors they name in
    ``isRagged``. Empty for JSON that holds none: the library refuses such a plan, and the
    gate finds the table's tensors missing. A uid listed twice with two layouts raises
    ``RecordError``: which one cuDNN reads could not be told."""
    try:
        # orjson: the JSON is 3-110 KB and read at every load; orjson reads the recorded
        # plans' in about 40% of the standard library's time. Invalid or too deep JSON raises
        # ValueError: no tensors, so the gate refuses the plan. A number past 64 bits is read
        # as a float, which no uid, dim or stride check below accepts.
        graph = orjson.loads(text).get("operationGraph")
    except (ValueError, RecursionError, AttributeError):
        return {}
    pending = list(graph.get("tensors") or []) if isinstance(graph, Mapping) else []
    found: dict[int, TensorSpec] = {}
    while pending:
        raw = pending.pop()
        if not isinstance(raw, Mapping):
            raise RecordError(f"a backend tensor must be an object, not {type(raw).__name__}")
        ragged = raw.get("isRagged")
        pending += ragged if isinstance(ragged, list) else []
        if raw.get("isVirtual") is not False:
            continue
        uid, dtype = _uid(raw.get("name")), raw.get("dataType")
        spec = TensorSpec(
            uid=uid,
            name=str(uid),
            dims=_int64s(raw.get("dim"), "a backend tensor's dim"),
            strides=_int64s(raw.get("stride"), "a backend tensor's stride"),
            dtype="data_type." + dtype.removeprefix("CUDNN_DATA_") if isinstance(dtype, str) else None,
            is_output=False,
            is_pass_by_value=raw.get("isByValue") is True,
        )
        if found.setdefault(uid, spec) != spec:
            raise RecordError(f"the backend plan lists uid {uid} twice, with two layouts")
    return found


def lowered_layouts(blob: PlanBlob | bytes) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """uid -> (dims, strides) of each non-virtual tensor as the backend lowered it (its own
    layout inference filled what the graph left unset: a convolution's output follows its
    input's channels-last layout), from the blob's ``tensors``; empty for a blob that is not
    a frontend plan or has none. A tensor whose entry is not whole numbers is left out."""
    try:
        tensors = PlanBlob.of(blob).fields.get("tensors")
    except (UbjsonError, UnicodeDecodeError, AttributeError):
        return {}
    layouts: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for tensor in tensors if isinstance(tensors, list) else []:
        if not isinstance(tensor, Mapping) or tensor.get("is_virtual") is not False:
            continue
        uid, dims, strides = tensor.get("uid"), tensor.get("dim"), tensor.get("stride")
        numbers = [uid, *(dims or []), *(strides or [])]
        if (isinstance(uid, int) and isinstance(dims, list) and isinstance(strides, list) and len(dims) == len(strides)
                and dims and all(isinstance(n, int) and not isinstance(n, bool) for n in numbers)):  # fmt: skip
            layouts[uid] = (tuple(dims), tuple(strides))
    return layouts


def _log_level() -> int:
    """``CUDNN_FRONTEND_LOG_INFO`` as the frontend reads it (``atoi``: leading digits, else
    0); at 1 to 9 its launches dump the plan's ``tensors_to_dump``."""
    found = re.match(r"\s*([+-]?\d+)", os.environ.get("CUDNN_FRONTEND_LOG_INFO", ""))
    return int(found.group(1)) if found else 0


class Fallback(enum.Enum):
    """Why a blob is left to the frontend's own path (``refusal``): one kind each, counted."""

    UNREADABLE = "not a frontend plan the native path reads"
    FORMAT = "a plan format the native path was not tested on"
    FIELDS = "fields the native path does not know"
    DUMPS = "the frontend's tensor dumps are on (CUDNN_FRONTEND_LOG_INFO)"
    UIDS = "uids the tensor table lacks"
    OFF = "the native path is turned off"
    WORKSPACE = "a workspace larger than the device's memory"
    SLOTS = "a by-value or workspace slot on a uid of the caller's tensors, or past its buffer"
    REPLACEMENT = "a variant-pack replacement that reaches past its source tensor"
    BACKEND_TENSORS = "backend plan tensors that differ from the tensor table"


#: Kinds whose blob would hand cuDNN a pointer outside every tensor and the workspace. The
#: frontend's own path applies the same slots and offsets, so such a blob is refused, never
#: loaded either way.
OUT_OF_BOUNDS = frozenset({Fallback.WORKSPACE, Fallback.SLOTS, Fallback.REPLACEMENT, Fallback.BACKEND_TENSORS})
#: The workspace bound on a device that does not say its memory (the CPU test device):
#: 1 TiB, more than any GPU has.
MEMORY_CEILING = 1 << 40


def workspace_fits(size: int, memory: int | None) -> bool:
    """Whether a workspace of ``size`` bytes could be allocated on a device of ``memory``
    bytes: a larger one is no plan's, and offsets into it could reach anything."""
    return size <= (memory or MEMORY_CEILING)


def _extent(spec: TensorSpec) -> int | None:
    """Bytes from a tensor's pointer to the end of its last element (what a kernel may
    touch), or None where no bound can be given: a negative dim or stride, or a data type of
    unknown size."""
    size, geometry = DTYPE_BYTES.get(spec.dtype or ""), storage_geometry(spec.dtype, tuple(spec.dims), tuple(spec.strides))
    if size is None or geometry is None or len(spec.dims) != len(spec.strides) or min((*spec.dims, *spec.strides), default=0) < 0:
        return None
    return size * span(*geometry)


def _memory_of(spec: TensorSpec) -> tuple[Any, ...]:
    """What fixes the bytes a tensor's pointer reaches: its type, whether it is a host
    scalar, and its (dim, stride) pairs in any order (the frontend lowers an attention's K
    and V transposed: the same memory), size-1 dims left out (their strides move nothing)."""
    return (
        spec.dtype,
        spec.is_pass_by_value,
        sorted((d, s) for d, s in zip(spec.dims, spec.strides) if d != 1),
        len(spec.dims) == len(spec.strides),
    )


def _laid_out_alike(lowered: TensorSpec, spec: TensorSpec) -> bool:
    """The same type, place and layout, written alike (most tensors): ``_memory_of`` agrees."""
    return (lowered.dtype == spec.dtype and lowered.is_pass_by_value == spec.is_pass_by_value
            and tuple(lowered.dims) == tuple(spec.dims) and tuple(lowered.strides) == tuple(spec.strides))  # fmt: skip


def _out_of_bounds(
    record: PlanRecord, tensors: Collection[int] | Mapping[int, TensorSpec] | None, memory: int | None
) -> Fallback | None:
    """Which pointer of ``record``'s launches no tensor or workspace bounds, or None."""
    if not workspace_fits(record.fe_workspace_size, memory):
        return Fallback.WORKSPACE
    users, backend = set(tensors or ()), record.backend_tensors
    buffers = [(uid, 0, len(value.data)) for uid, value in record.by_value.items()]  # (uid, offset, bytes there)
    buffers += [(uid, change.offset, record.fe_workspace_size) for uid, change in record.workspace.items()]
    for uid, offset, end in buffers:
        lowered = backend.get(uid)
        reach = _extent(lowered) if lowered is not None else 0  # a uid cuDNN's plan lacks is read by nothing
        if uid in users or reach is None or offset + reach > end:
            return Fallback.SLOTS
    if not isinstance(tensors, Mapping):  # only the uids of the table are known
        return None
    for source, (destination, offset) in record.replacements.items():
        table, lowered = tensors.get(source), backend.get(destination)
        room = _extent(table) if table is not None and not table.is_pass_by_value else None
        reach = _extent(lowered) if lowered is not None else None
        if room is None or reach is None or offset + reach > room:
            return Fallback.REPLACEMENT
    handed = set(record.variant_pack_uids)  # a table tensor no node uses is in no plan, and handed to no one
    for uid, spec in tensors.items():
        lowered = backend.get(uid)
        if uid not in handed or (lowered is not None and _laid_out_alike(lowered, spec)):
            continue
        if lowered is None or _memory_of(lowered) != _memory_of(spec):
            return Fallback.BACKEND_TENSORS
    return None


def refusal(record: PlanRecord, tensors: Collection[int] | Mapping[int, TensorSpec] | None = None,
            memory: int | None = None) -> Fallback | None:  # fmt: skip
    """Why the native path must not load ``record`` (the frontend's own path does, but for
    ``OUT_OF_BOUNDS``), or None. ``tensors``: the plan's tensor table by uid, when known (or
    only its uids: then layouts go unchecked): a uid the plan reads that is neither one of
    them nor the frontend's own could not be filled at launch, and every pointer a launch
    hands cuDNN must lie inside one of them or the workspace. ``memory``: the device's, in
    bytes, when it says (else ``MEMORY_CEILING``)."""
    why = _out_of_bounds(record, tensors, memory)
    if why is not None:
        return why
    if record.version not in TESTED_VERSIONS:
        return Fallback.FORMAT
    if record.fields - _READ - _DESCRIPTIVE:
        return Fallback.FIELDS
    if record.dumps and 1 <= _log_level() < 10:  # only the frontend's own path writes them
        return Fallback.DUMPS
    if tensors is not None:
        known = set(tensors) | set(record.by_value) | set(record.workspace)
        known |= {target for target, _ in record.replacements.values()}
        if set(record.variant_pack_uids) - known:
            return Fallback.UIDS
    return None


@dataclass(frozen=True)
class Layout:
    """The slots of one plan's variant pack, in the frontend's order."""

    uids: tuple[int, ...]  # every slot's uid
    user: tuple[int, ...]  # the slots the caller's tensors fill, in uid order
    fixed: Mapping[int, int]  # slot -> index into ``by_value`` buffers (host pointers)
    workspace: tuple[tuple[int, int], ...]  # (slot, byte offset into the workspace)
    replacements: tuple[tuple[int, int, int], ...]  # (destination slot, source slot, byte offset)
    aligned: tuple[tuple[int, int], ...]  # (slot, alignment) checked after replacements
    backend: tuple[int, ...]  # the slots handed to cuDNN, in order

    @property
    def user_uids(self) -> tuple[int, ...]:
        return tuple(self.uids[slot] for slot in self.user)

    @classmethod
    def of(cls, record: PlanRecord) -> Layout:
        if not (record.by_value or record.workspace or record.replacements):
            # Most plans (every store hit makes a layout): the caller fills every slot, and
            # every slot goes to cuDNN. The same layout as below, without its searches.
            ordered = tuple(sorted(set(record.variant_pack_uids)))
            every = tuple(range(len(ordered)))
            alignment = record.aligned
            return cls(uids=ordered, user=every, fixed={}, workspace=(), replacements=(), backend=every,
                       aligned=tuple((i, alignment[uid]) for i, uid in enumerate(ordered) if alignment.get(uid, 0) > 1)
                       if alignment else ())  # fmt: skip
        uids = sorted(set(record.variant_pack_uids) | set(record.replacements))
        slot = {uid: i for i, uid in enumerate(uids)}
        fixed: dict[int, int] = {}
        for index, uid in enumerate(record.by_value):
            if uid not in slot:
                slot[uid] = len(uids)
                uids.append(uid)
            fixed[slot[uid]] = index
        for uid in record.workspace:
            if uid not in slot:
                slot[uid] = len(uids)
                uids.append(uid)
        destinations = {target for target, _ in record.replacements.values()}
        user = tuple(
            i for i, uid in enumerate(uids) if i not in fixed and uid not in record.workspace and uid not in destinations
        )
        aligned = tuple(
            (i, record.aligned[uid])
            for i, uid in enumerate(uids)
            if record.aligned.get(uid, 0) > 1 and i not in fixed and uid not in record.workspace
        )
        replacements = tuple(
            (slot[target], slot[source], offset)
            for source, (target, offset) in record.replacements.items()
            if source in slot and target in slot
        )
        reads = set(record.variant_pack_uids)
        backend = tuple(i for i, uid in enumerate(uids) if uid not in record.replacements or uid in reads)
        return cls(
            uids=tuple(uids),
            user=user,
            fixed=fixed,
            workspace=tuple((slot[uid], change.offset) for uid, change in record.workspace.items()),
            replacements=replacements,
            aligned=aligned,
            backend=backend,
        )

    def pointers(self, user: Sequence[int], workspace: int, fixed: Sequence[int]) -> list[int]:
        """Every slot's pointer: ``user`` for the caller's slots (in ``user`` order),
        ``fixed`` the host pointers of the by-value buffers, ``workspace`` the workspace.
        Raises ``ValueError`` for a pointer whose alignment the plan requires but lacks."""
        pointers = [0] * len(self.uids)
        for slot, pointer in zip(self.user, user):
            pointers[slot] = pointer
        for slot, index in self.fixed.items():
            pointers[slot] = fixed[index]
        for slot, offset in self.workspace:
            pointers[slot] = workspace + offset
        for destination, source, offset in self.replacements:
            pointers[destination] = pointers[source] + offset
        for slot, alignment in self.aligned:
            if pointers[slot] % alignment:
                raise ValueError(f"uid {self.uids[slot]}: pointer {pointers[slot]:#x} is not {alignment}-byte aligned")
        return pointers
