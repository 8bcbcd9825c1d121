"""Discrete-event replay of a ``Schedule`` on a ``CostModel``, with the runtime's execution rule.

Execution rule (the same as ``maestro.runtime``): every section replica owns its own rank and
runs its micro-batch forwards in schedule order; a forward starts when the replica is free and
every producer output of its samples has arrived (one coalesced message per producer
micro-batch and consumer replica). Then, by the section's role (``schedule.graph.role``):

- ``forward`` (frozen): forwards only, back to back; it runs ahead of its consumers. With
  ``max_in_flight = B`` a forward waits until at most ``B`` of its earlier output messages
  are unreceived (a consumer receives a message when it starts the first micro-batch that
  needs it); the simulator iterates to a fixed point, since receive times depend on it.
- ``step`` (trainable, no trainable consumer): each backward right after its forward; input
  gradients go back to trainable producers.
- ``producer`` (trainable with trainable consumers): all forwards, then one backward per
  micro-batch, in schedule order, each once the gradients of all its samples have arrived.

When a section's last backward ends on every replica, its gradients are all-reduced within its
DP group and its optimizer steps; the step ends when the last section is done, plus the cost
model's ``step_overhead`` (work outside sections, such as building the batch), if it has one.
A colocated (monolithic) schedule runs each whole-model micro-batch forward through all
sections then backward on one rank, and all-reduces every trainable section over all ranks.

Parallel strategies inside a section are the cost model's: a layout model
(``maestro.plan.tpmodel.LayoutCostModel``) prices tensor-parallel all-reduces and FSDP
all-gathers and reduce-scatters into each micro-batch's compute, and the step's tail.

One lockstep rule for every layout. A section whose cost model says ``lockstep(n) = k > 1``
(FSDP's collectives), trainable or frozen, runs in lockstep within shard groups of ``k``
consecutive replicas (``shard_groups``): every replica of a group is padded to the group's
busiest micro-batch count (a padding micro-batch is one sample: the first of the batch that
activates the section), and each replica's ``i``-th forward (backward) starts when every
replica of its group is ready for it and lasts as long as the slowest. Groups do not wait for
each other before the step's tail (HSDP's once-per-step all-reduce across groups is in
``allreduce_time``). A colocated schedule follows the same rule with a rank's whole-model
micro-batches: the ranks of a group pad to the same number and run each section's pass of
each micro-batch in step (``_simulate_colocated``), so a one-section layout replays to the
same step time either way.

Transfers are latency plus bytes over the link bandwidth (NVLink inside a node, the network
across nodes); link contention is not modelled. Ranks are assigned to sections in
topological order, consecutively (``spec.tp`` ranks per replica), ``gpus_per_node`` to a
node.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from maestro.costmodel import CostModel, micro_batch_features
from maestro.schedule.graph import (
    check_sections,
    consumers_of,
    grad_consumers,
    role,
    topo_order,
)
from maestro.schedule.types import SampleInfo, Schedule, SectionSpec


@dataclass
class SectionStats:
    """Per-section outcome of a simulated step.

    Args:
        replicas: number of replicas (ranks) the section ran on.
        busy: compute seconds per replica.
        finish: when each replica's last compute ended.
        allreduce: seconds of gradient all-reduce plus optimizer step after the last backward.
    """

    replicas: int
    busy: list[float]
    finish: list[float]
    allreduce: float = 0.0

    def utilisation(self, step_time: float) -> float:
        """Mean fraction of the step each replica spent computing."""
        return sum(self.busy) / (len(self.busy) * step_time) if step_time > 0 else 0.0

    def bubble(self, step_time: float) -> float:
        """Mean idle seconds per replica over the step."""
        return step_time - sum(self.busy) / len(self.busy)


@dataclass
class SimResult:
    """A simulated step.

    Args:
        step_time: seconds from the first forward to the last optimizer step.
        num_samples: samples in the global batch.
        sections: per-section statistics.
        events: ``(section, replica, kind, start, end)`` compute intervals, kind ``"fwd"`` or
            ``"bwd"`` (empty unless ``trace=True``).
        world_size: ranks used.
    """

    step_time: float
    num_samples: int
    sections: dict[str, SectionStats]
    events: list[tuple[str, int, str, float, float]] = field(default_factory=list)
    world_size: int = 0

    @property
    def samples_per_s(self) -> float:
        return self.num_samples / self.step_time if self.step_time > 0 else float("inf")

    def table(self) -> str:
        """A readable per-section summary."""
        lines = [
            f"step time {self.step_time * 1e3:.2f} ms, {self.samples_per_s:.1f} samples/s, "
            f"{self.world_size} ranks",
            f"{'section':<14}{'ranks':>6}{'util %':>8}{'bubble ms':>11}{'allreduce ms':>14}",
        ]
        for n, st in self.sections.items():
            lines.append(
                f"{n:<14}{st.replicas:>6}{100 * st.utilisation(self.step_time):>8.1f}"
                f"{1e3 * st.bubble(self.step_time):>11.2f}{1e3 * st.allreduce:>14.2f}"
            )
        return "\n".join(lines)


def simulate(
    schedule: Schedule,
    samples: Sequence[SampleInfo],
    sections: Sequence[SectionSpec],
    cost_model: CostModel,
    *,
    gpus_per_node: int | None = None,
    trace: bool = False,
    arrival_order: bool = False,
    start: Mapping[str, Sequence[float]] | None = None,
) -> SimResult:
    """Replay ``schedule`` and return its step time and per-section statistics.

    Args:
        schedule: output of any scheduler for ``samples`` and ``sections``.
        samples: the global batch.
        sections: the section specs.
        cost_model: times of compute, transfers and all-reduces.
        gpus_per_node: ranks per node (default: the cost model's GPU preset, else 8).
        trace: keep every compute interval in ``SimResult.events`` (for a Gantt chart).
        arrival_order: producer backwards run in gradient-arrival order instead of schedule
            order (``maestro.runtime`` runs them in schedule order, waiting as needed).
        start: section -> per-replica time at which the replica may begin (default 0), for
            replaying consecutive steps (``maestro.sim.replay``); not for colocated schedules.
    """
    if schedule.colocated and start is not None:
        raise ValueError("start times are not supported for colocated schedules")
    step = StepModel(schedule, samples, sections, cost_model, gpus_per_node=gpus_per_node)
    return step.run(start, trace=trace, arrival_order=arrival_order)


def lockstep_degree(cost_model: CostModel, section: str) -> int:
    """``k > 1`` when ``section``'s replicas run in lockstep in shard groups of ``k``
    consecutive replicas (``cost_model.lockstep``: FSDP), else 0; 0 for a cost model without
    ``lockstep``."""
    fn = getattr(cost_model, "lockstep", None)
    k = int(fn(section)) if fn is not None else 0
    return k if k > 1 else 0


def shard_groups(replicas: int, k: int) -> list[list[int]]:
    """The shard groups of ``replicas`` replicas at lockstep degree ``k``: ``k`` consecutive
    replicas each (the mesh's ``replica = dp_index * fsdp + fsdp_index``); the last group is
    shorter when ``k`` does not divide ``replicas``. ``k <= 1``: every replica on its own."""
    k = max(1, k)
    return [list(range(g, min(g + k, replicas))) for g in range(0, replicas, k)]


def _gpus_per_node(cost_model: CostModel, gpus_per_node: int | None) -> int:
    if gpus_per_node is None:
        gpu = getattr(cost_model, "gpu", None)
        gpus_per_node = getattr(gpu, "gpus_per_node", 8)
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    return gpus_per_node


class StepModel:
    """One schedule's step with everything that does not depend on start times computed once.

    ``simulate`` runs it once; ``maestro.sim.replay`` runs it for every consecutive step of
    the same schedule (compute and transfer times, message groups and roles are the same each
    step, only the replicas' start times change).

    Args: as ``simulate``.
    """

    def __init__(
        self,
        schedule: Schedule,
        samples: Sequence[SampleInfo],
        sections: Sequence[SectionSpec],
        cost_model: CostModel,
        *,
        gpus_per_node: int | None = None,
    ) -> None:
        self.by_name = check_sections(sections)
        self.gpn = _gpus_per_node(cost_model, gpus_per_node)
        self.schedule, self.cm, self.sections = schedule, cost_model, sections
        self.cost_of = {s.sample_id: s.cost for s in samples}
        self.num_samples = len(samples)
        # a padding micro-batch (lockstep) is one sample: the first that activates the section
        self.pad_sample: dict[str, SampleInfo] = {}
        for x in samples:
            for n in x.sections:
                self.pad_sample.setdefault(n, x)
        if schedule.colocated:
            return
        order = self.order = topo_order(sections)
        self.gcons = grad_consumers(sections)
        self.roles = {n: role(self.by_name[n], self.gcons) for n in order}
        self.first_rank, r0 = {}, 0
        for n in order:
            self.first_rank[n] = r0
            r0 += len(schedule.order[n]) * max(1, self.by_name[n].tp)
        self.world = r0
        self.where: dict[str, dict[int, tuple[int, int]]] = {
            n: {
                s: (r, i)
                for r, mbs in enumerate(schedule.order[n])
                for i, mb in enumerate(mbs)
                for s in mb.sample_ids
            }
            for n in order
        }
        feats = {
            n: [
                [micro_batch_features(self.cost_of[s] for s in mb.sample_ids) for mb in mbs]
                for mbs in schedule.order[n]
            ]
            for n in order
        }
        # unscaled compute seconds per (section, replica, micro-batch)
        self.fwd_s = {
            n: [[cost_model.forward_time(n, f) for f in fr] for fr in feats[n]] for n in order
        }
        self.bwd_s = {
            n: [[cost_model.backward_time(n, f) for f in fr] for fr in feats[n]]
            for n in order
            if self.roles[n] != "forward"
        }
        # lockstep sections (FSDP), trainable or frozen: every replica of a shard group (k
        # consecutive replicas) is padded to the group's busiest micro-batch count; groups are
        # independent (HSDP couples them only in the step's tail, ``allreduce_time``)
        self.lockstep: dict[str, int] = {}  # section -> replicas per shard group
        for n in order:
            k = lockstep_degree(cost_model, n)
            if k > 1:
                self.lockstep[n] = k
        for n, k in self.lockstep.items():
            first = self.pad_sample.get(n)
            if first is None:
                continue
            f1 = micro_batch_features([first.cost])
            pad_f = cost_model.forward_time(n, f1)
            pad_b = cost_model.backward_time(n, f1) if n in self.bwd_s else 0.0
            for grp in shard_groups(len(schedule.order[n]), k):
                num = max(len(schedule.order[n][r]) for r in grp)
                for r in grp:
                    extra = num - len(schedule.order[n][r])
                    self.fwd_s[n][r] += [pad_f] * extra
                    if n in self.bwd_s:
                        self.bwd_s[n][r] += [pad_b] * extra
        # coalesced messages ``(producer replica, mb, consumer replica, mb, transfer seconds)``
        # per (producer, consumer) edge: outputs one way, gradients (same size) the other
        self.msgs: dict[tuple[str, str], list[tuple[int, int, int, int, float]]] = {}
        for c in order:
            for p in dict.fromkeys(self.by_name[c].inputs):
                groups: dict[tuple[int, int, int, int], list[int]] = defaultdict(list)
                for s, (dr, di) in self.where[c].items():
                    if s in self.where[p]:
                        sr, si = self.where[p][s]
                        groups[(sr, si, dr, di)].append(s)
                self.msgs[(p, c)] = [
                    (
                        *key,
                        cost_model.transfer_time(
                            p,
                            micro_batch_features(self.cost_of[s] for s in ss),
                            self._node(p, key[0]) == self._node(c, key[2]),
                        ),
                    )
                    for key, ss in groups.items()
                ]
        self.allreduce = {}
        for n in order:
            if not self.by_name[n].frozen:
                ranks = len(schedule.order[n])
                same = self._node(n, 0) == self._node(n, ranks - 1)
                self.allreduce[n] = cost_model.allreduce_time(n, ranks, same)
        self.bounded = {
            n: self.by_name[n].max_in_flight
            for n in order
            if self.by_name[n].frozen and self.by_name[n].max_in_flight is not None
        }

    def _node(self, n: str, r: int) -> int:
        return (self.first_rank[n] + r * max(1, self.by_name[n].tp)) // self.gpn

    def run(
        self,
        start: Mapping[str, Sequence[float]] | None = None,
        *,
        trace: bool = False,
        arrival_order: bool = False,
        scale: Mapping[str, float] | None = None,
    ) -> SimResult:
        """Replay the step.

        Args:
            start: section -> per-replica time at which the replica may begin (default 0).
            trace: keep every compute interval in ``SimResult.events``.
            arrival_order: producer backwards in gradient-arrival order (see ``simulate``).
            scale: section -> factor on its compute times (contention, ``maestro.sim.replay``).
        """
        scale = scale or {}
        if self.schedule.colocated:
            return _simulate_colocated(self, trace, scale)
        order, by_name, roles = self.order, self.by_name, self.roles
        fwd_end: dict[str, list[list[float]]] = {}
        bwd_end: dict[str, list[list[float]]] = {}
        stats: dict[str, SectionStats] = {}
        events: list[tuple[str, int, str, float, float]] = []

        def forwards(not_before: dict[tuple[str, int, int], float]) -> dict[str, list[list[float]]]:
            """Forwards (and the backwards of step sections), producers first; forward starts."""
            starts: dict[str, list[list[float]]] = {}
            for n in order:
                k = scale.get(n, 1.0)
                need: dict[tuple[int, int], float] = defaultdict(float)  # (replica, mb) -> ready
                for p in dict.fromkeys(by_name[n].inputs):
                    for sr, si, dr, di, tt in self.msgs[(p, n)]:
                        need[(dr, di)] = max(need[(dr, di)], fwd_end[p][sr][si] + tt)
                if n in self.lockstep:
                    fwd_end[n], bwd_end[n], starts[n], stats[n] = self._lockstep_forwards(
                        n, need, not_before, start, k, trace, events
                    )
                    continue
                fe, be, busy, fin, st = [], [], [], [], []
                for r, mbs in enumerate(self.schedule.order[n]):
                    t, b = (float(start[n][r]) if start is not None else 0.0), 0.0
                    fe_r, be_r, st_r = [], [], []
                    for i in range(len(mbs)):
                        s0 = max(t, need.get((r, i), 0.0), not_before.get((n, r, i), 0.0))
                        st_r.append(s0)
                        f = self.fwd_s[n][r][i] * k
                        t = s0 + f
                        b += f
                        fe_r.append(t)
                        if trace:
                            events.append((n, r, "fwd", s0, t))
                        if roles[n] == "step":
                            bt = self.bwd_s[n][r][i] * k
                            if trace:
                                events.append((n, r, "bwd", t, t + bt))
                            t += bt
                            b += bt
                            be_r.append(t)
                    fe.append(fe_r)
                    be.append(be_r)
                    busy.append(b)
                    fin.append(t)
                    st.append(st_r)
                fwd_end[n], bwd_end[n], starts[n] = fe, be, st
                stats[n] = SectionStats(len(self.schedule.order[n]), busy, fin)
            return starts

        # a bounded frozen section's forwards wait for its consumers' receives, which depend on
        # its forwards: iterate to a fixed point (waits only grow, so this settles)
        not_before: dict[tuple[str, int, int], float] = {}
        for _ in range(50 if self.bounded else 1):
            events.clear()
            fwd_start = forwards(not_before)
            if not self.bounded:
                break
            new = _run_ahead_limits(
                self.bounded, self.schedule, self.where, consumers_of(self.sections), fwd_start
            )
            if new == not_before:
                break
            not_before = new

        # backwards of producer sections, as their gradients arrive; consumers first
        for n in reversed(order):
            if roles[n] != "producer":
                continue
            k = scale.get(n, 1.0)
            grad_at: dict[tuple[int, int], float] = {}
            for c in self.gcons[n]:
                for sr, si, dr, di, tt in self.msgs[(n, c)]:
                    grad_at[(sr, si)] = max(grad_at.get((sr, si), 0.0), bwd_end[c][dr][di] + tt)
            st = stats[n]
            if n in self.lockstep:
                bwd_end[n] = self._lockstep_backwards(n, grad_at, st, k, trace, events)
                continue
            be = []
            for r, mbs in enumerate(self.schedule.order[n]):
                t = st.finish[r]
                ends = [0.0] * len(mbs)
                todo = [(grad_at[(r, i)], i) for i in range(len(mbs)) if (r, i) in grad_at]
                if arrival_order:
                    todo.sort()
                for arrive, i in todo:
                    s0 = max(t, arrive)
                    bt = self.bwd_s[n][r][i] * k
                    t = s0 + bt
                    ends[i] = t
                    st.busy[r] += bt
                    if trace:
                        events.append((n, r, "bwd", s0, t))
                be.append(ends)
                st.finish[r] = t
            bwd_end[n] = be

        step = 0.0
        for n in order:
            st = stats[n]
            st.allreduce = self.allreduce.get(n, 0.0)
            step = max(step, max(st.finish, default=0.0) + st.allreduce)
        step += getattr(self.cm, "step_overhead", 0.0)
        return SimResult(step, self.num_samples, stats, events, world_size=self.world)

    def _lockstep_forwards(self, n, need, not_before, start, k, trace, events):
        """Forwards (and a step section's backwards) of a lockstep section: per shard group,
        index by index, every replica of the group starts when all of them are ready and
        takes as long as the slowest (the group's replicas have the same count, padded)."""
        reps = self.schedule.order[n]
        t = [float(start[n][r]) if start is not None else 0.0 for r in range(len(reps))]
        busy = [0.0] * len(reps)
        fe = [[] for _ in reps]
        be = [[] for _ in reps]
        st = [[] for _ in reps]
        step_role = self.roles[n] == "step"
        for grp in shard_groups(len(reps), self.lockstep[n]):
            num = len(self.fwd_s[n][grp[0]])
            assert all(len(self.fwd_s[n][r]) == num for r in grp), "group not padded"
            for i in range(num):
                s0 = max(
                    max(t[r], need.get((r, i), 0.0), not_before.get((n, r, i), 0.0)) for r in grp
                )
                f = {r: self.fwd_s[n][r][i] * k for r in grp}
                end = s0 + max(f.values())
                for r in grp:
                    st[r].append(s0)
                    fe[r].append(end)
                    busy[r] += f[r]
                    t[r] = end
                    if trace:
                        events.append((n, r, "fwd", s0, s0 + f[r]))
                if step_role:
                    bt = {r: self.bwd_s[n][r][i] * k for r in grp}
                    b_end = end + max(bt.values())
                    for r in grp:
                        be[r].append(b_end)
                        busy[r] += bt[r]
                        t[r] = b_end
                        if trace:
                            events.append((n, r, "bwd", end, end + bt[r]))
        return fe, be, st, SectionStats(len(reps), busy, list(t))

    def _lockstep_backwards(self, n, grad_at, st, k, trace, events):
        """A lockstep producer's backwards, in schedule order (padding last, needing no
        gradients), per shard group: each starts when every replica of the group has its
        gradients and lasts as long as the slowest."""
        reps = self.schedule.order[n]
        t = list(st.finish)
        be: list[list[float]] = [[] for _ in reps]
        for grp in shard_groups(len(reps), self.lockstep[n]):
            num = len(self.bwd_s[n][grp[0]])
            for r in grp:
                be[r] = [0.0] * num
            for i in range(num):
                s0 = max(max(t[r], grad_at.get((r, i), 0.0)) for r in grp)
                bt = {r: self.bwd_s[n][r][i] * k for r in grp}
                end = s0 + max(bt.values())
                for r in grp:
                    be[r][i] = end
                    st.busy[r] += bt[r]
                    t[r] = end
                    if trace:
                        events.append((n, r, "bwd", s0, s0 + bt[r]))
        st.finish = t
        return be


def _run_ahead_limits(bounded, schedule, where, consumers, fwd_start):
    """``(section, replica, mb) -> earliest forward start`` under each run-ahead bound.

    A frozen replica sends one message per micro-batch and consumer replica, in schedule
    order; a message is received when its consumer starts the first micro-batch needing it.
    Before forward ``k`` the runtime waits, oldest first, until at most ``B`` of the messages
    sent so far are unreceived, i.e. until all but the last ``B`` have been received.
    """
    out: dict[tuple[str, int, int], float] = {}
    for n, limit in bounded.items():
        for r, mbs in enumerate(schedule.order[n]):
            recv: list[float] = []  # receive time of every message sent so far, in order
            for k, mb in enumerate(mbs):
                if len(recv) > limit:
                    out[(n, r, k)] = max(recv[: len(recv) - limit])
                for c in consumers.get(n, ()):
                    first: dict[int, float] = {}  # consumer replica -> receive time
                    for s in mb.sample_ids:
                        if s in where[c]:
                            dr, di = where[c][s]
                            t = fwd_start[c][dr][di]
                            first[dr] = min(first.get(dr, t), t)
                    recv.extend(first.values())
    return out


def _simulate_colocated(m: StepModel, trace: bool, scale: Mapping[str, float]) -> SimResult:
    """Each rank runs whole-model micro-batches: every section forward, trainable ones backward.

    With a cost model that has a ``whole_model`` fit (measured in monolithic runs:
    ``maestro.sim.calibrate``), a micro-batch costs that fit on the features of all its
    samples, and the step's tail and overhead are the monolithic runtime's; the per-section
    statistics split the micro-batch's time in proportion to the sections' own fits.

    Lockstep (FSDP, ``lockstep_degree``) is the per-section rule applied to whole-model
    micro-batches: a section with degree ``k > 1`` syncs the ranks of each shard group (``k``
    consecutive ranks). Micro-batch ``i``'s forward (backward) of the section starts on every
    rank of the group when all of them are ready for it and lasts as long as the slowest; a
    rank of the group with no part in it (an empty part, or past its last micro-batch) runs a
    padding part of one sample (the first of the batch that activates the section, priced by
    the section's own fit). So the ranks of a group run the same number of whole-model
    micro-batches; ranks of different groups do not wait for each other before the tail.
    """
    schedule, cm, by_name = m.schedule, m.cm, m.by_name
    order = topo_order(m.sections)
    whole = getattr(cm, "whole_model", None)
    world = len(schedule.order[order[0]])
    counts = [len(schedule.order[order[0]][r]) for r in range(world)]
    busy = {n: [0.0] * world for n in order}
    events = []
    lock = {n: k for n in order if (k := lockstep_degree(cm, n)) > 1}
    pads: dict[str, tuple[float, float]] = {}  # lockstep section -> padding part (fwd, bwd)
    for n in lock:
        first = m.pad_sample.get(n)
        if first is None:
            continue  # no sample activates it: it never runs, so nothing to sync
        f1 = micro_batch_features([first.cost])
        k = scale.get(n, 1.0)
        pad_b = 0.0 if by_name[n].frozen else cm.backward_time(n, f1) * k
        pads[n] = (cm.forward_time(n, f1) * k, pad_b)
    t = [0.0] * world
    for i in range(max(counts, default=0)):
        fwd_r: list[dict[str, float]] = []
        bwd_r: list[dict[str, float]] = []
        for r in range(world):
            if i >= counts[r]:
                fwd_r.append({})
                bwd_r.append({})
                continue
            parts = {n: schedule.order[n][r][i].sample_ids for n in order}
            fs = {n: micro_batch_features(m.cost_of[s] for s in parts[n]) for n in order}
            fwd = {n: cm.forward_time(n, fs[n]) * scale.get(n, 1.0) for n in order if parts[n]}
            bwd = {
                n: cm.backward_time(n, fs[n]) * scale.get(n, 1.0)
                for n in fwd
                if not by_name[n].frozen
            }
            if whole is not None:
                ids = dict.fromkeys(s for n in order for s in parts[n])
                f_all, b_all = whole.times(micro_batch_features(m.cost_of[s] for s in ids))
                fwd = _spread(fwd, f_all)
                bwd = _spread(bwd, b_all)
            fwd_r.append(fwd)
            bwd_r.append(bwd)
        # FSDP's collectives need every rank of the shard group in the section's pass
        for n, (pf, pb) in pads.items():
            for grp in shard_groups(world, lock[n]):
                if any(n in fwd_r[r] for r in grp):
                    for r in grp:
                        if n not in fwd_r[r]:
                            fwd_r[r][n] = pf
                            if not by_name[n].frozen:
                                bwd_r[r][n] = pb
        for kind, seq, times in (("fwd", order, fwd_r), ("bwd", order[::-1], bwd_r)):
            for n in seq:
                if n in lock:
                    groups = shard_groups(world, lock[n])
                else:
                    groups = [[r] for r in range(world)]
                for grp in groups:
                    members = [r for r in grp if n in times[r]]
                    if not members:
                        continue
                    s0 = max(t[r] for r in members)
                    end = s0 + max(times[r][n] for r in members)
                    for r in members:
                        own = times[r][n]
                        if trace:
                            events.append((n, r, kind, s0, s0 + own))
                        busy[n][r] += own
                        t[r] = end
    finish = t
    if whole is not None:
        allreduce, overhead = whole.tail(world), whole.step_overhead
    else:
        same = world <= m.gpn
        allreduce = sum(cm.allreduce_time(n, world, same) for n in order if not by_name[n].frozen)
        overhead = getattr(cm, "step_overhead", 0.0)
    step = max(finish, default=0.0) + allreduce + overhead
    stats = {n: SectionStats(world, busy[n], list(finish), allreduce) for n in order}
    return SimResult(step, m.num_samples, stats, events, world_size=world)


def _spread(parts: dict[str, float], total: float) -> dict[str, float]:
    """``total`` split over ``parts``' keys in proportion to their values (evenly if all 0)."""
    if not parts:
        return parts
    s = sum(parts.values())
    if s <= 0:
        return {n: total / len(parts) for n in parts}
    return {n: total * v / s for n, v in parts.items()}
