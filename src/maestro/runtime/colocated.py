"""Colocated groups in the runtime: several sections on the same ranks, run as one section.

A run config groups sections with ``[sections.NAME] group = "g"``. The executor then sees the
*unit graph* (``unit_graph``): every disaggregated section as it is, and every colocated group
as one virtual ``Section`` named ``"a+b"`` (its members in topological order, as
``maestro.plan.colocate`` names it). The planner scores exactly this model:

- a replica of the group holds every member (``ColocatedModule``: an ``nn.ModuleDict`` by
  member name, so states map back to the members' own names);
- a group micro-batch's samples stay on that replica; each member runs on the samples that
  activate it, cut into its own chunks: ``max(ceil(n / micro_batch_size),
  ceil(tokens / token_budget))`` of (nearly) equal size, in sample order;
- members run one after another in topological order and pass their outputs in memory;
  frozen members run under ``no_grad`` (``inference_mode`` tensors could not enter the
  trainable members' autograd graph);
- the group's per-sample outputs carry what leaves the group as ``"member/key"`` (consumers
  get them back under the member's name, so their forwards are unchanged) and, when the group
  holds a sink, the sum of its members' sink losses as ``"loss"``.

Autograd runs through the whole group micro-batch, so one backward per group micro-batch
gives every trainable member its gradients, and the step equals the single-process step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext

import torch
from torch import nn

from maestro.sections import Outputs, Sample, Section, SectionGraph

SEP = "/"


class ColocatedModule(nn.Module):
    """The modules of a colocated group's members, by member name.

    Args:
        members: ``member -> module`` (built ones on the group's ranks, placeholders elsewhere).

    The executor saves and loads each member's module under the member's own name, so a
    colocated run's checkpoints and ``--save-dir`` files are a disaggregated run's.
    """

    def __init__(self, members: Mapping[str, nn.Module]) -> None:
        super().__init__()
        self.members = nn.ModuleDict(dict(members))


def _decode(
    inputs: Mapping[str, Sequence[Outputs | None]], units: Mapping[str, list[str]]
) -> dict[str, list[Outputs | None]]:
    """Per-sample inputs keyed by unit -> keyed by the real producer sections.

    A colocated producer's outputs carry ``"member/key"``; a member that skipped a sample has
    no key of it there (its consumer gets ``None``, as from a disaggregated producer)."""
    out: dict[str, list[Outputs | None]] = {}
    for u, col in inputs.items():
        ms = units.get(u, [u])
        if len(ms) == 1:
            out[ms[0]] = list(col)
            continue
        for m in ms:
            pre = m + SEP
            per = []
            for o in col:
                got = (
                    None
                    if o is None
                    else {k[len(pre) :]: v for k, v in o.items() if k.startswith(pre)}
                )
                per.append(got or None)
            out[m] = per
    return out


def chunks(
    idx: Sequence[int], mbs: int, budget: int | None, tokens: Sequence[float]
) -> list[list[int]]:
    """``idx`` cut into ``max(ceil(n / mbs), ceil(sum(tokens) / budget))`` contiguous chunks
    whose sizes differ by at most one (``plan.colocate.GroupedCostModel``'s chunking)."""
    n = len(idx)
    if n == 0:
        return []
    k = math.ceil(n / mbs)
    if budget:
        k = max(k, math.ceil(sum(tokens) / budget - 1e-9))
    k = max(1, min(k, n))
    base, extra = divmod(n, k)
    out, start = [], 0
    for j in range(k):
        size = base + (1 if j < extra else 0)
        out.append(list(idx[start : start + size]))
        start += size
    return out


def _group_section(
    name: str,
    members: list[str],
    real: SectionGraph,
    units: Mapping[str, list[str]],
    unit_inputs: Sequence[str],
    mbs: Mapping[str, int],
    budgets: Mapping[str, int | None],
    tokens_of: Callable[[Sample], float],
) -> Section:
    """The virtual section of a colocated group (see the module docstring)."""
    module = ColocatedModule({m: real[m].module for m in members})
    inside = set(members)
    leaving = [m for m in members if any(c not in inside for c in real.consumers(m))]
    sinks = [m for m in members if real.is_sink(m)]
    # members as Sections around the ColocatedModule's own submodules
    secs = {m: real[m].clone(module.members[m]) for m in members}

    def forward(mod, samples, inputs):
        ext = _decode(inputs, units)
        internal: dict[str, dict[int, Outputs]] = {}
        outs: list[Outputs] = [{} for _ in samples]
        losses: list[list[torch.Tensor]] = [[] for _ in samples]
        for m in members:
            sec = secs[m]
            internal[m] = {}
            idx = [i for i, s in enumerate(samples) if sec.activated(s)]
            toks = [tokens_of(samples[i]) for i in idx]
            for chunk in chunks(idx, mbs[m], budgets[m], toks):
                sub = [samples[i] for i in chunk]
                ins = {
                    p: [
                        internal[p].get(samples[i]["id"]) if p in inside else ext[p][i]
                        for i in chunk
                    ]
                    for p in sec.inputs
                }
                with torch.no_grad() if sec.frozen else nullcontext():
                    got = sec.run(sub, ins)
                for i, o in zip(chunk, got):
                    internal[m][samples[i]["id"]] = o
                    if m in leaving:
                        outs[i].update({f"{m}{SEP}{k}": v for k, v in o.items()})
                    if m in sinks:
                        losses[i].append(o["loss"])
        if sinks:
            for i, ls in enumerate(losses):
                outs[i]["loss"] = torch.stack(ls).sum() if ls else torch.zeros(())
        return outs

    def activates_on(sample):
        return any(secs[m].activated(sample) for m in members)

    return Section(
        name,
        module,
        inputs=unit_inputs,
        frozen=all(real[m].frozen for m in members),
        activates_on=activates_on,
        forward=forward,
    )


def _rewired(sec: Section, units: Mapping[str, list[str]], unit_inputs: Sequence[str]) -> Section:
    """A disaggregated section reading from units: its inputs decoded back to producers."""
    if tuple(unit_inputs) == tuple(sec.inputs):
        return sec
    inner = sec._forward

    def forward(module, samples, inputs):
        return inner(module, samples, _decode(inputs, units))

    out = Section(
        sec.name,
        sec.module,
        inputs=unit_inputs,
        frozen=sec.frozen,
        activates_on=sec.activates_on,
        forward=forward,
        loss=sec._loss,
    )
    out.autocast_dtype, out.input_dtype = sec.autocast_dtype, sec.input_dtype
    return out


def unit_graph(config, real: SectionGraph, tokens_of: Callable[[Sample], float]) -> SectionGraph:
    """The graph the executor runs: ``config.unit_specs()``'s units as sections.

    Args:
        config: the validated run config (its ``units()`` and member micro-batch sizes).
        real: the job's section graph (members of this rank's unit built, others placeholders).
        tokens_of: a sample's tokens (the job's ``sample_cost``), for members' token budgets.
    """
    units = config.units()
    specs = {s.name: s for s in config.unit_specs()}
    mbs = {n: sc.micro_batch_size for n, sc in config.sections.items()}
    budgets = {n: sc.token_budget for n, sc in config.sections.items()}
    out = []
    for u, ms in units.items():
        ins = specs[u].inputs
        if len(ms) == 1:
            out.append(_rewired(real[ms[0]], units, ins))
        else:
            out.append(_group_section(u, ms, real, units, ins, mbs, budgets, tokens_of))
    return SectionGraph(out)


class ColocatedOptimizer:
    """One optimizer per trainable member of a colocated group, each with its own config.

    Args:
        parts: ``(member, section config, parameters, optimizer)`` per trainable member.
    """

    def __init__(self, parts: list[tuple[str, object, list[nn.Parameter], torch.optim.Optimizer]]):
        self.parts = parts

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every member's gradients."""
        for _, _, _, opt in self.parts:
            opt.zero_grad(set_to_none=set_to_none)

    @property
    def state(self) -> dict:
        """Every member optimizer's per-parameter state (for memory accounting)."""
        out = {}
        for _, _, _, opt in self.parts:
            out.update(opt.state)
        return out

    @property
    def param_groups(self) -> list[dict]:
        """Every member optimizer's parameter groups."""
        return [g for _, _, _, opt in self.parts for g in opt.param_groups]


__all__ = ["ColocatedModule", "ColocatedOptimizer", "chunks", "unit_graph"]
