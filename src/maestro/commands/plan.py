"""``maestro plan``: choose each section's dp, tp and micro-batch size for a GPU budget."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="search per-section dp/tp/micro-batch layouts; GPU-hours against three "
        "monolithic baselines",
        description=(
            "CONFIG is a scenario (paper-like: kd-72b, mllm-vl, mllm-internvl; light: kd, mllm, "
            "mllm-audio), a scenario file on analytical GPU presets (a built-in scenario's, "
            "examples/paper_*.toml, or the user's own sections, models, modalities and token "
            "counts, examples/optimus_table10.toml), or a run config TOML timed "
            "on this machine. Prints the Maestro plan and three baselines, each the best "
            "monolithic plan under the same search: conventional (a, data order), careful "
            "(b', a token-count-balanced sampler) and tuned (b, contains Maestro's "
            "cost-aware balancer); their predicted step time, throughput, GPU-hours per "
            "million samples and Maestro's saving against each, and the GPUs Maestro needs "
            "to match the tuned baseline's throughput."
        ),
    )
    p.add_argument(
        "config",
        metavar="CONFIG",
        help="kd-72b | mllm-vl | mllm-internvl | kd | mllm | mllm-audio | path/to/file.toml",
    )
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="GPU budget (default: the scenario's, or the run config's sum of dp)",
    )
    p.add_argument(
        "--target-samples-per-s",
        type=float,
        default=None,
        help="also find the fewest GPUs (up to --gpus) whose Maestro plan reaches this rate",
    )
    p.add_argument(
        "--monolithic",
        action="store_true",
        help="write the tuned baseline's monolithic plan (b; its monolithic_order is "
        "balanced) to --out instead of the per-section one (when (b) uses pipeline or "
        "context parallelism, which maestro train --monolithic lacks: the best whole-model "
        "layout it runs)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="write the chosen plan as a run config for `maestro train` (a scenario: its "
        "Hugging Face job at full scale with the planned layout)",
    )
    p.add_argument(
        "--scale-down",
        type=int,
        default=0,
        metavar="K",
        help="scenarios: --out writes the same shapes K times narrower (layers / 16) and the "
        "layout shrunk to at most 4 ranks, to train on this machine (e.g. 64)",
    )
    p.add_argument(
        "--profile",
        default=None,
        help="JSON profile from `maestro profile` (run configs; measured now if omitted)",
    )
    p.add_argument(
        "--hardware",
        default=None,
        metavar="GPU",
        help="run configs: price the config's own sections (their modules' shapes, its "
        "data's lengths) on this analytical GPU (H100 or h100-sxm, H200, A100 or a100-80g) "
        "instead of timing them on this machine",
    )
    p.add_argument(
        "--simulate-top",
        type=int,
        default=3,
        help="layouts replayed in the simulator per plan (default 3)",
    )
    p.add_argument(
        "--colocate",
        action="store_true",
        help="also search layouts where sections share devices (colocated groups; --out "
        "writes their [sections.NAME] group with its members' dp, fsdp and tp, which "
        "maestro train runs on the group's ranks)",
    )
    p.add_argument(
        "--pp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="give Maestro's sections pipeline stages (pp 2 and 4, which maestro train runs; "
        "--out writes them), priced from their real stages like the baselines' (default on; "
        "--no-pp searches without: the search nests, so --pp is never worse)",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="OUT.png",
        help="scenarios: plan every budget of --plot-gpus and draw GPU-hours per million "
        "samples for Maestro and the conventional (a), careful (b') and tuned (b) baselines",
    )
    p.add_argument(
        "--plot-gpus",
        default="64,128,256,512,1024",
        help="GPU budgets of --plot (default 64,128,256,512,1024)",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="re-plan with each per-section freedom off; print what each is worth and "
        "Maestro's saving against the careful baseline (b') with it off",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from maestro.plan import (
        SearchOptions,
        breakdown,
        compare,
        format_comparison,
        gpus_to_match,
        load_workload,
        plan_toml,
    )
    from maestro.plan.report import format_breakdown, layout_label

    if args.simulate_top < 1:
        raise ValueError(f"--simulate-top must be >= 1, got {args.simulate_top}")
    if args.target_samples_per_s is not None and not args.target_samples_per_s > 0:
        raise ValueError(f"--target-samples-per-s must be > 0, got {args.target_samples_per_s}")
    if args.scale_down < 0:
        raise ValueError(f"--scale-down must be >= 1, got {args.scale_down}")
    if args.scale_down and args.out is None:
        raise ValueError("--scale-down applies to the config --out writes: give --out")
    if args.out is not None and not Path(args.out).parent.is_dir():
        raise FileNotFoundError(f"--out: directory {Path(args.out).parent} does not exist")
    wl = load_workload(args.config, args.gpus, args.profile, args.hardware)
    if args.out is not None and wl.config is None and wl.scenario is None:
        raise ValueError(
            "--out writes a run config of a job (a run config's, or a built-in scenario's "
            "Hugging Face job); a scenario file's own sections have no job to train"
        )
    # a run config's plan must be runnable (disjoint sections or the whole model per rank) and
    # is for a fixed number of processes: the fastest step; scenarios: fewest GPU-hours
    run = wl.config is not None
    # (maestro.runtime's monolithic layout shards the batch in data order by default, so a
    # run config's own monolithic candidates are scored that way too; the three baselines
    # get their own samplers either way)
    opts = SearchOptions(
        simulate_top=args.simulate_top,
        colocate=args.colocate,
        objective="step_time" if run else "gpu_hours",
        monolithic_order="data" if run else "cost",
        pp_choices=(1, 2, 4) if args.pp else (1,),
    )
    from tqdm import tqdm

    from maestro.plan.report import BASELINES

    # a bar on stderr over the searches (seconds to minutes each at hundreds of GPUs); tqdm
    # stays silent when stderr is not a terminal
    with tqdm(
        total=len(BASELINES) + 2, desc="planning", unit="search", leave=False, disable=None
    ) as bar:
        started = []

        def say(label: str) -> None:
            if started:  # the previous search is done
                bar.update(1)
            started.append(label)
            bar.set_postfix_str(label.split(" (")[0])

        c = compare(wl, wl.gpus, opts, progress=say)
    print(format_comparison(wl.label, wl.gpus, c))
    if args.target_samples_per_s is not None:
        got = gpus_to_match(
            wl.samples, wl.sections, wl.cost_model, args.target_samples_per_s, wl.gpus, opts
        )
        if got is None:
            print(
                f"target {args.target_samples_per_s:g} samples/s: not reached within {wl.gpus} GPUs"
            )
        else:
            print(
                f"target {args.target_samples_per_s:g} samples/s: {got.gpus} GPUs "
                f"({got.samples_per_s:.1f} samples/s; {got.describe()})"
            )
    if args.breakdown:
        print(format_breakdown(breakdown(wl, wl.gpus, opts), c.careful))
    if args.plot is not None:
        from maestro.plan.plot import budget_sweep, format_sweep, plot_sweep

        if run:
            raise ValueError("--plot sweeps a scenario's GPU budget; CONFIG is a run config")
        try:
            budgets = [int(x) for x in args.plot_gpus.split(",")]
        except ValueError:
            raise ValueError(
                f"--plot-gpus: expected comma-separated integers, got {args.plot_gpus!r}"
            ) from None
        if not budgets or min(budgets) < 1:
            raise ValueError(f"--plot-gpus: budgets must be >= 1, got {args.plot_gpus!r}")
        pts = budget_sweep(args.config, budgets, opts)
        print("\n" + format_sweep(pts))
        plot_sweep(pts, wl.label, args.plot)
        print(f"plot: {args.plot}")
    if args.out is not None:
        plan = c.monolithic if args.monolithic else c.maestro
        if args.monolithic and any(s.pp > 1 or s.cp > 1 for s in plan.sections.values()):
            # the tuned baseline pipelines or splits sequences (it stands for other systems):
            # write the best whole-model layout maestro train runs instead
            from maestro.plan import plan_monolithic

            plan = plan_monolithic(wl.samples, wl.sections, wl.cost_model, wl.gpus, opts)
            print(
                "(the tuned baseline uses pp/cp; --out gets the best whole-model layout "
                "maestro train runs)"
            )
        if wl.config is not None and args.profile is not None and plan.order != "data":
            # the run's wavefront scheduler (or the monolithic cost-aware balancer) then
            # estimates costs with the profile the plan was scored on (without one it
            # estimates them from FLOPs)
            wl.config.cost_profile = str(Path(args.profile).resolve())
        if wl.config is None:
            scale = f"scaled down {args.scale_down}x" if args.scale_down else "full scale"
        else:
            scale = "run config"
        Path(args.out).write_text(plan_toml(wl, plan, args.scale_down))
        print(f"wrote {args.out} ({layout_label(plan)} plan, {scale}: {plan.describe()})")
    return 0
