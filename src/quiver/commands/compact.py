"""``quiver compact DIR``: fold a served dataset's update log into its files.

``quiver serve`` logs every update (``POST /v1/update``) to ``DIR/updates.log`` and replays it
at start-up; compaction writes the current graph as a new generation of files
(``DIR/gen-<seq>/``), switches ``manifest.json`` to it atomically and empties the log, so
start-up stops replaying. Homogeneous and heterogeneous datasets alike. Refused while a server
holds the directory. Example::

    quiver compact data/products
"""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser(
        "compact",
        help="fold a dataset's update log into its files (not while it is served)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "dataset_dir", metavar="DATASET_DIR", help="a `quiver prepare` dir served with updates"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import time

    from quiver.hetero.graph import is_hetero_dir

    if is_hetero_dir(args.dataset_dir):
        from quiver.hetero.updates import compact
    else:
        from quiver.serving.live import compact_homogeneous as compact
    t0 = time.perf_counter()
    folded, seq = compact(args.dataset_dir)
    if folded == 0:
        print(f"{args.dataset_dir}: nothing to compact (log empty, at seq {seq})")
    else:
        print(
            f"{args.dataset_dir}: folded {folded} updates (up to seq {seq}) into gen-{seq} in "
            f"{time.perf_counter() - t0:.1f}s"
        )
    return 0
