"""Wavefront scheduler: keep every section busy by reordering samples through the DAG.

Sections are scheduled in topological order. For each section, an event loop over its
replicas (earliest-free first) fills the next micro-batch from the samples whose inputs are
estimated to be ready by then, favouring those that unblock the most other work (downstream
forwards, and upstream backwards waiting for their gradients), largest first. Because each
replica takes work when it becomes free, estimated cost (not sample count) is balanced across
a section's replicas. Micro-batches respect ``micro_batch_size`` and ``token_budget``.

Estimated readiness follows the runtime's execution rule (see ``maestro.sim``): a sample's
output of a section exists when the forward of its micro-batch ends; a section whose backward
runs right after each forward (``role == "step"``) is busy for forward plus backward; a frozen
section is forward-only and so runs ahead of its consumers, limited only by its own speed.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from maestro.costmodel import CostModel, UnitCostModel, micro_batch_features
from maestro.schedule.graph import (
    check_sections,
    consumers_of,
    grad_consumers,
    role,
    topo_order,
)
from maestro.schedule.types import MicroBatch, SampleInfo, Schedule, SectionSpec


def _closure(start: str, edges: dict[str, list[str]]) -> set[str]:
    seen: set[str] = set()
    stack = list(edges.get(start, ()))
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(edges.get(n, ()))
    return seen


def wavefront_schedule(
    samples: Sequence[SampleInfo],
    sections: Sequence[SectionSpec],
    cost_model: CostModel | None = None,
) -> Schedule:
    """Greedy, event-driven wavefront schedule.

    Args:
        samples: the global batch.
        sections: the section specs (DAG through ``inputs``).
        cost_model: estimates micro-batch and transfer times; ``UnitCostModel`` if omitted.

    Returns:
        A ``Schedule`` whose replicas each hold an ordered list of micro-batches.
    """
    by_name = check_sections(sections)
    cm = cost_model if cost_model is not None else UnitCostModel()
    order = topo_order(sections)
    gcons = grad_consumers(sections)
    roles = {n: role(by_name[n], gcons) for n in order}
    descendants = {n: _closure(n, consumers_of(sections)) for n in order}
    # sections whose backward waits for this one's input gradients
    grad_producers = {n: set() for n in order}
    for p, cs in gcons.items():
        for c in cs:
            grad_producers[c].add(p)
    grad_ancestors = {
        n: _closure(n, {k: sorted(v) for k, v in grad_producers.items()}) for n in order
    }

    # per-(sample, section) estimates from single-sample features
    cost_of = {s.sample_id: s.cost for s in samples}
    one = {i: micro_batch_features([c]) for i, c in cost_of.items()}
    fwd: dict[str, dict[int, float]] = {}
    bwd: dict[str, dict[int, float]] = {}
    for n in order:
        act = [s.sample_id for s in samples if n in s.sections]
        fwd[n] = {i: cm.forward_time(n, one[i]) for i in act}
        bwd[n] = {} if roles[n] == "forward" else {i: cm.backward_time(n, one[i]) for i in act}

    out_time: dict[str, dict[int, float]] = {}
    result: dict[str, list[list[MicroBatch]]] = {}
    for n in order:
        sec = by_name[n]
        act = list(fwd[n])
        # readiness: every producer this sample activates has produced and sent its output
        ready = {}
        for i in act:
            t = 0.0
            for p in sec.inputs:
                if i in out_time[p]:
                    t = max(t, out_time[p][i] + cm.transfer_time(p, one[i], True))
            ready[i] = t
        prio = {}
        for i in act:
            w = sum(fwd[d].get(i, 0.0) + bwd[d].get(i, 0.0) for d in descendants[n])
            w += sum(bwd[a].get(i, 0.0) for a in grad_ancestors[n])
            prio[i] = w
        # pool order: most work unblocked first, then largest own cost (balances replicas)
        key = {i: (-prio[i], -(fwd[n][i] + bwd[n].get(i, 0.0)), i) for i in act}
        reps, out_time[n] = _list_schedule(
            sec, ready, key, cost_of, cm, with_backward=roles[n] == "step"
        )
        result[n] = reps
    return Schedule(order=result, name="wavefront")


def _list_schedule(
    sec: SectionSpec,
    ready: dict[int, float],
    key: dict[int, tuple],
    cost_of: dict,
    cm: CostModel,
    with_backward: bool,
) -> tuple[list[list[MicroBatch]], dict[int, float]]:
    """Event loop over one section's replicas: the earliest-free replica takes the next
    micro-batch from the samples ready by then (smallest ``key`` first).

    Returns the per-replica micro-batches and each sample's estimated output time.
    """
    pending = sorted(ready, key=lambda i: ready[i], reverse=True)  # pop() = earliest
    pool: list[tuple] = []
    replicas = [(0.0, r) for r in range(sec.dp)]
    reps: list[list[MicroBatch]] = [[] for _ in range(sec.dp)]
    done_at: dict[int, float] = {}
    budget = sec.token_budget
    while pending or pool:
        t, r = heapq.heappop(replicas)
        if not pool and ready[pending[-1]] > t:
            t = ready[pending[-1]]  # idle until the next sample's inputs arrive
        while pending and ready[pending[-1]] <= t:
            heapq.heappush(pool, key[pending.pop()])
        mb: list[int] = []
        skipped: list[tuple] = []
        tok = 0.0
        # a few samples too long for the remaining token budget are passed over, not all
        while pool and len(mb) < sec.micro_batch_size and len(skipped) < 8:
            item = heapq.heappop(pool)
            i = item[-1]
            ti = cost_of[i].get("tokens", 0.0)
            if budget is not None and mb and tok + ti > budget:
                skipped.append(item)
                continue
            mb.append(i)
            tok += ti
        for item in skipped:
            heapq.heappush(pool, item)
        assert mb, "a free replica with a non-empty pool must take a sample"
        feats = micro_batch_features(cost_of[i] for i in mb)
        f = cm.forward_time(sec.name, feats)
        end = t + f + (cm.backward_time(sec.name, feats) if with_backward else 0.0)
        for i in mb:
            done_at[i] = t + f
        reps[r].append(MicroBatch(tuple(mb)))
        heapq.heappush(replicas, (end, r))
    return reps, done_at
