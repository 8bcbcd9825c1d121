"""How a user's section is parallelised: its blocks, its tensor-parallel plan, or a function.

One declaration (``Parallelism``) serves every strategy Maestro applies to a section: the
*blocks* are FSDP's units (one ``fully_shard`` each), recompute's units (one checkpoint each)
and tensor parallelism's targets; the *TP plan* says how each block splits, in torch's
``parallelize_module`` style (a dict from submodule path to a ``ParallelStyle``); a
``parallelize`` function replaces the TP step altogether, as torchtitan's per-model
``parallelize.py`` does. A section without a declaration gets the defaults of
``find_blocks``::

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from maestro import Parallelism, Section

    Section(
        "student",
        lambda: MyTransformer(...),
        parallel=Parallelism(
            blocks=[MyBlock],                       # classes, class names, or a function
            tp_plan={
                "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                "attn.v": ColwiseParallel(), "attn.o": RowwiseParallel(),
                "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(),
            },
            tp_divides=["n_heads"],                 # block attributes tp must divide
        ),
    )

A block under a TP plan sees the local shard of every split projection: its attention must
infer the local head count from the projection's output (``view(B, T, -1, head_dim)``), as
Hugging Face's layers do, or the ``parallelize`` function adjusts it (torchtitan's
``n_local_heads``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

#: ``parallelize(module, mesh, layout)``: the section's own TP step (see ``Parallelism``)
ParallelizeFn = Callable[[nn.Module, Any, Any], None]


@dataclass(frozen=True)
class Parallelism:
    """A section's parallelisation declaration (``Section(..., parallel=Parallelism(...))``).

    Args:
        blocks: which submodules are the section's blocks (FSDP units, recompute units, TP
            targets), in forward order: a list of classes (or class names, for classes the
            job cannot import), or ``blocks(module) -> list of submodules``. ``None``: the
            defaults of ``find_blocks`` (Maestro's ``Block``, Llama/Qwen2-style decoder
            layers, a Hugging Face model's ``_no_split_modules``, else the largest
            ``nn.ModuleList`` of identical blocks).
        tp_plan: how one block splits under tensor parallelism: ``{submodule path:
            ParallelStyle}`` relative to the block (``ColwiseParallel``, ``RowwiseParallel``,
            ... from ``torch.distributed.tensor.parallel``), or ``tp_plan(block) -> dict``.
            ``None``: Maestro's plans for its own ``Block`` and Llama/Qwen2-style layers.
        tp_divides: names of integer block attributes every TP degree must divide (e.g.
            ``["n_heads", "n_kv_heads"]``); the split projections' widths are checked too.
        parallelize: ``parallelize(module, mesh, layout)``: the section's whole TP step,
            called on every rank of the section when ``tp > 1``, instead of ``tp_plan``
            (``mesh``: the section's ``DeviceMesh`` with dimensions ``("dp", "fsdp",
            "tp")``; ``layout``: its ``maestro.parallel.mesh.SectionLayout``). Maestro then
            applies recompute and FSDP over ``blocks`` as usual. Its TP degrees are not
            checked ahead: the function raises its own errors.
    """

    blocks: Sequence[type | str] | Callable[[nn.Module], Sequence[nn.Module]] | None = None
    tp_plan: Mapping[str, Any] | Callable[[nn.Module], Mapping[str, Any]] | None = None
    tp_divides: Sequence[str] = ()
    parallelize: ParallelizeFn | None = None

    def __post_init__(self) -> None:
        b = self.blocks
        if isinstance(b, (str, type)):
            b = (b,)
        if b is not None and not callable(b):
            b = tuple(b)
            if not b or not all(isinstance(x, (str, type)) for x in b):
                raise ValueError(
                    "Parallelism(blocks=...): give module classes, class names, or a "
                    f"function of the module; got {self.blocks!r}"
                )
        object.__setattr__(self, "blocks", b)
        tp = self.tp_plan
        if tp is not None and not callable(tp) and not isinstance(tp, Mapping):
            raise ValueError(
                "Parallelism(tp_plan=...): give a dict {submodule path: ParallelStyle} or a "
                f"function of the block; got {type(tp).__name__}"
            )
        if isinstance(self.tp_divides, str):
            object.__setattr__(self, "tp_divides", (self.tp_divides,))
        if self.parallelize is not None and not callable(self.parallelize):
            raise ValueError("Parallelism(parallelize=...): must be a function")
        if self.parallelize is not None and self.tp_plan is not None:
            raise ValueError("Parallelism: give tp_plan or parallelize, not both")


def _outermost(module: nn.Module, hit: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """Submodules of ``module`` (itself excluded) for which ``hit`` holds, in module order,
    none inside another."""
    found: list[nn.Module] = []
    seen: set[int] = set()
    for m in module.modules():
        if m is module or id(m) in seen:
            continue
        if hit(m):
            found.append(m)
            seen.update(id(x) for x in m.modules())
    return found


HF_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
HF_MLP = ("gate_proj", "up_proj", "down_proj")


def is_hf_decoder_layer(m: nn.Module) -> bool:
    """A Llama/Qwen2-style layer: ``self_attn`` with q/k/v/o projections and a gated MLP."""
    attn, mlp = getattr(m, "self_attn", None), getattr(m, "mlp", None)
    return (
        attn is not None
        and mlp is not None
        and all(hasattr(attn, n) for n in HF_ATTN)
        and hasattr(mlp, "down_proj")
    )


def _known(m: nn.Module) -> bool:
    from maestro.workloads.layers import Block

    return isinstance(m, Block) or is_hf_decoder_layer(m)


def _no_split_names(module: nn.Module) -> set[str]:
    """Class names a Hugging Face model (or any submodule that is one) keeps whole."""
    names: set[str] = set()
    for m in module.modules():
        got = getattr(m, "_no_split_modules", None)
        if isinstance(got, (list, tuple, set)):
            names.update(str(x) for x in got)
    return names


def _composite(m: nn.Module) -> bool:
    return any(True for _ in m.children()) and any(True for _ in m.parameters())


def _repeated(module: nn.Module) -> list[nn.Module]:
    """The children of every outermost ``nn.ModuleList`` whose entries are composite modules
    (they hold submodules and parameters) of one class: a stack of identical blocks."""

    def hit(m: nn.Module) -> bool:
        kids = list(m.children()) if isinstance(m, nn.ModuleList) else []
        return bool(kids) and len({type(k) for k in kids}) == 1 and _composite(kids[0])

    return [b for ml in _outermost(module, hit) for b in ml.children()]


def find_blocks(
    module: nn.Module, spec: Parallelism | None = None, where: str = "section"
) -> list[nn.Module]:
    """The section's blocks, in module order, none nested in another.

    With ``spec.blocks``: the submodules of those classes (or names), or what its function
    returns; a ``ValueError`` naming ``where`` when none is found. Without: Maestro's
    ``Block`` and Llama/Qwen2-style decoder layers; else the classes a Hugging Face model
    lists in ``_no_split_modules``; else the entries of the outermost ``nn.ModuleList`` of
    identical composite modules; else ``[]`` (the section is one unit).
    """
    wanted = None if spec is None else spec.blocks
    if wanted is None:
        found = _outermost(module, _known)
        if not found and (names := _no_split_names(module)):
            found = _outermost(module, lambda m: type(m).__name__ in names)
        return found or _repeated(module)
    if not isinstance(wanted, tuple):  # a function of the module
        got = wanted(module)
        found = list(got) if got is not None else []
        inside = {id(m) for m in module.modules()}
        for b in found:
            if not isinstance(b, nn.Module) or id(b) not in inside:
                raise ValueError(
                    f"{where}: Parallelism.blocks returned {type(b).__name__}, not a submodule "
                    f"of the section's {type(module).__name__}"
                )
        if not found:
            raise ValueError(f"{where}: Parallelism.blocks returned no block")
        return found
    classes = tuple(c for c in wanted if isinstance(c, type))
    names = {c for c in wanted if isinstance(c, str)}
    found = _outermost(module, lambda m: isinstance(m, classes) or type(m).__name__ in names)
    if not found:
        want = ", ".join(c if isinstance(c, str) else c.__name__ for c in wanted)
        raise ValueError(
            f"{where}: Parallelism.blocks: no submodule of class {want} in the section's "
            f"{type(module).__name__}"
        )
    return found


def user_plan(block: nn.Module, spec: Parallelism | None) -> Mapping[str, Any] | None:
    """The declaration's TP plan of ``block`` (``None``: it gives none)."""
    if spec is None or spec.tp_plan is None:
        return None
    plan = spec.tp_plan(block) if callable(spec.tp_plan) else spec.tp_plan
    return dict(plan) if plan else None


#: the width a column- or row-wise split divides, per module type
_SPLIT_DIMS = (
    (nn.Linear, "column", "out_features"),
    (nn.Linear, "row", "in_features"),
    (nn.Embedding, "column", "embedding_dim"),
    (nn.Embedding, "row", "num_embeddings"),
)


def check_user_plan(
    block: nn.Module, plan: Mapping[str, Any], spec: Parallelism, tp: int, where: str
) -> None:
    """``ValueError`` (one line naming the block's class) when ``plan`` does not fit
    ``block`` at degree ``tp`` (``tp = 1``: only the paths and module types): a path with no
    submodule, a column/row split of something that is not an ``nn.Linear`` or
    ``nn.Embedding``, a split width or a ``tp_divides`` attribute ``tp`` does not divide."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    cls = type(block).__name__
    for path, style in plan.items():
        if any(c in path for c in "*?["):
            continue  # a pattern: parallelize_module resolves it
        try:
            sub = block.get_submodule(path)
        except AttributeError:
            raise ValueError(
                f"{where}.tp: {cls} has no submodule {path!r} (Parallelism.tp_plan)"
            ) from None
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            continue
        kind = "column" if isinstance(style, ColwiseParallel) else "row"
        dim = next((d for cls_, k, d in _SPLIT_DIMS if isinstance(sub, cls_) and k == kind), None)
        if dim is None:
            raise ValueError(
                f"{where}.tp: {cls}.{path} is a {type(sub).__name__}; a {kind}-wise split "
                "needs an nn.Linear or nn.Embedding (Parallelism.tp_plan)"
            )
        width = getattr(sub, dim)
        if width % tp:
            raise ValueError(f"{where}.tp={tp} must divide {cls}.{path}.{dim}={width}")
    for name in spec.tp_divides:
        v = getattr(block, name, None)
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(
                f"{where}.tp: {cls} has no integer attribute {name!r} (Parallelism.tp_divides)"
            )
        if v % tp:
            raise ValueError(f"{where}.tp={tp} must divide {cls}.{name}={v}")


def plan_divisor(block: nn.Module, spec: Parallelism) -> int:
    """The largest number every TP degree of ``block`` under ``spec`` must divide (its split
    widths and ``tp_divides`` attributes; 0 when ``spec.parallelize`` decides alone)."""
    import math

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if spec.parallelize is not None:
        return 0
    g = 0
    for path, style in (user_plan(block, spec) or {}).items():
        try:
            sub = block.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(style, (ColwiseParallel, RowwiseParallel)):
            kind = "column" if isinstance(style, ColwiseParallel) else "row"
            for cls_, k, dim in _SPLIT_DIMS:
                if isinstance(sub, cls_) and k == kind:
                    g = math.gcd(g, getattr(sub, dim))
    for name in spec.tp_divides:
        v = getattr(block, name, None)
        if isinstance(v, int):
            g = math.gcd(g, v)
    return g
