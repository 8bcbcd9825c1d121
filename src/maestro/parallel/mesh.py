"""Section layouts (device-free rank arithmetic) and the DeviceMesh of each section.

A section's contiguous block of global ranks is arranged as a ``(dp, fsdp, tp)`` grid, TP
innermost (a TP group's ranks are neighbours, on one node when possible). The data-parallel
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

    def __post_init__(self) -> None:
        if len(self.ranks) != self.dp * self.fsdp * self.tp:
            raise ValueError(
                f"sections.{self.name}: dp {self.dp} x fsdp {self.fsdp} x tp {self.tp} = "
                f"{self.dp * self.fsdp * self.tp} ranks, but the section has {len(self.ranks)}"
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
        """``(dp, fsdp, tp)`` indices of global ``rank`` (``ValueError`` if not in the section)."""
        try:
            i = self.ranks.index(rank)
        except ValueError:
            raise ValueError(f"rank {rank} is not in section {self.name!r}") from None
        return i // (self.fsdp * self.tp), (i // self.tp) % self.fsdp, i % self.tp

    def replica_of(self, rank: int) -> int:
        """The data-parallel coordinate (schedule replica) of ``rank``."""
        return self.ranks.index(rank) // self.tp

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
        """The TP group that runs ``replica``: every rank gets its inputs."""
        return list(self.ranks[replica * self.tp : (replica + 1) * self.tp])

    def leader(self, replica: int) -> int:
        """The rank of ``replica`` that sends its outputs and input gradients (TP index 0)."""
        return self.ranks[replica * self.tp]

    def tp_peers(self, rank: int) -> list[int]:
        """The ranks that share ``rank``'s micro-batches (its TP group, itself included)."""
        return self.replica_ranks(self.replica_of(rank))

    def dp_peers(self, rank: int) -> list[int]:
        """Ranks holding the same TP shard in every replica (``rank``'s gradient-sum group)."""
        t = self.ranks.index(rank) % self.tp
        return list(self.ranks[t :: self.tp])

    def grid(self) -> list[list[list[int]]]:
        """The ranks as nested ``[dp][fsdp][tp]`` lists (a DeviceMesh's ``mesh``)."""
        it = iter(self.ranks)
        return [
            [[next(it) for _ in range(self.tp)] for _ in range(self.fsdp)] for _ in range(self.dp)
        ]


def section_layouts(config) -> dict[str, SectionLayout]:
    """Every section's layout from a ``TrainConfig`` (ranks from ``config.rank_layout()``)."""
    ranks = config.rank_layout()
    return {
        n: SectionLayout(n, tuple(ranks[n]), sc.dp, sc.fsdp, sc.tp)
        for n, sc in config.sections.items()
    }


def build_meshes(layouts: Mapping[str, SectionLayout], device_type: str) -> dict:
    """``name -> DeviceMesh(dp, fsdp, tp)`` for every section that shards (FSDP or TP).

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
                device_type, torch.tensor(lay.grid(), dtype=torch.int), mesh_dim_names=DIMS
            )
    return meshes


def build_section_mesh(layout: SectionLayout, device_type: str):
    """One section's ``DeviceMesh(dp, fsdp, tp)``; collective over the world (see
    ``build_meshes``)."""
    return build_meshes({layout.name: layout}, device_type)[layout.name]
