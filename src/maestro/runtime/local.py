"""Single-process execution of a compound model: the reference step and the monolithic body.

``compound_loss`` runs every section of the graph on the given samples in dependency order,
as one model would; ``reference_train`` is the single-process training loop that a Maestro run
must match exactly (same global batches, same normalisation, same optimizers).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
from torch import nn

from maestro.config import SectionConfig, TrainConfig
from maestro.sections import Outputs, Sample, SectionGraph


def make_optimizer(sc: SectionConfig, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer a section config asks for (``foreach=False``: same kernels everywhere)."""
    if sc.optimizer == "sgd":
        return torch.optim.SGD(params, lr=sc.lr, weight_decay=sc.weight_decay, foreach=False)
    assert sc.optimizer == "adamw", sc.optimizer
    return torch.optim.AdamW(params, lr=sc.lr, weight_decay=sc.weight_decay, foreach=False)


def compound_loss(graph: SectionGraph, samples: Sequence[Sample]) -> torch.Tensor:
    """Sum of the sinks' per-sample losses over ``samples`` (frozen sections under no_grad)."""
    outputs: dict[str, dict[int, Outputs]] = {}
    total = None
    for sec in graph:
        act = [s for s in samples if sec.activated(s)]
        outputs[sec.name] = {}
        if not act:
            continue
        ins = {p: [outputs[p].get(s["id"]) for s in act] for p in sec.inputs}
        with torch.no_grad() if sec.frozen else nullcontext():
            outs = sec.run(act, ins)
        for s, o in zip(act, outs):
            outputs[sec.name][s["id"]] = o
        if graph.is_sink(sec.name):
            part = torch.stack([o["loss"] for o in outs]).sum()
            total = part if total is None else total + part
    assert total is not None, "no sink ran on these samples"
    return total


def batch_to(batch: Sequence[Sample], device: torch.device) -> list[Sample]:
    """Move every tensor of every sample to ``device``."""
    return [
        {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
        for s in batch
    ]


def reference_train(config: TrainConfig, steps: int | None = None):
    """Train the compound model in one process on whole global batches.

    Returns ``(graph, losses)``: the trained section graph and the loss of every step.
    """
    from maestro.workloads import get_workload

    wl = get_workload(config)
    graph = wl.graph()
    opts = {
        s.name: make_optimizer(config.sections[s.name], list(s.module.parameters()))
        for s in graph
        if not s.frozen
    }
    losses = []
    for step in range(config.steps if steps is None else steps):
        batch = wl.batch(step)
        loss = compound_loss(graph, batch) / wl.normaliser(batch)
        for o in opts.values():
            o.zero_grad(set_to_none=True)
        loss.backward()
        for o in opts.values():
            o.step()
        losses.append(loss.item())
    return graph, losses
