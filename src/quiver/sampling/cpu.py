"""CPU sampler: the numba kernel behind a ``BaseSampler``, with reusable per-thread workspace."""

from __future__ import annotations

import itertools
import threading

import numba
import numpy as np
import torch

from quiver.graph import CSRTopo
from quiver.sampling import _cpu_kernel as K
from quiver.sampling.base import BaseSampler, SampledSubgraph

__all__ = ["CPUSampler", "random_seed"]

# Hops with fewer targets run on the calling thread: a parallel launch (and waiting for the
# slowest thread when cores are shared) costs more than it saves on small hops.
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
        num_threads: numba threads per call (default: numba's default, all cores).
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
        max_threads = numba.config.NUMBA_NUM_THREADS
        if num_threads is None:
            num_threads = max_threads
        if not 1 <= num_threads <= max_threads:
            raise ValueError(f"num_threads must be in [1, {max_threads}], got {num_threads}")
        self.num_threads = int(num_threads)
        self.frontier = bool(frontier)
        self._calls = itertools.count()
        # local ids fit int32 below 2**31 nodes: half the marker's cache footprint
        self._marker_dtype = np.int32 if self.node_count < 2**31 else np.int64
        self._local = threading.local()

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
        numba.set_num_threads(self.num_threads)  # thread-local in numba: cheap, no global effect
        n_id, num_nodes, hops = K.sample_khop(
            self._indptr,
            self._indices,
            self._eid,
            seeds.numpy(),
            self._fanouts,
            self.seed,
            next(self._calls),
            self._marker(),
            PARALLEL_MIN_TARGETS,
            self.frontier,
        )
        if num_nodes[0] < 0:
            raise ValueError("seeds hold duplicate node ids")
        t = torch.from_numpy
        return SampledSubgraph(
            t(n_id), seeds.numel(), num_nodes.tolist(), [(t(a), t(b), t(c)) for a, b, c in hops]
        )
