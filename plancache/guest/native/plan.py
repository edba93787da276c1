"""A plan loaded and launched through cuDNN's C API.

``NativePlan.load`` finalizes the backend plan from its JSON representation (host work
and cuDNN's finalize, the GIL released; nothing captured, allocated or synchronized: the
kernels load at the first launch). ``launch`` does per launch what the frontend's execute
does (``record``: the workspace modifications, the variant pack, the backend execute), with
the variant pack of each set of pointers made once and kept, a few per plan and thread:
a thread's packs are its own, so a launch takes no lock and no other thread's eviction
can destroy the pack it is using.

Lifetimes: a plan owns its backend descriptor, its variant packs and the host buffers
the backend reads (by-value scalars, the floats copied into the workspace). A CUDA graph
captured from a launch keeps pointing at all of them, and cuDNN releases a
runtime-compiled plan's code with the plan, so a plan launched on a capturing stream is
kept for the rest of the process (the launcher pins it, ``guest.guest_backend``); any
other is destroyed, exactly once, when its last reference goes.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence

from ...store.per_process import forks
from ..driver import CLibrary
from .record import Layout, PlanRecord

__all__ = ["PACKS_PER_PLAN", "NativePlan"]

#: Variant packs kept per plan and thread (one per set of pointers a program launches with; a
#: training step or a server's fixed buffers repeat a few).
PACKS_PER_PLAN = 8


class _Owned:
    """What a plan's finalizer destroys: the plan descriptor and every thread's variant packs."""

    def __init__(self, library: CLibrary, plan: int) -> None:
        self.library = library
        self.plan = plan
        self.packs: list[tuple[weakref.ref[threading.Thread], OrderedDict[tuple[int, ...], int]]] = []
        self._lock = threading.Lock()
        self._forks = forks()

    def thread_packs(self) -> OrderedDict[tuple[int, ...], int]:
        """A new set of packs for the calling thread; the packs of threads that ended are
        destroyed (no launch of theirs can be using them)."""
        mine: OrderedDict[tuple[int, ...], int] = OrderedDict()
        with self._lock:
            ended = [packs for thread, packs in self.packs if (t := thread()) is None or not t.is_alive()]
            self.packs = [(thread, packs) for thread, packs in self.packs if all(packs is not e for e in ended)]
            self.packs.append((weakref.ref(threading.current_thread()), mine))
        for packs in ended:
            for pack in packs.values():
                self.library.destroy(pack)
        return mine

    def destroy(self) -> None:
        if self._forks != forks():
            # A forked child's copy of its parent's plan (its per-process plans made anew):
            # the descriptors are the parent's, in the parent's CUDA context; a child calls
            # no cuDNN on them, and the memory goes with the child.
            return
        for _, packs in self.packs:
            for pack in packs.values():
                self.library.destroy(pack)
        self.packs.clear()
        self.library.destroy(self.plan)


class NativePlan:
    """A frontend plan blob loaded through cuDNN's C API, launched by uid."""

    def __init__(self, library: CLibrary, record: PlanRecord, handle: int, device: int) -> None:
        self.library = library
        self.record = record
        self.device = device
        self.layout = Layout.of(record)
        self.user_uids = self.layout.user_uids
        plan = library.load_plan(handle, record.representation)
        self._owned = _Owned(library, plan)
        finalizer = weakref.finalize(self, self._owned.destroy)
        finalizer.atexit = False  # at exit CUDA may be gone: the process frees everything
        self.plan = plan
        #: Bytes of workspace a launch needs: the frontend's part, then the backend's.
        self.workspace_size = record.fe_workspace_size + library.plan_workspace(plan)
        self._by_value = [ctypes.create_string_buffer(v.data, len(v.data)) for v in record.by_value.values()]
        self._fixed = [ctypes.addressof(b) for b in self._by_value]
        changes = record.workspace.values()  # most plans have none: no comprehension runs
        self._copies = [
            (change.offset, (ctypes.c_uint32 * len(change.words))(*change.words))  # the bits, as the frontend copies them
            for change in changes
            if change.operation == 0
        ] if changes else []  # fmt: skip
        self._zeros = [(change.offset, change.zero_bytes) for change in changes if change.operation == 1] if changes else []
        backend = self.layout.backend
        self._uids = (ctypes.c_int64 * len(backend))(*map(self.layout.uids.__getitem__, backend))
        self._count = len(backend)
        self._local = threading.local()  # .packs: this thread's variant packs (the same dict as in _Owned)

    def __repr__(self) -> str:
        return f"<NativePlan device {self.device} uids {list(self.user_uids)} workspace {self.workspace_size}>"

    def _pack(self, user: Sequence[int], workspace: int) -> int:
        """This thread's variant pack of these pointers (made once, the least recently used
        of more than ``PACKS_PER_PLAN`` destroyed: no other thread ever uses it)."""
        key = (*user, workspace)
        packs = getattr(self._local, "packs", None)
        if packs is None:
            packs = self._local.packs = self._owned.thread_packs()
        pack = packs.get(key)
        if pack is not None:
            packs.move_to_end(key)
            return pack
        pointers = self.layout.pointers(user, workspace, self._fixed)
        array = (ctypes.c_void_p * self._count)(*(pointers[slot] or None for slot in self.layout.backend))
        engine_workspace = workspace + self.record.fe_workspace_size if workspace else 0  # the backend's part
        pack = packs[key] = self.library.variant_pack(self._uids, array, self._count, engine_workspace)
        if len(packs) > PACKS_PER_PLAN:
            _, oldest = packs.popitem(last=False)
            self.library.destroy(oldest)
        return pack

    def launch(self, user: Sequence[int], workspace: int, handle: int, stream: int) -> None:
        """Run the plan on ``stream`` with ``handle`` (already set to that stream):
        ``user`` the caller's data pointers in ``user_uids`` order, ``workspace`` a device
        buffer of at least ``workspace_size`` bytes (0 when none is needed)."""
        library = self.library
        for offset, floats in self._copies:
            library.copy_to_device(workspace + offset, floats, ctypes.sizeof(floats), stream)
        for offset, size in self._zeros:
            library.zero(workspace + offset, size, stream)
        library.execute(handle, self.plan, self._pack(user, workspace))
