"""A pipelined section's step on one rank: its stage's micro-batches in 1F1B order.

Every stage of a replica runs the same micro-batches (the schedule's list for the replica,
plus FSDP's padding ones), in the same order, so the stages' point-to-point messages and each
stage's FSDP/TP collectives line up. Per micro-batch ``k``:

- every stage receives the section's inputs from producer sections (a stage after the first
  needs them too: the section's forward runs its code before the first block on every
  stage, ``maestro.parallel.pipeline``); a stage after the first also receives the hidden
  state of ``k`` from the previous stage's TP leader;
- a stage before the last sends its hidden state to every rank of the next stage; the last
  stage sends the outputs to consumers (and, for a sink, runs the loss backward at once);
- backwards run in reverse stage order: the last stage's gradient of its incoming hidden
  state goes back to the previous stage with the gradients of the section's inputs that
  stage's forward produced, and each stage adds its own; the first stage sends the sums to
  the producers.

Order on stage ``s`` of ``P`` with ``M`` micro-batches: a sink runs 1F1B (``min(P - 1 - s,
M)`` forwards, then one forward and one backward at a time, then the remaining backwards;
the last stage alternates from the start); a trainable section whose gradients come from
consumers runs every forward and then every backward (its consumers batch samples their own
way, so a backward can wait for any of its forwards); a frozen one runs forwards only.

Messages between stages use the step's tags with the micro-batch index as the id; the
gradients of the section's inputs ride in the same message under negative ids.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from maestro.costmodel import micro_batch_features
from maestro.parallel import grads as pgrads
from maestro.parallel.pipeline import HIDDEN
from maestro.runtime.failures import sink_loss
from maestro.runtime.faults import kill_point, poison_factor
from maestro.runtime.wire import message_tags


def setup_comms(worker, layout, device_type: str) -> dict:
    """Process groups of a pipelined section, created by every rank in the same order: each
    stage's mesh (FSDP/TP) or flat gradient-sum group, and one group per (replica, TP index)
    over its stages (the shared gradients' sum; replica 0's TP index 0 also gathers
    checkpoints). Returns this rank's ``{"mesh", "group", "pp_group"}``."""
    from maestro.parallel.mesh import build_section_mesh

    rank = worker.rank
    out = {"mesh": None, "group": None, "pp_group": None}
    for s in range(layout.pp):
        stl = layout.stage_layout(s)
        if stl.sharded:
            m = build_section_mesh(stl, device_type)
            if rank in stl.ranks:
                out["mesh"] = m
        elif len(stl.ranks) > 1:  # replicas (and CP ranks): the flat gradient sum
            g = dist.new_group(list(stl.ranks))
            if rank in stl.ranks:
                out["group"] = g
    for rep in range(layout.num_replicas):
        for c in range(layout.cp):
            for t in range(layout.tp):
                ranks = layout.pipeline_ranks(rep, t, c)
                g = dist.new_group(ranks)
                if rank in ranks:
                    out["pp_group"] = g
    return out


def setup_stage(worker, sc, layout, mixed_precision) -> None:
    """Cut this rank's section to its stage, then TP, recompute and FSDP on the stage's
    blocks over the stage's grid, then the stage hooks (``maestro.parallel.pipeline``)."""
    from maestro.parallel.apply import apply_recompute, parallelize_section
    from maestro.parallel.pipeline import make_stage

    where = f"sections.{worker.name}"
    stage = make_stage(worker.section, worker.stage_index, layout.pp, where)
    stl = layout.stage_layout(worker.stage_index)
    if stl.sharded:
        worker.strategy = parallelize_section(
            worker.section,
            sc,
            stl,
            worker.mesh,
            mixed_precision=mixed_precision,
            where=where,
            blocks=stage.blocks,
        )
    elif sc.recompute and not worker.section.frozen:
        apply_recompute(stage.blocks, where)
    stage.install_hooks()
    stage.refresh(worker.section.module)  # FSDP2 replaced the parameters with DTensors
    worker.stage = stage
    # with cp, each CP rank's stages form their own chain (the same share of every sequence)
    rep, s, c = worker.replica, worker.stage_index, layout.cp_index(worker.rank)
    worker.stage_leader = layout.stage_ranks(rep, s, c)[0] == worker.rank
    worker.prev_leader = layout.stage_ranks(rep, s - 1, c)[0] if s > 0 else None
    worker.prev_ranks = layout.stage_ranks(rep, s - 1, c) if s > 0 else []
    worker.next_leader = layout.stage_ranks(rep, s + 1, c)[0] if s < layout.pp - 1 else None
    worker.next_ranks = layout.stage_ranks(rep, s + 1, c) if s < layout.pp - 1 else []


def order(pp: int, stage: int, num: int, sink: bool, frozen: bool) -> list[tuple[str, int]]:
    """``[("F" | "B", micro-batch)]`` of one stage (see the module docstring)."""
    if frozen:
        return [("F", k) for k in range(num)]
    if not sink:
        return [("F", k) for k in range(num)] + [("B", k) for k in range(num)]
    warm = min(pp - 1 - stage, num)
    out = [("F", k) for k in range(warm)]
    for k in range(num - warm):
        out += [("F", warm + k), ("B", k)]
    return out + [("B", k) for k in range(num - warm, num)]


def _input_key(producer: str, key: str) -> str:
    return f"{producer}\x1f{key}"


def _micro_batches(worker, schedule, batch, active):
    """This replica's micro-batches: ``[(sample ids, is padding)]`` (FSDP pads to the
    busiest replica of the shard group; a padding micro-batch is one activated sample with
    no inputs and zero weight)."""
    mine = schedule.order[worker.name][worker.replica]
    out = [(tuple(mb.sample_ids), False) for mb in mine]
    if worker.pads:
        reps = schedule.order[worker.name]
        num_pad = max(len(reps[r]) for r in worker.lock_replicas) - len(mine)
        pad = next(s["id"] for s in batch if worker.name in active[s["id"]])
        out += [((pad,), True)] * num_pad
    return out


def _forward(worker, k, mb, batch, schedule, active, step, tag_act, grad_mode):
    """Stage forward of micro-batch ``k``; returns ``(outs, incoming, received)``."""
    sec, st, tr = worker.section, worker.stage, worker.tracer
    ids, is_pad = mb
    trainable = worker.trainable and grad_mode
    if is_pad:  # a padding micro-batch's sample has its producers absent
        ins, received = {p: [None] for p in sec.inputs}, []
    else:
        ins, received = worker._receive_inputs(ids, schedule, active, tag_act, k, trainable)
    incoming = None
    if not st.first:
        with tr.span("recv stage", "wait", mb=k):
            incoming = worker.transport.get(worker.prev_leader, tag_act, k)["h"]
        if trainable:
            incoming.requires_grad_(True)
        st.incoming = incoming
    if worker.max_in_flight is not None:
        with tr.span("run-ahead bound", "wait", mb=k):
            worker.transport.limit_in_flight(worker.max_in_flight)
    samples = [batch[i] for i in ids]
    feats = micro_batch_features(worker.costs[i] for i in ids) if worker.costs else None
    if sec.frozen:
        mode = torch.inference_mode()
    elif not grad_mode:
        mode = torch.no_grad()
    else:
        mode = nullcontext()
    label = "pad fwd" if is_pad else "fwd"
    with tr.span(f"{worker.name} {label}", "forward", mb=k, step=step, feats=feats):
        with mode:
            outs = sec.run(samples, ins)
    if not st.last:
        if worker.stage_leader:
            with tr.span("send stage", "send", mb=k, step=step):
                h = outs[0][HIDDEN]
                for dst in worker.next_ranks:
                    worker.transport.send(dst, tag_act, [(k, {"h": h})], step)
    elif not is_pad:
        consumers = worker.graph.consumers(worker.name)
        with tr.span("send", "send", mb=k, step=step):
            worker._send_outputs(consumers, ids, outs, active, schedule, tag_act, step)
    return outs, incoming, received


def _backward(worker, k, mb, state, batch, schedule, active, step, tag_grad, norm):
    """Stage backward of micro-batch ``k``; returns the loss it added (a sink's last
    stage)."""
    ids, is_pad = mb
    outs, incoming, received = state
    st, tr, graph = worker.stage, worker.tracer, worker.graph
    loss_value = 0.0
    if st.last and graph.is_sink(worker.name):
        with tr.span(f"{worker.name} bwd", "backward", mb=k, step=step):
            sids = list(ids) + [None] * (len(outs) - len(ids))  # a pad has no ids
            per = [sink_loss(worker.name, o, sid) for o, sid in zip(outs, sids)]
            if is_pad:
                loss = per[0] * 0.0
            else:
                for i, sid in enumerate(ids):
                    f = poison_factor(step, sid)
                    if f is not None:
                        per[i] = per[i] * f
                loss = torch.stack(per).sum() / norm
            loss.backward()
        loss_value = 0.0 if is_pad else loss.item()
    elif st.last:
        grad_from = [c for c in graph.consumers(worker.name) if not graph[c].frozen]
        mb_ids = () if is_pad else ids
        tensors, grads = worker._output_grads(
            k, mb_ids, outs, grad_from, active, schedule, tag_grad
        )
        with tr.span(f"{worker.name} bwd", "backward", mb=k, step=step):
            if tensors:
                torch.autograd.backward(tensors, grads)
    else:
        with tr.span("recv stage grad", "wait", mb=k):
            g = worker.transport.get(worker.next_leader, tag_grad, k)["h"]
            extra = {}
            for _, sid, _ in received:
                if sid not in extra:
                    extra[sid] = worker.transport.get(worker.next_leader, tag_grad, -(1 + sid))
        with tr.span(f"{worker.name} bwd", "backward", mb=k, step=step):
            torch.autograd.backward([outs[0][HIDDEN]], [g])
        # the later stages' share of the gradients of the section's inputs
        for p, sid, got in received:
            for key, t in got.items():
                add = extra[sid].get(_input_key(p, key))
                if add is not None and t.requires_grad:
                    t.grad = add if t.grad is None else t.grad + add
    if st.first:
        worker._send_input_grads(received, schedule, tag_grad, step)
    elif worker.stage_leader:
        items = [(k, {"h": incoming.grad if incoming.grad is not None else incoming * 0})]
        per_sid: dict[int, dict] = {}
        for p, sid, got in received:
            d = per_sid.setdefault(sid, {})
            for key, t in got.items():
                if t.requires_grad:
                    d[_input_key(p, key)] = t.grad if t.grad is not None else torch.zeros_like(t)
        items += [(-(1 + sid), d) for sid, d in per_sid.items()]
        with tr.span("send stage grad", "send", mb=k, step=step):
            for dst in worker.prev_ranks:
                worker.transport.send(dst, tag_grad, items, step)
    return loss_value


def pipeline_step(worker, step: int) -> float:
    """One training step of a pipelined section on this rank (``MaestroWorker.step``)."""
    batch, schedule, infos = worker._prepare(step)
    worker.costs = {i.sample_id: i.cost for i in infos}
    norm = worker.workload.normaliser(batch)
    active = {i.sample_id: i.sections for i in infos}
    sink = worker.graph.is_sink(worker.name)
    tag_act, tag_grad = message_tags(step)
    if worker.optimizer is not None:
        worker.optimizer.zero_grad(set_to_none=True)
    mine = schedule.order[worker.name][worker.replica]
    worker.last_ids = [sid for mb in mine for sid in mb.sample_ids] if worker.leader else []
    worker.last_skipped = False
    worker._step_schedule = schedule
    mbs = _micro_batches(worker, schedule, batch, active)
    lay = worker.layouts[worker.name]
    kept: dict[int, tuple] = {}
    loss_total = 0.0
    for what, k in order(lay.pp, worker.stage_index, len(mbs), sink, worker.section.frozen):
        if what == "F":
            kept[k] = _forward(worker, k, mbs[k], batch, schedule, active, step, tag_act, True)
            if k == 0:
                kill_point(step, worker.rank)
            if worker.section.frozen:
                del kept[k]
        else:
            state = kept.pop(k)
            loss_total += _backward(
                worker, k, mbs[k], state, batch, schedule, active, step, tag_grad, norm
            )
    return worker._step_tail(step, sink, loss_total)


def pipeline_eval(worker, batch, schedule, active, vstep, sums: dict) -> None:
    """Forward-only pass of one eval batch through this rank's stage (``evaluate``)."""
    from maestro.runtime import evaluation as ev

    tag_act, _ = message_tags(vstep)
    worker.costs = None
    mbs = _micro_batches(worker, schedule, batch, active)
    for k, mb in enumerate(mbs):
        outs, _, _ = _forward(worker, k, mb, batch, schedule, active, vstep, tag_act, False)
        if worker.stage.last and not mb[1] and worker.graph.is_sink(worker.name):
            if worker.leader:
                ev.add_sink_outputs(sums, worker.name, outs)


def reduce_shared_grads(worker) -> None:
    """SUM the gradients of the parameters every stage holds (embeddings, norms, head) over
    the replica's stages: each stage computed its own share (the first the embeddings', the
    last the head's, both a tied weight's)."""
    shared = [p for p in worker.stage.shared_params if p.requires_grad]
    pgrads.allreduce_grads(shared, worker.pp_group)


def clip_pipeline_grads(worker, max_norm: float | None) -> None:
    """Global-norm clipping over the whole section: every stage's blocks once, the shared
    parameters once (identical on every stage after ``reduce_shared_grads``)."""
    if max_norm is None:
        return
    shared_ids = {id(p) for p in worker.stage.shared_params}
    blocks = [p for p in worker.params if id(p) not in shared_ids]
    shared = [p for p in worker.params if id(p) in shared_ids]
    sq = pgrads.global_grad_norm(blocks, worker.mesh) ** 2
    sq = sq.to(worker.device)
    dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=worker.pp_group)
    total = sq.cpu() + pgrads.global_grad_norm(shared, worker.mesh) ** 2
    norm = float(total.sqrt())
    coef = min(max_norm / (norm + 1e-6), 1.0)
    for p in worker.params:
        if p.grad is not None:
            p.grad.mul_(coef)


def checkpoint_parts(worker, full: bool) -> dict:
    """``{section: (module state, optimizer state or None)}`` of the whole pipelined
    section, gathered from replica 0's stages to its first stage's TP leader (collective
    over the section's ranks). ``full=False``: module state only."""
    from maestro.parallel import state as pstate
    from maestro.parallel.pipeline import merge_optimizer_states

    sharded = worker.strategy is not None
    module = worker.section.module
    mod = pstate.full_module_state(module) if sharded else dict(module.state_dict())
    opt = None
    if full and worker.optimizer is not None:
        opt = pstate.full_optimizer_state(worker.optimizer, worker.params)
    lay = worker.layouts[worker.name]
    if worker.replica != 0 or lay.coordinate(worker.rank)[2] != 0 or lay.cp_index(worker.rank):
        return {}
    part = (mod, opt, worker.stage.global_index())
    got = [None] * lay.pp if worker.stage.first else None
    group = worker.pp_group
    dist.gather_object(part, got, group_dst=0, group=group)
    if not worker.stage.first:
        return {}
    merged: dict = {}
    for m, _, _ in got:
        for key, t in m.items():
            merged.setdefault(key, t)
    merged_opt = None
    if opt is not None:
        merged_opt = merge_optimizer_states(
            [(g, o) for _, o, g in got], len(worker.stage.full_names)
        )
    return {worker.name: (merged, merged_opt)}


def load_checkpoint(worker, st: dict) -> None:
    """Load a whole-section checkpoint entry (``{"module", "optimizer"}``) into this stage."""
    from maestro.parallel import state as pstate
    from maestro.parallel.pipeline import stage_optimizer_state

    module = worker.section.module
    own = set(module.state_dict())
    mod = {k: v for k, v in st["module"].items() if k in own}
    if worker.strategy is not None:
        pstate.load_module_state(module, mod)
    else:
        module.load_state_dict(mod)
    if worker.optimizer is None:
        return
    if st["optimizer"] is None:
        raise ValueError(f"checkpoint has no optimizer state for section {worker.name!r}")
    sd = stage_optimizer_state(worker.stage, st["optimizer"])
    if worker.strategy is not None:
        pstate.load_optimizer_state(worker.optimizer, worker.params, sd)
    else:
        worker.optimizer.load_state_dict(sd)
