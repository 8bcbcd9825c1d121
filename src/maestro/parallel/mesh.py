"""Section layouts (device-free rank arithmetic) and the DeviceMesh of each section.

A section's contiguous block of global ranks is arranged as a ``(dp, fsdp, pp, cp, tp)`` grid,
TP innermost (a TP group's ranks are neighbours, on one node when possible), then the
context-parallel group (``cp``: the ranks that share a replica's samples, each holding a share
of every sequence, ``maestro.parallel.cp``), then the pipeline stages of one replica (``pp``; a
replica's stages are neighbours too). A section with ``cp > 1`` and FSDP or TP gets a 4-D
mesh ``(dp, fsdp, cp, tp)``: FSDP shards and TP splits within one CP index, and the ``cp``
dimension is the group that sums gradients and exchanges keys and values. Each stage of a
pipelined section is laid out as a section of its own (``stage_layout``: the ranks at that
stage index, a ``(dp, fsdp, tp)`` grid), so FSDP and TP apply per stage unchanged. The data-parallel
coordinate of a rank, its *replica* in the schedule, is ``dp_index * fsdp + fsdp_index``, so
a *shard group* (one FSDP mesh row: the ``fsdp`` replicas of one ``dp_index``) is ``fsdp``
consecutive replicas, the simulator's ``maestro.schedule.timeline.shard_groups(dp * fsdp,
fsdp)``. FSDP's collectives run inside a shard group; HSDP's gradient sum across the ``dp``
shard groups is once per step (``maestro.parallel.apply``).

``build_meshes`` must run on every rank with the same layouts: ``DeviceMesh`` creates its
groups with ``new_group``, which every rank of the world calls in the same order, members or
not (torch 2.13: a rank outside a mesh gets ``get_coordinate() is None`` and no groups).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

DIMS = ("dp", "fsdp", "tp")
#: a section's mesh dimensions with context parallelism
DIMS_CP = ("dp", "fsdp", "cp", "tp")


@dataclass(frozen=True)
class SectionLayout:
    """Where one section's ranks sit in its ``dp x fsdp x tp`` grid.

    Args:
        name: section name.
        ranks: the section's global ranks, in grid order (TP fastest).
        dp: replica groups.
        fsdp: shard degree inside a replica group.
        tp: tensor-parallel degree.
    """

    name: str
    ranks: tuple[int, ...]
    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    #: pipeline stages per replica (``pp``); each stage is a TP group
    pp: int = 1
    #: context-parallel degree: the TP groups of one stage that share its samples
    cp: int = 1

    def __post_init__(self) -> None:
        n = self.dp * self.fsdp * self.pp * self.cp * self.tp
        if len(self.ranks) != n:
            pp = f" x pp {self.pp}" if self.pp > 1 else ""
            cp = f" x cp {self.cp}" if self.cp > 1 else ""
            raise ValueError(
                f"sections.{self.name}: dp {self.dp} x fsdp {self.fsdp}{pp}{cp} x tp "
                f"{self.tp} = {n} ranks, but the section has {len(self.ranks)}"
            )

    @property
    def num_replicas(self) -> int:
        """Data-parallel coordinates (``dp * fsdp``): the schedule's replicas."""
        return self.dp * self.fsdp

    @property
    def sharded(self) -> bool:
        """Whether parameters are DTensors (FSDP or TP), so a DeviceMesh is needed."""
        return self.fsdp > 1 or self.tp > 1

    def coordinate(self, rank: int) -> tuple[int, int, int]:
        """``(dp, fsdp, tp)`` indices of global ``rank`` (``ValueError`` if not in the section;
        its pipeline stage is ``stage_of``)."""
        try:
            i = self.ranks.index(rank)
        except ValueError:
            raise ValueError(f"rank {rank} is not in section {self.name!r}") from None
        per = self.pp * self.cp * self.tp
        return i // (self.fsdp * per), (i // per) % self.fsdp, i % self.tp

    def stage_of(self, rank: int) -> int:
        """The pipeline stage of ``rank`` (0 without ``pp``)."""
        return (self.ranks.index(rank) // (self.cp * self.tp)) % self.pp

    def cp_index(self, rank: int) -> int:
        """``rank``'s index in its CP group (0 without ``cp``)."""
        return (self.ranks.index(rank) // self.tp) % self.cp

    def cp_peers(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s CP group (same replica, stage and TP index), in CP order."""
        i = self.ranks.index(rank)
        base = i - self.cp_index(rank) * self.tp
        return [self.ranks[base + c * self.tp] for c in range(self.cp)]

    def cp_groups(self) -> list[list[int]]:
        """Every CP group of the section, in rank order."""
        seen, out = set(), []
        for r in self.ranks:
            if r not in seen:
                g = self.cp_peers(r)
                seen.update(g)
                out.append(g)
        return out

    def replica_of(self, rank: int) -> int:
        """The data-parallel coordinate (schedule replica) of ``rank``."""
        return self.ranks.index(rank) // (self.pp * self.cp * self.tp)

    def shard_group(self, replica: int) -> list[int]:
        """The replicas of ``replica``'s FSDP mesh row (its own ``dp`` index): the ``fsdp``
        consecutive replicas that run FSDP's collectives together (``[replica]`` without
        FSDP)."""
        d = replica // self.fsdp
        return list(range(d * self.fsdp, (d + 1) * self.fsdp))

    def shard_groups(self) -> list[list[int]]:
        """Every shard group, in order (``timeline.shard_groups(num_replicas, fsdp)``)."""
        return [self.shard_group(d * self.fsdp) for d in range(self.dp)]

    def replica_ranks(self, replica: int) -> list[int]:
        """The ranks that run ``replica`` (its TP groups; every stage's under ``pp``, every CP
        rank's under ``cp``): every one gets the replica's inputs from producer sections."""
        per = self.pp * self.cp * self.tp
        return list(self.ranks[replica * per : (replica + 1) * per])

    def stage_ranks(self, replica: int, stage: int, cp_index: int = 0) -> list[int]:
        """The TP group of pipeline stage ``stage`` of ``replica`` (at CP index
        ``cp_index``)."""
        base = (replica * self.pp + stage) * self.cp * self.tp + cp_index * self.tp
        return list(self.ranks[base : base + self.tp])

    def leader(self, replica: int) -> int:
        """The rank of ``replica`` that sends its outputs (TP index 0 of its last stage)."""
        return self.stage_ranks(replica, self.pp - 1)[0]

    def input_grad_leader(self, replica: int) -> int:
        """The rank of ``replica`` that sends its input gradients back to its producers (TP
        index 0 of its first stage; ``leader`` without ``pp``)."""
        return self.stage_ranks(replica, 0)[0]

    def output_ranks(self, replica: int) -> list[int]:
        """The ranks holding ``replica``'s outputs, which receive their gradients (its last
        stage's TP groups, every CP rank's)."""
        return [r for c in range(self.cp) for r in self.stage_ranks(replica, self.pp - 1, c)]

    def tp_peers(self, rank: int) -> list[int]:
        """The ranks that share ``rank``'s micro-batches at its stage (its TP group, itself
        included)."""
        return self.stage_ranks(self.replica_of(rank), self.stage_of(rank), self.cp_index(rank))

    def dp_peers(self, rank: int) -> list[int]:
        """Ranks holding the same shard (TP index, CP index and stage) in every replica
        (``rank``'s gradient-sum group across replicas)."""
        per = self.pp * self.cp * self.tp
        i = self.ranks.index(rank) % per
        return list(self.ranks[i::per])

    def stage_layout(self, stage: int) -> SectionLayout:
        """The ``(dp, fsdp, tp)`` layout (``(dp, fsdp, cp, tp)`` with ``cp``) of one pipeline
        stage's ranks (all replicas)."""
        ranks = [
            r
            for rep in range(self.num_replicas)
            for c in range(self.cp)
            for r in self.stage_ranks(rep, stage, c)
        ]
        return SectionLayout(self.name, tuple(ranks), self.dp, self.fsdp, self.tp, 1, self.cp)

    def pipeline_ranks(self, replica: int, tp_index: int, cp_index: int = 0) -> list[int]:
        """One rank per stage of ``replica`` at TP index ``tp_index`` (and CP index
        ``cp_index``), in stage order: the group that sums the stages' shared (non-block)
        gradients."""
        return [self.stage_ranks(replica, s, cp_index)[tp_index] for s in range(self.pp)]

    def grid(self) -> list[list[list[int]]]:
        """The ranks as nested ``[dp][fsdp][tp]`` lists (``[dp][fsdp][cp][tp]`` with ``cp``;
        a DeviceMesh's ``mesh``; one stage's ``stage_layout`` under ``pp``)."""
        assert self.pp == 1, "a pipelined section's meshes are its stages'"
        it = iter(self.ranks)
        if self.cp > 1:
            return [
                [
                    [[next(it) for _ in range(self.tp)] for _ in range(self.cp)]
                    for _ in range(self.fsdp)
                ]
                for _ in range(self.dp)
            ]
        return [
            [[next(it) for _ in range(self.tp)] for _ in range(self.fsdp)] for _ in range(self.dp)
        ]

    @property
    def dims(self) -> tuple[str, ...]:
        """The mesh dimension names of ``grid``."""
        return DIMS_CP if self.cp > 1 else DIMS


def section_layouts(config) -> dict[str, SectionLayout]:
    """Every section's layout from a ``TrainConfig`` (ranks from ``config.rank_layout()``)."""
    ranks = config.rank_layout()
    return {
        n: SectionLayout(
            n, tuple(ranks[n]), sc.dp, sc.fsdp, sc.tp, getattr(sc, "pp", 1), getattr(sc, "cp", 1)
        )
        for n, sc in config.sections.items()
    }


def build_meshes(layouts: Mapping[str, SectionLayout], device_type: str) -> dict:
    """``name -> DeviceMesh(dp, fsdp, tp)`` (``(dp, fsdp, cp, tp)`` with ``cp``) for every
    section that shards (FSDP or TP).

    Collective over the world: call on every rank with the same ``layouts`` (in the same
    order). Sections without FSDP or TP get no mesh (their replicas sum gradients with one
    flat all-reduce, as before).
    """
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    meshes = {}
    for name, lay in layouts.items():
        if lay.sharded:
            meshes[name] = DeviceMesh(
                device_type, torch.tensor(lay.grid(), dtype=torch.int), mesh_dim_names=lay.dims
            )
    return meshes


def build_section_mesh(layout: SectionLayout, device_type: str):
    """One section's ``DeviceMesh(dp, fsdp, tp)``; collective over the world (see
    ``build_meshes``)."""
    return build_meshes({layout.name: layout}, device_type)[layout.name]
