"""The scheduler interface: dataclasses in, dataclasses out, no processes or devices.

A scheduler is a function ``schedule(samples, sections, cost_model=None) -> Schedule``. The
runtime (``maestro.runtime``) executes any ``Schedule``; the simulator (``maestro.sim``) replays
it on a cost model. Keep this module free of torch so it stays cheap to import and test.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SampleInfo:
    """One sample of the global batch, as the scheduler sees it.

    Args:
        sample_id: index of the sample in the global batch (unique within the batch).
        sections: names of the sections this sample activates (e.g. ``{"vision", "llm"}``);
            a section not listed never sees the sample.
        cost: cost features, e.g. ``{"tokens": 512, "images": 1}``; a cost model maps them to
            seconds per section.
    """

    sample_id: int
    sections: frozenset[str]
    cost: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class SectionSpec:
    """A section as the scheduler sees it.

    Args:
        name: unique section name.
        inputs: names of producer sections whose per-sample outputs this section consumes.
        dp: number of data-parallel replicas: the section's data-parallel coordinates
            (its config's ``dp * fsdp``: FSDP ranks take micro-batches of their own).
        micro_batch_size: at most this many samples per micro-batch.
        frozen: forward-only (no gradients flow back to it; it may run ahead).
        token_budget: optional cap on the sum of ``cost["tokens"]`` per micro-batch.
        max_in_flight: frozen sections: at most this many output messages sent and not yet
            received before the next forward (the runtime's run-ahead bound; ``None``: none).
        tp: ranks per replica (a tensor-parallel group shares its replica's micro-batches);
            schedulers ignore it, the section takes ``dp * tp`` ranks.
    """

    name: str
    inputs: tuple[str, ...] = ()
    dp: int = 1
    micro_batch_size: int = 1
    frozen: bool = False
    token_budget: int | None = None
    max_in_flight: int | None = None
    tp: int = 1


@dataclass(frozen=True)
class ReplicaSpec:
    """One replica of a section: ``(section name, replica index in its DP group)``."""

    section: str
    index: int


@dataclass(frozen=True)
class MicroBatch:
    """An ordered group of sample ids that one replica processes together."""

    sample_ids: tuple[int, ...]


@dataclass
class Schedule:
    """The scheduler's output for one global batch.

    Args:
        order: for every section, for every replica index, the ordered micro-batches it runs.
            ``order["llm"][1][0]`` is the first micro-batch of the llm's replica 1.
        name: which scheduler produced it (for logs and traces).
        colocated: every section shares the same ranks (the monolithic baseline): each section
            has one replica per rank, and ``order[sec][r][i]`` is the part of rank ``r``'s
            ``i``-th whole-model micro-batch that activates ``sec`` (it may be empty).

    Routing is derived, not stored twice: ``replica_of(section, sample_id)`` tells which
    replica holds a sample, so a producer sends each sample's output to the consumer replica
    that will use it (M-to-N re-sharding keyed by sample id).
    """

    order: dict[str, list[list[MicroBatch]]]
    name: str = "fifo"
    colocated: bool = False

    def replica_of(self, section: str, sample_id: int) -> int:
        """Index of the replica of ``section`` that processes ``sample_id``."""
        return self._routing()[section][sample_id]

    def samples_of(self, section: str) -> set[int]:
        """All sample ids that ``section`` processes in this schedule."""
        return set(self._routing()[section])

    def _routing(self) -> dict[str, dict[int, int]]:
        cache = getattr(self, "_route_cache", None)
        if cache is None:
            cache = {
                sec: {s: r for r, mbs in enumerate(reps) for mb in mbs for s in mb.sample_ids}
                for sec, reps in self.order.items()
            }
            self._route_cache = cache
        return cache
