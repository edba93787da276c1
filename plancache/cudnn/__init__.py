"""The GPU backend: cuDNN Frontend, CUDA and torch under the driver seam (``backend``, the
one module that imports ``cudnn``), cuDNN's C API through ctypes (``library``), CUDA-event
timing (``timing``) and pygraphs rebuilt from stored descriptions (``replay``). Every
import of cuDNN or torch happens inside a call, so importing plancache works without a GPU."""
