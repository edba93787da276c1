"""Plans loaded and launched through cuDNN's own C API, not the frontend's binding.

``record`` takes what a launch needs out of a frontend plan blob (``formats.ubjson`` reads
its bytes) and refuses what this path was not tested on; ``plan`` is a loaded plan and its
launch, through the driver's C library (``cudnn.library`` on a GPU, ctypes with the GIL
released). ``guest.guest_backend`` decides which plans go this way and leaves the others to
the frontend's path.
"""

from .plan import NativePlan
from .record import Fallback, Layout, PlanRecord, RecordError, parse, refusal

__all__ = ["Fallback", "Layout", "NativePlan", "PlanRecord", "RecordError", "parse", "refusal"]
