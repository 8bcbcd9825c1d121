"""torch-quiver compatible sampling API, and a PyG ``BaseSampler`` for ``NodeLoader``.

``GraphSageSampler(csr_topo, sizes, device, mode).sample(seeds)`` returns
``(n_id, batch_size, adjs)`` exactly like torch-quiver and PyG's legacy ``NeighborSampler``,
so existing training and inference loops (``for edge_index, _, size in adjs``) run unchanged.
torch-quiver's device forms (``device=-1``/``0``/``"CPU"`` with ``mode="CPU"``), repeated
seeds, ``sample_prob`` and the IPC methods (``share_ipc``/``lazy_from_ipc_handle``) work too.
"""

from __future__ import annotations

import torch

from quiver.graph import CSRTopo
from quiver.sampling import CPUSampler, TorchSampler
from quiver.sampling.base import Adj, SampledSubgraph

__all__ = [  # noqa: F822 (QuiverNodeSampler: lazy)
    "GraphSageSampler",
    "MixedGraphSageSampler",
    "QuiverNodeSampler",
    "SampleJob",
]

MODES = ("CPU", "GPU", "UVA")
#: torch-quiver's ``MixedGraphSageSampler`` modes: a device sampler, with CPU workers or alone
MIXED_MODES = ("UVA_CPU_MIXED", "GPU_CPU_MIXED", "UVA_ONLY", "GPU_ONLY")


def _resolve_device(device, mode: str) -> torch.device | None:
    """torch-quiver's device argument -> where results go (``None``: the sampler's default).

    In ``CPU`` mode an integer ordinal (torch-quiver passes ``-1``, ``0``, ...) and ``"CPU"``
    mean the host, as in torch-quiver; an explicit ``torch.device``/``"cuda:1"`` string moves
    the results there. In ``GPU``/``UVA`` mode an ordinal names a CUDA device.
    """
    if isinstance(device, str) and device.lower() == "cpu":
        return torch.device("cpu")
    if mode == "CPU":
        if device is None or isinstance(device, int):
            return torch.device("cpu")
        d = torch.device(device)
    elif device is None:
        return None
    elif isinstance(device, int):
        if device < 0:
            raise ValueError(
                f"mode={mode!r} needs a GPU ordinal >= 0, got device={device}; "
                "use mode='CPU' to sample on the host"
            )
        d = torch.device("cuda", device)
    else:
        d = torch.device(device)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"mode={mode!r} with device={device!r} needs CUDA, which is not available here; "
            "use mode='CPU' (device=-1, 0 or 'CPU') to sample on the host"
        )
    return d


def _build_sampler(csr_topo, sizes, device, mode, seed, num_threads, frontier):
    if not isinstance(csr_topo, CSRTopo):
        raise ValueError(f"csr_topo must be a quiver.CSRTopo, got {type(csr_topo).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "CPU":
        return CPUSampler(
            csr_topo.to("cpu"), sizes, seed=seed, num_threads=num_threads, frontier=frontier
        )
    return TorchSampler(csr_topo, sizes, device=device, mode=mode, seed=seed, frontier=frontier)


class GraphSageSampler:
    """GraphSAGE-style k-hop neighbour sampler with torch-quiver's interface.

    Args:
        csr_topo: the graph (``quiver.CSRTopo``).
        sizes: per-hop fanouts, innermost first, e.g. ``[15, 10, 5]``; ``-1`` = all neighbours.
        device: in ``CPU`` mode, an integer (torch-quiver's ``-1``/``0``), ``"CPU"`` or ``None``
            return CPU tensors, as torch-quiver does; a ``torch.device``/``"cuda:N"`` string
            moves the results there. In ``GPU`` mode the device of the kernel, the topology
            and the results (an ordinal ``N`` = ``cuda:N``; default: the topology's device, so
            a CPU topology runs the torch kernel on the CPU); in ``UVA`` mode the CUDA device.
            A CUDA device without CUDA raises ``ValueError``.
        mode: ``"CPU"`` (default here; torch-quiver's default is ``"UVA"``: numba kernel on
            host threads), ``"GPU"`` (vectorized torch kernel on ``device``) or ``"UVA"``
            (torch kernel on the GPU reading a pinned host topology; needs CUDA).
        seed: seed for reproducible sampling; ``None`` draws one.
        num_threads: CPU mode only: numba threads per call (default: all cores).
        frontier: ``False`` (default, torch-quiver's and PyG's legacy ``NeighborSampler``'s
            semantics) samples every gathered node at each hop; ``True`` only each hop's new
            nodes, as PyG's ``NeighborLoader``: the hops' edges then never repeat, so their
            concatenation is the subgraph a ``forward(x, edge_index)`` model runs on.
    """

    def __init__(
        self,
        csr_topo: CSRTopo,
        sizes,
        device=None,
        mode: str = "CPU",
        seed: int | None = None,
        num_threads: int | None = None,
        frontier: bool = False,
    ):
        if isinstance(mode, str) and mode.upper() in MODES:
            mode = mode.upper()
        self.mode = mode
        self.sizes = list(sizes)
        self.frontier = bool(frontier)
        self.csr_topo = csr_topo
        resolved = _resolve_device(device, mode) if mode in MODES else None
        kernel_device = resolved if mode != "CPU" else None
        self.sampler = _build_sampler(
            csr_topo, sizes, kernel_device, mode, seed, num_threads, self.frontier
        )
        self._options = {"seed": seed, "num_threads": num_threads, "frontier": self.frontier}
        if resolved is None:
            resolved = getattr(self.sampler, "device", torch.device("cpu"))
        self.device = torch.device(resolved)

    def sample_subgraph(self, seeds) -> SampledSubgraph:
        """The flat :class:`~quiver.sampling.SampledSubgraph` (on the sampler's device);
        repeated seeds allowed, as in :meth:`sample`."""
        return self.sampler.sample_subgraph(seeds, repeats=True)

    def sample(self, seeds) -> tuple[torch.Tensor, int, list[Adj]]:
        """Sample the k-hop neighbourhood of ``seeds``.

        Args:
            seeds: 1-D integer node ids in ``[0, node_count)``. Repeats are allowed (e.g.
                torch-quiver's unsupervised example samples ``torch.cat([batch, pos, neg])``):
                each occurrence gets its own target row, ``n_id[:len(seeds)] == seeds``, and
                the occurrences of one node share one sample of its neighbourhood.

        Returns:
            ``(n_id, batch_size, adjs)``: ``n_id`` global ids with the seeds first;
            ``batch_size = len(seeds)``; ``adjs[i] = (edge_index, e_id, size)`` from the
            outermost hop to the seeds' hop, ``edge_index`` in local ids (row 0 source).

        Raises:
            ValueError: seeds of a non-integer dtype, not 1-D, negative or ``>= node_count``.
        """
        n_id, batch_size, adjs = self.sampler.sample(seeds, repeats=True)
        if n_id.device != self.device:
            n_id = n_id.to(self.device)
            adjs = [a.to(self.device) for a in adjs]
        return n_id, batch_size, adjs

    def sample_prob(self, train_idx, total_node_count: int) -> torch.Tensor:
        """torch-quiver's ``sample_prob``: per node, the probability that sampling from all of
        ``train_idx`` as seeds reaches it (quiver's FAP, :func:`quiver.workload.access_probability`
        with the training nodes as certain seeds; torch-quiver's kernel is a cruder estimate of
        the same quantity, so values differ but rank nodes alike).

        Args:
            train_idx: 1-D integer ids of the seed nodes.
            total_node_count: the graph's node count (checked).

        Returns:
            ``[total_node_count]`` float32 tensor on :attr:`device` (1.0 at ``train_idx``).
        """
        from quiver.sampling.base import check_seeds
        from quiver.workload import access_probability

        n = self.csr_topo.node_count
        if int(total_node_count) != n:
            raise ValueError(f"total_node_count is {total_node_count} but the graph has {n} nodes")
        p0 = torch.zeros(n, dtype=torch.float64)
        p0[check_seeds(train_idx, n).cpu()] = 1.0
        prob = access_probability(self.csr_topo.to("cpu"), self.sizes, p0, self.frontier)
        return prob.to(self.device)

    def lazy_init_quiver(self) -> None:
        """torch-quiver's lazy kernel set-up; here the sampler is ready once built (no-op)."""

    def share_ipc(self):
        """torch-quiver's IPC handle: ``(csr_topo, sizes, mode, options)``, picklable (the
        topology's tensors travel in shared memory under ``torch.multiprocessing``). The
        sampler itself pickles too, so it can also be passed to ``mp.spawn`` directly."""
        return self.csr_topo, self.sizes, self.mode, dict(self._options)

    @classmethod
    def lazy_from_ipc_handle(cls, ipc_handle) -> GraphSageSampler:
        """Rebuild a sampler from :meth:`share_ipc`'s handle in a worker process; ``GPU`` and
        ``UVA`` samplers go to the worker's current CUDA device, as in torch-quiver."""
        csr_topo, sizes, mode, *rest = ipc_handle
        options = rest[0] if rest else {}
        device = None
        if mode in ("GPU", "UVA") and torch.cuda.is_available():
            device = torch.cuda.current_device()
        return cls(csr_topo, sizes, device, mode, **options)


class SampleJob:
    """torch-quiver's ``SampleJob``: the tasks an epoch samples, one seed batch per index.

    Subclass it and define ``__getitem__`` (the seeds of task ``index``), ``__len__`` and
    ``shuffle`` (called at the start of every pass of :class:`MixedGraphSageSampler`).
    """

    def __getitem__(self, index):
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def shuffle(self) -> None:
        raise NotImplementedError


class MixedGraphSageSampler:
    """torch-quiver's ``MixedGraphSageSampler``: iterate over a :class:`SampleJob`, yielding
    ``sample(job[i])`` (``(n_id, batch_size, adjs)``) for every task, in task order.

    torch-quiver splits the tasks between a GPU/UVA sampler and CPU worker processes. Here the
    tasks are sampled by quiver's CPU :class:`GraphSageSampler` on ``num_workers`` threads
    (its kernel releases the GIL), in order; a ``*_MIXED``/``*_ONLY`` mode is accepted and
    the device part runs on the host too (the results are the same samples).

    Args:
        sample_job: the tasks; ``shuffle()`` runs at the start of each iteration.
        num_workers: sampling threads (>= 1; torch-quiver's CPU worker processes).
        csr_topo: the graph.
        sizes: fanouts, outermost hop last, as :class:`GraphSageSampler`.
        device: torch-quiver's device ordinal; unused on the host.
        mode: one of :data:`MIXED_MODES`.
        seed: seed of the sampler (default: random).
    """

    def __init__(
        self,
        sample_job: SampleJob,
        num_workers: int,
        csr_topo: CSRTopo,
        sizes,
        device=0,
        mode: str = "UVA_CPU_MIXED",
        seed: int | None = None,
    ):
        if mode not in MIXED_MODES:
            raise ValueError(f"mode must be one of {MIXED_MODES}, got {mode!r}")
        if int(num_workers) < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.sample_job = sample_job
        self.num_workers = max(int(num_workers), 1)
        self.csr_topo, self.sizes, self.device, self.mode = csr_topo, list(sizes), device, mode
        self.sampler = GraphSageSampler(csr_topo, sizes, mode="CPU", seed=seed)

    def __len__(self) -> int:
        return len(self.sample_job)

    def __iter__(self):
        from concurrent.futures import ThreadPoolExecutor

        self.sample_job.shuffle()
        tasks = [self.sample_job[i] for i in range(len(self.sample_job))]
        with ThreadPoolExecutor(self.num_workers, thread_name_prefix="quiver-mixed") as pool:
            yield from pool.map(self.sampler.sample, tasks)

    def share_ipc(self):
        """torch-quiver's IPC handle: the constructor's arguments (picklable)."""
        return self.sample_job, self.num_workers, self.csr_topo, self.sizes, self.device, self.mode

    @classmethod
    def lazy_from_ipc_handle(cls, ipc_handle) -> MixedGraphSageSampler:
        """Rebuild from :meth:`share_ipc`'s handle in a worker process."""
        return cls(*ipc_handle)


def _make_node_sampler():
    """Build ``QuiverNodeSampler`` on first use: its base class needs ``torch_geometric``,
    whose import takes seconds, so ``quiver.pyg`` (and worker processes unpickling a
    ``GraphSageSampler``) do not pay for it otherwise."""
    from torch_geometric.sampler import BaseSampler

    class QuiverNodeSampler(BaseSampler):
        """A ``torch_geometric.sampler.BaseSampler`` so PyG's ``NodeLoader`` can use our kernels.

        It samples like PyG's ``NeighborSampler`` (only the nodes a hop adds are expanded at the
        next hop), so the edges of different hops never repeat and a ``Data`` batch from
        ``NodeLoader`` feeds a PyG model directly.

        Args:
            csr_topo: the graph; its ``eid`` (set by ``CSRTopo.from_edge_index``/``from_pyg``) maps
                sampled edges back to the ``Data``'s edge order, which ``NodeLoader`` uses to slice
                edge attributes.
            num_neighbors: per-hop fanouts, innermost first.
            mode: ``"CPU"`` or ``"GPU"`` (the torch kernel on the topology's device).
            seed: seed for reproducible sampling.
            num_threads: CPU mode only: numba threads per call.

        Example::

            loader = NodeLoader(data, QuiverNodeSampler(CSRTopo.from_pyg(data), [15, 10]),
                                input_nodes=train_idx, batch_size=1024)
        """

        def __init__(
            self,
            csr_topo: CSRTopo,
            num_neighbors,
            mode: str = "CPU",
            seed: int | None = None,
            num_threads: int | None = None,
        ):
            if mode == "UVA":
                raise ValueError("QuiverNodeSampler supports mode 'CPU' or 'GPU'")
            self.sampler = _build_sampler(
                csr_topo, num_neighbors, None, mode, seed, num_threads, True
            )

        def sample_from_nodes(self, index, **kwargs):
            """Sample from ``index.node`` (a ``NodeSamplerInput``); returns a ``SamplerOutput``."""
            from torch_geometric.sampler import SamplerOutput

            out = self.sampler.sample_subgraph(index.node)
            return SamplerOutput(
                node=out.n_id.cpu(),
                row=out.src.cpu(),
                col=out.dst.cpu(),
                edge=out.e_id.cpu(),
                num_sampled_nodes=[b - a for a, b in zip([0] + out.num_nodes[:-1], out.num_nodes)],
                num_sampled_edges=[b - a for a, b in zip(out.edge_ptr[:-1], out.edge_ptr[1:])],
                metadata=(index.input_id, index.time),
            )

        def sample_from_edges(self, index, neg_sampling=None):
            raise NotImplementedError("QuiverNodeSampler samples from nodes only")

    QuiverNodeSampler.__module__ = __name__
    QuiverNodeSampler.__qualname__ = "QuiverNodeSampler"  # pickles by name, via __getattr__
    return QuiverNodeSampler


_node_sampler_cls = None


def __getattr__(name):
    global _node_sampler_cls
    if name == "QuiverNodeSampler":
        if _node_sampler_cls is None:
            _node_sampler_cls = _make_node_sampler()
        return _node_sampler_cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
