"""The ``--monolithic`` baseline: the whole compound model on every rank, data parallel.

What users run today: every rank holds teacher and student (or encoders and LLM), takes a
contiguous shard of the global batch in micro-batches of one size, runs the full model per
micro-batch (frozen parts under ``no_grad``) and accumulates gradients; one fused SUM
all-reduce over all ranks per step (what DDP does under ``no_sync`` accumulation, without
its averaging, so the loss normalisation is the same as Maestro's and the reference's).
"""

from __future__ import annotations

import torch

from maestro.config import TrainConfig
from maestro.runtime.executor import flat_allreduce_grads
from maestro.runtime.local import batch_to, compound_loss, make_optimizer
from maestro.runtime.trace import Tracer
from maestro.schedule.types import SampleInfo, SectionSpec, fifo_schedule


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
        self.spec = SectionSpec(
            "model", dp=world, micro_batch_size=config.monolithic_micro_batch_size
        )
        self.label = f"model[{rank}]"

    def step(self, step: int) -> float:
        """One data-parallel step; returns this rank's share of the loss."""
        with self.tracer.span("batch + schedule", "schedule"):
            batch = batch_to(self.workload.batch(step), self.device)
            infos = [SampleInfo(s["id"], frozenset({"model"})) for s in batch]
            mine = fifo_schedule(infos, [self.spec]).order["model"][self.rank]
        norm = self.workload.normaliser(batch)
        for o in self.optimizers.values():
            o.zero_grad(set_to_none=True)
        total = 0.0
        for k, mb in enumerate(mine):
            with self.tracer.span("model fwd", "forward", mb=k, samples=len(mb.sample_ids)):
                loss = compound_loss(self.graph, [batch[i] for i in mb.sample_ids]) / norm
            with self.tracer.span("model bwd", "backward", mb=k):
                loss.backward()
            total += loss.item()
        with self.tracer.span("all-reduce grads", "comm"):
            flat_allreduce_grads(self.params)
        with self.tracer.span("optimizer", "optimizer"):
            for o in self.optimizers.values():
                o.step()
        return total

    def finish(self) -> None:
        """Nothing outstanding: every collective completed within its step."""

    def state_dicts(self) -> dict[str, dict]:
        """Every section's weights (saved by rank 0)."""
        return {s.name: s.module.state_dict() for s in self.graph} if self.rank == 0 else {}
