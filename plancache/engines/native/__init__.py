"""Plans loaded and launched through cuDNN's own C API, not the frontend's binding.

``ubjson`` reads the frontend's plan blobs, ``record`` takes what a launch needs out of
one (and refuses what this path was not tested on), ``library`` owns the C libraries
(ctypes; the GIL is released through every call), ``plan`` is a loaded plan and its
launch. ``engines.cudnn_backend`` decides which plans go this way and falls back to the
frontend's path for the others.
"""

from .library import Library, NativeError, library
from .plan import NativePlan, captured_plans
from .record import Layout, PlanRecord, RecordError, parse, refusal

__all__ = ["Layout", "Library", "NativeError", "NativePlan", "PlanRecord", "RecordError", "captured_plans", "library", "parse",
           "refusal"]  # fmt: skip
