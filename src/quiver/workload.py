"""Workload metrics of k-hop neighbour sampling: PSGS and FAP (DESIGN.md §1.3).

- **PSGS** (probabilistic sampled graph size): for every node, the *expected* number of nodes
  the sampler draws for that seed, counted as a tree (before deduplication). The dispatcher sums it
  over a batch's seeds and sends small batches to CPU sampling, large ones to the GPU.
- **FAP** (feature access probability): for every node, the probability that its feature row
  is read when serving one request batch drawn from a seed distribution. The feature store
  keeps the rows with the highest FAP in its fastest tier.

Both are computed for all nodes at once with one pass over the CSR per hop (a sparse mat-vec,
numba-compiled, float64 accumulators, no dense matrix), so they scale to 10^8 edges.

Sampling semantics (those of :mod:`quiver.sampling` and PyG's ``NeighborSampler``): a fanout
``k`` picks ``min(d, k)`` distinct in-neighbours of a node of in-degree ``d`` uniformly without
replacement (``k = -1`` keeps all of them), so each neighbour is picked with probability
``min(d, k) / d``; at hop ``l`` *every* node reached so far (seeds included) is sampled again.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

__all__ = ["psgs", "batch_psgs", "fap", "access_probability", "seed_distribution"]


# --------------------------------------------------------------------------- helpers


def _csr_numpy(topo) -> tuple[np.ndarray, np.ndarray]:
    """``(indptr, indices)`` int64 numpy arrays from a CSRTopo or an ``(indptr, indices)`` pair."""
    if isinstance(topo, tuple | list) and len(topo) == 2:
        indptr, indices = topo
    elif hasattr(topo, "indptr") and hasattr(topo, "indices"):
        indptr, indices = topo.indptr, topo.indices
    else:
        raise ValueError(
            f"expected a CSRTopo or an (indptr, indices) pair, got {type(topo).__name__}"
        )
    out = []
    for a in (indptr, indices):
        if isinstance(a, torch.Tensor):
            a = a.detach().cpu().numpy()
        out.append(np.ascontiguousarray(a, dtype=np.int64))
    indptr, indices = out
    if indptr.ndim != 1 or indptr.size < 1 or indices.ndim != 1:
        raise ValueError("indptr and indices must be 1-D, indptr of length node_count + 1")
    return indptr, indices


def _check_sizes(sizes) -> list[int]:
    sizes = [int(k) for k in sizes]
    if not sizes:
        raise ValueError("sizes (fanouts) must name at least one hop")
    for k in sizes:
        if k < -1:
            raise ValueError(f"fanout {k} is invalid: use a count >= 0, or -1 for all neighbours")
    return sizes


def _pick_probability(degree: np.ndarray, k: int) -> np.ndarray:
    """``[N]`` float64: probability that a node of this degree picks a given in-neighbour."""
    d = degree.astype(np.float64)
    if k == -1:
        return np.ones_like(d)
    with np.errstate(divide="ignore", invalid="ignore"):
        w = np.minimum(d, float(k)) / d
    w[degree == 0] = 0.0
    return w


@numba.njit(parallel=True, nogil=True, cache=True)
def _row_sum(indptr, indices, x, out):  # pragma: no cover - compiled
    """``out[v] = sum of x[u] over u in row v`` (A @ x), rows in parallel."""
    n = indptr.shape[0] - 1
    for v in numba.prange(n):
        acc = 0.0
        for j in range(indptr[v], indptr[v + 1]):
            acc += x[indices[j]]
        out[v] = acc


@numba.njit(nogil=True, cache=True)
def _column_sum(indptr, indices, y, out):  # pragma: no cover - compiled
    """``out[u] += y[v]`` for every ``u`` in row ``v`` (A^T @ y); a serial scatter."""
    n = indptr.shape[0] - 1
    for v in range(n):
        yv = y[v]
        if yv == 0.0:
            continue
        for j in range(indptr[v], indptr[v + 1]):
            out[indices[j]] += yv


# ----------------------------------------------------------------------------- PSGS


def psgs(topo, sizes, frontier: bool = False) -> torch.Tensor:
    """Expected sampled-subgraph size of every node as a seed (before deduplication).

    With fanouts ``k_1..k_L``, in-degree ``d(v)`` and ``w_h(v) = min(d(v), k_h) / d(v)``:

    - ``frontier=True`` (DESIGN.md §1.3; PyG ``NeighborLoader``: a node is expanded once, at the
      hop after it arrives): ``S_L = 1``, ``S_l = 1 + w_{l+1} * (A @ S_{l+1})``, result ``S_0``.
    - ``frontier=False`` (default; the sampler's default, PyG's legacy ``NeighborSampler`` and
      torch-quiver: every node reached so far is sampled again at each later hop): a node that
      arrives at hop ``l`` spawns ``R_l = 1 + sum_{h > l} w_h * (A @ R_h)`` nodes, result
      ``R_0``. Same cost: one mat-vec per hop.

    Both count the sampled nodes as a tree (no deduplication).

    Args:
        topo: a :class:`quiver.CSRTopo` (row ``v`` = in-neighbours of ``v``) or an
            ``(indptr, indices)`` pair.
        sizes: fanouts per hop, first hop first, ``-1`` for all neighbours (e.g. ``[15, 10, 5]``).
        frontier: sampling semantics, as above.

    Returns:
        ``[node_count]`` float32 tensor (the PSGS table).
    """
    indptr, indices = _csr_numpy(topo)
    sizes = _check_sizes(sizes)
    degree = np.diff(indptr)
    n = degree.size
    s = np.ones(n, dtype=np.float64)  # S_L = R_L
    acc = np.zeros(n, dtype=np.float64)
    tmp = np.empty(n, dtype=np.float64)
    for k in reversed(sizes):
        _row_sum(indptr, indices, s, tmp)
        if frontier:
            s = 1.0 + _pick_probability(degree, k) * tmp
        else:
            acc += _pick_probability(degree, k) * tmp
            s = 1.0 + acc
    return torch.from_numpy(s.astype(np.float32))


def batch_psgs(table: torch.Tensor, seeds) -> float:
    """PSGS of a request batch: the sum of its seeds' PSGS (overlapping neighbourhoods are
    counted once per seed, so it exceeds the distinct node count the sampler returns).

    Args:
        table: ``[node_count]`` PSGS table from :func:`psgs`.
        seeds: node ids of the batch (tensor, array or list); repeats count each time.
    """
    seeds = torch.as_tensor(seeds, dtype=torch.int64)
    if seeds.numel() == 0:
        return 0.0
    if int(seeds.min()) < 0 or int(seeds.max()) >= table.numel():
        raise ValueError(f"seed ids must lie in [0, {table.numel()})")
    return float(table.index_select(0, seeds.to(table.device)).sum(dtype=torch.float64))


# ------------------------------------------------------------------------------ FAP


def seed_distribution(node_count: int, seed_prob=None) -> np.ndarray:
    """Per-draw seed probabilities ``q`` (``[node_count]`` float64, sums to 1).

    Args:
        node_count: number of nodes.
        seed_prob: ``None`` for uniform seeds; a request log (1-D integer array of node ids,
            counted); or a ``[node_count]`` float array of non-negative weights (normalised).
    """
    if seed_prob is None:
        return np.full(node_count, 1.0 / node_count)
    a = seed_prob.detach().cpu().numpy() if isinstance(seed_prob, torch.Tensor) else seed_prob
    a = np.asarray(a)
    if a.ndim != 1 or a.size == 0:
        raise ValueError("seed_prob must be a non-empty 1-D request log or weight vector")
    if np.issubdtype(a.dtype, np.integer):
        if a.min() < 0 or a.max() >= node_count:
            raise ValueError(f"request log holds node ids outside [0, {node_count})")
        q = np.bincount(a, minlength=node_count).astype(np.float64)
    elif np.issubdtype(a.dtype, np.floating):
        if a.size != node_count:
            raise ValueError(f"seed weights have length {a.size}, expected {node_count}")
        if not np.all(np.isfinite(a)) or a.min() < 0:
            raise ValueError("seed weights must be finite and non-negative")
        q = a.astype(np.float64)
    else:
        raise ValueError(f"seed_prob has unsupported dtype {a.dtype}")
    total = q.sum()
    if total <= 0:
        raise ValueError("seed weights sum to zero")
    return q / total


def access_probability(topo, sizes, p0, frontier: bool = False) -> torch.Tensor:
    """Probability that each node is in the sampled subgraph, given independent seed events.

    ``p0[v]`` is the probability that ``v`` is a seed. Let ``T(v)`` be the hop at which ``v``
    first enters the subgraph (0 for a seed). At hop ``h``, a node ``u`` already reached picks
    each in-neighbour with probability ``w_h(u) = min(1, k_h / d(u))``, independently of earlier
    hops, so a node that arrived at hop ``t`` has picked ``v`` by hop ``l`` with probability
    ``1 - prod_{h=t+1..l} (1 - w_h(u))``. Assuming the arrival of different samplers ``u`` of
    ``v`` independent (exact on in-forests, where every node is the in-neighbour of at most one
    node, with independent seeds)::

        P(T(v) <= l) = 1 - (1 - p0[v]) * prod_{u: v in N(u)} (1 - sum_{t<l} P(T(u)=t) * c_{t,l}(u))

    with ``c_{t,l}(u) = 1 - prod_{h=t+1..l}(1 - w_h(u))``. This tracks the full arrival-time
    distribution instead of DESIGN.md's ``1 - (1 - P_{l-1}(v)) * prod(1 - P_{l-1}(u) w_l(u))``,
    which counts a node's own past presence and its samplers' as independent and so
    over-estimates (e.g. on a two-node chain). One scatter (``A^T`` mat-vec) per hop.

    Args:
        topo: a :class:`quiver.CSRTopo` or an ``(indptr, indices)`` pair.
        sizes: fanouts per hop, first hop first, ``-1`` for all neighbours.
        p0: ``[node_count]`` probabilities in ``[0, 1]``.
        frontier: ``False`` (default): every node reached so far is sampled again at each
            hop (PyG's legacy ``NeighborSampler``, torch-quiver, ``GraphSageSampler``);
            ``True``: a node is sampled only at the hop after it arrives (PyG's
            ``NeighborLoader``), so ``c_{t,l}(u) = w_{t+1}(u)``.

    Returns:
        ``[node_count]`` float32 tensor ``P(T(v) <= L)``.
    """
    indptr, indices = _csr_numpy(topo)
    sizes = _check_sizes(sizes)
    degree = np.diff(indptr)
    n = degree.size
    p0 = p0.detach().cpu().numpy() if isinstance(p0, torch.Tensor) else np.asarray(p0)
    p0 = p0.astype(np.float64)
    if p0.shape != (n,):
        raise ValueError(f"p0 must have shape [{n}], got {list(p0.shape)}")
    if not np.all((p0 >= 0) & (p0 <= 1)):
        raise ValueError("p0 must hold probabilities in [0, 1]")
    w = [_pick_probability(degree, k) for k in sizes]  # w[h-1] = w_h
    arrival = [p0]  # arrival[t] = P(T(v) = t)
    cum = p0.copy()  # P(T(v) <= l)
    # keep (1 - p0) in log space: log(0) for certain seeds is fine, exp(-inf) = 0
    with np.errstate(divide="ignore"):
        log_not_seed = np.log1p(-p0)
    scatter = np.empty(n, dtype=np.float64)
    for l in range(1, len(sizes) + 1):
        # per sampler u: probability it has picked a given neighbour by hop l
        picked = np.zeros(n, dtype=np.float64)
        for t in range(l):
            if frontier:
                picked += arrival[t] * w[t]
                continue
            miss = np.ones(n, dtype=np.float64)
            for h in range(t + 1, l + 1):
                miss *= 1.0 - w[h - 1]
            picked += arrival[t] * (1.0 - miss)
        with np.errstate(divide="ignore"):
            log_keep = np.log1p(-np.minimum(picked, 1.0))
        scatter.fill(0.0)
        # a row u contributes its log-term to every in-neighbour v it may pick
        _column_sum(indptr, indices, log_keep, scatter)
        new_cum = -np.expm1(log_not_seed + scatter)
        new_cum = np.maximum(new_cum, cum)  # monotone in l; guards float rounding
        arrival.append(new_cum - cum)
        cum = new_cum
    return torch.from_numpy(cum.astype(np.float32))


def fap(topo, sizes, seed_prob=None, batch_size: int = 1, frontier: bool = False) -> torch.Tensor:
    """Feature access probability: chance that each node's feature is read by one request batch.

    A batch holds ``batch_size`` seeds drawn independently from the seed distribution ``q``,
    so node ``v`` is a seed with probability ``1 - (1 - q_v)^batch_size``; the rest is
    :func:`access_probability`.

    Args:
        topo: a :class:`quiver.CSRTopo` or an ``(indptr, indices)`` pair.
        sizes: fanouts per hop, first hop first (e.g. ``[15, 10, 5]``).
        seed_prob: ``None`` (uniform seeds), a request log (1-D array of node ids) or per-node
            weights; see :func:`seed_distribution`.
        batch_size: seeds per request batch (>= 1).
        frontier: sampling semantics, see :func:`access_probability`.

    Returns:
        ``[node_count]`` float32 tensor of probabilities.
    """
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    indptr, indices = _csr_numpy(topo)
    q = seed_distribution(indptr.size - 1, seed_prob)
    p0 = -np.expm1(int(batch_size) * np.log1p(-np.minimum(q, 1.0)))
    return access_probability((indptr, indices), sizes, p0, frontier=frontier)
