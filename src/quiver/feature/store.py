"""``quiver.Feature``: a tiered feature store, hottest rows in the fastest memory.

Tiers, fastest first (DESIGN.md §1.4), each a contiguous block of rows in *hot order*:

- ``device``: (a) rows replicated on every GPU (``cache_policy="device_replicate"``);
- ``clique``: (b) rows partitioned across the GPUs of each NVLink clique and read
  peer-to-peer (``cache_policy="p2p_clique_replicate"``);
- ``host``: (c) rows in host RAM, page-locked when a GPU reads them; for a memory-mapped source,
  (d) a RAM cache of ``host_cache_size`` bytes of hot rows;
- ``disk``: (d) the memory-mapped file itself, holding all rows, for features larger than RAM.

The hot order comes from a placement policy (FAP, degree, random) or is given. Gathers keep
request order; :meth:`Feature.stats` counts rows served per tier. torch-quiver's forms work
too: a pre-set ``csr_topo.feature_order``, ``from_mmap(array, DeviceConfig(...))``,
``set_local_order`` and the IPC methods; a ``Feature`` pickles (CPU rows travel in shared
memory under ``torch.multiprocessing``), so it can be passed to ``mp.spawn``.
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

__all__ = ["Feature", "CACHE_POLICIES", "DeviceConfig"]

CACHE_POLICIES = ("device_replicate", "p2p_clique_replicate")


class DeviceConfig:
    """torch-quiver's explicit partition for :meth:`Feature.from_mmap`.

    Args:
        gpu_parts: one entry per device of ``device_list``: the rows that device caches, as
            a 1-D tensor of node ids (rows of the array given to ``from_mmap``), or, when that
            array is ``None``, a ``[rows, dim]`` feature tensor; or a path to such a tensor
            (``.npy``, or a ``torch.save`` file).
        cpu_part: the rows kept in host RAM, in the same forms.

    The store's row ``i`` is row ``i`` of ``gpu_parts[rank]`` followed by ``cpu_part`` (as in
    torch-quiver); map node ids to these rows with :meth:`Feature.set_local_order`.
    """

    def __init__(self, gpu_parts, cpu_part):
        self.gpu_parts = gpu_parts
        self.cpu_part = cpu_part


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
                raise ValueError(
                    f"device {d} requested but CUDA is not available; "
                    "use device_list=[] for a CPU-only store"
                )
        if self.devices and not 0 <= int(rank) < len(self.devices):
            raise ValueError(f"rank {rank} out of range for {len(self.devices)} devices")
        self.rank = int(rank)
        self.device_cache_size = parse_bytes(device_cache_size, "device_cache_size")
        self.host_cache_size = parse_bytes(host_cache_size, "host_cache_size")
        if self.device_cache_size and not self.devices:
            raise ValueError("device_cache_size > 0 needs a non-empty device_list")
        self.cache_policy = cache_policy
        self.csr_topo = csr_topo
        self._placement_given = placement is not None
        self.placement = placement if placement is not None else ("fap" if csr_topo else None)
        self._order_arg = order
        self.sizes, self.seed_prob, self.batch_size, self.seed = sizes, seed_prob, batch_size, seed
        self.peer_access = peer_access
        n_threads = num_threads or (os.cpu_count() or 1)
        self._gather = RowGather(n_threads)
        self._disk_gather = RowGather(num_threads or 4 * n_threads)
        self._buffers = BufferPool() if recycle_outputs else None
        self.tiers: list[Tier] = []
        self._id_map: np.ndarray | None = None  # node id -> row (set_local_order)
        self._shape: tuple[int, int] | None = None
        self._dtype: torch.dtype | None = None
        self._counts = np.zeros(0, dtype=np.int64)
        self._mmap = self._disk_map = None  # set_mmap_file

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

    def _build_device_tier(self, rows_at, n: int, row_bytes: int, per_dev=None) -> int:
        """Create the GPU tier from ``rows_at(lo, hi)`` (hot positions -> CPU tensor); returns
        the number of positions it covers for this rank."""
        if per_dev is None:
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

    def _check_source(self, shape, dtype, check_topo: bool = True) -> tuple[int, int]:
        if len(shape) != 2:
            raise ValueError(f"features must be 2-D [node_count, dim], got shape {list(shape)}")
        n, dim = int(shape[0]), int(shape[1])
        if n == 0 or dim == 0:
            raise ValueError(f"features must have rows and columns, got shape {[n, dim]}")
        if check_topo and self.csr_topo is not None and self.csr_topo.node_count != n:
            hint = ""
            if n > self.csr_topo.node_count and self.csr_topo.orientation is not None:
                hint = (
                    " (an edge list's nodes count to its largest id + 1; build it with "
                    f"CSRTopo(edge_index, num_nodes={n}) to keep the isolated nodes after it)"
                )
            raise ValueError(
                f"features have {n} rows but csr_topo has {self.csr_topo.node_count}{hint}"
            )
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
        order, fill the GPU tier, keep the rest in host RAM (pinned if a GPU reads it).

        If ``csr_topo.feature_order`` is set (torch-quiver's convention), ``x`` is taken to be
        stored in that order: row ``feature_order[v]`` of ``x`` holds node ``v``, and that
        order is the hot order unless ``placement``/``order`` was given (or it is the identity,
        which says nothing about heat). An unset ``feature_order`` is filled in, as torch-quiver
        does, with the identity permutation: ``x`` as given is the tensor in that order (the hot
        order is kept inside the store, see :meth:`hot_order`), so the same ``csr_topo`` can
        build more stores from the same ``x``.
        """
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"from_cpu_tensor expects a torch.Tensor, got {type(x).__name__}")
        n, dim = self._check_source(x.shape, x.dtype)
        x = x.detach().cpu()
        perm = None
        order = getattr(self.csr_topo, "feature_order", None)
        if order is not None:
            order = order.cpu()
            if not torch.equal(torch.sort(order).values, torch.arange(n)):
                raise ValueError(f"csr_topo.feature_order must be a permutation of the {n} rows")
            identity = torch.equal(order, torch.arange(n))
            if not identity:
                x = x[order]  # row v = node v
                if self._order_arg is None and not self._placement_given:
                    perm = torch.argsort(order)  # the node stored first is the hottest
        elif self.csr_topo is not None:
            self.csr_topo.feature_order = torch.arange(n)  # torch-quiver leaves a permutation
        if perm is None:
            perm = self._hot_order(n)
        self._id_map = None
        self._load_rows(x, perm)
        return self

    def _load_rows(self, x: torch.Tensor, perm: torch.Tensor, per_dev=None) -> None:
        """Build the tiers from id-ordered rows ``x`` and the hot order ``perm``."""
        n, dim = x.shape
        row_bytes = dim * x.element_size()
        self.tiers = []
        g = self._build_device_tier(lambda lo, hi: x[perm[lo:hi]], n, row_bytes, per_dev)
        if g < n:
            host = x[perm[g:]].contiguous()
            if any(d.type == "cuda" for d in self.devices):
                host = host.pin_memory()
            self.tiers.append(HostTier(g, n, host, self._gather))
        self._finish(perm)

    def from_mmap(
        self, source, device_config: DeviceConfig | None = None, dtype: torch.dtype | None = None
    ) -> Feature:
        """Serve features from a memory-mapped ``.npy`` file (or an ``np.memmap``) holding all
        rows in id order: the hottest rows go to the GPU tier and a RAM cache of
        ``host_cache_size`` bytes; the rest is read from the file on demand.

        ``dtype`` reinterprets the file's items as this torch dtype of the same size (rows are
        copied as raw words): ``torch.bfloat16`` for the ``uint16`` bit patterns ``quiver
        prepare --feature-dtype bf16`` writes (numpy has no bfloat16).

        With a :class:`DeviceConfig` (torch-quiver's form), the store holds exactly the rows
        it names: ``gpu_parts[rank]`` (on the devices; in host RAM when ``device_list`` is
        empty) followed by ``cpu_part``, read from ``source`` (an array, or ``None`` when the
        parts are feature tensors themselves). Row ``i`` of that sequence answers id ``i``
        until :meth:`set_local_order` maps node ids to rows.
        """
        if device_config is not None:
            return self._from_device_config(source, device_config)
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
        file_dtype = torch.from_numpy(arr[:0].copy()).dtype
        if dtype is not None and torch.empty(0, dtype=dtype).element_size() != arr.itemsize:
            raise ValueError(f"dtype {dtype} does not match the file's {arr.itemsize}-byte items")
        n, dim = self._check_source(arr.shape, dtype or file_dtype)
        self._id_map = None
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
            return torch.from_numpy(out).view(self._dtype)

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

    def _from_device_config(self, source, config: DeviceConfig) -> Feature:
        if not isinstance(config, DeviceConfig):
            raise ValueError(f"device_config must be a DeviceConfig, got {type(config).__name__}")
        if isinstance(source, str | os.PathLike):
            source = np.load(source, mmap_mode="r")
        if source is not None and not isinstance(source, np.ndarray | torch.Tensor):
            raise ValueError(f"from_mmap expects an array or None, got {type(source).__name__}")
        gpu_parts = list(config.gpu_parts)
        if self.devices and len(gpu_parts) != len(self.devices):
            raise ValueError(
                f"DeviceConfig has {len(gpu_parts)} gpu_parts for {len(self.devices)} devices"
            )
        if self.devices and self.cache_policy != "device_replicate":
            raise ValueError(
                "from_mmap with a DeviceConfig supports cache_policy='device_replicate'"
            )

        def rows(part, name: str) -> torch.Tensor:
            if isinstance(part, str | os.PathLike):
                path = Path(part)
                if not path.is_file():
                    raise FileNotFoundError(f"DeviceConfig {name} file not found: {path}")
                return torch.as_tensor(np.load(path) if path.suffix == ".npy" else torch.load(path))
            if source is None:
                return torch.as_tensor(part)
            ids = torch.as_tensor(part).cpu()
            if ids.dtype.is_floating_point or ids.dim() != 1:
                raise ValueError(f"DeviceConfig {name} must be 1-D node ids when an array is given")
            return torch.as_tensor(np.asarray(source[ids.numpy()]))

        mine = rows(gpu_parts[self.rank], "gpu_parts") if gpu_parts else None
        cpu = rows(config.cpu_part, "cpu_part")
        parts = [p for p in (mine, cpu) if p is not None and p.numel()]
        if not parts:
            raise ValueError("DeviceConfig names no rows")
        x = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
        n, _ = self._check_source(x.shape, x.dtype, check_topo=False)
        per_dev = 0 if mine is None or not self.devices else int(mine.shape[0])
        self._id_map = None
        self._load_rows(x, torch.arange(n), per_dev)
        return self

    def set_local_order(self, local_order) -> None:
        """torch-quiver's ``set_local_order``: ``local_order[i]`` is the node id held in row
        ``i``; afterwards ``feature[ids]`` takes node ids. Pass ``None`` to clear."""
        self._check_loaded()
        if local_order is None:
            self._id_map = None
            return
        lo = torch.as_tensor(local_order).cpu()
        n = self._shape[0]
        if lo.dim() != 1 or lo.numel() != n or lo.dtype.is_floating_point:
            raise ValueError(f"local_order must be 1-D integer ids, one per row ({n})")
        lo = lo.to(torch.int64)
        if not torch.equal(torch.sort(lo).values, torch.arange(n)):
            raise ValueError(f"local_order must be a permutation of 0..{n - 1}")
        id_map = np.empty(n, dtype=np.int64)
        id_map[lo.numpy()] = np.arange(n)
        self._id_map = id_map

    def set_mmap_file(self, path, disk_map) -> None:
        """torch-quiver's ``set_mmap_file``: rows not held in memory are read from a ``.npy``
        file holding every node's row in id order.

        Args:
            path: the ``.npy`` file (memory-mapped, read on demand).
            disk_map: ``[N]`` integer tensor over node ids: ``disk_map[v] >= 0`` is the row of
                this store holding node ``v`` (as :meth:`from_mmap` with a
                :class:`DeviceConfig` lays them out), negative for a node read from the file.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"set_mmap_file: no such file {path}")
        arr = np.load(path, mmap_mode="r")
        dm = torch.as_tensor(disk_map).cpu()
        if dm.dim() != 1 or dm.dtype.is_floating_point or dm.numel() != arr.shape[0]:
            raise ValueError(
                f"disk_map must be 1-D integers, one per row of {path.name} ({arr.shape[0]})"
            )
        self._mmap, self._mmap_path, self._disk_map = arr, str(path), dm.to(torch.int64)

    def _gather_with_disk(self, n_id) -> torch.Tensor:
        ids = torch.as_tensor(n_id).cpu().to(torch.int64)
        n = self._disk_map.numel()
        if ids.dim() != 1 or (ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n)):
            raise ValueError(f"ids must be 1-D node ids in [0, {n})")
        local = self._disk_map[ids]
        on_disk = local < 0
        out = torch.empty((ids.numel(), self._mmap.shape[1]), dtype=self.dtype)
        if bool((~on_disk).any()):
            out[~on_disk] = self.gather(local[~on_disk]).cpu()
        if bool(on_disk.any()):
            rows = np.asarray(self._mmap[ids[on_disk].numpy()])
            out[on_disk] = torch.from_numpy(rows).to(self.dtype)
        return out.to(self.device)

    # ------------------------------------------------------------------ processes

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for k in ("_gather", "_disk_gather", "_buffers", "_pos_np", "_starts", "_stops"):
            state.pop(k, None)
        state["_num_threads"] = (self._gather.num_threads, self._disk_gather.num_threads)
        state["_recycle"] = self._buffers is not None
        state["tiers"] = [_tier_spec(t) for t in self.tiers]
        state["_mmap"] = None  # reopened from _mmap_path
        return state

    def __setstate__(self, state: dict) -> None:
        n_threads, disk_threads = state.pop("_num_threads")
        recycle = state.pop("_recycle")
        specs = state.pop("tiers")
        self.__dict__.update(state)
        self._gather = RowGather(n_threads)
        self._disk_gather = RowGather(disk_threads)
        self._buffers = BufferPool() if recycle else None
        self.tiers = [_tier_from_spec(s, self._gather, self._disk_gather) for s in specs]
        if getattr(self, "_disk_map", None) is not None:
            self._mmap = np.load(self._mmap_path, mmap_mode="r")
        counts = self._counts
        if self.tiers:
            self._finish(self._perm)
            self._counts = counts

    def share_ipc(self):
        """torch-quiver's IPC handle (a tuple holding this store); pass it to worker
        processes and rebuild there with :meth:`new_from_ipc_handle`. The store pickles
        itself too, so it can also go to ``mp.spawn`` directly."""
        return ("quiver.Feature", self)

    @classmethod
    def new_from_ipc_handle(cls, rank, ipc_handle) -> Feature:
        """The store of a :meth:`share_ipc` handle, gathering to ``rank`` (a device ordinal
        of ``device_list``, as in torch-quiver; ignored by a CPU-only store)."""
        feature = cls.lazy_from_ipc_handle(ipc_handle)
        if feature.devices:
            want = _as_device(rank)
            if want not in feature.devices:
                raise ValueError(f"rank {rank} is not in device_list {feature.devices}")
            feature.rank = feature.devices.index(want)
        return feature

    @classmethod
    def lazy_from_ipc_handle(cls, ipc_handle) -> Feature:
        """The store of a :meth:`share_ipc` handle, gathering to the current CUDA device when
        it is one of ``device_list`` (torch-quiver's behaviour), else to its own ``rank``."""
        if not (isinstance(ipc_handle, tuple) and len(ipc_handle) == 2):
            raise ValueError("not a quiver.Feature IPC handle (expected Feature.share_ipc())")
        tag, feature = ipc_handle
        if tag != "quiver.Feature" or not isinstance(feature, Feature):
            raise ValueError("not a quiver.Feature IPC handle (expected Feature.share_ipc())")
        import copy

        feature = copy.copy(feature)
        if feature.devices and torch.cuda.is_available():
            here = torch.device("cuda", torch.cuda.current_device())
            if here in feature.devices:
                feature.rank = feature.devices.index(here)
        return feature

    def lazy_init_from_ipc_handle(self) -> None:
        """torch-quiver's deferred set-up after ``lazy_from_ipc_handle``; a no-op here."""

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
        if getattr(self, "_disk_map", None) is not None:
            return self._gather_with_disk(n_id)
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
        if self._id_map is not None and ids.size:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= n:
                raise ValueError(f"node ids must lie in [0, {n}); got {lo if lo < 0 else hi}")
            ids = self._id_map[ids]
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


def _tier_spec(t: Tier) -> tuple:
    """A picklable description of a tier (its tensors, not its threads or numpy views)."""
    if isinstance(t, ReplicatedTier):
        return ("device", t.start, t.stop, t.replicas)
    if isinstance(t, CliqueTier):
        return ("clique", t.start, t.stop, t.shards)
    if isinstance(t, HostTier):
        return ("host", t.start, t.stop, t.rows)
    if isinstance(t, DiskTier):
        a = t.array
        if isinstance(a, np.memmap) and a.filename is not None:
            src = ("file", str(a.filename), int(a.offset), a.dtype.str, a.shape)
        else:
            src = ("array", a)
        return ("disk", t.start, t.stop, src, t.perm)
    raise AssertionError(f"unknown tier {type(t).__name__}")


def _tier_from_spec(spec: tuple, gather: RowGather, disk_gather: RowGather) -> Tier:
    kind, start, stop, *rest = spec
    if kind == "device":
        return ReplicatedTier(start, stop, rest[0], gather)
    if kind == "clique":
        return CliqueTier(start, stop, rest[0], gather)
    if kind == "host":
        return HostTier(start, stop, rest[0], gather)
    src, perm = rest
    if src[0] == "file":
        _, name, offset, dtype, shape = src
        arr = np.memmap(name, dtype=np.dtype(dtype), mode="r", offset=offset, shape=shape)
    else:
        arr = src[1]
    return DiskTier(start, stop, arr, perm, disk_gather)
