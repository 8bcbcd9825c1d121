"""The monolithic baseline as a schedule: every rank runs the whole model (DDP).

All sections share all ranks (``Schedule.colocated``). Samples are sharded over the ranks in
data order, as a ``DistributedSampler`` would, and cut into micro-batches of one size for the
whole model: the smallest ``micro_batch_size`` (and ``token_budget``) of any section, since one
micro-batch must fit every component's memory at once.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from maestro.costmodel import micro_batch_features
from maestro.schedule.graph import check_sections
from maestro.schedule.types import MicroBatch, SampleInfo, Schedule, SectionSpec


def monolithic_schedule(
    samples: Sequence[SampleInfo],
    sections: Sequence[SectionSpec],
    cost_model=None,
    *,
    world_size: int | None = None,
    micro_batch_size: int | None = None,
) -> Schedule:
    """Whole-model micro-batches, contiguous data-order shards, one per rank.

    Args:
        samples: the global batch.
        sections: section specs; their ranks (``dp * tp``) only set the default world size.
        cost_model: unused (the baseline does not look at costs).
        world_size: number of ranks (default: the sum of the sections' ``dp``).
        micro_batch_size: samples per whole-model micro-batch (default: the smallest of the
            sections' ``micro_batch_size``).

    Returns:
        A colocated schedule: ``order[sec][r][i]`` is the part of rank ``r``'s ``i``-th
        micro-batch that activates ``sec`` (empty when none of its samples do).
    """
    check_sections(sections)
    world = world_size if world_size is not None else sum(s.dp * s.tp for s in sections)
    if world < 1:
        raise ValueError(f"world_size must be >= 1, got {world}")
    mbs = micro_batch_size or min(s.micro_batch_size for s in sections)
    if mbs < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {mbs}")
    budgets = [s.token_budget for s in sections if s.token_budget is not None]
    budget = min(budgets) if budgets else None

    n = len(samples)
    order: dict[str, list[list[MicroBatch]]] = {s.name: [] for s in sections}
    for r in range(world):
        shard = samples[(r * n) // world : ((r + 1) * n) // world]
        whole: list[list[SampleInfo]] = []
        cur: list[SampleInfo] = []
        tok = 0.0
        for s in shard:
            t = s.cost.get("tokens", 0.0)
            full = len(cur) >= mbs or (budget is not None and cur and tok + t > budget)
            if full:
                whole.append(cur)
                cur, tok = [], 0.0
            cur.append(s)
            tok += t
        if cur:
            whole.append(cur)
        for sec in sections:
            order[sec.name].append(
                [
                    MicroBatch(tuple(s.sample_id for s in mb if sec.name in s.sections))
                    for mb in whole
                ]
            )
    return Schedule(order=order, name="monolithic", colocated=True)


def balanced_order(
    samples: Sequence[SampleInfo],
    world: int,
    cost_model,
    units: Sequence[tuple[str, bool]],
) -> list[SampleInfo]:
    """Samples reordered so each of ``world`` contiguous equal-count shards carries about the
    same estimated work: a length-balanced sampler, so the baseline's ranks do not wait on
    the one holding the longest sequences.

    Greedy, longest first to the least-loaded rank with room; a sample's work is the forward
    (and, for a trainable unit, backward) time of each ``(section, frozen)`` unit it
    activates, alone, on ``cost_model``. Deterministic (ties keep data order).
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    n = len(samples)
    room = [((r + 1) * n) // world - (r * n) // world for r in range(world)]

    def cost(s: SampleInfo) -> float:
        f = micro_batch_features([s.cost])
        t = 0.0
        for name, frozen in units:
            if name in s.sections:
                t += cost_model.forward_time(name, f)
                if not frozen:
                    t += cost_model.backward_time(name, f)
        return t

    heap = [(0.0, r) for r in range(world) if room[r] > 0]
    heapq.heapify(heap)
    bins: list[list[SampleInfo]] = [[] for _ in range(world)]
    for c, s in sorted(((cost(s), s) for s in samples), key=lambda x: -x[0]):
        load, r = heapq.heappop(heap)
        bins[r].append(s)
        if len(bins[r]) < room[r]:
            heapq.heappush(heap, (load + c, r))
    return [s for b in bins for s in b]


def whole_micro_batches(schedule: Schedule, rank: int) -> list[tuple[int, ...]]:
    """Rank ``rank``'s whole-model micro-batches of a ``monolithic_schedule``: the sample ids
    of each, in order (the union of every section's part)."""
    parts = [schedule.order[n][rank] for n in schedule.order]
    out = []
    for i in range(max((len(p) for p in parts), default=0)):
        ids = dict.fromkeys(sid for p in parts if i < len(p) for sid in p[i].sample_ids)
        out.append(tuple(sorted(ids)))
    return out
