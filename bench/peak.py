"""The true in-step peak of live tensor bytes in this process, op by op.

How: a TorchDispatchMode sees every tensor each aten op returns, including the ops autograd
runs in backward and the allocations DeepSpeed makes (flat buffers, all-gathers, reduce
buckets): each new storage is counted with its bytes and gets a weakref whose callback takes
the bytes off when torch frees it (storages keep their Python object while C++ holds them,
so the callback fires when the last C++ reference goes, e.g. a saved activation released in
backward). What already lived when the mode was entered (parameters, optimizer states, pinned
swap buffers) is found by one gc walk and tracked the same way. The peak is the largest total
after any op. This is the method of torch.distributed._tools.mem_tracker (private API, built
for FSDP), reduced to what the bench needs.

Not seen: temporaries an op allocates and frees inside its own kernel (one op's workspace,
e.g. gloo's), and memory not owned by a tensor (allocator slack, Python objects): RSS covers
those, and the bench reports it beside.
"""

from __future__ import annotations

import gc
import heapq
import warnings
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def storage_of(obj: object) -> torch.UntypedStorage | None:
    try:
        return obj.untyped_storage() if isinstance(obj, torch.Tensor) else None
    except Exception:  # noqa: BLE001 - half-built or exotic objects
        return None


class PeakTracker(TorchDispatchMode):
    """`with PeakTracker() as p: ...` then p.peak (bytes), p.peak_phase, p.peak_op, p.live."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}  # StorageImpl address -> bytes counted
        self.refs: dict[int, weakref.ref] = {}
        self.live = 0
        self.start = 0  # live bytes when entered
        self.peak = 0
        self.phase = ""  # set by the caller: forward / backward / step
        self.peak_phase = ""
        self.op = self.peak_op = ""  # the op whose outputs made the peak
        self.peak_largest: list[int] = []  # the largest storages live at the peak (bytes)

    def _freed(self, key: int, _ref: Any) -> None:
        self.live -= self.sizes.pop(key, 0)
        self.refs.pop(key, None)

    def track(self, storage: torch.UntypedStorage) -> None:
        if storage.device.type == "meta":
            return
        key = storage._cdata
        size = storage.nbytes()
        old = self.sizes.get(key)
        if old is None:
            self.refs[key] = weakref.ref(storage, lambda r, k=key: self._freed(k, r))
            old = 0
        if size != old:  # new, or resized in place
            self.sizes[key] = size
            self.live += size - old
            self._note()

    def _note(self) -> None:
        if self.live > self.peak:
            self.peak, self.peak_phase, self.peak_op = self.live, self.phase, self.op
            self.peak_largest = heapq.nlargest(12, self.sizes.values())

    def __enter__(self) -> PeakTracker:
        gc.collect()
        seen: set[int] = set()  # data pointers: two storages over one buffer count once
        with warnings.catch_warnings():  # isinstance on deprecated torch modules warns
            warnings.simplefilter("ignore")
            storages = [s for s in map(storage_of, gc.get_objects()) if s is not None]
        for storage in storages:
            try:
                ptr = storage.data_ptr()
            except RuntimeError:  # a fake tensor's (torch.compile's leftovers): no memory
                continue
            if ptr and ptr not in seen:
                seen.add(ptr)
                self.track(storage)
        self.start = self.peak = self.live
        self.peak_phase = "start"
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        self.op = str(func)
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.track(leaf.untyped_storage())
        return out
