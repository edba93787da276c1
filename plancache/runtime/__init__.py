"""What a caller runs: ``plan`` (an immutable loaded plan, the checks that guard its launch,
the launch on its own device) and ``capturing`` (a step of plans replayed as one CUDA
graph). Neither imports torch or cuDNN: the backend behind a plan does."""

from .capturing import CapturedStep, capture
from .plan import Plan

__all__ = ["CapturedStep", "Plan", "capture"]
