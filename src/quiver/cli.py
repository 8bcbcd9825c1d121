"""The ``quiver`` command line: one sub-command per capability (see README.md)."""

from __future__ import annotations

import argparse
import sys

from quiver import __version__


def _cmd_info(args: argparse.Namespace) -> int:
    """Print versions and the hardware Quiver will use."""
    import numba
    import torch

    print(f"quiver {__version__}")
    print(f"torch {torch.__version__}  numba {numba.__version__}")
    cuda = torch.cuda.is_available()
    print(f"cuda available: {cuda}" + (f" ({torch.cuda.device_count()} devices)" if cuda else ""))
    print(f"cpu threads: {torch.get_num_threads()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser; sub-commands register themselves here."""
    parser = argparse.ArgumentParser(
        prog="quiver", description="Quiver: low-latency GNN serving (CPU and GPU)."
    )
    parser.add_argument("--version", action="version", version=f"quiver {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("info", help="print versions and available hardware")
    p.set_defaults(func=_cmd_info)
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
    except (ValueError, FileNotFoundError) as e:  # user mistakes: one line, no traceback
        print(f"quiver {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
