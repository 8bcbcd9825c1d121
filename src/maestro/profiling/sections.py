"""A profiler: time and memory of each section of a run config on this machine, for
``MeasuredCostModel``.

For every section it runs real micro-batches of the workload's synthetic samples (producer
outputs computed first, as the runtime would receive them) against micro-batch size and, with
``seq_lens``, against sequence length (samples truncated to each length, so a row's tokens are
exactly ``size * length``). Each row records forward and forward+backward seconds (fastest of
repeats) and memory:

- ``activation_bytes``: bytes autograd saves for the backward during the forward (counted with
  ``torch.autograd.graph.saved_tensors_hooks``, each storage once, parameters excluded): the
  activations a trainable section holds per micro-batch (0 for a frozen section, which runs
  under ``inference_mode``).
- ``peak_bytes``: on a GPU, the allocator's peak above the section's resident state during
  forward+backward (``torch.cuda.max_memory_allocated``); on the CPU, whose allocator keeps no
  statistics, the accounting ``resident + activation_bytes`` (``peak_method`` says which).

The section record adds output bytes per sample, gradient bytes, the optimizer step and its
state (``resident_bytes``: parameters, gradients and optimizer state), and the profile the
per-step overhead every rank pays (building the global batch and its ``SampleInfo`` list).
``MeasuredCostModel.from_profile`` reads ``features``, ``forward_s`` and
``forward_backward_s`` of the rows; the memory keys are extra.
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
    seq_lens: Sequence[int] | None = None,
) -> dict:
    """Measure every section of ``config`` (a validated ``TrainConfig``) on this machine.

    Args:
        config: the run config; its workload, model sizes, seed and dtype are used.
        sizes: micro-batch sizes to time (capped by the activated samples available).
        draws: random micro-batches per size (the workload's own sequence lengths).
        repeats: timings per micro-batch; the fastest is kept.
        threads: torch intra-op threads (default: ``config.threads``, as each rank uses).
        seed: picks the micro-batches.
        seq_lens: also time every size at each of these sequence lengths (text tokens; samples
            at least that long are truncated to it, positions into the text clamped); a
            length no sample reaches is skipped.

    Returns:
        ``{"sections": {name: {"rows": [{"features", "forward_s", "forward_backward_s",
        "activation_bytes", "peak_bytes", "seq_len"}], "bytes_per": {key: bytes},
        "param_bytes": n, "resident_bytes": n, "optimizer_s": t}}, "step_overhead_s": t,
        "threads": n, "peak_method": "cuda" | "accounting"}``.
    """
    import torch

    from maestro.runtime.local import make_optimizer
    from maestro.workloads import get_workload

    if not sizes or min(sizes) < 1:
        raise ValueError(f"sizes must be positive, got {list(sizes)}")
    if seq_lens is not None and (not seq_lens or min(seq_lens) < 2):
        raise ValueError(f"seq_lens must be >= 2, got {list(seq_lens)}")
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
        # micro-batches to time per section: (samples, sequence length or None)
        plan: dict[str, list[tuple[list, int | None]]] = {sec.name: [] for sec in graph}
        for sec in graph:
            act = [s for s in batch if sec.activated(s)]
            for m in sizes:
                if m <= len(act):
                    plan[sec.name] += [(rng.sample(act, m), None) for _ in range(draws)]
        for length in seq_lens or ():
            cut = [
                _truncate(s, length, len(batch) + k)
                for k, s in enumerate(x for x in batch if x["tokens"].numel() >= length)
            ]
            for sec in graph:
                act = [s for s in cut if sec.activated(s)]
                plan[sec.name] += [(act[:m], length) for m in sizes if m <= len(act)]
            batch += cut
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
                sec, graph, plan[sec.name], outs, infos, repeats, config, make_optimizer
            )
        cuda = any(p.is_cuda for sec in graph for p in sec.module.parameters())
        return {
            "sections": result,
            "step_overhead_s": step_overhead,
            "threads": nthreads,
            "peak_method": "cuda" if cuda else "accounting",
        }
    finally:
        torch.set_num_threads(old_threads)


def _truncate(sample: dict, length: int, new_id: int) -> dict:
    """``sample`` with its text cut to ``length`` tokens (positions into it clamped)."""
    out = {**sample, "id": new_id, "tokens": sample["tokens"][:length].clone()}
    for k, v in sample.items():
        if k.endswith("_pos") and isinstance(v, int):
            out[k] = max(1, min(v, length - 1))
    return out


def _saved_bytes(fn, params) -> tuple[object, int]:
    """``(fn(), bytes of the tensors autograd saved for backward while running it)``."""
    import torch

    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: set[int] = set()
    total = 0

    def pack(t):
        nonlocal total
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in skip and ptr not in seen:
            seen.add(ptr)
            total += st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        res = fn()
    return res, total


def _profile_section(sec, graph, micro_batches, outs, infos, repeats, config, make_opt):
    import torch

    name = sec.name
    trainable = not sec.frozen
    sink = graph.is_sink(name)
    params = [p for p in sec.module.parameters() if p.requires_grad]
    all_params = list(sec.module.parameters())
    cuda = any(p.is_cuda for p in all_params)

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

    def backward(res):
        if sink:
            torch.stack([o["loss"] for o in res]).sum().backward()
        else:
            ts = [t for o in res for t in o.values() if t.requires_grad]
            torch.autograd.backward(ts, [torch.ones_like(t) for t in ts])

    def forward_backward(mb):
        backward(sec.run(mb, inputs(mb)))
        sec.module.zero_grad(set_to_none=True)

    # resident state: parameters, gradients and optimizer state (after one step)
    param_all = sum(p.numel() * p.element_size() for p in all_params)
    optimizer_s, resident = 0.0, param_all
    if trainable and params:
        opt = make_opt(config.sections[name], params)
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer_s = _fastest_time(opt.step, repeats)
        state = sum(
            v.numel() * v.element_size()
            for st in opt.state.values()
            for v in st.values()
            if torch.is_tensor(v)
        )
        resident += state + sum(p.numel() * p.element_size() for p in params)
        sec.module.zero_grad(set_to_none=True)
        del opt

    rows = []
    for mb, length in micro_batches:
        forward(mb)  # warm-up (allocator, kernels)
        row = {
            "features": micro_batch_features(infos[s["id"]].cost for s in mb),
            "forward_s": _fastest_time(lambda mb=mb: forward(mb), repeats),
        }
        if length is not None:
            row["seq_len"] = length
        acts = 0
        if trainable:
            row["forward_backward_s"] = _fastest_time(lambda mb=mb: forward_backward(mb), repeats)
            res, acts = _saved_bytes(lambda mb=mb: sec.run(mb, inputs(mb)), all_params)
            del res
        row["activation_bytes"] = acts
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            forward_backward(mb) if trainable else forward(mb)
            torch.cuda.synchronize()
            row["peak_bytes"] = torch.cuda.max_memory_allocated() - base + resident
        else:
            row["peak_bytes"] = resident + acts
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
    return {
        "rows": rows,
        # the fit is valid up to here (MeasuredCostModel.max_samples)
        "max_micro_batch": max((len(mb) for mb, _ in micro_batches), default=0),
        "bytes_per": bytes_per,
        "param_bytes": float(sum(p.numel() * p.element_size() for p in params)),
        "resident_bytes": float(resident),
        "optimizer_s": optimizer_s,
    }
