"""Per-rank bytes of a section's training state: parameters, gradients, optimizer state.

Counts what this rank holds: the local shard of a DTensor (FSDP, TP), the whole of a plain
tensor; optimizer state tensors (AdamW moments; ZeRO-1: this replica's slice only). Scalars
such as AdamW's ``step`` count too (they are tiny). Activations are not included.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from maestro.parallel.grads import local


def _bytes(t: torch.Tensor) -> int:
    t = local(t)
    return t.numel() * t.element_size()


def state_bytes(params: Iterable[nn.Parameter], optimizer=None) -> dict[str, int]:
    """``{"params", "grads", "optimizer", "total"}`` bytes held by this rank."""
    params = list(params)
    out = {
        "params": sum(_bytes(p) for p in params),
        "grads": sum(_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": 0,
    }
    if optimizer is not None:
        for st in optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    out["optimizer"] += _bytes(v)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def optimizer_slots(optimizer) -> int:
    """Tensors of per-parameter state the optimizer will keep (before its first step):
    2 for the Adam family (two moments), 1 for SGD with momentum and anything unknown,
    0 for plain SGD."""
    if optimizer is None:
        return 0
    inner = getattr(optimizer, "optimizer", None)  # ZeroOptimizer wraps one
    name = type(inner if inner is not None else optimizer).__name__.lower()
    if "adam" in name:
        return 2
    if name == "sgd":
        groups = getattr(optimizer, "param_groups", [])
        return int(any(g.get("momentum", 0) for g in groups))
    return 1


def predicted_state_bytes(
    params: Iterable[nn.Parameter], optimizer=None, trainable: bool = True, zero: int = 1
) -> int:
    """Bytes of parameters, gradients and optimizer state this rank will hold once training
    runs: local shards, a gradient per trainable parameter, ``optimizer_slots`` copies of
    them divided by ``zero`` (ZeRO-1 replicas)."""
    held = sum(_bytes(p) for p in params)
    if not trainable:
        return held
    return held + held + optimizer_slots(optimizer) * held // max(zero, 1)
