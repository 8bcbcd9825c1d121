"""The ``--monolithic`` baseline: the whole compound model on every rank, data parallel.

What users run today: every rank holds teacher and student (or encoders and LLM), takes a
contiguous shard of the global batch in micro-batches of one size (and at most the smallest
section ``token_budget`` of tokens), runs the full model per micro-batch (frozen parts under
``no_grad``) and accumulates gradients; one fused SUM all-reduce over all ranks per step
(what DDP does under ``no_sync`` accumulation, without its averaging, so the loss
normalisation is the same as Maestro's and the reference's). The shards follow data order,
or, with ``monolithic_order = "balanced"``, a length-balanced sampler's order (equal
estimated work per rank): the planner's tuned baseline. The micro-batches are exactly the
simulator's ``monolithic_schedule``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from maestro.config import TrainConfig
from maestro.runtime.executor import flat_allreduce_grads, grads_finite
from maestro.runtime.faults import NonFiniteError, nonfinite_message, poison_factor
from maestro.runtime.local import (
    batch_fingerprint,
    batch_to,
    check_same_batch,
    clip_grads,
    compound_loss,
    make_optimizer,
    set_lr,
    sink_outputs,
)
from maestro.runtime.trace import Tracer
from maestro.schedule.monolithic import (
    balanced_order,
    monolithic_schedule,
    token_balanced_order,
    whole_micro_batches,
)


class MonolithicWorker:
    """Args: like ``MaestroWorker``; uses ``config.monolithic_micro_batch_size``."""

    def __init__(
        self, config: TrainConfig, rank: int, world: int, device: torch.device, tracer: Tracer
    ) -> None:
        from maestro.workloads import get_workload

        self.config, self.rank, self.world = config, rank, world
        self.device, self.tracer = device, tracer
        self.workload = get_workload(config)
        self.graph = self.workload.graph()
        for s in self.graph:
            s.module.to(device)
        self.optimizers = {
            s.name: make_optimizer(config.sections[s.name], list(s.module.parameters()))
            for s in self.graph
            if not s.frozen
        }
        self.params = [
            p for s in self.graph if not s.frozen for p in s.module.parameters() if p.requires_grad
        ]
        self.specs = config.section_specs()
        self.cost_model = None
        if config.monolithic_order == "balanced":
            from maestro.runtime.costs import runtime_cost_model

            self.cost_model = runtime_cost_model(config, self.workload, shared=True)
        self.label = f"model[{rank}]"
        self.on_nonfinite = "stop"
        #: the total steps the LR schedule decays over (a resume sets the checkpoint's)
        self.lr_total_steps = config.steps
        self.last_ids: list[int] = []
        self.last_skipped = False
        self.name = "model"
        self.guard_names = [s.name for s in self.graph if not s.frozen]
        self._batch_checked = False

    def _schedule(self, batch):
        """The batch's shards in the run's sampler order (cost-aware balance, token balance or
        data order), cut into whole-model micro-batches: one rule for training and eval."""
        infos = self.workload.sample_infos(batch, self.graph)
        if self.cost_model is not None:
            units = [(s.name, s.frozen) for s in self.specs]
            budgets = [s.token_budget for s in self.specs if s.token_budget is not None]
            infos = balanced_order(
                infos,
                self.world,
                self.cost_model,
                units,
                self.config.monolithic_micro_batch_size,
                min(budgets) if budgets else None,
            )
        elif self.config.monolithic_order == "tokens":
            infos = token_balanced_order(infos, self.world)
        return monolithic_schedule(
            infos,
            self.specs,
            world_size=self.world,
            micro_batch_size=self.config.monolithic_micro_batch_size,
        )

    def step(self, step: int) -> float:
        """One data-parallel step; returns this rank's share of the loss."""
        with self.tracer.span("batch + schedule", "schedule"):
            batch = batch_to(self.workload.batch(step), self.device)
            if not self._batch_checked:
                check_same_batch(batch_fingerprint(batch), step)
                self._batch_checked = True
            sched = self._schedule(batch)
            mine = whole_micro_batches(sched, self.rank)
        norm = self.workload.normaliser(batch)
        for o in self.optimizers.values():
            o.zero_grad(set_to_none=True)
        total = 0.0
        self.last_ids = [sid for mb in mine for sid in mb]
        self.last_skipped = False
        by_id = {s["id"]: s for s in batch}
        for k, ids in enumerate(mine):
            with self.tracer.span("model fwd", "forward", mb=k, samples=len(ids)):
                loss = compound_loss(self.graph, [by_id[i] for i in ids]) / norm
                for sid in ids:
                    f = poison_factor(step, sid)
                    if f is not None:
                        loss = loss * f
            with self.tracer.span("model bwd", "backward", mb=k):
                loss.backward()
            total += loss.item()
        if not self._guard(step, total):
            self.last_skipped = True
            for o in self.optimizers.values():
                o.zero_grad(set_to_none=True)
            return total
        with self.tracer.span("all-reduce grads", "comm"):
            flat_allreduce_grads(self.params)
        with self.tracer.span("optimizer", "optimizer"):
            for name, o in self.optimizers.items():
                sc = self.config.sections[name]
                clip_grads(list(self.graph[name].module.parameters()), sc.grad_clip)
                set_lr(o, sc, step, self.lr_total_steps)
                o.step()
        return total

    def evaluate(self, batches) -> tuple[dict[str, float], float, int]:
        """Held-out global batches, forward only, each rank on its shard of every batch (as
        ``step`` shards it); ``MaestroWorker.evaluate``'s ``(sums, normaliser, samples)``."""
        from maestro.runtime import evaluation as ev

        sums: dict[str, float] = {}
        norm_total, count = 0.0, 0
        modules = [s.module for s in self.graph]
        with ev.eval_mode(modules):
            for b, batch in enumerate(batches):
                batch = batch_to(batch, self.device)
                if not getattr(self, "_eval_checked", False):
                    try:
                        check_same_batch(batch_fingerprint(batch), b)
                    except ValueError as e:
                        raise ValueError(f"eval batch {b}: {str(e).split(': ', 1)[-1]}") from None
                    self._eval_checked = True
                sched = self._schedule(batch)
                norm_total += self.workload.normaliser(batch)
                count += len(batch)
                by_id = {s["id"]: s for s in batch}
                for k, ids in enumerate(whole_micro_batches(sched, self.rank)):
                    with self.tracer.span("model eval fwd", "forward", mb=k), torch.no_grad():
                        for name, outs in sink_outputs(self.graph, [by_id[i] for i in ids]):
                            ev.add_sink_outputs(sums, name, outs)
        return sums, norm_total, count

    def _guard(self, step: int, loss: float) -> bool:
        """Agree with every rank whether the step is finite; ``True`` to update."""
        flags = torch.zeros(2 * len(self.guard_names), dtype=torch.float64, device=self.device)
        for i, n in enumerate(self.guard_names):
            flags[2 * i] = float(self.graph.is_sink(n) and not math.isfinite(loss))
            flags[2 * i + 1] = float(not grads_finite(list(self.graph[n].module.parameters())))
        dist.all_reduce(flags, op=dist.ReduceOp.SUM)
        msg = nonfinite_message(step, flags.tolist(), self.guard_names)
        if msg is None:
            return True
        if self.on_nonfinite == "stop":
            raise NonFiniteError(f"{msg}; stopped before any optimizer update (--on-nonfinite)")
        return False

    def checkpoint_state(self) -> dict:
        """``{section: (module, optimizer)}`` of every section (rank 0 writes them)."""
        if self.rank != 0:
            return {}
        return {s.name: (s.module, self.optimizers.get(s.name)) for s in self.graph}

    def load_checkpoint(self, ckpt) -> None:
        """Load every section's module and optimizer state (from a Maestro or monolithic run)."""
        for s in self.graph:
            if s.name not in ckpt.sections:
                raise ValueError(f"checkpoint has no state for section {s.name!r}")
            st = ckpt.section(s.name)
            s.module.load_state_dict(st["module"])
            if s.name in self.optimizers:
                if st["optimizer"] is None:
                    raise ValueError(f"checkpoint has no optimizer state for section {s.name!r}")
                self.optimizers[s.name].load_state_dict(st["optimizer"])

    def finish(self) -> None:
        """Nothing outstanding: every collective completed within its step."""

    def state_dicts(self) -> dict[str, dict]:
        """Every section's weights (saved by rank 0)."""
        return {s.name: s.module.state_dict() for s in self.graph} if self.rank == 0 else {}
