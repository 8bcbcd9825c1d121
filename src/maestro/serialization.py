"""Loading the files Maestro writes without running code from them (checkpoints, DCP
metadata): one function every loader goes through, below the runtime and the parallel
strategies that both read such files."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch


def safe_load(path: str | Path) -> object:
    """``torch.load`` of a file Maestro wrote, refusing anything that could run code.

    Loads with ``weights_only=True``: tensors, containers and plain scalars only (what
    Maestro writes: module and optimizer state dicts, RNG states, its own records).
    A checkpoint from someone else that pickles a callable would otherwise execute it
    on load, so such a file raises ``ValueError`` naming it and nothing in it runs.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        why = next((ln for ln in first if "GLOBAL" in ln or "Unsupported" in ln), "")
        raise ValueError(
            f"refusing to load checkpoint file {path}: it needs objects beyond tensors and "
            f"plain containers, which could run code ({why.strip() or 'unsafe pickle'})"
        ) from None
