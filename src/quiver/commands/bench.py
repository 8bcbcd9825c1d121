"""``quiver bench``: open-loop Poisson load against a server (URL) or an in-process engine."""

from __future__ import annotations

import argparse


def _rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",")]
    except ValueError:
        raise ValueError(f"--rates must be comma-separated numbers, got {text!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"--rates must be positive, got {text!r}")
    return rates


def _sizes(text: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition("-")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--sizes must look like 1-64, got {text!r}") from None
    return lo, hi


def register(sub) -> None:
    from quiver.commands.serve import add_serve_options

    p = sub.add_parser(
        "bench",
        help="open-loop load test: throughput and p50/p95/p99 latency per offered rate",
        description=(
            "Sends requests at Poisson arrival times (open loop: latency counts from the "
            "scheduled arrival) at each rate of --rates, either to --url or to an in-process "
            "server built from DATASET_DIR and --checkpoint. Prints a table, the sustained "
            "throughput under the SLO, and writes CSV and a latency-vs-throughput PNG."
        ),
    )
    p.add_argument(
        "dataset_dir",
        nargs="?",
        metavar="DATASET_DIR",
        help="serve this prepared dataset in-process (with --checkpoint)",
    )
    p.add_argument("--checkpoint", help="checkpoint for the in-process server")
    p.add_argument("--url", help="benchmark a running server instead, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--node-count",
        type=int,
        help="with --url: node ids are drawn below this (default: asked from /healthz)",
    )
    p.add_argument("--rates", default="50,100,200,400", help="requests/s (50,100,200,400)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per rate (5)")
    p.add_argument("--max-requests", type=int, default=20000, help="cap per rate (20000)")
    p.add_argument("--sizes", default="1-64", help="request sizes, uniform (1-64)")
    p.add_argument("--zipf", type=float, default=0.0, help="skew of node ids (0: uniform)")
    p.add_argument("--csv", default=None, help="write results here")
    p.add_argument("--plot", default=None, help="write latency-vs-throughput PNG here")
    p.add_argument("--label", default="quiver", help="system name in outputs (quiver)")
    add_serve_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from quiver.serving import loadgen

    rates = _rates(args.rates)
    lo, hi = _sizes(args.sizes)
    server = None
    if args.url:
        import httpx

        from quiver.serving.auth import load_token

        token = load_token(args.auth_token_file)
        try:
            health = httpx.get(args.url.rstrip("/") + "/healthz", timeout=10).json()
        except httpx.HTTPError as e:
            raise ValueError(f"cannot reach {args.url}: {e}") from None
        node_count = args.node_count or int(health["node_count"])

        async def make_target():
            return await loadgen.http_target(args.url, token=token)
    else:
        if not args.dataset_dir or not args.checkpoint:
            raise ValueError("give DATASET_DIR and --checkpoint, or --url of a running server")
        from quiver.commands.serve import server_from_args

        server = server_from_args(args).start()
        print(f"in-process server: {server.info}")
        node_count = server.engine.node_count

        async def make_target():
            async def close():
                return None

            return loadgen.engine_target(server.engine), close

    mix = loadgen.RequestMix(node_count, lo, hi, zipf=args.zipf)
    try:
        results = loadgen.sweep(make_target, mix, rates, args.duration, args.max_requests)
    finally:
        if server is not None:
            server.stop()
    curves = {args.label: results}
    print(loadgen.format_table(curves))
    best = loadgen.sustained_rps(results, args.slo_ms)
    print(f"sustained throughput at p99 <= {args.slo_ms:g} ms: {best:.1f} requests/s")
    if args.csv:
        loadgen.write_csv(args.csv, results, args.label)
        print(f"wrote {args.csv}")
    if args.plot:
        loadgen.plot(args.plot, curves, args.slo_ms)
        print(f"wrote {args.plot}")
    return 0
