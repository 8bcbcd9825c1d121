"""Numba kernels of the CPU sampler: k-hop uniform sampling without replacement, dedup, relabel.

One call samples every hop of a batch so a single seed pays one dispatch. Kernels are compiled
with ``nogil=True`` (serving threads sample concurrently) and ``cache=True`` (compiled once per
machine). Rows are sampled in parallel with ``prange`` when a hop has many targets; the
dedup/relabel pass is sequential and uses a node-indexed marker array instead of hashing or
sorting.

Randomness: row ``i`` of hop ``h`` of call ``c`` draws from a splitmix64 stream keyed by
``(seed, c, h, i)``, so a result depends on the seed and call number only, never on the thread
count or on how rows are split among threads.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange
from numba.typed import List

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S32 = np.uint64(32)

_JIT = dict(nogil=True, cache=True)


@numba.njit(inline="always", **_JIT)
def _mix(z):
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@numba.njit(**_JIT)
def stream_key(seed, call, hop):
    """Key of the random stream of one hop of one call (uint64)."""
    k = _mix(np.uint64(seed) + _GOLDEN)
    k = _mix(k ^ (np.uint64(call) * _M1))
    return _mix(k ^ (np.uint64(hop) * _M2))


@numba.njit(inline="always", **_JIT)
def _below(state, bound):
    """Advance ``state``; return (state, uniform int in [0, bound)) for bound < 2**32."""
    state = state + _GOLDEN
    r = ((_mix(state) >> _S32) * np.uint64(bound)) >> _S32
    return state, np.int64(r)


@numba.njit(inline="always", **_JIT)
def _row_positions(deg, k, key, i, pos, o):
    """Write ``min(deg, k)`` distinct uniform positions in ``[0, deg)`` of row ``i`` to ``pos[o:]``.

    Floyd's algorithm picks ``k`` distinct positions of the row in ``k`` draws; the
    membership scan is over at most ``k`` entries, cheap for GNN fanouts. Reads no graph data.
    The positions are then sorted, so a target's sampled neighbours always come in its row's
    (CSR) order, as a row taken whole does: an order-sensitive aggregator (LSTM) sees one
    canonical sequence per sampled set, whatever the draw order.
    """
    if k < 0 or deg <= k:
        for j in range(deg):
            pos[o + j] = j
        return
    state = _mix(key ^ (np.uint64(i) * _GOLDEN))
    for m in range(k):
        j = deg - k + m
        state, r = _below(state, j + 1)
        for q in range(m):
            if pos[o + q] == r:
                r = j
                break
        pos[o + m] = r
    for a in range(1, k):  # insertion sort: k is a fanout, a few dozen at most
        v = pos[o + a]
        b = a - 1
        while b >= 0 and pos[o + b] > v:
            pos[o + b + 1] = pos[o + b]
            b -= 1
        pos[o + b + 1] = v


@numba.njit(inline="always", **_JIT)
def _map_row(indices, eid, has_eid, start, lo, hi, cols, eids):
    """Turn the row positions in ``eids[lo:hi]`` into neighbour ids and edge ids."""
    for e in range(lo, hi):
        p = start + eids[e]
        cols[e] = indices[p]
        eids[e] = eid[p] if has_eid else p


@numba.njit(inline="always", **_JIT)
def _fill_rows(indices, eid, has_eid, starts, degs, k, key, offs, cols, eids, lo, hi):
    """Sample rows ``lo..hi`` in two passes: first every row's positions (no graph reads), then
    the graph reads, which no longer wait on each other's random draws, so the CPU keeps many
    of these cache misses in flight (2x faster on products-like, bench/serving_path.py)."""
    for i in range(lo, hi):
        _row_positions(degs[i], k, key, i, eids, offs[i])
    for i in range(lo, hi):
        _map_row(indices, eid, has_eid, starts[i], offs[i], offs[i + 1], cols, eids)


@numba.njit(parallel=True, **_JIT)
def _rows_parallel(indptr, targets, starts, degs):
    for i in prange(targets.shape[0]):
        t = targets[i]
        starts[i] = indptr[t]
        degs[i] = indptr[t + 1] - indptr[t]


@numba.njit(**_JIT)
def _rows_serial(indptr, targets, starts, degs):
    for i in range(targets.shape[0]):
        t = targets[i]
        starts[i] = indptr[t]
        degs[i] = indptr[t + 1] - indptr[t]


@numba.njit(parallel=True, **_JIT)
def _fill_parallel(indices, eid, has_eid, starts, degs, k, key, offs, cols, eids):
    nt = starts.shape[0]
    chunks = min(nt, 64)
    for c in prange(chunks):
        lo, hi = nt * c // chunks, nt * (c + 1) // chunks
        _fill_rows(indices, eid, has_eid, starts, degs, k, key, offs, cols, eids, lo, hi)


@numba.njit(**_JIT)
def _fill_serial(indices, eid, has_eid, starts, degs, k, key, offs, cols, eids):
    _fill_rows(indices, eid, has_eid, starts, degs, k, key, offs, cols, eids, 0, starts.shape[0])


@numba.njit(**_JIT)
def _sample_rows(indptr, indices, eid, targets, k, key, parallel):
    """Sample every row of ``targets``; returns ``(offs [T+1], cols [S], eids [S])``."""
    nt = targets.shape[0]
    starts = np.empty(nt, dtype=np.int64)
    degs = np.empty(nt, dtype=np.int64)
    if parallel:
        _rows_parallel(indptr, targets, starts, degs)
    else:
        _rows_serial(indptr, targets, starts, degs)
    offs = np.empty(nt + 1, dtype=np.int64)
    offs[0] = 0
    for i in range(nt):
        d = degs[i]
        offs[i + 1] = offs[i] + (d if (k < 0 or d <= k) else k)
    m = offs[nt]
    cols = np.empty(m, dtype=np.int64)
    eids = np.empty(m, dtype=np.int64)
    has_eid = eid.shape[0] > 0
    if parallel:
        _fill_parallel(indices, eid, has_eid, starts, degs, k, key, offs, cols, eids)
    else:
        _fill_serial(indices, eid, has_eid, starts, degs, k, key, offs, cols, eids)
    return offs, cols, eids


@numba.njit(**_JIT)
def rows_range(indptr, targets, starts, degs, lo, hi):
    """Row starts and degrees of ``targets[lo:hi]`` (one chunk of a threaded hop)."""
    for i in range(lo, hi):
        t = targets[i]
        starts[i] = indptr[t]
        degs[i] = indptr[t + 1] - indptr[t]


@numba.njit(**_JIT)
def row_offsets(degs, k):
    """``[T + 1]`` output offsets: row ``i`` yields ``min(degs[i], k)`` entries (all if k < 0)."""
    nt = degs.shape[0]
    offs = np.empty(nt + 1, dtype=np.int64)
    offs[0] = 0
    for i in range(nt):
        d = degs[i]
        offs[i + 1] = offs[i] + (d if (k < 0 or d <= k) else k)
    return offs


@numba.njit(**_JIT)
def fill_range(indices, eid, has_eid, starts, degs, k, key, offs, cols, eids, lo, hi):
    """Sample rows ``lo..hi`` of a hop; row ``i`` draws from stream ``(key, i)`` as always."""
    _fill_rows(indices, eid, has_eid, starts, degs, k, key, offs, cols, eids, lo, hi)


@numba.njit(**_JIT)
def relabel(src, dst, first, offs, marker, n_id, n):
    """Relabel one hop in place (first occurrence gets the next local id); returns new ``n``.

    ``src`` holds global ids on entry, local ids on return; ``dst[j]`` is set to the local id
    of the target of edge ``j``; ``n_id`` must have room for ``len(src)`` new nodes.
    """
    num_targets = offs.shape[0] - 1
    for i in range(num_targets):
        for j in range(offs[i], offs[i + 1]):
            g = src[j]
            loc = marker[g]
            if loc < 0:
                loc = n
                marker[g] = n
                n_id[n] = g
                n += 1
            src[j] = loc
            dst[j] = first + i
    return n


@numba.njit(**_JIT)
def reset_marker(marker, n_id, n):
    for i in range(n):
        marker[n_id[i]] = -1


@numba.njit(**_JIT)
def _grow(a, need):
    if need <= a.shape[0]:
        return a
    b = np.empty(max(need, 2 * a.shape[0]), dtype=a.dtype)
    b[: a.shape[0]] = a
    return b


@numba.njit(**_JIT)
def sample_khop(indptr, indices, eid, seeds, fanouts, seed, call, marker, stop_at, frontier):
    """Sample ``len(fanouts)`` hops from ``seeds``.

    Hop ``h`` samples up to ``fanouts[h]`` in-neighbours (``k < 0`` takes all) of its targets:
    with ``frontier=False`` (PyG's legacy ``NeighborSampler``) every node gathered so far, the
    first ``num_nodes[h]`` entries of ``n_id``; with ``frontier=True`` (PyG's
    ``NeighborLoader``) only the nodes the previous hop added. ``n_id`` starts with the seeds
    and grows hop by hop.

    Memory: each hop's outputs are allocated once at their exact size and the sampled ids are
    relabelled in place, so besides the outputs a call only holds the marker and three
    per-target arrays of the current hop.

    Args:
        indptr, indices: int64 CSR of in-neighbours.
        eid: int64 edge ids (length E) or an empty array to use CSR positions.
        seeds: int64 seed ids, distinct, validated by the caller.
        fanouts: int64 per-hop fanouts, innermost (seeds) first.
        seed, call: key of the random streams.
        marker: integer work array of length N (int32 suffices), all -1 on entry and on return.
        stop_at: return before the first hop with at least this many targets, so the caller
            can run it on several threads (``rows_range``/``fill_range``/``relabel``); the
            marker then still holds the ids of ``n_id[:n]``.
        frontier: sample only the previous hop's new nodes (see above).

    Returns:
        ``(n_id, n, num_nodes, hops, done)``: ``n_id[:n]`` the node ids so far (the buffer may
        be longer), ``num_nodes`` [L+1] (n_id count before hop 0 and after each hop done),
        ``hops`` a list of ``(src_local, dst_local, e_id)`` per hop done, ``done`` the number of
        hops done (the marker is restored only when ``done == L``). If ``seeds`` holds a
        duplicate, ``num_nodes[0]`` is -1 and nothing was sampled.
    """
    num_hops = fanouts.shape[0]
    n_seeds = seeds.shape[0]
    num_nodes = np.empty(num_hops + 1, dtype=np.int64)
    hops = List()
    n_id = np.empty(max(16, n_seeds * 4), dtype=np.int64)
    for i in range(n_seeds):
        s = seeds[i]
        if marker[s] >= 0:
            for q in range(i):
                marker[seeds[q]] = -1
            num_nodes[0] = -1
            e = np.empty(0, dtype=np.int64)
            hops.append((e, e, e))
            return n_id, 0, num_nodes, hops, 0
        n_id[i] = s
        marker[s] = i
    n = n_seeds
    num_nodes[0] = n
    for h in range(num_hops):
        k = fanouts[h]
        first = num_nodes[h - 1] if (frontier and h > 0) else 0
        num_targets = n - first
        if num_targets >= stop_at:
            return n_id, n, num_nodes, hops, h
        key = stream_key(seed, call, h)
        # src receives global ids from the sampler and is relabelled in place below
        offs, src, eids = _sample_rows(indptr, indices, eid, n_id[first:n], k, key, False)
        m = offs[num_targets]
        dst = np.empty(m, dtype=np.int64)
        n_id = _grow(n_id, n + m)
        n = relabel(src, dst, first, offs, marker, n_id, n)
        num_nodes[h + 1] = n
        hops.append((src, dst, eids))
    reset_marker(marker, n_id, n)
    return n_id, n, num_nodes, hops, num_hops


@numba.njit(**_JIT)
def sample_one_hop(indptr, indices, eid, nodes, k, seed, call):
    """Sample up to ``k`` in-neighbours of each of ``nodes`` (global ids, no relabel).

    Returns ``(counts [len(nodes)], neighbours [sum counts], e_id [sum counts])``.
    """
    key = stream_key(seed, call, 0)
    offs, cols, eids = _sample_rows(indptr, indices, eid, nodes, k, key, True)
    return offs[1:] - offs[:-1], cols, eids
