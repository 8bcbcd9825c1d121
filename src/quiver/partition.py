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

from quiver.feature.partition_info import PartitionInfo
from quiver.feature.sizes import parse_bytes

__all__ = [
    "PartitionInfo",
    "load_quiver_feature_partition",
    "partition_feature_without_replication",
    "partition_without_replication",
    "quiver_partition_feature",
    "select_nodes",
]

#: torch-quiver's default chunk: nodes each partition takes per round
CHUNK_SIZE = 128
#: rounds of :func:`partition_without_replication` (torch-quiver's ``CHUNK_NUM``)
NUM_CHUNKS = 32


def _compute_device(device) -> torch.device:
    """torch-quiver's ``device`` argument (a GPU ordinal): that GPU where there is one, else
    the CPU (the result is the same; only where it is computed differs)."""
    if isinstance(device, torch.device):
        dev = device
    elif isinstance(device, str) and not device.isdigit():
        dev = torch.device(device)
    elif device is None or int(device) < 0:
        dev = torch.device("cpu")
    else:
        dev = torch.device("cuda", int(device))
    if dev.type == "cuda" and not torch.cuda.is_available():
        return torch.device("cpu")
    return dev


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


def partition_without_replication(device, probs, ids=None) -> list[torch.Tensor]:
    """torch-quiver's ``quiver.partition.partition_without_replication``: split nodes among
    ``K`` partitions by access probability, each node in exactly one partition.

    The nodes (``ids``, or all ``N``) are cut, in the given order, into 32 rounds; in each
    round the partitions take turns (the first one rotating from round to round) picking up to
    ``ceil(round / K)`` of the nodes still free, those with the highest
    ``K * p_k - sum_{j != k} p_j`` (what ``k`` reads more than the others do).

    Args:
        device: where to compute: a GPU ordinal (torch-quiver's ``0``), ``"cpu"`` or ``-1``.
            Without CUDA an ordinal computes on the CPU (same result).
        probs: ``K`` tensors of ``[N]`` access probabilities (``sampler.sample_prob``).
        ids: the node ids to split (e.g. ``select_nodes``'s, squeezed), or None for all.

    Returns:
        ``K`` int64 tensors on the compute device: the node ids of each partition (from
        ``ids`` when given), in picking order.
    """
    dev = _compute_device(device)
    k = len(probs)
    if k < 1:
        raise ValueError("probs must hold one access-probability tensor per partition")
    if ids is not None:
        ids = torch.as_tensor(ids).to(dev, torch.int64).reshape(-1)
    probs = [torch.as_tensor(p).to(dev) for p in probs]
    stacked = torch.stack([p[ids] if ids is not None else p for p in probs]).double()  # (K, n)
    n = stacked.shape[1]
    score_all = stacked * (k + 1) - stacked.sum(0, keepdim=True)  # K p_k - sum of the others
    parts: list[list[torch.Tensor]] = [[] for _ in range(k)]
    step = (n + NUM_CHUNKS - 1) // NUM_CHUNKS
    for r, lo in enumerate(range(0, n, max(step, 1))):
        hi = min(n, lo + step)
        score = score_all[:, lo:hi].clone()
        share = (hi - lo + k - 1) // k
        left = hi - lo
        for t in range(k):
            part = (r + t) % k
            take = torch.topk(score[part], min(share, left)).indices
            parts[part].append(take + lo)
            score[:, take] = float("-inf")
            left -= take.numel()
    res = []
    for picked in parts:
        pos = torch.cat(picked) if picked else torch.zeros(0, dtype=torch.int64, device=dev)
        res.append(ids[pos] if ids is not None else pos)
    return res


def select_nodes(device, probs, ids=None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch-quiver's ``select_nodes``: ``(prob_sum, node_ids)``, the summed access
    probability of every node (over ``ids`` only, when given) and the ``[M, 1]`` ids of the
    nodes any partition reads. ``device`` as in :func:`partition_without_replication`."""
    dev = _compute_device(device)
    probs = [torch.as_tensor(p).to(dev) for p in probs]
    if not probs:
        raise ValueError("probs must hold one access-probability tensor per partition")
    prob_sum = torch.zeros(probs[0].shape[0], device=dev)
    for p in probs:
        if ids is None:
            prob_sum += p
        else:
            ids_ = torch.as_tensor(ids).to(dev, torch.int64)
            prob_sum[ids_] += p[ids_]
    return prob_sum, torch.nonzero(prob_sum)


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
