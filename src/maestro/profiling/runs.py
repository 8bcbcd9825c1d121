"""Profiles from real runs: train briefly with tracing on, fit the simulator's cost model.

This sits above both the runtime (it launches real training, builds the workload) and the
simulator (``maestro.sim.calibrate`` fits the traces, ``maestro.sim.replay`` replays them):
``run_and_profile`` returns a profile for ``MeasuredCostModel.from_profile``; ``replay_run``
predicts a run's step time from a profile, as the planner's validation does.
"""

from __future__ import annotations

import copy
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from maestro.sim.calibrate import _median, profile_from_trace, step_scale_by_size


def monolithic_features(config, world: int, micro_batch_size: int):
    """``f(step, rank, mb)``: the features of a monolithic run's micro-batch.

    The monolithic runtime traces no features, but its micro-batches follow from the config:
    contiguous data-order shards of each step's batch, cut into ``micro_batch_size`` samples
    (``runtime/monolithic.py``), with the costs the workload gives each sample.
    """
    from maestro.costmodel import micro_batch_features
    from maestro.schedule.fifo import fifo_schedule
    from maestro.schedule.types import SampleInfo, SectionSpec
    from maestro.workloads import get_workload

    wl = get_workload(config)
    graph = wl.graph(build=[])
    spec = SectionSpec("model", dp=world, micro_batch_size=micro_batch_size)
    cache: dict[int, tuple[dict, list]] = {}

    def feats(step: int, rank: int, mb: int) -> dict[str, float]:
        if step not in cache:
            infos = wl.sample_infos(wl.batch(step), graph)
            whole = [SampleInfo(i.sample_id, frozenset({"model"})) for i in infos]
            cache[step] = (
                {i.sample_id: i.cost for i in infos},
                fifo_schedule(whole, [spec]).order["model"],
            )
        cost, order = cache[step]
        return micro_batch_features(cost[s] for s in order[rank][mb].sample_ids)

    return feats


def param_bytes_of(config) -> dict[str, float]:
    """Gradient bytes of every trainable section (modules built on the ``meta`` device)."""
    import torch

    from maestro.workloads import get_workload

    with torch.device("meta"):
        graph = get_workload(config).graph()
    return {
        s.name: float(
            sum(p.numel() * p.element_size() for p in s.module.parameters() if p.requires_grad)
        )
        for s in graph
    }


def replay_run(cost_model, config, monolithic: bool, *, corrected: bool = False) -> float:
    """Predicted seconds per step of ``launch(config)``: the steps after the warm-up, each
    its own batch, from a common start, scheduled as the run schedules them (with the run's
    own cost model, ``runtime.costs``), replayed on ``cost_model`` (``maestro.sim.replay``).

    Args:
        cost_model: the model to replay on.
        config: the run config (its ``steps``, layout and scheduler).
        monolithic: the run is ``--monolithic``.
        corrected: apply the cost model's ``step_scale`` (else the bare replay).
    """
    from dataclasses import replace

    from maestro.runtime.costs import runtime_cost_model
    from maestro.schedule import get_scheduler, monolithic_schedule
    from maestro.sim.replay import replay_steps
    from maestro.workloads import get_workload

    wl = get_workload(config)
    graph = wl.graph(build=[])
    batches = [wl.sample_infos(wl.batch(k), graph) for k in range(1, config.steps)]
    specs = config.section_specs()
    if monolithic:
        world = config.world_size  # every rank: dp * fsdp * tp per section
        specs = [replace(s, dp=world, tp=1) for s in specs]  # the whole model per rank
        mbs = config.monolithic_micro_batch_size
        scheds = [
            monolithic_schedule(b, specs, world_size=world, micro_batch_size=mbs) for b in batches
        ]
    else:
        rcm = runtime_cost_model(config, wl) if config.scheduler != "fifo" else None
        scheds = [get_scheduler(config.scheduler)(b, specs, rcm) for b in batches]
    scale = None if corrected else 1.0
    return replay_steps(list(zip(scheds, batches)), specs, cost_model, step_scale=scale).step_time


def _step_scale(prof: dict, measured) -> tuple[dict[str, float], list[dict]]:
    """Measured over replayed seconds per step of the profiling runs themselves, per layout
    kind (median): what the replay leaves out (e.g. messages delivered late while both
    cores compute, ranks waiting on each other at a balanced pipeline). Applied by
    ``maestro.sim.replay`` as a step-level correction; layouts validated against it must be
    other runs than these."""
    from maestro.costmodel import MeasuredCostModel

    cm = MeasuredCostModel.from_profile(prof)
    ratios: dict[str, list[float]] = defaultdict(list)
    rows = []
    for cfg, mono, res in measured:
        got = res["elapsed_s"] / res["measured_steps"]
        pred = replay_run(cm, cfg, mono)
        kind = "monolithic" if mono else "sections"
        ratios[kind].append(got / pred)
        mbs = (
            cfg.monolithic_micro_batch_size
            if mono
            else min(sc.micro_batch_size for sc in cfg.sections.values())
        )
        rows.append({"layout": kind, "micro_batch": mbs, "measured_s": got, "replayed_s": pred})
    return {k: _median(v, 1.0) for k, v in ratios.items()}, rows


def run_and_profile(
    config,
    *,
    steps: int = 6,
    seed: int | None = None,
    runs: int = 1,
    micro_batches: Sequence[int] | None = None,
    monolithic: bool = False,
    scheduler: str | None = None,
    timeout_s: float = 900.0,
):
    """Train ``config`` for ``steps`` steps with tracing on; return ``profile_from_trace``.

    One traced run of a layout fits per-sample and per-micro-batch costs only as far as its
    micro-batches differ in size; a planner that may pick other sizes needs runs at those
    sizes. With ``micro_batches``, every size ``m`` is run with every section at
    micro-batch ``m`` (and, with ``monolithic``, the monolithic layout at ``m``), all fitted
    together; the profile records ``max_micro_batch`` (the largest size run), so the planner
    does not extrapolate beyond it.

    Args:
        config: a validated ``TrainConfig`` (its sections' ``dp`` set the world size).
        steps: steps to run (>= 3: the first is dropped as warm-up).
        seed: data seed of the first profiling run (default: the config's); every further
            run takes the next seed. Use seeds different from the runs you validate against.
        runs: traced runs per layout (one run's speed on a shared machine varies by 10% or
            more).
        micro_batches: micro-batch sizes to run (default: the config's own layout only).
        monolithic: also run the monolithic layout (same world size) at each size and fit
            the profile's ``"monolithic"`` record from it (requires ``micro_batches``, or
            uses the config's ``monolithic_micro_batch_size``).
        scheduler: the scheduler of the section runs (default: the config's).
        timeout_s: give up after this long (per run).
    """
    from maestro.runtime.launch import RunOptions, launch

    if steps < 3:
        raise ValueError(f"steps must be >= 3 for a profile from a run, got {steps}")
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    if micro_batches is not None and (not micro_batches or min(micro_batches) < 1):
        raise ValueError(f"micro_batches must be sizes >= 1, got {list(micro_batches)}")
    base = copy.deepcopy(config)
    base.steps = steps
    if scheduler is not None:
        base.scheduler = scheduler
    first = base.seed if seed is None else seed
    sizes = list(micro_batches) if micro_batches is not None else [None]
    world = base.world_size
    seeds = iter(range(first, first + 10_000))
    with tempfile.TemporaryDirectory() as tmp:
        traces, mono, measured = [], [], []
        for m in sizes:
            for _ in range(runs):
                cfg = copy.deepcopy(base)
                cfg.seed = next(seeds)
                if m is not None:
                    for sc in cfg.sections.values():
                        sc.micro_batch_size = m
                traces.append(Path(tmp) / f"trace{len(traces)}.json")
                opts = RunOptions(progress=False, device="cpu", trace=str(traces[-1]))
                res = launch(cfg, world, opts, timeout_s=timeout_s)
                measured.append((copy.deepcopy(cfg), False, res))
                if monolithic:
                    mbs = m if m is not None else cfg.monolithic_micro_batch_size
                    cfg.seed = next(seeds)
                    cfg.monolithic_micro_batch_size = mbs
                    path = Path(tmp) / f"mono{len(mono)}.json"
                    opts = RunOptions(
                        progress=False, device="cpu", trace=str(path), monolithic=True
                    )
                    res = launch(cfg, world, opts, timeout_s=timeout_s)
                    measured.append((copy.deepcopy(cfg), True, res))
                    mono.append((path, monolithic_features(cfg, world, mbs)))
        prof = profile_from_trace(
            traces,
            param_bytes=param_bytes_of(base),
            dp={n: sc.dp for n, sc in base.sections.items()},
            monolithic=mono,
        )
    if micro_batches is not None:
        for rec in prof["sections"].values():
            rec["max_micro_batch"] = max(sizes)
    prof["step_scale"], prof["step_ratios"] = _step_scale(prof, measured)
    prof["step_scale_by_mbs"] = step_scale_by_size(prof["step_ratios"])
    prof["run"] = {
        "steps": steps,
        "seed": first,
        "runs": runs,
        "scheduler": base.scheduler,
        "micro_batches": sizes if micro_batches is not None else None,
        "monolithic": monolithic,
    }
    return prof


__all__ = [
    "monolithic_features",
    "param_bytes_of",
    "replay_run",
    "run_and_profile",
]
