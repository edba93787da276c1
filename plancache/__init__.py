"""plancache: a persistent, autotuning plan cache for cuDNN Frontend graphs.

    import plancache
    cache = plancache.PlanCache()          # $PLANCACHE_DIR or the user cache directory
    plan = cache.get(graph)                # hit: deserialize; miss: autotune and store
    plan.execute({uid: tensor, ...})

Importing plancache touches no GPU and imports neither torch nor cuDNN.
"""

from __future__ import annotations

from .autotune import TimingPolicy
from .backend import Backend, BuiltPlan, CandidateSet, EngineChoice
from .cache import PlanCache
from .errors import (
    BuildError,
    BundleError,
    CacheDirError,
    EntryNotFoundError,
    InvalidGraphError,
    LockTimeoutError,
    ManifestError,
    NoGpuError,
    PlanCacheError,
    RemoteError,
    SchemaTooNewError,
    StoreBusyError,
    StoreError,
    TensorMismatchError,
)
from .key import BuildOptions, CacheKey, TensorSpec, describe, make_key
from .plan import Plan
from .store import Store, default_cache_dir

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BuildError",
    "BuildOptions",
    "BuiltPlan",
    "BundleError",
    "CacheDirError",
    "CacheKey",
    "CandidateSet",
    "EngineChoice",
    "EntryNotFoundError",
    "InvalidGraphError",
    "LockTimeoutError",
    "ManifestError",
    "NoGpuError",
    "Plan",
    "PlanCache",
    "PlanCacheError",
    "RemoteError",
    "SchemaTooNewError",
    "Store",
    "StoreBusyError",
    "StoreError",
    "TensorMismatchError",
    "TensorSpec",
    "TimingPolicy",
    "__version__",
    "default_cache_dir",
    "describe",
    "make_key",
]
