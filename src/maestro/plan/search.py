"""Planner search: each section's (dp, tp, micro-batch size, recompute) for a GPU budget.

The search is cheap enough to run at thousands of GPUs because it narrows in three stages:

1. **Memory first.** Every (tp, mbs, recompute) option of a section is checked against the
   per-device memory limit on its worst micro-batch (the ``mbs`` longest samples, within the
   section's token budget); a trainable section that feeds another trainable one runs all its
   forwards before its backwards and so holds its whole share of the batch, which sets a
   minimum ``dp``.
2. **Analytical ranking.** An option's work is its micro-batches' compute in data order; each
   section keeps its few options with the least GPU-seconds. For every combination, GPUs are
   dealt to the current bottleneck section (``tp`` GPUs per extra replica) until the budget
   is spent; the estimate is the slowest section's work / dp plus its all-reduce, plus the
   pipeline fill (a producer chain's first forward) and drain (a trainable producer's last
   backward). Combinations come in three families: the cheapest options per section, and
   those with one micro-batch size or one tp for all sections.
3. **Simulation.** The best few of each family are scheduled with the wavefront scheduler and
   replayed by the simulator on the same cost model; the fastest simulated plan wins.

``plan_monolithic`` gives the one-size-fits-all baseline the same effort: one (tp, mbs,
recompute) for the whole model, ``dp = gpus // tp`` replicas, each holding every section,
ranked by the same estimate and as many simulated (colocated schedule, length-balanced
shards by default).

Ablations (``Ablation``) turn one of Maestro's freedoms off so a report can attribute the
saving: one micro-batch size for every section, one tp for every section, encoders running
on every sample, or data-order scheduling instead of the cost-balancing wavefront.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from maestro.costmodel import AnalyticalCostModel, CostModel, micro_batch_features
from maestro.plan.tpmodel import with_layout
from maestro.schedule.graph import check_sections, grad_consumers, role, topo_order
from maestro.schedule.types import SampleInfo, SectionSpec

#: Micro-batch sizes the search tries (capped by each section's sample count).
MBS_CHOICES = (1, 2, 4, 8, 16, 32, 64)
#: Tensor-parallel degrees the search tries (capped by GPUs per node).
TP_CHOICES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Ablation:
    """Switch off one of Maestro's per-section freedoms (all off = the full planner).

    Args:
        same_mbs: every section uses one micro-batch size (no large forward-only batches).
        same_tp: every section uses one tensor-parallel degree (a small section pays its
            large neighbour's TP).
        no_skip: every sample activates every section (encoders run on text-only samples,
            as a dummy input would).
        fifo: score with data-order (fifo) scheduling instead of the balancing wavefront.
    """

    same_mbs: bool = False
    same_tp: bool = False
    no_skip: bool = False
    fifo: bool = False


@dataclass
class SearchOptions:
    """How hard and where to search.

    Args:
        mbs_choices: micro-batch sizes to try.
        tp_choices: tensor-parallel degrees to try (only 1 without an analytical model).
        recompute_choices: activation recompute options for trainable sections.
        memory_fraction: share of the GPU's memory a plan may use (the rest: allocator,
            fragmentation, communication buffers).
        memory_limit: bytes per device; default ``memory_fraction`` of the cost model's GPU
            memory, or no limit when the model has none (measured on this machine).
        keep_per_section: options per section kept after the analytical ranking.
        simulate_top: combinations (or monolithic layouts) replayed in the simulator.
        ablation: freedoms switched off (see ``Ablation``).
        balance_monolithic: give the monolithic baseline a length-balanced sampler (equal
            estimated work per rank) instead of data-order shards, so it is not weakened by
            imbalance a real trainer would avoid.
    """

    mbs_choices: Sequence[int] = MBS_CHOICES
    tp_choices: Sequence[int] = TP_CHOICES
    recompute_choices: Sequence[bool] = (False, True)
    memory_fraction: float = 0.9
    memory_limit: float | None = None
    keep_per_section: int = 3
    simulate_top: int = 3
    ablation: Ablation = field(default_factory=Ablation)
    balance_monolithic: bool = True


@dataclass(frozen=True)
class SectionPlan:
    """One section's resources: ``dp`` replicas of ``tp`` GPUs, ``dp * tp`` GPUs in all.

    Args:
        dp: data-parallel replicas.
        tp: GPUs per replica (tensor parallel).
        micro_batch_size: samples per micro-batch.
        recompute: activation checkpointing in backward.
        memory: predicted peak bytes per GPU.
    """

    dp: int
    tp: int
    micro_batch_size: int
    recompute: bool = False
    memory: float = 0.0

    @property
    def gpus(self) -> int:
        return self.dp * self.tp


@dataclass
class Plan:
    """A planned layout and its prediction.

    Args:
        sections: section name -> ``SectionPlan`` (monolithic: every section shares one
            layout and the same GPUs).
        monolithic: the whole model on every replica.
        gpus: GPUs the plan occupies.
        num_samples: samples per step (the global batch).
        step_time: simulated seconds per step.
        estimate: the analytical estimate that ranked it.
        candidates: layouts that passed the memory check; simulated: how many were replayed.
        busy_bound: the busiest GPU's compute plus its all-reduce in the simulated step: the
            step time if pipeline fill and drain overlapped with the neighbouring steps (the
            simulator replays one step alone; the runtime lets a frozen section run ahead
            into the next step, so the truth lies between ``busy_bound`` and ``step_time``).
    """

    sections: dict[str, SectionPlan]
    monolithic: bool
    gpus: int
    num_samples: int
    step_time: float
    estimate: float
    candidates: int = 0
    simulated: int = 0
    busy_bound: float = 0.0

    @property
    def samples_per_s(self) -> float:
        return self.num_samples / self.step_time

    @property
    def gpu_hours_per_million(self) -> float:
        """GPU-hours to train on one million samples at this plan's throughput."""
        return self.gpus * 1e6 / self.samples_per_s / 3600.0

    @property
    def gpu_hours_per_million_bound(self) -> float:
        """The same at ``busy_bound`` (fill and drain hidden by the neighbouring steps)."""
        return self.gpus * 1e6 * self.busy_bound / self.num_samples / 3600.0

    def describe(self) -> str:
        """``name dp=.. tp=.. mbs=..`` for every section, on one line."""
        parts = []
        for n, s in self.sections.items():
            rc = " rc" if s.recompute else ""
            parts.append(f"{n} dp={s.dp} tp={s.tp} mbs={s.micro_batch_size}{rc}")
        return ("monolithic: " if self.monolithic else "") + ", ".join(parts)


@dataclass
class _Option:
    tp: int
    mbs: int
    recompute: bool
    work: float  # seconds of the section's whole step on one replica (fwd, + bwd if trainable)
    longest: float  # seconds of its slowest micro-batch
    fwd_mb: float  # mean forward seconds per micro-batch (pipeline fill of its consumers)
    bwd_mb: float  # mean backward seconds per micro-batch (drain of a trainable producer)
    min_dp: int
    memory: float


def _worst_features(costs: list, sec: SectionSpec, mbs: int) -> dict[str, float]:
    """Features of the heaviest micro-batch a scheduler may form: the ``mbs`` longest samples
    that fit the token budget (at least one)."""
    by_len = sorted(costs, key=lambda c: c.get("tokens", 0.0), reverse=True)
    pick, tok = [], 0.0
    for c in by_len:
        t = c.get("tokens", 0.0)
        if pick and (len(pick) >= mbs or (sec.token_budget and tok + t > sec.token_budget)):
            continue
        pick.append(c)
        tok += t
        if len(pick) >= mbs:
            break
    return micro_batch_features(pick)


def _data_order_work(cm: CostModel, sec: SectionSpec, costs: list, trainable: bool):
    """``(total, longest, mean forward, mean backward)`` micro-batch seconds with ``costs``
    cut in data order."""
    total, longest, fwd, bwd = 0.0, 0.0, 0.0, 0.0
    cur, tok = [], 0.0
    mbs = []
    for c in costs:
        t = c.get("tokens", 0.0)
        if cur and (
            len(cur) >= sec.micro_batch_size
            or (sec.token_budget is not None and tok + t > sec.token_budget)
        ):
            mbs.append(cur)
            cur, tok = [], 0.0
        cur.append(c)
        tok += t
    if cur:
        mbs.append(cur)
    for mb in mbs:
        f = micro_batch_features(mb)
        f_s = cm.forward_time(sec.name, f)
        b_s = cm.backward_time(sec.name, f) if trainable else 0.0
        total += f_s + b_s
        fwd += f_s
        bwd += b_s
        longest = max(longest, f_s + b_s)
    k = max(len(mbs), 1)
    return total, longest, fwd / k, bwd / k


class _Problem:
    """The workload, prepared once for many candidate layouts."""

    def __init__(self, samples, sections, cost_model, gpus, opts: SearchOptions):
        check_sections(sections)
        if gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {gpus}")
        if not samples:
            raise ValueError("the global batch has no samples")
        self.opts = opts
        if opts.ablation.no_skip:
            every = frozenset(s.name for s in sections)
            samples = [replace(s, sections=every) for s in samples]
        self.samples = list(samples)
        self.sections = {s.name: s for s in sections}
        self.order = topo_order(sections)
        self.cm = cost_model
        self.gpus = gpus
        self.analytical = isinstance(cost_model, AnalyticalCostModel)
        gpn = getattr(getattr(cost_model, "gpu", None), "gpus_per_node", 8)
        self.gpus_per_node = gpn
        self.tps = sorted({t for t in opts.tp_choices if t <= gpn} if self.analytical else {1})
        if not self.tps:
            raise ValueError(f"no tp choice fits a node of {gpn} GPUs: {opts.tp_choices}")
        self.recomputes = sorted(set(opts.recompute_choices)) if self.analytical else [False]
        if opts.memory_limit is not None:
            self.memory_limit = opts.memory_limit
        elif self.analytical:
            self.memory_limit = opts.memory_fraction * cost_model.gpu.memory
        else:
            self.memory_limit = None
        gcons = grad_consumers(sections)
        self.roles = {n: role(self.sections[n], gcons) for n in self.order}
        self.costs = {n: [s.cost for s in self.samples if n in s.sections] for n in self.order}

    def model(self, tp: dict[str, int], rc: dict[str, bool]) -> CostModel:
        return with_layout(self.cm, tp, rc)

    def mbs_choices(self, n: str) -> list[int]:
        cap = max(1, len(self.costs[n]))
        out = sorted({m for m in self.opts.mbs_choices if m <= cap})
        return out or [min(self.opts.mbs_choices)]


def _section_options(p: _Problem, n: str) -> list[_Option]:
    """Memory-feasible options of section ``n`` with their data-order work."""
    sec = p.sections[n]
    trainable = not sec.frozen
    costs = p.costs[n]
    out = []
    for tp, mbs, rc in itertools.product(p.tps, p.mbs_choices(n), p.recomputes):
        if rc and not trainable:
            continue
        cm = p.model({n: tp}, {n: rc})
        spec = replace(sec, micro_batch_size=mbs)
        min_dp, mem = 1, 0.0
        if hasattr(cm, "memory_bytes") and costs:
            worst = _worst_features(costs, sec, mbs)
            mem = cm.memory_bytes(n, worst, trainable)
            if p.roles[n] == "producer":
                # all forwards before backwards: a replica holds its share of the batch
                total = micro_batch_features(costs)
                fixed = cm.memory_bytes(n, {"samples": 1.0}, trainable)
                per_all = cm.memory_bytes(n, total, trainable) - fixed
                # mem (one micro-batch in flight) already counts the weights
                room = p.memory_limit - mem if p.memory_limit is not None else 1.0
                if room <= 0:
                    continue
                if p.memory_limit is not None:
                    min_dp = max(1, -int(-per_all // room))
                mem = mem + per_all / min_dp
            if p.memory_limit is not None and mem > p.memory_limit:
                continue
        if min_dp * tp > p.gpus:
            continue
        work, longest, fwd_mb, bwd_mb = _data_order_work(cm, spec, costs, trainable)
        out.append(_Option(tp, mbs, rc, work, longest, fwd_mb, bwd_mb, min_dp, mem))
    return out


def _estimate(p: _Problem, n: str, o: _Option, dp: int) -> float:
    cm = p.model({n: o.tp}, {n: o.recompute})
    t = max(o.work / dp, o.longest) if p.costs[n] else 0.0
    if not p.sections[n].frozen:
        t += cm.allreduce_time(n, dp, dp * o.tp <= p.gpus_per_node)
    return t


def _allocate(p: _Problem, combo: dict[str, _Option]) -> tuple[dict[str, int], float] | None:
    """Deal GPUs to the bottleneck section; ``(dp per section, estimated step)`` or None."""
    dp = {n: o.min_dp for n, o in combo.items()}
    left = p.gpus - sum(dp[n] * o.tp for n, o in combo.items())
    if left < 0:
        return None
    heap = [(-_estimate(p, n, o, dp[n]), n) for n, o in combo.items()]
    heapq.heapify(heap)
    while heap:
        neg, n = heap[0]
        o = combo[n]
        if o.tp > left:
            break  # the bottleneck cannot grow; others growing would not shorten the step
        new = _estimate(p, n, o, dp[n] + 1)
        if new >= -neg:
            break
        dp[n] += 1
        left -= o.tp
        heapq.heapreplace(heap, (-new, n))
    return dp, max(-t for t, _ in heap) + _fill_drain(p, combo)


def _fill_drain(p: _Problem, combo: dict[str, _Option]) -> float:
    """Pipeline latency the per-section balance misses: a consumer cannot start before one
    micro-batch of each producer chain has run forward, and a trainable producer's last
    backward runs after its consumers' last gradients arrive."""
    ready: dict[str, float] = {}
    for n in p.order:
        ins = p.sections[n].inputs
        ready[n] = max((ready[i] + combo[i].fwd_mb for i in ins), default=0.0)
    fill = max(ready.values(), default=0.0)
    drain = max((combo[n].bwd_mb for n in p.order if p.roles[n] == "producer"), default=0.0)
    return fill + drain


def _simulate(p: _Problem, specs: list[SectionSpec], cm: CostModel, monolithic: bool, mbs=None):
    from maestro.schedule import fifo_schedule, monolithic_schedule, wavefront_schedule
    from maestro.sim import simulate

    if monolithic:
        world = specs[0].dp
        samples = p.samples
        if p.opts.balance_monolithic:
            samples = _balanced_order(p, samples, world, cm)
        sched = monolithic_schedule(samples, specs, cm, world_size=world, micro_batch_size=mbs)
    elif p.opts.ablation.fifo:
        sched = fifo_schedule(p.samples, specs, cm)
    else:
        sched = wavefront_schedule(p.samples, specs, cm)
    res = simulate(sched, p.samples, specs, cm)
    if monolithic:
        names = list(res.sections)
        world = len(res.sections[names[0]].busy)
        busiest = max(sum(res.sections[n].busy[r] for n in names) for r in range(world))
        bound = busiest + res.sections[names[0]].allreduce
    else:
        bound = max(max(st.busy) + st.allreduce for st in res.sections.values())
    return res.step_time, bound


def _balanced_order(p: _Problem, samples, world: int, cm: CostModel) -> list[SampleInfo]:
    """Samples reordered so each of ``world`` contiguous equal-count shards carries about the
    same estimated work (longest first to the least-loaded rank with room): a length-balanced
    sampler, so the baseline's ranks do not wait on the one holding the longest sequences."""
    n = len(samples)
    room = [((r + 1) * n) // world - (r * n) // world for r in range(world)]

    def cost(s: SampleInfo) -> float:
        f = micro_batch_features([s.cost])
        t = 0.0
        for name in p.order:
            if name in s.sections:
                t += cm.forward_time(name, f)
                if not p.sections[name].frozen:
                    t += cm.backward_time(name, f)
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


def plan_maestro(
    samples: Sequence[SampleInfo],
    sections: Sequence[SectionSpec],
    cost_model: CostModel,
    gpus: int,
    options: SearchOptions | None = None,
) -> Plan:
    """Choose every section's (dp, tp, mbs, recompute) for at most ``gpus`` GPUs.

    Args:
        samples: one global batch (the workload mix); it stays the same for every layout.
        sections: the section graph (``inputs``, ``frozen``, ``token_budget``); their ``dp``
            and ``micro_batch_size`` are ignored.
        cost_model: an ``AnalyticalCostModel`` (tp and recompute are modelled) or a measured
            model (tp = 1, no memory limit unless ``options.memory_limit`` is set and the
            model has ``memory_bytes``).
        gpus: the GPU budget; a plan uses at most this many.
        options: search settings and ablations.

    Returns:
        The fastest simulated ``Plan``.

    Raises:
        ValueError: no layout fits the memory limit within ``gpus`` GPUs.
    """
    opts = options or SearchOptions()
    p = _Problem(samples, sections, cost_model, gpus, opts)
    if gpus < len(p.order):
        raise ValueError(f"need at least one GPU per section: {gpus} < {len(p.order)}")
    per = {n: _section_options(p, n) for n in p.order}
    for n, os_ in per.items():
        if not os_:
            raise ValueError(
                f"section {n!r}: no (tp, micro-batch, recompute) fits "
                f"{_gb(p.memory_limit)} per device within {gpus} GPUs"
            )
    ab = opts.ablation
    if ab.same_mbs or ab.same_tp:
        families = [_tied_combos(p, per, ab)]
    else:
        # the cheapest options per section, and every tied family, each with its own best few
        # simulated, so the full search contains each ablation's search
        kept = {
            n: sorted(os_, key=lambda o: o.work * o.tp)[: opts.keep_per_section]
            for n, os_ in per.items()
        }
        families = [
            [dict(zip(p.order, c)) for c in itertools.product(*(kept[n] for n in p.order))],
            _tied_combos(p, per, Ablation(same_mbs=True)),
            _tied_combos(p, per, Ablation(same_tp=True)),
        ]
    chosen: dict[tuple, tuple] = {}
    num_ranked = 0
    for combos in families:
        ranked = []
        for combo in combos:
            alloc = _allocate(p, combo)
            if alloc is not None:
                ranked.append((alloc[1], combo, alloc[0]))
        num_ranked += len(ranked)
        ranked.sort(key=lambda r: r[0])
        for est, combo, dp in ranked[: opts.simulate_top]:
            key = tuple((n, o.tp, o.mbs, o.recompute, dp[n]) for n, o in combo.items())
            chosen.setdefault(key, (est, combo, dp))
    if not chosen:
        raise ValueError(f"no layout of the sections fits within {gpus} GPUs")
    best = None
    for est, combo, dp in chosen.values():
        specs = [replace(p.sections[n], dp=dp[n], micro_batch_size=combo[n].mbs) for n in p.order]
        cm = p.model(
            {n: o.tp for n, o in combo.items()}, {n: o.recompute for n, o in combo.items()}
        )
        step, bound = _simulate(p, specs, cm, monolithic=False)
        if best is None or step < best.step_time:
            best = Plan(
                sections={
                    n: SectionPlan(dp[n], o.tp, o.mbs, o.recompute, o.memory)
                    for n, o in combo.items()
                },
                monolithic=False,
                gpus=sum(dp[n] * o.tp for n, o in combo.items()),
                num_samples=len(p.samples),
                step_time=step,
                estimate=est,
                busy_bound=bound,
            )
    best.candidates = num_ranked
    best.simulated = len(chosen)
    return best


def _tied_combos(p: _Problem, per: dict[str, list[_Option]], ab: Ablation):
    """Combinations where the tied knob (mbs and/or tp) is equal across sections."""
    keys = set()
    for os_ in per.values():
        keys |= {(o.mbs if ab.same_mbs else None, o.tp if ab.same_tp else None) for o in os_}
    combos = []
    for m, t in keys:
        pick = {}
        for n, os_ in per.items():
            match = [o for o in os_ if (m is None or o.mbs == m) and (t is None or o.tp == t)]
            if not match:
                break
            pick[n] = sorted(match, key=lambda o: o.work * o.tp)[: p.opts.keep_per_section]
        else:
            combos.extend(dict(zip(p.order, c)) for c in itertools.product(*pick.values()))
    return combos


def _gb(x: float | None) -> str:
    return "no limit" if x is None else f"{x / 1e9:.1f} GB"


def plan_monolithic(
    samples: Sequence[SampleInfo],
    sections: Sequence[SectionSpec],
    cost_model: CostModel,
    gpus: int,
    options: SearchOptions | None = None,
) -> Plan:
    """The best one-size-fits-all layout: every replica holds the whole model.

    One (tp, mbs, recompute) for all sections, ``dp = gpus // tp`` replicas; the memory check
    sums every section's weights, optimizer state and one micro-batch's activations of the
    trainable sections. Candidates are ranked by the analytical estimate (whole-model work /
    dp plus every trainable section's all-reduce) and the best ``simulate_top`` are replayed
    with the colocated schedule, as in ``plan_maestro``.
    """
    opts = options or SearchOptions()
    p = _Problem(samples, sections, cost_model, gpus, opts)
    cands = []
    mbs_all = sorted({m for m in opts.mbs_choices if m <= len(p.samples)}) or [1]
    budgets = [s.token_budget for s in p.sections.values() if s.token_budget is not None]
    budget = min(budgets) if budgets else None
    any_trainable = any(not s.frozen for s in p.sections.values())
    for tp, mbs, rc in itertools.product(p.tps, mbs_all, p.recomputes):
        if rc and not any_trainable:
            continue
        dp = gpus // tp
        if dp < 1:
            continue
        tps = {n: tp for n in p.order}
        rcs = {n: rc and not p.sections[n].frozen for n in p.order}
        cm = p.model(tps, rcs)
        mem, work, longest = 0.0, 0.0, 0.0
        for n in p.order:
            sec = replace(p.sections[n], micro_batch_size=mbs, token_budget=budget)
            trainable = not sec.frozen
            if hasattr(cm, "memory_bytes") and p.costs[n]:
                mem += cm.memory_bytes(n, _worst_features(p.costs[n], sec, mbs), trainable)
            w, lg, _, _ = _data_order_work(cm, sec, p.costs[n], trainable)
            work += w
            longest += lg
        if p.memory_limit is not None and mem > p.memory_limit:
            continue
        same = dp * tp <= p.gpus_per_node
        est = max(work / dp, longest) + sum(
            cm.allreduce_time(n, dp, same) for n in p.order if not p.sections[n].frozen
        )
        cands.append((est, tp, mbs, rc, dp, mem, cm))
    if not cands:
        raise ValueError(
            f"no monolithic layout fits {_gb(p.memory_limit)} per device within {gpus} GPUs"
        )
    cands.sort(key=lambda c: c[0])
    best = None
    # as many simulations as plan_maestro's three families may use
    for est, tp, mbs, rc, dp, mem, cm in cands[: 3 * opts.simulate_top]:
        specs = [
            replace(p.sections[n], dp=dp, micro_batch_size=mbs, token_budget=budget)
            for n in p.order
        ]
        step, bound = _simulate(p, specs, cm, monolithic=True, mbs=mbs)
        if best is None or step < best.step_time:
            best = Plan(
                sections={
                    n: SectionPlan(dp, tp, mbs, rc and not p.sections[n].frozen, mem)
                    for n in p.order
                },
                monolithic=True,
                gpus=dp * tp,
                num_samples=len(p.samples),
                step_time=step,
                estimate=est,
                busy_bound=bound,
            )
    best.candidates = len(cands)
    best.simulated = min(3 * opts.simulate_top, len(cands))
    return best


def gpus_to_match(
    samples: Sequence[SampleInfo],
    sections: Sequence[SectionSpec],
    cost_model: CostModel,
    target_samples_per_s: float,
    max_gpus: int,
    options: SearchOptions | None = None,
) -> Plan | None:
    """The Maestro plan with the fewest GPUs (<= ``max_gpus``) that reaches the throughput.

    Binary search over the GPU budget (throughput grows with GPUs up to noise of the
    simulation; the found plan is re-planned at its budget, so it is a real plan). ``None``
    when even ``max_gpus`` falls short.
    """

    def plan(n: int) -> Plan | None:
        try:
            return plan_maestro(samples, sections, cost_model, n, options)
        except ValueError:
            return None

    top = plan(max_gpus)
    if top is None or top.samples_per_s < target_samples_per_s:
        return None
    lo, hi, best = len(sections) - 1, top.gpus, top
    while hi - lo > 1:
        mid = (lo + hi) // 2
        got = plan(mid)
        if got is not None and got.samples_per_s >= target_samples_per_s:
            hi, best = got.gpus, got
            hi = min(hi, mid)
        else:
            lo = mid
    return best


__all__ = [
    "Ablation",
    "Plan",
    "SearchOptions",
    "SectionPlan",
    "gpus_to_match",
    "plan_maestro",
    "plan_monolithic",
]
