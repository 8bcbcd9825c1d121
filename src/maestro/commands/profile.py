"""``maestro profile``: time and memory of each section of a run config on this machine."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser(
        "profile",
        help="measure each section's time and memory vs micro-batch size and sequence length",
    )
    p.add_argument("config", metavar="CONFIG", help="run config TOML")
    p.add_argument("--out", default="profile.json", help="output JSON (default profile.json)")
    p.add_argument("--sizes", default="1,2,4,8", help="micro-batch sizes to time")
    p.add_argument(
        "--seq-lens",
        default=None,
        help="also time every size at these text lengths, e.g. 32,64,128 (samples truncated)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timings per micro-batch (fastest kept)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: the config's threads per rank)",
    )
    p.add_argument(
        "--from-run",
        action="store_true",
        help="fit the profile from a short traced real run of CONFIG instead (per-micro-batch "
        "overheads, transfers, optimizer, contention; maestro.sim.calibrate)",
    )
    p.add_argument("--steps", type=int, default=6, help="--from-run: steps per run (default 6)")
    p.add_argument(
        "--runs", type=int, default=1, help="--from-run: traced runs per layout (default 1)"
    )
    p.add_argument(
        "--micro-batches",
        default=None,
        help="--from-run: run every section at each of these micro-batch sizes, and the "
        "monolithic layout too, e.g. 1,2,4,8 (fits per-sample and per-micro-batch costs, "
        "and the monolithic runtime's own; the planner stays within the largest)",
    )
    p.add_argument(
        "--seed", type=int, default=None, help="--from-run: data seed (default: the config's)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from maestro.config import load
    from maestro.costmodel import MeasuredCostModel
    from maestro.profiling.sections import profile_config

    sizes = _int_list(args.sizes, "--sizes")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    seq_lens = _int_list(args.seq_lens, "--seq-lens")
    cfg = load(args.config)
    if args.micro_batches is not None and not args.from_run:
        raise ValueError("--micro-batches needs --from-run (compute-only profiles use --sizes)")
    if args.from_run:
        return _from_run(cfg, args)
    prof = profile_config(
        cfg, sizes=sizes, repeats=args.repeats, threads=args.threads, seq_lens=seq_lens
    )
    with open(args.out, "w") as f:
        json.dump(prof, f, indent=1)
    cm = MeasuredCostModel.from_profile(prof)
    print(
        f"{'section':<12}{'rows':>5}{'fwd ms/sample':>15}{'fwd+bwd ms/sample':>19}"
        f"{'act KB/token':>14}{'peak MB':>9}"
    )
    for name, rec in prof["sections"].items():
        rows = rec["rows"]
        n = sum(r["features"]["samples"] for r in rows)
        f = sum(r["forward_s"] for r in rows) / n * 1e3
        fb = [r["forward_backward_s"] for r in rows if r.get("forward_backward_s") is not None]
        fbs = f"{sum(fb) / n * 1e3:.2f}" if fb else "-"
        tok = sum(r["features"].get("tokens", 0.0) for r in rows)
        act = sum(r.get("activation_bytes", 0) for r in rows)
        acts = f"{act / tok / 1e3:.1f}" if tok and act else "-"
        peak = max((r.get("peak_bytes", 0) for r in rows), default=0) / 1e6
        print(f"{name:<12}{len(rows):>5}{f:>15.2f}{fbs:>19}{acts:>14}{peak:>9.1f}")
    print(f"peak memory: {prof.get('peak_method', 'accounting')}")
    print(f"wrote {args.out} ({len(cm.forward)} sections fitted)")
    return 0


def _int_list(value: str | None, flag: str) -> list[int] | None:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (``None`` stays ``None``); ``ValueError`` names ``flag``."""
    if value is None:
        return None
    try:
        return [int(x) for x in value.split(",")]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {value!r}") from None


def _from_run(cfg, args: argparse.Namespace) -> int:
    """``--from-run``: trace a real run, fit the profile, print what was fitted."""
    import json

    from maestro.costmodel import MeasuredCostModel
    from maestro.profiling.runs import run_and_profile

    mbs = _int_list(args.micro_batches, "--micro-batches")
    prof = run_and_profile(
        cfg,
        steps=args.steps,
        seed=args.seed,
        runs=args.runs,
        micro_batches=mbs,
        monolithic=mbs is not None,
    )
    with open(args.out, "w") as f:
        json.dump(prof, f, indent=1)
    cm = MeasuredCostModel.from_profile(prof)
    print(f"{'section':<12}{'rows':>5}  {'features':<24}{'optimizer ms':>13}")
    for name, rec in prof["sections"].items():
        keys = sorted(cm.forward[name].coef)
        opt = rec["optimizer_s"] * 1e3
        print(f"{name:<12}{len(rec['rows']):>5}  {','.join(keys):<24}{opt:>13.2f}")
    if cm.whole_model is not None:
        w = cm.whole_model
        print(
            f"{'monolithic':<12}{len(prof['monolithic']['rows']):>5}  "
            f"{','.join(sorted(k for k in w.forward.coef if k != 'const')):<24}"
            f"{w.optimizer_s * 1e3:>13.2f}"
        )
    if mbs is not None:
        print(f"micro-batch sizes run: {','.join(map(str, mbs))} (the planner stays within them)")
    print(
        f"step overhead {prof['step_overhead_s'] * 1e3:.2f} ms, scheduler "
        f"{prof['scheduler_s'] * 1e3:.2f} ms, contention {prof['contention']:.2f} per other "
        "busy rank"
    )
    print(
        f"wrote {args.out} ({len(cm.forward)} sections fitted from {args.runs} run(s) per layout)"
    )
    return 0
