"""``maestro simulate``: predict a step of a schedule at any scale and draw its Gantt chart."""

from __future__ import annotations

import argparse
from pathlib import Path

#: the built-in scenarios: the light ones, their aliases and the paper-like heavy ones
from maestro.sim.scenarios import NAMES as SCENARIOS

#: the monolithic baselines ``--scheduler`` knows: name -> (sampler order, label); the same
#: three samplers ``maestro plan`` compares (``maestro.plan.report.BASELINES``)
MONOLITHIC = {
    "monolithic": ("data", "conventional (a): data order"),
    "monolithic-tokens": ("tokens", "careful (b'): token-count-balanced sampler"),
    "monolithic-balanced": (
        "cost",
        "tuned (b, contains Maestro's cost-aware balancer)",
    ),
}


def register(sub) -> None:
    p = sub.add_parser(
        "simulate",
        help="replay a schedule on a cost model: step time, utilisation, bubbles, Gantt PNG",
        description=(
            "CONFIG is a scenario on analytical GPU presets (paper-like: kd-72b, mllm-vl, "
            "mllm-internvl; light: kd, mllm, mllm-audio), a scenario file (a built-in "
            "scenario's [scenario] table, or the user's own [sections.NAME], "
            "examples/optimus_table10.toml), "
            "or a run config TOML, simulated on a profile measured on this machine."
        ),
    )
    p.add_argument(
        "config",
        metavar="CONFIG",
        help="kd-72b | mllm-vl | mllm-internvl | kd | mllm | mllm-audio | path/to/run.toml",
    )
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="ranks to simulate (scenarios: default 256; TOML: its sum of dp); "
        "sections get dp proportional to their work when it differs",
    )
    p.add_argument(
        "--scheduler",
        default="all",
        help="fifo | wavefront | monolithic (conventional baseline a: data order) | "
        "monolithic-tokens (careful b': token-count-balanced sampler) | monolithic-balanced "
        "(tuned b: Maestro's cost-aware balancer) | all (default: all, with ratios)",
    )
    p.add_argument("--gpu", default="H100", help="GPU preset for scenarios: H100 or H200")
    p.add_argument(
        "--samples",
        type=int,
        default=None,
        help="global batch (scenarios: default 8 per GPU; TOML: its global_batch)",
    )
    p.add_argument(
        "--text-only",
        type=float,
        default=0.4,
        help="text-only share of the mllm scenario (default 0.4)",
    )
    p.add_argument(
        "--profile",
        default=None,
        help="JSON profile from `maestro profile` (TOML configs; measured now if omitted)",
    )
    p.add_argument(
        "--monolithic-mbs",
        type=int,
        default=None,
        help="whole-model micro-batch size of the monolithic baseline (default: "
        "TOML's monolithic_micro_batch_size, else the smallest section's)",
    )
    p.add_argument(
        "--gantt",
        default="simulate.png",
        help="Gantt chart PNG path; the scheduler name is added when several run",
    )
    p.add_argument("--no-gantt", action="store_true", help="do not draw a Gantt chart")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic batch")
    p.set_defaults(func=run)


def load_workload(args: argparse.Namespace):
    """``(label, samples, sections, cost_model, monolithic_mbs)`` for the CLI arguments."""
    from maestro.sim.scenarios import build, proportional_dp

    if args.gpus is not None and args.gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {args.gpus}")
    if args.config in SCENARIOS:
        sc = build(args.config, args.gpus or 256, args.samples, args.gpu, args.seed, args.text_only)
        return sc.name, sc.samples, sc.sections, sc.cost_model, args.monolithic_mbs
    path = Path(args.config)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist (or give a scenario: {', '.join(SCENARIOS)})"
        )
    scen = _scenario_file(path, args)
    if scen is not None:
        return scen
    from maestro.config import load
    from maestro.costmodel import MeasuredCostModel
    from maestro.plan.tpmodel import config_strategies, with_layout
    from maestro.plan.workload import section_facts
    from maestro.workloads import get_workload

    cfg = load(path)
    if args.samples is not None:
        if args.samples < 1:
            raise ValueError(f"--samples must be >= 1, got {args.samples}")
        cfg.global_batch = args.samples
    if args.profile is None:
        from maestro.profiling.sections import profile_config

        print("profiling the sections on this machine (pass --profile to reuse one) ...")
        cm = MeasuredCostModel.from_profile(profile_config(cfg))
    else:
        cm = MeasuredCostModel.from_profile(args.profile)
    # each section's tp/fsdp/zero/recompute, priced as the planner prices them
    cm.facts = {**section_facts(cfg), **cm.facts}
    cm = with_layout(cm, strategies=config_strategies(cfg))
    wl = get_workload(cfg)
    graph = wl.graph(build=[])  # routing only: no weights needed
    samples = wl.sample_infos(wl.batch(0), graph)
    sections = cfg.section_specs()
    if args.gpus is not None and args.gpus != cfg.world_size:
        sections = proportional_dp(samples, sections, cm, args.gpus)
    mbs = args.monolithic_mbs or cfg.monolithic_micro_batch_size
    return path.stem, samples, sections, cm, mbs


def _scenario_file(path: Path, args: argparse.Namespace):
    """A scenario file's workload (``maestro.sim.scenario_file``'s own sections, or a
    built-in scenario's ``[scenario]`` table), or ``None`` for a run config."""
    import tomllib

    try:
        head = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: invalid TOML: {e}") from None
    if "scenario" not in head:
        return None
    if args.samples is not None:
        raise ValueError("--samples: a scenario file sets its own global batch")
    from maestro.plan.workload import load_workload

    wl = load_workload(str(path), args.gpus)
    return wl.label, wl.samples, wl.sections, wl.cost_model, args.monolithic_mbs


def run(args: argparse.Namespace) -> int:
    import time

    from maestro.schedule import SCHEDULERS, get_scheduler, monolithic_schedule
    from maestro.schedule.monolithic import sampler_order
    from maestro.sim import simulate
    from maestro.sim.gantt import gantt

    if args.scheduler == "all":
        names = ["fifo", "wavefront", *MONOLITHIC]
    else:
        names = [args.scheduler]
    for n in names:
        if n not in MONOLITHIC:
            get_scheduler(n)  # ValueError lists the known names
    label, samples, sections, cm, mono_mbs = load_workload(args)
    # pipeline stages of a run config's sections (LayoutCostModel prices them per stage)
    strategy = getattr(cm, "strategy", None)
    pp = {s.name: (strategy(s.name).pp if strategy else 1) for s in sections}
    world = sum(s.dp * getattr(s, "tp", 1) * pp[s.name] for s in sections)  # replicas x tp x pp
    print(
        f"{label}: {len(samples)} samples on {world} ranks; "
        + ", ".join(
            f"{s.name} dp={s.dp}"
            + (f" pp={pp[s.name]}" if pp[s.name] > 1 else "")
            + f" mbs={s.micro_batch_size}"
            for s in sections
        )
    )
    if any(v > 1 for v in pp.values()):
        print(
            "  pipelined sections replay at their stages' throughput; 1F1B's fill and drain "
            "((pp - 1) stage micro-batches per step) are not in the timeline"
        )
    # the whole-model baselines run on every rank, stages included, without pipelining
    mono_cm = cm
    if any(v > 1 for v in pp.values()):
        from dataclasses import replace

        from maestro.plan.tpmodel import LayoutCostModel

        flat = {n: replace(st, pp=1, pp_shared=False) for n, st in cm.strategies.items()}
        mono_cm = LayoutCostModel(cm.base, flat, cm.overlap)
    results = {}
    for n in names:
        t = time.perf_counter()
        run_cm = cm
        if n in MONOLITHIC:
            run_cm = mono_cm
            # the baseline's sampler orders the batch; the shards are then contiguous
            units = [(s.name, s.frozen) for s in sections]
            mono_world = sum(s.dp * s.tp * pp[s.name] for s in sections)
            order = sampler_order(MONOLITHIC[n][0], samples, mono_world, run_cm, units)
            sched = monolithic_schedule(
                order, sections, run_cm, world_size=mono_world, micro_batch_size=mono_mbs
            )
        else:
            sched = SCHEDULERS[n](samples, sections, cm)
        t_sched = time.perf_counter() - t
        t = time.perf_counter()
        res = simulate(sched, samples, sections, run_cm, trace=not args.no_gantt)
        t_sim = time.perf_counter() - t
        results[n] = res
        what = f"{MONOLITHIC[n][1]}; " if n in MONOLITHIC else ""
        print(f"\n== {n} ({what}schedule {t_sched:.2f} s, simulation {t_sim:.2f} s)")
        print(res.table())
        if not args.no_gantt:
            out = Path(args.gantt)
            if len(names) > 1:
                out = out.with_name(f"{out.stem}_{n}{out.suffix or '.png'}")
            gantt(res, out, title=f"{label} {n}")
            print(f"gantt: {out}")
    if len(results) > 1:
        print()
        base = results.get("wavefront")
        for n, r in results.items():
            if base is not None and n != "wavefront":
                what = f" ({MONOLITHIC[n][1]})" if n in MONOLITHIC else ""
                print(f"wavefront vs {n}{what}: {r.step_time / base.step_time:.2f}x samples/s")
    return 0
