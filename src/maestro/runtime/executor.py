"""One rank of a Maestro run: its section's replica executes any ``Schedule``.

Per step, on every rank (deadlock-free for any schedule that assigns every activated
(sample, section) pair to exactly one replica):

1. Forwards of this replica's micro-batches in schedule order. A forward waits only for its
   producers' outputs of its own samples; producers never wait on consumers during forwards.
   Outputs go per sample to the consumer replica holding that sample (one message per
   destination and micro-batch).
2. A sink (the loss section) runs each micro-batch's backward right after its forward and sends
   the input gradients back per sample. A frozen section runs under ``inference_mode`` and keeps
   nothing. A trainable producer keeps its micro-batches' outputs, then, after all forwards,
   receives their gradients and runs one backward per micro-batch (and sends its own input
   gradients further back).
3. Gradients are summed inside the section's DP group and the section's optimizer steps.

Parallel strategies (``maestro.parallel``): a section's ranks form a ``dp x fsdp x tp`` mesh
(``dp x fsdp x cp x tp`` with context parallelism). The schedule's replicas are its
``dp * fsdp`` data-parallel coordinates; every rank of a replica's TP group gets the replica's
inputs (the producer replica's TP leader sends to each) and only the TP leader sends outputs
and input gradients on. A CP group (``maestro.parallel.cp``) shares a replica's samples, each
rank a share of every sequence: a producer sends each CP rank only its share, each CP rank
sends its share's input gradients back (the producer sums them), each rank of a CP producer
sends its own rows of every sequence output (the consumer assembles them), and a CP
section's gradients are summed over the group.
FSDP collectives need every rank of a shard group (one FSDP mesh row: ``fsdp`` consecutive
replicas, ``SectionLayout.shard_group``, the simulator's ``timeline.shard_groups``) to run the
same forwards and backwards, so a replica with fewer micro-batches than the busiest of *its
own shard group* runs zero-contribution padding micro-batches (``_pad_micro_batch``); shard
groups do not wait for each other, and HSDP sums gradients across them once per step, in the
step's tail (``maestro.parallel.apply``). ``lock_replicas`` is the group a replica pads with.

Colocated groups (``[sections.NAME] group``, ``maestro.runtime.colocated``): the executor
runs the *unit graph*, in which a group is one virtual section on the group's ranks; its
replica holds every member and runs them one after another, outputs in memory. Its optimizer
is one per trainable member, and its checkpoints and saved states are per member.

Every per-sample loss is divided by the *global* batch's normaliser and DP reduction is a SUM,
so the step equals a single-process step of the whole compound model up to float rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.distributed as dist

from maestro.config import TrainConfig, fmt_bytes, parse_bytes
from maestro.costmodel import micro_batch_features
from maestro.parallel import grads as pgrads
from maestro.parallel.mesh import SectionLayout, build_section_mesh, section_layouts
from maestro.runtime.failures import sink_loss
from maestro.runtime.faults import NonFiniteError, kill_point, nonfinite_message, poison_factor
from maestro.runtime.local import (
    batch_fingerprint,
    batch_to,
    check_same_batch,
    clip_grads,
    make_optimizer,
    set_lr,
)
from maestro.runtime.trace import Tracer
from maestro.runtime.wire import Transport, message_tags
from maestro.runtime.worker_state import WorkerCheckpoints
from maestro.schedule import get_scheduler
from maestro.schedule.types import SampleInfo, Schedule, SectionSpec
from maestro.sections import Outputs


def check_schedule(
    schedule: Schedule, samples: Sequence[SampleInfo], sections: Sequence[SectionSpec]
) -> None:
    """``ValueError`` unless every activated (sample, section) pair has exactly one replica."""
    for spec in sections:
        reps = schedule.order.get(spec.name)
        if reps is None or len(reps) != spec.dp:
            got = None if reps is None else len(reps)
            raise ValueError(
                f"schedule {schedule.name!r}: section {spec.name!r} needs {spec.dp} replica "
                f"lists, got {got}"
            )
        seen = [sid for mbs in reps for mb in mbs for sid in mb.sample_ids]
        want = {s.sample_id for s in samples if spec.name in s.sections}
        if len(seen) != len(set(seen)) or set(seen) != want:
            raise ValueError(
                f"schedule {schedule.name!r}: section {spec.name!r} must process each of its "
                f"{len(want)} activated samples exactly once"
            )


def resolve_scheduler(name: str):
    """A registered scheduler, or ``"package.module:function"`` imported on demand."""
    if ":" in name:
        import importlib

        mod, _, fn = name.partition(":")
        try:
            return getattr(importlib.import_module(mod), fn)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"scheduler {name!r} cannot be imported: {e}") from None
    return get_scheduler(name)


def flat_allreduce_grads(params: Sequence[torch.nn.Parameter], group=None) -> None:
    """SUM-all-reduce the gradients of ``params`` as one flat buffer.

    A missing gradient counts as zeros, but a parameter that has no gradient on *any* replica
    keeps ``grad = None``, as in a single process (where, e.g., a vision encoder that saw no
    image in the global batch gets no gradient and AdamW leaves it and its moments alone).
    """
    if not params:
        return
    has = [p.grad is not None for p in params]
    flat = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        + [torch.tensor(has, dtype=params[0].dtype, device=params[0].device)]
    )
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    off = 0
    flags = flat[-len(params) :].tolist()
    for p, flag in zip(params, flags):
        n = p.numel()
        p.grad = flat[off : off + n].view_as(p).clone() if flag > 0 else None
        off += n


def grads_finite(params: Sequence[torch.nn.Parameter]) -> bool:
    """Whether every existing gradient of ``params`` is finite."""
    grads = [p.grad for p in params if p.grad is not None]
    return all(bool(torch.isfinite(g).all()) for g in grads)


def _unit_layouts(config: TrainConfig, ranks: dict[str, list[int]]) -> dict[str, SectionLayout]:
    """Every unit's layout: a section's own (``section_layouts``), or a colocated group's
    replicas of ``T`` ranks (its members' largest ``tp``) over its ranks."""
    out = section_layouts(config)
    for u, ms in config.units().items():
        if len(ms) > 1:
            T = config.group_tp(u)
            out[u] = SectionLayout(u, tuple(ranks[u]), len(ranks[u]) // T, 1, T)
    return {u: out[u] for u in ranks}


def _grads_of(received: Outputs) -> Outputs:
    """Gradients of the received tensors that took part in autograd (zeros when unused)."""
    return {
        k: (t.grad if t.grad is not None else torch.zeros_like(t))
        for k, t in received.items()
        if t.requires_grad
    }


def _token_lengths(batch) -> dict[int, int | None]:
    """``sample id -> sequence length`` (``input_ids``/``tokens``; ``None`` without)."""
    from maestro.job import TOKEN_KEYS

    out: dict[int, int | None] = {}
    for s in batch:
        t = next((s[k] for k in TOKEN_KEYS if isinstance(s.get(k), torch.Tensor)), None)
        out[s["id"]] = int(t.shape[0]) if t is not None and t.dim() >= 1 else None
    return out


class MaestroWorker(WorkerCheckpoints):
    """The replica of one section on this rank.

    Args:
        config: the validated run config (``sum(dp)`` must equal ``world``).
        rank: this process's global rank; ranks are given to sections in contiguous blocks
            (``config.rank_layout()``).
        world: world size.
        device: device of this rank.
        tracer: records compute and transfer events.
    """

    def __init__(
        self, config: TrainConfig, rank: int, world: int, device: torch.device, tracer: Tracer
    ) -> None:
        from maestro.workloads import get_workload

        config.check_world_size(world)
        self.config, self.rank, self.device, self.tracer = config, rank, device, tracer
        #: the schedulable units (a section, or a colocated group ``"a+b"``) and their ranks
        self.units = config.units()
        self.layout = config.unit_layout()
        self.layouts = _unit_layouts(config, self.layout)
        self.specs = config.unit_specs()
        self.name = next(n for n, rs in self.layout.items() if rank in rs)
        #: the real sections this rank runs (one, or a group's members)
        self.members = self.units[self.name]
        lay = self.layouts[self.name]
        self.replica = lay.replica_of(rank)
        #: the TP leader of a replica (of its last stage under ``pp``) sends its outputs
        self.leader = lay.leader(self.replica) == rank
        #: the TP leader of the replica's first stage sends the gradients of its inputs
        #: (with ``cp``, every CP rank's: each sends its own share's)
        self.sends_input_grads = lay.stage_ranks(self.replica, 0, lay.cp_index(rank))[0] == rank
        #: this rank's pipeline stage (``pp > 1``: ``maestro.parallel.pipeline.Stage``)
        self.stage = None
        self.stage_index = lay.stage_of(rank)
        self.pp_group = None
        self.workload = get_workload(config)
        #: the job's own graph (for sample infos and costs) and the graph of units this rank
        #: runs (the same object without colocated groups)
        self.real_graph = self.workload.graph(build=self.members)
        self.graph = self.real_graph
        if config.colocated:
            from maestro.runtime.colocated import unit_graph

            job = self.workload
            self.graph = unit_graph(
                config, self.real_graph, lambda s: float(job.sample_cost(s).get("tokens", 1.0))
            )
        self.section = self.graph[self.name]
        self.section.module.to(device)
        self.group = None  # plain replicas: the flat gradient all-reduce's group
        self.mesh = None
        #: this rank's CP group (``cp > 1``: ring attention's, and the input gradients' sum)
        self.cp_group = None
        #: a colocated group's per-member grids on this rank (``_group_comms``)
        self.member_comm = None
        for spec in self.specs:  # every rank creates every group, in the same order
            sl = self.layouts[spec.name]
            if len(self.units[spec.name]) > 1:
                made = self._group_comms(spec.name, device.type)
                if spec.name == self.name:
                    self.member_comm = made
            elif sl.pp > 1:
                from maestro.runtime.pipeline import setup_comms

                made = setup_comms(self, sl, device.type)
                if spec.name == self.name:
                    self.mesh, self.group, self.pp_group = (
                        made["mesh"],
                        made["group"],
                        made["pp_group"],
                    )
            elif sl.sharded:
                m = build_section_mesh(sl, device.type)
                if spec.name == self.name:
                    self.mesh = m
                    if sl.cp > 1:
                        self.cp_group = m["cp"].get_group()
            elif spec.dp > 1 or sl.cp > 1:
                # without a mesh the flat gradient sum runs over every rank (dp x cp)
                g = dist.new_group(self.layout[spec.name])
                if spec.name == self.name:
                    self.group = g
            if sl.cp > 1 and (not sl.sharded or sl.pp > 1):
                for ranks in sl.cp_groups():
                    g = dist.new_group(ranks)
                    if spec.name == self.name and rank in ranks:
                        self.cp_group = g
        # the non-finite guard's flags are agreed among the ranks of trainable sections only:
        # frozen ranks never update, so they keep running ahead of their consumers
        self.guard_names = [s.name for s in self.specs if not s.frozen]
        guard_ranks = sorted(r for n in self.guard_names for r in self.layout[n])
        self.guard_group = None
        if 0 < len(guard_ranks) < world:
            self.guard_group = dist.new_group(guard_ranks)
        self.trainable = not self.section.frozen
        #: the unit's parallel settings (a group's members share them)
        sc = self.unit_config = config.sections[self.members[0]]
        self.strategy = None
        #: per trainable member of a colocated group: ``(name, config, params, mesh,
        #: gradient-sum group, sharded)``; see ``_reduce_member_grads``
        self.member_parts: list = []
        if self.member_comm is not None:
            self._parallelize_members(config)
        elif lay.pp > 1:
            from maestro.runtime.pipeline import setup_stage

            bf16 = torch.bfloat16 if config.dtype == "bfloat16" else None
            setup_stage(self, sc, lay, bf16)
        elif lay.sharded:
            from maestro.parallel.apply import parallelize_section

            bf16 = torch.bfloat16 if config.dtype == "bfloat16" else None
            self.strategy = parallelize_section(
                self.section,
                sc,
                lay,
                self.mesh,
                mixed_precision=bf16,
                where=f"sections.{self.name}",
            )
        else:
            for m in self.members:
                msc = config.sections[m]
                if msc.recompute and not msc.frozen:
                    from maestro.parallel.apply import apply_recompute, transformer_blocks

                    sec_m = self.real_graph[m]
                    where = f"sections.{m}"
                    apply_recompute(transformer_blocks(sec_m.module, sec_m.parallel, where), where)
        #: the gradient-sum group over replicas of a TP-sharded section without FSDP
        self.dp_group = self.strategy.dp_group if self.strategy is not None else None
        #: CP: the section's forward runs on this rank's share of every sequence
        #: (``maestro.parallel.cp``); a sharded section sums its gradients over the CP group
        #: in the step's tail (a plain one's flat sum already spans it)
        self.cp_grad_group = None
        #: a CP producer's ranks each send their own rows of every sequence output
        #: (``maestro.parallel.cp.assemble`` at the consumer): no gather over the group; a
        #: section that cuts its own sequence (``cp_split``) gathers them whole instead
        self.cp_pieces = (
            lay.cp > 1 and not self.graph.is_sink(self.name) and self.section.cp_split is None
        )
        self.sends_outputs = (
            lay.stage_ranks(self.replica, lay.pp - 1, lay.cp_index(rank))[0] == rank
            if self.cp_pieces
            else self.leader
        )
        if lay.cp > 1:
            from maestro.parallel.cp import cp_forward

            self.section._forward = cp_forward(
                self.section._forward,
                lay.cp,
                lay.cp_index(rank),
                self.cp_group,
                f"sections.{self.name}",
                shared=self.section.cp_split is None,
                ranks=lay.cp_peers(rank),
                split=self.section.cp_split,
                gather=not self.cp_pieces,
            )
            if self.mesh is not None:
                self.cp_grad_group = self.cp_group
        self.params = [p for p in self.section.module.parameters() if p.requires_grad]
        self.optimizer = None
        #: ``(section config, parameters, optimizer)`` stepped after each step
        self.opt_parts: list = []
        if len(self.members) > 1:
            from maestro.parallel.zero import ZeroOptimizer
            from maestro.runtime.colocated import ColocatedOptimizer

            parts = []
            for m, msc, ps, mesh, group, _ in self.member_parts:
                if msc.zero and group is not None:
                    opt = ZeroOptimizer(ps, lambda xs, c=msc: make_optimizer(c, xs), group)
                else:
                    opt = make_optimizer(msc, ps)
                parts.append((m, msc, ps, opt))
                self.opt_parts.append((msc, ps, opt, mesh))
            if parts:
                self.optimizer = ColocatedOptimizer(parts)
        elif self.trainable and sc.zero and lay.num_replicas > 1:
            from maestro.parallel.zero import ZeroOptimizer

            self.optimizer = ZeroOptimizer(
                self.params, lambda ps: make_optimizer(sc, ps), self.group or self.dp_group
            )
        elif self.trainable:
            self.optimizer = make_optimizer(sc, self.params)
        if self.optimizer is not None and not self.opt_parts:
            self.opt_parts = [(sc, self.params, self.optimizer, self.mesh)]
        if config.max_memory is not None:
            self._check_memory(parse_bytes(config.max_memory, "max_memory"))
        self.scheduler = resolve_scheduler(config.scheduler)
        #: what the scheduler estimates costs with (``runtime.costs``); fifo needs none
        self.cost_model = None
        if config.scheduler != "fifo":
            from maestro.runtime.costs import runtime_cost_model

            self.cost_model = runtime_cost_model(config, self.workload, shared=True)
            if config.colocated:
                from maestro.plan.colocate import GroupedCostModel

                mbs = {n: s.micro_batch_size for n, s in config.sections.items()}
                splits = {
                    m: config.group_tp(u) // config.sections[m].tp
                    for u, ms in self.units.items()
                    for m in ms
                }
                self.cost_model = GroupedCostModel(
                    self.cost_model, config.section_specs(), self._groups(), mbs, splits
                )
        #: forward-only micro-batches whose outputs may be in flight (sent, not yet received)
        self.max_in_flight = sc.max_in_flight if self.section.frozen else None
        self.transport = Transport(device)
        #: the replicas of this unit that run FSDP's collectives with this one (its shard
        #: group; a colocated group's ``colocated.lockstep_groups``), all padded to the
        #: busiest one's micro-batch count; ``[replica]`` when nothing syncs
        self.lock_replicas = self._lock_replicas()
        tp_index = lay.coordinate(rank)[2]
        self.label = (
            f"{self.name}[{self.replica}]"
            + (f"pp{self.stage_index}" if lay.pp > 1 else "")
            + (f"cp{lay.cp_index(rank)}" if lay.cp > 1 else "")
            + (f"tp{tp_index}" if lay.tp > 1 else "")
        )
        #: ``"stop"`` (raise ``NonFiniteError``) or ``"skip"`` (no update on any rank)
        self.on_nonfinite = "stop"
        #: the total steps the LR schedule decays over (a resume sets the checkpoint's)
        self.lr_total_steps = config.steps
        #: sample ids this rank processed in the last step, and whether that step was skipped
        self.last_ids: list[int] = []
        self.last_skipped = False
        self._batch_checked = False
        #: ``sample id -> tokens`` of the batch being run (what a CP consumer's shares cut)
        self._lengths: dict[int, int | None] = {}
        #: ``(batch fingerprint, schedule)`` of the last step
        self._schedule_cache: tuple[int, Schedule] | None = None
        if lay.cp > 1 and lay.pp == 1:
            self._probe_cp()

    def _probe_cp(self) -> None:
        """Refuse at start-up, in one line, a CP section whose attention cannot be split (no
        SDPA call, a mask, a forward that runs samples one by one, a sequence shorter than
        ``2 * cp``): one forward of the first batch's first sample for this section, its
        producers' inputs absent (as for a padding micro-batch), in ``eval()`` mode and without
        gradients, on every rank of the section (its collectives stay in step). A pipelined
        section's first step is its probe (a later stage needs the earlier one's output)."""
        sec = self.section
        batch = batch_to(self.workload.batch(0), self.device)
        sample = next((s for s in batch if sec.activated(s)), None)
        if sample is None:
            return
        module = sec.module
        training = [m.training for m in module.modules()]
        module.eval()
        try:
            with torch.inference_mode() if sec.frozen else torch.no_grad():
                sec.run([sample], {p: [None] for p in sec.inputs})
        finally:
            for m, t in zip(module.modules(), training):
                m.training = t

    def _group_comms(self, unit: str, device_type: str) -> dict:
        """A colocated group's process groups, created by every rank in the same order:
        ``all`` (its ranks, when more than one), ``meshes`` (``member -> DeviceMesh`` of the
        members at ``tp > 1``), ``replica`` (this rank's group replica, when ``T > 1``)."""
        ranks = self.layout[unit]
        cfg = self.config
        T = cfg.group_tp(unit)
        out: dict = {"all": None, "meshes": {}, "replica": None, "T": T}
        if len(ranks) > 1:
            out["all"] = dist.new_group(ranks)
        for m in self.units[unit]:
            msc = cfg.sections[m]
            if msc.tp > 1 or msc.fsdp > 1:
                lay = SectionLayout(m, tuple(ranks), msc.dp, msc.fsdp, msc.tp)
                out["meshes"][m] = build_section_mesh(lay, device_type)
        if T > 1:
            for j in range(len(ranks) // T):
                g = dist.new_group(ranks[j * T : (j + 1) * T])
                if self.rank in ranks[j * T : (j + 1) * T]:
                    out["replica"] = g
        return out

    def _parallelize_members(self, config: TrainConfig) -> None:
        """Each member of this rank's colocated group on its own grid: TP on its mesh,
        recompute, and the group its gradients sum over (its ``dp`` replicas)."""
        from maestro.parallel.apply import apply_recompute, parallelize_section, transformer_blocks

        comm = self.member_comm
        ranks = self.layout[self.name]
        bf16 = torch.bfloat16 if config.dtype == "bfloat16" else None
        for m in self.members:
            msc = config.sections[m]
            mesh = comm["meshes"].get(m)
            # the group's own Section of the member: FSDP routes its forward through a root
            sec = self.section.member_sections[m]
            if mesh is not None:
                lay = SectionLayout(m, tuple(ranks), msc.dp, msc.fsdp, msc.tp)
                st = parallelize_section(
                    sec, msc, lay, mesh, mixed_precision=bf16, where=f"sections.{m}"
                )
                group = st.dp_group
            else:
                if msc.recompute and not msc.frozen:
                    where = f"sections.{m}"
                    apply_recompute(transformer_blocks(sec.module, sec.parallel, where), where)
                group = comm["all"]
            if msc.frozen:
                continue
            ps = [p for p in sec.module.parameters() if p.requires_grad]
            self.member_parts.append((m, msc, ps, mesh, group, mesh is not None))
        from maestro.runtime.colocated import GroupContext

        T = comm["T"]
        self.section.colocated = GroupContext(
            T=T,
            tp={m: config.sections[m].tp for m in self.members},
            index=ranks.index(self.rank) % T,
            group=comm["replica"],
            fsdp=any(config.sections[m].fsdp > 1 for m in self.members),
        )

    def _lock_replicas(self) -> list[int]:
        """``lock_replicas`` (see ``__init__``)."""
        ctx = getattr(self.section, "colocated", None)
        if ctx is not None and ctx.fsdp:
            from maestro.runtime.colocated import lockstep_groups

            groups = lockstep_groups(self.config, self.name)
            return next(g for g in groups if self.replica in g)
        if self.strategy is not None and self.strategy.pad:
            return self.layouts[self.name].shard_group(self.replica)
        return [self.replica]

    @property
    def pads(self) -> bool:
        """Whether every replica of a shard group runs the same number of micro-batches and
        backwards (FSDP's collectives: ``strategy.pad``, or a colocated group's FSDP
        members), padding with zero-contribution ones (``lock_replicas``)."""
        ctx = getattr(self.section, "colocated", None)
        return (self.strategy is not None and self.strategy.pad) or (ctx is not None and ctx.fsdp)

    @property
    def staged(self) -> bool:
        """Whether this unit is a colocated group whose replica spans several ranks or
        that holds FSDP members (its backward is staged:
        ``maestro.runtime.colocated.staged_backward``)."""
        ctx = getattr(self.section, "colocated", None)
        return ctx is not None and (ctx.T > 1 or ctx.fsdp)

    def _lockstep(self, batch, active, schedule: Schedule | None, k: int) -> None:
        """Before micro-batch ``k`` of a colocated group with FSDP members: how many chunks
        each FSDP member runs on every rank (the most any rank of this replica's lockstep
        group has, counted from the schedule every rank holds), so FSDP's collectives stay in
        step."""
        ctx = getattr(self.section, "colocated", None)
        if ctx is None or not ctx.fsdp:
            return
        from maestro.runtime.colocated import chunks, split_even

        secs = self.section.member_sections
        fs = [m for m in self.members if self.config.sections[m].fsdp > 1]
        if k == 0 or not ctx.fallback:
            ctx.fallback = {
                m: next((smp for smp in batch if secs[m].activated(smp)), None) for m in fs
            }
        pad = next(smp for smp in batch if self.name in active[smp["id"]])
        reps = [schedule.order[self.name][r] for r in self.lock_replicas]
        ctx.targets = {}
        for m in fs:
            msc = self.config.sections[m]
            most = 0
            for rep in reps:
                samples = [batch[i] for i in rep[k].sample_ids] if k < len(rep) else [pad]
                idx = [i for i, smp in enumerate(samples) if secs[m].activated(smp)]
                for part in split_even(idx, ctx.splits(m)):
                    toks = [self._tokens(samples[i]) for i in part]
                    n = len(chunks(part, msc.micro_batch_size, msc.token_budget, toks))
                    most = max(most, n)
            ctx.targets[m] = most

    def _tokens(self, sample) -> float:
        """A sample's tokens, as the colocated group's forward chunks by them."""
        return float(self.workload.sample_cost(sample).get("tokens", 1.0))

    def _backward(self, tensors, grads) -> None:
        """One micro-batch's backward from ``tensors`` (with ``grads``)."""
        if self.staged:
            self.section.backward(tensors, grads)
        elif tensors:
            torch.autograd.backward(tensors, grads)

    def _reduce_member_grads(self) -> None:
        """Sum each trainable colocated member's gradients over its own replicas."""
        for _, _, ps, mesh, group, _ in self.member_parts:
            if group is None:
                continue
            if mesh is not None:
                pgrads.allreduce_grads(ps, group)
            else:
                flat_allreduce_grads(ps, group)

    def predicted_memory(self) -> dict[str, int]:
        """``section -> bytes`` of training state this rank will hold (its section, or every
        member of its colocated group): ``parallel.memory.predicted_state_bytes``."""
        from maestro.parallel.memory import predicted_state_bytes

        out = {}
        for m, module, opt, _ in self._member_states():
            msc = self.config.sections[m]
            # ZeRO-1 shards the optimizer state over the section's dp replicas (and, without
            # a mesh, its CP ranks too: they share the flat gradient-sum group)
            zero = msc.dp * (msc.cp if msc.tp == 1 and msc.dp > 1 else 1) if msc.zero else 1
            out[m] = predicted_state_bytes(
                module.parameters(), opt, trainable=not msc.frozen, zero=zero
            )
        return out

    def _check_memory(self, budget: int) -> None:
        """``ValueError`` (one line) when this rank's sections do not fit ``max_memory``."""
        per = self.predicted_memory()
        total = sum(per.values())
        if total > budget:
            parts = ", ".join(f"{m} {fmt_bytes(b)}" for m, b in per.items())
            raise ValueError(
                f"max_memory: rank {self.rank} ({self.name}) needs {fmt_bytes(total)} of "
                f"training state ({parts}), over the budget of {fmt_bytes(budget)}; give it "
                f"more ranks (dp, tp, fsdp, zero) or raise max_memory"
            )

    def _groups(self) -> list[tuple[str, ...]]:
        """The layout's partition of the sections (``maestro.plan.colocate``'s groups)."""
        return [tuple(ms) for ms in self.units.values()]

    def _sample_infos(self, batch) -> list[SampleInfo]:
        """The scheduler's view of ``batch``: per unit (a group's members' costs carried as
        ``member/key``, as ``GroupedCostModel`` reads them)."""
        infos = self.workload.sample_infos(batch, self.real_graph)
        if not self.config.colocated:
            return infos
        from maestro.plan.colocate import merged_samples

        return merged_samples(infos, self._groups())

    def _rank_of(self, section: str, schedule: Schedule, sample_id: int) -> int:
        """The rank that sends ``section``'s messages about ``sample_id`` (its TP leader)."""
        return self.layouts[section].leader(schedule.replica_of(section, sample_id))

    def _grad_src(self, section: str, schedule: Schedule, sample_id: int) -> int:
        """The rank that sends ``section``'s input gradients about ``sample_id`` (its first
        stage's TP leader)."""
        return self.layouts[section].input_grad_leader(schedule.replica_of(section, sample_id))

    def _ranks_of(self, section: str, schedule: Schedule, sample_id: int) -> list[int]:
        """Every rank that needs ``section``'s inputs for ``sample_id`` (its TP group)."""
        return self.layouts[section].replica_ranks(schedule.replica_of(section, sample_id))

    def _send_outputs(self, consumers, ids, outs, active, schedule, tag, step) -> None:
        """Send a micro-batch's per-sample outputs to every consumer rank that needs them: one
        coalesced message per destination (the leader of a TP group sends; training and eval
        alike). A consumer rank of a CP group gets its ``maestro.parallel.cp.share`` of each
        sequence only."""
        for c in consumers if self.sends_outputs else ():
            by_dst: dict[int, list[tuple[int, Outputs]]] = {}
            lay = self.layouts[c]
            # a consumer that assembles its own sequence (``cp_split``) gets whole outputs; a
            # CP producer's rank sends its pieces (the consumer assembles and cuts them)
            shares = (
                lay.cp > 1
                and getattr(self.graph[c], "cp_split", None) is None
                and not self.cp_pieces
            )
            for sid, o in zip(ids, outs):
                if c in active[sid]:
                    for dst in self._ranks_of(c, schedule, sid):
                        if shares and self._lengths.get(sid) is not None:
                            from maestro.parallel.cp import share

                            item = share(o, self._lengths[sid], lay.cp, lay.cp_index(dst))
                        else:
                            item = o
                        by_dst.setdefault(dst, []).append((sid, item))
            for dst, items in by_dst.items():
                self.transport.send(dst, tag, items, step)

    def _pad_micro_batch(self, batch, active, step: int, k: int):
        """A forward (and, trainable, a zero backward) that changes no gradient.

        Keeps FSDP's collectives in step when this replica has fewer micro-batches than
        another of its shard group (``lock_replicas``): the first sample of the batch that
        activates the section, its producers' inputs absent (``None``, as for a sample a
        producer skips); a sink's loss is multiplied by 0, a producer's backward gets zero
        gradients.
        """
        sample = next(s for s in batch if self.name in active[s["id"]])
        ins = {p: [None] for p in self.section.inputs}
        self._lockstep(batch, active, self._step_schedule, k)
        with self.tracer.span(f"{self.name} pad fwd", "forward", mb=k, step=step):
            with torch.inference_mode() if self.section.frozen else nullcontext():
                outs = self.section.run([sample], ins)
        if self.section.frozen:
            return None
        if self.graph.is_sink(self.name):
            with self.tracer.span(f"{self.name} pad bwd", "backward", mb=k, step=step):
                self._backward([sink_loss(self.name, outs[0], sample["id"]) * 0.0], [None])
            return None
        return outs

    def _prepare(self, step: int):
        """The step's global batch (on this device), its schedule and sample infos: the same
        on every rank, computed locally."""
        with self.tracer.span("batch + schedule", "schedule"):
            # every rank builds the same batch and schedule: no coordination needed
            batch = batch_to(self.workload.batch(step), self.device)
            self._lengths = _token_lengths(batch)
            fp = batch_fingerprint(batch)
            if not self._batch_checked:
                # once per run, a collective check: a diverging pipeline is an error, not a hang
                check_same_batch(fp, step)
                self._batch_checked = True
            # afterwards every message carries the sender's fingerprint (no extra sync)
            self.transport.batch_checks = {step - 1: self.transport.batch_checks.get(step - 1, 0)}
            self.transport.batch_checks[step] = fp
            infos = self._sample_infos(batch)
            if self._schedule_cache is not None and self._schedule_cache[0] == fp:
                # the same global batch again (an emulated run replays its planned batch):
                # schedulers are deterministic, so its schedule is the one computed before
                schedule = self._schedule_cache[1]
            else:
                with self.tracer.span("scheduler", "scheduler"):
                    schedule = self.scheduler(infos, self.specs, self.cost_model)
                check_schedule(schedule, infos, self.specs)
                self._schedule_cache = (fp, schedule)
        return batch, schedule, infos

    def step(self, step: int) -> float:
        """Run one training step; returns this rank's share of the (normalised) loss."""
        if self.stage is not None:
            from maestro.runtime.pipeline import pipeline_step

            return pipeline_step(self, step)
        batch, schedule, infos = self._prepare(step)
        cost = {i.sample_id: i.cost for i in infos}
        norm = self.workload.normaliser(batch)
        active = {i.sample_id: i.sections for i in infos}
        sec, graph, tr = self.section, self.graph, self.tracer
        sink = graph.is_sink(self.name)
        consumers = graph.consumers(self.name)
        grad_from = [c for c in consumers if not graph[c].frozen]
        # one message stream per (source, step, direction): steps never mix, so a frozen
        # producer may already send the next step's outputs
        tag_act, tag_grad = message_tags(step)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        kept = []
        loss_total = 0.0
        mine = schedule.order[self.name][self.replica]
        # TP peers process the same samples: only the leader logs them (no duplicate ids)
        self.last_ids = [sid for mb in mine for sid in mb.sample_ids] if self.leader else []
        self.last_skipped = False
        pad = self.pads
        ctx = getattr(sec, "colocated", None)
        self._step_schedule = schedule
        if ctx is not None:
            ctx.fallback = {}
        # FSDP: as many micro-batches as the busiest replica of this one's shard group
        reps = schedule.order[self.name]
        num_pad = max(len(reps[r]) for r in self.lock_replicas) - len(mine) if pad else 0
        for k, mb in enumerate(mine):
            ids = mb.sample_ids
            ins, received = self._receive_inputs(ids, schedule, active, tag_act, k, self.trainable)
            if self.max_in_flight is not None:
                with tr.span("run-ahead bound", "wait", mb=k):
                    self.transport.limit_in_flight(self.max_in_flight)
            feats = micro_batch_features(cost[i] for i in ids)
            self._lockstep(batch, active, schedule, k)
            with tr.span(f"{self.name} fwd", "forward", mb=k, step=step, feats=feats):
                with torch.inference_mode() if sec.frozen else nullcontext():
                    outs = sec.run([batch[i] for i in ids], ins)
            with tr.span("send", "send", mb=k, step=step) as targs:
                sent = self.transport.bytes_sent
                self._send_outputs(consumers, ids, outs, active, schedule, tag_act, step)
                targs["bytes"] = self.transport.bytes_sent - sent
            if k == 0:
                kill_point(step, self.rank)
            if sink:
                with tr.span(f"{self.name} bwd", "backward", mb=k, step=step):
                    per = [sink_loss(self.name, o, sid) for o, sid in zip(outs, ids)]
                    for i, sid in enumerate(ids):
                        f = poison_factor(step, sid)
                        if f is not None:
                            per[i] = per[i] * f
                    loss = torch.stack(per).sum() / norm
                    self._backward([loss], [None])
                loss_total += loss.item()
                self._send_input_grads(received, schedule, tag_grad, step)
            elif self.trainable:
                kept.append((k, ids, outs, received))
        for j in range(num_pad):
            outs = self._pad_micro_batch(batch, active, step, len(mine) + j)
            if outs is not None:
                kept.append((len(mine) + j, (), outs, []))
        for k, ids, outs, received in kept:
            tensors, grads = self._output_grads(k, ids, outs, grad_from, active, schedule, tag_grad)
            with tr.span(f"{self.name} bwd", "backward", mb=k, step=step):
                self._backward(tensors, grads)
            self._send_input_grads(received, schedule, tag_grad, step)
        return self._step_tail(step, sink, loss_total)

    def _receive_inputs(self, ids, schedule, active, tag, k, trainable: bool):
        """``(inputs, received)`` of micro-batch ``k`` (samples ``ids``): the producers'
        per-sample outputs (``None`` where a producer skipped the sample) and, when
        ``trainable``, those from trainable producers, marked to require gradients, which go
        back (``[(producer, sample id, outputs)]``)."""
        ins: dict[str, list[Outputs | None]] = {}
        received: list[tuple[str, int, Outputs]] = []
        for p in self.section.inputs:
            needs_grad = trainable and not self.graph[p].frozen
            col: list[Outputs | None] = []
            for sid in ids:
                if p not in active[sid]:
                    col.append(None)
                    continue
                with self.tracer.span(f"recv {p}", "wait", mb=k):
                    got = self._receive_output(p, schedule, sid, tag)
                if needs_grad:
                    for t in got.values():
                        if t.is_floating_point():
                            t.requires_grad_(True)
                    received.append((p, sid, got))
                col.append(got)
            ins[p] = col
        return ins, received

    def _output_grads(self, k, ids, outs, grad_from, active, schedule, tag_grad):
        """``(tensors, grads)`` of micro-batch ``k``'s backward: its outputs and the gradients
        its trainable consumers sent for them; under FSDP (``strategy.pad`` or a group's FSDP
        members) every output that needs one, with zeros where nobody sent any (padding
        micro-batches included), so every rank runs one backward per micro-batch."""
        tensors, grads = [], []
        for sid, o in zip(ids, outs):
            for c in grad_from:
                if c in active[sid]:
                    with self.tracer.span(f"recv grad {c}", "wait", mb=k):
                        g = self._receive_grads(c, schedule, sid, o, tag_grad)
                    for key, gt in g.items():
                        if o[key].requires_grad:  # not a frozen group member's output
                            tensors.append(o[key])
                            grads.append(gt)
        if self.pads:
            have = {id(t) for t in tensors}
            for o in outs:
                for t in o.values():
                    if t.requires_grad and id(t) not in have:
                        tensors.append(t)
                        grads.append(torch.zeros_like(t))
        return tensors, grads

    def _receive_output(self, p: str, schedule: Schedule, sid: int, tag: int) -> Outputs:
        """Producer ``p``'s outputs for sample ``sid`` as this rank's forward takes them: from
        a CP producer, every rank's pieces assembled whole (``maestro.parallel.cp.assemble``),
        then cut to this rank's share when it is a CP rank itself."""
        lp = self.layouts[p]
        rep = schedule.replica_of(p, sid)
        pieces = getattr(self.graph[p], "cp_split", None) is None and lp.cp > 1
        if not pieces or self.graph.is_sink(p):
            return self.transport.get(self._rank_of(p, schedule, sid), tag, sid)
        from maestro.parallel import cp as pcp

        parts = [
            self.transport.get(lp.stage_ranks(rep, lp.pp - 1, c)[0], tag, sid) for c in range(lp.cp)
        ]
        n = self._lengths[sid]
        got = {
            k: pcp.assemble([q[k] for q in parts], n, lp.cp)
            if isinstance(v, torch.Tensor) and v.dim() >= 1
            else v
            for k, v in parts[0].items()
        }
        me = self.layouts[self.name]
        if me.cp > 1 and self.section.cp_split is None:
            got = pcp.share(got, n, me.cp, me.cp_index(self.rank))
        return got

    def _receive_grads(self, c: str, schedule: Schedule, sid: int, o: Outputs, tag: int):
        """Consumer ``c``'s gradients of output ``o`` (sample ``sid``); from a CP consumer,
        the sum of every CP rank's share (``maestro.parallel.cp.unshare``); on a CP
        producer's rank, the rows of its own piece (``own_rows``)."""
        from maestro.parallel import cp as pcp

        lay = self.layouts[c]
        n = self._lengths.get(sid)
        if lay.cp == 1:
            out = self.transport.get(self._grad_src(c, schedule, sid), tag, sid)
        else:
            rep = schedule.replica_of(c, sid)
            out = {}
            for i in range(lay.cp):
                part = self.transport.get(lay.stage_ranks(rep, 0, i)[0], tag, sid)
                for key, gt in part.items():
                    if n is None:
                        full = gt
                    elif self.cp_pieces:  # ``o`` holds this rank's rows only
                        full = pcp.unshare_rows(gt, n, lay.cp, i)
                    else:
                        full = pcp.unshare(gt, o[key], n, lay.cp, i)
                    out[key] = full if key not in out else out[key] + full
        if self.cp_pieces and n is not None:
            me = self.layouts[self.name]
            out = {
                k: g if g.shape == o[k].shape else pcp.own_rows(g, n, me.cp, me.cp_index(self.rank))
                for k, g in out.items()
            }
        return out

    def _step_tail(self, step: int, sink: bool, loss_total: float) -> float:
        """After a step's micro-batches: flush, the non-finite guard, the gradient sums and
        the optimizer step; returns this rank's share of the loss."""
        tr = self.tracer
        with tr.span("flush sends", "wait"):
            self.transport.flush(before_step=step)
        assert not any(self.transport.inbox.values()), "unconsumed messages at end of step"
        # the launcher sums every rank's loss: TP peers computed the same one
        reported = loss_total if self.leader else 0.0
        if self.trainable and not self._guard(step, sink, loss_total):
            self.last_skipped = True
            self.optimizer.zero_grad(set_to_none=True)
            return reported
        if self.optimizer is not None:
            if self.member_comm is not None:
                with tr.span("all-reduce grads", "comm"):
                    self._reduce_member_grads()
            elif self.group is not None:
                with tr.span("all-reduce grads", "comm"):
                    flat_allreduce_grads(self.params, self.group)
            elif self.dp_group is not None:  # TP replicas; HSDP across shard groups
                with tr.span("all-reduce grads", "comm"):
                    pgrads.allreduce_grads(self.params, self.dp_group)
            if self.cp_grad_group is not None:  # each CP rank holds its share's gradients
                with tr.span("all-reduce grads (cp)", "comm"):
                    pgrads.allreduce_grads(self.params, self.cp_grad_group)
            if self.stage is not None:
                from maestro.runtime.pipeline import reduce_shared_grads

                with tr.span("all-reduce shared grads (pp)", "comm"):
                    reduce_shared_grads(self)
            with tr.span("optimizer", "optimizer"):
                # one part per section (a colocated group's members each clip and step alone)
                for sc, params, opt, mesh in self.opt_parts:
                    if self.stage is not None:
                        from maestro.runtime.pipeline import clip_pipeline_grads

                        clip_pipeline_grads(self, sc.grad_clip)
                    elif mesh is not None:
                        pgrads.clip_grads(params, sc.grad_clip, mesh)  # all shards
                    else:
                        clip_grads(params, sc.grad_clip)
                    set_lr(opt, sc, step, self.lr_total_steps)
                    opt.step()
        return reported

    def evaluate(self, batches) -> tuple[dict[str, float], float, int]:
        """Run held-out global batches through this layout and scheduler, forward only.

        No gradient (frozen sections under ``inference_mode``, trainable ones under
        ``no_grad``), no optimizer step, modules in ``eval()`` mode for the pass; every rank
        runs the same micro-batches (FSDP padding included) as a training step would, so the
        sections' collectives stay in step. Eval batch ``b`` travels as virtual step
        ``evaluation.EVAL_STEP_BASE + b``. Returns ``(sums, total normaliser, samples)``:
        this rank's sums of its sink's per-sample losses and other scalars
        (``evaluation.add_sink_outputs``; empty off the sinks and on TP peers).
        """
        from maestro.runtime import evaluation as ev

        sec, graph, tr = self.section, self.graph, self.tracer
        sink = graph.is_sink(self.name)
        consumers = graph.consumers(self.name)
        ctx = getattr(sec, "colocated", None)
        pad = self.pads
        no_grad = torch.inference_mode if sec.frozen else torch.no_grad
        modules = [sec.module] + [self.real_graph[m].module for m in self.members]
        sums: dict[str, float] = {}
        norm_total, count = 0.0, 0
        with ev.eval_mode(modules), ev.gathered_through_eval(modules):
            for b, batch in enumerate(batches):
                vstep = ev.EVAL_STEP_BASE + b
                with tr.span("eval batch + schedule", "schedule"):
                    batch = batch_to(batch, self.device)
                    self._lengths = _token_lengths(batch)
                    fp = batch_fingerprint(batch)
                    if not getattr(self, "_eval_checked", False):
                        try:
                            check_same_batch(fp, vstep)
                        except ValueError as e:
                            msg = str(e).split(": ", 1)[-1]
                            raise ValueError(f"eval batch {b}: {msg}") from None
                        self._eval_checked = True
                    self.transport.batch_checks[vstep] = fp
                    infos = self._sample_infos(batch)
                    schedule = self.scheduler(infos, self.specs, self.cost_model)
                    check_schedule(schedule, infos, self.specs)
                norm_total += self.workload.normaliser(batch)
                count += len(batch)
                active = {i.sample_id: i.sections for i in infos}
                tag_act, _ = message_tags(vstep)
                if ctx is not None:
                    ctx.fallback = {}
                mine = schedule.order[self.name][self.replica]
                reps = schedule.order[self.name]
                num_pad = max(len(reps[r]) for r in self.lock_replicas) - len(mine) if pad else 0
                if self.stage is not None:
                    from maestro.runtime.pipeline import pipeline_eval

                    pipeline_eval(self, batch, schedule, active, vstep, sums)
                    mine, num_pad = [], 0
                for k, mb in enumerate(mine):
                    ids = mb.sample_ids
                    ins, _ = self._receive_inputs(ids, schedule, active, tag_act, k, False)
                    if self.max_in_flight is not None:
                        with tr.span("run-ahead bound", "wait", mb=k):
                            self.transport.limit_in_flight(self.max_in_flight)
                    self._lockstep(batch, active, schedule, k)
                    with tr.span(f"{self.name} eval fwd", "forward", mb=k):
                        with no_grad():
                            outs = sec.run([batch[i] for i in ids], ins)
                    with tr.span("eval send", "send", mb=k):
                        self._send_outputs(consumers, ids, outs, active, schedule, tag_act, vstep)
                    if sink and self.leader:
                        ev.add_sink_outputs(sums, self.name, outs)
                for j in range(num_pad):
                    # FSDP: as many forwards as the busiest replica of the shard group
                    sample = next(s for s in batch if self.name in active[s["id"]])
                    self._lockstep(batch, active, schedule, len(mine) + j)
                    with tr.span(f"{self.name} eval pad fwd", "forward", mb=len(mine) + j):
                        with no_grad():
                            sec.run([sample], {p: [None] for p in sec.inputs})
                with tr.span("flush sends", "wait"):
                    self.transport.flush()
                assert not any(self.transport.inbox.values()), "unconsumed messages after eval"
                self.transport.batch_checks.pop(vstep, None)
        ev.reshard(modules)
        return sums, norm_total, count

    def _guard(self, step: int, sink: bool, loss: float) -> bool:
        """Agree with every trainable rank whether the step is finite; ``True`` to update.

        Runs before the DP all-reduce, so a NaN on one replica is caught before it spreads.
        """
        import math

        flags = torch.zeros(2 * len(self.guard_names), dtype=torch.float64, device=self.device)
        i = self.guard_names.index(self.name)
        flags[2 * i] = float(sink and not math.isfinite(loss))
        flags[2 * i + 1] = float(not pgrads.grads_finite(self.params))
        with self.tracer.span("non-finite guard", "comm"):
            dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=self.guard_group)
        msg = nonfinite_message(step, flags.tolist(), self.guard_names)
        if msg is None:
            return True
        if self.on_nonfinite == "stop":
            raise NonFiniteError(f"{msg}; stopped before any optimizer update (--on-nonfinite)")
        return False

    def state_bytes(self) -> dict[str, int]:
        """This rank's bytes of parameters, gradients and optimizer state."""
        from maestro.parallel.memory import state_bytes

        return state_bytes(self.section.module.parameters(), self.optimizer)

    def _send_input_grads(
        self, received: list[tuple[str, int, Outputs]], schedule: Schedule, tag: int, step: int
    ) -> None:
        if not self.sends_input_grads:  # TP peers hold the same (all-reduced) input gradients
            return
        by_dst: dict[int, list[tuple[int, Outputs]]] = {}
        for p, sid, got in received:
            g = _grads_of(got)
            # the producer's ranks that hold the outputs (its last stage under pp)
            for dst in self.layouts[p].output_ranks(schedule.replica_of(p, sid)):
                by_dst.setdefault(dst, []).append((sid, g))
        with self.tracer.span("send grads", "send"):
            for dst, items in by_dst.items():
                self.transport.send(dst, tag, items, step)

    def finish(self) -> None:
        """Complete every outstanding send (call after the last step)."""
        self.transport.flush()
