"""Steady-state step time: several consecutive steps replayed the way ``maestro.runtime`` runs them.

``maestro.sim.simulate`` replays one step from an idle start, so it charges every step the
pipeline fill (consumers waiting for their producers' first outputs) and drain (producers'
last backwards). The runtime overlaps some of that with the neighbouring steps, and only
some. What it does (``runtime/executor.py`` and ``runtime/launch.py``), and what this replay
therefore models across steps:

- Every rank of a trainable section ends its step with the non-finite guard, an all-reduce
  over *all* trainable ranks (before the DP all-reduce and optimizer step): no trainable rank
  starts step ``k + 1`` before the slowest trainable rank has finished step ``k``'s compute.
  Trainable sections therefore never overlap steps, and neither does a colocated
  (monolithic) layout.
- A frozen (forward-only) rank takes no part in the guard and has no optimizer; it starts step
  ``k + 1`` as soon as its own step ``k`` is done and the loss statistics of step ``k - 1``
  (an async all-reduce over all ranks, waited one step late) are complete, i.e. once every
  rank has finished step ``k - 1``. So a frozen producer runs at most one step ahead, and its
  outputs for the next step may be waiting when its consumers start it.

Within a step the rules are the simulator's (``maestro.sim.engine``): forwards in schedule
order as inputs arrive; a ``step`` section's backward right after each forward; a trainable
producer's backwards in schedule order as gradients arrive; transfers are latency plus bytes
over the link. With ``steps=1`` the replay equals ``simulate`` whenever at most one section is
trainable (with several, the guard makes each trainable rank wait for the slowest before its
all-reduce, which ``simulate`` does not model).

Every step replays the same schedule (one global batch, as the planner scores).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from maestro.costmodel import CostModel, micro_batch_features
from maestro.schedule.graph import check_sections, grad_consumers, role, topo_order
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
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if schedule.colocated:
        from maestro.sim import simulate

        res = simulate(schedule, samples, sections, cost_model, gpus_per_node=gpus_per_node)
        names = list(res.sections)
        world = len(res.sections[names[0]].busy)
        busiest = max(sum(res.sections[n].busy[r] for n in names) for r in range(world))
        busy = busiest + res.sections[names[0]].allreduce
        ends = [res.step_time * (k + 1) for k in range(steps)]
        return SteadyResult(ends, res.step_time, res.step_time, busy)
    return _Replay(schedule, samples, sections, cost_model, gpus_per_node).run(steps)


class _Replay:
    def __init__(self, schedule, samples, sections, cm, gpus_per_node):
        self.by_name = check_sections(sections)
        if gpus_per_node is None:
            gpus_per_node = getattr(getattr(cm, "gpu", None), "gpus_per_node", 8)
        if gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
        self.gpn = gpus_per_node
        self.cm = cm
        self.order = topo_order(sections)
        self.gcons = grad_consumers(sections)
        self.roles = {n: role(self.by_name[n], self.gcons) for n in self.order}
        self.sched = schedule
        cost_of = {s.sample_id: s.cost for s in samples}
        self.first_rank, r0 = {}, 0
        for n in self.order:
            self.first_rank[n] = r0
            r0 += len(schedule.order[n])
        self.feats = {
            n: [
                [micro_batch_features(cost_of[s] for s in mb.sample_ids) for mb in mbs]
                for mbs in schedule.order[n]
            ]
            for n in self.order
        }
        where = {
            n: {
                s: (r, i)
                for r, mbs in enumerate(schedule.order[n])
                for i, mb in enumerate(mbs)
                for s in mb.sample_ids
            }
            for n in self.order
        }
        # coalesced messages (producer replica, mb, consumer replica, mb) and their transfer
        # seconds, per (producer, consumer) edge; the same every step
        self.msgs: dict[tuple[str, str], list[tuple[int, int, int, int, float]]] = {}
        for c in self.order:
            for p in dict.fromkeys(self.by_name[c].inputs):
                groups: dict[tuple[int, int, int, int], list[int]] = defaultdict(list)
                for s, (dr, di) in where[c].items():
                    if s in where[p]:
                        sr, si = where[p][s]
                        groups[(sr, si, dr, di)].append(s)
                self.msgs[(p, c)] = [
                    (
                        *key,
                        cm.transfer_time(
                            p,
                            micro_batch_features(cost_of[s] for s in ss),
                            self._node(p, key[0]) == self._node(c, key[2]),
                        ),
                    )
                    for key, ss in groups.items()
                ]
        self.overhead = getattr(cm, "step_overhead", 0.0)
        self.allreduce = {}
        for n in self.order:
            if not self.by_name[n].frozen:
                ranks = len(schedule.order[n])
                same = self._node(n, 0) == self._node(n, ranks - 1)
                self.allreduce[n] = cm.allreduce_time(n, ranks, same)

    def _node(self, n: str, r: int) -> int:
        return (self.first_rank[n] + r) // self.gpn

    def _step(self, start: dict[str, list[float]]):
        """One step from per-replica start times; ``(finish per replica, busy per replica)``."""
        cm, order = self.cm, self.order
        fwd_end: dict[str, list[list[float]]] = {}
        bwd_end: dict[str, list[list[float]]] = {}
        finish: dict[str, list[float]] = {}
        busy: dict[str, list[float]] = {}
        for n in order:
            need: dict[tuple[int, int], float] = defaultdict(float)
            for p in dict.fromkeys(self.by_name[n].inputs):
                for sr, si, dr, di, tt in self.msgs[(p, n)]:
                    need[(dr, di)] = max(need[(dr, di)], fwd_end[p][sr][si] + tt)
            fe, be, fin, bs = [], [], [], []
            for r, mbs in enumerate(self.sched.order[n]):
                t, b = start[n][r] + self.overhead, 0.0
                fe_r, be_r = [], []
                for i in range(len(mbs)):
                    f = cm.forward_time(n, self.feats[n][r][i])
                    t = max(t, need.get((r, i), 0.0)) + f
                    b += f
                    fe_r.append(t)
                    if self.roles[n] == "step":
                        bt = cm.backward_time(n, self.feats[n][r][i])
                        t += bt
                        b += bt
                        be_r.append(t)
                fe.append(fe_r)
                be.append(be_r)
                fin.append(t)
                bs.append(b)
            fwd_end[n], bwd_end[n], finish[n], busy[n] = fe, be, fin, bs
        for n in reversed(order):
            if self.roles[n] != "producer":
                continue
            grad_at: dict[tuple[int, int], float] = {}
            for c in self.gcons[n]:
                for sr, si, dr, di, tt in self.msgs[(n, c)]:
                    grad_at[(sr, si)] = max(grad_at.get((sr, si), 0.0), bwd_end[c][dr][di] + tt)
            be = []
            for r, mbs in enumerate(self.sched.order[n]):
                t = finish[n][r]
                ends = [0.0] * len(mbs)
                for i in range(len(mbs)):
                    if (r, i) not in grad_at:
                        continue
                    bt = cm.backward_time(n, self.feats[n][r][i])
                    t = max(t, grad_at[(r, i)]) + bt
                    ends[i] = t
                    busy[n][r] += bt
                be.append(ends)
                finish[n][r] = t
            bwd_end[n] = be
        return finish, busy

    def run(self, steps: int) -> SteadyResult:
        order, by_name = self.order, self.by_name
        trainable = [n for n in order if not by_name[n].frozen]
        start = {n: [0.0] * len(self.sched.order[n]) for n in order}
        ends: list[float] = []
        prev_all = 0.0  # every rank done with step k - 1 (loss statistics all-reduce)
        busiest = 0.0
        for _ in range(steps):
            finish, busy = self._step(start)
            guard = max((max(finish[n], default=0.0) for n in trainable), default=0.0)
            end = {
                n: (
                    [guard + self.allreduce[n]] * len(finish[n])
                    if n in self.allreduce
                    else list(finish[n])
                )
                for n in order
            }
            step_end = max(max(e, default=0.0) for e in end.values())
            ends.append(step_end)
            busiest = max(
                max((b + self.allreduce.get(n, 0.0) for b in busy[n]), default=0.0) for n in order
            )
            # the next step: trainable ranks after their all-reduce; frozen ranks after their
            # own step and once every rank has finished the step before (one step ahead)
            start = {
                n: (end[n] if n in self.allreduce else [max(e, prev_all) for e in end[n]])
                for n in order
            }
            prev_all = step_end
        gaps = [b - a for a, b in zip([0.0, *ends], ends)]
        tail = gaps[len(gaps) // 2 :]
        return SteadyResult(ends, sum(tail) / len(tail), ends[0], busiest)


__all__ = ["SteadyResult", "steady_state"]
