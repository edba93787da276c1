"""plancache: a persistent, autotuning plan cache for cuDNN Frontend graphs.

    import plancache
    cache = plancache.PlanCache()          # $PLANCACHE_DIR or the user cache directory
    plan = cache.get(graph)                # hit: deserialize; miss: autotune and store
    plan.execute({uid: tensor, ...})

Importing plancache touches no GPU and imports neither torch nor cuDNN.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import lazy_getattr as _lazy_getattr
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
    UnkeyableArgumentError,
)
from .integrations.startup import patch_cudnn_from_env as _patch_cudnn_from_env

# The rest loads on first use (PEP 562): ``import plancache`` stays a few milliseconds,
# and a process pays for the cache's modules only when it uses them.
_LAZY = {
    "TimingPolicy": "autotuning.autotune", "ConfigError": "config", "MemoryBudget": "config", "RemoteTier": "tiers.remote",
    "Backend": "guest.backend", "BuiltPlan": "guest.backend", "CandidateSet": "autotuning.candidates", "EngineChoice": "guest.backend",
    "PlanCache": "cache.cache",
    "BuildOptions": "key", "CacheKey": "key", "Policy": "key", "TensorSpec": "key", "describe": "key", "make_key": "key",
    "Plan": "runtime.plan",
    "capture": "runtime.capturing", "CapturedStep": "runtime.capturing",
    "Store": "store", "default_cache_dir": "store",
    "jit": "integrations.frontend", "graph_cache": "integrations.frontend", "install": "integrations.frontend",
    "uninstall": "integrations.frontend", "plan_of": "integrations.frontend",
}  # fmt: skip
#: The package's own folders and root modules, loaded on first use as attributes
#: (``plancache.testing``, ``plancache.workflows``) like the names above.
_SUBMODULES = frozenset({"autotuning", "cache", "cli", "config", "cudnn", "errors", "guest", "integrations", "key", "runtime", "store", "testing",
                         "tiers", "workflows"})  # fmt: skip

if TYPE_CHECKING:
    from .autotuning.autotune import TimingPolicy
    from .autotuning.candidates import CandidateSet
    from .cache.cache import PlanCache
    from .config import ConfigError, MemoryBudget
    from .guest.backend import Backend, BuiltPlan, EngineChoice
    from .integrations.frontend import graph_cache, install, jit, plan_of, uninstall
    from .key import BuildOptions, CacheKey, Policy, TensorSpec, describe, make_key
    from .runtime.capturing import CapturedStep, capture
    from .runtime.plan import Plan
    from .store import Store, default_cache_dir
    from .tiers.remote import RemoteTier


if not TYPE_CHECKING:  # to a type checker, a name missing from the imports above is an error
    __getattr__ = _lazy_getattr(__name__, _LAZY, _SUBMODULES)


def __dir__() -> list[str]:
    # The public names and folders only: not this module's own imports (TYPE_CHECKING...).
    return sorted(set(__all__) | _SUBMODULES)


__version__ = "0.1.0"

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
    "ConfigError",
    "EngineChoice",
    "EntryNotFoundError",
    "ExecutionError",
    "InvalidGraphError",
    "LockTimeoutError",
    "ManifestError",
    "MemoryBudget",
    "NoGpuError",
    "Plan",
    "PlanCache",
    "PlanCacheError",
    "PlanCacheNotice",
    "Policy",
    "RemoteError",
    "RemoteTier",
    "SchemaTooNewError",
    "Store",
    "StoreBusyError",
    "StoreError",
    "TensorMismatchError",
    "TensorSpec",
    "TimingPolicy",
    "TransientLoadError",
    "UnkeyableArgumentError",
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
