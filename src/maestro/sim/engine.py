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

Transfers are latency plus bytes over the link bandwidth (NVLink inside a node, the network
across nodes); link contention is not modelled. Ranks are assigned to sections in
topological order, consecutively, ``gpus_per_node`` to a node.
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
    by_name = check_sections(sections)
    begin = start  # the name is reused for event starts below
    if gpus_per_node is None:
        gpu = getattr(cost_model, "gpu", None)
        gpus_per_node = getattr(gpu, "gpus_per_node", 8)
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    cost_of = {s.sample_id: s.cost for s in samples}
    if schedule.colocated:
        if start is not None:
            raise ValueError("start times are not supported for colocated schedules")
        return _simulate_colocated(schedule, sections, cost_model, cost_of, gpus_per_node, trace)

    order = topo_order(sections)
    gcons = grad_consumers(sections)
    roles = {n: role(by_name[n], gcons) for n in order}
    first_rank, r0 = {}, 0
    for n in order:
        first_rank[n] = r0
        r0 += len(schedule.order[n])

    def node(n: str, r: int) -> int:
        return (first_rank[n] + r) // gpus_per_node

    where: dict[str, dict[int, tuple[int, int]]] = {
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
            [micro_batch_features(cost_of[s] for s in mb.sample_ids) for mb in mbs]
            for mbs in schedule.order[n]
        ]
        for n in order
    }
    fwd_end: dict[str, list[list[float]]] = {}
    bwd_end: dict[str, list[list[float]]] = {}
    stats: dict[str, SectionStats] = {}
    events: list[tuple[str, int, str, float, float]] = []

    def messages(prod: str, cons: str, grads: bool):
        """Arrival of each coalesced message between ``(prod replica, mb)`` and ``(cons replica,
        mb)``: outputs after the producer's forward, or gradients after the consumer's backward.
        Both are sized by the producer's output shape."""
        groups: dict[tuple[int, int, int, int], list[int]] = defaultdict(list)
        for s, (dr, di) in where[cons].items():
            if s in where[prod]:
                sr, si = where[prod][s]
                groups[(sr, si, dr, di)].append(s)
        arrive: dict[tuple[int, int, int, int], float] = {}
        for key, ss in groups.items():
            sr, si, dr, di = key
            same = node(prod, sr) == node(cons, dr)
            f = micro_batch_features(cost_of[s] for s in ss)
            sent = bwd_end[cons][dr][di] if grads else fwd_end[prod][sr][si]
            arrive[key] = sent + cost_model.transfer_time(prod, f, same)
        return arrive

    def forwards(not_before: dict[tuple[str, int, int], float]) -> dict[str, list[list[float]]]:
        """Forwards (and the backwards of step sections), producers first; forward starts."""
        starts: dict[str, list[list[float]]] = {}
        for n in order:
            sec = by_name[n]
            need: dict[tuple[int, int], float] = defaultdict(float)  # (replica, mb) -> ready
            for p in sec.inputs:
                for (_, _, dr, di), t in messages(p, n, grads=False).items():
                    need[(dr, di)] = max(need[(dr, di)], t)
            fe, be, busy, fin, st = [], [], [], [], []
            for r, mbs in enumerate(schedule.order[n]):
                t, b = (float(begin[n][r]) if begin is not None else 0.0), 0.0
                fe_r, be_r, st_r = [], [], []
                for i in range(len(mbs)):
                    start = max(t, need.get((r, i), 0.0), not_before.get((n, r, i), 0.0))
                    st_r.append(start)
                    f = cost_model.forward_time(n, feats[n][r][i])
                    t = start + f
                    b += f
                    fe_r.append(t)
                    if trace:
                        events.append((n, r, "fwd", start, t))
                    if roles[n] == "step":
                        bt = cost_model.backward_time(n, feats[n][r][i])
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
            stats[n] = SectionStats(len(schedule.order[n]), busy, fin)
        return starts

    # a bounded frozen section's forwards wait for its consumers' receives, which depend on
    # its forwards: iterate to a fixed point (waits only grow, so this settles)
    bounded = {
        n: by_name[n].max_in_flight
        for n in order
        if by_name[n].frozen and by_name[n].max_in_flight is not None
    }
    not_before: dict[tuple[str, int, int], float] = {}
    for _ in range(50 if bounded else 1):
        events.clear()
        fwd_start = forwards(not_before)
        if not bounded:
            break
        new = _run_ahead_limits(bounded, schedule, where, consumers_of(sections), fwd_start)
        if new == not_before:
            break
        not_before = new

    # backwards of producer sections, as their gradients arrive; consumers first
    for n in reversed(order):
        if roles[n] != "producer":
            continue
        grad_at: dict[tuple[int, int], float] = {}
        for c in gcons[n]:
            for (sr, si, _, _), t in messages(n, c, grads=True).items():
                grad_at[(sr, si)] = max(grad_at.get((sr, si), 0.0), t)
        st = stats[n]
        be = []
        for r, mbs in enumerate(schedule.order[n]):
            t = st.finish[r]
            ends = [0.0] * len(mbs)
            if arrival_order:
                todo = sorted((grad_at[(r, i)], i) for i in range(len(mbs)) if (r, i) in grad_at)
            else:
                todo = [(grad_at[(r, i)], i) for i in range(len(mbs)) if (r, i) in grad_at]
            for arrive, i in todo:
                start = max(t, arrive)
                bt = cost_model.backward_time(n, feats[n][r][i])
                t = start + bt
                ends[i] = t
                st.busy[r] += bt
                if trace:
                    events.append((n, r, "bwd", start, t))
            be.append(ends)
            st.finish[r] = t
        bwd_end[n] = be

    step = 0.0
    for n in order:
        st = stats[n]
        if not by_name[n].frozen:
            ranks = len(schedule.order[n])
            same = node(n, 0) == node(n, ranks - 1)
            st.allreduce = cost_model.allreduce_time(n, ranks, same)
        step = max(step, max(st.finish, default=0.0) + st.allreduce)
    step += getattr(cost_model, "step_overhead", 0.0)
    return SimResult(step, len(samples), stats, events, world_size=r0)


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


def _simulate_colocated(schedule, sections, cost_model, cost_of, gpus_per_node, trace):
    order = topo_order(sections)
    by_name = {s.name: s for s in sections}
    world = len(schedule.order[order[0]])
    busy = {n: [0.0] * world for n in order}
    finish = [0.0] * world
    events = []
    for r in range(world):
        t = 0.0
        for i in range(len(schedule.order[order[0]][r])):
            parts = {n: schedule.order[n][r][i].sample_ids for n in order}
            fs = {n: micro_batch_features(cost_of[s] for s in parts[n]) for n in order}
            for n in order:
                if parts[n]:
                    f = cost_model.forward_time(n, fs[n])
                    if trace:
                        events.append((n, r, "fwd", t, t + f))
                    t += f
                    busy[n][r] += f
            for n in reversed(order):
                if parts[n] and not by_name[n].frozen:
                    b = cost_model.backward_time(n, fs[n])
                    if trace:
                        events.append((n, r, "bwd", t, t + b))
                    t += b
                    busy[n][r] += b
        finish[r] = t
    same = world <= gpus_per_node
    allreduce = sum(
        cost_model.allreduce_time(n, world, same) for n in order if not by_name[n].frozen
    )
    step = max(finish, default=0.0) + allreduce + getattr(cost_model, "step_overhead", 0.0)
    stats = {n: SectionStats(world, busy[n], list(finish), allreduce) for n in order}
    return SimResult(step, len(cost_of), stats, events, world_size=world)
