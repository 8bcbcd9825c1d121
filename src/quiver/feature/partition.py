"""Feature rows partitioned across hosts, with per-host replicas of hot remote rows.

The torch-quiver policy (issue 21): every node's feature row is *owned* by one of ``K``
hosts, and each host also *replicates* the remote rows that its own requests read most, up to
a per-host budget of rows. A serving host then reads its owned and replicated rows from its
own tiers and fetches the rest from their owners (:class:`quiver.feature.dist.DistFeature`).

- Ownership (:func:`assign_owners`): ``"bfs"`` cuts a breadth-first order over the sampling
  direction (row ``v`` -> its in-neighbours) into ``K`` contiguous blocks of equal size, so a
  seed and the neighbours it samples tend to share an owner; ``"hash"`` is ``v mod K`` (no
  locality, the floor).
- A host's *own requests* are the seeds routed to it: a request goes to the host whose rows
  its seeds and their in-neighbours touch most (:func:`route`, :class:`Router`).
- Replication (:func:`replicate`): per host, the top ``budget`` remote rows by ``"fap"`` (the
  feature access probability under that host's own seed distribution,
  :func:`quiver.workload.fap`), ``"degree"`` (in-degree, the same for every host) or
  ``"random"`` (seeded).

On disk (``quiver partition DATA``): ``partition/owner.npy`` (``[N]`` int32),
``partition/replicas.npy`` (every host's replicated ids, sorted per host, int64) with
``partition/replica_offsets.npy`` (``[K + 1]``), and a ``"partition"`` manifest entry.
Directories without it load as before; :func:`load_partition` returns ``None`` for them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numba
import numpy as np
import torch

__all__ = [
    "METHODS",
    "POLICIES",
    "Partition",
    "Router",
    "assign_owners",
    "find_partition",
    "home_hosts",
    "load_partition",
    "make_partition",
    "parse_budget",
    "remote_share",
    "replicate",
    "route",
    "save_partition",
]

METHODS = ("bfs", "hash")
POLICIES = ("fap", "degree", "random")
PARTITION_DIR = "partition"


@dataclass
class Partition:
    """Who owns each row and what each host replicates.

    Attributes:
        owner: ``[N]`` int32: the host owning each node's row.
        replicas: per host, the sorted int64 ids of the remote rows it replicates.
        info: the manifest entry (hosts, method, policy, budget, sizes, ...).
    """

    owner: np.ndarray
    replicas: list[np.ndarray]
    info: dict = field(default_factory=dict)

    @property
    def hosts(self) -> int:
        return len(self.replicas)

    @property
    def num_nodes(self) -> int:
        return int(self.owner.size)

    def local_ids(self, host: int) -> np.ndarray:
        """Sorted ids of the rows ``host`` holds: owned and replicated."""
        _check_host(host, self.hosts)
        owned = np.flatnonzero(self.owner == host)
        return np.union1d(owned, self.replicas[host]).astype(np.int64)

    def local_mask(self) -> np.ndarray:
        """``[K, N]`` bool: row ``v`` is held by host ``h`` (owned or replicated)."""
        mask = np.zeros((self.hosts, self.num_nodes), dtype=bool)
        mask[self.owner, np.arange(self.num_nodes)] = True
        for h, r in enumerate(self.replicas):
            mask[h, r] = True
        return mask


def _check_host(host: int, hosts: int) -> None:
    if not 0 <= int(host) < hosts:
        raise ValueError(f"host {host} out of range for {hosts} hosts")


def _check_hosts(hosts, num_nodes: int) -> int:
    if isinstance(hosts, bool) or not isinstance(hosts, int | np.integer):
        raise ValueError(f"hosts must be an integer, got {hosts!r}")
    hosts = int(hosts)
    if hosts < 1:
        raise ValueError(f"hosts must be >= 1, got {hosts}")
    if hosts > max(num_nodes, 1):
        raise ValueError(f"hosts ({hosts}) exceeds the node count ({num_nodes})")
    if hosts > np.iinfo(np.int32).max:
        raise ValueError(f"hosts must be < 2**31, got {hosts}")
    return hosts


def _csr(topo) -> tuple[np.ndarray, np.ndarray]:
    from quiver.workload import _csr_numpy

    return _csr_numpy(topo)


def parse_budget(value, num_nodes: int) -> int:
    """Per-host replica budget in rows: an integer row count (``1000``, ``"1000"``), a
    fraction of all rows (``0.1``, ``"0.1"``) or a percentage (``"10%"``)."""
    text = str(value).strip()
    try:
        if text.endswith("%"):
            frac = float(text[:-1]) / 100.0
            is_frac = True
        elif isinstance(value, float) or any(c in text for c in ".eE"):
            frac = float(text)
            is_frac = True
        else:
            rows = int(text)
            is_frac = False
    except ValueError:
        raise ValueError(
            f"replicate budget must be a row count (1000), a fraction (0.1) or a percentage "
            f"(10%), got {value!r}"
        ) from None
    if is_frac:
        if not np.isfinite(frac) or not 0.0 <= frac <= 1.0:
            raise ValueError(f"replicate budget fraction must lie in [0, 1], got {value!r}")
        return int(frac * num_nodes)
    if rows < 0:
        raise ValueError(f"replicate budget must be >= 0 rows, got {value!r}")
    return rows


@numba.njit(cache=True)
def _bfs_order(indptr, indices):  # pragma: no cover - compiled
    n = indptr.shape[0] - 1
    order = np.empty(n, dtype=np.int64)
    seen = np.zeros(n, dtype=np.bool_)
    head = 0
    tail = 0
    for start in range(n):
        if seen[start]:
            continue
        seen[start] = True
        order[tail] = start
        tail += 1
        while head < tail:
            v = order[head]
            head += 1
            for j in range(indptr[v], indptr[v + 1]):
                u = indices[j]
                if not seen[u]:
                    seen[u] = True
                    order[tail] = u
                    tail += 1
    return order


def assign_owners(topo, hosts: int, method: str = "bfs") -> np.ndarray:
    """``[N]`` int32 owner of every row: ``"bfs"`` (K equal contiguous blocks of a BFS order
    along the sampling direction) or ``"hash"`` (``v mod K``)."""
    if method not in METHODS:
        raise ValueError(f"unknown partition method {method!r}; choose one of {', '.join(METHODS)}")
    indptr, indices = _csr(topo)
    n = indptr.size - 1
    hosts = _check_hosts(hosts, n)
    if method == "hash":
        return (np.arange(n) % hosts).astype(np.int32)
    order = _bfs_order(indptr, indices)
    owner = np.empty(n, dtype=np.int32)
    owner[order] = (np.arange(n, dtype=np.int64) * hosts // max(n, 1)).astype(np.int32)
    return owner


@numba.njit(cache=True)
def _home(indptr, indices, owner, hosts):  # pragma: no cover - compiled
    n = indptr.shape[0] - 1
    out = np.empty(n, dtype=np.int32)
    counts = np.zeros(hosts, dtype=np.int64)
    for v in range(n):
        counts[:] = 0
        counts[owner[v]] += 1
        for j in range(indptr[v], indptr[v + 1]):
            counts[owner[indices[j]]] += 1
        best = owner[v]  # ties stay with the seed's owner
        for h in range(hosts):
            if counts[h] > counts[best]:
                best = h
        out[v] = best
    return out


def home_hosts(topo, owner: np.ndarray) -> np.ndarray:
    """``[N]`` int32: the host a request for node ``v`` alone is routed to (the host owning
    most of ``v`` and its in-neighbours; ties go to ``v``'s owner)."""
    indptr, indices = _csr(topo)
    owner = np.ascontiguousarray(owner, dtype=np.int32)
    hosts = int(owner.max()) + 1 if owner.size else 1
    return _home(indptr, indices, owner, hosts)


def route(seeds, holds: np.ndarray, topo=None) -> int:
    """The host whose rows a request touches most: ``holds`` is ``[N]`` owner ids or a
    ``[K, N]`` bool "host holds row" mask (owned + replicated); the request's touched rows are
    its seeds and, with ``topo``, their in-neighbours. Ties go to the lowest host id; an empty
    request goes to host 0."""
    seeds = np.asarray(seeds.cpu() if isinstance(seeds, torch.Tensor) else seeds, dtype=np.int64)
    seeds = seeds.reshape(-1)
    n = holds.shape[-1]
    if seeds.size and (seeds.min() < 0 or seeds.max() >= n):
        raise ValueError(f"seed ids must lie in [0, {n})")
    touched = seeds
    if topo is not None and seeds.size:
        indptr, indices = _csr(topo)
        lo, hi = indptr[seeds], indptr[seeds + 1]
        if int((hi - lo).sum()):
            nbrs = np.concatenate([indices[a:b] for a, b in zip(lo, hi, strict=True)])
            touched = np.concatenate([seeds, nbrs])
    if not touched.size:
        return 0
    if holds.ndim == 1:
        counts = np.bincount(holds[touched], minlength=int(holds.max()) + 1)
    else:
        counts = holds[:, touched].sum(axis=1)
    return int(np.argmax(counts))


class Router:
    """Routes request batches to the host holding most of the rows they touch (seeds and
    their in-neighbours), counting replicated rows as held."""

    def __init__(self, partition: Partition, topo=None):
        self.partition = partition
        self.topo = topo
        self._holds = partition.local_mask()

    def __call__(self, seeds) -> int:
        return route(seeds, self._holds, self.topo)


def replicate(
    topo,
    owner: np.ndarray,
    budget: int,
    policy: str = "fap",
    sizes=(15, 10, 5),
    seed_prob=None,
    batch_size: int = 64,
    seed: int = 0,
) -> list[np.ndarray]:
    """Per host, the sorted ids of the ``budget`` hottest *remote* rows under ``policy``.

    ``"fap"``: FAP of the node under the host's own seed distribution (``seed_prob`` — uniform,
    a request log of ids or weights — restricted to the seeds :func:`home_hosts` routes to the
    host); a host no seed is routed to replicates nothing. ``"degree"``: in-degree.
    ``"random"``: a seeded permutation per host.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown replica policy {policy!r}; choose one of {', '.join(POLICIES)}")
    indptr, indices = _csr(topo)
    n = indptr.size - 1
    owner = np.asarray(owner, dtype=np.int32)
    if owner.shape != (n,):
        raise ValueError(f"owner must have shape [{n}], got {list(owner.shape)}")
    budget = int(budget)
    if budget < 0:
        raise ValueError(f"replicate budget must be >= 0 rows, got {budget}")
    hosts = int(owner.max()) + 1 if n else 1
    out: list[np.ndarray] = []
    if policy == "fap":
        from quiver.workload import fap, seed_distribution

        q = seed_distribution(n, seed_prob)
        home = home_hosts((indptr, indices), owner)
    for h in range(hosts):
        remote = owner != h
        k = min(budget, int(remote.sum()))
        if k == 0:
            out.append(np.zeros(0, dtype=np.int64))
            continue
        if policy == "random":
            rng = np.random.default_rng([seed, h])
            score = rng.random(n)
        elif policy == "degree":
            score = np.diff(indptr).astype(np.float64)
        else:
            qh = np.where(home == h, q, 0.0)
            if qh.sum() <= 0:
                out.append(np.zeros(0, dtype=np.int64))
                continue
            score = (
                fap((indptr, indices), sizes, seed_prob=qh, batch_size=batch_size)
                .numpy()
                .astype(np.float64)
            )
        score = np.where(remote, score, -np.inf)
        # hottest first, ties by id; a rows with score 0 (never read) are not worth a copy
        top = np.argsort(-score, kind="stable")[:k]
        if policy == "fap":
            top = top[score[top] > 0]
        out.append(np.sort(top).astype(np.int64))
    return out


def make_partition(
    topo,
    hosts: int,
    budget=0,
    policy: str = "fap",
    method: str = "bfs",
    sizes=(15, 10, 5),
    seed_prob=None,
    batch_size: int = 64,
    seed: int = 0,
) -> Partition:
    """Ownership by ``method`` plus per-host replicas by ``policy`` within ``budget`` rows
    (a count, fraction or percentage, see :func:`parse_budget`)."""
    from quiver.workload import _check_sizes

    indptr, indices = _csr(topo)
    n = indptr.size - 1
    sizes = _check_sizes(sizes)
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    rows = parse_budget(budget, n)
    owner = assign_owners((indptr, indices), hosts, method)
    reps = replicate(
        (indptr, indices), owner, rows, policy, sizes, seed_prob, batch_size=batch_size, seed=seed
    )
    info = {
        "hosts": int(hosts),
        "method": method,
        "policy": policy,
        "budget_rows": rows,
        "sizes": sizes,
        "batch_size": int(batch_size),
        "seed": int(seed),
        "owned_rows": np.bincount(owner, minlength=int(hosts)).tolist(),
        "replica_rows": [int(r.size) for r in reps],
    }
    return Partition(owner, reps, info)


def save_partition(directory, partition: Partition) -> dict:
    """Write ``partition/`` arrays into a prepared directory and its manifest entry."""
    from quiver.datasets.prepared import MANIFEST, update_manifest

    d = Path(directory)
    if not (d / MANIFEST).exists():
        raise FileNotFoundError(f"{d} is not a prepared dataset (no {MANIFEST})")
    manifest = json.loads((d / MANIFEST).read_text())
    n = int(manifest.get("num_nodes", partition.num_nodes))
    if n != partition.num_nodes:
        raise ValueError(f"partition covers {partition.num_nodes} nodes, the dataset has {n}")
    p = d / PARTITION_DIR
    p.mkdir(exist_ok=True)
    offsets = np.cumsum([0] + [r.size for r in partition.replicas]).astype(np.int64)
    flat = (
        np.concatenate(partition.replicas).astype(np.int64)
        if partition.replicas
        else np.zeros(0, np.int64)
    )
    np.save(p / "owner.npy", partition.owner.astype(np.int32))
    np.save(p / "replicas.npy", flat)
    np.save(p / "replica_offsets.npy", offsets)
    entry = {
        **partition.info,
        "files": {
            "owner": f"{PARTITION_DIR}/owner.npy",
            "replicas": f"{PARTITION_DIR}/replicas.npy",
            "replica_offsets": f"{PARTITION_DIR}/replica_offsets.npy",
        },
    }
    return update_manifest(d, partition=entry)


def load_partition(directory) -> Partition | None:
    """The partition of a prepared directory, or ``None`` if it was never partitioned."""
    from quiver.datasets.prepared import MANIFEST

    d = Path(directory)
    manifest = json.loads((d / MANIFEST).read_text())
    entry = manifest.get("partition")
    if not entry:
        return None
    files = entry["files"]
    for key in ("owner", "replicas", "replica_offsets"):
        if not (d / files[key]).exists():
            raise FileNotFoundError(f"missing partition file {d / files[key]}")
    owner = np.load(d / files["owner"])
    flat = np.load(d / files["replicas"])
    offsets = np.load(d / files["replica_offsets"])
    reps = [flat[offsets[h] : offsets[h + 1]] for h in range(offsets.size - 1)]
    return Partition(owner, reps, entry)


def find_partition(path) -> Partition:
    """The partition at ``path``: a prepared directory with a ``partition`` manifest entry, or
    a ``partition/`` folder itself (``owner.npy``, ``replicas.npy``, ``replica_offsets.npy``).

    Raises ``FileNotFoundError`` / ``ValueError`` (one line) when there is none."""
    from quiver.datasets.prepared import MANIFEST

    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"partition directory not found: {d}")
    if (d / MANIFEST).exists():
        part = load_partition(d)
        if part is None:
            raise ValueError(f"{d} has no partition (run `quiver partition {d} --hosts K`)")
        return part
    names = ("owner.npy", "replicas.npy", "replica_offsets.npy")
    missing = [n for n in names if not (d / n).exists()]
    if missing:
        raise FileNotFoundError(
            f"{d} is neither a partitioned dataset nor a partition folder (no manifest.json, "
            f"missing {', '.join(missing)})"
        )
    owner = np.load(d / "owner.npy")
    flat = np.load(d / "replicas.npy")
    offsets = np.load(d / "replica_offsets.npy")
    reps = [flat[offsets[h] : offsets[h + 1]] for h in range(offsets.size - 1)]
    return Partition(owner, reps, {"hosts": len(reps)})


def remote_share(partition: Partition, n_ids_by_host) -> float:
    """Share of the rows read that are remote: ``n_ids_by_host[h]`` lists the node-id tensors
    (or arrays) host ``h`` gathers; a row is remote when ``h`` neither owns nor replicates it."""
    mask = partition.local_mask()
    total = remote = 0
    for h, batches in enumerate(n_ids_by_host):
        for ids in batches:
            ids = np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids, dtype=np.int64)
            total += ids.size
            remote += int((~mask[h, ids]).sum())
    return remote / total if total else 0.0
