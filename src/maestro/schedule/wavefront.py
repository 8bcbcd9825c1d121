"""Wavefront scheduler: keep every section busy by reordering samples through the DAG.

Sections are scheduled in topological order. For each section, an event loop over its
replicas (earliest-free first) fills the next micro-batch from the samples whose inputs are
estimated to be ready by then, favouring those that unblock the most other work (downstream
forwards, and upstream backwards waiting for their gradients), then the largest. Because each
replica takes work when it becomes free, estimated cost (not sample count) is balanced across
a section's replicas. Micro-batches respect ``micro_batch_size`` and ``token_budget``.

Two refinements, each a variant of the greedy pass: a *lookahead* lets a free replica idle for
a soon-ready sample that unblocks much more work than the ready ones (e.g. an image sample
whose encoder backward waits on the LLM's gradients, rather than a text-only one); and
*Johnson's rule* for two-stage flow shops may order a producer's samples instead (those whose
downstream work exceeds their own first, cheapest first, so consumers start early; then the
rest, most downstream work first). ``wavefront_schedule`` runs a few variants and keeps the
schedule the simulator predicts fastest on the same cost model; the data-order (fifo)
schedule competes too, so a wavefront schedule is never predicted slower than fifo's.

A section whose cost model runs it in lockstep (``cost_model.lockstep(n) = k > 1``: FSDP) is
scheduled by shard group (``k`` consecutive replicas) instead of by replica: the earliest-free
group takes a round of one micro-batch per replica, dealt from the ready samples so their
costs stay close, and the round takes as long as its slowest micro-batch (the simulator's
lockstep rule); a group with fewer ready samples than replicas waits for more while any are
to come. So the replicas of a group get the same number of micro-batches, but for the
section's very last round when the samples run out, and the lockstep replay pads only that.

Estimated readiness follows the runtime's execution rule (see ``maestro.sim``): a sample's
output of a section exists when the forward of its micro-batch ends; a section whose backward
runs right after each forward (``role == "step"``) is busy for forward plus backward; a frozen
section is forward-only and so runs ahead of its consumers, limited only by its own speed.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from maestro.costmodel import CostModel, UnitCostModel, micro_batch_features
from maestro.schedule.fifo import fifo_schedule
from maestro.schedule.graph import (
    check_sections,
    consumers_of,
    grad_consumers,
    role,
    topo_order,
)
from maestro.schedule.timeline import lockstep_degree, shard_groups, simulate
from maestro.schedule.types import (
    MicroBatch,
    SampleInfo,
    Schedule,
    SectionSpec,
)


def _closure(start: str, edges: dict[str, list[str]]) -> set[str]:
    seen: set[str] = set()
    stack = list(edges.get(start, ()))
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(edges.get(n, ()))
    return seen


#: ``(lookahead, johnson)`` passes tried by ``wavefront_schedule`` (see ``greedy_wavefront``).
PASSES = ((0.0, False), (0.5, False), (2.0, False), (0.0, True))
_SCAN = 32  # upcoming arrivals a lookahead inspects


def wavefront_schedule(
    samples: Sequence[SampleInfo],
    sections: Sequence[SectionSpec],
    cost_model: CostModel | None = None,
    *,
    passes: Sequence[tuple[float, bool]] = PASSES,
    with_fifo: bool = True,
    group_by_length: bool = True,
) -> Schedule:
    """Wavefront schedule: the best of a few greedy passes, scored by the simulator.

    Each pass (``greedy_wavefront``) uses a different lookahead or producer order; the
    schedule whose simulated step time (``maestro.schedule.timeline.simulate``, the
    simulator's engine, on the same cost model) is shortest wins, the first pass on ties.
    With ``with_fifo`` the fifo schedule is scored too and kept (under the name
    ``"wavefront"``) if it is strictly faster, so the result is never predicted slower than
    fifo; how close that is to "never slower" in a real run depends only on the cost model's
    error. With ``group_by_length`` a pass that fills micro-batches longest sample first
    (similar lengths together, as a length-grouped sampler does) and, with ``with_fifo``,
    the fifo schedule of the length-sorted batch compete too: where the cost model prices
    padding (the runtime pads a micro-batch to its longest sample), grouping wins there.

    Args:
        samples: the global batch.
        sections: the section specs (DAG through ``inputs``).
        cost_model: estimates compute and transfer times; ``UnitCostModel`` if omitted.
        passes: the ``(lookahead, johnson)`` variants to try.
        with_fifo: also score the fifo schedule and keep it when it is predicted faster.
        group_by_length: also try the length-grouped pass (and fifo).

    Returns:
        A ``Schedule`` whose replicas each hold an ordered list of micro-batches.
    """
    check_sections(sections)
    if not passes:
        raise ValueError("passes must not be empty")
    cm = cost_model if cost_model is not None else UnitCostModel()
    prep = _prepare(samples, sections, cm)
    score = len(passes) > 1 or with_fifo
    best, best_t = None, float("inf")
    score = score or group_by_length
    runs = [(la, jo, False) for la, jo in passes]
    if group_by_length:
        runs.append((0.0, False, True))
    for la, jo, by_len in runs:
        sched = _greedy(prep, la, jo, by_len)
        t = simulate(sched, samples, sections, cm).step_time if score else 0.0
        if best is None or t < best_t - 1e-12 * max(t, 1.0):
            best, best_t = sched, t
    if with_fifo:
        orders = [list(samples)]
        if group_by_length:
            orders.append(sorted(samples, key=lambda s: -s.cost.get("tokens", 0.0)))
        for order in orders:
            fifo = fifo_schedule(order, sections)
            t = simulate(fifo, samples, sections, cm).step_time
            if t < best_t - 1e-12 * max(t, 1.0):
                best, best_t = Schedule(order=fifo.order, name="wavefront"), t
    return best


def greedy_wavefront(
    samples: Sequence[SampleInfo],
    sections: Sequence[SectionSpec],
    cost_model: CostModel | None = None,
    *,
    lookahead: float = 0.0,
    johnson: bool = False,
) -> Schedule:
    """One greedy, event-driven wavefront pass.

    Args:
        samples: the global batch.
        sections: the section specs (DAG through ``inputs``).
        cost_model: estimates micro-batch and transfer times; ``UnitCostModel`` if omitted.
        lookahead: a free replica whose best ready micro-batch would take ``d`` seconds idles
            instead, if a sample that unblocks more work becomes ready within
            ``lookahead * d`` (0: never idle while work is ready).
        johnson: producers order samples by Johnson's flow-shop rule instead of most
            downstream work first.
    """
    cm = cost_model if cost_model is not None else UnitCostModel()
    return _greedy(_prepare(samples, sections, cm), lookahead, johnson)


@dataclass
class _Prep:
    """What every greedy pass shares: graph facts and per-(sample, section) estimates."""

    by_name: dict[str, SectionSpec]
    order: list[str]
    roles: dict[str, str]
    cm: CostModel
    cost_of: dict[int, Mapping[str, float]]
    send: dict[str, dict[int, float]]  # producer -> sample -> estimated transfer seconds
    own: dict[str, dict[int, float]]  # section -> sample -> its estimated compute seconds
    lockstep: dict[str, int]  # section -> shard-group size (> 1: FSDP lockstep)
    key: dict[str, dict[int, tuple]]  # section -> sample -> pool key (smaller = sooner)
    johnson: dict[str, dict[int, tuple]]  # the same, producers ordered by Johnson's rule
    length: dict[str, dict[int, tuple]]  # the same, longest first (length-grouped pass)


def _prepare(samples, sections, cm: CostModel) -> _Prep:
    by_name = check_sections(sections)
    order = topo_order(sections)
    gcons = grad_consumers(sections)
    roles = {n: role(by_name[n], gcons) for n in order}
    descendants = {n: _closure(n, consumers_of(sections)) for n in order}
    # sections whose backward waits for this one's input gradients
    grad_producers: dict[str, list[str]] = {n: [] for n in order}
    for p, cs in gcons.items():
        for c in cs:
            grad_producers[c].append(p)
    grad_ancestors = {n: _closure(n, grad_producers) for n in order}

    # per-(sample, section) estimates: a sample's share of a full micro-batch of its like,
    # so fixed per-micro-batch costs are amortised as they will be
    cost_of = {s.sample_id: s.cost for s in samples}
    one = {i: micro_batch_features([c]) for i, c in cost_of.items()}
    fwd: dict[str, dict[int, float]] = {}
    bwd: dict[str, dict[int, float]] = {}
    for n in order:
        m = by_name[n].micro_batch_size
        act = [s.sample_id for s in samples if n in s.sections]
        full = {i: {k: v * m for k, v in one[i].items()} for i in act}
        fwd[n] = {i: cm.forward_time(n, full[i]) / m for i in act}
        bwd[n] = {} if roles[n] == "forward" else {i: cm.backward_time(n, full[i]) / m for i in act}
    key = {}
    johnson = {}
    length = {}
    owns: dict[str, dict[int, float]] = {}
    for n in order:
        k, kj = {}, {}
        owns[n] = {}
        for i in fwd[n]:
            own = fwd[n][i] + (bwd[n].get(i, 0.0) if roles[n] == "step" else 0.0)
            owns[n][i] = own
            down = sum(fwd[d].get(i, 0.0) + bwd[d].get(i, 0.0) for d in descendants[n])
            up = sum(bwd[a].get(i, 0.0) for a in grad_ancestors[n])
            # most work unblocked first (downstream passes, upstream backwards waiting for
            # this sample's gradients), then largest own cost (balances replicas), then id
            k[i] = (-(down + up), -own, i)
            if down > 0:
                # a producer feeding a pipeline: Johnson's two-stage flow-shop rule. Samples
                # whose downstream work exceeds their own go first, cheapest first (consumers
                # start early); then the rest, most downstream work first (no long tail).
                kj[i] = (0, own, i) if own < down else (1, -down, i)
            else:
                kj[i] = k[i]
        key[n] = k
        johnson[n] = kj
        # longest first, so a micro-batch holds samples of similar length (little padding)
        length[n] = {i: (-cost_of[i].get("tokens", 0.0), -owns[n][i], i) for i in fwd[n]}
    send = {n: {i: cm.transfer_time(n, one[i], True) for i in fwd[n]} for n in order}
    lock = {n: k for n in order if (k := lockstep_degree(cm, n)) > 1}
    return _Prep(by_name, order, roles, cm, cost_of, send, owns, lock, key, johnson, length)


def _greedy(
    prep: _Prep, lookahead: float, johnson: bool = False, by_length: bool = False
) -> Schedule:
    if lookahead < 0:
        raise ValueError(f"lookahead must be >= 0, got {lookahead}")
    out_time: dict[str, dict[int, float]] = {}
    result: dict[str, list[list[MicroBatch]]] = {}
    for n in prep.order:
        sec = prep.by_name[n]
        # readiness: every producer this sample activates has produced and sent its output
        ready = {}
        for i in prep.key[n]:
            t = 0.0
            for p in sec.inputs:
                done = out_time[p].get(i)
                if done is not None:
                    t = max(t, done + prep.send[p][i])
            ready[i] = t
        keys = (prep.length if by_length else prep.johnson if johnson else prep.key)[n]
        if n in prep.lockstep:
            reps, out_time[n] = _lockstep_list_schedule(
                sec,
                prep.lockstep[n],
                ready,
                keys,
                prep.own[n],
                prep.cost_of,
                prep.cm,
                with_backward=prep.roles[n] == "step",
            )
        else:
            reps, out_time[n] = _list_schedule(
                sec,
                ready,
                keys,
                prep.cost_of,
                prep.cm,
                with_backward=prep.roles[n] == "step",
                lookahead=lookahead,
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
    lookahead: float = 0.0,
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
    while pending or pool:
        t, r = heapq.heappop(replicas)
        if not pool and ready[pending[-1]] > t:
            t = ready[pending[-1]]  # idle until the next sample's inputs arrive
        while pending and ready[pending[-1]] <= t:
            heapq.heappush(pool, key[pending.pop()])
        mb = _fill(pool, sec, cost_of)
        if lookahead > 0 and pending:
            # idle for a soon-ready sample that unblocks more than the best ready one
            f = cm.forward_time(sec.name, micro_batch_features(cost_of[i] for i in mb))
            horizon = t + lookahead * f
            top = key[mb[0]][0]  # rank class of the best ready sample (smaller = sooner)
            # look at the next few arrivals only, so a pass stays O(n log n)
            k, stop = len(pending) - 1, max(-1, len(pending) - 1 - _SCAN)
            while k > stop and ready[pending[k]] <= horizon and key[pending[k]][0] >= top:
                k -= 1
            if k > stop and ready[pending[k]] <= horizon and key[pending[k]][0] < top:
                for i in mb:
                    heapq.heappush(pool, key[i])
                t = ready[pending[k]]
                while pending and ready[pending[-1]] <= t:
                    heapq.heappush(pool, key[pending.pop()])
                mb = _fill(pool, sec, cost_of)
        feats = micro_batch_features(cost_of[i] for i in mb)
        f = cm.forward_time(sec.name, feats)
        end = t + f + (cm.backward_time(sec.name, feats) if with_backward else 0.0)
        for i in mb:
            done_at[i] = t + f
        reps[r].append(MicroBatch(tuple(mb)))
        heapq.heappush(replicas, (end, r))
    return reps, done_at


def _lockstep_list_schedule(
    sec: SectionSpec,
    k: int,
    ready: dict[int, float],
    key: dict[int, tuple],
    own: dict[int, float],
    cost_of: dict,
    cm: CostModel,
    with_backward: bool,
) -> tuple[list[list[MicroBatch]], dict[int, float]]:
    """``_list_schedule`` for a lockstep section: the event loop runs over shard groups
    (``k`` consecutive replicas, ``shard_groups``), not replicas.

    The earliest-free group takes one round: a micro-batch for each of its replicas, filled
    together from the ready samples (``_fill_round``), so the replicas of a group keep the
    same micro-batch count and similar micro-batches; the round ends when its slowest
    micro-batch does (the replay's lockstep rule). A group with fewer ready samples than
    replicas waits for more while any are still to come, so only the last round of a group
    can leave a replica without a micro-batch (when the samples run out). No lookahead: the
    group already waits for its round to fill.

    Returns the per-replica micro-batches and each sample's estimated output time.
    """
    pending = sorted(ready, key=lambda i: ready[i], reverse=True)  # pop() = earliest
    pool: list[tuple] = []
    groups = shard_groups(sec.dp, k)
    free = [(0.0, g) for g in range(len(groups))]
    reps: list[list[MicroBatch]] = [[] for _ in range(sec.dp)]
    done_at: dict[int, float] = {}
    while pending or pool:
        t, g = heapq.heappop(free)
        grp = groups[g]
        while pending and ready[pending[-1]] <= t:
            heapq.heappush(pool, key[pending.pop()])
        # a round needs a sample per replica: wait for arrivals while any are to come
        while pending and len(pool) < len(grp):
            t = max(t, ready[pending[-1]])
            while pending and ready[pending[-1]] <= t:
                heapq.heappush(pool, key[pending.pop()])
        fwd, bwd = 0.0, 0.0  # the round's slowest forward and backward
        taken: list[int] = []
        for r, mb in zip(grp, _fill_round(pool, sec, cost_of, own, len(grp))):
            feats = micro_batch_features(cost_of[i] for i in mb)
            fwd = max(fwd, cm.forward_time(sec.name, feats))
            if with_backward:
                bwd = max(bwd, cm.backward_time(sec.name, feats))
            reps[r].append(MicroBatch(tuple(mb)))
            taken.extend(mb)
        for i in taken:  # every forward of the round ends with the slowest
            done_at[i] = t + fwd
        heapq.heappush(free, (t + fwd + bwd, g))
    return reps, done_at


def _fill_round(
    pool: list[tuple], sec: SectionSpec, cost_of: dict, own: dict[int, float], k: int
) -> list[list[int]]:
    """Pop one round of up to ``k`` micro-batches from ``pool`` (best keys first), dealt so
    their estimated costs stay close: each sample goes to the micro-batch with room that has
    no sample yet, else the one with the least estimated cost (ties: the lowest index), so
    every replica of the round gets a sample before any gets two. Empty micro-batches are
    dropped (fewer samples than ``k``)."""
    mbs: list[list[int]] = [[] for _ in range(k)]
    tok = [0.0] * k
    load = [0.0] * k
    skipped: list[tuple] = []
    budget = sec.token_budget
    # as ``_fill``: a few samples too long for any remaining token budget are passed over
    while pool and len(skipped) < 8 and any(len(m) < sec.micro_batch_size for m in mbs):
        item = heapq.heappop(pool)
        i = item[-1]
        ti = cost_of[i].get("tokens", 0.0)
        room = [
            j
            for j in range(k)
            if len(mbs[j]) < sec.micro_batch_size
            and (budget is None or not mbs[j] or tok[j] + ti <= budget)
        ]
        if not room:
            skipped.append(item)
            continue
        j = min(room, key=lambda j: (bool(mbs[j]), load[j], j))
        mbs[j].append(i)
        tok[j] += ti
        load[j] += own.get(i, 0.0)
    for item in skipped:
        heapq.heappush(pool, item)
    out = [m for m in mbs if m]
    assert out, "a free group with a non-empty pool must take a sample"
    return out


def _fill(pool: list[tuple], sec: SectionSpec, cost_of: dict) -> list[int]:
    """Pop the next micro-batch from ``pool`` (best keys first) within the section's limits."""
    mb: list[int] = []
    skipped: list[tuple] = []
    tok = 0.0
    budget = sec.token_budget
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
    return mb
