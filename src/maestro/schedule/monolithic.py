"""The monolithic baseline as a schedule: every rank runs the whole model (DDP).

All sections share all ranks (``Schedule.colocated``). Samples are sharded over the ranks in
the order given, as contiguous equal-count shards, and cut into micro-batches of one size for
the whole model: the smallest ``micro_batch_size`` (and ``token_budget``) of any section, since
one micro-batch must fit every component's memory at once.

The order is the baseline's sampler (``ORDERS``, ``sampler_order``): ``data`` (a
``DistributedSampler``: the conventional baseline), ``tokens`` (``token_balanced_order``:
equal token counts per rank and length-sorted micro-batches, as trainers ship; the careful
baseline, which never looks at a cost model) or ``cost`` (``balanced_order``: Maestro's own
cost-aware balancer; the tuned baseline).
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
        whole = cut_micro_batches(shard, mbs, budget)
        for sec in sections:
            order[sec.name].append(
                [
                    MicroBatch(tuple(s.sample_id for s in mb if sec.name in s.sections))
                    for mb in whole
                ]
            )
    return Schedule(order=order, name="monolithic", colocated=True)


#: the monolithic baseline's samplers: data order, token-count balance, cost-model balance
ORDERS = ("data", "tokens", "cost")


def _greedy_bins(
    samples: Sequence[SampleInfo], world: int, weights: Sequence[float]
) -> list[list[SampleInfo]]:
    """``world`` bins of the contiguous shards' sizes (as ``monolithic_schedule`` cuts them),
    filled greedily heaviest first, each sample to the lightest bin with room. Ties keep data
    order (a stable sort; the lowest rank among equally light bins)."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    n = len(samples)
    room = [((r + 1) * n) // world - (r * n) // world for r in range(world)]
    heap = [(0.0, r) for r in range(world) if room[r] > 0]
    heapq.heapify(heap)
    bins: list[list[SampleInfo]] = [[] for _ in range(world)]
    for i in sorted(range(n), key=lambda i: -weights[i]):
        load, r = heapq.heappop(heap)
        bins[r].append(samples[i])
        if len(bins[r]) < room[r]:
            heapq.heappush(heap, (load + weights[i], r))
    return bins


def token_balanced_order(samples: Sequence[SampleInfo], world: int) -> list[SampleInfo]:
    """The careful baseline's sampler: token-count balance across ranks, as trainers ship it.

    Samples go longest first to the rank with the fewest tokens so far that still has room
    (equal sample counts per rank, the contiguous shards ``monolithic_schedule`` cuts): the
    greedy equal-size variant of verl's ``get_seqlen_balanced_partitions``
    (``verl.utils.seqlen_balancing``; Megatron-style sequence-length balancing). Within a
    rank the samples are sorted by length, longest first, so its micro-batches hold samples
    of similar length and pad little, as Hugging Face's ``group_by_length``
    (``LengthGroupedSampler``) does. A sample's length is its ``cost["tokens"]`` (0 when
    absent); no cost model is consulted, which is what separates it from ``balanced_order``.
    Greedy longest-first keeps every rank's token sum within the longest sample's tokens of
    every other's. Deterministic (ties keep data order).
    """
    tokens = [float(s.cost.get("tokens", 0.0)) for s in samples]
    bins = _greedy_bins(samples, world, tokens)
    # heaviest first already: a stable sort by length keeps ties in the order they arrived
    return [s for b in bins for s in sorted(b, key=lambda s: -s.cost.get("tokens", 0.0))]


def balanced_order(
    samples: Sequence[SampleInfo],
    world: int,
    cost_model,
    units: Sequence[tuple[str, bool]],
    micro_batch_size: int | None = None,
    token_budget: float | None = None,
) -> list[SampleInfo]:
    """The tuned baseline's sampler: Maestro's own cost-aware balancer. Samples reordered so
    each of ``world`` contiguous equal-count shards carries about the same work on
    ``cost_model``, so the baseline's ranks do not wait on the one holding the costliest
    samples.

    Greedy, costliest first to the least-loaded rank with room; a sample's work is the
    forward (and, for a trainable unit, backward) time of each ``(section, frozen)`` unit it
    activates, alone, on ``cost_model``. Each rank's samples are then sorted by length,
    longest first, so its micro-batches group similar lengths (as ``token_balanced_order``).

    A rank pays per micro-batch, not per sample: given the micro-batch cut
    (``micro_batch_size``, ``token_budget``), this order and ``token_balanced_order``'s are
    both priced as the ranks run them (every micro-batch on ``cost_model``; in FSDP lockstep,
    ``cost_model.lockstep``, the slowest rank's i-th micro-batch for every i) and the one
    whose busiest rank has the least work is returned, so the cost-aware balancer is never worse
    than token-count balance by the measure it balances. Deterministic (ties keep data
    order).
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")

    def work(feats: dict, active: set) -> float:
        t = 0.0
        for name, frozen in units:
            if name in active:
                t += cost_model.forward_time(name, feats)
                if not frozen:
                    t += cost_model.backward_time(name, feats)
        return t

    weights = [work(micro_batch_features([s.cost]), s.sections) for s in samples]
    bins = _greedy_bins(samples, world, weights)
    greedy = [s for b in bins for s in sorted(b, key=lambda s: -s.cost.get("tokens", 0.0))]
    if micro_batch_size is None:
        return greedy

    # FSDP ranks run in lockstep (every micro-batch's collectives wait for the slowest rank):
    # they pay the slowest rank's i-th micro-batch for every i; plain replicas meet once
    lockstep = any(getattr(cost_model, "lockstep", lambda n: 0)(n) for n, _ in units)

    def busiest(order: list[SampleInfo]) -> float:
        n = len(order)
        per_rank = []
        for r in range(world):
            shard = order[(r * n) // world : ((r + 1) * n) // world]
            times = []
            for mb in cut_micro_batches(shard, micro_batch_size, token_budget):
                t = 0.0
                for name, _frozen in units:
                    part = [s.cost for s in mb if name in s.sections]
                    if part:
                        t += work(micro_batch_features(part), {name})
                times.append(t)
            per_rank.append(times)
        if lockstep:
            depth = max(len(t) for t in per_rank)
            return sum(
                max((t[i] for t in per_rank if i < len(t)), default=0.0) for i in range(depth)
            )
        return max(sum(t) for t in per_rank)

    tokens = token_balanced_order(samples, world)
    return min((greedy, tokens), key=busiest)  # the first on a tie


def cut_micro_batches(items: Sequence, mbs: int, budget: float | None, tokens=None) -> list[list]:
    """``items`` in order, cut into micro-batches of at most ``mbs`` items and, when
    ``budget`` is set, at most ``budget`` tokens (a single longer item still gets its own):
    the one rule of ``monolithic_schedule``, the balancer and the planner's data-order work.
    ``tokens(item)``: an item's length (default: a ``SampleInfo``'s ``cost["tokens"]``)."""
    length = tokens or (lambda s: s.cost.get("tokens", 0.0))
    out: list[list] = []
    cur: list = []
    tok = 0.0
    for s in items:
        t = length(s)
        if cur and (len(cur) >= mbs or (budget is not None and tok + t > budget)):
            out.append(cur)
            cur, tok = [], 0.0
        cur.append(s)
        tok += t
    if cur:
        out.append(cur)
    return out


def sampler_order(
    order: str,
    samples: Sequence[SampleInfo],
    world: int,
    cost_model=None,
    units: Sequence[tuple[str, bool]] = (),
    micro_batch_size: int | None = None,
    token_budget: float | None = None,
) -> list[SampleInfo]:
    """``samples`` in the order of the baseline sampler ``order`` (one of ``ORDERS``) for
    ``world`` contiguous shards; ``cost_model``, ``units`` and the micro-batch cut
    (``micro_batch_size``, ``token_budget``) are used by ``cost`` only."""
    if order == "data":
        return list(samples)
    if order == "tokens":
        return token_balanced_order(samples, world)
    if order == "cost":
        return balanced_order(samples, world, cost_model, units, micro_batch_size, token_budget)
    raise ValueError(f"unknown monolithic order {order!r}; choose one of: {', '.join(ORDERS)}")


def whole_micro_batches(schedule: Schedule, rank: int) -> list[tuple[int, ...]]:
    """Rank ``rank``'s whole-model micro-batches of a ``monolithic_schedule``: the sample ids
    of each, in order (the union of every section's part)."""
    parts = [schedule.order[n][rank] for n in schedule.order]
    out = []
    for i in range(max((len(p) for p in parts), default=0)):
        ids = dict.fromkeys(sid for p in parts if i < len(p) for sid in p[i].sample_ids)
        out.append(tuple(sorted(ids)))
    return out
