"""Vectorized torch sampler (``mode="GPU"``/``"UVA"``): runs on the topology's device.

``GPU`` keeps the topology on the given device. ``UVA`` keeps it in page-locked host memory and
lets the GPU read it in place (zero-copy), so graphs larger than GPU memory can be sampled on
the GPU: the pinned buffers are wrapped as CUDA tensors through ``__cuda_array_interface__``,
which is valid because, under unified virtual addressing, a pinned host allocation has the
same address on the device.
"""

from __future__ import annotations

import threading

import torch

from quiver.graph import CSRTopo
from quiver.sampling import _torch_kernel as K
from quiver.sampling.base import BaseSampler, RepeatedSeedsError, SampledSubgraph
from quiver.sampling.cpu import random_seed

__all__ = ["TorchSampler", "uva_view"]


class _CudaArray:
    """Minimal ``__cuda_array_interface__`` exporter for a device pointer."""

    def __init__(self, ptr: int, numel: int, owner: torch.Tensor):
        self.owner = owner  # keeps the pinned buffer alive
        self.__cuda_array_interface__ = {
            "shape": (numel,),
            "typestr": "<i8",
            "data": (ptr, False),
            "version": 3,
        }


def uva_view(pinned: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor reading the pinned int64 host tensor ``pinned`` in place (no copy)."""
    if not pinned.is_pinned():
        raise ValueError("uva_view needs a pinned host tensor")
    assert pinned.dtype == torch.int64 and pinned.dim() == 1 and pinned.is_contiguous()
    with torch.cuda.device(device):
        view = torch.as_tensor(_CudaArray(pinned.data_ptr(), pinned.numel(), pinned), device=device)
    view._quiver_owner = pinned  # the view must not outlive the host buffer
    return view


class TorchSampler(BaseSampler):
    """Uniform k-hop sampling without replacement as whole-tensor torch operations.

    Args:
        csr_topo: the graph.
        sizes: per-hop fanouts, innermost first; ``-1`` takes all neighbours.
        device: where the kernel runs; default the topology's device. In ``GPU`` mode the
            topology is copied there if needed.
        mode: ``"GPU"`` (topology on ``device``) or ``"UVA"`` (topology pinned in host memory,
            read by the GPU in place; needs CUDA).
        seed: seed of the device generator; ``None`` draws one. Results are reproducible for a
            given seed and call sequence on one device.
        frontier: sample only each hop's new nodes (PyG ``NeighborLoader`` semantics) instead of
            all gathered nodes (legacy ``NeighborSampler``, default).
    """

    def __init__(
        self,
        csr_topo: CSRTopo,
        sizes,
        device=None,
        mode: str = "GPU",
        seed: int | None = None,
        frontier: bool = False,
    ):
        super().__init__(csr_topo.node_count, sizes)
        if mode not in ("GPU", "UVA"):
            raise ValueError(f"TorchSampler mode must be 'GPU' or 'UVA', got {mode!r}")
        self.mode = mode
        if mode == "UVA":
            if not torch.cuda.is_available():
                raise ValueError("mode='UVA' needs CUDA (pinned host topology read by the GPU)")
            self.device = torch.device("cuda" if device is None else device)
            if self.device.type != "cuda":
                raise ValueError(f"mode='UVA' runs on a CUDA device, got {self.device}")
            pinned = csr_topo.pin_memory()
            self._pinned = pinned
            self._indptr = uva_view(pinned.indptr, self.device)
            self._indices = uva_view(pinned.indices, self.device)
            self._eid = None if pinned.eid is None else uva_view(pinned.eid, self.device)
        else:
            self.device = csr_topo.device if device is None else torch.device(device)
            if self.device.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device {self.device} requested but CUDA is not available")
            topo = csr_topo.to(self.device)
            self._indptr, self._indices, self._eid = topo.indptr, topo.indices, topo.eid
        self.topo = csr_topo
        self.seed = random_seed() if seed is None else int(seed) & ((1 << 63) - 1)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.seed)
        self.frontier = bool(frontier)
        self._local = threading.local()

    def __reduce__(self):
        # rebuilt from its arguments (device copy, pinned view and generator made anew)
        args = (self.topo, self.sizes, self.device, self.mode, self.seed, self.frontier)
        return (TorchSampler, args)

    def _marker(self) -> torch.Tensor:
        m = getattr(self._local, "marker", None)
        if m is None:
            m = torch.full((self.node_count,), -1, dtype=torch.int64, device=self.device)
            self._local.marker = m
        return m

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the per-thread marker tensor on the kernel's device."""
        return 8 * self.node_count

    def _sample(self, seeds: torch.Tensor) -> SampledSubgraph:
        seeds = seeds.to(self.device)
        out = K.sample_khop(
            self._indptr,
            self._indices,
            self._eid,
            seeds,
            self.sizes,
            self._marker(),
            self.generator,
            self.frontier,
        )
        if out is None:
            raise RepeatedSeedsError("seeds hold duplicate node ids")
        n_id, num_nodes, hops = out
        return SampledSubgraph(n_id, seeds.numel(), num_nodes, hops)
