"""plancache: a persistent, autotuning plan cache for cuDNN Frontend graphs.

    import plancache
    cache = plancache.PlanCache()          # $PLANCACHE_DIR or the user cache directory
    plan = cache.get(graph)                # hit: deserialize; miss: autotune and store
    plan.execute({uid: tensor, ...})

Importing plancache touches no GPU and imports neither torch nor cuDNN.
"""

from __future__ import annotations

import importlib
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

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
from .integrations.startup import patch_cudnn_from_env as _patch_cudnn_from_env

# The rest loads on first use (PEP 562): ``import plancache`` stays a few milliseconds,
# and a process pays for the cache's modules only when it uses them.
_LAZY = {
    "TimingPolicy": "engines.autotune",
    "Backend": "engines.backend", "BuiltPlan": "engines.backend", "CandidateSet": "engines.backend", "EngineChoice": "engines.backend",
    "PlanCache": "cache.cache",
    "BuildOptions": "key", "CacheKey": "key", "TensorSpec": "key", "describe": "key", "make_key": "key",
    "Plan": "runtime.plan",
    "capture": "runtime.capturing", "CapturedStep": "runtime.capturing",
    "Store": "store", "default_cache_dir": "store",
    "jit": "integrations.frontend", "graph_cache": "integrations.frontend", "install": "integrations.frontend",
    "uninstall": "integrations.frontend", "plan_of": "integrations.frontend",
}  # fmt: skip
# ``plancache.NAME`` for a module: the layers, short names of a few modules, and the paths
# that modules had before the layers had folders of their own. Those old paths import too
# (``import plancache.frontend``, ``from plancache.recording import record_to``): they give
# the module where it lives now, one module object under both names (``_MovedModules``).
_SUBMODULES = {
    "cache": "cache", "cli": "cli", "config": "config", "engines": "engines", "errors": "errors",
    "integrations": "integrations", "key": "key", "runtime": "runtime", "store": "store", "testing": "testing",
    "tiers": "tiers", "workflows": "workflows",
    "builder": "cache.builder", "flight": "cache.flight", "loads": "cache.loads", "lookup": "cache.lookup",
    "priming": "cache.priming", "recording": "cache.recording",
    "capturing": "runtime.capturing", "plan": "runtime.plan",
    "frontend": "integrations.frontend", "frontend_adopt": "integrations.frontend_adopt",
    "frontend_pipeline": "integrations.frontend_pipeline",
    "remote": "tiers.remote", "buckets": "workflows.buckets", "bundle": "workflows.bundle",
    "manifest": "workflows.manifest", "prewarm": "workflows.prewarm", "report": "workflows.report",
    "templates": "workflows.templates",
}  # fmt: skip

if TYPE_CHECKING:
    from importlib.abc import Loader

    from .cache.cache import PlanCache
    from .engines.autotune import TimingPolicy
    from .engines.backend import Backend, BuiltPlan, CandidateSet, EngineChoice
    from .integrations.frontend import graph_cache, install, jit, plan_of, uninstall
    from .key import BuildOptions, CacheKey, TensorSpec, describe, make_key
    from .runtime.capturing import CapturedStep, capture
    from .runtime.plan import Plan
    from .store import Store, default_cache_dir


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)  # a moved module through _MovedModules
    raise AttributeError(f"module 'plancache' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


class _MovedModules:
    """Finds ``plancache.NAME`` where ``_SUBMODULES`` maps NAME elsewhere, before any other
    finder can find a stale file of that name; it declines every other module at once."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != __name__ or _SUBMODULES.get(name, name) == name:
            return None
        return ModuleSpec(fullname, cast("Loader", _Alias(f"{__name__}.{_SUBMODULES[name]}")))


class _Alias:
    """Loads a moved module: the import system then takes whatever the loader left in
    ``sys.modules`` under the old name, here the module itself, imported under its own name
    (its ``__spec__`` untouched)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: ModuleSpec) -> None:
        return None  # a placeholder module, replaced in exec_module

    def exec_module(self, module: ModuleType) -> None:
        sys.modules[module.__name__] = importlib.import_module(self.target)


if not any(type(finder).__name__ == "_MovedModules" for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())

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
