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
from maestro.job import compute_dtype, param_dtype  # noqa: F401 - the runtime's names too
from maestro.sections import Outputs, Sample, SectionGraph


def optimizer_class(name: str) -> type:
    """The optimizer class a config names: ``adamw``/``sgd``, a ``torch.optim`` class or
    ``package.module:Class``."""
    if name == "adamw":
        return torch.optim.AdamW
    if name == "sgd":
        return torch.optim.SGD
    if ":" in name:
        import importlib

        mod, _, cls = name.partition(":")
        return getattr(importlib.import_module(mod), cls)
    return getattr(torch.optim, name)


def make_optimizer(sc: SectionConfig, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer a section config asks for.

    Built-in ``torch.optim`` classes get ``foreach=False`` unless ``optimizer_args`` says
    otherwise, so every layout runs the same kernels (exactness across layouts).
    """
    cls = optimizer_class(sc.optimizer)
    kwargs = {k: (tuple(v) if isinstance(v, list) else v) for k, v in sc.optimizer_args.items()}
    if cls.__module__.startswith("torch.optim") and "foreach" in _init_params(cls):
        kwargs.setdefault("foreach", False)
    try:
        return cls(params, lr=sc.lr, weight_decay=sc.weight_decay, **kwargs)
    except TypeError as e:
        raise ValueError(f"optimizer {sc.optimizer!r}: {e}") from None


def _init_params(cls: type) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        return set()


def lr_factor(sc: SectionConfig, step: int, total_steps: int) -> float:
    """Multiplier of ``sc.lr`` at optimizer step ``step`` (0-based) of ``total_steps``.

    Linear warmup over ``warmup_steps``: step ``s < w`` gets ``(s + 1) / (w + 1)`` (the
    first step already moves, at ``1 / (w + 1)``; the factor would reach 1 at step ``w``),
    then constant, or a cosine / linear decay to ``min_lr_ratio`` reached at the last step.
    """
    import math

    w = sc.warmup_steps
    if step < w:
        return (step + 1) / (w + 1)
    if sc.lr_schedule == "constant":
        return 1.0
    span = max(total_steps - 1 - w, 1)
    t = min(max(step - w, 0) / span, 1.0)
    lo = sc.min_lr_ratio
    if sc.lr_schedule == "cosine":
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * t))
    return lo + (1 - lo) * (1 - t)


def set_lr(optimizer: torch.optim.Optimizer, sc: SectionConfig, step: int, total: int) -> None:
    """Set every param group's learning rate for optimizer step ``step`` (a pure function of
    the step, so resuming from a checkpoint needs no scheduler state)."""
    lr = sc.lr * lr_factor(sc, step, total)
    for g in optimizer.param_groups:
        g["lr"] = lr


def clip_grads(params: Sequence[nn.Parameter], max_norm: float | None) -> float | None:
    """Clip to a global L2 norm (the grads are already reduced: identical on every replica,
    so the local norm is the group's); returns the norm before clipping."""
    if max_norm is None:
        return None
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.nn.utils.clip_grad_norm_(grads, max_norm, foreach=False))


def sink_outputs(graph: SectionGraph, samples: Sequence[Sample]) -> list[tuple[str, list[Outputs]]]:
    """Run every section of ``graph`` on ``samples`` in dependency order (frozen sections
    under no_grad); returns ``[(sink, per-sample outputs)]`` in graph order."""
    outputs: dict[str, dict[int, Outputs]] = {}
    out = []
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
            out.append((sec.name, outs))
    return out


def compound_loss(graph: SectionGraph, samples: Sequence[Sample]) -> torch.Tensor:
    """Sum of the sinks' per-sample losses over ``samples`` (frozen sections under no_grad)."""
    total = None
    for _, outs in sink_outputs(graph, samples):
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
        for name, o in opts.items():
            sc = config.sections[name]
            clip_grads(list(graph[name].module.parameters()), sc.grad_clip)
            set_lr(o, sc, step, config.steps)
            o.step()
        losses.append(loss.item())
    return graph, losses


def batch_fingerprint(batch: Sequence[Sample]) -> int:
    """A 62-bit fingerprint of a global batch: ids, keys, shapes, dtypes and tensor bytes.

    Ranks compare fingerprints to detect data pipelines that disagree (different files, an
    unseeded shuffle) before they would hang waiting for samples nobody sends. Nonzero.
    """
    import zlib

    h = 0
    for s in batch:
        for k in sorted(s):
            v = s[k]
            if isinstance(v, torch.Tensor):
                t = v.detach().contiguous().reshape(-1).cpu()
                raw = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
                h = zlib.crc32(f"{k}{v.dtype}{tuple(v.shape)}".encode(), h)
                h = zlib.crc32(raw.numpy().tobytes(), h)
            else:
                h = zlib.crc32(f"{k}={v!r}".encode(), h)
    return (h << 30 | len(batch) % (1 << 30)) | 1


def check_same_batch(fingerprint: int, step: int, group=None) -> None:
    """Collective: ``ValueError`` naming the step and the ranks when the fingerprints differ."""
    import torch.distributed as dist

    t = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if int(t[0]) == -int(t[1]):
        return
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, fingerprint, group=group)
    groups: dict[int, list[int]] = {}
    for r, f in enumerate(every):
        groups.setdefault(f, []).append(r)
    parts = "; ".join(f"ranks {', '.join(map(str, rs))}: {f:#x}" for f, rs in groups.items())
    raise ValueError(
        f"step {step}: the ranks built different global batches ({parts}); every rank must "
        "read the same data in the same order (check the data files, the seed and the job)"
    )
