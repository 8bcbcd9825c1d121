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
        "--torch-threads",
        type=int,
        default=1,
        help="intra-op threads of the model thread, or of each lane with --lanes (1)",
    )
    p.add_argument(
        "--lanes",
        type=int,
        default=0,
        metavar="N",
        help="N lanes instead of the staged pipeline: each lane thread takes what is queued "
        "when it is free and runs sampling, gather and model back to back, so a small "
        "request starts on a free lane instead of waiting behind a large batch (0: the "
        "staged pipeline, --sampler-workers + one model thread) (0)",
    )
    p.add_argument(
        "--split-seeds",
        type=int,
        default=0,
        metavar="N",
        help="with --lanes: a batch of N or more distinct seeds taken while every other lane "
        "is idle is split in two, its second half sampled and run on a helper thread, so a "
        "large request at light load uses two cores (0: never) (0)",
    )
    p.add_argument(
        "--adaptive-batch",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a batch takes only the seeds its oldest request's remaining --slo-ms fits at the "
        "measured service time (full batches once that request is late anyway); "
        "--no-adaptive-batch: close at --max-batch-nodes only (default: on with --lanes, off "
        "for the staged pipeline)",
    )
    p.add_argument(
        "--auth-token-file",
        default=None,
        metavar="PATH",
        help="a file whose first line is the token POST /v1/update needs as 'Authorization: "
        "Bearer TOKEN' (default: $QUIVER_AUTH_TOKEN); required to take updates beyond "
        "loopback; `quiver bench --url` sends it",
    )
    p.add_argument(
        "--auth",
        choices=["updates", "predict"],
        default="updates",
        help="what the token guards: updates only, or predict too (updates)",
    )
    p.add_argument(
        "--read-only",
        action="store_true",
        help="take no updates (POST /v1/update answers 403); no token needed on any --host",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,
        help="largest request body; longer ones get 413 unread (1048576)",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="a request's headers, then its body, must arrive within this; else 408 and the "
        "connection closes (5)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="on SIGTERM, requests still running after this are cancelled; bodies still "
        "arriving get 503 at once (5)",
    )
    p.add_argument(
        "--docs",
        action="store_true",
        help="serve the interactive /docs and /redoc pages (their assets served by the server "
        "itself, so they render offline; needs the serve-docs extra); /openapi.json is always "
        "served",
    )
    p.add_argument(
        "--feature-cache",
        default="0",
        help="RAM for hot feature rows over the mmap file, e.g. 2G (0: load as is)",
    )
    p.add_argument(
        "--precision",
        default="fp32",
        metavar="auto|fp32|bf16",
        help="fp32 (as trained); bf16: feature rows gathered and the model run in bf16 "
        "(AMX / AVX-512-BF16 through oneDNN), logits still fp32; auto: per stage the faster "
        "on this CPU, as `quiver calibrate --checkpoint` recorded it for this machine (CPU "
        "model, bf16 flags, cores) and this model, else measured at start-up (seconds) and "
        "recorded in the manifest (default fp32)",
    )
    p.add_argument(
        "--fold-first-layer",
        default="auto",
        choices=["auto", "on", "off"],
        help="fold a SAGE model's first layer into the feature table: two (nodes x hidden) "
        "tables replace the features and layer 1 needs no matrix product; auto: when the "
        "model allows it, the tables fit in half the free RAM and it measures faster at "
        "start-up; the decision is recorded in the manifest and reused by later starts on this "
        "machine with this model, precision and fanouts (default auto)",
    )
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible answers)")
    p.add_argument("--device", default=None, help="model device, e.g. cuda:0 (default cpu)")
    p.add_argument("--gpu-cache", default="4G", help="feature bytes cached on a GPU device (4G)")
    p.add_argument(
        "--model",
        default=None,
        metavar="PACKAGE.MODULE:FACTORY",
        help="function (no arguments) building the torch_geometric module whose state_dict "
        "--checkpoint holds (or the factory the checkpoint records, called with its "
        "factory_kwargs); the current directory is importable",
    )
    p.add_argument(
        "--fanouts",
        default=None,
        help="sampling fanouts, one per layer, e.g. 15,10,5; -1 = all neighbours "
        "(default: the checkpoint's, else the manifest's)",
    )
    p.add_argument(
        "--model-input",
        choices=["edge_index", "subgraph", "adjs"],
        default=None,
        help="the model's forward: (x, edge_index) on the sampled subgraph with PyG's per-hop "
        "counts when it takes them (edge_index); (x, edge_index) on one plain subgraph, every "
        "layer on all sampled nodes, e.g. GraphSAGE(jk='cat') (subgraph); or torch-quiver's "
        "(x, adjs) (default: from forward's signature; subgraph for a model that takes the "
        "counts and has a JumpingKnowledge)",
    )
    p.add_argument(
        "--trust-pickle",
        action="store_true",
        help="allow a --checkpoint saved with torch.save(model) (unpickling runs its code), or "
        "one naming a factory outside quiver without --model (calling it runs its code)",
    )


def serve_config(args):
    from quiver.serving import ServeConfig
    from quiver.serving.auth import load_token

    token = load_token(getattr(args, "auth_token_file", None))
    auth_predict = getattr(args, "auth", "updates") == "predict"
    if auth_predict and token is None:
        raise ValueError(
            "--auth predict needs a token: --auth-token-file PATH (or $QUIVER_AUTH_TOKEN)"
        )
    return ServeConfig(
        auth_token=token,
        auth_predict=auth_predict,
        max_request_nodes=args.max_request_nodes,
        queue_capacity=args.queue,
        max_batch_nodes=args.max_batch_nodes,
        max_wait_ms=args.max_wait_ms,
        slo_ms=args.slo_ms,
        num_sampler_workers=args.sampler_workers,
        torch_threads=args.torch_threads,
        num_lanes=args.lanes,
        adaptive_batch=args.adaptive_batch,
        split_seeds=args.split_seeds,
        shed_late=args.shed_late,
        fast_lane=args.fast_lane,
        max_body_bytes=args.max_body_bytes,
        read_timeout_s=args.read_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
        docs=args.docs,
    )


def parse_fanouts(text: str | None):
    """``"15,10,5"`` -> ``[15, 10, 5]``; None stays None."""
    if text is None:
        return None
    try:
        fanouts = [int(k) for k in text.split(",")]
    except ValueError:
        raise ValueError(f"--fanouts must be comma-separated integers, got {text!r}") from None
    if any(k == 0 or k < -1 for k in fanouts):
        raise ValueError(f"--fanouts must be positive or -1 (all neighbours), got {text!r}")
    return fanouts


def server_kwargs(args) -> dict:
    """``Server.from_dataset`` keyword arguments from DATASET_DIR, --checkpoint and the options."""
    return dict(
        dataset_dir=args.dataset_dir,
        checkpoint=args.checkpoint,
        cfg=serve_config(args),
        fanouts=parse_fanouts(args.fanouts),
        model=args.model,
        trust_pickle=args.trust_pickle,
        convention=args.model_input,
        seed=args.seed,
        feature_cache=args.feature_cache if args.feature_cache != "0" else 0,
        device=args.device,
        gpu_cache=args.gpu_cache,
        precision=args.precision,
        fold=args.fold_first_layer,
    )


def server_from_args(args):
    """A ``quiver.Server`` (not started) from DATASET_DIR, --checkpoint and the serve options."""
    from quiver.serving.server import Server

    return Server.from_dataset(**server_kwargs(args))


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {port}")
    return port


def check_listen(host: str, port: int) -> None:
    """A one-line ``ValueError`` when ``host:port`` cannot be bound (checked before the start)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ValueError(f"--host {host}: cannot resolve it ({e})") from None
    family, kind, proto, _, addr = infos[0]
    try:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
    except OSError as e:
        raise ValueError(
            f"cannot listen on --host {host} --port {port}: {e.strerror or e}"
        ) from None


def register(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve GNN predictions over HTTP (POST /v1/predict, /healthz, /metrics)",
        description=(
            "Serves a model on a `quiver prepare` dataset: a state_dict with --model "
            "package.module:factory, a torch.export archive, or a `quiver train-model` checkpoint."
        ),
    )
    p.add_argument("dataset_dir", metavar="DATASET_DIR", help="a directory from `quiver prepare`")
    p.add_argument(
        "--checkpoint",
        required=True,
        help="a state_dict (with --model), a checkpoint recording its factory (what `quiver "
        "train-model` writes), or a torch.export archive (.pt2)",
    )
    p.add_argument("--host", default="127.0.0.1", help="interface (127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port (8000)")
    add_serve_options(p)
    add_replica_options(p)
    p.add_argument(
        "--target",
        metavar="TYPE[,TYPE]",
        default=None,
        help="heterogeneous dataset: the node types requests may name (default: the "
        "manifest's target, else every type with labels); --fanouts then also takes a JSON "
        "object per edge type, e.g. '{\"author__writes__paper\": [10, 5], ...}'",
    )
    add_peer_options(p)
    p.set_defaults(func=run)


def add_peer_options(p) -> None:
    """``--host-rank`` and its companions: one host of a ``quiver partition`` (feature shards)."""
    g = p.add_argument_group(
        "feature shards across hosts (after `quiver partition DATA --hosts K`)",
        "Serve as host R of K: this host holds the rows it owns or replicates and fetches the "
        "others from their owners, one batched exchange per batch over torch.distributed "
        "(gloo), while a responder thread answers the other hosts. Start every host with the "
        "same DATA partition, --hosts and --peer-addr; route each request to the host holding "
        "most of its rows (quiver.serving.routing.RoutedClient).",
    )
    g.add_argument(
        "--host-rank", type=int, default=None, metavar="R", help="this host's id, 0 <= R < K"
    )
    g.add_argument(
        "--hosts", type=int, default=None, metavar="K", help="hosts serving the partition"
    )
    g.add_argument(
        "--peer-addr",
        default="127.0.0.1:29500",
        metavar="HOST:PORT",
        help="rendezvous: host 0 listens here, the other hosts connect (127.0.0.1:29500)",
    )
    g.add_argument(
        "--partition-dir",
        default=None,
        metavar="DIR",
        help="a partitioned dataset directory or its partition/ folder (default: DATASET_DIR)",
    )
    g.add_argument(
        "--join-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="every host must join the rendezvous within this (120)",
    )
    g.add_argument(
        "--peer-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a batch waits this long for a peer's rows; then its requests get 500 and the "
        "peer counts as lost (10)",
    )
    g.add_argument(
        "--peer-linger",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, keep answering peers still serving for at most this (30)",
    )


def peer_config(args):
    """A ``PeerConfig`` from the host options; None when the server holds every feature row."""
    rank, hosts = getattr(args, "host_rank", None), getattr(args, "hosts", None)
    if rank is None and hosts is None and getattr(args, "partition_dir", None) is None:
        return None
    if rank is None or hosts is None:
        raise ValueError("serving a partition needs both --host-rank R and --hosts K")
    from quiver.feature.peer import PeerConfig

    return PeerConfig(
        host_rank=rank,
        hosts=hosts,
        peer_addr=args.peer_addr,
        partition_dir=args.partition_dir,
        join_timeout_s=args.join_timeout,
        peer_timeout_s=args.peer_timeout,
        linger_s=args.peer_linger,
    )


def add_replica_options(p) -> None:
    """``--replicas`` and its companions: engine replicas on Ray Serve (needs ``[scale]``)."""
    g = p.add_argument_group(
        "replicas (Ray Serve; pip install 'maestro-quiver[scale]')",
        "Run N engine replicas as a Ray Serve deployment behind Ray's HTTP proxy on "
        "--host/--port; each replica has the serve options above (validation, 429 admission).",
    )
    g.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="engine replicas on Ray Serve (default: one process, no Ray); with "
        "--min/--max-replicas the autoscaler's initial count",
    )
    g.add_argument("--min-replicas", type=int, default=None, help="autoscaling lower bound")
    g.add_argument("--max-replicas", type=int, default=None, help="autoscaling upper bound")
    g.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=16.0,
        help="autoscaling target: ongoing requests per replica (16)",
    )
    g.add_argument(
        "--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica (1)"
    )
    g.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="join this running Ray cluster (e.g. 10.0.0.1:6379, or auto) instead of starting "
        "a local one",
    )


def replica_config(args):
    """A ``ReplicaConfig`` from the replica options; None when the server runs in one process."""
    scaled = (args.min_replicas, args.max_replicas, args.ray_address)
    if args.replicas is None and all(v is None for v in scaled):
        return None
    from quiver.serving.replicas import ReplicaConfig

    n = args.replicas
    if n is None:  # bounds alone: start at the lower bound
        n = max(1, args.min_replicas or 1)
    return ReplicaConfig(
        num_replicas=n,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests,
        num_cpus=args.replica_cpus,
        ray_address=args.ray_address,
    )


def run(args: argparse.Namespace) -> int:
    import signal
    import threading

    from quiver.hetero.graph import is_hetero_dir
    from quiver.serving.server import Server

    if is_hetero_dir(args.dataset_dir):
        return run_hetero(args)
    peers = peer_config(args)
    replicas = replica_config(args)
    if args.docs:
        from quiver.serving.app import offline_docs_app

        offline_docs_app()  # without the packaged Swagger UI: one line, before the dataset loads
    if replicas is not None:
        if peers is not None:
            raise ValueError("--host-rank (feature shards) cannot be combined with --replicas")
        return run_replicated(args, replicas)
    check_listen(args.host, args.port)
    if peers is not None:
        print(
            f"quiver serve: host {peers.host_rank} of {peers.hosts}, waiting for the hosts at "
            f"{peers.peer_addr} (up to {peers.join_timeout_s:g} s)",
            flush=True,
        )
    kwargs = server_kwargs(args)
    # a partition's hosts serve read-only: an update would have to reach every host's shard
    why_not = "--read-only" if args.read_only else None
    if peers is not None:
        why_not = "--host-rank"
    updates = why_not is None
    from quiver.serving.auth import check_open_writes

    check_open_writes(args.host, updates, kwargs["cfg"].auth_token)
    server = Server.from_dataset(**kwargs, peers=peers, updates=updates)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start(args.host, args.port)
    except (OSError, RuntimeError) as e:
        server.stop()
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {e}") from None
    print(f"quiver serve: {server.info}" + ("" if updates else f"; read-only ({why_not})"))
    docs = ", /docs" if args.docs else ""
    writes = "POST /v1/update, " if updates else ""
    print(
        f"listening on {server.url}  (POST /v1/predict, {writes}GET /healthz, GET /metrics, "
        f"/openapi.json{docs})",
        flush=True,
    )
    stop.wait()
    print("quiver serve: draining in-flight requests...", flush=True)
    server.stop()
    if not server.stopped_cleanly:
        import os
        import sys

        left = server.peers.peers()
        lost = sorted(left["lost"])
        serving = sorted(set(range(peers.hosts)) - {peers.host_rank} - set(lost))
        serving = [h for h in serving if h not in left["said_bye"]]
        why = [f"lost: hosts {lost}"] if lost else []
        if serving:
            why.append(f"still serving after --peer-linger {peers.linger_s:g} s: hosts {serving}")
        print(
            f"quiver serve: stopped ({'; '.join(why)}); leaving without closing the gloo group",
            flush=True,
        )
        sys.stderr.flush()
        os._exit(0)  # gloo's destructors would wait on the responder's pending receive
    print("quiver serve: stopped", flush=True)
    return 0


def run_hetero(args: argparse.Namespace) -> int:
    """``quiver serve`` on a heterogeneous dataset (``quiver prepare --hetero``): a
    ``quiver.hetero.HeteroServer``; requests name a node type."""
    import signal
    import threading

    from quiver.hetero.server import HeteroServer

    unsupported = [
        (getattr(args, "replicas", None), "--replicas"),
        (getattr(args, "host_rank", None) is not None, "--host-rank"),
        (args.precision != "fp32", "--precision"),
        (args.device not in (None, "cpu"), "--device"),
        (args.docs, "--docs"),
        (args.model_input, "--model-input"),
        (args.fold_first_layer not in ("auto", "off"), "--fold-first-layer"),
    ]
    named = [flag for given, flag in unsupported if given]
    if named:
        raise ValueError(
            f"{', '.join(named)}: not available for a heterogeneous dataset yet (its model runs "
            "in fp32 on the CPU, in one process)"
        )
    from quiver.serving.auth import check_open_writes

    cfg = serve_config(args)
    check_open_writes(args.host, not args.read_only, cfg.auth_token)
    check_listen(args.host, args.port)
    server = HeteroServer.from_dataset(
        args.dataset_dir,
        args.checkpoint,
        cfg=cfg,
        fanouts=args.fanouts,
        targets=args.target.split(",") if args.target else None,
        model=args.model,
        trust_pickle=args.trust_pickle,
        seed=args.seed,
        feature_cache=args.feature_cache if args.feature_cache != "0" else "1G",
        updates=not args.read_only,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server.start(args.host, args.port)
    print(f"quiver serve: {server.info}")
    print(
        f"listening on {server.url}  (POST /v1/predict with node_type, GET /healthz, GET /metrics)",
        flush=True,
    )
    stop.wait()
    print("quiver serve: draining in-flight requests...", flush=True)
    server.stop()
    print("quiver serve: stopped", flush=True)
    return 0


def run_replicated(args: argparse.Namespace, replicas) -> int:
    """``quiver serve --replicas N``: deploy on Ray Serve, wait for a signal, tear down."""
    import signal
    import threading
    from pathlib import Path

    from quiver.serving.replicas import import_serve, run_replicas, stop_replicas

    import_serve()  # a one-line error before any work when Ray is missing
    kwargs = server_kwargs(args)
    if kwargs["fold"] == "auto":
        # replicas share the memory-mapped features through the page cache; folded tables
        # would be built privately in every replica (--fold-first-layer on still asks for it)
        kwargs["fold"] = "off"
    # replicas run in Ray's worker processes, whose working directory is not ours
    for key in ("dataset_dir", "checkpoint"):
        kwargs[key] = str(Path(kwargs[key]).resolve())
    if replicas.ray_address is None:
        check_listen(args.host, args.port)
    lo, hi = replicas.bounds
    scale = f", autoscaling {lo}-{hi}" if replicas.autoscaling else ""
    # read-only: every replica holds its own copy of the graph, and an update acknowledged by
    # one would be missing from the others' answers (replicated, durable updates: not built)
    print(
        f"quiver serve: {replicas.num_replicas} replicas on Ray Serve{scale}; read-only (updates "
        "need one server process: serve without --replicas to take them)",
        flush=True,
    )
    url = run_replicas(kwargs, replicas, kwargs["cfg"].queue_capacity, args.host, args.port)
    stop = threading.Event()  # handlers set after ray.init, so they stay ours
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(
        f"listening on {url}  (Ray Serve proxy: POST /v1/predict, GET /healthz per replica, "
        "GET /metrics of all replicas)",
        flush=True,
    )
    stop.wait()
    print("quiver serve: stopping the replicas...", flush=True)
    stop_replicas(shutdown_ray=replicas.ray_address is None)
    print("quiver serve: stopped", flush=True)
    return 0
