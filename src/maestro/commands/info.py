"""``maestro info``: versions, hardware and torch.distributed backends."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("info", help="print versions, hardware and distributed backends")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from maestro import __version__

    print(f"maestro {__version__}")
    print(f"torch {torch.__version__}")
    cuda = torch.cuda.is_available()
    print(f"cuda available: {cuda}" + (f" ({torch.cuda.device_count()} devices)" if cuda else ""))
    print(f"cpu threads: {torch.get_num_threads()}")
    ok = dist.is_available()
    print(
        f"distributed backends: gloo={ok and dist.is_gloo_available()} "
        f"nccl={ok and dist.is_nccl_available()}"
    )
    return 0
