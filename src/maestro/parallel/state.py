"""Layout-independent state of a sharded section: gather to full tensors, load from them.

A checkpoint holds a section's *full* module and optimizer state in the format of a plain
single-rank run (``module.state_dict()``, ``optimizer.state_dict()`` over the section's
parameters in ``module.parameters()`` order). Writing gathers every DTensor (FSDP, TP) and
every ZeRO-1 slice; loading shards the full tensors again for the new layout. So a
checkpoint taken under one layout resumes under any other (``fsdp = 2`` -> ``dp = 1``, ...),
and files keep today's atomic-manifest rule. Gathering is collective over the section's
ranks: every rank of the section calls these functions, in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full_tensor(t: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """The whole tensor on CPU: a DTensor gathered, or a plain local shard of a tensor laid out
    like DTensor ``like`` (ZeRO slices of TP shards), or a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    if _is_dtensor(t):
        t = t.full_tensor()
    elif like is not None and _is_dtensor(like) and t.shape == like.to_local().shape:
        t = DTensor.from_local(
            t, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
        ).full_tensor()
    return t.detach().cpu()


def shard_like(full: torch.Tensor, like: torch.Tensor, *, as_local: bool = False) -> torch.Tensor:
    """``full`` laid out like ``like`` (a DTensor with its placements, or its local shard when
    ``as_local``); ``like``'s device and, for floating tensors, dtype."""
    from torch.distributed.tensor import distribute_tensor

    dev = like.device if not _is_dtensor(like) else like.to_local().device
    full = full.to(dev, dtype=like.dtype if full.is_floating_point() else full.dtype)
    if not _is_dtensor(like):
        return full
    d = distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return d.to_local() if as_local else d


def full_module_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every tensor whole, on CPU (collective when sharded)."""
    return {k: full_tensor(v) for k, v in module.state_dict().items()}


def load_module_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into the (possibly sharded) module; ``ValueError`` on missing keys."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        raise ValueError(f"checkpoint lacks {', '.join(missing[:3])} (and {len(missing)} total)")
    with torch.no_grad():
        for k, t in own.items():
            src = shard_like(state[k], t, as_local=True)
            (t.to_local() if _is_dtensor(t) else t).copy_(src)


def full_optimizer_state(optimizer, params: Sequence[nn.Parameter]) -> dict:
    """The optimizer's ``state_dict()`` as one unsharded optimizer over ``params`` has it."""
    from maestro.parallel.zero import ZeroOptimizer

    sd = optimizer.local_state_dict() if isinstance(optimizer, ZeroOptimizer) else None
    sd = sd if sd is not None else optimizer.state_dict()
    state = {}
    for i in sorted(sd["state"]):
        p = params[i]
        state[i] = {
            k: (full_tensor(v, p) if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
            for k, v in sd["state"][i].items()
        }
    return {"state": state, "param_groups": sd["param_groups"]}


def load_optimizer_state(optimizer, params: Sequence[nn.Parameter], sd: dict) -> None:
    """Load what ``full_optimizer_state`` returned (under any layout) into ``optimizer``."""
    from maestro.parallel.zero import ZeroOptimizer

    zero = isinstance(optimizer, ZeroOptimizer)
    state = {}
    for i, st in sd["state"].items():
        p = params[int(i)]
        state[int(i)] = {
            k: (
                shard_like(v, p, as_local=zero)
                if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape)
                else v
            )
            for k, v in st.items()
        }
    full = {"state": state, "param_groups": sd["param_groups"]}
    if zero:
        optimizer.load_local_state_dict(full)
    else:
        optimizer.load_state_dict(full)
