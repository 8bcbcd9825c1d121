"""Pipeline stages of a section (``pp``): its blocks cut into contiguous ranges, one per rank.

How a user's forward is staged without rewriting it. Every stage keeps the section's whole
module *except* the blocks other stages own, which become parameter-free ``SkippedBlock``
placeholders; the section's own forward then runs on every stage, with two hooks:

- on a stage after the first, a pre-hook on its first block replaces that block's input (the
  hidden state the forward computed from the embeddings, which the stage does not own) with
  the hidden state received from the previous stage;
- on a stage before the last, a hook on its last block captures the block's output and ends
  the forward there (``StageExit``), so the head and the loss run on the last stage only.

So a section pipelines when its forward runs its blocks once per micro-batch, in order, each
taking the hidden state as its first argument (or ``hidden_states=``) and returning it (or a
tuple that starts with it), batch first: what Maestro's ``Block``, Hugging Face decoder layers
and most user transformers do. The cheap code before the first block (embedding lookups,
masks, position tables) runs on every stage; the parameters outside the blocks (embeddings,
norms, head) are kept on every stage and their gradients are summed over the stages
(``shared_params``), as Megatron sums tied embeddings over its first and last stage. The
planner counts those shared parameters on every stage.

The runtime (``maestro.runtime.pipeline``) moves hidden states between stages and orders the
micro-batches (1F1B for a sink); this module only changes the module.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

#: the key a non-last stage's forward returns its hidden state under (first sample's outputs)
HIDDEN = "__pp_hidden"


class StageExit(Exception):
    """Raised by a non-last stage's last block to end the forward with its hidden state."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("pipeline stage boundary")
        self.hidden = hidden


class SkippedBlock(nn.Module):
    """Stands for a block another pipeline stage owns: no parameters, returns its input.

    Its output is never used: the next owned block's input is replaced by the hidden state
    received from the previous stage.
    """

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, *args, **kwargs):
        if args:
            return args[0]
        return kwargs.get("hidden_states")

    def extra_repr(self) -> str:
        return f"block {self.index}, on another pipeline stage"


def stage_bounds(num_blocks: int, pp: int) -> list[tuple[int, int]]:
    """``[(start, stop)]`` block ranges of ``pp`` stages: contiguous, as even as possible
    (the first ``num_blocks % pp`` stages get one more): the cut the planner prices
    (``maestro.estimate.pipeline.even_bounds``)."""
    from maestro.estimate.pipeline import even_bounds

    return even_bounds(num_blocks, pp)


def _first_tensor(out) -> torch.Tensor:
    """A block's hidden state: its output, or the first element of a tuple/list output."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(type(out).__name__)


class Stage:
    """One pipeline stage of a section on this rank (``make_stage``).

    Attributes:
        index: this stage (0-based); ``count``: the section's ``pp``.
        blocks: the blocks this stage owns, in order (FSDP, TP and recompute units).
        bounds: ``(start, stop)`` of those blocks among the section's.
        shared_params: trainable parameters outside every block (on every stage).
        full_names: the names of the section's trainable parameters before the cut, in
            ``module.parameters()`` order (a checkpoint's optimizer-state indices).
        local_names: the same for this stage's module (a subset, same order).
    """

    def __init__(self, index: int, count: int, blocks, bounds, shared, full_names, local_names):
        self.index, self.count = index, count
        self.blocks: list[nn.Module] = blocks
        self.bounds: tuple[int, int] = bounds
        self.shared_params: list[nn.Parameter] = shared
        self.full_names: list[str] = full_names
        self.local_names: list[str] = local_names
        #: the hidden state received for the micro-batch being run (stages after the first)
        self.incoming: torch.Tensor | None = None
        self._taken = False
        self.where = "section"

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def refresh(self, module: nn.Module) -> None:
        """Re-read ``shared_params`` from ``module`` by name (``fully_shard`` replaces a
        module's parameters with new DTensor ones)."""
        names = self._shared_names
        self.shared_params = [p for n, p in module.named_parameters() if n in names]

    def global_index(self) -> list[int]:
        """For each local trainable parameter, its index among ``full_names``."""
        pos = {n: i for i, n in enumerate(self.full_names)}
        return [pos[n] for n in self.local_names]

    # -- hooks ---------------------------------------------------------------------------
    def _replace_input(self, module, args, kwargs):
        if self._taken:
            raise ValueError(
                f"{self.where}.pp: the section's forward runs its blocks more than once per "
                "micro-batch (e.g. one sample at a time); a pipelined section's forward must "
                "run the blocks once on the whole micro-batch"
            )
        if self.incoming is None:
            raise AssertionError("pipeline stage ran without its incoming hidden state")
        self._taken = True
        h = self.incoming
        if args:
            return (h, *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": h}
        raise ValueError(
            f"{self.where}.pp: block {type(module).__name__} is called without a positional "
            "hidden state or hidden_states=; it cannot start a pipeline stage"
        )

    def _exit(self, module, args, out):
        try:
            h = _first_tensor(out)
        except TypeError as e:
            raise ValueError(
                f"{self.where}.pp: block {type(module).__name__} returns {e}, not the hidden "
                "state (a tensor or a tuple starting with one); it cannot end a pipeline stage"
            ) from None
        raise StageExit(h)

    def install_hooks(self) -> None:
        """Register the stage's hooks (after FSDP/TP/recompute have wrapped the blocks: the
        input swap runs before FSDP's own pre-forward hook, the exit after its post-forward
        hook)."""
        if not self.first:
            self.blocks[0].register_forward_pre_hook(
                self._replace_input, with_kwargs=True, prepend=True
            )
        if not self.last:
            self.blocks[-1].register_forward_hook(self._exit)

    def wrap_forward(self, forward):
        """The section forward of this stage: ``forward`` ended at the stage's last block
        (``[{HIDDEN: hidden}, {}, ...]`` on a non-last stage, batch first)."""

        def staged(module, samples, inputs):
            self._taken = False
            try:
                outs = forward(module, samples, inputs)
            except StageExit as e:
                h = e.hidden
                if h.dim() == 0 or h.shape[0] != len(samples):
                    raise ValueError(
                        f"{self.where}.pp: the hidden state leaving stage {self.index} has shape "
                        f"{tuple(h.shape)} for a micro-batch of {len(samples)} samples; a "
                        "pipelined section's forward must run its blocks once on the whole "
                        "micro-batch, batch first"
                    ) from None
                return [{HIDDEN: h}] + [{} for _ in samples[1:]]
            finally:
                self.incoming = None
            if not self.last:
                raise ValueError(
                    f"{self.where}.pp: the section's forward returned without running block "
                    f"{self.bounds[1] - 1}, the last of pipeline stage {self.index}"
                )
            if not self.first and not self._taken:
                raise ValueError(
                    f"{self.where}.pp: the section's forward never ran block {self.bounds[0]}, "
                    f"the first of pipeline stage {self.index}"
                )
            return outs

        return staged


def make_stage(section, index: int, count: int, where: str = "section") -> Stage:
    """Cut ``section.module`` down to pipeline stage ``index`` of ``count`` in place and
    route ``section``'s forward through the stage (``Stage.wrap_forward``). Call before
    TP/recompute/FSDP are applied (``maestro.parallel.apply.parallelize_section`` with
    ``blocks=stage.blocks``), then ``stage.install_hooks()``.

    ``ValueError`` (one line, naming ``where``) when the module has fewer blocks than stages.
    """
    from maestro.parallel.spec import find_blocks

    module = section.module
    full_names = [n for n, p in module.named_parameters() if p.requires_grad]
    blocks = find_blocks(module, getattr(section, "parallel", None), where)
    if len(blocks) < count:
        raise ValueError(
            f"{where}.pp: {count} pipeline stages need at least {count} blocks, but the "
            f"section's {type(module).__name__} has {len(blocks)}"
            + (
                ""
                if blocks
                else "; declare them: Section(..., parallel=maestro.Parallelism(blocks=[...]))"
            )
        )
    bounds = stage_bounds(len(blocks), count)[index]
    parent_of = {}
    for m in module.modules():
        for name, child in m.named_children():
            parent_of.setdefault(id(child), (m, name))
    for j, blk in enumerate(blocks):
        if not bounds[0] <= j < bounds[1]:
            parent, name = parent_of[id(blk)]
            setattr(parent, name, SkippedBlock(j))
    owned = blocks[bounds[0] : bounds[1]]
    in_blocks = {id(p) for b in owned for p in b.parameters()}
    shared = [p for p in module.parameters() if p.requires_grad and id(p) not in in_blocks]
    local_names = [n for n, p in module.named_parameters() if p.requires_grad]
    stage = Stage(index, count, owned, bounds, shared, full_names, local_names)
    shared_ids = {id(p) for p in shared}
    stage._shared_names = {n for n, p in module.named_parameters() if id(p) in shared_ids}
    stage.where = where
    section._forward = stage.wrap_forward(section._forward)
    if not stage.last:
        section._loss = None  # the loss is the last stage's
    return stage


def merge_optimizer_states(parts: Sequence[tuple[list[int], dict]], num_params: int) -> dict:
    """One optimizer ``state_dict`` of the whole section from the stages' own.

    Args:
        parts: per stage, ``(global index of each local parameter, its optimizer state_dict)``.
        num_params: the section's trainable parameters.
    """
    state: dict = {}
    groups = None
    for gidx, sd in parts:
        for i, st in sd["state"].items():
            state.setdefault(gidx[int(i)], st)  # shared parameters: identical on every stage
        if groups is None:
            groups = [dict(g) for g in sd["param_groups"]]
    assert groups is not None and len(groups) == 1, "one parameter group per section"
    groups[0]["params"] = list(range(num_params))
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def stage_optimizer_state(stage: Stage, full: dict) -> dict:
    """This stage's share of a whole-section optimizer ``state_dict`` (inverse of
    ``merge_optimizer_states``)."""
    gidx = stage.global_index()
    state = {}
    for i, g in enumerate(gidx):
        st = full["state"].get(g, full["state"].get(str(g)))
        if st is not None:
            state[i] = st
    groups = [dict(g) for g in full["param_groups"]]
    groups[0]["params"] = list(range(len(gidx)))
    return {"state": state, "param_groups": groups}
