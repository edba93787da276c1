"""``PLANCACHE_PATCH_CUDNN`` at ``import plancache``: patch cuDNN Frontend now.

A program that never imports plancache is patched by the interpreter start-up hook
(``_plancache_startup``, outside the package), which calls
``frontend.install_from_environment`` once the program imports ``cudnn``. A program that
imports plancache with the variable on is patched here, at that import.
"""

from __future__ import annotations

import logging

from ..config import PATCH_CUDNN, ConfigError

__all__ = ["patch_cudnn_from_env"]


def patch_cudnn_from_env() -> None:
    """PLANCACHE_PATCH_CUDNN on (1/true/yes/on): existing cuDNN Frontend code (the five-step
    pipeline, build(), execute(), cudnn.jit, cudnn.graph_cache) gets persistent plans
    without a change; only then is cuDNN imported here, and where it cannot be, a notice
    says so and nothing is patched. ``import plancache`` never fails because of the
    variable: a value that is not a switch is one warning line, and nothing is patched."""
    try:
        patch = PATCH_CUDNN.from_env()
    except ConfigError as exc:
        logging.getLogger("plancache").warning("plancache: %s; cuDNN Frontend is not patched", exc)
        return
    if patch:
        from .frontend import install_from_environment

        install_from_environment()
