"""Planner search: each section's (dp, fsdp, tp, zero, micro-batch size, recompute).

These are exactly the strategies ``maestro.runtime`` runs per section (``SectionConfig``:
``dp`` replica groups of ``fsdp`` data-parallel ranks of ``tp`` ranks each). Every option is
priced by the layout cost model (``plan.tpmodel``) the simulator replays it on.
The search is cheap enough to run at thousands of GPUs because it narrows in three stages:

1. **Memory first.** Every (tp, fsdp, zero, mbs, recompute) option of a section is checked
   (tp > 1 only for a section the runtime can split: ``maestro.costmodel.splits_tp``)
   against the per-device memory limit on its worst micro-batch (the ``mbs`` longest
   samples, within the section's token budget); a trainable section that feeds another
   trainable one runs all its forwards before its backwards and so holds its whole share of
   the batch, which sets a minimum ``dp``.
2. **Analytical ranking.** An option's work is its micro-batches' compute in data order; each
   section keeps its few options with the least GPU-seconds. For every combination, GPUs are
   dealt to the current bottleneck section (``fsdp * tp`` GPUs per extra replica group)
   until the budget
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

import itertools
from collections.abc import Sequence
from dataclasses import replace

from maestro.costmodel import AnalyticalCostModel, CostModel
from maestro.plan.monolithic import plan_monolithic
from maestro.plan.options import Ablation, Plan, SearchOptions, SectionPlan
from maestro.plan.problem import (
    _allocate,
    _better,
    _gb,
    _group_options,
    _members,
    _Problem,
    _section_options,
    _simulate,
    _Unit,
    _units,
    best_of_caps,
)
from maestro.schedule.types import SampleInfo, SectionSpec


def plan_maestro(
    samples: Sequence[SampleInfo],
    sections: Sequence[SectionSpec],
    cost_model: CostModel,
    gpus: int,
    options: SearchOptions | None = None,
) -> Plan:
    """Choose every section's (dp, fsdp, tp, pp, zero, mbs, recompute) for ``gpus`` GPUs.

    The search nests by construction: under the ``gpu_hours`` objective it is the best of
    sub-searches (``_plan_once``) capped at ``gpus`` and at every power of two below it (the
    budget is a cap, not a target), each without pipeline stages and, when
    ``options.pp_choices`` has some, with them. A larger budget or more options only add
    sub-searches, so they never give a worse plan; the sub-searches share every priced
    micro-batch and every simulated layout, so the extra ones cost little. ``step_time``:
    one search at ``gpus``. Arguments, result and errors as ``_plan_once``.
    """
    opts = options or SearchOptions()
    subsets = [opts]
    # (pipeline stages are priced on analytical models only: nothing to nest otherwise)
    if any(k > 1 for k in opts.pp_choices) and isinstance(cost_model, AnalyticalCostModel):
        subsets = [replace(opts, pp_choices=(1,)), opts]
    return best_of_caps(
        lambda cap, o: _plan_once(samples, sections, cost_model, cap, o), gpus, subsets
    )


def _plan_once(
    samples: Sequence[SampleInfo],
    sections: Sequence[SectionSpec],
    cost_model: CostModel,
    gpus: int,
    options: SearchOptions | None = None,
) -> Plan:
    """Choose every section's (dp, fsdp, tp, zero, mbs, recompute) for ``gpus`` GPUs.

    Layouts searched: every section on its own devices; with ``options.colocate``, every
    valid grouping of sections onto shared devices (``maestro.plan.colocate``); with
    ``options.include_monolithic``, the monolithic layouts of ``plan_monolithic`` (so the
    result is never slower than the baseline's plan). Each grouping is ranked analytically
    and its best few simulated over consecutive steps (``maestro.plan.steady``).

    Args:
        samples: one global batch (the workload mix); it stays the same for every layout.
        sections: the section graph (``inputs``, ``frozen``, ``token_budget``); their ``dp``
            and ``micro_batch_size`` are ignored.
        cost_model: an ``AnalyticalCostModel`` (every strategy is modelled) or a measured
            model (tp, fsdp and recompute only for sections it has ``facts`` for; no memory
            limit unless ``options.memory_limit`` is set).
        gpus: the GPU budget; a plan uses at most this many.
        options: search settings and ablations.

    Returns:
        The simulated ``Plan`` with the fewest GPU-hours per sample (GPUs x steady-state step
        time), the faster on a tie. It may use fewer than ``gpus`` GPUs when more would not
        pay for themselves.

    Raises:
        ValueError: no layout fits the memory limit within ``gpus`` GPUs, or a section the
            runtime cannot split tensor-parallel is left no ``tp = 1`` by
            ``options.tp_choices``.
    """
    from maestro.plan.colocate import GroupedCostModel, merged_specs, valid_groupings

    opts = options or SearchOptions()
    p = _Problem(samples, sections, cost_model, gpus, opts)
    ab = opts.ablation
    alone = [(n,) for n in p.order]
    groupings = [alone] if gpus >= len(p.order) and opts.colocate != "only" else []
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
            kept = {n: _kept(os_, opts.keep_per_section) for n, os_ in opts_of.items()}
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
                    used = sum(alloc[0][u] * o.width for u, o in combo.items())
                    cost = alloc[1] * (used if opts.objective == "gpu_hours" else 1)
                    ranked.append((alloc[1], combo, alloc[0], cost))
            num_ranked += len(ranked)
            ranked.sort(key=lambda r: r[3])  # estimated GPU-seconds per step
            for est, combo, dp, _ in ranked[: opts.simulate_top]:
                key = tuple(
                    (
                        n,
                        o.tp,
                        o.fsdp,
                        getattr(o, "pp", 1),
                        getattr(o, "cp", 1),
                        getattr(o, "zero", 0),
                        dp[n],
                        tuple((m, x.mbs, x.recompute) for m, x in _members(units[n], o).items()),
                    )
                    for n, o in combo.items()
                )
                chosen.setdefault(key, (groups, units, est, combo, dp))
    mono = None
    if opts.include_monolithic and not ab.disaggregated:
        # Maestro's whole-model candidates run under its balancer, token-count balance and
        # data order (maestro train runs all three; any can win on a batch)
        for order in dict.fromkeys([opts.monolithic_order, "tokens", "data"]):
            try:
                got = plan_monolithic(
                    samples, sections, cost_model, gpus, replace(opts, monolithic_order=order)
                )
            except ValueError:
                continue
            if mono is None or _better(got.gpus, got.step_time, mono, opts.objective):
                mono = got
    if not chosen and mono is None:
        if errors:
            raise ValueError(
                f"section {errors[0]!r}: no (tp, fsdp, zero, micro-batch, recompute) fits "
                f"{_gb(p.memory_limit)} per device within {gpus} GPUs"
            )
        raise ValueError(f"no layout of the sections fits within {gpus} GPUs")
    best = None
    for key, (groups, units, est, combo, dp) in chosen.items():
        mem = {n: (x, o.tp, u) for u, o in combo.items() for n, x in _members(units[u], o).items()}
        mbs = {n: x.mbs for n, (x, _, _) in mem.items()}
        mixed = 1 < len(units) < len(p.order)
        if mixed:  # group micro-batches of the smallest member size cap the others
            for u in units.values():
                cap = min(mbs[n] for n in u.members)
                mbs.update({n: min(mbs[n], cap) for n in u.members})
        cm = p.model({}, {}, {n: x.strategy() for n, (x, _, _) in mem.items()})
        specs_real = [p.sections[n] for n in p.order]
        # the scheduler's replicas are the data-parallel coordinates, dp * fsdp
        gdp = {units[u].members: d * combo[u].fsdp for u, d in dp.items()}
        specs = merged_specs(specs_real, groups, gdp, mbs, "min" if mixed else "max")
        tp_of = {u: combo[u].tp for u in units if len(units[u].members) == 1}
        specs = [replace(s, tp=tp_of.get(s.name, 1)) for s in specs]
        merged = None
        if len(units) < len(p.order):
            cm = GroupedCostModel(cm, specs_real, groups, mbs)
            merged = groups
        if len(units) == 1 and len(p.order) > 1:
            # everything colocated: the monolithic layout with per-section micro-batches, on
            # the same length-balanced shards as the baseline
            (u,) = units.values()
            step, bound, first = p.simulated(
                key,
                _simulate,
                p,
                specs,
                cm,
                True,
                specs[0].micro_batch_size,
                merged,
                [(u.name, u.frozen)],
            )
        else:
            # the simulator replays a pipelined section's replica at its stages' ideal
            # throughput; its real stages' 1F1B is replayed on the same schedule on top
            pipes = [((u,), getattr(o, "pp", 1)) for u, o in combo.items()]
            step, bound, first = p.simulated(
                key, _simulate, p, specs, cm, monolithic=False, groups=merged, pipelines=pipes
            )
        used = sum(dp[u] * o.width for u, o in combo.items())
        if best is None or _better(used, step, best, opts.objective):
            secs = {}
            for n in p.order:
                x, t, u = mem[n]
                g = u if len(units[u].members) > 1 else ""
                memory = combo[u].memory
                secs[n] = SectionPlan(
                    dp[u], t, mbs[n], x.recompute, memory, g, x.fsdp, x.zero, x.pp, x.cp
                )
            best = Plan(
                sections=secs,
                monolithic=False,
                gpus=used,
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


def _kept(options: list, k: int) -> list:
    """A unit's ``k`` options with the fewest GPU-seconds of compute, plus the best of each
    FSDP degree, of each pipeline depth and of each CP degree: FSDP's gain is in the step's
    tail (no gradient all-reduce after the last backward) and a pipeline's or a CP group's
    in memory and in a shorter longest micro-batch, which the compute ranking does not see,
    so the allocation weighs them. (Nesting does not rest on this: ``plan_maestro`` runs the
    search without pipeline stages too.)"""
    by_cost = sorted(options, key=lambda o: o.work * o.tp * getattr(o, "cp", 1))
    out = by_cost[:k]
    for attr in ("fsdp", "pp", "cp"):
        for v in sorted({getattr(o, attr, 1) for o in options}):
            best = next(o for o in by_cost if getattr(o, attr, 1) == v)
            if best not in out:
                out.append(best)
    return out


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
        # one search with every option at each probed budget (the bisection needs a plan
        # per budget, not plan_maestro's nesting over smaller ones)
        try:
            return _plan_once(samples, sections, cost_model, n, fastest)
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
