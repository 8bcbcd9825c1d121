"""``quiver.Feature``: a tiered feature store, hottest rows in the fastest memory.

Tiers, fastest first (DESIGN.md §1.4), each a contiguous block of rows in *hot order*:

- ``device``: (a) rows replicated on every GPU (``cache_policy="device_replicate"``);
- ``clique``: (b) rows partitioned across the GPUs of each NVLink clique and read
  peer-to-peer (``cache_policy="p2p_clique_replicate"``);
- ``host``: (c) rows in host RAM, page-locked when a GPU reads them; for a memory-mapped source,
  (d) a RAM cache of ``host_cache_size`` bytes of hot rows;
- ``disk``: (d) the memory-mapped file itself, holding all rows, for features larger than RAM.

The hot order comes from a placement policy (FAP, degree, random) or is given. Gathers keep
request order; :meth:`Feature.stats` counts rows served per tier.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from quiver.feature.buffers import BufferPool
from quiver.feature.cliques import clique_of, detect_cliques
from quiver.feature.gather import RowGather, as_words, split_by_tier
from quiver.feature.placement import PLACEMENTS, hot_order
from quiver.feature.sizes import parse_bytes
from quiver.feature.tiers import CliqueTier, DiskTier, HostTier, ReplicatedTier, Tier

__all__ = ["Feature", "CACHE_POLICIES"]

CACHE_POLICIES = ("device_replicate", "p2p_clique_replicate")


def _as_device(d) -> torch.device:
    if isinstance(d, int):
        return torch.device("cuda", d)
    return torch.device(d)


def _default_peer_access(devices: list[torch.device]):
    def peer(i: int, j: int) -> bool:
        a, b = devices[i], devices[j]
        if a == b or a.type != "cuda" or b.type != "cuda":
            return a.type == b.type
        return bool(torch.cuda.can_device_access_peer(a.index, b.index))

    return peer


class Feature:
    """Tiered feature store with torch-quiver's constructor, extended with placement policies
    and explicit tier capacities.

    Example::

        feature = quiver.Feature(0, [0, 1], "2G", "p2p_clique_replicate", csr_topo=topo)
        feature.from_cpu_tensor(x)          # or feature.from_mmap("features.npy")
        rows = feature[n_id]                # [len(n_id), dim] on device_list[rank]

    Args:
        rank: position in ``device_list`` of the device gathers return to.
        device_list: GPU ordinals (or ``torch.device``/strings; CPUs in tests). Empty: a
            CPU-only store and gathers return CPU tensors.
        device_cache_size: bytes of rows each device caches (int or ``"2G"``-style string).
        cache_policy: ``"device_replicate"`` (every device caches the same hottest rows) or
            ``"p2p_clique_replicate"`` (a clique's devices cache disjoint rows, read peer to
            peer; cliques replicate each other).
        csr_topo: graph used by the ``fap`` and ``degree`` placements.
        placement: ``"fap"``, ``"degree"``, ``"random"``; default ``"fap"`` when ``csr_topo``
            is given, else the id order.
        order: explicit hot order (``[N]`` permutation of node ids, hottest first); overrides
            ``placement``.
        host_cache_size: for :meth:`from_mmap`: bytes of hot rows kept in RAM; the rest is read
            from the file. Default 0. (:meth:`from_cpu_tensor` keeps all non-GPU rows in RAM.)
        sizes: fanouts of the sampler (for FAP).
        seed_prob: seed distribution for FAP: ``None`` (uniform), or a request log of node ids.
        batch_size: seeds per request batch (for FAP).
        num_threads: CPU gather threads; default ``os.cpu_count()`` (x4 for a disk tier).
        peer_access: ``peer_access(i, j) -> bool`` over positions in ``device_list``; default
            asks CUDA (``torch.cuda.can_device_access_peer``).
        seed: RNG seed of the ``random`` placement.
        recycle_outputs: CPU gathers of 1 MiB or more return tensors over recycled buffers
            (:class:`~quiver.feature.buffers.BufferPool`), taken back only once every view of
            them is gone; saves the first-touch page faults of a fresh output (default True).
    """

    def __init__(
        self,
        rank: int = 0,
        device_list=(),
        device_cache_size=0,
        cache_policy: str = "device_replicate",
        csr_topo=None,
        *,
        placement: str | None = None,
        order=None,
        host_cache_size=0,
        sizes=(15, 10, 5),
        seed_prob=None,
        batch_size: int = 64,
        num_threads: int | None = None,
        peer_access=None,
        seed: int = 0,
        recycle_outputs: bool = True,
    ):
        if cache_policy not in CACHE_POLICIES:
            raise ValueError(
                f"unknown cache_policy {cache_policy!r}; choose one of {', '.join(CACHE_POLICIES)}"
            )
        if placement is not None and placement not in PLACEMENTS:
            raise ValueError(
                f"unknown placement {placement!r}; choose one of {', '.join(PLACEMENTS)}"
            )
        self.devices = [_as_device(d) for d in device_list]
        for d in self.devices:
            if d.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device {d} requested but CUDA is not available")
        if self.devices and not 0 <= int(rank) < len(self.devices):
            raise ValueError(f"rank {rank} out of range for {len(self.devices)} devices")
        self.rank = int(rank)
        self.device_cache_size = parse_bytes(device_cache_size, "device_cache_size")
        self.host_cache_size = parse_bytes(host_cache_size, "host_cache_size")
        if self.device_cache_size and not self.devices:
            raise ValueError("device_cache_size > 0 needs a non-empty device_list")
        self.cache_policy = cache_policy
        self.csr_topo = csr_topo
        self.placement = placement if placement is not None else ("fap" if csr_topo else None)
        self._order_arg = order
        self.sizes, self.seed_prob, self.batch_size, self.seed = sizes, seed_prob, batch_size, seed
        self.peer_access = peer_access
        n_threads = num_threads or (os.cpu_count() or 1)
        self._gather = RowGather(n_threads)
        self._disk_gather = RowGather(num_threads or 4 * n_threads)
        self._buffers = BufferPool() if recycle_outputs else None
        self.tiers: list[Tier] = []
        self._shape: tuple[int, int] | None = None
        self._dtype: torch.dtype | None = None
        self._counts = np.zeros(0, dtype=np.int64)

    # ---------------------------------------------------------------------- building

    @property
    def device(self) -> torch.device:
        """Device gathers return to."""
        return self.devices[self.rank] if self.devices else torch.device("cpu")

    def _hot_order(self, n: int) -> torch.Tensor:
        if self._order_arg is not None:
            perm = torch.as_tensor(self._order_arg, dtype=torch.int64).cpu()
            if perm.shape != (n,) or not torch.equal(torch.sort(perm).values, torch.arange(n)):
                raise ValueError(f"order must be a permutation of the {n} node ids")
            return perm
        if self.placement is None:
            return torch.arange(n)
        return hot_order(
            self.placement,
            n,
            self.csr_topo,
            self.sizes,
            self.seed_prob,
            self.batch_size,
            self.seed,
        )

    def _device_rows(self, row_bytes: int, n: int) -> int:
        return min(n, self.device_cache_size // row_bytes) if self.devices else 0

    def _build_device_tier(self, rows_at, n: int, row_bytes: int) -> int:
        """Create the GPU tier from ``rows_at(lo, hi)`` (hot positions -> CPU tensor); returns
        the number of positions it covers for this rank."""
        per_dev = self._device_rows(row_bytes, n)
        if per_dev == 0:
            return 0
        if self.cache_policy == "device_replicate":
            block = rows_at(0, per_dev)
            replicas = {d: block.to(d) for d in dict.fromkeys(self.devices)}
            self.tiers.append(ReplicatedTier(0, per_dev, replicas, self._gather))
            return per_dev
        peer = self.peer_access or _default_peer_access(self.devices)
        self.cliques = detect_cliques(len(self.devices), peer)
        mine = clique_of(self.cliques, self.rank)
        cap = min(n, per_dev * len(mine))
        shards = []
        for k, m in enumerate(mine):
            lo, hi = min(cap, k * per_dev), min(cap, (k + 1) * per_dev)
            if hi > lo:
                shards.append((self.devices[m], lo, hi, rows_at(lo, hi).to(self.devices[m])))
        self.tiers.append(CliqueTier(0, cap, shards, self._gather))
        return cap

    def _check_source(self, shape, dtype) -> tuple[int, int]:
        if len(shape) != 2:
            raise ValueError(f"features must be 2-D [node_count, dim], got shape {list(shape)}")
        n, dim = int(shape[0]), int(shape[1])
        if n == 0 or dim == 0:
            raise ValueError(f"features must have rows and columns, got shape {[n, dim]}")
        if self.csr_topo is not None and self.csr_topo.node_count != n:
            raise ValueError(f"features have {n} rows but csr_topo has {self.csr_topo.node_count}")
        self._shape, self._dtype = (n, dim), dtype
        return n, dim

    def _finish(self, perm: torch.Tensor) -> None:
        n = perm.numel()
        pos = torch.empty(n, dtype=torch.int64)
        pos[perm] = torch.arange(n)
        self._perm = perm
        self._pos_np = pos.numpy()
        self._identity = bool(torch.equal(perm, torch.arange(n)))
        self._starts = np.array([t.start for t in self.tiers], dtype=np.int64)
        self._stops = np.array([t.stop for t in self.tiers], dtype=np.int64)
        self._counts = np.zeros(len(self.tiers), dtype=np.int64)
        assert self.tiers[-1].stop == n and self.tiers[0].start == 0

    def from_cpu_tensor(self, x: torch.Tensor) -> Feature:
        """Load features from a ``[node_count, dim]`` CPU tensor: reorder rows once by the hot
        order, fill the GPU tier, keep the rest in host RAM (pinned if a GPU reads it)."""
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"from_cpu_tensor expects a torch.Tensor, got {type(x).__name__}")
        n, dim = self._check_source(x.shape, x.dtype)
        x = x.detach().cpu()
        perm = self._hot_order(n)
        row_bytes = dim * x.element_size()
        self.tiers = []
        g = self._build_device_tier(lambda lo, hi: x[perm[lo:hi]], n, row_bytes)
        if g < n:
            host = x[perm[g:]].contiguous()
            if any(d.type == "cuda" for d in self.devices):
                host = host.pin_memory()
            self.tiers.append(HostTier(g, n, host, self._gather))
        self._finish(perm)
        return self

    def from_mmap(self, source) -> Feature:
        """Serve features from a memory-mapped ``.npy`` file (or an ``np.memmap``) holding all
        rows in id order: the hottest rows go to the GPU tier and a RAM cache of
        ``host_cache_size`` bytes; the rest is read from the file on demand."""
        if isinstance(source, str | os.PathLike):
            path = Path(source)
            if not path.is_file():
                raise FileNotFoundError(f"feature file not found: {path}")
            arr = np.load(path, mmap_mode="r")
        elif isinstance(source, np.ndarray):
            arr = source
        else:
            raise ValueError(f"from_mmap expects a .npy path or a numpy memmap, got {type(source)}")
        if not arr.flags.c_contiguous:
            raise ValueError("memory-mapped features must be C-contiguous (row-major)")
        n, dim = self._check_source(arr.shape, torch.from_numpy(arr[:0].copy()).dtype)
        perm = self._hot_order(n)
        perm_np = perm.numpy()
        row_bytes = dim * arr.itemsize
        words = as_words(arr)

        def rows_at(lo: int, hi: int) -> torch.Tensor:
            # read in file order (sequential I/O), place in hot order
            ids = perm_np[lo:hi]
            by_file = np.argsort(ids, kind="stable")
            out = np.empty((hi - lo, dim), dtype=arr.dtype)
            self._disk_gather(words, ids[by_file], as_words(out), by_file.astype(np.int64))
            return torch.from_numpy(out)

        self.tiers = []
        g = self._build_device_tier(rows_at, n, row_bytes)
        ram = min(n - g, self.host_cache_size // row_bytes)
        if ram:
            host = rows_at(g, g + ram)
            if any(d.type == "cuda" for d in self.devices):
                host = host.pin_memory()
            self.tiers.append(HostTier(g, g + ram, host, self._gather))
        if g + ram < n:
            self.tiers.append(DiskTier(g + ram, n, arr, perm_np, self._disk_gather))
        self._finish(perm)
        return self

    # ----------------------------------------------------------------------- reading

    @property
    def shape(self) -> torch.Size:
        """``(node_count, dim)``."""
        self._check_loaded()
        return torch.Size(self._shape)

    def size(self, dim: int | None = None):
        """Like ``Tensor.size``."""
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return 2

    @property
    def dtype(self) -> torch.dtype:
        self._check_loaded()
        return self._dtype

    def _check_loaded(self) -> None:
        if self._shape is None:
            raise ValueError("Feature holds no rows yet: call from_cpu_tensor() or from_mmap()")

    def __getitem__(self, n_id) -> torch.Tensor:
        """Rows of the node ids ``n_id`` (1-D ints), in request order, on :attr:`device`.

        Raises:
            ValueError: for non-integer or non-1-D ids, or ids outside ``[0, node_count)``.
        """
        return self.gather(n_id)

    def gather(self, n_id, out: torch.Tensor | None = None) -> torch.Tensor:
        """``feature[n_id]``, optionally into a preallocated ``out`` (saves first-touch page
        faults of a fresh output on every call).

        Args:
            n_id: 1-D integer node ids (tensor, array or list); repeats allowed.
            out: ``[len(n_id), dim]`` contiguous tensor of this store's dtype on :attr:`device`.

        Raises:
            ValueError: bad ids (see ``__getitem__``) or an ``out`` of the wrong shape/dtype/device.
        """
        self._check_loaded()
        if isinstance(n_id, torch.Tensor):
            if n_id.dtype.is_floating_point or n_id.dtype == torch.bool or n_id.is_complex():
                raise ValueError(f"node ids must be integers, got dtype {n_id.dtype}")
            ids = n_id.detach().cpu().numpy()
        else:
            ids = np.asarray(n_id)
            if ids.size == 0:
                ids = ids.astype(np.int64)
            if not np.issubdtype(ids.dtype, np.integer):
                raise ValueError(f"node ids must be integers, got dtype {ids.dtype}")
        if ids.ndim != 1:
            raise ValueError(f"node ids must be 1-D, got shape {list(ids.shape)}")
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        n, dim = self._shape
        if out is None and self._buffers is not None and self.device.type == "cpu":
            out = self._buffers.empty((ids.size, dim), self._dtype)
        elif out is None:
            out = torch.empty((ids.size, dim), dtype=self._dtype, device=self.device)
        elif (
            tuple(out.shape) != (ids.size, dim)
            or out.dtype != self._dtype
            or out.device != self.device
            or not out.is_contiguous()
        ):
            raise ValueError(
                f"out must be a contiguous [{ids.size}, {dim}] {self._dtype} tensor on "
                f"{self.device}, got {list(out.shape)} {out.dtype} on {out.device}"
            )
        if ids.size == 0:
            return out
        tier0 = self.tiers[0]
        if len(self.tiers) == 1 and out.device.type == "cpu" and hasattr(tier0, "read_ids_into"):
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= n:
                raise ValueError(f"node ids must lie in [0, {n}); got {lo if lo < 0 else hi}")
            tier0.read_ids_into(ids, out, None if self._identity else self._pos_np)
            self._counts[0] += ids.size
            return out
        sel, local, offsets, bad = split_by_tier(ids, self._pos_np, self._starts, self._stops)
        if bad >= 0:
            raise ValueError(f"node ids must lie in [0, {n}); got {int(ids[bad])}")
        for t, tier in enumerate(self.tiers):
            a, b = int(offsets[t]), int(offsets[t + 1])
            if b > a:
                tier.read_into(local[a:b], out, sel[a:b])
        self._counts += np.diff(offsets)
        return out

    # ------------------------------------------------------------------------- stats

    def stats(self) -> dict:
        """Rows served per tier since the last :meth:`reset_stats`, plus tier sizes.

        Returns:
            ``{"rows": {tier: count}, "total": int, "share": {tier: fraction},
            "tier_rows": {tier: rows held}, "tier_bytes": {tier: bytes held}}``.
        """
        names = [t.name for t in self.tiers]
        total = int(self._counts.sum())
        return {
            "rows": {k: int(c) for k, c in zip(names, self._counts)},
            "total": total,
            "share": {k: (int(c) / total if total else 0.0) for k, c in zip(names, self._counts)},
            "tier_rows": {t.name: t.num_rows for t in self.tiers},
            "tier_bytes": {t.name: t.nbytes() for t in self.tiers},
        }

    def reset_stats(self) -> None:
        """Zero the per-tier counters."""
        self._counts[:] = 0

    def hot_order(self) -> torch.Tensor:
        """``[N]`` node ids in hot order (position ``i`` holds node ``hot_order()[i]``)."""
        self._check_loaded()
        return self._perm

    def close(self) -> None:
        """Stop the gather threads."""
        self._gather.close()
        self._disk_gather.close()
        if self._buffers is not None:
            self._buffers.clear()

    def __repr__(self) -> str:
        if self._shape is None:
            return "Feature(empty)"
        tiers = ", ".join(f"{t.name}={t.num_rows}" for t in self.tiers)
        return f"Feature(shape={list(self._shape)}, dtype={self._dtype}, tiers: {tiers})"
