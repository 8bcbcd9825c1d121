"""``maestro profile``: time each section of a run config on this machine (minimal profiler)."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser(
        "profile",
        help="measure each section's forward and forward+backward time; write a JSON profile",
    )
    p.add_argument("config", metavar="CONFIG", help="run config TOML")
    p.add_argument("--out", default="profile.json", help="output JSON (default profile.json)")
    p.add_argument("--sizes", default="1,2,4,8", help="micro-batch sizes to time")
    p.add_argument("--repeats", type=int, default=3, help="timings per micro-batch (fastest kept)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: the config's threads per rank)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from maestro.config import load
    from maestro.costmodel import MeasuredCostModel
    from maestro.sim.profile import profile_config

    try:
        sizes = [int(x) for x in args.sizes.split(",")]
    except ValueError:
        raise ValueError(f"--sizes must be comma-separated integers, got {args.sizes!r}") from None
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    cfg = load(args.config)
    prof = profile_config(cfg, sizes=sizes, repeats=args.repeats, threads=args.threads)
    with open(args.out, "w") as f:
        json.dump(prof, f, indent=1)
    cm = MeasuredCostModel.from_profile(prof)
    print(f"{'section':<12}{'rows':>5}{'fwd ms/sample':>15}{'fwd+bwd ms/sample':>19}")
    for name, rec in prof["sections"].items():
        rows = rec["rows"]
        n = sum(r["features"]["samples"] for r in rows)
        f = sum(r["forward_s"] for r in rows) / n * 1e3
        fb = [r["forward_backward_s"] for r in rows if r.get("forward_backward_s") is not None]
        fbs = f"{sum(fb) / n * 1e3:.2f}" if fb else "-"
        print(f"{name:<12}{len(rows):>5}{f:>15.2f}{fbs:>19}")
    print(f"wrote {args.out} ({len(cm.forward)} sections fitted)")
    return 0
