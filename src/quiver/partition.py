"""torch-quiver's feature-partition API (``quiver.partition``) over Quiver's partitioned rows.

torch-quiver's multi-host training partitions feature rows by each host's access
probability, saves the result in a folder, and gathers with ``DistFeature(feature, info,
comm)`` where ``info`` is a :class:`PartitionInfo`. The same calls work here, CPU-only, on
Quiver's own pieces: the rows go to :class:`quiver.feature.DistFeature` (one batched exchange
over ``torch.distributed``, gloo on CPU), whose owners and local ids a :class:`PartitionInfo`
describes. Quiver's own route is ``quiver partition DATA`` (BFS ownership and FAP replicas,
:mod:`quiver.feature.partition`).

The folder :func:`quiver_partition_feature` writes, as torch-quiver lays it out::

    result_path/feature_partition_book.pth          # [N] int64: the partition of each node
    result_path/feature_partition_{k}/partition_res.pth   # node ids partition k owns
    result_path/feature_partition_{k}/cache_res.pth       # ids it also caches, or None
"""

from __future__ import annotations

from pathlib import Path

import torch

from quiver.feature.sizes import parse_bytes

__all__ = [
    "PartitionInfo",
    "load_quiver_feature_partition",
    "partition_feature_without_replication",
    "quiver_partition_feature",
]

#: torch-quiver's default chunk: nodes each partition takes per round
CHUNK_SIZE = 128


def _check_probs(probs) -> list[torch.Tensor]:
    probs = [torch.as_tensor(p, dtype=torch.float64).cpu().reshape(-1) for p in probs]
    if not probs:
        raise ValueError("probs must hold one access-probability tensor per partition")
    n = probs[0].numel()
    if any(p.numel() != n for p in probs):
        raise ValueError(f"probs must all have one entry per node ({n})")
    return probs


def partition_feature_without_replication(probs, chunk_size: int = CHUNK_SIZE):
    """Owners by access probability, balanced: ``([ids of partition k], probs)``.

    Nodes are taken ``chunk_size * K`` at a time in id order; within a block the partitions
    take turns (the first one rotating from block to block) picking the ``chunk_size`` nodes
    they favour most over the others: highest ``p_k - mean_{j != k} p_j``. Every node gets
    exactly one owner and partitions differ in size by at most ``chunk_size``.
    """
    probs = _check_probs(probs)
    k, n = len(probs), probs[0].numel()
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    chunk_size = int(chunk_size)
    stacked = torch.stack(probs)  # (K, N)
    others = (stacked.sum(0, keepdim=True) - stacked) / max(k - 1, 1)
    favour = stacked - others if k > 1 else stacked
    parts: list[list[torch.Tensor]] = [[] for _ in range(k)]
    block = chunk_size * k
    for b, lo in enumerate(range(0, n, block)):
        hi = min(n, lo + block)
        score = favour[:, lo:hi].clone()
        for t in range(k):
            part = (b + t) % k
            free = int((score[part] > float("-inf")).sum())
            if free == 0:
                break
            take = torch.topk(score[part], min(chunk_size, free)).indices
            parts[part].append(take + lo)
            score[:, take] = float("-inf")
    res = [
        torch.sort(torch.cat(p)).values if p else torch.zeros(0, dtype=torch.int64) for p in parts
    ]
    return res, probs


def quiver_partition_feature(
    probs,
    result_path,
    cache_memory_budget=0,
    per_feature_size=0,
    chunk_size: int = CHUNK_SIZE,
):
    """torch-quiver's ``quiver_partition_feature``: partition rows by access probability and
    save the folder described in the module docstring.

    Args:
        probs: ``K`` tensors of ``[N]`` access probabilities, one per partition (host).
        result_path: the folder to write; it must not exist yet (torch-quiver asked on the
            terminal whether to delete it; here nothing is deleted).
        cache_memory_budget: bytes (or ``"2G"``) of rows the partitions cache in all: each
            caches ``budget / per_feature_size / K`` of the remote rows it reads most.
        per_feature_size: bytes of one row.
        chunk_size: nodes each partition takes per round (see
            :func:`partition_feature_without_replication`).

    Returns:
        ``(partition_book, partition_res, cache_res)``: ``[N]`` owner of each node, the ids
        each partition owns, and the ids each caches (``None`` without a budget).
    """
    path = Path(result_path)
    if path.exists():
        raise ValueError(f"result_path {path} already exists; remove it or choose another")
    parts, probs = partition_feature_without_replication(probs, chunk_size)
    k, n = len(parts), probs[0].numel()
    budget = parse_bytes(cache_memory_budget, "cache_memory_budget")
    row = parse_bytes(per_feature_size, "per_feature_size")
    per_part = budget // row // k if row else 0
    book = torch.zeros(n, dtype=torch.int64)
    for i, ids in enumerate(parts):
        book[ids] = i
    cache: list[torch.Tensor | None] = [None] * k
    if per_part > 0:
        for i in range(k):
            score = probs[i].clone()
            score[parts[i]] = float("-inf")  # owned rows are local already
            free = int((book != i).sum())
            cache[i] = torch.topk(score, min(per_part, free)).indices
    for i in range(k):
        d = path / f"feature_partition_{i}"
        d.mkdir(parents=True)
        torch.save(parts[i], d / "partition_res.pth")
        torch.save(cache[i], d / "cache_res.pth")
    torch.save(book, path / "feature_partition_book.pth")
    return book, parts, cache


def load_quiver_feature_partition(partition_idx: int, result_path):
    """``(partition_book, partition_res, cache_res)`` of partition ``partition_idx`` from a
    folder :func:`quiver_partition_feature` wrote (read with ``weights_only=True``)."""
    path = Path(result_path)
    part = path / f"feature_partition_{int(partition_idx)}"
    if not path.is_dir():
        raise FileNotFoundError(f"result_path {path}: no such folder")
    if not part.is_dir():
        raise ValueError(f"{path} has no partition {partition_idx} ({part.name} is missing)")

    def load(p: Path):
        return torch.load(p, map_location="cpu", weights_only=True)

    return (
        load(path / "feature_partition_book.pth"),
        load(part / "partition_res.pth"),
        load(part / "cache_res.pth"),
    )


class PartitionInfo:
    """torch-quiver's ``PartitionInfo``: which host holds each row, and this host's rows.

    A host's feature holds, in this order, the rows it owns (ascending ids) and then the
    ``replicate`` rows (in the order given): torch-quiver's local layout.
    ``DistFeature(feature, info, comm)`` (:mod:`quiver.feature.dist`) reads it.

    Args:
        device: where torch-quiver kept its maps (CPU here; a CUDA device is accepted and
            the maps stay on the CPU).
        host: this host's id (its ``torch.distributed`` rank).
        hosts: the number of hosts.
        global2host: ``[N]`` owner host of every node (``partition_book``).
        replicate: ids of remote rows this host also holds (``cache_res``), or None.
    """

    def __init__(self, device, host: int, hosts: int, global2host, replicate=None):
        owner = torch.as_tensor(global2host).to(torch.int64).cpu().reshape(-1)
        self.device = device
        self.host, self.hosts = int(host), int(hosts)
        if not 0 <= self.host < self.hosts:
            raise ValueError(f"host {host} out of range for {hosts} hosts")
        if owner.numel() and (int(owner.min()) < 0 or int(owner.max()) >= self.hosts):
            raise ValueError(f"global2host holds host ids outside [0, {self.hosts})")
        self.owner = owner
        self.size = owner.numel()
        owned = torch.nonzero(owner == self.host).reshape(-1)
        rep = (
            torch.zeros(0, dtype=torch.int64)
            if replicate is None
            else torch.as_tensor(replicate).to(torch.int64).cpu().reshape(-1)
        )
        if rep.numel() and bool((owner[rep] == self.host).any()):
            raise ValueError("replicate holds rows this host owns already")
        #: global ids of this host's feature rows, in its local order
        self.local_order = torch.cat([owned, rep])
        self.replicate = rep if replicate is not None else None
        self.global2host = owner.clone()
        self.global2host[rep] = self.host
        # torch-quiver's global2local: a row's index on the host that will answer it
        self.global2local = torch.empty(self.size, dtype=torch.int64)
        for h in range(self.hosts):
            ids = torch.nonzero(owner == h).reshape(-1)
            self.global2local[ids] = torch.arange(ids.numel())
        self.global2local[rep] = torch.arange(owned.numel(), owned.numel() + rep.numel())

    def dispatch(self, ids):
        """``(host_ids, host_orders)``: per host, the local indices of the ``ids`` it answers
        and their positions in ``ids`` (torch-quiver's routing of a gather)."""
        ids = torch.as_tensor(ids).to(torch.int64).cpu().reshape(-1)
        where = self.global2host[ids]
        host_ids, host_orders = [], []
        for h in range(self.hosts):
            pos = torch.nonzero(where == h).reshape(-1)
            host_orders.append(pos)
            host_ids.append(self.global2local[ids[pos]])
        return host_ids, host_orders
