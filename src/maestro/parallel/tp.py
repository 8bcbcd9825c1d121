"""Tensor-parallel plans (DTensor ``parallelize_module``) for the blocks Maestro knows.

- The project's ``workloads.layers.Block``: ``qkv`` column-wise, ``proj`` row-wise, ``fc1``
  column-wise, ``fc2`` row-wise. ``qkv`` packs q, k and v in one ``Linear`` (rows
  ``[q; k; v]``, each ``heads x head_dim``), so a plain column split would hand rank 0 all of
  q and half of k. ``PackedColwise`` shards each of the three parts separately
  (``_StridedShard(0, split_factor=3)``): rank r holds ``[q_r; k_r; v_r]``, whole heads, and
  the DTensor's global view keeps the original layout (state dicts and checkpoints are
  unchanged). Its bias stays replicated (a few numbers). Under FSDP such a weight is sharded
  along dim 1 (``shard_placement``): a second strided split of dim 0 assembles wrongly in
  ``full_tensor()`` in torch 2.13.
- Hugging Face Llama/Qwen2-style decoder layers (``self_attn.{q,k,v,o}_proj``,
  ``mlp.{gate,up,down}_proj``): q/k/v and gate/up column-wise, o and down row-wise. Their
  attention infers the local head count from the projection's width.

Everything else (embeddings, norms, LM head) stays a plain, replicated tensor: every TP rank
computes it on the same inputs and gets the same gradient, so no reduction over TP is needed.
Column-wise inputs are all-reduced in the backward (the input gradient is a partial sum).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from maestro.parallel.spec import (
    HF_ATTN,
    HF_MLP,
    Parallelism,
    check_user_plan,
    is_hf_decoder_layer,
    user_plan,
)


def _replicated_input(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; in the backward the (partial) input gradient is summed over ``mesh``."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(
        grad_placements=[Partial()]
    )


class PackedColwise(ParallelStyle):
    """Column-wise split of a ``Linear`` whose outputs pack ``parts`` equal blocks (q, k, v).

    Each block is split into ``tp`` contiguous chunks and rank r keeps chunk r of every block,
    so a packed qkv projection yields whole heads of q, k and v on each rank. Input: the
    replicated activation (a plain tensor); output: this rank's ``out_features / tp`` columns
    (a plain tensor).

    Args:
        parts: packed blocks along the output dimension (3 for q, k, v).
    """

    def __init__(self, parts: int = 3) -> None:
        super().__init__()
        self.parts = parts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise ValueError(f"PackedColwise needs an nn.Linear, got {type(module).__name__}")
        tp = device_mesh.size()
        if module.out_features % (self.parts * tp):
            raise ValueError(
                f"PackedColwise: out_features {module.out_features} must divide into "
                f"{self.parts} parts x tp {tp}"
            )
        placement = _StridedShard(0, split_factor=self.parts) if self.parts > 1 else Shard(0)
        w = module.weight
        d = distribute_tensor(w.data, device_mesh, [placement], src_data_rank=None)
        module.weight = nn.Parameter(d, requires_grad=w.requires_grad)
        parts, r = self.parts, device_mesh.get_local_rank()

        def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            b = self.bias
            if b is not None:
                # the bias stays a plain replicated tensor (FSDP cannot shard a 1-D strided
                # DTensor again, torch 2.13); each rank adds its rows, and the rows' gradients
                # are summed over TP so every rank holds the whole (identical) bias gradient
                b = _replicated_input(b, device_mesh).view(parts, tp, -1)[:, r].reshape(-1)
            return F.linear(_replicated_input(x, device_mesh), self.weight.to_local(), b)

        module.forward = types.MethodType(forward, module)
        return module


def block_plan() -> dict[str, ParallelStyle]:
    """The plan of ``maestro.workloads.layers.Block``."""
    return {
        "qkv": PackedColwise(3),
        "proj": RowwiseParallel(),
        "fc1": ColwiseParallel(),
        "fc2": RowwiseParallel(),
    }


def hf_decoder_layer_plan(layer: nn.Module) -> dict[str, ParallelStyle]:
    """The plan of a Llama/Qwen2-style decoder layer (only the projections it has)."""
    plan: dict[str, ParallelStyle] = {}
    for n in HF_ATTN:
        if hasattr(layer.self_attn, n):
            plan[f"self_attn.{n}"] = RowwiseParallel() if n == "o_proj" else ColwiseParallel()
    for n in HF_MLP:
        if hasattr(layer.mlp, n):
            plan[f"mlp.{n}"] = RowwiseParallel() if n == "down_proj" else ColwiseParallel()
    return plan


def plan_for(block: nn.Module) -> dict[str, ParallelStyle] | None:
    """The TP plan of a transformer block, or ``None`` when Maestro has none for its type."""
    from maestro.workloads.layers import Block

    if isinstance(block, Block):
        return block_plan()
    if is_hf_decoder_layer(block):
        return hf_decoder_layer_plan(block)
    return None


def plan_of(block: nn.Module, spec: Parallelism | None) -> dict[str, ParallelStyle] | None:
    """The TP plan of ``block``: the declaration's, else Maestro's own (``None``: none)."""
    if spec is not None and spec.tp_plan is not None:
        return user_plan(block, spec)
    return plan_for(block)


def _check_divisible(block: nn.Module, tp: int, where: str) -> None:
    from maestro.workloads.layers import Block

    if isinstance(block, Block):
        heads, width = block.heads, block.fc1.out_features
    else:
        cfg = getattr(block.self_attn, "config", None)
        heads = getattr(cfg, "num_attention_heads", tp)
        kv = getattr(cfg, "num_key_value_heads", heads) or heads
        if kv % tp:
            raise ValueError(f"{where}.tp must divide num_key_value_heads={kv}, got {tp}")
        width = block.mlp.down_proj.in_features
    if heads % tp:
        raise ValueError(f"{where}.tp must divide the attention heads ({heads}), got {tp}")
    if width % tp:
        raise ValueError(f"{where}.tp must divide the MLP width ({width}), got {tp}")


def tp_refusal(blocks: list[nn.Module], where: str = "section", spec=None) -> str | None:
    """Why ``apply_tp`` refuses ``blocks`` at every ``tp > 1`` (its one-line ``ValueError``
    message, naming ``where``), or ``None`` when each block has a plan (the section's
    ``maestro.Parallelism`` ``spec``, else ``plan_for``) that fits it.

    The one rule of which sections may be tensor-parallel at all: the runtime applies it in
    ``apply_tp``, the planner asks it of a workload's modules (``maestro.parallel.apply.
    module_tp_refusal``) before it gives a section ``tp > 1``. Degree-specific checks (heads
    and widths dividing by ``tp``) come on top, in ``apply_tp``. A ``spec.parallelize``
    function is never refused ahead: it raises its own errors.
    """
    if spec is not None and spec.parallelize is not None:
        return None
    if not blocks:
        return (
            f"{where}.tp: the section's module has no transformer block to split; declare "
            "its blocks and TP plan: Section(..., parallel=maestro.Parallelism(blocks=..., "
            "tp_plan=...))"
        )
    for blk in blocks:
        plan = plan_of(blk, spec)
        if plan is None:
            return (
                f"{where}.tp: no tensor-parallel plan for {type(blk).__name__} (Maestro has "
                "plans for its Block and Llama/Qwen2-style decoder layers; give yours: "
                "maestro.Parallelism(tp_plan=...))"
            )
        if spec is not None and spec.tp_plan is not None:
            try:
                check_user_plan(blk, plan, spec, 1, where)
            except ValueError as e:
                return str(e)
    return None


def apply_tp(
    blocks: list[nn.Module], tp_mesh: DeviceMesh, where: str = "section", spec=None
) -> None:
    """Parallelise every block in place over the 1-D ``tp_mesh``.

    ``ValueError`` (naming ``where``, the config table) when there is no block, a block has
    no plan (``tp_refusal``) or its heads or widths do not divide by the TP degree.
    """
    tp = tp_mesh.size()
    why = tp_refusal(blocks, where, spec)
    if why is not None:
        raise ValueError(why)
    user = spec is not None and spec.tp_plan is not None
    for blk in blocks:
        plan = plan_of(blk, spec)
        if user:
            check_user_plan(blk, plan, spec, tp, where)
        else:
            _check_divisible(blk, tp, where)
        parallelize_module(blk, tp_mesh, plan, src_data_rank=None)


def shard_placement(param: nn.Parameter):
    """FSDP2 ``shard_placement_fn``: dim 1 for a weight TP already splits strided on dim 0
    (see the module docstring), FSDP's default (dim 0) otherwise."""
    if isinstance(param, DTensor) and param.ndim >= 2:
        if any(isinstance(pl, _StridedShard) and pl.dim == 0 for pl in param.placements):
            return Shard(1)
    return None
