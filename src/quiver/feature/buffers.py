"""Recycled output buffers for large CPU gathers.

A fresh 70 MB output costs the kernel one page fault and one zeroed page per 4 KiB on first
touch: on the serving machine that was ~10 ms of a 256-seed batch's ~30 ms gather
(``bench/serving_path.py``). A :class:`BufferPool` hands out tensors over blocks it has
touched before and takes a block back only when the last tensor, view or numpy array that
shares its memory is gone, so a caller may keep (or slice) what it got for as long as it likes.
"""

from __future__ import annotations

import bisect
import threading

import numpy as np
import torch

__all__ = ["BufferPool"]


class _Lease:
    """Returns its block to the pool when collected (the last view of the block died)."""

    __slots__ = ("pool", "block")

    def __init__(self, pool: BufferPool, block: np.ndarray):
        self.pool, self.block = pool, block

    def __del__(self):
        try:
            self.pool._give_back(self.block)
        except Exception:  # pragma: no cover - interpreter shutdown: nothing left to recycle
            pass


class _LeasedArray(np.ndarray):
    """The ndarray a leased tensor is built on; it carries the lease, so the block returns
    only when this array dies, which torch's storage delays until its own last user is gone."""


class BufferPool:
    """Free list of byte blocks, sized in powers of two, for tensors of ``min_bytes`` or more.

    Args:
        max_bytes: capacity (sum of block sizes) kept on the free list; blocks given back
            beyond it are dropped (returned to the allocator). Default 1 GiB of address space;
            only pages that gathers touched use memory.
        min_bytes: smaller requests get a plain ``torch.empty`` (the allocator reuses small
            blocks without faults). Default 1 MiB.
    """

    def __init__(self, max_bytes: int = 1 << 30, min_bytes: int = 1 << 20):
        if max_bytes < 0 or min_bytes < 1:
            raise ValueError(
                f"need max_bytes >= 0 and min_bytes >= 1, got {max_bytes}, {min_bytes}"
            )
        self.max_bytes, self.min_bytes = int(max_bytes), int(min_bytes)
        self._free: list[tuple[int, int, np.ndarray]] = []  # (capacity, serial, block), sorted
        self._free_bytes = 0
        self._serial = 0
        self._lock = threading.Lock()
        #: blocks allocated (misses) and requests served from the free list (hits)
        self.allocated = 0
        self.reused = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype``."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        if nbytes < self.min_bytes:
            return torch.empty(shape, dtype=dtype)
        block = self._take(nbytes)
        arr = block[:nbytes].view(_LeasedArray)
        arr._lease = _Lease(self, block)
        return torch.from_numpy(arr).view(dtype).view(shape)

    def _take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            i = bisect.bisect_left(self._free, (nbytes, -1))
            if i < len(self._free):
                cap, _, block = self._free.pop(i)
                self._free_bytes -= cap
                self.reused += 1
                return block
            self.allocated += 1
        return np.empty(1 << (nbytes - 1).bit_length(), dtype=np.uint8)

    def _give_back(self, block: np.ndarray) -> None:
        cap = block.shape[0]
        with self._lock:
            if self._free_bytes + cap > self.max_bytes:
                return
            self._serial += 1
            bisect.insort(self._free, (cap, self._serial, block))
            self._free_bytes += cap

    @property
    def free_bytes(self) -> int:
        """Capacity on the free list now."""
        return self._free_bytes

    def clear(self) -> None:
        """Drop every free block."""
        with self._lock:
            self._free.clear()
            self._free_bytes = 0
