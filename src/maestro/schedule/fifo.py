"""The fifo schedule: each section deals its samples in data order (the runtime's baseline)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from maestro.schedule.graph import check_sections
from maestro.schedule.types import MicroBatch, SampleInfo, Schedule, SectionSpec


def fifo_schedule(
    samples: Sequence[SampleInfo], sections: Sequence[SectionSpec], cost_model=None
) -> Schedule:
    """Data order: each section deals its activated samples round-robin in blocks.

    Samples activated for a section are split into contiguous chunks of roughly equal size per
    replica (data-parallel sharding, in data order), then cut into micro-batches of at most
    ``micro_batch_size`` samples (and ``token_budget`` tokens, if set). This is the runtime's
    baseline behaviour.
    """
    check_sections(sections)
    order: dict[str, list[list[MicroBatch]]] = {}
    for sec in sections:
        ids = [s.sample_id for s in samples if sec.name in s.sections]
        # contiguous shards: replica r gets ids[r*n/dp : (r+1)*n/dp]
        n = len(ids)
        per = [ids[(r * n) // sec.dp : ((r + 1) * n) // sec.dp] for r in range(sec.dp)]
        cost = {s.sample_id: s.cost for s in samples}
        order[sec.name] = [_cut(shard, sec, cost) for shard in per]
    return Schedule(order=order, name="fifo")


def _cut(ids: list[int], sec: SectionSpec, cost: Mapping[int, Mapping[str, float]]):
    """Cut ids, in order, into micro-batches of at most ``micro_batch_size`` samples and at
    most ``token_budget`` tokens (a longer single sample forms its own micro-batch)."""
    out: list[MicroBatch] = []
    cur: list[int] = []
    tok = 0.0
    for i in ids:
        t = cost[i].get("tokens", 0.0)
        budget_hit = sec.token_budget is not None and cur and tok + t > sec.token_budget
        if len(cur) >= sec.micro_batch_size or budget_hit:
            out.append(MicroBatch(tuple(cur)))
            cur, tok = [], 0.0
        cur.append(i)
        tok += t
    if cur:
        out.append(MicroBatch(tuple(cur)))
    return out


__all__ = ["fifo_schedule"]
