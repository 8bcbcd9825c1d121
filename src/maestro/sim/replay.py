"""Replay consecutive training steps the way ``maestro.runtime`` runs them, one batch per step.

``simulate`` replays one step from an idle start. A real run's step time also depends on how
steps join, so this module chains the simulator's steps (``engine.StepModel``, built once per
schedule) with the runtime's rules (``runtime/launch.py`` and ``runtime/executor.py``); the
planner's steady-state scoring (``maestro.plan.steady``) is this replay of one schedule:

- Every rank starts a step by building the global batch (``overhead`` seconds) and computing
  the schedule (``schedule_s`` seconds, the scheduler's own CPU time) before its first
  micro-batch.
- A trainable rank ends its step with the non-finite guard, an all-reduce over all trainable
  ranks: none of them passes it before the slowest has finished its compute. Then its DP
  all-reduce and optimizer step (``cost_model.allreduce_time``), then the next step.
- A frozen (forward-only) rank has no guard: it starts step ``k + 1`` when its own step ``k``
  is done and every rank has finished step ``k - 1`` (the loss statistics all-reduce it waits
  one step late), so it runs at most one step ahead.
- A colocated (monolithic) step runs on ranks that are all trainable: the next step starts
  when it ends.

Inside a step every layout follows the same rules (``StepModel``), FSDP's included: a section
with ``cost_model.lockstep(n) = k > 1`` runs in lockstep within each shard group of ``k``
consecutive replicas (padded to the group's busiest micro-batch count), per-section or
colocated alike, and groups meet only at the step's end (the guard and the all-reduce).

Ranks on one machine slow each other down (shared memory bandwidth, caches, or cores when
there are more ranks than cores). With ``contention = c`` (fitted by ``maestro.sim.calibrate``)
a section's compute takes ``1 + c * k`` times its uncontended time, where ``k`` is the mean
number of *other* ranks computing while it computes; ``k`` comes from a first replay of the
step, and the step is replayed again with the scaled costs.

Step time is measured as a real run's trace is (``bench/maestro_schedule.py``): a step starts
when its first rank starts building the batch; the last step ends when the last rank does.
All ranks start the first replayed step together (the runtime's barrier after its warm-up).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from maestro.costmodel import CostModel
from maestro.schedule.timeline import SimResult, StepModel
from maestro.schedule.types import SampleInfo, Schedule, SectionSpec


@dataclass
class ReplayResult:
    """Consecutive replayed steps.

    Args:
        step_times: seconds of each step (start of its first rank to the next step's; the
            last one: to when its last rank ends).
        step_ends: when each step ended on its slowest rank (seconds from the first start).
        busy: the busiest rank's compute plus its all-reduce in the last step (a lower bound
            on the step time).
    """

    step_times: list[float]
    step_ends: list[float] = field(default_factory=list)
    busy: float = 0.0

    @property
    def step_time(self) -> float:
        """Mean of ``step_times``."""
        return sum(self.step_times) / len(self.step_times)

    @property
    def period(self) -> float:
        """Seconds per step in steady state: the mean interval between the step ends of the
        last half of the steps (the first steps include the pipeline's fill from idle)."""
        gaps = [b - a for a, b in zip([0.0, *self.step_ends], self.step_ends)]
        tail = gaps[len(gaps) // 2 :]
        return sum(tail) / len(tail)


def busy_integral(intervals: Mapping[object, Sequence[tuple[float, float]]]):
    """``f(x)``: the integral from the start to ``x`` of how many ranks are busy.

    Args:
        intervals: rank -> its busy intervals ``(start, end)`` (not overlapping each other).

    ``f(b) - f(a) - (b - a)`` is how long *other* ranks were busy during a busy interval
    ``(a, b)`` of one rank. A sweep over the boundaries, O(log n) per query.
    """
    delta: dict[float, int] = defaultdict(int)
    for ivs in intervals.values():
        for a, b in ivs:
            if b > a:
                delta[a] += 1
                delta[b] -= 1
    times = sorted(delta)
    after: list[int] = []  # busy ranks on [times[i], times[i + 1])
    for t in times:
        after.append((after[-1] if after else 0) + delta[t])
    cum = [0.0]  # the integral up to times[i]
    for i in range(1, len(times)):
        cum.append(cum[-1] + after[i - 1] * (times[i] - times[i - 1]))

    def integral(x: float) -> float:
        i = bisect.bisect_right(times, x) - 1
        return 0.0 if i < 0 else cum[i] + after[i] * (x - times[i])

    return integral


def busy_overlap(
    intervals: Mapping[object, Sequence[tuple[float, float]]],
) -> dict[object, tuple[float, float]]:
    """For every rank, ``(own busy seconds, seconds other ranks were busy meanwhile)``; their
    ratio is the mean number of other ranks computing while it computes."""
    f = busy_integral(intervals)
    out = {}
    for rank, ivs in intervals.items():
        own = sum(b - a for a, b in ivs if b > a)
        total = sum(f(b) - f(a) for a, b in ivs if b > a)
        out[rank] = (own, max(0.0, total - own))
    return out


def _contention_scale(step: StepModel, start, contention: float) -> dict[str, float]:
    """Section -> ``1 + contention * k``, ``k`` the mean number of other ranks computing while
    the section computes, from a first (uncontended) replay of the step."""
    res = step.run(start, trace=True)
    per_rank: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    for sec, r, _, a, b in res.events:
        per_rank[(sec, r)].append((a, b))
    if step.schedule.colocated:  # a rank runs every section: its intervals are the rank's
        per_rank = _merge_sections(per_rank)
    ov = busy_overlap(per_rank)
    own: dict[str, float] = defaultdict(float)
    other: dict[str, float] = defaultdict(float)
    for (sec, _), (o, x) in ov.items():
        own[sec] += o
        other[sec] += x
    if step.schedule.colocated:
        k = sum(other.values()) / max(sum(own.values()), 1e-30)
        return {n: 1.0 + contention * k for n in step.by_name}
    return {n: 1.0 + contention * other[n] / own[n] for n in own if own[n] > 0}


def _merge_sections(per_rank):
    out: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    for (_, r), ivs in per_rank.items():
        out[("", r)].extend(ivs)
    return out


def replay_steps(
    steps: Sequence[tuple[Schedule, Sequence[SampleInfo]]],
    sections: Sequence[SectionSpec],
    cost_model: CostModel,
    *,
    overhead: float | None = None,
    schedule_s: Sequence[float] | float | None = None,
    gpus_per_node: int | None = None,
    contention: float | None = None,
    step_scale: float | None = None,
) -> ReplayResult:
    """Replay ``steps`` (each a schedule and its batch) back to back with the runtime's rules.

    Args:
        steps: ``(schedule, samples)`` of every step, in order. Colocated (monolithic)
            schedules are replayed one after the other: every rank is trainable, so steps
            never overlap.
        sections: the section specs.
        cost_model: times of compute, transfers, all-reduces and optimizer steps.
        overhead: seconds each rank spends per step building the batch (default: the cost
            model's ``step_overhead``, else 0); colocated steps use the simulator's (the
            cost model's ``step_overhead``, or its ``whole_model`` fit's).
        schedule_s: seconds the scheduler takes per step (one value, or one per step;
            default: the cost model's ``scheduler_s``, else 0); not for colocated steps.
        gpus_per_node: ranks per node (see ``simulate``).
        contention: slowdown per other computing rank (default: the cost model's
            ``contention``, else 0: ranks do not slow each other). Not applied to a
            colocated step whose cost model has a ``whole_model`` fit (measured under the
            contention of a monolithic run already).
        step_scale: multiplies every replayed step's duration (default: the cost model's
            ``step_factor`` for the step's kind, ``"sections"`` or ``"monolithic"``, and its
            largest micro-batch, else its ``step_scale`` for the kind, else 1): a correction
            measured on real runs for what the replay does not model
            (``maestro.sim.calibrate``).
    """
    if contention is None:
        contention = float(getattr(cost_model, "contention", 0.0))
    if contention < 0:
        raise ValueError(f"contention must be >= 0, got {contention}")
    if not steps:
        raise ValueError("steps must not be empty")
    if overhead is None:
        overhead = float(getattr(cost_model, "step_overhead", 0.0))
    if schedule_s is None:
        schedule_s = float(getattr(cost_model, "scheduler_s", 0.0))
    per_step = (
        [float(schedule_s)] * len(steps)
        if isinstance(schedule_s, (int, float))
        else list(schedule_s)
    )
    if len(per_step) != len(steps):
        raise ValueError(f"schedule_s has {len(per_step)} values for {len(steps)} steps")
    frozen = {s.name: s.frozen for s in sections}
    whole = getattr(cost_model, "whole_model", None) is not None
    start = {s.name: [0.0] * s.dp for s in sections}
    models: dict[int, tuple[StepModel, dict[str, float] | None]] = {}
    begins: list[float] = []
    ends: list[float] = []
    busiest = 0.0
    prev_all = 0.0  # when every rank had finished the step before the current one
    for (sched, samples), t_sched in zip(steps, per_step):
        # consecutive steps of one schedule (a steady state) share its precomputed model
        key = id(sched)
        if key not in models:
            models[key] = (
                StepModel(sched, samples, sections, cost_model, gpus_per_node=gpus_per_node),
                None,
            )
        step, scale = models[key]
        if sched.colocated:
            begin = max(ends[-1] if ends else 0.0, 0.0)
            if scale is None:
                use = contention > 0 and not whole
                scale = _contention_scale(step, None, contention) if use else {}
                models[key] = (step, scale)
            res = step.run(scale=scale)
            begins.append(begin)
            ends.append(begin + res.step_time)
            busiest = _busiest(res, True)
            prev_all = ends[-1]
            start = {n: [ends[-1]] * len(v) for n, v in start.items()}
            continue
        begins.append(min(min(v) for v in start.values()))
        ready = {n: [t + overhead + t_sched for t in v] for n, v in start.items()}
        # contention depends on how the step overlaps, which depends on when ranks start
        scale = _contention_scale(step, ready, contention) if contention > 0 else {}
        res = step.run(ready, scale=scale)
        guard = max(
            (max(st.finish) for n, st in res.sections.items() if not frozen[n]), default=0.0
        )
        end = {
            n: [guard + st.allreduce] * st.replicas if not frozen[n] else list(st.finish)
            for n, st in res.sections.items()
        }
        ends.append(max(max(v) for v in end.values()))
        busiest = _busiest(res, False)
        # the next step: trainable ranks after their all-reduce; frozen ranks after their
        # own step and once every rank has finished the step before (one step ahead)
        start = {n: (v if not frozen[n] else [max(e, prev_all) for e in v]) for n, v in end.items()}
        prev_all = ends[-1]
    bounds = [*begins[1:], ends[-1]]
    times = [b - a for a, b in zip(begins, bounds)]
    factors = [
        step_scale if step_scale is not None else _step_factor(cost_model, sched, sections)
        for sched, _ in steps
    ]
    if any(f != 1.0 for f in factors):
        if min(factors) <= 0:
            raise ValueError(f"step_scale must be > 0, got {min(factors)}")
        times = [t * f for t, f in zip(times, factors)]
        # each step's end moves with the scaled durations before it
        scaled, prev, prev_new = [], 0.0, 0.0
        for e, f in zip(ends, factors):
            prev_new += (e - prev) * f
            prev = e
            scaled.append(prev_new)
        ends = scaled
        busiest *= factors[-1]
    return ReplayResult(times, ends, busiest)


def correction_micro_batch(sched: Schedule, sections: Sequence[SectionSpec]) -> int:
    """The micro-batch size a step's correction is keyed by (the profiling runs use one size
    for every section): a section layout's smallest configured ``micro_batch_size`` (its most
    numerous micro-batches, so messages and waits: a 2-rank MLLM layout with vision 4 / LLM 2
    measured as the profiling runs at 2 did, not at 4); a colocated schedule's largest
    whole-model micro-batch (the monolithic size is not in the specs), counted as its
    largest per-section part."""
    if not sched.colocated:
        return min((s.micro_batch_size for s in sections), default=1)
    return max(
        (len(mb.sample_ids) for reps in sched.order.values() for mbs in reps for mb in mbs),
        default=1,
    )


def _step_factor(cost_model: CostModel, sched: Schedule, sections) -> float:
    kind = "monolithic" if sched.colocated else "sections"
    by_size = getattr(cost_model, "step_factor", None)
    if by_size is not None:
        return by_size(kind, correction_micro_batch(sched, sections))
    return (getattr(cost_model, "step_scale", None) or {}).get(kind, 1.0)


def _busiest(res: SimResult, colocated: bool) -> float:
    """The busiest rank's compute plus its all-reduce in one step."""
    if not res.sections:
        return 0.0
    first = next(iter(res.sections.values()))
    if colocated:  # every rank runs every section
        ranks = range(first.replicas)
        return max(sum(st.busy[r] for st in res.sections.values()) for r in ranks) + first.allreduce
    return max(
        max((b + st.allreduce for b in st.busy), default=0.0) for st in res.sections.values()
    )


__all__ = [
    "ReplayResult",
    "busy_integral",
    "busy_overlap",
    "correction_micro_batch",
    "replay_steps",
]
