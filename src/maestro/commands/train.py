"""``maestro train CONFIG --nproc N``: train a compound model, each section on its own ranks."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    from maestro.train import add_arguments

    p = sub.add_parser(
        "train",
        help="train a compound model (sections on disjoint ranks; --monolithic for the baseline)",
        description="Spawn N local ranks (or run as one torchrun rank) and train the config's "
        "workload; rank 0 shows progress and prints a per-section summary.",
    )
    add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from maestro.train import run_reporting

    return run_reporting(args, "maestro train")
