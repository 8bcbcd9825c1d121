"""``quiver serve DATASET_DIR --checkpoint ckpt.pt --port 8000``: the HTTP server."""

from __future__ import annotations

import argparse


def add_serve_options(p) -> None:
    """Serving options shared by ``serve`` and ``bench``."""
    p.add_argument("--max-batch-nodes", type=int, default=256, help="seeds per batch (256)")
    p.add_argument("--max-wait-ms", type=float, default=2.0, help="batch wait (2 ms)")
    p.add_argument("--slo-ms", type=float, default=30.0, help="request deadline (30 ms)")
    p.add_argument("--queue", type=int, default=1024, help="admission queue capacity (1024)")
    p.add_argument(
        "--no-shed",
        dest="shed_late",
        action="store_false",
        help="do not shed requests that queueing makes miss --slo-ms (429); count bound only",
    )
    p.add_argument(
        "--no-fast-lane",
        dest="fast_lane",
        action="store_false",
        help="always use the overlapped pipeline, also when idle (default: an idle server runs a "
        "batch's stages back to back on one thread)",
    )
    p.add_argument("--max-request-nodes", type=int, default=1024, help="ids per request (1024)")
    p.add_argument("--sampler-workers", type=int, default=2, help="sampling threads (2)")
    p.add_argument(
        "--feature-cache",
        default="0",
        help="RAM for hot feature rows over the mmap file, e.g. 2G (0: load as is)",
    )
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible answers)")
    p.add_argument("--device", default=None, help="model device, e.g. cuda:0 (default cpu)")
    p.add_argument("--gpu-cache", default="4G", help="feature bytes cached on a GPU device (4G)")


def serve_config(args):
    from quiver.serving import ServeConfig

    return ServeConfig(
        max_request_nodes=args.max_request_nodes,
        queue_capacity=args.queue,
        max_batch_nodes=args.max_batch_nodes,
        max_wait_ms=args.max_wait_ms,
        slo_ms=args.slo_ms,
        num_sampler_workers=args.sampler_workers,
        shed_late=args.shed_late,
        fast_lane=args.fast_lane,
    )


def server_from_args(args):
    """A ``quiver.Server`` (not started) from DATASET_DIR, --checkpoint and the serve options."""
    from quiver.serving.server import Server

    return Server.from_dataset(
        args.dataset_dir,
        args.checkpoint,
        serve_config(args),
        seed=args.seed,
        feature_cache=args.feature_cache if args.feature_cache != "0" else 0,
        device=args.device,
        gpu_cache=args.gpu_cache,
    )


def register(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve GNN predictions over HTTP (POST /v1/predict, /healthz, /metrics)",
        description="Serves a `quiver train-model` checkpoint on a `quiver prepare` dataset.",
    )
    p.add_argument("dataset_dir", metavar="DATASET_DIR", help="a directory from `quiver prepare`")
    p.add_argument("--checkpoint", required=True, help="a checkpoint from `quiver train-model`")
    p.add_argument("--host", default="127.0.0.1", help="interface (127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (8000)")
    add_serve_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import signal
    import threading

    server = server_from_args(args)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start(args.host, args.port)
    except OSError as e:
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {e}") from None
    print(f"quiver serve: {server.info}")
    print(
        f"listening on {server.url}  (POST /v1/predict, GET /healthz, GET /metrics, /docs)",
        flush=True,
    )
    stop.wait()
    print("quiver serve: draining in-flight requests...", flush=True)
    server.stop()
    print("quiver serve: stopped", flush=True)
    return 0
