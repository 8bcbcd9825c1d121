"""Replay consecutive training steps the way ``maestro.runtime`` runs them, one batch per step.

``simulate`` replays one step from an idle start. A real run's step time also depends on how
steps join, so this module chains ``simulate`` calls with the runtime's rules
(``runtime/launch.py`` and ``runtime/executor.py``):

- Every rank starts a step by building the global batch (``overhead`` seconds) and computing
  the schedule (``schedule_s`` seconds, the scheduler's own CPU time) before its first
  micro-batch.
- A trainable rank ends its step with the non-finite guard, an all-reduce over all trainable
  ranks: none of them passes it before the slowest has finished its compute. Then its DP
  all-reduce and optimizer step (``cost_model.allreduce_time``), then the next step.
- A frozen (forward-only) rank has no guard: it starts step ``k + 1`` when its own step ``k``
  is done and every rank has finished step ``k - 1`` (the loss statistics all-reduce it waits
  one step late), so it runs at most one step ahead.

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
from dataclasses import dataclass

from maestro.costmodel import CostModel
from maestro.schedule.types import SampleInfo, Schedule, SectionSpec
from maestro.sim.engine import simulate


@dataclass
class ReplayResult:
    """Consecutive replayed steps.

    Args:
        step_times: seconds of each step (start of its first rank to the next step's).
        step_time: their mean.
    """

    step_times: list[float]

    @property
    def step_time(self) -> float:
        return sum(self.step_times) / len(self.step_times)


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


class _Scaled(CostModel):
    """``base`` with every section's compute times multiplied by its factor."""

    def __init__(self, base: CostModel, factor: Mapping[str, float]) -> None:
        self.base, self.factor = base, factor
        self.step_overhead = getattr(base, "step_overhead", 0.0)

    def forward_time(self, section, feats):
        return self.base.forward_time(section, feats) * self.factor.get(section, 1.0)

    def backward_time(self, section, feats):
        return self.base.backward_time(section, feats) * self.factor.get(section, 1.0)

    def transfer_time(self, producer, feats, same_node):
        return self.base.transfer_time(producer, feats, same_node)

    def allreduce_time(self, section, dp, same_node):
        return self.base.allreduce_time(section, dp, same_node)


def _contended(sched, samples, sections, cm, contention, gpus_per_node, start):
    """Simulate once, measure each section's overlap with other ranks, simulate scaled."""
    res = simulate(
        sched, samples, sections, cm, gpus_per_node=gpus_per_node, start=start, trace=True
    )
    per_rank: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    for sec, r, _, a, b in res.events:
        per_rank[(sec, r)].append((a, b))
    ov = busy_overlap(per_rank)
    own: dict[str, float] = defaultdict(float)
    other: dict[str, float] = defaultdict(float)
    for (sec, _), (o, x) in ov.items():
        own[sec] += o
        other[sec] += x
    factor = {n: 1.0 + contention * other[n] / own[n] for n in own if own[n] > 0}
    return simulate(
        sched, samples, sections, _Scaled(cm, factor), gpus_per_node=gpus_per_node, start=start
    )


def replay_steps(
    steps: Sequence[tuple[Schedule, Sequence[SampleInfo]]],
    sections: Sequence[SectionSpec],
    cost_model: CostModel,
    *,
    overhead: float | None = None,
    schedule_s: Sequence[float] | float = 0.0,
    gpus_per_node: int | None = None,
    contention: float = 0.0,
) -> ReplayResult:
    """Replay ``steps`` (each a schedule and its batch) back to back with the runtime's rules.

    Args:
        steps: ``(schedule, samples)`` of every step, in order (non-colocated schedules).
        sections: the section specs.
        cost_model: times of compute, transfers, all-reduces and optimizer steps.
        overhead: seconds each rank spends per step building the batch (default: the cost
            model's ``step_overhead``, else 0).
        schedule_s: seconds the scheduler takes per step (one value, or one per step).
        gpus_per_node: ranks per node (see ``simulate``).
        contention: slowdown per other computing rank (0: ranks do not slow each other).
    """
    if contention < 0:
        raise ValueError(f"contention must be >= 0, got {contention}")
    if not steps:
        raise ValueError("steps must not be empty")
    if overhead is None:
        overhead = float(getattr(cost_model, "step_overhead", 0.0))
    per_step = (
        [float(schedule_s)] * len(steps)
        if isinstance(schedule_s, (int, float))
        else list(schedule_s)
    )
    if len(per_step) != len(steps):
        raise ValueError(f"schedule_s has {len(per_step)} values for {len(steps)} steps")
    frozen = {s.name: s.frozen for s in sections}
    start = {s.name: [0.0] * s.dp for s in sections}
    begins: list[float] = []
    prev_all = 0.0  # when every rank had finished the step before the current one
    last_end = 0.0
    for (sched, samples), t_sched in zip(steps, per_step):
        if sched.colocated:
            raise ValueError("replay_steps replays section schedules, not colocated ones")
        begins.append(min(min(v) for v in start.values()))
        ready = {n: [t + overhead + t_sched for t in v] for n, v in start.items()}
        if contention > 0:
            res = _contended(sched, samples, sections, cost_model, contention, gpus_per_node, ready)
        else:
            res = simulate(
                sched, samples, sections, cost_model, gpus_per_node=gpus_per_node, start=ready
            )
        guard = max(
            (max(st.finish) for n, st in res.sections.items() if not frozen[n]), default=0.0
        )
        end = {
            n: [guard + st.allreduce] * st.replicas if not frozen[n] else list(st.finish)
            for n, st in res.sections.items()
        }
        last_end = max(max(v) for v in end.values())
        start = {n: (v if not frozen[n] else [max(e, prev_all) for e in v]) for n, v in end.items()}
        prev_all = last_end
    bounds = [*begins[1:], last_end]
    return ReplayResult([b - a for a, b in zip(begins, bounds)])


__all__ = ["ReplayResult", "busy_integral", "busy_overlap", "replay_steps"]
