"""The ``quiver`` command line: one sub-command per module in ``quiver.commands`` (see README.md).

Each command module defines ``register(subparsers)``, which adds its parser and sets ``func``;
modules import heavy dependencies inside their functions so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from quiver import __version__

#: Command modules, in the order ``--help`` lists them. Add a line per new command.
COMMAND_MODULES = [
    "quiver.commands.info",
    "quiver.commands.prepare",
    "quiver.commands.partition",
    "quiver.commands.calibrate",
    "quiver.commands.train_model",
    "quiver.commands.serve",
    "quiver.commands.bench",
]


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser with every registered sub-command."""
    parser = argparse.ArgumentParser(
        prog="quiver", description="Quiver: low-latency GNN serving (CPU and GPU)."
    )
    parser.add_argument("--version", action="version", version=f"quiver {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``quiver`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:
        # user mistakes: one clear line, no traceback
        print(f"quiver {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"quiver {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
