"""``quiver info``: versions and the hardware Quiver will use."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("info", help="print versions and available hardware")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import numba
    import torch

    from quiver import __version__

    print(f"quiver {__version__}")
    print(f"torch {torch.__version__}  numba {numba.__version__}")
    cuda = torch.cuda.is_available()
    print(f"cuda available: {cuda}" + (f" ({torch.cuda.device_count()} devices)" if cuda else ""))
    print(f"cpu threads: {torch.get_num_threads()}")
    return 0
