"""Prepare a section's module for its strategy: TP, then recompute, then FSDP2.

The order follows torch's composability rules (torchtitan's too): tensor parallelism turns
block weights into DTensors on the ``tp`` mesh dimension; activation checkpointing wraps each
block's forward; ``fully_shard`` then shards every block, and a ``SectionRoot`` holding the
module, over the ``fsdp`` dimension: one FSDP instance per shard group (a mesh row).

HSDP (``dp > 1`` with ``fsdp > 1``): the ``dp`` shard groups hold the same shards and each
runs only its own reduce-scatters (every micro-batch backward, summed into the sharded
gradients); the gradient SUM across shard groups is one all-reduce per step over the ``dp``
dimension (``Strategy.dp_group``, ``maestro.parallel.grads.allreduce_grads``, in the step's
tail, as the simulator prices it). The sum equals FSDP2's own 2-D HSDP with
``set_requires_all_reduce(False)`` on every backward but a rank's last; that one is not used
because shard groups are padded only to their own busiest replica
(``maestro.runtime.executor``) and so run different numbers of backwards: a shard group with
no micro-batch in a step would never reach the all-reduce FSDP2 issues inside a last backward
(a hang), and the groups would wait for each other mid-backward. Here every rank of the
``dp`` group calls it exactly once per step, after its last backward.

Why a ``SectionRoot``: a job's forward may touch its module in any way (the MLLM's calls
``module.tok`` and ``module.forward_embeds``, never ``module(...)``), while FSDP2 gathers the
root's parameters in the root's forward hook. The root wraps the whole section forward, so
everything outside the blocks is gathered once per micro-batch, however the job uses it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from maestro.parallel.mesh import SectionLayout


def transformer_blocks(module: nn.Module, spec=None, where: str = "section") -> list[nn.Module]:
    """The module's blocks (FSDP units, TP and recompute targets), in order, none nested.

    ``spec``: the section's ``maestro.Parallelism`` (its ``blocks``), else the defaults of
    ``maestro.parallel.spec.find_blocks`` (Maestro's ``Block``, Llama/Qwen2-style decoder
    layers, a Hugging Face model's ``_no_split_modules``, a ``ModuleList`` of identical
    blocks).
    """
    from maestro.parallel.spec import find_blocks

    return find_blocks(module, spec, where)


def module_tp_refusal(module: nn.Module, where: str = "section", spec=None) -> str | None:
    """Why ``parallelize_section`` refuses ``tp > 1`` for ``module`` at any degree (the
    message of ``maestro.parallel.tp.tp_refusal`` over its ``transformer_blocks``), or
    ``None`` when it can split it. The planner asks this of a workload's modules (built on
    the ``meta`` device) so that it never plans ``tp > 1`` the runtime refuses."""
    from maestro.parallel.tp import tp_refusal

    try:
        blocks = transformer_blocks(module, spec, where)
    except ValueError as e:
        return str(e)
    return tp_refusal(blocks, where, spec)


class SectionRoot(nn.Module):
    """The FSDP root of a section: ``forward(fn, samples, inputs) = fn(module, samples, inputs)``.

    Args:
        module: the section's module (kept as ``self.module``).
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, fn, samples, inputs):
        return fn(self.module, samples, inputs)


def apply_recompute(blocks: list[nn.Module], where: str = "section") -> None:
    """Activation checkpointing per block: the block keeps its input, recomputes its forward
    in the backward (non-reentrant ``torch.utils.checkpoint``; parameter names unchanged).
    ``ValueError`` naming ``where`` (the config table) when there is no block."""
    from torch.utils.checkpoint import checkpoint

    if not blocks:
        raise ValueError(
            f"{where}.recompute: the section's module has no block to checkpoint; declare its "
            "blocks: Section(..., parallel=maestro.Parallelism(blocks=[YourBlock]))"
        )

    from maestro.parallel.cp import keep_context

    for blk in blocks:
        inner = blk.forward

        def forward(*args, _inner=inner, **kwargs):
            # under context parallelism the recomputation (in the backward) runs ring
            # attention again, under the forward's context
            return checkpoint(keep_context(_inner), *args, use_reentrant=False, **kwargs)

        blk.forward = functools.wraps(inner)(forward)


def sum_gradients(root: nn.Module) -> None:
    """Make every FSDP unit under ``root`` SUM its gradients (FSDP2 averages by default; the
    loss is already divided by the global normaliser) and reduce zeros for unused parameters,
    so every rank issues the same collectives."""
    from torch.distributed.fsdp import FSDPModule

    for m in root.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
            m.set_reduce_scatter_unused_params(True, recurse=False)


def apply_fsdp(
    root: SectionRoot,
    blocks: list[nn.Module],
    mesh,
    *,
    reshard_after_forward: bool = True,
    mp_policy=None,
    frozen: bool = False,
) -> None:
    """``fully_shard`` each block, then ``root``, over ``mesh`` (the section's ``fsdp``
    dimension: one shard group).

    The root (embeddings, head: everything outside the blocks) stays gathered from its
    forward to its backward when trainable; a frozen section has no backward, so it reshards.
    """
    import warnings

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from maestro.parallel.tp import shard_placement

    # A section's per-sample outputs are slices of its micro-batch outputs (views), and FSDP2
    # warns that an in-place op on a view would drop its pre-backward hook. The root's outputs
    # only ever reach the executor, which reads them (losses, sends) and never writes them in
    # place; the user's forward runs inside the root, before the hook exists. The blocks' own
    # outputs still warn.
    warnings.filterwarnings(
        "ignore",
        message=r"FSDP2-wrapped module \((FSDP)?SectionRoot\) returned a view tensor",
        category=UserWarning,
    )

    kw = {
        "mesh": mesh,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "shard_placement_fn": shard_placement,
    }
    for blk in blocks:
        fully_shard(blk, reshard_after_forward=reshard_after_forward, **kw)
    # a trainable root's parameters are needed again right at the start of the backward
    fully_shard(root, reshard_after_forward=frozen, **kw)
    sum_gradients(root)


@dataclass
class Strategy:
    """How a section runs on this rank (what ``parallelize_section`` decided).

    Args:
        layout: the section's rank grid.
        mesh: its DeviceMesh (``None`` without FSDP and TP).
        root: the ``SectionRoot`` FSDP wraps (``None`` without FSDP).
        blocks: the transformer blocks found.
        pad: every replica of a shard group (``layout.shard_group``) runs the same number
            of micro-batches (FSDP collectives).
    """

    layout: SectionLayout
    mesh: object = None
    root: SectionRoot | None = None
    blocks: list | None = None
    pad: bool = False

    @property
    def dp_group(self):
        """The once-per-step gradient-sum group across the ``dp`` replica groups (ranks with
        the same ``fsdp`` and ``tp`` index): HSDP's all-reduce with FSDP, the replicas' sum
        without; ``None`` when ``dp == 1`` (FSDP's reduce-scatter is the whole sum)."""
        if self.layout.dp == 1 or self.mesh is None:
            return None
        return self.mesh["dp"].get_group()


def parallelize_section(
    section,
    sc,
    layout: SectionLayout,
    mesh,
    *,
    mixed_precision: torch.dtype | None = None,
    where: str = "section",
    blocks: list[nn.Module] | None = None,
) -> Strategy:
    """Apply the section config's strategy to ``section.module`` in place.

    Args:
        section: the ``maestro.sections.Section`` (its forward is routed through the FSDP
            root when ``fsdp > 1``).
        sc: its ``SectionConfig`` (``tp``, ``fsdp``, ``recompute``, ``reshard_after_forward``).
        layout: its rank grid.
        mesh: its ``DeviceMesh(dp, fsdp, tp)`` (``None`` when neither FSDP nor TP).
        mixed_precision: ``torch.bfloat16``: FSDP gathers bf16 parameters and reduces fp32
            gradients (``MixedPrecisionPolicy``); the fp32 master weights stay sharded.
        where: the config table, for error messages.
        blocks: the blocks to use (a pipeline stage's own, ``maestro.parallel.pipeline``);
            ``None``: ``transformer_blocks`` of the module.
    """
    module = section.module
    spec = getattr(section, "parallel", None)
    if blocks is None:
        blocks = transformer_blocks(module, spec, where)
    st = Strategy(layout=layout, mesh=mesh, blocks=blocks)
    if layout.tp > 1:
        if spec is not None and spec.parallelize is not None:
            spec.parallelize(module, mesh, layout)
        else:
            from maestro.parallel.tp import apply_tp

            apply_tp(blocks, mesh["tp"], where, spec)
    if sc.recompute and not section.frozen:
        apply_recompute(blocks, where)
    if layout.fsdp > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp = None
        if mixed_precision is not None and not section.frozen:
            mp = MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32)
        root = SectionRoot(module)
        # this rank's shard group only: the sum across the dp groups is the step's tail
        apply_fsdp(
            root,
            blocks,
            mesh["fsdp"],
            reshard_after_forward=sc.reshard_after_forward,
            mp_policy=mp,
            frozen=section.frozen,
        )
        forward = section._forward
        section._forward = lambda m, samples, inputs: root(forward, samples, inputs)
        st.root, st.pad = root, True
    return st
