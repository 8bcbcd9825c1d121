"""The one-size-fits-all baseline plan: one (tp, mbs, recompute) for the whole model, given
the same search effort as the per-section plan."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

from maestro.costmodel import CostModel
from maestro.plan.options import CP_MIN_TOKENS, Plan, SearchOptions, SectionPlan
from maestro.plan.problem import (
    _better,
    _gb,
    _Problem,
    _shard_bytes,
    _simulate,
    best_of_caps,
)
from maestro.plan.tpmodel import SectionStrategy
from maestro.schedule.types import SampleInfo, SectionSpec


def plan_monolithic(
    samples: Sequence[SampleInfo],
    sections: Sequence[SectionSpec],
    cost_model: CostModel,
    gpus: int,
    options: SearchOptions | None = None,
    *,
    baseline: bool = False,
) -> Plan:
    """The best one-size-fits-all layout: every replica holds the whole model.

    Under the ``gpu_hours`` objective, the best of ``_monolithic_once`` capped at ``gpus``
    and at every power of two below it, as ``plan_maestro`` searches (the budget is a cap
    for both sides, and a larger one never gives a worse plan); a baseline's search runs
    without and with its whole-model pipelines and CP, so they never make it worse.
    Arguments, result and errors as ``_monolithic_once``.
    """
    opts = options or SearchOptions()
    variants = [opts]
    pps, cps = set(opts.baseline_pp_choices), set(opts.baseline_cp_choices)
    if baseline and 1 in pps and 1 in cps and (pps | cps) - {1}:
        # the baselines' search nests too: without whole-model pp and cp, then with them
        # (more options must not crowd a better plan out of the few simulated; a layout
        # priced as given, without 1 among its degrees, is left as it is)
        variants = [replace(opts, baseline_pp_choices=(1,), baseline_cp_choices=(1,)), opts]
    return best_of_caps(
        lambda cap, o: _monolithic_once(samples, sections, cost_model, cap, o, baseline=baseline),
        gpus,
        variants,
    )


def _monolithic_once(
    samples: Sequence[SampleInfo],
    sections: Sequence[SectionSpec],
    cost_model: CostModel,
    gpus: int,
    options: SearchOptions | None = None,
    *,
    baseline: bool = False,
) -> Plan:
    """The best one-size-fits-all layout within exactly ``gpus`` GPUs.

    ``baseline=True``: the layout stands for another system (the baselines of
    ``maestro.plan.report.compare``): pipeline stages (``options.baseline_pp_choices``, 1F1B
    with its bubble) and context parallelism (``baseline_cp_choices``) are open to it, on
    analytical models; a replica is then ``tp * pp * cp`` GPUs.

    One (tp, fsdp, mbs, recompute) for all sections; ``dp = gpus // tp`` data-parallel
    ranks (``fsdp`` of them sharding one copy of the state; analytical models only, as
    ``maestro train --monolithic`` runs plain replicas), and also as
    ``plan_maestro`` allocates (the fewest that fit, then more while the estimate improves)
    when that is fewer; the memory check
    sums every section's weights, optimizer state (ZeRO-1-sharded over the ``dp`` replicas
    when ``options.zero1``) and one micro-batch's activations. Candidates are ranked by the
    analytical estimate (whole-model work / dp plus every trainable section's all-reduce)
    and the best ``simulate_top`` are replayed with the colocated schedule, as in
    ``plan_maestro``, its shards in the order of ``options.monolithic_order``'s sampler
    (data order, token-count balance or Maestro's cost-aware balance; the plan's ``order``):
    the three baselines of ``maestro.plan.report.compare`` differ only there.
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
    fsdps = sorted(set(opts.fsdp_choices)) if p.analytical else [1]
    # what each side may use: the baselines what Megatron-LM runs (``baseline_pp_choices``,
    # ``baseline_cp_choices``), Maestro's whole-model candidates what its runtime runs
    pps, cps = _whole_model_choices(p, opts, baseline)
    works: dict[tuple, tuple[float, float, float]] = {}
    for tp, f, mbs, rc, pp, cp in itertools.product(p.tps, fsdps, mbs_all, p.recomputes, pps, cps):
        if rc and not any_trainable:
            continue
        width = tp * pp * cp  # GPUs per data-parallel rank
        if gpus // width < f or (pp > 1 and len(p.samples) < pp):
            continue
        strat = {
            n: SectionStrategy(
                tp=tp, fsdp=f, recompute=rc and not p.sections[n].frozen, pp=pp, cp=cp
            )
            for n in p.order
        }
        cm = p.model({}, {}, strat)
        mem_full, shard = 0.0, 0.0
        for n in p.order:
            sec = replace(p.sections[n], micro_batch_size=mbs, token_budget=budget)
            trainable = not sec.frozen
            if hasattr(cm, "memory_bytes") and p.costs[n]:
                mem_full += cm.memory_bytes(n, p.worst_features(n, sec, mbs), trainable)
                shard += _shard_bytes(p, n, tp) / (pp * cp) if f == 1 else 0.0
        key = (tp, f, mbs, rc, cp)
        if key not in works:  # a stage's work is exactly 1/pp of the unstaged replica's
            flat = (
                cm if pp == 1 else p.model({}, {}, {n: replace(x, pp=1) for n, x in strat.items()})
            )
            work, longest, per_mb = 0.0, 0.0, 0.0
            for n in p.order:
                sec = replace(p.sections[n], micro_batch_size=mbs, token_budget=budget)
                w, lg, fwd_mb, bwd_mb = p.data_order_work(flat, sec, not sec.frozen)
                work += w
                longest += lg
                per_mb += fwd_mb + bwd_mb
            works[key] = (work, longest, per_mb)
        work, longest, per_mb = (x / pp for x in works[key])
        # 1F1B's fill and drain for the ranking: (pp - 1) stage-times of a mean micro-batch;
        # the simulated figure replays the real stages (plan.pipelines)
        bubble = (pp - 1) * per_mb

        # replicas: every GPU of the budget, and as plan_maestro allocates (the fewest that
        # fit, ZeRO-1 shrinking the optimizer state with more, then more while the estimate
        # shortens; it stops early when the longest micro-batch bounds the estimate)
        # (dp counts data-parallel ranks here, in steps of fsdp)
        top = gpus // width // f * f
        dp = f
        while (
            dp < top
            and p.memory_limit is not None
            and mem_full - shard * (1 - 1 / dp) > (p.memory_limit)
        ):
            dp += f
        if p.memory_limit is not None and mem_full - shard * (1 - 1 / dp) > p.memory_limit:
            continue
        est = _mono_estimate(p, cm, width, work, longest, dp) + bubble
        fewest, cheapest = dp, (est * dp, dp)
        while (
            dp < top and (nxt := _mono_estimate(p, cm, width, work, longest, dp + f) + bubble) < est
        ):
            dp, est = dp + f, nxt
            cheapest = min(cheapest, (est * dp, dp))
        # the same allocation rule as plan_maestro's (plan.problem._allocate): the fewest
        # that fit, then more while the estimate shortens, and under GPU-hours the cheapest
        # point on the way (the budget is a cap, for both sides); and the whole budget
        points = {fewest, dp, top}
        if opts.objective == "gpu_hours":
            points.add(cheapest[1])
        for d in sorted(points):
            mem = mem_full - shard * (1 - 1 / d)
            e = _mono_estimate(p, cm, width, work, longest, d) + bubble
            cands.append((e, width, mbs, rc, d, mem, cm, f, tp, pp, cp, bubble))
    if not cands:
        raise ValueError(
            f"no monolithic layout fits {_gb(p.memory_limit)} per device within {gpus} GPUs"
        )
    if opts.objective == "gpu_hours":
        cands.sort(key=lambda c: c[0] * c[4] * c[1])  # estimated GPU-seconds per step
    else:
        cands.sort(key=lambda c: c[0])
    # as many simulations as plan_maestro's three families may use, plus the best-ranked
    # layout of every (tp, pp, cp) not among them (so none goes unsimulated)
    picked = cands[: 3 * opts.simulate_top]
    kinds = {c[8:11] for c in picked}
    for c in cands:
        if c[8:11] not in kinds:
            kinds.add(c[8:11])
            picked.append(c)
    best = None
    for est, width, mbs, rc, dp, mem, cm, f, tp, pp, cp, _bubble in picked:
        specs = [
            replace(p.sections[n], dp=dp, micro_batch_size=mbs, token_budget=budget)
            for n in p.order
        ]
        step, bound, first = p.simulated(
            ("whole", tp, f, mbs, rc, dp, pp, cp, budget),
            _simulate,
            p,
            specs,
            cm,
            monolithic=True,
            mbs=mbs,
            pipelines=[(tuple(p.order), pp)],
        )
        if best is None or _better(dp * width, step, best, opts.objective):
            best = Plan(
                sections={
                    n: SectionPlan(
                        dp // f,
                        tp,
                        mbs,
                        rc and not p.sections[n].frozen,
                        mem,
                        fsdp=f,
                        pp=pp,
                        cp=cp,
                    )
                    for n in p.order
                },
                monolithic=True,
                gpus=dp * width,
                num_samples=len(p.samples),
                step_time=step,
                estimate=est,
                busy_bound=bound,
                first_step=first,
                order=opts.monolithic_order,
            )
    best.candidates = len(cands)
    best.simulated = len(picked)
    return best


def _whole_model_choices(p: _Problem, opts: SearchOptions, baseline: bool):
    """``(pp degrees, cp degrees)`` a whole-model layout may use: a baseline's (Megatron-LM's),
    or none for Maestro's own (its runtime's whole-model mode runs plain replicas). Pipelines
    need as many blocks in every sequence section as stages; context parallelism is for long
    sequences (torchtitan and Megatron-LM use it from 8k tokens up), offered when the batch
    has some."""
    if not p.analytical or not baseline:
        # maestro train --monolithic runs plain replicas: Maestro's own pipelines and CP
        # groups are per section (plan_maestro), where its runtime runs them
        return [1], [1]
    pp_set, cp_set = opts.baseline_pp_choices, opts.baseline_cp_choices
    seq = [p.cm.shapes[n].layers for n in p.order if p.cm.shapes[n].unit == "tokens"]
    most = min(seq) if seq else min(p.cm.shapes[n].layers for n in p.order)
    # exactly the degrees asked for (a layout can be priced as given), 1 when none applies
    pps = sorted({k for k in pp_set if k <= most}) or [1]
    longest = max((s.cost.get("tokens", 0.0) for s in p.samples), default=0.0)
    cps = sorted(set(cp_set)) if longest >= CP_MIN_TOKENS and seq else [1]
    return pps, cps


def _mono_estimate(p: _Problem, cm, width: int, work: float, longest: float, dp: int) -> float:
    same = dp * width <= p.gpus_per_node
    return max(work / dp, longest) + sum(
        cm.allreduce_time(n, dp, same) for n in p.order if not p.sections[n].frozen
    )


__all__ = ["plan_monolithic"]
