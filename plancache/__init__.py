"""plancache: a persistent, autotuning plan cache for cuDNN Frontend graphs.

    import plancache
    cache = plancache.PlanCache()          # $PLANCACHE_DIR or the user cache directory
    plan = cache.get(graph)                # hit: deserialize; miss: autotune and store
    plan.execute({uid: tensor, ...})

Importing plancache touches no GPU and imports neither torch nor cuDNN.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from .errors import (
    BuildError,
    BundleError,
    CacheDirError,
    CaptureInProgressError,
    EntryNotFoundError,
    ExecutionError,
    InvalidGraphError,
    LockTimeoutError,
    ManifestError,
    NoGpuError,
    PlanCacheError,
    PlanCacheNotice,
    RemoteError,
    SchemaTooNewError,
    StoreBusyError,
    StoreError,
    TensorMismatchError,
    TransientLoadError,
)

# The rest loads on first use (PEP 562): ``import plancache`` stays a few milliseconds,
# and a process pays for the cache's modules only when it uses them.
_LAZY = {
    "TimingPolicy": "engines.autotune",
    "Backend": "engines.backend", "BuiltPlan": "engines.backend", "CandidateSet": "engines.backend", "EngineChoice": "engines.backend",
    "PlanCache": "cache",
    "BuildOptions": "key", "CacheKey": "key", "TensorSpec": "key", "describe": "key", "make_key": "key",
    "Plan": "plan",
    "capture": "capturing", "CapturedStep": "capturing",
    "Store": "store", "default_cache_dir": "store",
    "jit": "frontend", "graph_cache": "frontend", "install": "frontend", "uninstall": "frontend", "plan_of": "frontend",
}  # fmt: skip
_SUBMODULES = {"engines": "engines", "cache": "cache", "cli": "cli", "config": "config", "errors": "errors", "flight": "flight",
               "frontend": "frontend", "frontend_adopt": "frontend_adopt", "frontend_pipeline": "frontend_pipeline", "key": "key", "plan": "plan", "recording": "recording", "store": "store", "testing": "testing",
               "tiers": "tiers", "workflows": "workflows", "remote": "tiers.remote", "bundle": "workflows.bundle",
               "buckets": "workflows.buckets", "capturing": "capturing", "priming": "priming", "manifest": "workflows.manifest", "prewarm": "workflows.prewarm",
               "report": "workflows.report", "templates": "workflows.templates"}  # fmt: skip

if TYPE_CHECKING:
    from .cache import PlanCache
    from .capturing import CapturedStep, capture
    from .engines.autotune import TimingPolicy
    from .engines.backend import Backend, BuiltPlan, CandidateSet, EngineChoice
    from .frontend import graph_cache, install, jit, plan_of, uninstall
    from .key import BuildOptions, CacheKey, TensorSpec, describe, make_key
    from .plan import Plan
    from .store import Store, default_cache_dir


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{_SUBMODULES[name]}", __name__)
    raise AttributeError(f"module 'plancache' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


__version__ = "0.1.0"


def _patch_cudnn_from_env() -> None:
    """PLANCACHE_PATCH_CUDNN on (1/true/yes/on): existing cuDNN Frontend code (the five-step
    pipeline, build(), execute(), cudnn.jit, cudnn.graph_cache) gets persistent plans
    without a change; only then is cuDNN imported here, and where it cannot be, a notice
    says so and nothing is patched. ``import plancache`` never fails because of the
    variable: a value that is not a switch is one warning line, and nothing is patched."""
    from .config import ConfigError, flag_from_env

    try:
        patch = flag_from_env("PLANCACHE_PATCH_CUDNN", False)
    except ConfigError as exc:
        logging.getLogger("plancache").warning("plancache: %s; cuDNN Frontend is not patched", exc)
        return
    if patch:
        importlib.import_module(".frontend", __name__).install_from_environment()


_patch_cudnn_from_env()

__all__ = [
    "Backend",
    "BuildError",
    "BuildOptions",
    "BuiltPlan",
    "BundleError",
    "CacheDirError",
    "CacheKey",
    "CandidateSet",
    "CaptureInProgressError",
    "CapturedStep",
    "EngineChoice",
    "EntryNotFoundError",
    "ExecutionError",
    "InvalidGraphError",
    "LockTimeoutError",
    "ManifestError",
    "NoGpuError",
    "Plan",
    "PlanCache",
    "PlanCacheError",
    "PlanCacheNotice",
    "RemoteError",
    "SchemaTooNewError",
    "Store",
    "StoreBusyError",
    "StoreError",
    "TensorMismatchError",
    "TensorSpec",
    "TimingPolicy",
    "TransientLoadError",
    "__version__",
    "capture",
    "default_cache_dir",
    "describe",
    "graph_cache",
    "install",
    "jit",
    "make_key",
    "plan_of",
    "uninstall",
]
