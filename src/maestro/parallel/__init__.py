"""Parallel strategies inside a section: meshes, FSDP2, tensor parallel, ZeRO-1, recompute.

A section's ranks form a ``dp x fsdp x tp`` mesh (``mesh``). Its module is prepared once per
rank by ``apply.parallelize_section``: DTensor tensor parallelism with the plans of ``tp``,
activation checkpointing per block (``recompute``), FSDP2 ``fully_shard`` per block then the
root (``fsdp``); a ZeRO-1 optimizer (``zero``) shards optimizer state across the replicas
instead. ``grads`` reduces and clips gradients of plain and DTensor parameters alike;
``memory`` accounts the per-rank bytes of parameters, gradients and optimizer state.

The schedulers never import this package: they see ``dp * fsdp`` replicas per section
(``SectionSpec.dp``) and the ranks of a replica are ``mesh.SectionLayout.replica_ranks``.
"""

from maestro.parallel.mesh import SectionLayout, build_meshes, section_layouts

__all__ = ["SectionLayout", "build_meshes", "section_layouts"]
