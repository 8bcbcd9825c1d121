"""``validate_schedule``: check every invariant a runnable schedule must hold.

Tests use it on every scheduler's output; the runtime may call it before executing a schedule
it did not build itself. It raises ``ValueError`` naming the first broken invariant.
"""

from __future__ import annotations

from collections.abc import Sequence

from maestro.schedule.graph import check_sections
from maestro.schedule.types import SampleInfo, Schedule, SectionSpec


def validate_schedule(
    schedule: Schedule, samples: Sequence[SampleInfo], sections: Sequence[SectionSpec]
) -> None:
    """Raise ``ValueError`` unless ``schedule`` is a correct schedule of ``samples``.

    Checked:
      1. every section has an entry, with ``dp`` replicas (colocated: the same number of
         replicas, one per rank, for every section, and the same micro-batch count per rank);
      2. every activated ``(sample, section)`` pair is scheduled exactly once, and no other;
      3. no micro-batch exceeds its section's ``micro_batch_size`` (colocated schedules have
         one size of their own) or ``token_budget`` (a single sample longer than the budget
         may form a micro-batch on its own), and none is empty (except the empty parts of a
         colocated schedule);
      4. colocated: a sample sits on the same rank and micro-batch index in all its sections.

    With these, every schedule can run: sections have disjoint ranks and form a DAG, so a
    consumer micro-batch only ever waits on producer forwards that wait on nothing downstream
    (and, colocated, a rank runs each whole-model micro-batch through the sections in
    topological order). ``maestro.sim`` replays the timing; tests check there that no consumer
    forward starts before its producers' outputs exist.

    Args:
        schedule: the schedule to check.
        samples: the global batch as the scheduler saw it.
        sections: the section specs it was scheduled for.
    """
    by_name = check_sections(sections)
    ids = [s.sample_id for s in samples]
    if len(set(ids)) != len(ids):
        raise ValueError("sample ids are not unique")
    missing = set(by_name) - set(schedule.order)
    extra = set(schedule.order) - set(by_name)
    if missing or extra:
        raise ValueError(
            f"schedule sections differ: missing {sorted(missing)}, extra {sorted(extra)}"
        )

    # 1. replica counts
    if schedule.colocated:
        counts = {len(schedule.order[n]) for n in by_name}
        if len(counts) != 1 or 0 in counts:
            raise ValueError(
                f"colocated schedule needs the same replica count per section: {counts}"
            )
        world = counts.pop()
        for r in range(world):
            lens = {len(schedule.order[n][r]) for n in by_name}
            if len(lens) != 1:
                raise ValueError(f"colocated rank {r}: sections have different micro-batch counts")
    else:
        for n, sec in by_name.items():
            if len(schedule.order[n]) != sec.dp:
                raise ValueError(
                    f"section {n!r}: {len(schedule.order[n])} replicas scheduled, dp={sec.dp}"
                )

    # 2./3. coverage and limits
    cost = {s.sample_id: s.cost for s in samples}
    where: dict[str, dict[int, tuple[int, int]]] = {}
    for n, sec in by_name.items():
        want = {s.sample_id for s in samples if n in s.sections}
        seen: dict[int, tuple[int, int]] = {}
        for r, mbs in enumerate(schedule.order[n]):
            for i, mb in enumerate(mbs):
                sids = mb.sample_ids
                if not sids and not schedule.colocated:
                    raise ValueError(f"section {n!r} replica {r}: micro-batch {i} is empty")
                # a colocated schedule has one whole-model micro-batch size of its own
                if len(sids) > sec.micro_batch_size and not schedule.colocated:
                    raise ValueError(
                        f"section {n!r} replica {r}: micro-batch {i} has {len(sids)} samples, "
                        f"micro_batch_size={sec.micro_batch_size}"
                    )
                for s in sids:
                    if s not in want:
                        raise ValueError(
                            f"section {n!r}: sample {s} is scheduled but does not activate it"
                            if s in cost
                            else f"section {n!r}: unknown sample id {s}"
                        )
                    if s in seen:
                        raise ValueError(f"section {n!r}: sample {s} is scheduled twice")
                    seen[s] = (r, i)
                if sec.token_budget is not None and len(sids) > 1:
                    tok = sum(cost[s].get("tokens", 0) for s in sids)
                    if tok > sec.token_budget:
                        raise ValueError(
                            f"section {n!r} replica {r}: micro-batch {i} has {tok} tokens, "
                            f"token_budget={sec.token_budget}"
                        )
        lost = want - set(seen)
        if lost:
            raise ValueError(f"section {n!r}: samples {sorted(lost)[:8]} are never scheduled")
        where[n] = seen

    # 4. colocation
    if schedule.colocated:
        for s in samples:
            places = {where[n][s.sample_id] for n in s.sections if n in where}
            if len(places) > 1:
                raise ValueError(
                    f"colocated schedule: sample {s.sample_id} is on different ranks/micro-batches"
                )
