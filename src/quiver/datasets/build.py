"""Streaming CSR construction: two passes over a re-playable edge stream, O(N) extra memory.

Pass 1 counts in-degrees; pass 2 replays the stream and drops each source into its target's
row at a per-row cursor. Within a row the stream order is kept, so the result equals
``CSRTopo.from_edge_index`` on the concatenated stream. ``indices`` can be a memory-mapped
``.npy`` so graphs larger than RAM are written without holding their edges in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numba
import numpy as np

__all__ = ["build_csr"]


@numba.njit(nogil=True, cache=True)
def _count(dst, counts):
    for j in range(dst.shape[0]):
        counts[dst[j]] += 1


@numba.njit(nogil=True, cache=True)
def _scatter(src, dst, cursor, indices):
    for j in range(dst.shape[0]):
        t = dst[j]
        indices[cursor[t]] = src[j]
        cursor[t] += 1


def _check_chunk(src, dst, num_nodes, edges_before):
    if src.shape != dst.shape:
        raise ValueError(f"edge chunk has {src.size} sources but {dst.size} targets")
    if src.size:
        lo = min(int(src.min()), int(dst.min()))
        hi = max(int(src.max()), int(dst.max()))
        if lo < 0 or hi >= num_nodes:
            bad = lo if lo < 0 else hi
            pos = np.flatnonzero((src == bad) | (dst == bad))[0] + edges_before
            raise ValueError(f"edge {pos} holds node id {bad}, outside [0, {num_nodes})")


def build_csr(
    stream: Callable[[], Iterable[tuple[np.ndarray, np.ndarray]]],
    num_nodes: int,
    alloc: Callable[[str, tuple, np.dtype], np.ndarray] | None = None,
    on_chunk: Callable[[int, int], None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Build the in-neighbour CSR of an edge stream.

    Args:
        stream: called twice; each call returns an iterable of ``(src, dst)`` int64 chunks,
            the same both times.
        num_nodes: node count; ids outside ``[0, num_nodes)`` raise ``ValueError``.
        alloc: ``alloc(name, shape, dtype)`` returns the output array for ``"indices"``
            (default ``np.empty``; pass a memmap factory to write to disk).
        on_chunk: progress callback ``on_chunk(pass_number, edges_in_chunk)``.

    Returns:
        ``(indptr [N + 1], indices [E])``.
    """
    counts = np.zeros(num_nodes, dtype=np.int64)
    seen = 0
    for src, dst in stream():
        src = np.ascontiguousarray(src, dtype=np.int64)
        dst = np.ascontiguousarray(dst, dtype=np.int64)
        _check_chunk(src, dst, num_nodes, seen)
        _count(dst, counts)
        seen += dst.size
        if on_chunk:
            on_chunk(1, dst.size)
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    del counts
    indices = (alloc or (lambda name, shape, dtype: np.empty(shape, dtype)))(
        "indices", (seen,), np.int64
    )
    cursor = indptr[:-1].copy()
    replayed = 0
    for src, dst in stream():
        src = np.ascontiguousarray(src, dtype=np.int64)
        dst = np.ascontiguousarray(dst, dtype=np.int64)
        replayed += dst.size
        if replayed > seen:
            raise ValueError("edge stream changed between passes")
        _scatter(src, dst, cursor, indices)
        if on_chunk:
            on_chunk(2, dst.size)
    if replayed != seen or not np.array_equal(cursor, indptr[1:]):
        raise ValueError("edge stream changed between passes")
    return indptr, indices
