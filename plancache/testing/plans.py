"""The blob of a CPU test plan: what ``CpuTestBackend`` stores, and reads back as cuDNN
reads a serialized plan (refusing a damaged one, and the plan of a candidate it was told
cannot be loaded back)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ..engines.backend import EngineChoice
from ..key import TensorSpec, canonical_json

__all__ = ["MAGIC", "decode", "encode", "note_build", "refusal"]

MAGIC = b"PLANCACHE-TEST-PLAN/1\n"


def encode(description: Mapping[str, Any], tensors: Sequence[TensorSpec], engine: EngineChoice, *,
           behaviour: Mapping[str, Any] | None, unloadable: bool) -> bytes:  # fmt: skip
    """The blob: the graph's description, its tensor table and the engine, as JSON, and how
    the engine computes (``kernels.Behaviour``) when it is not the reference's way."""
    payload: dict[str, Any] = {"description": description, "tensors": [t.to_dict() for t in tensors], "engine": engine.to_dict()}
    if behaviour is not None:
        payload["behaviour"] = dict(behaviour)  # a stored engine computes as it did, as a cuDNN plan would
    if unloadable:
        payload["unloadable"] = True  # as a plan the library writes and cannot deserialize
    return MAGIC + json.dumps(payload, sort_keys=True).encode()


def decode(blob: bytes) -> dict[str, Any]:
    """What ``encode`` wrote; ``ValueError`` for a blob that is not a test plan, or is the
    plan of an ``unloadable=`` candidate."""
    if not blob.startswith(MAGIC):
        raise ValueError("not a plancache test plan (bad magic)")
    payload: dict[str, Any] = json.loads(blob[len(MAGIC) :])
    if payload.get("unloadable"):
        raise ValueError("the test plan of an unloadable= candidate")
    return payload


def refusal(blob: bytes) -> str | None:
    """Why ``decode`` refuses ``blob`` (None: it reads it)."""
    try:
        decode(blob)
    except ValueError as exc:
        return f"ValueError: {exc}"
    return None


def note_build(path: str | None, description: Mapping[str, Any]) -> None:
    """One line per finished build in ``path`` (the concurrency tests count builds across
    processes): the graph's hash and the process id."""
    if path is not None:
        line = hashlib.sha256(canonical_json(description).encode()).hexdigest() + f" {os.getpid()}\n"
        with open(path, "a") as f:  # one short append: atomic on POSIX
            f.write(line)
