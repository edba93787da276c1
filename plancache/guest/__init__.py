"""The seam and the guest: what the cache asks of a backend (``backend``), what a backend
needs of a machine (``driver``), and what runs over that driver unchanged on a GPU and on
the CPU test device (``guest_backend``: the guest block, handles, load routing, launches;
``native``: plans loaded and launched through cuDNN's C API). No cuDNN, torch or CUDA
import here."""
