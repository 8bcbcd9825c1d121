"""Sharded section checkpoints through ``torch.distributed.checkpoint`` (DCP).

``--checkpoint-format sharded``: instead of gathering whole tensors on one rank, every rank of
a sharded section (FSDP, TP, ZeRO-1) writes its own shards with ``dcp.save`` over the
section's process group into one directory per section and step (``step-N.SECTION/``,
written as ``.tmp-step-N.SECTION/`` and renamed when complete). A plain replicated section is
written by replica 0 alone (``no_dist``). Keys of the DCP state dict:

- ``model.FQN``: ``get_model_state_dict(module)`` (DTensors for FSDP2/TP parameters);
- ``optim.FQN.KEY``: the optimizer's per-parameter tensors, laid out like the parameter (a
  DTensor with the parameter's placements for FSDP2/TP). ZeRO-1's flat slices are first
  assembled into the parameter's (local) layout inside the DP group, so the checkpoint holds
  no ZeRO-specific layout and DCP reshards it into any other.

``maestro.pt`` (written by the section's first rank) holds what is not a tensor: the
trainable parameters' FQNs in optimizer order, the param groups, non-tensor optimizer state
and the layout that wrote it. Loading (``load_section``) builds the current layout's state
dicts (DTensors where the parameters are) and ``dcp.load`` reshards into them, so a
checkpoint taken under ``fsdp = 2`` resumes under ``dp = 1``; ``read_full`` reads whole
tensors in one process (the ``--monolithic`` resume and tests).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from maestro.serialization import safe_load

META = "maestro.pt"


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _packed(t) -> tuple[int, int] | None:
    """``(dim, parts)`` of a DTensor split with ``_StridedShard`` (TP's packed qkv: each rank
    holds ``[q_r; k_r; v_r]``), whose local shard is no single block of the global tensor."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    if not _is_dtensor(t):
        return None
    strided = [pl for pl in t.placements if isinstance(pl, _StridedShard)]
    if len(strided) != 1:
        return None
    d = strided[0].dim
    others = [pl for pl in t.placements if isinstance(pl, Shard) and pl is not strided[0]]
    if any(pl.dim == d for pl in others):
        return None
    return d, strided[0].split_factor


def _unfold(t, d: int, k: int):
    """DTensor ``t`` (``_StridedShard(d, k)``) viewed with dim ``d`` split into ``(k, n / k)``:
    then the strided split is a plain ``Shard(d + 1)``, which DCP can write and reshard; the
    local tensor is a view of ``t``'s (loading into it loads ``t``)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    loc = t.to_local()
    view = loc.view(*loc.shape[:d], k, loc.shape[d] // k, *loc.shape[d + 1 :])
    placements = [
        Shard(d + 1)
        if isinstance(pl, _StridedShard)
        else (Shard(pl.dim + 1) if isinstance(pl, Shard) and pl.dim > d else pl)
        for pl in t.placements
    ]
    shape = torch.Size([*t.shape[:d], k, t.shape[d] // k, *t.shape[d + 1 :]])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        view, t.device_mesh, placements, run_check=False, shape=shape, stride=stride
    )


def _fold(full: torch.Tensor, d: int) -> torch.Tensor:
    """Undo ``_unfold``'s split of dim ``d`` on a whole tensor."""
    return full.reshape(*full.shape[:d], full.shape[d] * full.shape[d + 1], *full.shape[d + 2 :])


def _fqns(module: nn.Module, params: Sequence[nn.Parameter]) -> list[str]:
    names = {id(p): n for n, p in module.named_parameters()}
    return [names[id(p)] for p in params]


def _optimizer_state(optimizer, params: Sequence[nn.Parameter]) -> dict:
    """``{"state": {i: {k: v}}, "param_groups": [...]}`` with every per-parameter tensor laid
    out like parameter ``i`` (collective over ZeRO's group)."""
    from torch.distributed.tensor import DTensor

    from maestro.parallel.zero import ZeroOptimizer

    if not isinstance(optimizer, ZeroOptimizer):
        return optimizer.state_dict()
    sd = optimizer.local_state_dict()  # slices gathered into the local shards' shape
    state = {}
    for i, st in sd["state"].items():
        p = params[i]
        out = {}
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and _is_dtensor(p):
                loc = p.to_local()
                v = DTensor.from_local(
                    v.to(loc.device),
                    p.device_mesh,
                    p.placements,
                    run_check=False,
                    shape=p.shape,
                    stride=p.stride(),
                )
            out[k] = v
        state[i] = out
    return {"state": state, "param_groups": sd["param_groups"]}


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_section(
    final: Path,
    module: nn.Module,
    optimizer,
    params: Sequence[nn.Parameter],
    *,
    group=None,
    layout: dict | None = None,
) -> None:
    """Write one section's shards into directory ``final`` (via a temp directory, renamed).

    With ``group`` every rank of the section calls this (collective); without, one rank
    writes everything (a replicated section's replica 0).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    final = Path(final)
    tmp = final.parent / f".tmp-{final.name}"
    first = group is None or dist.get_rank(group) == 0
    if first:
        for p in (tmp, final):  # left over by a crashed attempt (never a committed one)
            shutil.rmtree(p, ignore_errors=True)
        tmp.mkdir(parents=True)
    if group is not None:
        dist.barrier(group=group)
    sd = {f"model.{k}": v for k, v in get_model_state_dict(module).items()}
    meta = {"fqns": [], "param_groups": None, "nontensor": {}, "layout": layout or {}}
    if optimizer is not None:
        fqns = _fqns(module, params)
        osd = _optimizer_state(optimizer, params)
        meta["fqns"], meta["param_groups"] = fqns, osd["param_groups"]
        for i, st in osd["state"].items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    sd[f"optim.{fqns[i]}.{k}"] = v
                else:
                    meta["nontensor"].setdefault(fqns[i], {})[k] = v
    meta["packed"] = {}
    for key, v in list(sd.items()):
        pk = _packed(v)
        if pk is not None:
            sd[key] = _unfold(v, *pk)
            meta["packed"][key] = pk
    dcp.save(
        sd,
        storage_writer=dcp.FileSystemWriter(tmp),
        process_group=group,
        no_dist=group is None,
    )
    if first:  # dcp.save returned on the coordinator: every rank's files are in place
        with open(tmp / META, "wb") as f:
            torch.save(meta, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    if group is not None:
        dist.barrier(group=group)


def _metadata(path: Path):
    return dcp.FileSystemReader(path).read_metadata().state_dict_metadata


def _meta(path: Path) -> dict:
    return safe_load(Path(path) / META)


def _layout_str(lay: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in lay.items()) or "?"


def load_section(
    path: Path,
    module: nn.Module,
    optimizer,
    params: Sequence[nn.Parameter],
    *,
    where: str = "section",
    layout: dict | None = None,
) -> None:
    """Load directory ``path`` (written under any layout) into this rank's (possibly
    sharded) module and optimizer; DCP reads exactly the pieces this rank's shards need."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )

    from maestro.parallel.zero import ZeroOptimizer

    path = Path(path)
    md, meta = _metadata(path), _meta(path)
    msd = get_model_state_dict(module)
    dst: dict = {f"model.{k}": v for k, v in msd.items()}
    missing = sorted(k for k in dst if k not in md)
    if missing:
        raise ValueError(
            f"{where}: checkpoint {path.name} lacks {missing[0][6:]} (written under "
            f"{_layout_str(meta['layout'])}, loading under {_layout_str(layout or {})})"
        )
    fqns = _fqns(module, params) if optimizer is not None else []
    if optimizer is not None:
        if meta["param_groups"] is None:
            raise ValueError(f"checkpoint has no optimizer state for {where}")
        if meta["fqns"] != fqns:
            raise ValueError(
                f"{where}: checkpoint {path.name} has optimizer state for other parameters "
                f"(written under {_layout_str(meta['layout'])}, loading under "
                f"{_layout_str(layout or {})})"
            )
        index = {n: i for i, n in enumerate(fqns)}
        for key, m in md.items():
            if not key.startswith("optim.") or not isinstance(m, TensorStorageMetadata):
                continue
            fqn, _, k = key[len("optim.") :].rpartition(".")
            p = params[index[fqn]].detach()
            dt = m.properties.dtype
            if len(m.size) > 0 and m.size.numel() == p.numel():  # also packed (unfolded)
                dst[key] = torch.zeros_like(p, dtype=dt)  # a DTensor like p where p is one
            else:
                dst[key] = torch.zeros(tuple(m.size), dtype=dt)
    # packed (strided) tensors: DCP reshards the unfolded view when both layouts pack alike;
    # otherwise that tensor is read whole and cut locally (TP's qkv weights and moments only)
    packed_saved = meta.get("packed", {})
    into: dict = {}
    whole: dict = {}
    for key, v in dst.items():
        cur, saved = _packed(v), packed_saved.get(key)
        if saved is not None:
            saved = tuple(saved)
        if cur is not None and cur == saved:
            into[key] = _unfold(v, *cur)
        elif cur is not None or saved is not None:
            m = md[key]
            into[key] = torch.zeros(tuple(m.size), dtype=m.properties.dtype)
            whole[key] = saved
        else:
            into[key] = v
    dcp.load(into, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    for key, saved in whole.items():
        from maestro.parallel.state import shard_like

        full = into[key] if saved is None else _fold(into[key], saved[0])
        v = dst[key]
        with torch.no_grad():
            if _is_dtensor(v):
                v.to_local().copy_(shard_like(full, v, as_local=True))
            else:
                v.copy_(full.reshape(v.shape))
    set_model_state_dict(module, {k: dst[f"model.{k}"] for k in msd})
    if optimizer is None:
        return
    zero = isinstance(optimizer, ZeroOptimizer)
    state: dict[int, dict] = {}
    for key, v in dst.items():
        if key.startswith("optim."):
            fqn, _, k = key[len("optim.") :].rpartition(".")
            if zero and _is_dtensor(v):
                v = v.to_local()
            state.setdefault(index[fqn], {})[k] = v
    for fqn, st in meta["nontensor"].items():
        state.setdefault(index[fqn], {}).update(st)
    sd = {"state": state, "param_groups": meta["param_groups"]}
    if zero:
        optimizer.load_local_state_dict(sd)
    else:
        optimizer.load_state_dict(sd)


def read_full(path: Path) -> dict:
    """``{"module": state_dict, "optimizer": state_dict | None}`` with whole tensors, in a
    single-rank run's format (one process reads every shard)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    md, meta = _metadata(path), _meta(path)
    dst = {
        k: torch.zeros(tuple(m.size), dtype=m.properties.dtype)
        for k, m in md.items()
        if isinstance(m, TensorStorageMetadata)
    }
    dcp.load(dst, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    for key, (d, _k) in meta.get("packed", {}).items():
        dst[key] = _fold(dst[key], d)
    module = {k[len("model.") :]: v for k, v in dst.items() if k.startswith("model.")}
    if meta["param_groups"] is None:
        return {"module": module, "optimizer": None}
    index = {n: i for i, n in enumerate(meta["fqns"])}
    state: dict[int, dict] = {}
    for key, v in dst.items():
        if key.startswith("optim."):
            fqn, _, k = key[len("optim.") :].rpartition(".")
            state.setdefault(index[fqn], {})[k] = v
    for fqn, st in meta["nontensor"].items():
        state.setdefault(index[fqn], {}).update(st)
    return {"module": module, "optimizer": {"state": state, "param_groups": meta["param_groups"]}}
