"""Deterministic, vectorized R-MAT edge generation, in chunks.

R-MAT (Chakrabarti et al., 2004) places each edge by descending ``scale`` levels of the
adjacency matrix, choosing one of four quadrants with probabilities ``(a, b, c, d)`` at each
level. Each chunk of edges is a handful of whole-array numpy operations per level and draws
from its own generator keyed by ``(seed, chunk index)``, so a graph is reproducible from its
seed and can be streamed to disk a chunk at a time.

``noise`` perturbs ``(a, b, c, d)`` at every level (as in Seshadhri, Pinar and Kolda's noisy
R-MAT), which smooths the oscillating degree distribution of plain R-MAT. Ids are finally
scaled from ``[0, 2**scale)`` to ``[0, num_nodes)`` and shuffled by a fixed permutation, so
hubs are spread over the id range.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

__all__ = ["RMat", "rmat_edges"]

DEFAULT_CHUNK = 1 << 16


@dataclass(frozen=True)
class RMat:
    """R-MAT parameters.

    Args:
        num_nodes: node count ``N``; ids are drawn in ``[0, 2**ceil(log2 N))`` and scaled down.
        num_edges: edge count.
        a, b, c, d: quadrant probabilities (top-left, top-right, bottom-left, bottom-right);
            row = source, column = target, so ``a + c`` is the chance a level keeps a target id
            bit at 0 and controls how skewed in-degrees are. They must sum to 1.
        noise: per-level multiplicative noise on ``a..d``, in ``[0, 1)``.
        permute: shuffle ids with a seeded permutation (spreads hubs over the id range).
    """

    num_nodes: int
    num_edges: int
    a: float = 0.57
    b: float = 0.19
    c: float = 0.19
    d: float = 0.05
    noise: float = 0.1
    permute: bool = True

    def __post_init__(self):
        if self.num_nodes < 2:
            raise ValueError(f"num_nodes must be >= 2, got {self.num_nodes}")
        if self.num_edges < 0:
            raise ValueError(f"num_edges must be >= 0, got {self.num_edges}")
        probs = (self.a, self.b, self.c, self.d)
        if min(probs) < 0 or abs(sum(probs) - 1.0) > 1e-6:
            raise ValueError(f"a, b, c, d must be >= 0 and sum to 1, got {probs}")
        if not 0 <= self.noise < 1:
            raise ValueError(f"noise must be in [0, 1), got {self.noise}")

    @property
    def scale(self) -> int:
        return max(1, int(np.ceil(np.log2(self.num_nodes))))


def _level_thresholds(p: RMat, rng: np.random.Generator) -> np.ndarray:
    """``[scale, 3]`` cumulative quadrant thresholds (as uint32) with per-level noise."""
    base = np.array([p.a, p.b, p.c, p.d])
    t = np.empty((p.scale, 3), dtype=np.uint32)
    for lvl in range(p.scale):
        # noise moves mass between the diagonal (a, d) and the off-diagonal (b, c) quadrants
        mu = rng.uniform(-p.noise, p.noise)
        q = base * np.array([1 - mu, 1 + mu, 1 + mu, 1 - mu])
        q = np.clip(q, 0, None)
        q /= q.sum()
        t[lvl] = np.minimum(np.round(np.cumsum(q)[:3] * 2**32), 2**32 - 1).astype(np.uint32)
    return t


def node_permutation(num_nodes: int, seed: int) -> np.ndarray:
    """The id permutation an R-MAT graph with this seed uses (int64 ``[N]``)."""
    return np.random.default_rng([seed, 0xB1]).permutation(num_nodes).astype(np.int64)


def rmat_chunk(
    params: RMat,
    seed: int,
    index: int,
    chunk_size: int,
    thresholds: np.ndarray,
    perm: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Chunk ``index`` of the edge stream: ``(src, dst)`` int64, from its own generator."""
    m = min(chunk_size, params.num_edges - index * chunk_size)
    assert m > 0
    rng = np.random.default_rng([seed, 0xC0, index])
    scale, n = params.scale, params.num_nodes
    src = np.zeros(m, dtype=np.int64)
    dst = np.zeros(m, dtype=np.int64)
    for lvl in range(0, scale, 2):
        raw = rng.bit_generator.random_raw(m)  # two levels per 64 random bits
        halves = (raw.astype(np.uint32), (raw >> np.uint64(32)).astype(np.uint32))
        for r, row in zip(halves, thresholds[lvl : lvl + 2]):
            t_a, t_ab, t_abc = row
            src <<= 1
            src |= r >= t_ab  # quadrants c, d
            dst <<= 1
            dst |= (r >= t_abc) | ((r >= t_a) & (r < t_ab))  # quadrants d, b
    # [0, 2**scale) -> [0, N): keeps the shape of the distribution, no rejection
    src = (src * n) >> scale
    dst = (dst * n) >> scale
    if perm is not None:
        src, dst = perm[src], perm[dst]
    return src, dst


def rmat_edges(
    params: RMat,
    seed: int,
    chunk_size: int = DEFAULT_CHUNK,
    perm: np.ndarray | None = None,
    workers: int = 1,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield ``(src, dst)`` int64 chunks of R-MAT edges, in order; deterministic in
    ``(params, seed, chunk_size)`` whatever ``workers`` is.

    Args:
        params: the R-MAT parameters.
        seed: random seed.
        chunk_size: edges per chunk; small chunks stay in cache (numpy releases the GIL, so
            ``workers`` threads generate chunks in parallel).
        perm: the id permutation (pass it when calling repeatedly to avoid recomputing it);
            default ``node_permutation(N, seed)`` when ``params.permute``.
        workers: threads generating chunks.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    thresholds = _level_thresholds(params, np.random.default_rng([seed, 0xA0]))
    if params.permute and perm is None:
        perm = node_permutation(params.num_nodes, seed)
    num_chunks = -(-params.num_edges // chunk_size)

    def one(i):
        return rmat_chunk(params, seed, i, chunk_size, thresholds, perm)

    if workers <= 1:
        for i in range(num_chunks):
            yield one(i)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        # bounded look-ahead keeps memory flat
        window = 4 * workers
        futures = [pool.submit(one, i) for i in range(min(window, num_chunks))]
        for i in range(num_chunks):
            out = futures[i].result()
            futures[i] = None
            if i + window < num_chunks:
                futures.append(pool.submit(one, i + window))
            yield out
