"""Feature tiers: each holds one contiguous block ``[start, stop)`` of the hot order.

A tier copies the rows at local positions ``local`` (``pos - start``) into ``out[sel]``.
All tiers are device-agnostic torch/numpy; the "devices" may be CPUs in tests.
"""

from __future__ import annotations

import numpy as np
import torch

from quiver.feature.gather import RowGather, as_words, tensor_words

__all__ = ["Tier", "ReplicatedTier", "CliqueTier", "HostTier", "DiskTier"]


class Tier:
    """A block of hot-ordered rows in one kind of memory.

    Args:
        name: stats key (``device``, ``clique``, ``host``, ``disk``).
        start: first position (in the hot order) held by this tier.
        stop: one past the last position.
    """

    def __init__(self, name: str, start: int, stop: int):
        assert 0 <= start <= stop
        self.name, self.start, self.stop = name, start, stop

    @property
    def num_rows(self) -> int:
        return self.stop - self.start

    def read_into(self, local: np.ndarray, out: torch.Tensor, sel: np.ndarray) -> None:
        """``out[sel] = rows[local]``; ``local`` and ``sel`` are int64 arrays of equal length."""
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes this tier holds (all copies)."""
        raise NotImplementedError


def _cpu_pair(src: torch.Tensor, out: torch.Tensor) -> bool:
    """Both on the CPU (tests, CPU "devices"): use the threaded numba gather, not torch ops."""
    return src.device.type == "cpu" and out.device.type == "cpu" and src.is_contiguous()


class ReplicatedTier(Tier):
    """(a) The same rows on every device; a read uses the copy on the output's device.

    Args:
        replicas: ``{device: [rows, dim] tensor}``.
    """

    def __init__(
        self,
        start: int,
        stop: int,
        replicas: dict[torch.device, torch.Tensor],
        gather: RowGather | None = None,
    ):
        super().__init__("device", start, stop)
        self.replicas = replicas
        self.gather = gather

    def read_into(self, local, out, sel):
        src = self.replicas[out.device]
        if _cpu_pair(src, out) and self.gather is not None:
            self.gather(tensor_words(src), local, tensor_words(out), sel)
            return
        local_t = torch.from_numpy(local).to(src.device)
        out.index_copy_(0, torch.from_numpy(sel).to(out.device), src.index_select(0, local_t))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.replicas.values())


class CliqueTier(Tier):
    """(b) Rows split across the devices of one peer-access (NVLink) clique; every member
    reads every shard directly (peer-to-peer), so the clique caches ``members x`` the rows a
    single device could.

    Args:
        shards: ``[(device, lo, hi, tensor)]``: positions ``[lo, hi)`` of the block (local)
            live on ``device``.
    """

    def __init__(
        self,
        start: int,
        stop: int,
        shards: list[tuple[torch.device, int, int, object]],
        gather: RowGather | None = None,
    ):
        super().__init__("clique", start, stop)
        self.shards = shards
        self.gather = gather

    def read_into(self, local, out, sel):
        for _, lo, hi, t in self.shards:
            m = (local >= lo) & (local < hi)
            if not m.any():
                continue
            if _cpu_pair(t, out) and self.gather is not None:
                self.gather(tensor_words(t), local[m] - lo, tensor_words(out), sel[m])
                continue
            rows = t.index_select(0, torch.from_numpy(local[m] - lo).to(t.device))
            # a peer read: on CUDA this copies over NVLink into the output's device
            dst = torch.from_numpy(sel[m]).to(out.device)
            out.index_copy_(0, dst, rows.to(out.device, non_blocking=True))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for *_, t in self.shards)


class _CpuRowsTier(Tier):
    """Rows in a host array: gathered by CPU threads for a CPU output; for a GPU output read
    by the GPU in place when pinned (zero-copy), else staged and copied."""

    def __init__(self, name, start, stop, words: np.ndarray, gather: RowGather, pinned: bool):
        super().__init__(name, start, stop)
        self.words = words  # [rows, words] view used by the gather kernel
        self.gather = gather
        self.pinned = pinned

    def _source_rows(self, local: np.ndarray) -> np.ndarray:
        return local

    def _uva_rows(self, device: torch.device) -> torch.Tensor | None:
        """A CUDA view of the pinned rows on ``device`` (zero-copy), or ``None``."""
        return None

    def read_into(self, local, out, sel):
        src_rows = self._source_rows(local)
        if out.device.type == "cpu":
            self.gather(self.words, src_rows, tensor_words(out), sel)
            return
        dst = torch.from_numpy(sel).to(out.device, non_blocking=True)
        uva = self._uva_rows(out.device)
        if uva is not None:
            # zero-copy: the GPU reads the pinned host rows itself over PCIe/NVLink-C2C
            idx = torch.from_numpy(src_rows).to(out.device, non_blocking=True)
            out.index_copy_(0, dst, uva.index_select(0, idx))
            return
        # otherwise: gather on the CPU into (pinned) staging, then one async copy
        staging = torch.empty(
            (len(src_rows), out.shape[1]), dtype=out.dtype, pin_memory=self.pinned
        )
        self.gather(self.words, src_rows, tensor_words(staging))
        out.index_copy_(0, dst, staging.to(out.device, non_blocking=True))

    def read_ids_into(self, ids: np.ndarray, out: torch.Tensor, pos_of: np.ndarray | None):
        """Sole-tier fast path: ``out[i] = row of node ids[i]`` on a CPU ``out``, mapping ids
        to rows inside the kernel (``pos_of``: node id -> hot position; ``None`` = identity)."""
        raise NotImplementedError


class _CudaArray:
    """Minimal ``__cuda_array_interface__`` exporter for a device pointer."""

    def __init__(self, ptr: int, shape: tuple, typestr: str, owner: torch.Tensor):
        self.owner = owner  # keeps the pinned buffer alive
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, False),
            "version": 3,
        }


def uva_view_2d(pinned: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A CUDA tensor aliasing the pinned host tensor ``pinned`` (no copy), or ``None`` when
    its dtype has no array-interface code (e.g. bfloat16). Valid under unified virtual
    addressing, where a pinned host allocation has the same address on the device."""
    try:
        typestr = np.dtype(torch.empty(0, dtype=pinned.dtype).numpy().dtype).str
    except (TypeError, RuntimeError):
        return None
    arr = _CudaArray(pinned.data_ptr(), tuple(pinned.shape), typestr, pinned)
    with torch.cuda.device(device):
        view = torch.as_tensor(arr, device=device)
    view._quiver_owner = pinned  # the view must not outlive the host buffer
    return view


class HostTier(_CpuRowsTier):
    """(c)/(d) Rows in host RAM (page-locked when a GPU reads them), contiguous in hot order.

    Args:
        rows: ``[num_rows, dim]`` CPU tensor, row ``i`` = position ``start + i``.
    """

    def __init__(self, start: int, stop: int, rows: torch.Tensor, gather: RowGather):
        assert rows.device.type == "cpu" and rows.is_contiguous()
        super().__init__("host", start, stop, tensor_words(rows), gather, rows.is_pinned())
        self.rows = rows  # keeps the storage alive
        self._uva: dict[torch.device, torch.Tensor | None] = {}

    def _uva_rows(self, device):
        if not self.pinned:
            return None
        if device not in self._uva:
            self._uva[device] = uva_view_2d(self.rows, device)
        return self._uva[device]

    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def read_ids_into(self, ids, out, pos_of):
        assert self.start == 0
        self.gather(self.words, ids, tensor_words(out), row_map=pos_of)


class DiskTier(_CpuRowsTier):
    """(d) The memory-mapped file holding *all* rows in original id order; serves the
    positions no faster tier holds, so features larger than RAM can be served.

    Args:
        array: ``[node_count, dim]`` memory-mapped array (original row order).
        perm: ``[node_count]`` int64 numpy hot order, ``perm[pos]`` = node id.
    """

    def __init__(self, start, stop, array: np.ndarray, perm: np.ndarray, gather: RowGather):
        super().__init__("disk", start, stop, as_words(array), gather, False)
        self.array = array
        self.perm = perm

    def _source_rows(self, local):
        return self.perm[local + self.start]

    def nbytes(self) -> int:
        return 0  # pages live in the OS page cache, not in this process's allocations

    def read_ids_into(self, ids, out, pos_of):
        # the file is in id order: the node id is the row
        self.gather(self.words, ids, tensor_words(out))
