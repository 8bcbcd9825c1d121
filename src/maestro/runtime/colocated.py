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
  holds a sink, the sum of its members' sink losses as ``"loss"`` (and their other per-sample
  scalars, e.g. ``"ce"``, under their own names, for the eval and the logs).

Autograd runs through the whole group micro-batch, so one backward per group micro-batch
gives every trainable member its gradients, and the step equals the single-process step.

Per-member grids (``GroupContext``): a group replica is ``T`` ranks (the members' largest
``tp``). A member at ``tp = T`` runs every sample of the replica tensor-parallel; a member at
``tp < T`` splits them over ``s = T / tp`` sub-replicas (contiguous, near-equal parts), so
each rank computes only its part. Where parts differ between a producer and a consumer, the
producer's outputs cross an *exchange*: forward, the replica all-gathers them (every rank then
holds every sample's outputs); backward is *staged* (``staged_backward``) with no collective
inside autograd, because ranks' graphs differ and autograd's order of two collectives could
too: first the backward from the group's outputs down to the exchanges' gathered leaves,
then, producers last, for each exchange: the gathered gradient summed over the replica
(each consumer's use scaled by ``1 / tp_consumer``, since its ``tp`` ranks hold the same
gradient) and this part's slice run back through the member. Inputs from outside the group
that a split member reads get their gradients summed over the replica the same way, so the
replica's leader sends whole gradients back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from maestro.runtime.failures import sink_loss
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


@dataclass
class GroupContext:
    """How this rank runs a colocated group's members (the executor fills it in).

    Args:
        T: ranks of a group replica (the members' largest ``tp``).
        tp: ``member -> tp``.
        index: this rank's position in its group replica (``0 .. T-1``).
        group: the replica's process group (``None`` when ``T == 1``).
    """

    T: int = 1
    tp: dict[str, int] = field(default_factory=dict)
    index: int = 0
    group: object = None
    #: a member shards with FSDP: every member's outputs cross an exchange (so each autograd
    #: pass holds one member's FSDP collectives) and FSDP members run ``targets`` chunks
    fsdp: bool = False
    #: ``member -> chunks`` every rank of this replica's lockstep group (``lockstep_groups``)
    #: runs of an FSDP member in the coming micro-batch (its real chunks, then zero-weight
    #: ones on ``fallback``; set before each forward)
    targets: dict[str, int] = field(default_factory=dict)
    #: ``member -> a sample of the step that activates it`` (for zero-weight chunks)
    fallback: dict[str, dict] = field(default_factory=dict)

    def splits(self, member: str) -> int:
        """Sub-replicas of ``member`` per group replica (``T / tp``)."""
        return self.T // self.tp.get(member, self.T)

    def sub(self, member: str) -> int:
        """This rank's sub-replica of ``member``."""
        return self.index // self.tp.get(member, self.T)


def split_even(idx: Sequence[int], parts: int) -> list[list[int]]:
    """``idx`` in ``parts`` contiguous pieces whose sizes differ by at most one (the first
    ones larger; empty pieces when there are fewer items than parts)."""
    base, extra = divmod(len(idx), parts)
    out, start = [], 0
    for j in range(parts):
        size = base + (1 if j < extra else 0)
        out.append(list(idx[start : start + size]))
        start += size
    return out


class _GradScale(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def _scaled(o: Outputs | None, factor: float) -> Outputs | None:
    """``o`` with every tensor that needs a gradient passed through ``_GradScale``."""
    if o is None or factor == 1.0:
        return o
    return {
        k: (_GradScale.apply(v, factor) if isinstance(v, torch.Tensor) and v.requires_grad else v)
        for k, v in o.items()
    }


@dataclass
class _Boundary:
    """One exchange of a micro-batch: per float dtype ``(gathered leaf, offset of this rank's
    part in the leaf, this rank's ``(chunk, output)`` in leaf order)``."""

    parts: list[tuple[torch.Tensor, int, list[tuple[int, torch.Tensor]]]]


@dataclass
class _Record:
    """What a group micro-batch's staged backward needs: its exchanges in forward order and
    the received inputs whose gradients the replica sums."""

    boundaries: dict[str, _Boundary] = field(default_factory=dict)
    external: list[torch.Tensor] = field(default_factory=list)
    #: ``member -> outputs of each zero-weight chunk`` (FSDP lockstep), run back with zeros
    dummies: dict[str, list[list[torch.Tensor]]] = field(default_factory=dict)
    #: members in forward (topological) order
    order: list[str] = field(default_factory=list)


def _exchange(
    local: Mapping[int, Outputs],
    parts: Sequence[Sequence[int]],
    ctx: GroupContext,
    member: str,
    grad: bool,
    chunk_of: Mapping[int, int],
) -> tuple[dict[int, Outputs], _Boundary | None]:
    """Every part's outputs on every rank of the replica.

    ``local`` holds this rank's part (``parts[ctx.sub(member)]``, sample ids). Floating
    tensors travel as one flat buffer per dtype (an all-gather, padded); the rest, with the
    shapes, as objects. With ``grad``, the gathered floats are leaves that collect the
    consumers' gradients for ``staged_backward`` (``chunk_of``: this rank's sample id ->
    the chunk that computed it).
    """
    s, mine = len(parts), ctx.sub(member)
    tp = ctx.tp[member]
    meta, small = [], {}
    flats: dict[torch.dtype, list[torch.Tensor]] = {}
    entries: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
    for sid in parts[mine]:
        for key in sorted(local[sid]):
            v = local[sid][key]
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                meta.append((sid, key, tuple(v.shape), v.dtype))
                flats.setdefault(v.dtype, []).append(v.reshape(-1))
                entries.setdefault(v.dtype, []).append((chunk_of[sid], v))
            else:
                small[(sid, key)] = v
    local_flat = {d: torch.cat(ts) for d, ts in flats.items()}
    if s > 1:
        objs: list = [None] * ctx.T
        dist.all_gather_object(objs, (meta, small), group=ctx.group)
        who = [objs[k * tp] for k in range(s)]  # one rank per sub-replica
    else:
        who = [(meta, small)]
    dtypes = sorted({m[3] for w in who for m in w[0]}, key=str)
    sizes = [{d: sum(math.prod(m[2]) for m in w[0] if m[3] == d) for d in dtypes} for w in who]
    out: dict[int, Outputs] = {}
    parts_out = []
    views: dict[tuple[int, str], torch.Tensor] = {}
    for d in dtypes:
        mine_flat = local_flat.get(d)
        if mine_flat is None:
            ref = next(iter(local_flat.values()), None)
            dev = ref.device if ref is not None else None
            mine_flat = torch.zeros(0, dtype=d, device=dev)
        if s > 1:
            width = max(sz[d] for sz in sizes)
            pad = torch.zeros(width, dtype=d, device=mine_flat.device)
            pad[: mine_flat.numel()] = mine_flat.detach()
            got = [torch.empty_like(pad) for _ in range(ctx.T)]
            dist.all_gather(got, pad, group=ctx.group)
            full = torch.cat([got[k * tp][: sizes[k][d]] for k in range(s)])
        else:
            full = mine_flat.detach().clone()
        if grad:
            full.requires_grad_(True)
        offset = sum(sizes[k][d] for k in range(mine)) if s > 1 else 0
        parts_out.append((full, offset, entries.get(d, [])))
        off = 0
        for w in who:
            for sid, key, shape, dt in w[0]:
                if dt == d:
                    n = math.prod(shape)
                    views[(sid, key)] = full[off : off + n].view(shape)
                    off += n
    for w in who:
        for sid, key, _, _ in w[0]:
            out.setdefault(sid, {})[key] = views[(sid, key)]
        for (sid, key), v in w[1].items():
            out.setdefault(sid, {})[key] = v
    return out, (_Boundary(parts_out) if grad else None)


def staged_backward(
    ctx: GroupContext, rec: _Record | None, tensors: Sequence[torch.Tensor], grads
) -> None:
    """The backward of one group micro-batch (see the module docstring): autograd from
    ``tensors`` down to the exchanges, then each exchange, producers last, then the summed
    gradients of received inputs. Every rank of the replica makes the same collectives."""
    if tensors:
        torch.autograd.backward(list(tensors), list(grads))
    if rec is None:
        return
    for m in reversed(rec.order):
        per: dict[int, tuple[list, list]] = {}  # chunk -> (outputs, their gradients)
        b = rec.boundaries.get(m)
        for full, offset, entries in b.parts if b is not None else ():
            g = full.grad if full.grad is not None else torch.zeros_like(full)
            if ctx.group is not None:
                dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.group)
            off = offset
            for c, t in entries:
                n = t.numel()
                if t.requires_grad:
                    ts, gs = per.setdefault(c, ([], []))
                    ts.append(t)
                    gs.append(g[off : off + n].view_as(t))
                off += n
        for j, outs in enumerate(rec.dummies.get(m, ())):
            per[-1 - j] = (outs, [torch.zeros_like(t) for t in outs])
        if not ctx.fsdp:  # one pass for the member (TP ranks hold identical graphs)
            per = {
                0: (
                    [t for ts, _ in per.values() for t in ts],
                    [g for _, gs in per.values() for g in gs],
                )
            }
        # with FSDP one pass per chunk, last first: within a chunk's chain of blocks the
        # order of FSDP's gathers and reduce-scatters is fixed, across chunks it is not
        for c in sorted(per, reverse=True):
            ts, gs = per[c]
            if ts:
                torch.autograd.backward(ts, gs)
    if rec.external:
        flat = torch.cat(
            [
                (t.grad if t.grad is not None else torch.zeros_like(t)).reshape(-1)
                for t in rec.external
            ]
        )
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=ctx.group)
        off = 0
        for t in rec.external:
            t.grad = flat[off : off + t.numel()].view_as(t).clone()
            off += t.numel()


def lockstep_groups(config, unit: str) -> list[list[int]]:
    """The lockstep groups of colocated group ``unit``'s replicas (``T`` ranks each): replicas
    that must run the same number of group micro-batches, and the same number of chunks of
    every FSDP member in each, because one FSDP mesh row of a member spans them.

    The planner and simulator sync shard groups of ``k`` consecutive group replicas, ``k`` the
    members' largest ``fsdp`` (``plan.colocate.GroupedCostModel.lockstep``,
    ``timeline.shard_groups``); a member's row covers ``fsdp * tp / T`` group replicas. The
    groups here join both (connected replicas), so they are the simulator's whenever its
    groups hold whole rows (every FSDP member at ``tp = T`` with nested ``fsdp`` degrees), and
    never split a row otherwise. ``[[r] for r]`` without an FSDP member."""
    from maestro.schedule.timeline import shard_groups

    members = config.units()[unit]
    T = config.group_tp(unit)
    secs = [config.sections[m] for m in members]
    reps = secs[0].num_ranks // T
    parent = list(range(reps))

    def find(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    def join(rs) -> None:
        rs = sorted(set(rs))
        for r in rs[1:]:
            parent[find(r)] = find(rs[0])

    fsdp = [sc for sc in secs if sc.fsdp > 1]
    for sc in fsdp:
        row = sc.fsdp * sc.tp  # ranks of one FSDP mesh row (TP innermost)
        for d in range(sc.dp):
            join(i // T for i in range(d * row, (d + 1) * row))
    for grp in shard_groups(reps, max((sc.fsdp for sc in fsdp), default=1)):
        join(grp)
    out: dict[int, list[int]] = {}
    for r in range(reps):
        out.setdefault(find(r), []).append(r)
    return sorted(out.values())


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

    internal_consumers = {m: [c for c in members if m in real[c].inputs] for m in members}
    ext_readers = [m for m in members if any(p not in inside for p in real[m].inputs)]
    pending: list[_Record] = []

    def forward(mod, samples, inputs):
        ctx: GroupContext = section.colocated
        T = ctx.T
        split = {m: ctx.splits(m) for m in members}
        # an exchange where a producer's and a consumer's parts differ
        exch = {
            m: ctx.fsdp or split[m] > 1 or any(split[c] > 1 for c in internal_consumers[m])
            for m in members
        }
        ext_sum = T > 1 and any(split[m] > 1 for m in ext_readers)
        grad_on = torch.is_grad_enabled() and not all(real[m].frozen for m in members)
        rec = _Record(order=list(members)) if grad_on and (T > 1 or ctx.fsdp) else None
        ext = _decode(inputs, units)
        if rec is not None and ext_sum:
            for p in sorted(inputs):
                for o in inputs[p]:
                    for k in sorted(o or {}):
                        v = o[k]
                        if isinstance(v, torch.Tensor) and v.requires_grad:
                            rec.external.append(v)
        internal: dict[str, dict[int, Outputs]] = {}
        outs: list[Outputs] = [{} for _ in samples]
        losses: list[list[torch.Tensor]] = [[] for _ in samples]
        for m in members:
            sec = secs[m]
            idx = [i for i, s in enumerate(samples) if sec.activated(s)]
            parts = split_even(idx, split[m])
            mine = parts[ctx.sub(m)]
            toks = [tokens_of(samples[i]) for i in mine]
            local: dict[int, Outputs] = {}
            factor = 1.0 / ctx.tp.get(m, T)  # this member's share of a summed gradient
            chunk_of: dict[int, int] = {}
            for c, chunk in enumerate(chunks(mine, mbs[m], budgets[m], toks)):
                chunk_of.update((samples[i]["id"], c) for i in chunk)
                sub = [samples[i] for i in chunk]
                ins = {}
                for p in sec.inputs:
                    if p in inside:
                        f = factor if exch[p] else 1.0
                        ins[p] = [_scaled(internal[p].get(samples[i]["id"]), f) for i in chunk]
                    else:
                        f = factor if ext_sum else 1.0
                        ins[p] = [_scaled(ext[p][i], f) for i in chunk]
                with torch.no_grad() if sec.frozen else nullcontext():
                    got = sec.run(sub, ins)
                for i, o in zip(chunk, got):
                    local[samples[i]["id"]] = o
            done = len(chunks(mine, mbs[m], budgets[m], toks))
            for _ in range(ctx.targets.get(m, 0) - done):
                # FSDP lockstep: as many forwards (and backwards) as the busiest rank of the
                # lockstep group (``lockstep_groups``), on a sample of the step with its
                # producers absent, contributing nothing
                dummy = ctx.fallback[m]
                with torch.no_grad() if sec.frozen else nullcontext():
                    (o,) = sec.run([dummy], {p: [None] for p in sec.inputs})
                if rec is not None and not sec.frozen:
                    rec.dummies.setdefault(m, []).append(
                        [v for v in o.values() if isinstance(v, torch.Tensor) and v.requires_grad]
                    )
            if exch[m] and idx:
                ids = [[samples[i]["id"] for i in part] for part in parts]
                trainable = grad_on and not sec.frozen
                local, b = _exchange(local, ids, ctx, m, trainable, chunk_of)
                if b is not None and rec is not None:
                    rec.boundaries[m] = b
            internal[m] = local
            leave_f = 1.0 / T if exch[m] else 1.0  # every replica rank gets these gradients
            for i in idx:
                o = local[samples[i]["id"]]
                if m in leaving:
                    o2 = _scaled(o, leave_f)
                    outs[i].update({f"{m}{SEP}{k}": v for k, v in o2.items()})
                if m in sinks:
                    losses[i].append(
                        _scaled({"loss": sink_loss(m, o, samples[i]["id"])}, leave_f)["loss"]
                    )
                    # the sink's other per-sample scalars (e.g. ``ce``): reported, as a
                    # disaggregated sink's are (summed over sink members sharing a name)
                    for k, v in o.items():
                        if k != "loss" and isinstance(v, torch.Tensor) and v.numel() == 1:
                            v = v.detach().reshape(())
                            outs[i][k] = outs[i][k] + v if k in outs[i] else v
        if sinks:
            for i, ls in enumerate(losses):
                outs[i]["loss"] = torch.stack(ls).sum() if ls else torch.zeros(())
        if rec is not None:
            pending.append(rec)
        return outs

    def backward(tensors, grads):
        """One group micro-batch's backward (micro-batches in forward order)."""
        assert pending, "a colocated backward without its forward"
        staged_backward(section.colocated, pending.pop(0), tensors, grads)

    def activates_on(sample):
        return any(secs[m].activated(sample) for m in members)

    section = Section(
        name,
        module,
        inputs=unit_inputs,
        frozen=all(real[m].frozen for m in members),
        activates_on=activates_on,
        forward=forward,
    )
    section.colocated = GroupContext(tp={m: 1 for m in members})
    section.backward = backward
    #: the members as the group runs them (the executor parallelizes these in place)
    section.member_sections = secs
    return section


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
        parallel=sec.parallel,
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


__all__ = [
    "ColocatedModule",
    "ColocatedOptimizer",
    "GroupContext",
    "chunks",
    "lockstep_groups",
    "split_even",
    "staged_backward",
    "unit_graph",
]
