"""Streaming CSR construction from a one-pass edge stream, in bounded memory.

Edges arrive in chunks. Each chunk is counted (in-degrees) and partitioned by target-id range
into buckets, kept in memory while they fit ``memory_budget`` and spilled to temporary files
otherwise. Then each bucket is placed into its rows in RAM and written to the output
sequentially, so a memory-mapped output is never written at random (random writes to a
file-backed map are dominated by page write-back). Within a row the stream order is kept: the
result equals ``CSRTopo.from_edge_index`` on the concatenated stream.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import numba
import numpy as np

__all__ = ["build_csr"]

DEFAULT_BUDGET = 1 << 31  # bytes of edges held in RAM before buckets spill to disk


@numba.njit(nogil=True, cache=True)
def _count(dst, counts):
    for j in range(dst.shape[0]):
        counts[dst[j]] += 1


@numba.njit(nogil=True, cache=True)
def _scatter(src, dst, cursor, base, out):
    """``out[cursor[t] - base] = src`` for each edge, advancing the row cursors."""
    for j in range(dst.shape[0]):
        t = dst[j]
        out[cursor[t] - base] = src[j]
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


class _Buckets:
    """Edges partitioned by target range; in memory until the budget is hit, then on disk."""

    def __init__(self, num_buckets: int, budget: int, spill_dir):
        self.parts = [[] for _ in range(num_buckets)]
        self.files = [None] * num_buckets
        self.in_memory = 0
        self.budget = budget
        self.spill_dir = spill_dir
        self._tmp = None

    def add(self, b: int, src: np.ndarray, dst: np.ndarray):
        pair = np.stack([src, dst])  # [2, m]
        if self.files[b] is None and self.in_memory + pair.nbytes <= self.budget:
            self.parts[b].append(pair)
            self.in_memory += pair.nbytes
            return
        if self.files[b] is None:
            if self._tmp is None:
                self._tmp = tempfile.TemporaryDirectory(dir=self.spill_dir, prefix="csr-spill-")
            self.files[b] = open(Path(self._tmp.name) / f"b{b}.bin", "w+b")
            for p in self.parts[b]:  # keep stream order: earlier parts go first
                p.T.tofile(self.files[b])
                self.in_memory -= p.nbytes
            self.parts[b] = []
        pair.T.tofile(self.files[b])  # rows of (src, dst)

    def take(self, b: int):
        """Yield bucket ``b``'s chunks in stream order and free them."""
        f = self.files[b]
        if f is not None:
            f.flush()
            f.seek(0)
            while True:
                a = np.fromfile(f, dtype=np.int64, count=2 * (1 << 22))
                if a.size == 0:
                    break
                a = a.reshape(-1, 2)
                yield np.ascontiguousarray(a[:, 0]), np.ascontiguousarray(a[:, 1])
            f.close()
        for p in self.parts[b]:
            yield p[0], p[1]
        self.parts[b] = []

    def close(self):
        for f in self.files:
            if f is not None and not f.closed:
                f.close()
        if self._tmp is not None:
            self._tmp.cleanup()


def build_csr(
    stream: Iterable[tuple[np.ndarray, np.ndarray]] | Callable[[], Iterable],
    num_nodes: int,
    alloc: Callable[[str, tuple, np.dtype], np.ndarray] | None = None,
    on_chunk: Callable[[int, int], None] | None = None,
    memory_budget: int = DEFAULT_BUDGET,
    spill_dir=None,
) -> tuple[np.ndarray, np.ndarray]:
    """Build the in-neighbour CSR of an edge stream, reading the stream once.

    Args:
        stream: an iterable of ``(src, dst)`` integer chunks (or a callable returning one).
        num_nodes: node count; ids outside ``[0, num_nodes)`` raise ``ValueError``.
        alloc: ``alloc(name, shape, dtype)`` returns the output array for ``"indices"``
            (default ``np.empty``; pass a memmap factory to write to disk).
        on_chunk: progress callback ``on_chunk(step, edges)``: step 1 while reading the stream,
            step 2 while placing edges.
        memory_budget: bytes of edges (16 per edge) kept in RAM; beyond it buckets spill to
            temporary files in ``spill_dir`` (default: the system temp directory).

    Returns:
        ``(indptr [N + 1], indices [E])``.
    """
    if callable(stream):
        stream = stream()
    # ~4 buckets per budget's worth of edges would need E up front; target ranges of equal
    # size are balanced because generators and loaders spread hubs over the id range
    num_buckets = max(1, min(num_nodes, 64))
    bounds = np.linspace(0, num_nodes, num_buckets + 1).astype(np.int64)
    counts = np.zeros(num_nodes, dtype=np.int64)
    buckets = _Buckets(num_buckets, memory_budget, spill_dir)
    seen = 0
    try:
        for src, dst in stream:
            src = np.ascontiguousarray(src, dtype=np.int64)
            dst = np.ascontiguousarray(dst, dtype=np.int64)
            _check_chunk(src, dst, num_nodes, seen)
            _count(dst, counts)
            seen += dst.size
            b = np.searchsorted(bounds, dst, side="right") - 1
            order = np.argsort(b, kind="stable")
            cuts = np.searchsorted(b[order], np.arange(num_buckets + 1))
            for k in np.flatnonzero(np.diff(cuts)):
                sel = order[cuts[k] : cuts[k + 1]]
                buckets.add(int(k), src[sel], dst[sel])
            if on_chunk:
                on_chunk(1, dst.size)
        indptr = np.zeros(num_nodes + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        del counts
        indices = (alloc or (lambda name, shape, dtype: np.empty(shape, dtype)))(
            "indices", (seen,), np.int64
        )
        cursor = indptr[:-1].copy()
        for k in range(num_buckets):
            lo, hi = indptr[bounds[k]], indptr[bounds[k + 1]]
            buf = np.empty(hi - lo, dtype=np.int64)  # one bucket's rows, placed in RAM
            for src, dst in buckets.take(k):
                _scatter(src, dst, cursor, lo, buf)
                if on_chunk:
                    on_chunk(2, dst.size)
            indices[lo:hi] = buf  # sequential write
            del buf
    finally:
        buckets.close()
    assert np.array_equal(cursor, indptr[1:]), "bucket placement lost edges"
    return indptr, indices
