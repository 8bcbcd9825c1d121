"""Vectorized torch kernel of the GPU sampler; device-agnostic, so tests run it on CPU tensors.

Each hop is a fixed number of whole-tensor operations: row lengths, one gather for rows that
are taken whole, and Floyd's algorithm run for all over-full rows at once (``k`` rounds, each
comparing a draw against the at most ``k`` positions picked so far), which samples ``k``
distinct positions uniformly without touching the rest of a long row, then sorts them (a row's
neighbours come in CSR order, whatever the draws). Dedup and relabel use a node-indexed marker
tensor instead of sorting.
"""

from __future__ import annotations

import torch

_RAND_HIGH = 1 << 62  # draws are r % (j + 1): bias below 2**-31 for rows shorter than 2**31


def sample_hop(
    indptr: torch.Tensor,
    indices: torch.Tensor,
    eid: torch.Tensor | None,
    targets: torch.Tensor,
    k: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample up to ``k`` distinct in-neighbours of every target (``k < 0``: all of them).

    Args:
        indptr, indices: int64 CSR (in-neighbours), on the device where the kernel runs.
        eid: optional int64 edge ids per CSR slot; CSR positions are returned without it.
        targets: ``[T]`` int64 node ids.
        k: fanout.
        generator: torch generator on the same device, for reproducible draws.

    Returns:
        ``(counts [T], neighbours [S], e_id [S])`` with ``S = counts.sum()``; the neighbours of
        target ``i`` come in the ``i``-th block of ``counts[i]`` entries.
    """
    dev = targets.device
    start = indptr[targets]  # [T]
    deg = indptr[targets + 1] - start  # [T]
    counts = deg if k < 0 else deg.clamp(max=k)
    ends = counts.cumsum(0)
    total = int(ends[-1]) if ends.numel() else 0
    row_of_slot = torch.repeat_interleave(torch.arange(targets.numel(), device=dev), counts)
    # position of each output slot inside its row: 0..counts-1, right for rows taken whole
    pos = torch.arange(total, device=dev) - (ends - counts)[row_of_slot]
    if k >= 0:
        big = (deg > k).nonzero().flatten()  # [B] rows that need a draw
        if big.numel():
            d = deg[big].unsqueeze(1)  # [B, 1]
            picked = torch.empty(big.numel(), k, dtype=torch.int64, device=dev)
            for m in range(k):
                j = d - k + m  # [B, 1] Floyd's m-th round draws from [0, j]
                r = torch.randint(_RAND_HIGH, (big.numel(), 1), generator=generator, device=dev)
                r = r % (j + 1)
                clash = (picked[:, :m] == r).any(dim=1, keepdim=True)
                picked[:, m : m + 1] = torch.where(clash, j, r)
            # sorted: a row's neighbours in CSR order, as the CPU kernel gives them
            picked = picked.sort(dim=1).values
            slots = (ends[big] - k).unsqueeze(1) + torch.arange(k, device=dev)  # [B, k]
            pos[slots.flatten()] = picked.flatten()
    csr_pos = start[row_of_slot] + pos
    nbrs = indices[csr_pos]
    e = eid[csr_pos] if eid is not None else csr_pos
    return counts, nbrs, e


def sample_khop(
    indptr: torch.Tensor,
    indices: torch.Tensor,
    eid: torch.Tensor | None,
    seeds: torch.Tensor,
    fanouts: list[int],
    marker: torch.Tensor,
    generator: torch.Generator | None = None,
    frontier: bool = False,
):
    """Multi-hop sampling with dedup + relabel; same contract as the numba ``sample_khop``.

    ``marker`` is an int64 ``[N]`` tensor of -1 on the kernel's device, restored on return.
    Returns ``(n_id, num_nodes, hops)`` with ``num_nodes`` a Python list and ``hops`` a list of
    ``(src_local, dst_local, e_id)`` per hop, or ``None`` if ``seeds`` holds a duplicate.
    """
    dev = seeds.device
    n_id = seeds
    n = seeds.numel()
    marker[seeds] = torch.arange(n, device=dev)
    if n and bool((marker[seeds] != torch.arange(n, device=dev)).any()):
        marker[seeds] = -1
        return None
    num_nodes = [n]
    hops = []
    for h, k in enumerate(fanouts):
        first = num_nodes[h - 1] if (frontier and h > 0) else 0
        targets = n_id[first:n]
        counts, nbrs, e = sample_hop(indptr, indices, eid, targets, k, generator)
        dst = first + torch.repeat_interleave(torch.arange(targets.numel(), device=dev), counts)
        loc = marker[nbrs]
        cand = nbrs[loc < 0]
        # duplicates among new nodes: one write per node wins, the winner takes the new id
        slot = torch.arange(cand.numel(), device=dev)
        marker[cand] = slot
        new = cand[marker[cand] == slot]
        marker[new] = torch.arange(n, n + new.numel(), device=dev)
        loc = marker[nbrs]
        n_id = torch.cat([n_id, new])
        n += new.numel()
        hops.append((loc, dst, e))
        num_nodes.append(n)
    marker[n_id] = -1
    return n_id, num_nodes, hops
