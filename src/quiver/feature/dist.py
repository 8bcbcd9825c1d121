"""``DistFeature``: feature rows partitioned across hosts, gathered over torch.distributed.

Each host process holds its own rows (owned + replicated, :mod:`quiver.feature.partition`)
in a local :class:`quiver.Feature` (its tiers) and a map ``owner[v]`` of every row's owner.
``dist_feature[n_id]`` returns exactly ``x[n_id]``: the local rows are read from the local
store, the others are fetched from their owners in **one batched exchange**: an
``all_to_all`` of request counts, one of the requested ids (deduplicated) and one of the
rows (sent as raw bytes, so float32 and bfloat16 rows travel alike). Like torch-quiver's
``quiver.DistFeature``, a gather is a *collective*: every process of the group calls it once
per step (a process with nothing to read passes an empty ``n_id``), so each one also answers
the others' requests. gloo on CPU; the same calls run on NCCL with CUDA tensors.

:class:`NcclComm` and :func:`getNcclId` keep torch-quiver's communicator API for the code that
builds one per worker and hands it to ``DistFeature(feature, info, comm)``: here the id is the
rendezvous address of a ``torch.distributed`` gloo group and the communicator's point-to-point
calls, ``allreduce`` and ``exchange`` run over it (CPU tensors; no NCCL).
"""

from __future__ import annotations

import os
import time

import torch

__all__ = ["DistFeature", "NcclComm", "getNcclId"]

_ID_SCHEME = "quiver-gloo://"


class DistFeature:
    """A host's shard of a row-partitioned feature matrix.

    Args:
        local: the host's rows, in ``local_ids`` order: a ``[L, F]`` tensor, or a loaded
            :class:`quiver.Feature` over those ``L`` rows.
        local_ids: ``[L]`` sorted distinct global ids of those rows (owned + replicated).
        owner: ``[N]`` owner host of every row (every row this host owns must be local).
        group: the ``torch.distributed`` process group (default: the world); its rank is the
            host id.

    torch-quiver's form ``DistFeature(feature, info, comm)`` works too: ``info`` a
    :class:`quiver.partition.PartitionInfo` (``local`` then holds its rows in that host's
    local order: owned ids ascending, then its replicas), ``comm`` a :class:`NcclComm` (the
    exchange runs over its group: one process per host), a ``ProcessGroup``, or anything
    else (then the default ``torch.distributed`` group); both stay reachable as ``info`` and
    ``comm``.
    """

    def __init__(self, local, local_ids, owner=None, group=None):
        import torch.distributed as dist

        from quiver.feature.store import Feature

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("DistFeature needs torch.distributed initialised (init_process_group)")
        from quiver.feature.partition_info import PartitionInfo

        self.info = self.comm = None
        if isinstance(local_ids, PartitionInfo):  # torch-quiver's (feature, info, comm)
            info, comm = local_ids, owner
            self.info, self.comm = info, comm
            if isinstance(comm, NcclComm):
                group = comm.group
            elif isinstance(comm, dist.ProcessGroup):
                group = comm
            if info.host != dist.get_rank(group) or info.hosts != dist.get_world_size(group):
                raise ValueError(
                    f"PartitionInfo is for host {info.host} of {info.hosts}; this process is "
                    f"rank {dist.get_rank(group)} of {dist.get_world_size(group)}"
                )
            ids, by_id = torch.sort(info.local_order)
            if local.shape[0] != ids.numel():
                raise ValueError(
                    f"feature has {local.shape[0]} rows; PartitionInfo gives host {info.host} "
                    f"{ids.numel()} (owned + replicate)"
                )
            local, local_ids, owner = local[by_id], ids, info.owner
        elif owner is None:
            raise ValueError("DistFeature needs owner (or torch-quiver's PartitionInfo)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        owner = torch.as_tensor(owner).to(torch.int64).cpu()
        local_ids = torch.as_tensor(local_ids, dtype=torch.int64).cpu()
        n = owner.numel()
        if owner.ndim != 1 or local_ids.ndim != 1:
            raise ValueError("owner and local_ids must be 1-D")
        if n and (int(owner.min()) < 0 or int(owner.max()) >= self.world_size):
            raise ValueError(f"owner holds host ids outside [0, {self.world_size})")
        if local_ids.numel() and (
            int(local_ids.min()) < 0
            or int(local_ids.max()) >= n
            or bool((local_ids[1:] <= local_ids[:-1]).any())
        ):
            raise ValueError(f"local_ids must be sorted distinct ids in [0, {n})")
        g2l = torch.full((n,), -1, dtype=torch.int64)
        g2l[local_ids] = torch.arange(local_ids.numel())
        missing = int(((owner == self.rank) & (g2l < 0)).sum())
        if missing:
            raise ValueError(f"host {self.rank} owns {missing} rows that are not in local_ids")
        if isinstance(local, torch.Tensor):
            if local.ndim != 2 or local.shape[0] != local_ids.numel():
                raise ValueError(
                    f"local rows have shape {list(local.shape)}, expected [{local_ids.numel()}, F]"
                )
            local = Feature(recycle_outputs=False).from_cpu_tensor(local.contiguous())
        elif not isinstance(local, Feature):
            raise ValueError(f"local must be a tensor or a quiver.Feature, got {type(local)}")
        if local.shape[0] != local_ids.numel():
            raise ValueError(
                f"local store has {local.shape[0]} rows, local_ids {local_ids.numel()}"
            )
        self.local = local
        self.local_ids = local_ids
        self.owner = owner
        self._g2l = g2l
        self._dim = int(local.shape[1])
        self._dtype = local.dtype
        self.reset_stats()

    @classmethod
    def from_prepared(cls, directory, group=None, **feature_kwargs) -> DistFeature:
        """This process's shard of a partitioned prepared directory (``quiver partition``):
        its owned + replicated rows read from the memory-mapped features into a local
        :class:`quiver.Feature` (``feature_kwargs`` go to its constructor)."""
        import torch.distributed as dist

        from quiver.datasets import load_prepared
        from quiver.feature.partition import load_partition
        from quiver.feature.store import Feature

        part = load_partition(directory)
        if part is None:
            raise ValueError(f"{directory} has no partition (run `quiver partition` first)")
        world = dist.get_world_size(group)
        if world != part.hosts:
            raise ValueError(
                f"{directory} is partitioned for {part.hosts} hosts, group has {world}"
            )
        ids = part.local_ids(dist.get_rank(group))
        x = load_prepared(directory).features
        rows = x[torch.from_numpy(ids)].contiguous()
        local = Feature(**feature_kwargs).from_cpu_tensor(rows)
        return cls(local, ids, part.owner, group)

    # ------------------------------------------------------------------------------ gather

    @property
    def shape(self) -> torch.Size:
        return torch.Size([self.owner.numel(), self._dim])

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def reset_stats(self) -> None:
        self._stats = {"local_rows": 0, "remote_rows": 0, "served_rows": 0, "exchange_s": 0.0}
        self._stats["gathers"] = 0

    def stats(self) -> dict:
        """Rows read locally / fetched from other hosts (after deduplication) / served to
        them, seconds spent in the exchange, gathers."""
        return dict(self._stats)

    def __getitem__(self, n_id) -> torch.Tensor:
        return self.gather(n_id)

    def _rows_bytes(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.contiguous().view(torch.uint8).reshape(rows.shape[0], -1)

    def gather(self, n_id) -> torch.Tensor:
        """``x[n_id]`` (a collective: every host of the group calls it once per step)."""

        n_id = torch.as_tensor(n_id, dtype=torch.int64).cpu().reshape(-1)
        n = self.owner.numel()
        if n_id.numel() and (int(n_id.min()) < 0 or int(n_id.max()) >= n):
            # still take part in the exchange, so the other hosts do not hang
            self._exchange(torch.zeros(0, dtype=torch.int64))
            raise ValueError(f"node ids must lie in [0, {n})")
        out = torch.empty((n_id.numel(), self._dim), dtype=self._dtype)
        pos = self._g2l[n_id]
        is_local = pos >= 0
        if bool(is_local.all()):
            if n_id.numel():
                out[:] = self.local[pos]
            self._stats["local_rows"] += n_id.numel()
            self._exchange(torch.zeros(0, dtype=torch.int64))
            return out
        loc = torch.nonzero(is_local).reshape(-1)
        rem = torch.nonzero(~is_local).reshape(-1)
        if loc.numel():
            out[loc] = self.local[pos[loc]]
        uniq, inverse = torch.unique(n_id[rem], return_inverse=True)
        fetched = self._exchange(uniq)
        out[rem] = fetched[inverse]
        self._stats["local_rows"] += loc.numel()
        self._stats["remote_rows"] += uniq.numel()
        return out

    def _exchange(self, want: torch.Tensor) -> torch.Tensor:
        """Fetch the rows of the distinct remote ids ``want`` from their owners while
        answering the other hosts' requests: three ``all_to_all``\\s (counts, ids, rows)."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        k = self.world_size
        dest = self.owner[want]
        order = torch.argsort(dest, stable=True)
        send_ids = want[order]
        send_counts = torch.bincount(dest, minlength=k).to(torch.int64)
        recv_counts = torch.empty(k, dtype=torch.int64)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        recv_ids = torch.empty(sum(rc), dtype=torch.int64)
        dist.all_to_all_single(recv_ids, send_ids, rc, sc, group=self.group)
        # answer: rows the others asked for, all owned (hence local) here
        row_bytes = self._dim * self._dtype.itemsize
        if recv_ids.numel():
            if bool((self.owner[recv_ids] != self.rank).any()):
                raise RuntimeError(f"host {self.rank} was asked for rows it does not own")
            answer = self._rows_bytes(self.local[self._g2l[recv_ids]])
        else:
            answer = torch.empty((0, row_bytes), dtype=torch.uint8)
        got = torch.empty((send_ids.numel(), row_bytes), dtype=torch.uint8)
        dist.all_to_all_single(got, answer, sc, rc, group=self.group)
        rows = torch.empty((want.numel(), self._dim), dtype=self._dtype)
        if want.numel():
            rows[order] = got.view(self._dtype).reshape(-1, self._dim)
        self._stats["served_rows"] += recv_ids.numel()
        self._stats["exchange_s"] += time.perf_counter() - t0
        self._stats["gathers"] += 1
        return rows

    def __repr__(self) -> str:
        return (
            f"DistFeature(host={self.rank}/{self.world_size}, rows={self.owner.numel()}, "
            f"local={self.local_ids.numel()}, dim={self._dim}, dtype={self._dtype})"
        )


# --------------------------------------------------------------------- torch-quiver's comm


def getNcclId(host: str | None = None, port: int | None = None) -> bytes:
    """torch-quiver's ``getNcclId``: the id every worker passes to :class:`NcclComm`.

    Here it is the rendezvous address of a gloo group (bytes, like torch-quiver's, so it
    travels through a ``TCPStore`` or ``mp.spawn`` arguments the same way). Create it once,
    on the host where rank 0 runs.

    Args:
        host: address the other ranks reach rank 0 at (default ``$MASTER_ADDR``, else
            ``127.0.0.1``: one machine).
        port: a TCP port free on that host (default: one free here now).
    """
    import socket

    host = host or os.environ.get("MASTER_ADDR", "127.0.0.1")
    if port is None:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    if not 0 < int(port) < 65536:
        raise ValueError(f"port must be in [1, 65535], got {port}")
    return f"{_ID_SCHEME}{host}:{int(port)}".encode()


class _HostRankTable:
    """torch-quiver's ``HostRankTable``: global rank ``r`` lives on host ``r // rank_per_host``
    and talks to the same local index on every other host."""

    def __init__(self, hosts: int, rank_per_host: int):
        self.hosts, self.rank_per_host = hosts, rank_per_host

    def ranks(self, host: int) -> list[int]:
        return list(range(host * self.rank_per_host, (host + 1) * self.rank_per_host))

    def host(self, rank: int) -> int:
        return rank // self.rank_per_host

    def remote_peer(self, rank: int, host: int) -> int:
        return host * self.rank_per_host + rank % self.rank_per_host


class NcclComm:
    """torch-quiver's ``NcclComm`` on CPU: a gloo ``torch.distributed`` group with its
    ``send``/``recv``/``allreduce`` and the feature ``exchange`` of ``DistFeature``.

    Example (torch-quiver's multi-host pattern)::

        if rank == 0:
            store.set("id", quiver.getNcclId())   # or pass it through mp.spawn's args
        comm = quiver.NcclComm(rank, world_size, store.get("id"), hosts, rank_per_host)
        dist_feature = quiver.DistFeature(feature, info, comm)

    Args:
        rank: global rank of this process.
        ws: world size.
        id: :func:`getNcclId`'s bytes. Ignored when ``torch.distributed`` is already
            initialised (its default group is used; its rank and size must match).
        hosts: hosts in the cluster (default: one process per host, ``ws`` hosts).
        rank_per_host: processes per host (``hosts * rank_per_host`` must equal ``ws``).

    With several processes per host, :attr:`group` holds the processes of this one's local
    index on every host (one per host, ranked by host), the group a ``DistFeature`` built
    with this communicator exchanges rows over. Tensors are CPU tensors; for NCCL on GPUs use
    ``torch.distributed`` with the ``nccl`` backend and pass its group to ``DistFeature``.
    """

    def __init__(self, rank: int, ws: int, id=None, hosts=None, rank_per_host=None):
        import torch.distributed as dist

        rank, ws = int(rank), int(ws)
        if ws < 1 or not 0 <= rank < ws:
            raise ValueError(f"rank {rank} out of range for world size {ws}")
        hosts = ws if hosts is None else int(hosts)
        rank_per_host = ws // hosts if rank_per_host is None and hosts else rank_per_host
        if hosts < 1 or rank_per_host is None or hosts * int(rank_per_host) != ws:
            raise ValueError(
                f"hosts ({hosts}) x rank_per_host ({rank_per_host}) must equal the world size {ws}"
            )
        rank_per_host = int(rank_per_host)
        self._owns_group = False
        if dist.is_available() and dist.is_initialized():
            if (dist.get_rank(), dist.get_world_size()) != (rank, ws):
                raise ValueError(
                    f"torch.distributed is initialised as rank {dist.get_rank()} of "
                    f"{dist.get_world_size()}, not {rank} of {ws}"
                )
        else:
            text = id.decode() if isinstance(id, bytes | bytearray) else str(id)
            if not text.startswith(_ID_SCHEME):
                raise ValueError(
                    "NcclComm needs the id from quiver.getNcclId() (or an initialised "
                    f"torch.distributed), got {id!r}"
                )
            dist.init_process_group(
                "gloo", init_method="tcp://" + text[len(_ID_SCHEME) :], rank=rank, world_size=ws
            )
            self._owns_group = True
        self.table = _HostRankTable(hosts, rank_per_host)
        self.host = self.table.host(rank)
        self.group = None  # the default group: one process per host
        if rank_per_host > 1:  # every process creates every group, as new_group requires
            for i in range(rank_per_host):
                ranks = [h * rank_per_host + i for h in range(hosts)]
                g = dist.new_group(ranks)
                if rank in ranks:
                    self.group = g

    @property
    def rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank()

    @property
    def size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size()

    @property
    def device(self) -> torch.device:
        """Where the communicator's tensors live: the CPU."""
        return torch.device("cpu")

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        import torch.distributed as dist

        dist.send(tensor, int(dst))

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        import torch.distributed as dist

        dist.recv(tensor, int(src))

    def allreduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over every process, in place."""
        import torch.distributed as dist

        dist.all_reduce(tensor)

    def exchange(self, host2ids, feature) -> list:
        """torch-quiver's exchange: send each host's requested local ids to this process's
        peer there, answer the peers' requests from ``feature``, return the rows received.

        Args:
            host2ids: per host, the local ids wanted from it (``PartitionInfo.dispatch``), or
                None; this host's own entry is not sent.
            feature: this host's rows (tensor or ``quiver.Feature``), indexed by local id.

        Returns:
            Per host, the rows of ``host2ids[host]`` (None where nothing was asked). A
            collective: every process calls it.
        """
        import torch.distributed as dist

        me, ws, table = self.rank, self.size, self.table
        if len(host2ids) != table.hosts:
            raise ValueError(f"host2ids has {len(host2ids)} entries, expected {table.hosts}")
        sizes = torch.zeros(ws * ws, dtype=torch.int64)
        for host, ids in enumerate(host2ids):
            peer = table.remote_peer(me, host)
            if ids is not None and peer != me:
                sizes[me * ws + peer] = int(torch.as_tensor(ids).numel())
        dist.all_reduce(sizes)
        mat = sizes.reshape(ws, ws).tolist()
        # requests: ids out to each peer, ids in from each process asking this one
        ops, asked = [], {}
        for host, ids in enumerate(host2ids):
            peer = table.remote_peer(me, host)
            if mat[me][peer] > 0:
                out = torch.as_tensor(ids).to(torch.int64).cpu().contiguous()
                ops.append(dist.isend(out, peer))
        for src in range(ws):
            if src != me and mat[src][me] > 0:
                asked[src] = torch.empty(mat[src][me], dtype=torch.int64)
                ops.append(dist.irecv(asked[src], src))
        for op in ops:
            op.wait()
        # answers: rows back to each asker, rows in from each peer asked
        dim = int(feature.shape[1])
        dtype = getattr(feature, "dtype", torch.float32)
        ops, host2feats = [], [None] * table.hosts
        for src, ids in asked.items():
            rows = torch.as_tensor(feature[ids]).cpu().contiguous()
            ops.append(dist.isend(rows, src))
        for host in range(table.hosts):
            peer = table.remote_peer(me, host)
            if mat[me][peer] > 0:
                host2feats[host] = torch.empty((mat[me][peer], dim), dtype=dtype)
                ops.append(dist.irecv(host2feats[host], peer))
        for op in ops:
            op.wait()
        return host2feats

    def destroy(self) -> None:
        """Destroy the process group if this communicator created it."""
        import torch.distributed as dist

        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False
