"""A minimal profiler: time each section of a run config on this machine, for ``MeasuredCostModel``.

For every section and a few micro-batch sizes, it runs real micro-batches of the workload's
synthetic samples (producer outputs computed first, as the runtime would receive them) and
records forward and forward+backward seconds (fastest of repeats), output bytes per sample,
gradient bytes, the optimizer step, and the per-step overhead every rank pays (building the
global batch and its ``SampleInfo`` list). The result is a JSON-able dict that
``MeasuredCostModel.from_profile`` fits. Issue 8's planner may grow this into a full profiler.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from contextlib import nullcontext

from maestro.costmodel import micro_batch_features

#: Cost keys tried as the unit of a section's output bytes (the steadiest ratio wins).
_BYTE_KEYS = ("images", "audio", "text_tokens", "tokens", "samples")


def _fastest_time(fn, repeats: int) -> float:
    # the fastest repeat: other processes on a shared machine only ever add time
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def profile_config(
    config,
    sizes: Sequence[int] = (1, 2, 4, 8),
    draws: int = 3,
    repeats: int = 3,
    threads: int | None = None,
    seed: int = 0,
) -> dict:
    """Measure every section of ``config`` (a validated ``TrainConfig``) on this machine.

    Args:
        config: the run config; its workload, model sizes, seed and dtype are used.
        sizes: micro-batch sizes to time (capped by the activated samples available).
        draws: random micro-batches per size (different sequence lengths).
        repeats: timings per micro-batch; the fastest is kept.
        threads: torch intra-op threads (default: ``config.threads``, as each rank uses).
        seed: picks the micro-batches.

    Returns:
        ``{"sections": {name: {"rows": [{"features", "forward_s", "forward_backward_s"}],
        "bytes_per": {key: bytes}, "param_bytes": n, "optimizer_s": t}},
        "step_overhead_s": t, "threads": n}``.
    """
    import torch

    from maestro.runtime.local import make_optimizer
    from maestro.workloads import get_workload

    if not sizes or min(sizes) < 1:
        raise ValueError(f"sizes must be positive, got {list(sizes)}")
    nthreads = threads if threads is not None else config.threads
    old_threads = torch.get_num_threads()
    torch.set_num_threads(nthreads)
    try:
        wl = get_workload(config)
        graph = wl.graph()
        rng = random.Random(seed)

        def overhead():
            b = wl.batch(0)
            wl.sample_infos(b, graph)

        step_overhead = _fastest_time(overhead, repeats)
        # two global batches, ids made unique, give enough samples of every kind
        batch = []
        for step in range(2):
            for s in wl.batch(step):
                batch.append({**s, "id": len(batch)})
        infos = {i.sample_id: i for i in wl.sample_infos(batch, graph)}
        outs: dict[str, dict[int, dict]] = {}
        result: dict[str, dict] = {}
        for sec in graph:
            act = [s for s in batch if sec.activated(s)]
            outs[sec.name] = {}
            if act:
                with torch.no_grad():
                    ins = {p: [outs[p].get(s["id"]) for s in act] for p in sec.inputs}
                    for s, o in zip(act, sec.run(act, ins)):
                        outs[sec.name][s["id"]] = {k: v.detach() for k, v in o.items()}
            result[sec.name] = _profile_section(
                sec, graph, act, outs, infos, sizes, draws, repeats, rng, config, make_optimizer
            )
        return {"sections": result, "step_overhead_s": step_overhead, "threads": nthreads}
    finally:
        torch.set_num_threads(old_threads)


def _profile_section(sec, graph, act, outs, infos, sizes, draws, repeats, rng, config, make_opt):
    import torch

    name = sec.name
    trainable = not sec.frozen
    sink = graph.is_sink(name)
    params = [p for p in sec.module.parameters() if p.requires_grad]

    def inputs(mb):
        ins = {}
        for p in sec.inputs:
            grad = trainable and not graph[p].frozen
            col = []
            for s in mb:
                o = outs[p].get(s["id"])
                if o is not None:
                    o = {
                        k: v.clone().requires_grad_(grad and v.is_floating_point())
                        for k, v in o.items()
                    }
                col.append(o)
            ins[p] = col
        return ins

    def forward(mb):
        with torch.inference_mode() if sec.frozen else nullcontext():
            return sec.run(mb, inputs(mb))

    def forward_backward(mb):
        res = sec.run(mb, inputs(mb))
        if sink:
            torch.stack([o["loss"] for o in res]).sum().backward()
        else:
            ts = [t for o in res for t in o.values() if t.requires_grad]
            torch.autograd.backward(ts, [torch.ones_like(t) for t in ts])
        sec.module.zero_grad(set_to_none=True)

    rows = []
    for m in sizes:
        if m > len(act):
            continue
        for _ in range(draws):
            mb = rng.sample(act, m)
            forward(mb)  # warm-up (allocator, kernels)
            row = {
                "features": micro_batch_features(infos[s["id"]].cost for s in mb),
                "forward_s": _fastest_time(lambda mb=mb: forward(mb), repeats),
            }
            if trainable:
                row["forward_backward_s"] = _fastest_time(
                    lambda mb=mb: forward_backward(mb), repeats
                )
            rows.append(row)
    # output bytes per unit of the cost key whose ratio varies least across samples
    bytes_per = {}
    per_sample = [
        (infos[i].cost, sum(t.numel() * t.element_size() for t in o.values()))
        for i, o in outs[name].items()
    ]
    if per_sample and not graph.is_sink(name):
        best = None
        for key in _BYTE_KEYS:
            ratios = [
                b / (c.get(key, 0) if key != "samples" else 1)
                for c, b in per_sample
                if (c.get(key, 0) if key != "samples" else 1) > 0
            ]
            if len(ratios) == len(per_sample):
                spread = statistics.pstdev(ratios) / max(statistics.mean(ratios), 1e-12)
                if best is None or spread < best[0]:
                    best = (spread, key, statistics.mean(ratios))
        if best is not None:
            bytes_per = {best[1]: best[2]}
    optimizer_s = 0.0
    if trainable and params:
        opt = make_opt(config.sections[name], params)
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer_s = _fastest_time(opt.step, repeats)
        sec.module.zero_grad(set_to_none=True)
    return {
        "rows": rows,
        "bytes_per": bytes_per,
        "param_bytes": float(sum(p.numel() * p.element_size() for p in params)),
        "optimizer_s": optimizer_s,
    }
