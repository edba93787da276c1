"""A CPU backend for tests: the whole cache (hits, misses, store, locking, CLI) without a GPU.

``CpuTestBackend`` takes real ``cudnn.pygraph`` objects, which build without a GPU, and
implements the backend seam with PyTorch on the CPU:

* candidates: a fixed number per graph, launched for real on the same inputs (and
  compared, as on a GPU), with simulated, deterministic timings (a function of the key and
  the index), so autotuning picks the same winner every time;
* a plan blob: the graph's canonical description and the chosen engine, as JSON behind a
  magic header, so a damaged blob is refused by ``load`` just as cuDNN refuses one;
* execution: a reference implementation of convolution, matmul, pointwise ops and SDPA,
  so users can test code that runs plans on CPU-only CI.

Options make it slow (``build_delay``), log every build to a file (``build_log``, which
the concurrency tests use to count builds across processes), give it engines that compute
wrong results (``wrong``), little memory (``memory``), or several devices (``devices``).
Its ``cuda`` (a ``SimulatedCuda``) models streams, captures, sticky errors and memory.

Use it with ``PlanCache(backend=CpuTestBackend())``.
"""

from .backend import CpuTestBackend, TwoDeviceCpuTestBackend, summary_of_ops
from .device import LEGACY, Capture, CudaError, SimulatedCuda
from .plans import MAGIC

__all__ = ["LEGACY", "MAGIC", "Capture", "CpuTestBackend", "CudaError", "SimulatedCuda", "TwoDeviceCpuTestBackend",
           "summary_of_ops"]  # fmt: skip
