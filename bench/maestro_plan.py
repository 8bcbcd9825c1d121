"""Benchmark: the planner's Maestro layouts against the best monolithic layouts.

Four parts (``--part calibration,heavy,sim,validate``; all by default):

- ``calibration``: ``maestro estimate`` against the published torchtitan and Megatron-LM runs
  (``maestro.estimate.calibration``; also ``bench/maestro_estimate.py``).
- ``heavy``: the paper-like scenarios (``kd-72b``, ``mllm-vl``, ``mllm-internvl``; fixed
  global batch) at ``--heavy-gpus`` (default 256 and 1,024), Maestro against the conventional
  (a), careful (b') and tuned (b) baselines; ``--colocate`` adds colocated layouts.

- ``sim``: the paper-like scenarios (``examples/paper_kd.toml``: 7B student, 35B frozen
  teacher; ``examples/paper_mllm.toml``: 630M ViT + 300M audio + 7B LLM, 40% text-only) on
  analytical H100s at 64, 256 and 1,024 GPUs (8 samples per GPU per step). For each: Maestro's
  plan (sections on their own devices, colocated groups, or the monolithic layouts, scored by
  steady-state step time) and the best monolithic plan under the same search (the monolithic
  baseline with a length-balanced sampler, and with data-order shards as the simulator's
  stock baseline), GPU-hours per million samples, the saving, and the GPUs Maestro needs to
  match the monolithic throughput. Then the breakdown at 256 GPUs by ablation (one per-section
  freedom switched off at a time) and a text-only sweep; writes ``--plot`` (PNG).
- ``validate``: on this machine, for each 2-rank example config (``examples/kd.toml``,
  ``examples/mllm.toml``): profile the sections (``--from-run``: traced real runs of the
  sections and the monolithic layout at ``--micro-batches``; else compute-only), plan 2
  ranks (layouts the runtime runs: disjoint sections or the whole model per rank; fastest
  step), run the planned config, the hand-written one and the hand-written monolithic one
  for real, interleaved (``maestro.runtime.launch``; median of ``--repeats``), and print
  predicted (the measured window replayed: ``maestro.profiling.runs.replay_run``) vs
  measured step time.

Run: ``.venv/bin/python bench/maestro_plan.py [--part sim] [--gpus 64,256,1024]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def model_flops_per_sample(wl) -> float:
    """Model FLOPs per sample of an analytical workload: each active section's forward, x3
    for a trainable one (forward + backward), no recompute; with GPU-seconds per sample it
    gives the model-FLOPs utilisation (MFU) a plan implies."""
    from maestro.costmodel import micro_batch_features

    frozen = {s.name: s.frozen for s in wl.sections}
    total = 0.0
    for s in wl.samples:
        f = micro_batch_features([s.cost])
        for n in s.sections:
            total += wl.cost_model.shapes[n].forward_flops(f) * (1.0 if frozen[n] else 3.0)
    return total / len(wl.samples)


def _mfu(wl, gpu_hours_per_million: float) -> float:
    gpu_s_per_sample = gpu_hours_per_million * 3600.0 / 1e6
    return model_flops_per_sample(wl) / (gpu_s_per_sample * wl.cost_model.gpu.flops)


def calibration_part() -> None:
    """The cost model against published GPU runs (``maestro.estimate.calibration``)."""
    from maestro.estimate import calibration

    print("== cost model vs published runs (fit: the one row the kernel efficiency is fitted on)")
    print(calibration.format_table(calibration.compare()), flush=True)


def heavy_part(
    gpu_list: list[int],
    colocate: bool,
    names=("kd-72b", "mllm-vl", "mllm-internvl"),
    breakdown_at: int = 0,
) -> None:
    """Issue 30's table: the paper-like scenarios (fixed global batch) at each budget, Maestro
    against the three baselines, with ``--colocate`` when asked; then, at ``breakdown_at``
    GPUs, what each of Maestro's freedoms buys against the careful baseline (b')."""
    from maestro.plan import SearchOptions, breakdown, compare, format_comparison
    from maestro.plan.report import format_breakdown
    from maestro.plan.workload import ScenarioSpec, scenario_workload

    opts = SearchOptions(colocate=colocate)
    for name in names:
        for g in gpu_list:
            t = time.perf_counter()
            wl = scenario_workload(ScenarioSpec(name=name, gpus=g))
            c = compare(wl, g, opts, match=False)
            print(f"\n== {name} at {g} GPUs{' (--colocate)' if colocate else ''}")
            print(format_comparison(wl.label, g, c))
            print(f"({time.perf_counter() - t:.0f} s)", flush=True)
            if g == breakdown_at:
                t = time.perf_counter()
                print(format_breakdown(breakdown(wl, g, opts), c.careful))
                print(f"(breakdown {time.perf_counter() - t:.0f} s)", flush=True)


def sim_part(gpu_list: list[int], plot: str, text_only: list[float]) -> None:
    from maestro.plan import SearchOptions, breakdown, compare, plan_monolithic
    from maestro.plan.workload import load_scenario, scenario_workload

    print("== planner on analytical H100s (GPU-h per million samples; saving vs monolithic)")
    print(
        "steady-state steps (4 replayed; a frozen section runs one step ahead, as the runtime); "
        "mono: balanced-sampler monolithic; mono(d-o): data-order shards; 1st: saving on one "
        "step from idle; bound: saving if all fill/drain overlapped; match: GPUs Maestro needs "
        "for mono's rate; MFU: model FLOPs utilisation of maestro / mono (no recompute FLOPs)"
    )
    print(
        f"{'scenario':<11}{'gpus':>5}{'maestro':>9}{'mono':>8}{'saving':>8}{'mono(d-o)':>10}"
        f"{'saving':>8}{'1st':>7}{'bound':>7}{'match':>7}{'MFU':>12}{'time s':>8}  layouts"
    )
    sizes: dict[str, list[tuple[int, float, float]]] = {}
    for fname in ("paper_kd.toml", "paper_mllm.toml"):
        spec = load_scenario(EXAMPLES / fname)
        for g in gpu_list:
            t = time.perf_counter()
            wl = scenario_workload(replace(spec, gpus=g))
            c = compare(wl, g)
            raw = plan_monolithic(
                wl.samples,
                wl.sections,
                wl.cost_model,
                g,
                SearchOptions(balance_monolithic=False),
            )
            raw_saving = 1 - c.maestro.gpu_hours_per_million / raw.gpu_hours_per_million
            first = 1 - (c.maestro.gpus * c.maestro.first_step) / (
                c.monolithic.gpus * c.monolithic.first_step
            )
            match = c.match.gpus if c.match is not None else "-"
            print(
                f"{spec.name:<11}{g:>5}{c.maestro.gpu_hours_per_million:>9.2f}"
                f"{c.monolithic.gpu_hours_per_million:>8.2f}{100 * c.saving:>7.1f}%"
                f"{raw.gpu_hours_per_million:>10.2f}{100 * raw_saving:>7.1f}%"
                f"{100 * first:>6.1f}%{100 * c.saving_bound:>6.1f}%{match:>7}"
                f"{100 * _mfu(wl, c.maestro.gpu_hours_per_million):>6.1f}/"
                f"{100 * _mfu(wl, c.monolithic.gpu_hours_per_million):>4.1f}%"
                f"{time.perf_counter() - t:>8.1f}  {c.maestro.describe()} | "
                f"{c.monolithic.describe().removeprefix('monolithic: ').split(',')[0]}",
                flush=True,
            )
            sizes.setdefault(spec.name, []).append((g, c.saving, raw_saving))

    print("\n== breakdown at 256 GPUs: GPU-h/M added when one freedom is switched off")
    for fname in ("paper_kd.toml", "paper_mllm.toml"):
        spec = load_scenario(EXAMPLES / fname)
        wl = scenario_workload(replace(spec, gpus=256))
        b = breakdown(wl, 256)
        full = b.pop("full")
        print(f"{spec.name} (full plan {full:.2f} GPU-h/M)")
        for label, extra in b.items():
            print(f"  {label:<54}{extra:>+8.2f}  ({100 * extra / full:+.1f}%)", flush=True)

    print("\n== MLLM text-only sweep at 256 GPUs")
    print(f"{'text-only':>10}{'maestro':>9}{'mono':>8}{'saving':>8}{'bound':>8}")
    spec = load_scenario(EXAMPLES / "paper_mllm.toml")
    sweep = []
    for to in text_only:
        wl = scenario_workload(replace(spec, gpus=256, text_only=to))
        c = compare(wl, 256, match=False)
        print(
            f"{to:>10.0%}{c.maestro.gpu_hours_per_million:>9.2f}"
            f"{c.monolithic.gpu_hours_per_million:>8.2f}{100 * c.saving:>7.1f}%"
            f"{100 * c.saving_bound:>7.1f}%",
            flush=True,
        )
        sweep.append((to, c.saving))
    _plot(sizes, sweep, plot)
    print(f"\nplot: {plot}")


def _plot(sizes, sweep, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in sizes.items():
        g = [r[0] for r in rows]
        a.plot(g, [100 * r[1] for r in rows], "o-", label=f"{name} vs balanced monolithic")
        a.plot(g, [100 * r[2] for r in rows], "x--", label=f"{name} vs data-order monolithic")
    a.set_xscale("log", base=2)
    a.axhline(0, color="grey", lw=0.5)
    a.axhline(40, color="red", lw=0.5, ls=":", label="paper's ~40%")
    a.set_xlabel("GPUs")
    a.set_ylabel("GPU-hours saved (%)")
    a.set_title("saving vs cluster size")
    a.legend(fontsize=7)
    b.plot([100 * t for t, _ in sweep], [100 * s for _, s in sweep], "o-")
    b.axhline(0, color="grey", lw=0.5)
    b.set_xlabel("text-only samples (%)")
    b.set_ylabel("GPU-hours saved (%)")
    b.set_title("MLLM (vision+audio+LLM), 256 GPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def validate_part(
    steps: int, repeats: int, from_run: bool = False, micro_batches: list[int] | None = None
) -> None:
    import os
    import statistics

    from maestro.config import load
    from maestro.costmodel import MeasuredCostModel
    from maestro.plan import SearchOptions, plan_maestro
    from maestro.profiling.runs import replay_run
    from maestro.profiling.sections import profile_config
    from maestro.runtime.launch import RunOptions, launch
    from maestro.workloads import get_workload

    if from_run:
        src = "traced real runs" + (
            f" at micro-batches {','.join(map(str, micro_batches))} (sections and monolithic)"
            if micro_batches
            else " of the hand-written layout"
        )
    else:
        src = "compute-only micro-batches"
    print(f"\n== this machine, 2 ranks: planned layout vs the hand-written ones (s/step); {src}")
    print(f"load average at start {os.getloadavg()[0]:.2f}")
    print(
        f"{'config':<10}{'layout':<58}{'raw':>6}{'predicted':>10}{'measured':>10}{'error':>8}"
        "  runs (s/step, interleaved)"
    )
    tmp = tempfile.mkdtemp(prefix="maestro_plan_")
    for fname in ("kd.toml", "mllm.toml"):
        cfg = load(EXAMPLES / fname)
        cfg.steps = steps
        if from_run:
            # fitted from traced real runs (maestro.sim.calibrate): per-micro-batch overheads,
            # transfers, contention, and with micro_batches the monolithic runtime's own costs
            # at every size the search may pick; seeds differ from the measured runs'
            from maestro.profiling.runs import run_and_profile

            prof = run_and_profile(
                cfg,
                steps=steps,
                seed=cfg.seed + 100,
                micro_batches=micro_batches,
                monolithic=bool(micro_batches),
                scheduler="wavefront" if micro_batches else None,
            )
        else:
            prof = profile_config(cfg, repeats=2)
        cm = MeasuredCostModel.from_profile(prof)
        if prof.get("step_scale"):
            print(
                f"{fname}: step correction (measured / replayed, profiling runs) "
                + ", ".join(f"{k} {v:.3f}" for k, v in prof["step_scale"].items())
                + "; by micro-batch size (used): "
                + ", ".join(
                    f"{k} " + " ".join(f"{m}:{v:.3f}" for m, v in t.items())
                    for k, t in prof.get("step_scale_by_mbs", {}).items()
                )
            )
        # the planned run schedules with the profile it was planned on (``cost_profile``), so
        # its wavefront schedule is the one the planner scored (without one, the runtime
        # estimates costs from FLOPs)
        prof_path = Path(tmp) / f"{fname}.profile.json"
        prof_path.write_text(json.dumps(prof))
        wl = get_workload(cfg)
        samples = wl.sample_infos(wl.batch(0), wl.graph(build=[]))
        # layouts are scored over several batches of the workload, drawn with another seed
        # than the measured runs' (a sample of its data, not the batches measured)
        other = copy.deepcopy(cfg)
        other.seed = cfg.seed + 1000
        owl = get_workload(other)
        extra = [owl.sample_infos(owl.batch(k), owl.graph(build=[])) for k in range(8)]
        # what the runtime can run on 2 processes (disjoint sections, or the whole model on
        # every rank with data-order shards, as runtime/monolithic.py), fastest step
        opts = SearchOptions(
            colocate=False, objective="step_time", balance_monolithic=False, batches=extra
        )
        plan = plan_maestro(samples, cfg.section_specs(), cm, 2, opts)
        planned = load(EXAMPLES / fname)
        planned.steps = steps
        if plan.monolithic:
            planned.monolithic_micro_batch_size = next(
                iter(plan.sections.values())
            ).micro_batch_size
        else:
            planned.scheduler = "wavefront"
            planned.cost_profile = str(prof_path)
            for n, sp in plan.sections.items():
                planned.sections[n].dp = sp.dp
                planned.sections[n].micro_batch_size = sp.micro_batch_size
        layouts = (
            ("planned", planned, plan.monolithic),
            ("hand-written", cfg, False),
            ("hand-written monolithic", cfg, True),
        )
        runs: dict[str, list[float]] = {}
        # interleaved repeats: load from other processes drifts; the median is kept
        for _ in range(repeats):
            for label, c, mono in layouts:
                res = launch(c, 2, RunOptions(progress=False, device="cpu", monolithic=mono))
                runs.setdefault(label, []).append(res["elapsed_s"] / res["measured_steps"])
        # predicted: what a run measures (``launch``'s elapsed over the steps after the
        # warm-up, from a common barrier, each step its own batch), replayed on the profile;
        # raw, and with the step-level correction fitted on the profiling runs
        for label, c, mono in layouts:
            raw = replay_run(cm, c, mono)
            pred = replay_run(cm, c, mono, corrected=True)
            if mono:
                lay = f"monolithic mbs={c.monolithic_micro_batch_size}"
            else:
                lay = (
                    ", ".join(
                        f"{n} dp={s.dp} mbs={s.micro_batch_size}" for n, s in c.sections.items()
                    )
                    + f" {c.scheduler}"
                )
            med = statistics.median(runs[label])
            print(
                f"{fname:<10}{label + ': ' + lay:<58}{raw:>6.3f}{pred:>10.3f}{med:>10.3f}"
                f"{100 * (pred - med) / med:>+7.1f}%  " + " ".join(f"{t:.3f}" for t in runs[label]),
                flush=True,
            )
    print(f"load average at end {os.getloadavg()[0]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="calibration,heavy,sim,validate")
    ap.add_argument("--gpus", default="64,256,1024")
    ap.add_argument("--heavy-gpus", default="256,1024", help="budgets of the heavy scenarios")
    ap.add_argument("--colocate", action="store_true", help="heavy: also colocated layouts")
    ap.add_argument(
        "--scenarios", default="kd-72b,mllm-vl,mllm-internvl", help="heavy: scenarios to plan"
    )
    ap.add_argument(
        "--breakdown-at", type=int, default=256, help="heavy: budget of the breakdown (0: none)"
    )
    ap.add_argument("--text-only", default="0,0.2,0.4,0.6,0.8")
    ap.add_argument("--plot", default="maestro_plan.png")
    ap.add_argument("--steps", type=int, default=6, help="steps per real run (validate)")
    ap.add_argument(
        "--repeats", type=int, default=3, help="real runs per layout, interleaved (median kept)"
    )
    ap.add_argument(
        "--from-run",
        action="store_true",
        help="validate: fit the profile from traced real runs instead of compute-only timing",
    )
    ap.add_argument(
        "--micro-batches",
        default="1,2,4,8",
        help="validate --from-run: micro-batch sizes of the traced runs (sections and "
        "monolithic); empty: the hand-written layout only",
    )
    args = ap.parse_args()
    parts = args.part.split(",")
    t = time.perf_counter()
    if "calibration" in parts:
        calibration_part()
    if "heavy" in parts:
        heavy_part(
            [int(x) for x in args.heavy_gpus.split(",")],
            args.colocate,
            tuple(args.scenarios.split(",")),
            args.breakdown_at,
        )
    if "sim" in parts:
        sim_part(
            [int(x) for x in args.gpus.split(",")],
            args.plot,
            [float(x) for x in args.text_only.split(",")],
        )
    if "validate" in parts:
        mbs = [int(x) for x in args.micro_batches.split(",") if x]
        validate_part(args.steps, args.repeats, args.from_run, mbs or None)
    print(f"\ntotal {time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
