"""The ``quiver`` command line: one sub-command per module in ``quiver.commands``.

The docs' CLI reference is generated from ``build_parser()`` (``docs/hooks/reference.py``), so
help strings are the reference: every option needs one.

Each command module defines ``register(subparsers)``, which adds its parser and sets ``func``;
modules import heavy dependencies inside their functions so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import re
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
    "quiver.commands.compact",
    "quiver.commands.bench",
]


#: a comma-separated list of integers with a negative one first, e.g. ``-1,-1`` or ``-1,10``
_NEGATIVE_INT_LIST = re.compile(r"^-\d+(,-?\d+)*$")


class _Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` that reads ``--fanouts -1,-1`` as ``--fanouts=-1,-1`` and
    reports a mistake in one line, without the usage dump.

    argparse takes a word that starts with ``-`` for an option unless it is one negative
    number, so ``--fanouts -1,-1`` (all neighbours, as the docs write it) failed with
    "expected one argument". A comma list of integers that follows an option taking one value
    is attached to it. Sub-command parsers are of this class too (``add_subparsers`` makes
    them so), and each attaches the values of its own options.
    """

    def error(self, message: str):
        """Exit 2 with one line (argparse prints the whole usage first): the error and where
        the options are listed."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(self._attach_int_lists(args), namespace)

    def _attach_int_lists(self, args: list[str]) -> list[str]:
        out: list[str] = []
        i = 0
        while i < len(args):
            word = args[i]
            if word == "--":  # everything after it is positional
                return out + args[i:]
            action = self._option_string_actions.get(word)
            if (
                action is not None
                and action.nargs is None  # takes exactly one value
                and i + 1 < len(args)
                and _NEGATIVE_INT_LIST.match(args[i + 1])
            ):
                out.append(f"{word}={args[i + 1]}")
                i += 2
                continue
            out.append(word)
            i += 1
        return out


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser with every registered sub-command."""
    parser = _Parser(prog="quiver", description="Quiver: low-latency GNN serving (CPU and GPU).")
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
