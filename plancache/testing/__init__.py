"""A CPU backend for tests: the whole cache (hits, misses, store, locking, CLI) without a GPU.

``CpuTestBackend`` takes real ``cudnn.pygraph`` objects, which build without a GPU, and
implements the backend seam with PyTorch on the CPU:

* candidates: a fixed number per graph, launched for real on the same inputs (and
  compared, as on a GPU), with simulated, deterministic timings (a function of the key and
  the index), so autotuning picks the same winner every time;
* a plan blob: a cuDNN Frontend plan blob (UBJSON) whose backend plan is the graph's
  canonical description and the chosen engine, loaded through the same code a GPU runs
  (``guest.guest_backend``) over a simulated driver and C API (``testing.driver``,
  ``testing.library``) that read tensors by pointer;
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

__all__ = ["LEGACY", "Capture", "CpuTestBackend", "CudaError", "SimulatedCuda", "TwoDeviceCpuTestBackend", "summary_of_ops"]
