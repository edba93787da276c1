"""The blob of a CPU test plan: a cuDNN Frontend plan blob, as the frontend writes one.

It is UBJSON with the fields a real blob has (``json_version``, ``cudnn_backend_data``,
``variant_pack_uids``, ``fe_workspace_size``...), so loading it goes through the same
parsing, gate and variant-pack layout as a GPU's (``guest.native``). What the simulated
library finalizes, ``cudnn_backend_data``, is JSON of the graph's description, its tensor
table and the engine (and how that engine computes, ``kernels.Behaviour``, when it is not
the reference's way). Its graph (``context``, ``tensors`` and ``nodes`` at the top level) is
the description's frontend form (``key.frontend_form``): the ops with their attributes and
ports, the tensors laid out as the frontend lays them out (a 1-D ragged offset of attention
written ``[n, 1, 1, 1]``, K transposed), attention's own by-value scale, so the store's
judge (``store.judge``) reads a CPU blob as it reads a GPU's. A damaged blob is refused, as
cuDNN refuses one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ..formats.plan_blob import PlanBlob
from ..formats.ubjson import encode as encode_ubjson
from ..guest.backend import EngineChoice
from ..key import TensorSpec, canonical_json, used_tensors
from ..key.frontend_form import frontend_form, frontend_graph

__all__ = ["FORMAT", "decode", "encode", "note_build", "payload", "payload_of"]

#: The plan format the test backend writes: one the native path was tested on.
FORMAT = "2.0"


def payload(description: Mapping[str, Any], tensors: Sequence[TensorSpec], engine: EngineChoice, *,
            behaviour: Mapping[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    """What a plan computes: the graph, its tensor table, the engine, and how that engine
    computes (``kernels.Behaviour``) when it is not the reference's way."""
    found: dict[str, Any] = {"description": description, "tensors": [t.to_dict() for t in tensors], "engine": engine.to_dict()}
    if behaviour is not None:
        found["behaviour"] = dict(behaviour)  # a stored engine computes as it did, as a cuDNN plan would
    return found


def encode(description: Mapping[str, Any], tensors: Sequence[TensorSpec], engine: EngineChoice, *,
           behaviour: Mapping[str, Any] | None, unloadable: bool, workspace: int) -> bytes:  # fmt: skip
    """The blob: a frontend plan over the table's tensors that the graph's nodes use (a tensor
    no node uses is in the key's description and the table, never in a plan). Its backend
    plan adds to the ``payload`` ``workspace``, the plan's own in bytes, as a finalized cuDNN
    plan reports it, and those tensors as cuDNN's JSON lists them (``operationGraph``), which
    the native gate holds against the table as it does a real plan's. Its graph takes the
    table's shapes where the description leaves them to planning (inferred outputs)."""
    used = used_tensors(description)
    lowered = [spec for spec in tensors if f"u{spec.uid}" in used]
    backend_tensors = [{"name": str(spec.uid), "dataType": spec.dtype and "CUDNN_DATA_" + spec.dtype.removeprefix("data_type."),
                        "dim": list(spec.dims), "stride": list(spec.strides), "isVirtual": False,
                        "isByValue": spec.is_pass_by_value} for spec in lowered]  # fmt: skip
    backend = {**payload(description, tensors, engine, behaviour=behaviour), "workspace": int(workspace),
               "operationGraph": {"tensors": backend_tensors}}  # fmt: skip
    if unloadable:
        backend["unloadable"] = True  # as a plan the library writes and cannot finalize
    shapes = {f"u{spec.uid}": (list(spec.dims), list(spec.strides)) for spec in tensors}
    names = {f"u{spec.uid}": spec.name for spec in tensors}
    return encode_ubjson({
        "json_version": FORMAT,
        "cudnn_backend_data": json.dumps(backend, sort_keys=True),
        "variant_pack_uids": sorted(spec.uid for spec in lowered),
        **frontend_graph(frontend_form(description), names, shapes),
        "pass_by_values": {},
        "workspace_modifications": {},
        "variant_pack_replacements": [],
        "fe_workspace_size": 0,
        "aligned_operands": {},
        "tensors_to_dump": [],
        "behavior_notes": [[]],
    })  # fmt: skip


def payload_of(text: bytes | str) -> dict[str, Any]:
    """The payload of a backend plan's representation; ``ValueError`` for one that is not a
    test plan, or is the plan of an ``unloadable=`` candidate."""
    try:
        payload = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"not a plancache test plan ({exc})") from exc
    if not isinstance(payload, dict) or not {"description", "tensors", "engine"} <= set(payload):
        raise ValueError("not a plancache test plan (fields missing)")
    if payload.get("unloadable"):
        raise ValueError("the test plan of an unloadable= candidate")
    return payload


def decode(blob: PlanBlob | bytes) -> dict[str, Any]:
    """The payload of a whole blob (``payload_of`` its ``cudnn_backend_data``), read as the
    native path reads a frontend plan: from the blob's one decoding (``PlanBlob.fields``),
    which the store's judge read too."""
    try:
        fields = PlanBlob.of(blob).fields
        text = fields.get("cudnn_backend_data") if isinstance(fields, dict) else None
    except ValueError as exc:
        raise ValueError(f"not a plancache test plan ({exc})") from exc
    if not isinstance(text, str):
        raise ValueError("not a plancache test plan (no backend plan)")
    return payload_of(text)


def note_build(path: str | None, description: Mapping[str, Any]) -> None:
    """One line per finished build in ``path`` (the concurrency tests count builds across
    processes): the graph's hash and the process id."""
    if path is not None:
        line = hashlib.sha256(canonical_json(description).encode()).hexdigest() + f" {os.getpid()}\n"
        with open(path, "a") as f:  # one short append: atomic on POSIX
            f.write(line)
