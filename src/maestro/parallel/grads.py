"""Gradient reduction, global-norm clipping and finiteness for plain and DTensor parameters.

A section's parameters may mix plain tensors (replicated: embeddings and norms under TP) and
DTensors (TP shards; FSDP shards). The data-parallel SUM works on local shards (ranks with the
same TP index hold the same shard); the clipping norm is the norm of the *full* gradients,
each counted once however it is sharded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def allreduce_grads(params: Sequence[nn.Parameter], group) -> None:
    """SUM the gradients of ``params`` over ``group`` as one flat buffer of local shards.

    A parameter with no gradient on any member keeps ``grad = None`` (as in one process,
    where AdamW then leaves it alone); elsewhere a missing gradient counts as zeros.
    """
    from torch.distributed.tensor import DTensor

    if not params:
        return
    shards = [local(p.detach()) for p in params]
    grads = [None if p.grad is None else local(p.grad) for p in params]
    flat = torch.cat(
        [(g if g is not None else torch.zeros_like(s)).reshape(-1) for g, s in zip(grads, shards)]
        + [torch.tensor([g is not None for g in grads], dtype=shards[0].dtype)]
    )
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flags = flat[-len(params) :].tolist()
    off = 0
    for p, s, flag in zip(params, shards, flags):
        n = s.numel()
        if flag > 0:
            g = flat[off : off + n].view_as(s).clone()
            if isinstance(p, DTensor):
                g = DTensor.from_local(g, p.device_mesh, p.placements, run_check=False)
            p.grad = g
        else:
            p.grad = None
        off += n


def grads_finite(params: Sequence[nn.Parameter]) -> bool:
    """Whether every local gradient shard of ``params`` is finite (a guard all-reduces it)."""
    return all(bool(torch.isfinite(local(p.grad)).all()) for p in params if p.grad is not None)


def _is_shard(placement) -> bool:
    """``Shard`` or ``_StridedShard`` (whose ``is_shard()`` is false in torch 2.13)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return placement.is_shard() or isinstance(placement, _StridedShard)


def global_grad_norm(params: Sequence[nn.Parameter], mesh=None) -> torch.Tensor:
    """L2 norm of the full gradients of a section, each element counted once.

    Args:
        params: the section's parameters on this rank (plain or DTensor).
        mesh: the section's ``DeviceMesh`` (``None``: the gradients are whole and identical
            on every rank, the local norm is the norm). Each rank sums the squares of its
            local shards, weighted by how many distinct shards the parameter has; one scalar
            all-reduce per mesh dimension adds them up, and dividing by the number of ranks
            undoes the replication, so every rank gets the same norm.
    """
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is None:
            continue
        g = local(p.grad)
        sq = torch.linalg.vector_norm(g, 2.0, dtype=torch.float64).cpu() ** 2
        if mesh is not None:
            shards = 1
            for i, pl in enumerate(getattr(p.grad, "placements", ())):
                if _is_shard(pl):
                    shards *= p.grad.device_mesh.size(i)
            sq = sq * shards
        total = total + sq
    if mesh is not None:
        dev = local(params[0]).device if params else torch.device("cpu")
        total = total.to(dev)
        for dim in range(mesh.ndim):
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
        total = total.cpu() / mesh.size()
    return total.sqrt()


def clip_grads(params: Sequence[nn.Parameter], max_norm: float | None, mesh=None) -> float | None:
    """Scale gradients so their global L2 norm (``global_grad_norm``) is at most
    ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does; returns the norm before."""
    if max_norm is None:
        return None
    norm = float(global_grad_norm(params, mesh))
    coef = min(max_norm / (norm + 1e-6), 1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef)
    return norm
