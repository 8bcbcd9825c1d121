"""Steady-state step time: several consecutive steps replayed the way ``maestro.runtime`` runs them.

``maestro.sim.simulate`` replays one step from an idle start, so it charges every step the
pipeline fill (consumers waiting for their producers' first outputs) and drain (producers'
last backwards). The runtime overlaps some of that with the neighbouring steps, and only
some: trainable ranks meet at the non-finite guard at every step's end, a frozen
(forward-only) rank runs at most one step ahead, and colocated (monolithic) steps never
overlap. Those rules live in one place, ``maestro.sim.replay.replay_steps``; the planner
scores a layout by replaying its one schedule for ``steps`` consecutive steps there (with
the cost model's step overhead, scheduler time, contention and step correction, when it
has them: a profile fitted from real runs, ``maestro.sim.calibrate``).

Every step replays the same schedule (one global batch, as the planner scores), under the
simulator's one set of in-step rules for every layout (FSDP lockstep per shard group, padding:
``maestro.schedule.timeline``), so a monolithic baseline and a per-section plan are scored alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from maestro.costmodel import CostModel
from maestro.schedule.types import SampleInfo, Schedule, SectionSpec


@dataclass
class SteadyResult:
    """Consecutive steps of one schedule.

    Args:
        step_ends: when each step ended on its slowest rank (seconds from the first start).
        period: seconds per step in steady state (mean of the last half of the intervals).
        first_step: the first step's duration (what a one-step replay reports).
        busy: the busiest rank's compute plus its all-reduce per step (a lower bound).
    """

    step_ends: list[float]
    period: float
    first_step: float
    busy: float


def steady_state(
    schedule: Schedule,
    samples: Sequence[SampleInfo],
    sections: Sequence[SectionSpec],
    cost_model: CostModel,
    *,
    steps: int = 4,
    gpus_per_node: int | None = None,
) -> SteadyResult:
    """Replay ``steps`` consecutive steps of ``schedule`` with the runtime's cross-step rules.

    Args:
        schedule: any scheduler's output for ``samples`` and ``sections`` (a colocated schedule
            never overlaps steps: every rank is trainable, so its period is one step).
        samples: the global batch (the same every step).
        sections: the section specs.
        cost_model: times of compute, transfers and all-reduces.
        steps: steps to replay (>= 1).
        gpus_per_node: ranks per node (default: the cost model's GPU preset, else 8).
    """
    from maestro.sim.replay import replay_steps

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    res = replay_steps(
        [(schedule, samples)] * steps, sections, cost_model, gpus_per_node=gpus_per_node
    )
    return SteadyResult(res.step_ends, res.period, res.step_ends[0], res.busy)


__all__ = ["SteadyResult", "steady_state"]
