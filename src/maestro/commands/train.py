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
    import sys

    from maestro.runtime.faults import NonFiniteError
    from maestro.train import run as train_run

    try:
        return train_run(args)
    except NonFiniteError as e:
        print(f"maestro train: error: {e}", file=sys.stderr)
        return 1
