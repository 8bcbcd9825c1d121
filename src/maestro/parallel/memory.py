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
