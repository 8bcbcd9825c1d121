"""The ``maestro`` command line: one sub-command per module in ``maestro.commands``.

The docs' CLI reference is generated from ``build_parser()`` (``docs/hooks/reference.py``), so
help strings are the reference: every option needs one.

Each command module defines ``register(subparsers)``, which adds its parser and sets ``func``;
modules import heavy dependencies inside their functions so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from maestro import __version__

#: Command modules, in the order ``--help`` lists them. Add a line per new command.
COMMAND_MODULES = [
    "maestro.commands.info",
    "maestro.commands.train",
    "maestro.commands.export",
    "maestro.commands.simulate",
    "maestro.commands.profile",
    "maestro.commands.plan",
    "maestro.commands.estimate",
]


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser with every registered sub-command."""
    parser = argparse.ArgumentParser(
        prog="maestro", description="Maestro: compound-model training with per-section resources."
    )
    parser.add_argument("--version", action="version", version=f"maestro {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``maestro`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:
        # user mistakes: one clear line, no traceback
        print(f"maestro {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"maestro {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
