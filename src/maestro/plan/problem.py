"""The planner's working state: per-section options checked against memory, their analytical
work, GPU allocation to the bottleneck, and the simulation of the best candidates. Shared by
``plan.search`` (per-section plans) and ``plan.monolithic`` (the one-size-fits-all baseline).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from maestro.costmodel import (
    AnalyticalCostModel,
    CostModel,
    facts_of,
    micro_batch_features,
    splits_tp,
)
from maestro.plan.colocate import group_name, merged_samples
from maestro.plan.options import CP_MIN_TOKENS, Plan, SearchOptions
from maestro.plan.tpmodel import LayoutCostModel, SectionStrategy, with_layout
from maestro.schedule.graph import check_sections, grad_consumers, role, topo_order
from maestro.schedule.types import SampleInfo, SectionSpec


@dataclass
class _Option:
    tp: int
    mbs: int
    recompute: bool
    work: float  # seconds of the section's whole step on one replica (fwd, + bwd if trainable)
    longest: float  # seconds of its slowest micro-batch
    fwd_mb: float  # mean forward seconds per micro-batch (pipeline fill of its consumers)
    bwd_mb: float  # mean backward seconds per micro-batch (drain of a trainable producer)
    min_dp: int  # replica groups (of ``fsdp`` data-parallel coordinates, ``tp`` ranks each)
    memory: float
    mem_one: float = 0.0  # memory with one micro-batch in flight (no batch held)
    fsdp: int = 1
    zero: int = 0
    pp: int = 1  # pipeline stages per replica (work, longest: stage times)
    bubble: float = 0.0  # 1F1B fill and drain per step (``(pp - 1)`` stage micro-batches)
    cp: int = 1  # context-parallel ranks sharing each sequence

    @property
    def width(self) -> int:
        """Ranks one more replica group takes: ``fsdp * pp * cp * tp``."""
        return self.fsdp * self.pp * self.cp * self.tp

    def strategy(self) -> SectionStrategy:
        return SectionStrategy(
            tp=self.tp,
            fsdp=self.fsdp,
            zero=self.zero,
            recompute=self.recompute,
            pp=self.pp,
            pp_shared=self.pp > 1,
            cp=self.cp,
        )


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
    from maestro.schedule.monolithic import cut_micro_batches

    total, longest, fwd, bwd = 0.0, 0.0, 0.0, 0.0
    mbs = cut_micro_batches(
        costs, sec.micro_batch_size, sec.token_budget, lambda c: c.get("tokens", 0.0)
    )
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
        if opts.ablation.no_token_budget:
            sections = [replace(s, token_budget=None) for s in sections]
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
        for name, vals in (("fsdp_choices", opts.fsdp_choices), ("tp_choices", opts.tp_choices)):
            if not vals or min(vals) < 1:
                raise ValueError(f"{name} must be degrees >= 1, got {list(vals)}")
        if not opts.zero_choices or set(opts.zero_choices) - {0, 1}:
            raise ValueError(f"zero_choices must be 0 and/or 1, got {list(opts.zero_choices)}")
        self.zeros = sorted(set(opts.zero_choices)) if opts.zero1 else [0]
        if opts.memory_limit is not None:
            self.memory_limit = opts.memory_limit
        elif self.analytical:
            self.memory_limit = opts.memory_fraction * cost_model.gpu.memory
        else:
            self.memory_limit = None
        gcons = grad_consumers(sections)
        self.roles = {n: role(self.sections[n], gcons) for n in self.order}
        self.costs = {n: [s.cost for s in self.samples if n in s.sections] for n in self.order}
        # the batch's identity per section: each (layout, micro-batch cut) is priced once per
        # cost model, shared by every search that plans this batch on it (Maestro's and the
        # baselines', ``data_order_work``)
        self._costs_key = {
            n: hash(tuple(tuple(sorted(c.items())) for c in cs)) for n, cs in self.costs.items()
        }
        # every batch the simulations replay, whole (ids, activation sets, costs)
        self._batches_key = hash(
            tuple(
                tuple((s.sample_id, s.sections, tuple(sorted(s.cost.items()))) for s in b)
                for b in (self.samples, *self.batches)
            )
        )
        memo = getattr(cost_model, "_plan_memo", None)
        if memo is None:
            memo = {}
            try:
                cost_model._plan_memo = memo
            except AttributeError:  # a model that takes no attributes: per problem
                pass
        self._memo = memo
        self._models: dict[tuple, CostModel] = {}

    def worst_features(self, n: str, sec: SectionSpec, mbs: int) -> dict[str, float]:
        """``_worst_features`` of section ``n``'s samples, memoised like ``data_order_work``."""
        key = ("worst", n, mbs, sec.token_budget, self._costs_key[n])
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = _worst_features(self.costs[n], sec, mbs)
        return got

    def simulated(self, key: tuple, run, *args, **kwargs):
        """``run(*args, **kwargs)`` (a layout's simulation) memoised by the layout ``key``
        and everything of this problem the simulation reads (the batches, steps, ablation,
        sampler): the sub-searches of ``plan_maestro`` share their simulations."""
        full = (
            "sim",
            key,
            self._batches_key,
            self.opts.steps,
            self.opts.ablation,
            self.opts.monolithic_order,
        )
        got = self._memo.get(full)
        if got is None:
            got = self._memo[full] = run(*args, **kwargs)
        return got

    def data_order_work(self, cm: CostModel, sec: SectionSpec, trainable: bool):
        """``_data_order_work`` of section ``sec`` on layout ``cm`` over this batch, memoised
        by (section, its strategy, micro-batch size, token budget, the batch)."""
        strat = cm.strategy(sec.name) if isinstance(cm, LayoutCostModel) else None
        pp = strat.pp if strat is not None else 1
        if pp > 1:  # a stage's work is exactly 1/pp of the unstaged replica's (forward_time)
            flat = replace(strat, pp=1, pp_shared=False, zero=0)
            cm = LayoutCostModel(cm.base, {**cm.strategies, sec.name: flat}, cm.overlap)
            strat = flat
        elif strat is not None:
            strat = replace(strat, zero=0)  # ZeRO-1 changes memory and the tail, not the work
        key = (
            sec.name,
            strat,
            sec.micro_batch_size,
            sec.token_budget,
            trainable,
            self._costs_key[sec.name],
        )
        got = self._memo.get(key)
        if got is None:
            if len(self._memo) > 1 << 16:
                self._memo.clear()
            got = self._memo[key] = _data_order_work(cm, sec, self.costs[sec.name], trainable)
        return tuple(x / pp for x in got) if pp > 1 else got

    def model(
        self, tp: dict[str, int], rc: dict[str, bool], strategies: dict | None = None
    ) -> CostModel:
        """The layout's cost model (``plan.tpmodel.with_layout``): the same one the
        simulator replays the layout on. A measured model with ``facts`` is wrapped even for
        plain replicas, so that its state bytes meet the memory limit too. One model per
        layout for the problem's life (the allocation prices each many times)."""
        key = (
            "model",
            tuple(sorted(tp.items())),
            tuple(sorted(rc.items())),
            tuple(sorted((strategies or {}).items())),
        )
        got = self._models.get(key)
        if got is None:
            got = with_layout(self.cm, tp, rc, strategies=strategies)
            if got is self.cm and not self.analytical and getattr(self.cm, "facts", None):
                got = LayoutCostModel(self.cm, strategies)
            self._models[key] = got
        return got

    def choices(self, n: str) -> list[tuple[int, int, int, bool]]:
        """``(tp, fsdp, zero, recompute)`` strategies the runtime can run for section ``n``.

        A measured model prices tp, fsdp and recompute only with the section's structure
        (``MeasuredCostModel.facts``); a tp degree must divide the section's heads and fit
        a node; a section the runtime cannot split (``splits_tp``: its module has no
        transformer block with a tensor-parallel plan) gets ``tp = 1`` only, and
        ``ValueError`` naming it when ``tp_choices`` leave out 1; a replica group
        (``fsdp * tp`` ranks) must fit the budget; ZeRO-1 needs a trainable section without
        FSDP.
        """
        trainable = not self.sections[n].frozen
        facts = facts_of(self.cm, n)
        if self.analytical:
            tps, rcs = self.tps, self.recomputes
            if not splits_tp(self.cm, n):
                if 1 not in tps:
                    raise ValueError(
                        f"section {n!r}: its module has no transformer block to split, so it "
                        f"runs at tp = 1 only, but tp_choices are {list(self.opts.tp_choices)}"
                    )
                tps = [1]
        elif facts is not None:
            gpn = self.gpus_per_node
            tps = sorted(
                {1}
                | {
                    t
                    for t in self.opts.tp_choices
                    if t <= gpn and facts.tp_plan and (not facts.heads or facts.heads % t == 0)
                }
            )
            rcs = sorted(set(self.opts.recompute_choices))
        else:
            tps, rcs = [1], [False]
        fsdps = sorted(set(self.opts.fsdp_choices)) if (self.analytical or facts) else [1]
        out = []
        for tp, f, z, rc in itertools.product(tps, fsdps, self.zeros, rcs):
            if tp * f > self.gpus or (rc and not trainable) or (z and (f > 1 or not trainable)):
                continue
            out.append((tp, f, z, rc))
        return out

    def pp_choices(self, n: str) -> list[int]:
        """Pipeline stages Maestro's runtime can give section ``n`` (``SearchOptions.
        pp_choices``): analytical models only, at most its number of blocks."""
        if not self.analytical:
            return [1]
        layers = self.cm.shapes[n].layers
        return sorted({1} | {k for k in self.opts.pp_choices if 1 < k <= layers})

    def cp_choices(self, n: str) -> list[int]:
        """Context-parallel degrees Maestro's runtime can give section ``n``
        (``SearchOptions.cp_choices``): analytical models, a sequence section (``tokens``)
        whose longest sample has at least ``2 * cp`` tokens and reaches ``CP_MIN_TOKENS``."""
        if not self.analytical or self.cm.shapes[n].unit != "tokens":
            return [1]
        longest = max((c.get("tokens", 0.0) for c in self.costs[n]), default=0.0)
        if longest < CP_MIN_TOKENS:
            return [1]
        return sorted({1} | {k for k in self.opts.cp_choices if 2 * k <= longest})

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
    works: dict[tuple, tuple] = {}  # zero changes memory and the tail, not the micro-batches
    # pipeline stages: the runtime's pp (not inside a colocated group, not with ZeRO-1)
    pps = p.pp_choices(n) if standalone else [1]
    cps = p.cp_choices(n) if standalone else [1]
    grid = itertools.product(p.choices(n), p.mbs_choices(n), pps, cps)
    for (tp, f, z, rc), mbs, pp, cp in grid:
        if pp > 1 and z:
            continue
        strat = SectionStrategy(tp=tp, fsdp=f, zero=z, recompute=rc, pp=pp, pp_shared=pp > 1, cp=cp)
        cm = p.model({}, {}, {n: strat})
        spec = replace(sec, micro_batch_size=mbs)
        min_dp, mem, mem_one = 1, 0.0, 0.0
        if hasattr(cm, "memory_bytes") and costs:
            worst = p.worst_features(n, sec, mbs)
            mem_one = cm.memory_bytes(n, worst, trainable)
            held = 0.0
            if standalone and p.roles[n] == "producer":
                # all forwards before backwards: a replica holds its share of the batch
                total = micro_batch_features(costs)
                fixed = cm.memory_bytes(n, {"samples": 1.0}, trainable)
                # (a pipeline stage holds its 1/pp of the blocks' activations)
                held = (cm.memory_bytes(n, total, trainable) - fixed) / (f * pp)
            got = _fit(p, mem_one, _shard_bytes(p, n, tp, z), held, tp * f * pp * cp)
            if got is None:
                continue
            min_dp, mem = got
        if min_dp * tp * f * pp * cp > p.gpus:
            continue
        key = (tp, f, rc, mbs, pp, cp)
        if key not in works:
            works[key] = p.data_order_work(cm, spec, trainable)
        work, longest, fwd_mb, bwd_mb = works[key]
        # stage times: a replica's throughput; its consumers wait for all pp stages (the
        # fill and drain of the layout use whole-replica latencies) and 1F1B adds (pp - 1)
        # stage micro-batches per step (the layout model's ``pipeline_bubble``)
        bubble = (pp - 1) * (fwd_mb + bwd_mb)
        out.append(
            _Option(
                tp, mbs, rc, work, longest, fwd_mb * pp, bwd_mb * pp, min_dp, mem, mem_one, f, z,
                pp, bubble, cp,
            )
        )  # fmt: skip
    # micro-batch sizes beyond the token budget change nothing: keep the smallest of equals
    # (and of equal options, the plainer: no ZeRO where it buys nothing)
    seen, kept = set(), []
    for o in sorted(out, key=lambda o: o.zero):
        key = (o.tp, o.fsdp, o.pp, o.cp, o.recompute, round(o.work, 9), o.min_dp)
        if key not in seen:
            seen.add(key)
            kept.append(o)
    return kept


def _shard_bytes(p: _Problem, n: str, tp: int, zero: int | None = None) -> float:
    """Bytes per GPU of section ``n``'s optimizer state that ZeRO-1 shards over its DP group:
    fp32 master weights and Adam moments, 12 of the 18 bytes per parameter (Megatron-LM's
    distributed optimizer: ``6 + 12 / dp`` bytes per parameter instead of 18).

    ``zero``: the section's choice (default: 1 when the search allows ZeRO-1 at all)."""
    if zero is None:
        zero = max(p.zeros)
    if not zero or p.sections[n].frozen or not p.analytical:
        return 0.0
    return 12.0 * p.cm.shapes[n].params / tp


def _fit(p: _Problem, mem_one: float, shard: float, held: float, width: int):
    """``(min_dp, bytes per GPU at min_dp)`` for a replica whose ``mem_one`` (one micro-batch
    in flight, full optimizer state) loses ``shard * (1 - 1/dp)`` to ZeRO-1 and gains
    ``held / dp`` of held activations; None if no ``dp`` (replica groups of ``width``
    ranks) within the budget fits."""
    fixed = mem_one - shard
    divisible = shard + held
    if p.memory_limit is None:
        return 1, fixed + divisible
    room = p.memory_limit - fixed
    if room <= 0:
        return None
    min_dp = max(1, -int(-divisible // room))
    if min_dp * width > p.gpus:
        return None
    return min_dp, fixed + divisible / min_dp


@dataclass
class _GroupOption:
    """A colocated group's option: one (tp, fsdp) grid, each member's own (mbs, recompute)
    option."""

    tp: int
    members: dict[str, _Option]
    work: float
    longest: float
    fwd_mb: float
    bwd_mb: float
    min_dp: int
    memory: float
    fsdp: int = 1

    @property
    def width(self) -> int:
        """Ranks one more replica group takes: ``fsdp * tp``."""
        return self.fsdp * self.tp


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
    """Options of a colocated group: per tp, the best few member options combined (a grid
    with ``tp > 1`` needs every member to have options there, so a member the runtime
    cannot split keeps its group at ``tp = 1``).

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
    grids = sorted({(o.tp, o.fsdp) for n in u.members for o in member_opts[n]})
    for tp, f in grids:
        choices = []
        for n in u.members:
            # a group's members share its (tp, fsdp) grid here (the runtime also runs members
            # on grids of their own); without FSDP the group keeps the global ZeRO-1 choice
            # in its memory (_shard_bytes below): one option per (mbs, recompute)
            os_, seen = [], set()
            for o in member_opts[n]:
                if o.tp == tp and o.fsdp == f and (o.mbs, o.recompute) not in seen:
                    seen.add((o.mbs, o.recompute))
                    os_.append(o)
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
                    whole = cm.memory_bytes(n, p.worst_features(n, spec, group_mbs), True)
                    mem += max(0.0, whole - opts[n].mem_one)
            held = 0.0
            if u.role == "producer" and hasattr(cm, "memory_bytes"):
                for n in u.members:
                    if p.sections[n].frozen or not p.costs[n]:
                        continue
                    total = micro_batch_features(p.costs[n])
                    fixed = cm.memory_bytes(n, {"samples": 1.0}, True)
                    held += (cm.memory_bytes(n, total, True) - fixed) / f
            shard = sum(_shard_bytes(p, n, tp) for n in u.members) if f == 1 else 0.0
            got = _fit(p, mem, shard, held, tp * f)
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
                    f,
                )
            )
    return out


def _members(u: _Unit, o) -> dict[str, _Option]:
    return o.members if isinstance(o, _GroupOption) else {u.members[0]: o}


def _estimate(p: _Problem, u: _Unit, o, dp: int) -> float:
    """A unit's step estimate at ``dp`` replica groups: its work over its ``dp * fsdp``
    data-parallel coordinates (at least its longest micro-batch) plus its tail."""
    mem = _members(u, o)
    if isinstance(o, _GroupOption):
        cm = p.model({n: o.tp for n in mem}, {n: m.recompute for n, m in mem.items()})
    else:
        cm = p.model({}, {}, {u.members[0]: o.strategy()})
    coords = dp * o.fsdp
    t = max(o.work / coords, o.longest) if any(p.costs[n] for n in mem) else 0.0
    t += getattr(o, "bubble", 0.0)
    same = dp * o.width <= p.gpus_per_node
    t += sum(cm.allreduce_time(n, coords, same) for n in mem if not p.sections[n].frozen)
    return t


def _allocate(p: _Problem, units: dict[str, _Unit], combo: dict) -> tuple[dict, float] | None:
    """Deal GPUs to the bottleneck unit; ``(dp per unit, estimated step)`` or None.

    Under the ``gpu_hours`` objective the budget is a cap, not a target: of every point the
    dealing passes (each a plan within a smaller budget), the one with the fewest estimated
    GPU-seconds per step is returned, so a larger budget only adds points and never yields
    a worse allocation. ``step_time``: the last point (the fastest)."""
    dp = {n: o.min_dp for n, o in combo.items()}
    left = p.gpus - sum(dp[n] * o.width for n, o in combo.items())
    if left < 0:
        return None
    heap = [(-_estimate(p, units[n], o, dp[n]), n) for n, o in combo.items()]
    heapq.heapify(heap)
    tail = _fill_drain(units, combo)
    hours = p.opts.objective == "gpu_hours"

    def point():
        step = max(-t for t, _ in heap) + tail
        return step * (p.gpus - left) if hours else step, dict(dp), step

    best = point()
    while heap:
        neg, n = heap[0]
        o = combo[n]
        if o.width > left:
            break  # the bottleneck cannot grow; others growing would not shorten the step
        new = _estimate(p, units[n], o, dp[n] + 1)
        if new >= -neg:
            break
        dp[n] += 1
        left -= o.width
        heapq.heapreplace(heap, (-new, n))
        got = point()
        if got[0] < best[0] * (1 - 1e-12) or not hours:
            best = got
    return best[1], best[2]


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
    p: _Problem,
    specs,
    cm: CostModel,
    monolithic: bool,
    mbs=None,
    groups=None,
    units=None,
    pipelines=(),
):
    """``(steady-state step, busiest GPU's work, first step)`` of a layout.

    ``monolithic``: every spec on every rank, shards in the order of
    ``p.opts.monolithic_order``'s sampler (``_balanced_order``; ``units``: the
    ``(name, frozen)`` the cost balance prices, default the real sections). ``groups``: the
    colocated groups the specs merge (their samples are merged the same way).
    ``pipelines``: ``(sections, pp)`` of the layout's pipelines (``plan.pipelines``): their
    real stages' 1F1B, replayed on the planned batch's schedule, is added to every figure."""
    from maestro.plan.steady import steady_state
    from maestro.schedule import fifo_schedule, monolithic_schedule, wavefront_schedule

    def schedule(samples):
        if monolithic:
            world = specs[0].dp
            budgets = [x.token_budget for x in specs if x.token_budget is not None]
            cut = mbs or min(x.micro_batch_size for x in specs)
            samples = _balanced_order(
                p, samples, world, cm, units, cut=(cut, min(budgets) if budgets else None)
            )
            return samples, monolithic_schedule(
                samples, specs, cm, world_size=world, micro_batch_size=mbs
            )
        if p.opts.ablation.fifo:
            return samples, fifo_schedule(samples, specs, cm)
        # (an analytical model prices packed sequences, where no padding is saved by the
        # length-grouped candidates; a measured one prices the runtime's padding)
        return samples, wavefront_schedule(samples, specs, cm, group_by_length=not p.analytical)

    batches = [p.samples, *p.batches]
    if groups is not None:
        batches = [merged_samples(b, groups) for b in batches]

    def excess(samples, sched) -> float:
        pipes = [(m, k) for m, k in pipelines if k > 1]
        if not pipes:
            return 0.0
        from maestro.plan.pipelines import pipeline_excess

        lay = cm
        while not isinstance(lay, LayoutCostModel):  # a colocated layout's wrapper
            lay = lay.base
        plain = {n: replace(s, pp=1) for n, s in lay.strategies.items()}
        flat = LayoutCostModel(lay.base, plain, lay.overlap)
        trainable = {n: not p.sections[n].frozen for n in p.sections}
        return pipeline_excess(sched, samples, flat, pipes, trainable, monolithic)

    if len(batches) == 1:
        samples, sched = schedule(batches[0])
        res = steady_state(sched, samples, specs, cm, steps=p.opts.steps)
        x = excess(samples, sched)
        return res.period + x, res.busy + x, res.first_step + x
    from maestro.sim.replay import replay_steps

    seq = [schedule(b)[::-1] for b in batches]
    rep = replay_steps(seq, specs, cm)
    ends = rep.step_ends
    x = excess(*seq[0][::-1])
    return (ends[-1] - ends[0]) / (len(ends) - 1) + x, rep.busy + x, ends[0] + x


def _balanced_order(
    p: _Problem,
    samples,
    world: int,
    cm: CostModel,
    units=None,
    order: str | None = None,
    cut: tuple[int, float | None] | None = None,
) -> list[SampleInfo]:
    """``samples`` in the monolithic sampler's order for ``world`` shards
    (``schedule.monolithic.sampler_order``): ``order``, default ``p.opts.monolithic_order``;
    ``cost`` balances ``balanced_order``'s work over the problem's sections (or ``units``)
    and, given the micro-batch ``cut`` ``(size, token budget)``, prices what each rank runs;
    ``tokens`` and ``data`` do not consult ``cm``."""
    from maestro.schedule.monolithic import sampler_order

    if units is None:
        units = [(n, p.sections[n].frozen) for n in p.order]
    mbs, budget = cut if cut is not None else (None, None)
    return sampler_order(order or p.opts.monolithic_order, samples, world, cm, units, mbs, budget)


def budget_caps(gpus: int) -> list[int]:
    """``gpus`` and every power of two below it, largest first: the budgets a GPU-hours
    search tries (so a plan for 1,024 GPUs contains the plans for 512, 256, ...)."""
    caps, c = {gpus}, 1
    while c < gpus:
        caps.add(c)
        c *= 2
    return sorted(caps, reverse=True)


def best_of_caps(search, gpus: int, variants: list[SearchOptions]) -> Plan:
    """The best plan of ``search(cap, options)`` over every ``variants`` entry and every cap
    of ``budget_caps(gpus)`` (just ``gpus`` under the ``step_time`` objective), by the
    objective; candidate and simulation counts summed. ``ValueError``: the first variant's
    full-budget error when no search finds a plan."""
    objective = variants[0].objective
    caps = budget_caps(gpus) if objective == "gpu_hours" else [gpus]
    best, error, ranked, simulated = None, None, 0, 0
    for opts in variants:
        for cap in caps:
            try:
                got = search(cap, opts)
            except ValueError as e:
                if cap == gpus and error is None:
                    error = e
                continue
            ranked += got.candidates
            simulated += got.simulated
            if best is None or _better(got.gpus, got.step_time, best, objective):
                best = got
    if best is None:
        raise error if error is not None else ValueError(f"nothing fits within {gpus} GPUs")
    best.candidates, best.simulated = ranked, simulated
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


def _gb(x: float | None) -> str:
    return "no limit" if x is None else f"{x / 1e9:.1f} GB"
