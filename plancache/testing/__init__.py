"""A CPU backend for tests: the whole cache (hits, misses, store, locking, CLI) without a GPU.

``CpuTestBackend`` takes real ``cudnn.pygraph`` objects, which build without a GPU, and
implements the backend seam with PyTorch on the CPU: candidates launched for real and
compared as on a GPU, with simulated, deterministic timings (a function of the key and the
index, so autotuning picks the same winner every time); plan blobs in cuDNN Frontend's
format, loaded through the code a GPU runs (``guest.guest_backend``) over a simulated
driver and C API that read tensors by pointer; and a reference implementation of
convolution, matmul, pointwise ops and SDPA, so users can test code that runs plans on
CPU-only CI. Its class docstring lists where it behaves like cuDNN and the options that
steer it.

Use it with ``PlanCache(backend=CpuTestBackend())``.
"""

from .backend import CpuTestBackend, TwoDeviceCpuTestBackend, summary_of_ops
from .device import LEGACY, Capture, CudaError, SimulatedCuda

__all__ = ["LEGACY", "Capture", "CpuTestBackend", "CudaError", "SimulatedCuda", "TwoDeviceCpuTestBackend", "summary_of_ops"]
