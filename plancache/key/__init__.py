"""What determines a plan, and the key that names it: ``description`` (everything the
pygraph hands to cuDNN, names dropped; ``lowering`` reads the frontend's own op tables for
it) and ``key`` (build options, environment, the hash)."""

from .description import (
    GRAPH_KWARGS_DENIED,
    NODE_ATTRS_DENIED,
    NODE_ATTRS_KEYED,
    TENSOR_FIELDS_DENIED,
    TENSOR_FIELDS_KEYED,
    describe,
    mark_shared_kernel_cache,
    tensor_table,
    used_tensors,
)
from .key import (
    HEURISTIC_MODES,
    JSON,
    KEY_FORMAT,
    POLICIES,
    BuildOptions,
    CacheKey,
    Policy,
    TensorSpec,
    canonical_json,
    environment_id,
    make_key,
    options_json,
)

__all__ = [
    "GRAPH_KWARGS_DENIED",
    "HEURISTIC_MODES",
    "JSON",
    "KEY_FORMAT",
    "NODE_ATTRS_DENIED",
    "NODE_ATTRS_KEYED",
    "POLICIES",
    "TENSOR_FIELDS_DENIED",
    "TENSOR_FIELDS_KEYED",
    "BuildOptions",
    "CacheKey",
    "Policy",
    "TensorSpec",
    "canonical_json",
    "describe",
    "environment_id",
    "make_key",
    "mark_shared_kernel_cache",
    "options_json",
    "tensor_table",
    "used_tensors",
]
