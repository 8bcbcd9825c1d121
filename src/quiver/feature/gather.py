"""Multi-threaded row gather on the CPU, for RAM arrays and memory-mapped files alike.

Rows are copied as raw machine words (any dtype, any row width) by a numba kernel compiled
with ``nogil=True``; a thread pool runs it on chunks of the request, so page faults of a
memory-mapped file are served in parallel and several gathers can run at once (numba's own
``parallel=True`` pool may not be entered from several threads concurrently).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

__all__ = ["RowGather", "as_words", "tensor_words"]

#: below this many rows a gather runs in the calling thread (pool hand-off costs ~50 us)
_INLINE_ROWS = 2048
_EMPTY = np.empty(0, dtype=np.int64)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _gather_rows(src, src_rows, row_map, dst, dst_rows, lo, hi):  # pragma: no cover - compiled
    """``dst[dst_rows[i]] = src[row_map[src_rows[i]]]`` for ``i`` in ``[lo, hi)``; an empty
    ``row_map`` is the identity, an empty ``dst_rows`` means ``dst_rows[i] = i``."""
    width = src.shape[1]
    mapped = row_map.shape[0] > 0
    scattered = dst_rows.shape[0] > 0
    for i in range(lo, hi):
        s = src_rows[i]
        if mapped:
            s = row_map[s]
        d = dst_rows[i] if scattered else i
        for j in range(width):
            dst[d, j] = src[s, j]


def as_words(a: np.ndarray) -> np.ndarray:
    """View a C-contiguous 2-D array as ``[rows, words]`` of the widest unsigned int that
    divides the row size, so the copy loop moves 8 bytes at a time when it can."""
    assert a.ndim == 2 and a.flags.c_contiguous, "gather needs C-contiguous 2-D rows"
    row_bytes = a.shape[1] * a.itemsize
    for word in (np.uint64, np.uint32, np.uint16, np.uint8):
        if row_bytes % np.dtype(word).itemsize == 0:
            v = a.view(np.uint8).view(word) if a.shape[1] else a.view(np.uint8)
            # plain ndarray: numba needs no subclass (np.memmap) handling
            return np.ndarray(v.shape, v.dtype, buffer=v) if v.size else v
    raise AssertionError("unreachable: uint8 divides every row")


def tensor_words(t) -> np.ndarray:
    """:func:`as_words` of a contiguous 2-D CPU tensor of any dtype (bfloat16 has no numpy
    type: its bits are viewed as int16; the gather copies words, not values)."""
    import torch

    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return as_words(t.numpy())


class RowGather:
    """Copies rows between 2-D arrays with ``num_threads`` threads.

    Args:
        num_threads: worker threads; default ``os.cpu_count()``. Memory-mapped sources on
            disk benefit from more threads than cores (more reads in flight).
    """

    def __init__(self, num_threads: int | None = None):
        n = int(num_threads) if num_threads else (os.cpu_count() or 1)
        if n < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self.num_threads = n
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="gather")
            return self._pool

    def __call__(
        self,
        src: np.ndarray,
        src_rows: np.ndarray,
        dst: np.ndarray,
        dst_rows: np.ndarray | None = None,
        row_map: np.ndarray | None = None,
    ) -> None:
        """``dst[dst_rows] = src[row_map[src_rows]]``; ``src``/``dst`` are word views
        (:func:`as_words`), indices int64 arrays; ``dst_rows`` defaults to ``0..n-1`` and
        ``row_map`` to the identity."""
        n = src_rows.shape[0]
        dst_rows = _EMPTY if dst_rows is None else dst_rows
        row_map = _EMPTY if row_map is None else row_map
        assert dst_rows.shape[0] in (0, n) and src.shape[1] == dst.shape[1]
        if n == 0:
            return
        if n < _INLINE_ROWS or self.num_threads == 1:
            _gather_rows(src, src_rows, row_map, dst, dst_rows, 0, n)
            return
        chunks = min(self.num_threads * 4, -(-n // 512))
        bounds = np.linspace(0, n, chunks + 1).astype(np.int64)
        pool = self._executor()
        futures = [
            pool.submit(_gather_rows, src, src_rows, row_map, dst, dst_rows, int(lo), int(hi))
            for lo, hi in zip(bounds[:-1], bounds[1:])
            if hi > lo
        ]
        for f in futures:
            f.result()

    def close(self) -> None:
        """Stop the worker threads (a later call starts them again)."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _split_by_tier(ids, pos_of, starts, stops):  # pragma: no cover - compiled
    """Group a request by tier in one pass over its ids (no torch intra-op threads: on a
    busy machine their wake-ups cost milliseconds per small request).

    Returns ``(sel, local, offsets, bad)``: for tier ``t``, ``sel[offsets[t]:offsets[t+1]]``
    are request positions and ``local[...]`` the rows inside the tier; ``bad`` is the index of
    the first id outside ``[0, len(pos_of))``, or ``-1``.
    """
    n = ids.shape[0]
    num_tiers = stops.shape[0]
    num = pos_of.shape[0]
    tier_of = np.empty(n, dtype=np.int64)
    offsets = np.zeros(num_tiers + 1, dtype=np.int64)
    sel = np.empty(n, dtype=np.int64)
    local = np.empty(n, dtype=np.int64)
    for i in range(n):
        v = ids[i]
        if v < 0 or v >= num:
            return sel, local, offsets, i
        p = pos_of[v]
        t = 0
        while p >= stops[t]:
            t += 1
        tier_of[i] = t
        offsets[t + 1] += 1
    for t in range(num_tiers):
        offsets[t + 1] += offsets[t]
    fill = offsets[:-1].copy()
    for i in range(n):
        t = tier_of[i]
        j = fill[t]
        sel[j] = i
        local[j] = pos_of[ids[i]] - starts[t]
        fill[t] = j + 1
    return sel, local, offsets, -1


def split_by_tier(ids: np.ndarray, pos_of: np.ndarray, starts: np.ndarray, stops: np.ndarray):
    """Python entry of :func:`_split_by_tier` (int64 arrays)."""
    return _split_by_tier(ids, pos_of, starts, stops)
