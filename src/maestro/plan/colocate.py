"""Colocated section groups: several sections sharing the same devices, as one schedulable unit.

A layout is a partition of the sections into groups. A group of one section is the usual
disaggregated section (its own ranks). A group of several is colocated: its ``dp`` replicas
each hold every member (one shared ``tp``), every sample of the group stays on one replica,
and a replica runs its members one after another on the same device, each on its own
micro-batches (``micro_batch_size`` and recompute per member), with no transfer between
members. Grouping every section is the monolithic layout with per-section micro-batches;
grouping only some (e.g. the encoders with the LLM) gives the mixed layouts.

``merge`` turns a layout into an equivalent problem the schedulers and the simulator already
understand: each colocated group becomes one virtual section named ``"a+b"`` whose
micro-batch (``group_mbs`` samples) runs every member's share of it. ``GroupedCostModel``
times a group micro-batch as the sum of its members' chunks: a member with ``n`` of the
micro-batch's samples runs ``max(ceil(n / mbs), ceil(tokens / token_budget))`` chunks of equal
size. Equal-size chunks are exact for the analytical model's token-linear terms (its
efficiency curve makes a chunk's time ``flops * (positions + half_tokens) / positions``,
linear in positions for the linear FLOPs) and approximate only the attention term's split.
Each virtual sample carries its members' costs under ``"member/key"`` keys.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from maestro.costmodel import CostModel, Features
from maestro.schedule.graph import check_sections, topo_order
from maestro.schedule.types import SampleInfo, SectionSpec

SEP = "+"


def group_name(members: Sequence[str]) -> str:
    """The virtual section name of a group (its members joined by ``+``)."""
    return SEP.join(members)


def set_partitions(items: Sequence[str]) -> list[list[tuple[str, ...]]]:
    """Every partition of ``items`` into groups (Bell number many; members keep their order)."""
    items = list(items)
    if not items:
        return [[]]
    first, rest = items[0], items[1:]
    out = []
    for part in set_partitions(rest):
        out.append([(first,), *part])
        for k in range(len(part)):
            out.append(part[:k] + [(first, *part[k])] + part[k + 1 :])
    return out


def valid_groupings(sections: Sequence[SectionSpec]) -> list[list[tuple[str, ...]]]:
    """Partitions whose merged section graph has no cycle, each group in topological order.

    A group must be convex: a section outside it that consumes from it and feeds it back
    would need the group to run before and after itself.
    """
    order = topo_order(sections)
    pos = {n: i for i, n in enumerate(order)}
    out = []
    for part in set_partitions(order):
        groups = [tuple(sorted(g, key=pos.get)) for g in part]
        try:
            merged_specs(sections, groups, {g: 1 for g in groups}, {n: 1 for n in order})
        except ValueError:
            continue
        out.append(groups)
    return out


def merged_specs(
    sections: Sequence[SectionSpec],
    groups: Sequence[tuple[str, ...]],
    dp: Mapping[tuple[str, ...], int],
    mbs: Mapping[str, int],
    group_mbs: str = "max",
) -> list[SectionSpec]:
    """Section specs of the merged graph, in topological order.

    Args:
        sections: the real sections.
        groups: the layout's partition (each group in topological order).
        dp: replicas per group.
        mbs: micro-batch size per real section.
        group_mbs: a colocated group's micro-batch holds the ``"max"`` or ``"min"`` of its
            members' sizes. ``"max"`` suits a group that holds every section (its replicas
            get length-balanced shards and run every micro-batch back to back); in a mixed
            layout the scheduler balances replicas one micro-batch at a time, so ``"min"``
            keeps them fine-grained (a member's larger size is then capped by it).

    A group is frozen only if every member is, and has no token budget of its own (members
    chunk by theirs).
    """
    by_name = check_sections(sections)
    unit_of = {n: g for g in groups for n in g}
    if sorted(unit_of) != sorted(by_name) or sum(len(g) for g in groups) != len(by_name):
        raise ValueError(f"groups {list(groups)} are not a partition of {sorted(by_name)}")
    specs = []
    for g in groups:
        if len(g) == 1:
            (n,) = g
            s = by_name[n]
            ins = tuple(dict.fromkeys(group_name(unit_of[i]) for i in s.inputs))
            specs.append(replace(s, inputs=ins, dp=dp[g], micro_batch_size=mbs[n]))
            continue
        ins = tuple(
            dict.fromkeys(
                group_name(unit_of[i]) for n in g for i in by_name[n].inputs if i not in g
            )
        )
        specs.append(
            SectionSpec(
                group_name(g),
                inputs=ins,
                dp=dp[g],
                micro_batch_size=(min if group_mbs == "min" else max)(mbs[n] for n in g),
                frozen=all(by_name[n].frozen for n in g),
                token_budget=None,
            )
        )
    check_sections(specs)  # raises on a cycle (a non-convex group)
    order = topo_order(specs)
    pos = {n: i for i, n in enumerate(order)}
    return sorted(specs, key=lambda s: pos[s.name])


def merged_samples(
    samples: Sequence[SampleInfo], groups: Sequence[tuple[str, ...]]
) -> list[SampleInfo]:
    """The batch as the merged graph sees it: a sample activates a group if it activates any
    member, and carries each active member's costs as ``member/key`` (plus ``member/samples``
    and ``member/tokens_sq``)."""
    multi = [g for g in groups if len(g) > 1]
    out = []
    for s in samples:
        secs = set(s.sections)
        cost = dict(s.cost)
        for g in multi:
            active = [n for n in g if n in secs]
            if not active:
                continue
            secs -= set(active)
            secs.add(group_name(g))
            t = float(s.cost.get("tokens", 0.0))
            for n in active:
                cost[f"{n}/samples"] = 1.0
                cost[f"{n}/tokens_sq"] = t * t
                for k, v in s.cost.items():
                    cost[f"{n}/{k}"] = v
        out.append(SampleInfo(s.sample_id, frozenset(secs), cost))
    return out


class GroupedCostModel(CostModel):
    """A cost model over the merged graph: real sections pass through, groups sum members.

    Args:
        base: the layout's cost model over real sections (tp and recompute already applied).
        sections: the real section specs (``frozen``, ``inputs``, ``token_budget``).
        groups: the partition.
        mbs: micro-batch size per real section.
        splits: sub-replicas per group replica of a member on its own grid (``T / tp``,
            ``maestro.runtime.colocated``): each rank runs that share of the member's samples
            (default 1: every member on all of them).
    """

    def __init__(
        self,
        base: CostModel,
        sections: Sequence[SectionSpec],
        groups: Sequence[tuple[str, ...]],
        mbs: Mapping[str, int],
        splits: Mapping[str, int] | None = None,
    ):
        self.base = base
        self.splits = dict(splits or {})
        by_name = {s.name: s for s in sections}
        self.members = {group_name(g): g for g in groups if len(g) > 1}
        self.mbs = dict(mbs)
        self.budget = {n: s.token_budget for n, s in by_name.items()}
        self.trainable = {n: not s.frozen for n, s in by_name.items()}
        unit_of = {n: g for g in groups for n in g}
        # members whose outputs leave their group (they are what a group sends)
        self.senders = {
            name: [n for n in g if any(n in s.inputs and unit_of[s.name] != g for s in sections)]
            for name, g in self.members.items()
        }
        for attr in ("gpu", "step_overhead"):
            if hasattr(base, attr):
                setattr(self, attr, getattr(base, attr))

    def lockstep(self, section: str) -> int:
        """A group's members share its replicas: the group runs in lockstep as far as its
        most sharded member does (the base model's ``lockstep``, per member)."""
        base = getattr(self.base, "lockstep", None)
        if base is None:
            return 0
        if section not in self.members:
            return int(base(section))
        return max((int(base(n)) for n in self.members[section]), default=0)

    def _chunks(self, group: str, feats: Features, members=None):
        """``(member, chunks, features of one chunk)`` for every member with samples."""
        for n in members if members is not None else self.members[group]:
            split = self.splits.get(n, 1)
            num = feats.get(f"{n}/samples", 0.0) / split
            if num <= 0:
                continue
            own = {k.split("/", 1)[1]: v / split for k, v in feats.items() if k.startswith(n + "/")}
            k = math.ceil(num / self.mbs[n] - 1e-9)
            if self.budget[n]:
                k = max(k, math.ceil(own.get("tokens", 0.0) / self.budget[n] - 1e-9))
            k = max(k, 1)
            yield n, k, {key: v / k for key, v in own.items()}

    def forward_time(self, section: str, feats: Features) -> float:
        if section not in self.members:
            return self.base.forward_time(section, feats)
        return sum(k * self.base.forward_time(n, f) for n, k, f in self._chunks(section, feats))

    def backward_time(self, section: str, feats: Features) -> float:
        if section not in self.members:
            return self.base.backward_time(section, feats)
        return sum(
            k * self.base.backward_time(n, f)
            for n, k, f in self._chunks(section, feats)
            if self.trainable[n]
        )

    def transfer_time(self, producer: str, feats: Features, same_node: bool) -> float:
        if producer not in self.members:
            return self.base.transfer_time(producer, feats, same_node)
        # every sending member's outputs (each message's latency counted per member: a small
        # over-estimate when two members send to the same consumer)
        return sum(
            self.base.transfer_time(n, {key: v * k for key, v in f.items()}, same_node)
            for n, k, f in self._chunks(producer, feats, self.senders[producer])
        )

    def allreduce_time(self, section: str, dp: int, same_node: bool) -> float:
        if section not in self.members:
            return self.base.allreduce_time(section, dp, same_node)
        return sum(
            self.base.allreduce_time(n, dp, same_node)
            for n in self.members[section]
            if self.trainable[n]
        )


__all__ = [
    "GroupedCostModel",
    "group_name",
    "merged_samples",
    "merged_specs",
    "set_partitions",
    "valid_groupings",
]
