"""Schedulers: pure functions that turn one global batch into per-replica micro-batches.

A schedule is data (``Schedule``), so the runtime executes any scheduler and the simulator
replays the same output. See ``maestro.schedule.types`` for the interface.
"""

from maestro.schedule.types import (
    MicroBatch,
    ReplicaSpec,
    SampleInfo,
    Schedule,
    SectionSpec,
)

__all__ = ["MicroBatch", "ReplicaSpec", "SampleInfo", "Schedule", "SectionSpec"]
