"""Schedulers: pure functions that turn one global batch into per-replica micro-batches.

A schedule is data (``Schedule``), so the runtime executes any scheduler and the simulator
replays the same output. See ``maestro.schedule.types`` for the interface. Look schedulers up
by name with ``get_scheduler(name)``; register new ones in ``SCHEDULERS``.
"""

from __future__ import annotations

from collections.abc import Callable

from maestro.schedule.fifo import fifo_schedule
from maestro.schedule.monolithic import monolithic_schedule
from maestro.schedule.types import (
    MicroBatch,
    ReplicaSpec,
    SampleInfo,
    Schedule,
    SectionSpec,
)
from maestro.schedule.validate import validate_schedule
from maestro.schedule.wavefront import wavefront_schedule

#: name -> ``fn(samples, sections, cost_model=None) -> Schedule``
SCHEDULERS: dict[str, Callable[..., Schedule]] = {
    "fifo": fifo_schedule,
    "monolithic": monolithic_schedule,
    "wavefront": wavefront_schedule,
}


def get_scheduler(name: str) -> Callable[..., Schedule]:
    """Return the scheduler registered under ``name``; ``ValueError`` lists the known names."""
    try:
        return SCHEDULERS[name]
    except KeyError:
        known = ", ".join(sorted(SCHEDULERS))
        raise ValueError(f"unknown scheduler {name!r}; choose one of: {known}") from None


__all__ = [
    "SCHEDULERS",
    "MicroBatch",
    "ReplicaSpec",
    "SampleInfo",
    "Schedule",
    "SectionSpec",
    "fifo_schedule",
    "get_scheduler",
    "monolithic_schedule",
    "validate_schedule",
    "wavefront_schedule",
]
