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
from maestro.plan.colocate import group_name, merged_samples
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
        disaggregated: every section on its own devices (no colocated groups, and not the
            monolithic layout either).
    """

    same_mbs: bool = False
    same_tp: bool = False
    no_skip: bool = False
    fifo: bool = False
    disaggregated: bool = False


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
        colocate: also search layouts where groups of sections share devices
            (``maestro.plan.colocate``: all sections colocated with per-section micro-batches,
            or e.g. the encoders with the LLM). ``maestro.runtime`` runs only disjoint
            sections or the whole model on every rank, so plans for run configs turn it off.
        include_monolithic: the monolithic layouts (``plan_monolithic``'s search) are
            Maestro candidates too, so Maestro's plan is never slower than the baseline's.
        objective: ``"gpu_hours"``: the fewest GPU-hours per sample (GPUs x step time; a
            plan may leave GPUs of the budget unused); ``"step_time"``: the fastest step on
            at most the budget (e.g. a fixed number of processes on this machine).
        zero1: shard trainable sections' optimizer state (fp32 master weights, Adam moments)
            over their DP group (ZeRO-1 / Megatron's distributed optimizer), in both the
            Maestro and the monolithic search.
        steps: consecutive steps replayed to score a layout (``maestro.plan.steady``); the
            plan's step time is the steady-state period, which lets a frozen section run one
            step ahead exactly as the runtime does.
        batches: further global batches of the same workload (a sample of its data). With
            them, a layout (its own or the monolithic one, not a colocated group) is scored
            by replaying the planned batch then each of these, one step each, and its step
            time is the mean step after the first: one batch's mix of lengths and
            modalities can favour a layout that loses on the others. Each batch must hold
            as many samples as the planned one (``ValueError`` otherwise).
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
    colocate: bool = True
    include_monolithic: bool = True
    steps: int = 4
    batches: Sequence[Sequence[SampleInfo]] = ()
    zero1: bool = True
    objective: str = "gpu_hours"


@dataclass(frozen=True)
class SectionPlan:
    """One section's resources: ``dp`` replicas of ``tp`` GPUs, ``dp * tp`` GPUs in all.

    Args:
        dp: data-parallel replicas.
        tp: GPUs per replica (tensor parallel).
        micro_batch_size: samples per micro-batch.
        recompute: activation checkpointing in backward.
        memory: predicted peak bytes per GPU (of the whole group, when colocated).
        group: the colocated group it shares devices with (``"a+b"``), or ``""`` when the
            section has devices of its own.
    """

    dp: int
    tp: int
    micro_batch_size: int
    recompute: bool = False
    memory: float = 0.0
    group: str = ""

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
        busy_bound: the busiest GPU's compute plus its all-reduce per step: the step time if
            all pipeline fill and drain overlapped with the neighbouring steps (a lower bound).
        first_step: the first step from an idle start (``maestro.sim.simulate``'s figure);
            ``step_time`` is the steady-state period of consecutive steps.
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
    first_step: float = 0.0

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
        parts, done = [], set()
        for n, s in self.sections.items():
            rc = " rc" if s.recompute else ""
            if not s.group:
                parts.append(f"{n} dp={s.dp} tp={s.tp} mbs={s.micro_batch_size}{rc}")
            elif s.group not in done:
                done.add(s.group)
                mem = [(m, p) for m, p in self.sections.items() if p.group == s.group]
                inner = " ".join(
                    f"{m}:{p.micro_batch_size}{'rc' if p.recompute else ''}" for m, p in mem
                )
                parts.append(f"[{s.group}] dp={s.dp} tp={s.tp} mbs {inner}")
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
    mem_one: float = 0.0  # memory with one micro-batch in flight (no batch held)


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


def _check_batches(batches, size: int, names: set[str]) -> list[list[SampleInfo]]:
    """``SearchOptions.batches`` as lists, or ``ValueError`` naming the first bad batch: each
    must be a non-empty sequence of ``SampleInfo`` of the planned batch's size (the step time
    is read as the time of ``size`` samples), with unique sample ids and known sections."""
    if isinstance(batches, (str, bytes, SampleInfo)) or not isinstance(batches, Sequence):
        raise ValueError(
            f"batches must be a sequence of batches (sequences of SampleInfo), "
            f"got {type(batches).__name__}"
        )
    out = []
    for k, b in enumerate(batches):
        if isinstance(b, SampleInfo):
            raise ValueError(
                "batches must be a sequence of batches, not of samples: wrap one batch as [batch]"
            )
        if isinstance(b, (str, bytes)) or not isinstance(b, Sequence):
            raise ValueError(
                f"batches[{k}] must be a sequence of SampleInfo, got {type(b).__name__}"
            )
        if not b:
            raise ValueError(f"batches[{k}] is empty")
        bad = next((s for s in b if not isinstance(s, SampleInfo)), None)
        if bad is not None:
            raise ValueError(f"batches[{k}] holds a {type(bad).__name__}, not a SampleInfo")
        if len(b) != size:
            raise ValueError(
                f"batches[{k}] has {len(b)} samples, the planned batch {size}: "
                "batches must be global batches of the same size"
            )
        if len({s.sample_id for s in b}) != len(b):
            raise ValueError(f"batches[{k}] repeats a sample_id")
        unknown = set().union(*(s.sections for s in b)) - names
        if unknown:
            raise ValueError(f"batches[{k}] activates unknown sections: {sorted(unknown)}")
        out.append(list(b))
    return out


class _Problem:
    """The workload, prepared once for many candidate layouts."""

    def __init__(self, samples, sections, cost_model, gpus, opts: SearchOptions):
        check_sections(sections)
        if gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {gpus}")
        if not samples:
            raise ValueError("the global batch has no samples")
        if opts.objective not in ("gpu_hours", "step_time"):
            raise ValueError(
                f"objective must be 'gpu_hours' or 'step_time', got {opts.objective!r}"
            )
        if opts.steps < 1:
            raise ValueError(f"steps must be >= 1, got {opts.steps}")
        batches = _check_batches(opts.batches, len(samples), {s.name for s in sections})
        self.opts = opts
        if opts.ablation.no_skip:
            every = frozenset(s.name for s in sections)
            samples = [replace(s, sections=every) for s in samples]
            batches = [[replace(s, sections=every) for s in b] for b in batches]
        self.samples = list(samples)
        #: further batches the layouts are scored on (``SearchOptions.batches``)
        self.batches = batches
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
        # a measured model's fit is not extrapolated beyond its largest measured micro-batch
        measured = getattr(self.cm, "max_samples", {}).get(n)
        if measured:
            cap = min(cap, max(1, int(measured)))
        out = sorted({m for m in self.opts.mbs_choices if m <= cap})
        return out or [min(self.opts.mbs_choices)]


def _section_options(p: _Problem, n: str, standalone: bool = True) -> list[_Option]:
    """Memory-feasible options of section ``n`` with their data-order work.

    ``standalone=False``: as a member of a colocated group, which accounts for held
    activations itself (no producer ``min_dp`` here).
    """
    sec = p.sections[n]
    trainable = not sec.frozen
    costs = p.costs[n]
    out = []
    for tp, mbs, rc in itertools.product(p.tps, p.mbs_choices(n), p.recomputes):
        if rc and not trainable:
            continue
        cm = p.model({n: tp}, {n: rc})
        spec = replace(sec, micro_batch_size=mbs)
        min_dp, mem, mem_one = 1, 0.0, 0.0
        if hasattr(cm, "memory_bytes") and costs:
            worst = _worst_features(costs, sec, mbs)
            mem_one = cm.memory_bytes(n, worst, trainable)
            held = 0.0
            if standalone and p.roles[n] == "producer":
                # all forwards before backwards: a replica holds its share of the batch
                total = micro_batch_features(costs)
                fixed = cm.memory_bytes(n, {"samples": 1.0}, trainable)
                held = cm.memory_bytes(n, total, trainable) - fixed
            got = _fit(p, mem_one, _shard_bytes(p, n, tp), held, tp)
            if got is None:
                continue
            min_dp, mem = got
        if min_dp * tp > p.gpus:
            continue
        work, longest, fwd_mb, bwd_mb = _data_order_work(cm, spec, costs, trainable)
        out.append(_Option(tp, mbs, rc, work, longest, fwd_mb, bwd_mb, min_dp, mem, mem_one))
    # micro-batch sizes beyond the token budget change nothing: keep the smallest of equals
    seen, kept = set(), []
    for o in out:
        key = (o.tp, o.recompute, round(o.work, 9), o.min_dp)
        if key not in seen:
            seen.add(key)
            kept.append(o)
    return kept


def _shard_bytes(p: _Problem, n: str, tp: int) -> float:
    """Bytes per GPU of section ``n``'s optimizer state that ZeRO-1 shards over its DP group:
    fp32 master weights and Adam moments, 12 of the 18 bytes per parameter (Megatron-LM's
    distributed optimizer: ``6 + 12 / dp`` bytes per parameter instead of 18)."""
    if not p.opts.zero1 or p.sections[n].frozen or not p.analytical:
        return 0.0
    return 12.0 * p.cm.shapes[n].params / tp


def _fit(p: _Problem, mem_one: float, shard: float, held: float, tp: int):
    """``(min_dp, bytes per GPU at min_dp)`` for a replica whose ``mem_one`` (one micro-batch
    in flight, full optimizer state) loses ``shard * (1 - 1/dp)`` to ZeRO-1 and gains
    ``held / dp`` of held activations; None if no ``dp`` within the budget fits."""
    fixed = mem_one - shard
    divisible = shard + held
    if p.memory_limit is None:
        return 1, fixed + divisible
    room = p.memory_limit - fixed
    if room <= 0:
        return None
    min_dp = max(1, -int(-divisible // room))
    if min_dp * tp > p.gpus:
        return None
    return min_dp, fixed + divisible / min_dp


@dataclass
class _GroupOption:
    """A colocated group's option: one tp, each member's own (mbs, recompute) option."""

    tp: int
    members: dict[str, _Option]
    work: float
    longest: float
    fwd_mb: float
    bwd_mb: float
    min_dp: int
    memory: float


@dataclass
class _Unit:
    """A schedulable unit of a layout: one section, or a colocated group (``members``)."""

    name: str
    members: tuple[str, ...]
    inputs: tuple[str, ...]  # unit names
    frozen: bool
    role: str


def _units(p: _Problem, groups: list[tuple[str, ...]]) -> dict[str, _Unit]:
    from maestro.plan.colocate import merged_specs

    specs = merged_specs(
        [p.sections[n] for n in p.order], groups, {g: 1 for g in groups}, {n: 1 for n in p.order}
    )
    gcons = grad_consumers(specs)
    members = {group_name(g): g for g in groups}
    return {
        s.name: _Unit(s.name, members[s.name], s.inputs, s.frozen, role(s, gcons)) for s in specs
    }


def _group_options(p: _Problem, u: _Unit, member_opts: dict[str, list[_Option]]):
    """Options of a colocated group: per tp, the best few member options combined.

    Memory per GPU: every member's weights, optimizer state and one micro-batch of
    activations (members run one after another); a trainable member whose consumer in the
    group is trainable keeps the activations of the whole group micro-batch until that
    consumer's backward; if the group feeds a trainable section outside it, it holds its
    whole share of the batch (``min_dp``, as a standalone producer).
    """
    out = []
    inner_consumed = {
        n
        for c in u.members
        if not p.sections[c].frozen
        for n in p.sections[c].inputs
        if n in u.members
    }
    for tp in p.tps:
        choices = []
        for n in u.members:
            os_ = [o for o in member_opts[n] if o.tp == tp]
            choices.append(sorted(os_, key=lambda o: o.work)[: p.opts.keep_per_section])
        if not all(choices):
            continue
        for combo in itertools.product(*choices):
            opts = dict(zip(u.members, combo))
            group_mbs = max(o.mbs for o in combo)
            mem = sum(o.mem_one for o in combo)
            cm = p.model({n: tp for n in u.members}, {n: o.recompute for n, o in opts.items()})
            if hasattr(cm, "memory_bytes"):
                for n in inner_consumed:
                    if p.sections[n].frozen or not p.costs[n]:
                        continue
                    spec = p.sections[n]
                    whole = cm.memory_bytes(n, _worst_features(p.costs[n], spec, group_mbs), True)
                    mem += max(0.0, whole - opts[n].mem_one)
            held = 0.0
            if u.role == "producer" and hasattr(cm, "memory_bytes"):
                for n in u.members:
                    if p.sections[n].frozen or not p.costs[n]:
                        continue
                    total = micro_batch_features(p.costs[n])
                    fixed = cm.memory_bytes(n, {"samples": 1.0}, True)
                    held += cm.memory_bytes(n, total, True) - fixed
            got = _fit(p, mem, sum(_shard_bytes(p, n, tp) for n in u.members), held, tp)
            if got is None:
                continue
            min_dp, mem = got
            out.append(
                _GroupOption(
                    tp,
                    opts,
                    sum(o.work for o in combo),
                    sum(o.longest for o in combo),
                    sum(o.fwd_mb for o in combo),
                    sum(o.bwd_mb for o in combo),
                    min_dp,
                    mem,
                )
            )
    return out


def _members(u: _Unit, o) -> dict[str, _Option]:
    return o.members if isinstance(o, _GroupOption) else {u.members[0]: o}


def _estimate(p: _Problem, u: _Unit, o, dp: int) -> float:
    mem = _members(u, o)
    cm = p.model({n: o.tp for n in mem}, {n: m.recompute for n, m in mem.items()})
    t = max(o.work / dp, o.longest) if any(p.costs[n] for n in mem) else 0.0
    same = dp * o.tp <= p.gpus_per_node
    t += sum(cm.allreduce_time(n, dp, same) for n in mem if not p.sections[n].frozen)
    return t


def _allocate(p: _Problem, units: dict[str, _Unit], combo: dict) -> tuple[dict, float] | None:
    """Deal GPUs to the bottleneck unit; ``(dp per unit, estimated step)`` or None."""
    dp = {n: o.min_dp for n, o in combo.items()}
    left = p.gpus - sum(dp[n] * o.tp for n, o in combo.items())
    if left < 0:
        return None
    heap = [(-_estimate(p, units[n], o, dp[n]), n) for n, o in combo.items()]
    heapq.heapify(heap)
    while heap:
        neg, n = heap[0]
        o = combo[n]
        if o.tp > left:
            break  # the bottleneck cannot grow; others growing would not shorten the step
        new = _estimate(p, units[n], o, dp[n] + 1)
        if new >= -neg:
            break
        dp[n] += 1
        left -= o.tp
        heapq.heapreplace(heap, (-new, n))
    return dp, max(-t for t, _ in heap) + _fill_drain(units, combo)


def _fill_drain(units: dict[str, _Unit], combo: dict) -> float:
    """Pipeline latency the per-unit balance misses: a consumer cannot start before one
    micro-batch of each trainable producer chain has run forward (a frozen producer runs a
    step ahead, so its first outputs are waiting in steady state), and a trainable
    producer's last backward runs after its consumers' last gradients arrive."""
    ready: dict[str, float] = {}
    for n, u in units.items():  # topological order
        ready[n] = max(
            (ready[i] + (0.0 if units[i].frozen else combo[i].fwd_mb) for i in u.inputs),
            default=0.0,
        )
    fill = max(ready.values(), default=0.0)
    drain = max((combo[n].bwd_mb for n, u in units.items() if u.role == "producer"), default=0.0)
    return fill + drain


def _simulate(
    p: _Problem, specs, cm: CostModel, monolithic: bool, mbs=None, groups=None, units=None
):
    """``(steady-state step, busiest GPU's work, first step)`` of a layout.

    ``monolithic``: every spec on every rank, length-balanced shards (``units``: the
    ``(name, frozen)`` the balance costs, default the real sections). ``groups``: the
    colocated groups the specs merge (their samples are merged the same way)."""
    from maestro.plan.steady import steady_state
    from maestro.schedule import fifo_schedule, monolithic_schedule, wavefront_schedule

    def schedule(samples):
        if monolithic:
            world = specs[0].dp
            if p.opts.balance_monolithic:
                samples = _balanced_order(p, samples, world, cm, units)
            return samples, monolithic_schedule(
                samples, specs, cm, world_size=world, micro_batch_size=mbs
            )
        if p.opts.ablation.fifo:
            return samples, fifo_schedule(samples, specs, cm)
        return samples, wavefront_schedule(samples, specs, cm)

    batches = [p.samples, *p.batches]
    if groups is not None:
        batches = [merged_samples(b, groups) for b in batches]
    if len(batches) == 1:
        samples, sched = schedule(batches[0])
        res = steady_state(sched, samples, specs, cm, steps=p.opts.steps)
        return res.period, res.busy, res.first_step
    from maestro.sim.replay import replay_steps

    seq = [schedule(b)[::-1] for b in batches]
    rep = replay_steps(seq, specs, cm)
    ends = rep.step_ends
    return (ends[-1] - ends[0]) / (len(ends) - 1), rep.busy, ends[0]


def _balanced_order(
    p: _Problem, samples, world: int, cm: CostModel, units=None
) -> list[SampleInfo]:
    """Samples reordered so each of ``world`` contiguous equal-count shards carries about the
    same estimated work (longest first to the least-loaded rank with room): a length-balanced
    sampler, so the baseline's ranks do not wait on the one holding the longest sequences."""
    if units is None:
        units = [(n, p.sections[n].frozen) for n in p.order]
    n = len(samples)
    room = [((r + 1) * n) // world - (r * n) // world for r in range(world)]

    def cost(s: SampleInfo) -> float:
        f = micro_batch_features([s.cost])
        t = 0.0
        for name, frozen in units:
            if name in s.sections:
                t += cm.forward_time(name, f)
                if not frozen:
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
    """Choose every section's (dp, tp, mbs, recompute) and device sharing for ``gpus`` GPUs.

    Layouts searched: every section on its own devices; with ``options.colocate``, every
    valid grouping of sections onto shared devices (``maestro.plan.colocate``); with
    ``options.include_monolithic``, the monolithic layouts of ``plan_monolithic`` (so the
    result is never slower than the baseline's plan). Each grouping is ranked analytically
    and its best few simulated over consecutive steps (``maestro.plan.steady``).

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
        The simulated ``Plan`` with the fewest GPU-hours per sample (GPUs x steady-state step
        time), the faster on a tie. It may use fewer than ``gpus`` GPUs when more would not
        pay for themselves.

    Raises:
        ValueError: no layout fits the memory limit within ``gpus`` GPUs.
    """
    from maestro.plan.colocate import GroupedCostModel, merged_specs, valid_groupings

    opts = options or SearchOptions()
    p = _Problem(samples, sections, cost_model, gpus, opts)
    ab = opts.ablation
    alone = [(n,) for n in p.order]
    groupings = [alone] if gpus >= len(p.order) else []
    shared = opts.colocate and not ab.disaggregated
    if shared:
        groupings += [g for g in valid_groupings([p.sections[n] for n in p.order]) if g != alone]
    if not groupings and not (opts.include_monolithic and not ab.disaggregated):
        raise ValueError(f"need at least one GPU per section: {gpus} < {len(p.order)}")
    per = {n: _section_options(p, n) for n in p.order}
    shares = any(len(g) > 1 for groups in groupings for g in groups)
    member = {n: _section_options(p, n, standalone=False) for n in p.order} if shares else {}
    chosen: dict[tuple, tuple] = {}
    num_ranked = 0
    errors = []
    for groups in groupings:
        if len(groups) > gpus:
            continue
        units = _units(p, groups)
        opts_of = {}
        for name, u in units.items():
            if len(u.members) == 1:
                opts_of[name] = per[u.members[0]]
            else:
                opts_of[name] = _group_options(p, u, member)
        missing = [name for name, os_ in opts_of.items() if not os_]
        if missing:
            errors.append(missing[0])
            continue
        if ab.same_mbs or ab.same_tp:
            families = [_tied_combos(p, units, opts_of, ab)]
        else:
            # the cheapest options per unit, and every tied family, each with its own best few
            # simulated, so the full search contains each ablation's search
            kept = {
                n: sorted(os_, key=lambda o: o.work * o.tp)[: opts.keep_per_section]
                for n, os_ in opts_of.items()
            }
            families = [
                [dict(zip(units, c)) for c in itertools.product(*(kept[n] for n in units))],
                _tied_combos(p, units, opts_of, Ablation(same_mbs=True)),
                _tied_combos(p, units, opts_of, Ablation(same_tp=True)),
            ]
        for combos in families:
            ranked = []
            for combo in combos:
                alloc = _allocate(p, units, combo)
                if alloc is not None:
                    used = sum(alloc[0][u] * o.tp for u, o in combo.items())
                    cost = alloc[1] * (used if opts.objective == "gpu_hours" else 1)
                    ranked.append((alloc[1], combo, alloc[0], cost))
            num_ranked += len(ranked)
            ranked.sort(key=lambda r: r[3])  # estimated GPU-seconds per step
            for est, combo, dp, _ in ranked[: opts.simulate_top]:
                key = tuple(
                    (
                        n,
                        o.tp,
                        dp[n],
                        tuple((m, x.mbs, x.recompute) for m, x in _members(units[n], o).items()),
                    )
                    for n, o in combo.items()
                )
                chosen.setdefault(key, (groups, units, est, combo, dp))
    mono = None
    if opts.include_monolithic and not ab.disaggregated:
        try:
            mono = plan_monolithic(samples, sections, cost_model, gpus, opts)
        except ValueError:
            mono = None
    if not chosen and mono is None:
        if errors:
            raise ValueError(
                f"section {errors[0]!r}: no (tp, micro-batch, recompute) fits "
                f"{_gb(p.memory_limit)} per device within {gpus} GPUs"
            )
        raise ValueError(f"no layout of the sections fits within {gpus} GPUs")
    best = None
    for groups, units, est, combo, dp in chosen.values():
        mem = {n: (x, o.tp, u) for u, o in combo.items() for n, x in _members(units[u], o).items()}
        mbs = {n: x.mbs for n, (x, _, _) in mem.items()}
        mixed = 1 < len(units) < len(p.order)
        if mixed:  # group micro-batches of the smallest member size cap the others
            for u in units.values():
                cap = min(mbs[n] for n in u.members)
                mbs.update({n: min(mbs[n], cap) for n in u.members})
        cm = p.model(
            {n: t for n, (_, t, _) in mem.items()}, {n: x.recompute for n, (x, _, _) in mem.items()}
        )
        specs_real = [p.sections[n] for n in p.order]
        gdp = {units[u].members: d for u, d in dp.items()}
        specs = merged_specs(specs_real, groups, gdp, mbs, "min" if mixed else "max")
        merged = None
        if len(units) < len(p.order):
            cm = GroupedCostModel(cm, specs_real, groups, mbs)
            merged = groups
        if len(units) == 1 and len(p.order) > 1:
            # everything colocated: the monolithic layout with per-section micro-batches, on
            # the same length-balanced shards as the baseline
            (u,) = units.values()
            step, bound, first = _simulate(
                p, specs, cm, True, specs[0].micro_batch_size, merged, [(u.name, u.frozen)]
            )
        else:
            step, bound, first = _simulate(p, specs, cm, monolithic=False, groups=merged)
        used = sum(dp[u] * o.tp for u, o in combo.items())
        if best is None or _better(used, step, best, opts.objective):
            secs = {}
            for n in p.order:
                x, t, u = mem[n]
                g = u if len(units[u].members) > 1 else ""
                memory = combo[u].memory
                secs[n] = SectionPlan(dp[u], t, mbs[n], x.recompute, memory, g)
            best = Plan(
                sections=secs,
                monolithic=False,
                gpus=sum(dp[u] * o.tp for u, o in combo.items()),
                num_samples=len(p.samples),
                step_time=step,
                estimate=est,
                busy_bound=bound,
                first_step=first,
            )
    simulated = len(chosen)
    if mono is not None:
        num_ranked += mono.candidates
        simulated += mono.simulated
        if best is None or _better(mono.gpus, mono.step_time, best, opts.objective):
            best = mono
    best.candidates = num_ranked
    best.simulated = simulated
    return best


def _better(gpus: int, step: float, best: Plan, objective: str) -> bool:
    """Better than ``best`` by ``objective``: fewer GPU-seconds per step (GPU-hours per
    sample) or a faster step; on a tie (within 1e-9), the faster step, then fewer GPUs."""
    if objective == "step_time":
        if abs(step - best.step_time) > 1e-9 * best.step_time:
            return step < best.step_time
        return gpus < best.gpus
    cost, ref = gpus * step, best.gpus * best.step_time
    if abs(cost - ref) > 1e-9 * ref:
        return cost < ref
    return step < best.step_time


def _tied_combos(p: _Problem, units: dict[str, _Unit], opts_of: dict[str, list], ab: Ablation):
    """Combinations where the tied knob (mbs and/or tp) is equal across all sections."""

    def knobs(u, o):
        mem = _members(units[u], o)
        return {x.mbs for x in mem.values()}, o.tp

    keys = set()
    for u, os_ in opts_of.items():
        for o in os_:
            ms, t = knobs(u, o)
            if len(ms) == 1 or not ab.same_mbs:
                keys.add((next(iter(ms)) if ab.same_mbs else None, t if ab.same_tp else None))
    combos = []
    for m, t in keys:
        pick = {}
        for u, os_ in opts_of.items():
            match = [
                o for o in os_ if (m is None or knobs(u, o)[0] == {m}) and (t is None or o.tp == t)
            ]
            if not match:
                break
            pick[u] = sorted(match, key=lambda o: o.work * o.tp)[: p.opts.keep_per_section]
        else:
            combos.extend(dict(zip(units, c)) for c in itertools.product(*pick.values()))
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

    One (tp, mbs, recompute) for all sections; ``dp = gpus // tp`` replicas, and also as
    ``plan_maestro`` allocates (the fewest that fit, then more while the estimate improves)
    when that is fewer; the memory check
    sums every section's weights, optimizer state (ZeRO-1-sharded over the ``dp`` replicas
    when ``options.zero1``) and one micro-batch's activations. Candidates are ranked by the
    analytical estimate (whole-model work / dp plus every trainable section's all-reduce)
    and the best ``simulate_top`` are replayed with the colocated schedule, as in
    ``plan_maestro``.
    """
    opts = options or SearchOptions()
    p = _Problem(samples, sections, cost_model, gpus, opts)
    cands = []
    measured = getattr(cost_model, "max_samples", {})
    cap = min([len(p.samples)] + [max(1, int(measured[n])) for n in p.order if measured.get(n)])
    mbs_all = sorted({m for m in opts.mbs_choices if m <= cap}) or [1]
    budgets = [s.token_budget for s in p.sections.values() if s.token_budget is not None]
    budget = min(budgets) if budgets else None
    any_trainable = any(not s.frozen for s in p.sections.values())
    for tp, mbs, rc in itertools.product(p.tps, mbs_all, p.recomputes):
        if rc and not any_trainable:
            continue
        if gpus // tp < 1:
            continue
        tps = {n: tp for n in p.order}
        rcs = {n: rc and not p.sections[n].frozen for n in p.order}
        cm = p.model(tps, rcs)
        mem_full, shard, work, longest = 0.0, 0.0, 0.0, 0.0
        for n in p.order:
            sec = replace(p.sections[n], micro_batch_size=mbs, token_budget=budget)
            trainable = not sec.frozen
            if hasattr(cm, "memory_bytes") and p.costs[n]:
                mem_full += cm.memory_bytes(n, _worst_features(p.costs[n], sec, mbs), trainable)
                shard += _shard_bytes(p, n, tp)
            w, lg, _, _ = _data_order_work(cm, sec, p.costs[n], trainable)
            work += w
            longest += lg

        # replicas: every GPU of the budget, and as plan_maestro allocates (the fewest that
        # fit, ZeRO-1 shrinking the optimizer state with more, then more while the estimate
        # shortens; it stops early when the longest micro-batch bounds the estimate)
        top = gpus // tp
        dp = 1
        while (
            dp < top
            and p.memory_limit is not None
            and mem_full - shard * (1 - 1 / dp) > (p.memory_limit)
        ):
            dp += 1
        if p.memory_limit is not None and mem_full - shard * (1 - 1 / dp) > p.memory_limit:
            continue
        est = _mono_estimate(p, cm, tp, work, longest, dp)
        while dp < top and (nxt := _mono_estimate(p, cm, tp, work, longest, dp + 1)) < est:
            dp, est = dp + 1, nxt
        for d in sorted({dp, top}):
            mem = mem_full - shard * (1 - 1 / d)
            cands.append((_mono_estimate(p, cm, tp, work, longest, d), tp, mbs, rc, d, mem, cm))
    if not cands:
        raise ValueError(
            f"no monolithic layout fits {_gb(p.memory_limit)} per device within {gpus} GPUs"
        )
    if opts.objective == "gpu_hours":
        cands.sort(key=lambda c: c[0] * c[4] * c[1])  # estimated GPU-seconds per step
    else:
        cands.sort(key=lambda c: c[0])
    # as many simulations as plan_maestro's three families may use, plus the best-ranked
    # layout of every tp not among them (so no tp goes unsimulated)
    picked = cands[: 3 * opts.simulate_top]
    tps_in = {c[1] for c in picked}
    for c in cands:
        if c[1] not in tps_in:
            tps_in.add(c[1])
            picked.append(c)
    best = None
    for est, tp, mbs, rc, dp, mem, cm in picked:
        specs = [
            replace(p.sections[n], dp=dp, micro_batch_size=mbs, token_budget=budget)
            for n in p.order
        ]
        step, bound, first = _simulate(p, specs, cm, monolithic=True, mbs=mbs)
        if best is None or _better(dp * tp, step, best, opts.objective):
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
                first_step=first,
            )
    best.candidates = len(cands)
    best.simulated = len(picked)
    return best


def _mono_estimate(p: _Problem, cm, tp: int, work: float, longest: float, dp: int) -> float:
    same = dp * tp <= p.gpus_per_node
    return max(work / dp, longest) + sum(
        cm.allreduce_time(n, dp, same) for n in p.order if not p.sections[n].frozen
    )


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

    # the fastest plan at each budget (the GPU-hours objective may leave GPUs unused)
    fastest = replace(options or SearchOptions(), objective="step_time")

    def plan(n: int) -> Plan | None:
        try:
            return plan_maestro(samples, sections, cost_model, n, fastest)
        except ValueError:
            return None

    top = plan(max_gpus)
    if top is None or top.samples_per_s < target_samples_per_s:
        return None
    lo, hi, best = 0, top.gpus, top
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
