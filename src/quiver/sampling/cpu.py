"""CPU sampler: the numba kernel behind a ``BaseSampler``, with reusable per-thread workspace."""

from __future__ import annotations

import itertools
import os
import threading

import numpy as np
import torch

from quiver.graph import CSRTopo
from quiver.sampling import _cpu_kernel as K
from quiver.sampling.base import BaseSampler, RepeatedSeedsError, SampledSubgraph

__all__ = ["CPUSampler", "random_seed"]

# Hops with fewer targets run on the calling thread, inside one numba call: handing work to
# other threads costs more than it saves on small hops.
PARALLEL_MIN_TARGETS = 1024


def random_seed() -> int:
    """A fresh 63-bit seed from the OS entropy pool."""
    return int(np.random.SeedSequence().entropy) & ((1 << 63) - 1)


class CPUSampler(BaseSampler):
    """Uniform k-hop sampling without replacement on CPU (numba, ``nogil``, parallel rows).

    Several threads may call :meth:`sample` on one instance at once: each thread gets its own
    marker array (``node_count`` int32), allocated on its first call and reused.

    Args:
        csr_topo: the graph; must live on the CPU (it may be memory-mapped).
        sizes: per-hop fanouts, innermost first (``[15, 10, 5]``); ``-1`` takes all neighbours.
        seed: seed of the random streams; ``None`` draws one. Call ``i`` of an instance returns
            the same result for the same seed whatever ``num_threads`` is.
        num_threads: threads sampling the rows of a large hop (default: all cores). They
            share the work chunk by chunk, so a busy core delays a call by one chunk at most.
        frontier: ``False`` (default) samples every gathered node at each hop, as PyG's legacy
            ``NeighborSampler`` and torch-quiver do; ``True`` samples only the previous hop's new
            nodes, as PyG's ``NeighborLoader`` does.
    """

    def __init__(
        self,
        csr_topo: CSRTopo,
        sizes,
        seed: int | None = None,
        num_threads: int | None = None,
        frontier: bool = False,
    ):
        super().__init__(csr_topo.node_count, sizes)
        if csr_topo.device.type != "cpu":
            raise ValueError(f"CPU sampling needs a CPU topology, got one on {csr_topo.device}")
        self.topo = csr_topo
        self._indptr, self._indices = csr_topo.numpy()
        self._eid = (
            csr_topo.eid.numpy() if csr_topo.eid is not None else np.empty(0, dtype=np.int64)
        )
        self._fanouts = np.asarray(self.sizes, dtype=np.int64)
        self.seed = random_seed() if seed is None else int(seed) & ((1 << 63) - 1)
        if num_threads is None:
            num_threads = os.cpu_count() or 1
        if not 1 <= num_threads <= 256:
            raise ValueError(f"num_threads must be in [1, 256], got {num_threads}")
        self.num_threads = int(num_threads)
        self.frontier = bool(frontier)
        self._calls = itertools.count()
        # local ids fit int32 below 2**31 nodes: half the marker's cache footprint
        self._marker_dtype = np.int32 if self.node_count < 2**31 else np.int64
        self._local = threading.local()
        self._executor = None  # helper threads, started on the first large hop

    def __reduce__(self):
        # rebuilt from its arguments: the topology's tensors travel (shared memory under
        # torch.multiprocessing), the threads and per-thread workspace are made anew
        return (CPUSampler, (self.topo, self.sizes, self.seed, self.num_threads, self.frontier))

    def _marker(self) -> np.ndarray:
        m = getattr(self._local, "marker", None)
        if m is None:
            m = self._local.marker = np.full(self.node_count, -1, dtype=self._marker_dtype)
        return m

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the per-thread marker array (the sampler's persistent working memory)."""
        return np.dtype(self._marker_dtype).itemsize * self.node_count

    def _sample(self, seeds: torch.Tensor) -> SampledSubgraph:
        call = next(self._calls)
        marker = self._marker()
        # small hops run inside one numba call; the first hop with many targets (and the rest)
        # is split into chunks that this thread and the helper threads take as they come
        stop_at = PARALLEL_MIN_TARGETS if self.num_threads > 1 else np.iinfo(np.int64).max
        n_id, n, num_nodes, hops, done = K.sample_khop(
            self._indptr,
            self._indices,
            self._eid,
            seeds.numpy(),
            self._fanouts,
            self.seed,
            call,
            marker,
            stop_at,
            self.frontier,
        )
        if num_nodes[0] < 0:
            raise RepeatedSeedsError("seeds hold duplicate node ids")
        hops = list(hops)
        if done < len(self.sizes):
            try:
                n_id, n = self._threaded_hops(n_id, n, num_nodes, hops, done, call, marker)
            finally:
                K.reset_marker(marker, n_id, n)
        t = torch.from_numpy
        return SampledSubgraph(
            t(n_id[:n]), seeds.numel(), num_nodes.tolist(), [(t(a), t(b), t(c)) for a, b, c in hops]
        )

    def _threaded_hops(self, n_id, n, num_nodes, hops, done, call, marker):
        """Hops ``done..L-1`` with rows sampled by ``num_threads`` threads; the relabel pass
        stays sequential. Same random streams as the single-call path."""
        has_eid = self._eid.shape[0] > 0
        for h in range(done, len(self.sizes)):
            k = self.sizes[h]
            first = int(num_nodes[h - 1]) if (self.frontier and h > 0) else 0
            targets = n_id[first:n]
            nt = n - first
            starts = np.empty(nt, dtype=np.int64)
            degs = np.empty(nt, dtype=np.int64)
            self._run_chunks(nt, K.rows_range, self._indptr, targets, starts, degs)
            offs = K.row_offsets(degs, k)
            m = int(offs[-1])
            src = np.empty(m, dtype=np.int64)
            eids = np.empty(m, dtype=np.int64)
            key = np.uint64(K.stream_key(self.seed, call, h))
            args = (self._indices, self._eid, has_eid, starts, degs, k, key, offs, src, eids)
            self._run_chunks(nt, K.fill_range, *args)
            dst = np.empty(m, dtype=np.int64)
            if n_id.shape[0] < n + m:
                grown = np.empty(max(n + m, 2 * n_id.shape[0]), dtype=np.int64)
                grown[:n] = n_id[:n]
                n_id = grown
            n = K.relabel(src, dst, first, offs, marker, n_id, n)
            num_nodes[h + 1] = n
            hops.append((src, dst, eids))
        return n_id, n

    def _run_chunks(self, total: int, fn, *args) -> None:
        """Run ``fn(*args, lo, hi)`` over ``[0, total)`` in chunks taken by this thread and helpers.

        Work is shared, not split up front: if a helper is not scheduled (shared cores), the
        calling thread takes its chunks instead of waiting for it; a helper task that never
        started is cancelled.
        """
        chunks = 4 * self.num_threads
        bounds = np.linspace(0, total, chunks + 1).astype(np.int64).tolist()
        counter = itertools.count()

        def worker():
            while (c := next(counter)) < chunks:  # next() on a count is atomic under the GIL
                fn(*args, bounds[c], bounds[c + 1])

        futures = [self._pool().submit(worker) for _ in range(self.num_threads - 1)]
        worker()
        for f in futures:
            if not f.cancel():
                f.result()

    def _pool(self):
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(
                self.num_threads - 1, thread_name_prefix="quiver-sampler"
            )
        return self._executor
