"""Serving benchmark (issues 5 and 20): Quiver's engine against PyG and DGL serving, same graph,
same trained weights, same requests, each system at its best configuration. (Benchmark, not a
test.)

    .venv/bin/python bench/serving.py --runs 3            # products-like, median of 3 runs
    .venv/bin/python bench/serving.py --quick             # one shorter run, fewer configurations
    .venv/bin/python bench/serving.py --preset products-like --scale 200000 --quick

Steps, every one bounded in count and time (the expected duration is printed first):
1. dataset: reuse `--data` (default `data/<preset>[-<scale>]`) or generate it;
2. checkpoint: reuse `<data>/sage.pt` or train GraphSAGE (fanouts [15, 10, 5]) for a bounded
   number of steps; export its weights for DGL (`bench/baselines/export_weights.py`);
3. check that both baselines compute Quiver's logits exactly (fp32), on a graph whose
   in-degrees are below the fanouts (so sampling takes every neighbour and all three agree);
4. per run, every system in turn (the order rotates between runs), each over its
   configurations: Quiver in-process over `--quiver-configs` (staged pipeline, lanes) at
   `--precision` (auto by default), each baseline in its own env and process
   (`.bench-env/pyg`, `.bench-env/dgl`) over worker threads x intra-op threads
   (`--baseline-configs`, 1x1, 1x2, 2x1 within 2 cores). Each configuration sweeps the coarse
   rate grid, then each p99 bound's knee is bisected (`serving_common.next_probe`) on the
   configurations that can still be the best, until the last passing and the first failing
   rate are within `--tol`. The requests of a rate (sizes 1-64 uniform, uniform ids, Poisson
   arrivals) depend only on the rate and `--seed`, so every system runs the same ones;
5. per run: the best configuration of each system per bound and per light rate, the ratios;
   then (`--read-rate`, `--only-updates`) Quiver's read p50/p99 at a fixed rate without and
   with `--update-rate` durable updates/s on a copy of the dataset, and their p99 ratio;
   over runs: the median of each ratio, and the issue's targets as PASS / FAIL lines. Every
   table is printed with the CPU model and the load average. CSV, a latency-vs-throughput PNG
   (first run) and a JSON summary go under `--out`.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
BASELINES = REPO / "bench" / "baselines"
sys.path.insert(0, str(BASELINES))
sys.path.insert(0, str(REPO / "bench"))
import serving_common as common  # noqa: E402

from _machine import cpu_model  # noqa: E402

FANOUTS = [15, 10, 5]
BASELINE_TIMEOUT_S = 3600
#: The issue's targets: (figure, bound or rate, baseline, comparison, value).
TARGETS = [
    ("sustained", 30.0, "dgl", ">=", 3.0),
    ("sustained", 30.0, "pyg", ">=", 10.0),
    ("sustained", 100.0, "dgl", ">=", 3.0),
    ("light", 2.0, "dgl", "<=", 0.5),
    ("light", 4.0, "dgl", "<=", 0.5),
    ("light", 8.0, "dgl", "<=", 0.5),
    ("light", 16.0, "dgl", "<=", 0.5),
]
#: Seconds to start a system's process and load products-like (measured: imports, the graph
#: and features read into RAM, the model), for the duration estimate.
STARTUP_S = {"quiver": 40.0, "dgl": 25.0, "pyg": 25.0}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="products-like", help="synthetic preset (products-like)")
    p.add_argument("--scale", type=int, default=0, help="nodes (quiver.datasets.scaled; 0: as is)")
    p.add_argument("--data", help="prepared dataset dir (default data/<preset>[-<scale>])")
    p.add_argument("--checkpoint", help="checkpoint (default <data>/sage.pt, trained if absent)")
    p.add_argument("--train-steps", type=int, default=200, help="training steps if training (200)")
    p.add_argument("--rates", default="2,4,8,16,32,64,128", help="coarse rate grid, requests/s")
    p.add_argument("--duration", type=float, default=6.0, help="seconds of arrivals per rate (6)")
    p.add_argument("--max-requests", type=int, default=6000, help="cap per rate (6000)")
    p.add_argument(
        "--min-requests", type=int, default=40, help="floor per rate, for a p99 at low rates (40)"
    )
    p.add_argument("--sizes", default="1-64", help="request sizes, uniform (1-64)")
    p.add_argument("--slo-ms", type=float, default=30.0, help="p99 SLO (30 ms)")
    p.add_argument(
        "--extra-slos",
        default="100",
        help="more p99 bounds (ms) to find each system's sustained rate at (default 100, a "
        "target's bound); e.g. 50,100,300,1000 when the machine is shared",
    )
    p.add_argument("--tol", type=float, default=0.10, help="bisect a knee to within 10%% (0.10)")
    p.add_argument(
        "--refine-steps", type=int, default=3, help="bisection probes per bound and config (3)"
    )
    p.add_argument("--runs", type=int, default=1, help="runs; ratios are their median (1)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="one run, 4 s per rate, a knee to within 20%%, Quiver's default configuration "
        "only and baselines at 1x2,2x1: a smoke run of the whole benchmark (minutes)",
    )
    p.add_argument("--systems", default="quiver,pyg,dgl", help="which systems to run")
    p.add_argument(
        "--baseline-configs",
        default="1x1,1x2,2x1",
        help="baseline configurations, WORKERSxTHREADS (worker threads x intra-op threads "
        "each); 2x2 puts 4 busy threads on 2 cores and is left out by default (1x1,1x2,2x1)",
    )
    p.add_argument(
        "--quiver-configs",
        default="staged,lanes2x1",
        help="Quiver configurations: staged (batcher, --sampler-workers sampler threads, one "
        "model thread with --torch-threads, fast lane when idle; stagedxT: T model threads), "
        "pipeline[xT] (the same without the fast lane), lanesNxT (N lanes of T torch threads "
        "each, ServeConfig.num_lanes, sampling and gather on the lane's thread); suffixes "
        "-1t / -mt: sampling and gather on one / all cores, -cap / -nocap: adaptive batch "
        "cap on / off (default: on with lanes) (staged,lanes2x1)",
    )
    p.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "fp32", "bf16"],
        help="Quiver's serving precision (auto: measured on this CPU, see quiver serve)",
    )
    # Quiver's staged configuration as tuned on the 2-core machine (see BENCHMARKS.md)
    p.add_argument(
        "--fold",
        default="auto",
        choices=["auto", "on", "off"],
        help="Quiver's --fold-first-layer (auto: measured at start-up, see quiver serve)",
    )
    p.add_argument("--max-batch-nodes", type=int, default=256, help="Quiver batch seeds (256)")
    p.add_argument("--max-wait-ms", type=float, default=2.0, help="Quiver batch wait (2 ms)")
    p.add_argument("--sampler-workers", type=int, default=1, help="Quiver sampler threads (1)")
    p.add_argument("--torch-threads", type=int, default=2, help="Quiver model threads (2)")
    p.add_argument("--seed", type=int, default=0, help="dataset, requests and sampling seed (0)")
    p.add_argument("--skip-verify", action="store_true", help="skip the equal-logits check")
    p.add_argument("--out", default="data/serving-bench", help="output directory")
    p.add_argument(
        "--read-rate",
        type=float,
        default=20.0,
        help="the read-under-updates row: Quiver's reads/s, without then with updates (20; 0 "
        "skips the row)",
    )
    p.add_argument("--update-rate", type=float, default=100.0, help="updates/s of that row (100)")
    p.add_argument(
        "--only-updates",
        action="store_true",
        help="run only the read-under-updates row (dataset and checkpoint as usual)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.runs = 1
        args.duration = min(args.duration, 4.0)
        args.min_requests = min(args.min_requests, 30)
        args.tol = max(args.tol, 0.20)
        args.refine_steps = min(args.refine_steps, 2)
        args.quiver_configs = args.quiver_configs.split(",")[0]
        args.baseline_configs = "1x2,2x1"
    if args.runs < 1:
        p.error("--runs must be >= 1")
    return args


# ---- setup
def ensure_dataset(args) -> Path:
    from quiver.datasets import scaled, synthetic

    name = args.preset + (f"-{args.scale}" if args.scale else "")
    d = Path(args.data or REPO / "data" / name)
    if (d / "manifest.json").exists():
        print(f"dataset: reusing {d}")
        return d
    preset = scaled(args.preset, args.scale) if args.scale else args.preset
    print(f"dataset: generating {name} into {d}")
    tmp = d.with_name(d.name + ".tmp")
    synthetic(preset, seed=args.seed, out=tmp, progress=True)
    os.replace(tmp, d)
    return d


def ensure_checkpoint(args, data: Path) -> Path:
    from quiver.datasets import load_prepared
    from quiver.training import TrainConfig, train_model

    ckpt = Path(args.checkpoint or data / "sage.pt")
    if ckpt.exists():
        print(f"checkpoint: reusing {ckpt}")
        return ckpt
    print(f"checkpoint: training GraphSAGE {FANOUTS} for <= {args.train_steps} steps")
    ds = load_prepared(data)
    cfg = TrainConfig(
        model="sage",
        fanouts=tuple(FANOUTS),
        epochs=1,
        max_steps_per_epoch=args.train_steps,
        seed=args.seed,
        compare_mlp=False,
    )
    _, report = train_model(ds, cfg, out=ckpt)
    print(f"checkpoint: {ckpt} ({report})")
    return ckpt


def updates_row(args, data: Path, ckpt: Path) -> dict:
    """Read p50/p99 at ``--read-rate`` without, then with, ``--update-rate`` durable updates/s
    (add_edges and set_features alternating, each fsynced to the log before it is answered),
    on one Quiver server with updates on. It runs on a copy of the dataset (the updates stay
    out of ``data``)."""
    import asyncio
    import shutil
    import threading

    from quiver.serving.config import ServeConfig
    from quiver.serving.loadgen import RequestMix, engine_target, run_open_loop
    from quiver.serving.server import Server

    work = data.with_name(data.name + "-updates")
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(data, work, ignore=shutil.ignore_patterns("updates.log", ".serving.lock"))
    n_nodes = json.loads((work / "manifest.json").read_text())["num_nodes"]
    width = json.loads((work / "manifest.json").read_text())["num_features"]
    lo, _, hi = args.sizes.partition("-")
    srv = Server.from_dataset(
        work, ckpt, ServeConfig(slo_ms=args.slo_ms, num_lanes=2), seed=0, updates=True,
        fanouts=FANOUTS,
    )  # fmt: skip
    srv.start()
    out = {}
    try:
        send = engine_target(srv.engine)
        mix = RequestMix(n_nodes, int(lo), int(hi or lo))
        n = max(100, int(args.read_rate * args.duration * 2))
        for phase in ("without updates", "with updates"):
            stop, applied, waits = threading.Event(), [0], []

            def writer(stop=stop, applied=applied, waits=waits):
                rng = np.random.default_rng(1)
                period, nxt = 1.0 / args.update_rate, time.perf_counter()
                while not stop.is_set():
                    nxt += period
                    t0 = time.perf_counter()
                    if applied[0] % 2:
                        a, b = (int(v) for v in rng.integers(n_nodes, size=2))
                        u = {"op": "add_edges", "src": [a], "dst": [b]}
                    else:
                        row = rng.standard_normal((1, width)).tolist()
                        u = {"op": "set_features", "ids": [int(rng.integers(n_nodes))],
                             "features": row}  # fmt: skip
                    srv.update(u)
                    waits.append(time.perf_counter() - t0)
                    applied[0] += 1
                    time.sleep(max(0.0, nxt - time.perf_counter()))

            t = threading.Thread(target=writer) if phase == "with updates" else None
            t0 = time.perf_counter()
            if t is not None:
                t.start()
            res = asyncio.run(run_open_loop(send, mix.draw(n, seed=7), args.read_rate, seed=8))
            stop.set()
            if t is not None:
                t.join()
            elapsed = time.perf_counter() - t0
            out[phase] = {
                **asdict(res),
                "updates": applied[0],
                "updates_per_s": applied[0] / elapsed,
                "update_p99_ms": float(np.percentile(waits, 99) * 1e3) if waits else None,
            }
            print(
                f"  reads at {args.read_rate:g}/s {phase}: p50 {res.p50_ms:.2f} ms, p99 "
                f"{res.p99_ms:.2f} ms, {res.errors} errors, {applied[0]} updates "
                f"({applied[0] / elapsed:.0f}/s)"
                + (f", update p99 {out[phase]['update_p99_ms']:.2f} ms" if waits else ""),
                flush=True,
            )
        ratio = out["with updates"]["p99_ms"] / out["without updates"]["p99_ms"]
        out["p99_ratio"] = ratio
        print(f"  read p99 with / without updates: {ratio:.2f}x", flush=True)
    finally:
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    return out


def env_python(name: str) -> Path | None:
    py = REPO / ".bench-env" / name / "bin" / "python"
    return py if py.exists() else None


def run_baseline(python: Path, script: str, args_list: list[str], timeout: float) -> None:
    """Run one baseline script in its env, streaming its output; raise on failure."""
    cmd = [str(python), str(BASELINES / script), *args_list]
    proc = subprocess.run(cmd, timeout=timeout, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{script} failed (exit {proc.returncode}): {' '.join(cmd)}")


# ---- equal logits
def verify_graph(out: Path, in_dim: int, seed: int, num_nodes: int = 400, max_deg: int = 4) -> Path:
    """A prepared graph whose in-degrees (0..max_deg) are below every fanout, so sampling keeps
    all neighbours and every system's logits are a deterministic function of the weights."""
    from quiver.datasets import save_prepared
    from quiver.graph import CSRTopo

    rng = np.random.default_rng(seed)
    deg = rng.integers(0, max_deg + 1, size=num_nodes)
    indptr = np.concatenate([[0], np.cumsum(deg)]).astype(np.int64)
    # distinct sources per row (duplicates would be sampled as separate edges by some systems)
    indices = np.concatenate([rng.choice(num_nodes, size=k, replace=False) for k in deg]).astype(
        np.int64
    )
    feats = rng.standard_normal((num_nodes, in_dim)).astype(np.float32)
    labels = rng.integers(0, 2, size=num_nodes)
    save_prepared(
        out,
        CSRTopo(indptr=indptr, indices=indices),
        feats,
        labels,
        {"train": np.arange(10)},
        {"name": "verify"},
    )
    return out


def verify(args, ckpt: Path, weights: Path, work: Path, systems: list[str]) -> dict:
    from quiver.models import load_checkpoint
    from quiver.serving import ServeConfig
    from quiver.serving.server import Server

    model, _ = load_checkpoint(ckpt)
    g = verify_graph(work / "verify-graph", model.cfg.in_dim, args.seed)
    seeds = np.random.default_rng(args.seed).choice(400, size=64, replace=False)
    with Server.from_dataset(g, ckpt, ServeConfig(), fanouts=FANOUTS, seed=0) as server:
        logits = server.predict(seeds.tolist(), output="logits").values
    expected = work / "verify-expected.npz"
    np.savez(expected, seeds=seeds.astype(np.int64), logits=logits.astype(np.float32))
    status = {}
    for name in systems:
        py = env_python(name)
        if name == "pyg":
            run_baseline(
                py,
                "pyg_server.py",
                [str(g), "--checkpoint", str(ckpt), "--verify", str(expected)],
                600,
            )
        elif name == "dgl":
            run_baseline(
                py,
                "dgl_server.py",
                [str(g), "--weights", str(weights), "--verify", str(expected)],
                600,
            )
        status[name] = "equal logits to Quiver's (max |diff| < 1e-4)"
    return status


# ---- Quiver
def serve_config(args):
    from quiver.serving import ServeConfig

    return ServeConfig(
        max_batch_nodes=args.max_batch_nodes,
        max_wait_ms=args.max_wait_ms,
        slo_ms=args.slo_ms,
        num_sampler_workers=args.sampler_workers,
        torch_threads=args.torch_threads,
        # the sweep reads p99 at several bounds from one run, so nothing is shed at the 30 ms
        # one (the baselines too shed only requests far past every reported bound)
        shed_late=False,
    )


def parse_mode(mode: str) -> dict:
    """A Quiver configuration: ``staged`` (or ``fast``: staged threads, fast lane when idle),
    ``pipeline`` (staged, no fast lane), either with ``xT`` for T model threads instead of
    ``--torch-threads``, or ``lanesNxT`` (``num_lanes=N`` with T torch threads each).
    Sampling and gather calls use helper threads (all cores) in the staged modes and only the
    calling thread in lane modes, as ``Server.from_dataset`` sets them up; suffix ``-1t`` /
    ``-mt`` picks one or the other. Suffix ``-cap`` / ``-nocap``: the adaptive batch cap on /
    off (default: on with lanes, off staged, as ``ServeConfig.adaptive_batch``). Suffix
    ``-splitN``: ``ServeConfig.split_seeds = N`` (lanes: a lone lane's batch of N+ seeds
    split over two threads).

    Returns ``{"cfg": ServeConfig changes, "fast_lane": bool, "single_thread_calls": bool}``;
    ValueError when malformed.
    """
    base, *flags = mode.split("-")
    split = [f for f in flags if f.startswith("split")]
    flags = [f for f in flags if not f.startswith("split")]
    if any(not f.removeprefix("split").isdigit() for f in split) or len(split) > 1:
        raise ValueError(f"mode {mode!r}: write -splitN, e.g. lanes2x1-split24")
    if set(flags) - {"1t", "mt", "cap", "nocap"} or {"1t", "mt"} <= set(flags):
        raise ValueError(f"mode {mode!r}: unknown suffix; use -1t or -mt, -cap or -nocap")
    if {"cap", "nocap"} <= set(flags):
        raise ValueError(f"mode {mode!r}: -cap or -nocap, not both")
    name, _, threads = base.partition("x")
    spec = {"cfg": {}, "fast_lane": name != "pipeline"}
    if name.startswith("lanes"):
        n = name.removeprefix("lanes")
        if not n.isdigit() or not (threads or "1").isdigit() or int(n) < 1:
            raise ValueError(f"mode {mode!r}: write lanesNxT, e.g. lanes2x1")
        spec["cfg"] = {"num_lanes": int(n), "torch_threads": int(threads or 1)}
    elif name in ("staged", "fast", "pipeline"):
        if threads:
            if not threads.isdigit():
                raise ValueError(f"mode {mode!r}: write {name}xT, e.g. {name}x1")
            spec["cfg"] = {"torch_threads": int(threads)}
    else:
        raise ValueError(
            f"unknown mode {mode!r}; use staged[xT], pipeline[xT] or lanesNxT (+ -1t, -mt, "
            "-cap, -nocap)"
        )
    if spec["cfg"].get("torch_threads", 1) < 1:
        raise ValueError(f"mode {mode!r}: at least 1 torch thread")
    spec["single_thread_calls"] = "1t" in flags or (base.startswith("lanes") and "mt" not in flags)
    if "nocap" in flags or "cap" in flags:
        spec["cfg"]["adaptive_batch"] = "cap" in flags
    if split:
        spec["cfg"]["split_seeds"] = int(split[0].removeprefix("split"))
    return spec


def call_threads(engine, single: bool, all_threads: tuple[int, int]) -> None:
    """Let the engine's sampling and gather calls use one thread (the caller) or
    ``all_threads`` (sampler, gather) helper threads; ``Server.from_dataset`` sets the same
    up for a lane engine. A benchmark switch between configurations sharing one sampler and
    one feature store."""
    sampler = getattr(engine.sampler, "sampler", engine.sampler)  # quiver.pyg wraps it
    sampler.num_threads = 1 if single else all_threads[0]
    gather = getattr(engine.features, "_gather", None)  # quiver.Feature's CPU gather
    if gather is not None:
        gather.num_threads = 1 if single else all_threads[1]


def default_call_threads(engine) -> tuple[int, int]:
    """``(sampler, gather)`` threads per call the engine was built with."""
    sampler = getattr(engine.sampler, "sampler", engine.sampler)
    gather = getattr(engine.features, "_gather", None)
    return sampler.num_threads, gather.num_threads if gather is not None else 1


class QuiverSystem:
    """Quiver in-process: one dataset, checkpoint and model; one engine per configuration
    over the same sampler, features and model (one serves at a time)."""

    def __init__(self, args, data: Path, ckpt: Path, configs: list[str]):
        from quiver.serving.server import Server

        self.cfg = serve_config(args)
        self.specs = {c: parse_mode(c) for c in configs}
        # every row in RAM (quiver.Feature's host tier, FAP order), as the baselines hold theirs
        self.feature_bytes = (data / "features.npy").stat().st_size
        self.server = Server.from_dataset(
            data,
            ckpt,
            self.cfg,
            fanouts=FANOUTS,
            seed=args.seed,
            feature_cache=self.feature_bytes,
            precision=args.precision,
            fold=args.fold,
        )
        self.server.engine.warmup()
        self.all_threads = default_call_threads(self.server.engine)
        self.engines: dict = {}
        print(f"quiver: {self.server.info}")

    def engine(self, label: str):
        from quiver.serving import Engine

        spec = self.specs[label]
        if label not in self.engines:
            base = self.server.engine
            cfg = replace(self.cfg, **spec["cfg"])
            self.engines[label] = Engine(
                base.sampler, base.features, base.model, base.node_count, cfg,
                fast_lane=spec["fast_lane"],
            ).start()  # fmt: skip
        call_threads(self.engines[label], spec["single_thread_calls"], self.all_threads)
        return self.engines[label]

    def search(self, plan) -> dict:
        import asyncio

        from quiver.serving import loadgen

        t0 = time.perf_counter()

        def activate(label: str, warmup: int):
            engine = self.engine(label)
            print(f"  configuration {label}: {engine.cfg}", flush=True)
            send = loadgen.engine_target(engine)

            async def warm():
                reqs, _ = common.requests_for(plan, plan.rates[0])
                for nodes in reqs[:warmup]:
                    await send(nodes)

            asyncio.run(warm())
            return send

        results = common.search_configs(list(self.specs), activate, plan, progress=print)
        first = self.engine(next(iter(self.specs)))  # its call threads
        torch.set_num_threads(first.cfg.torch_threads)  # and its model threads, on this one
        reqs, _ = common.requests_for(plan, plan.rates[0])
        return {
            "results": results,
            "wall_s": time.perf_counter() - t0,
            "stage_ms": quiver_stage_ms(first, reqs, self.cfg.max_batch_nodes),
            "config": {
                "base": asdict(self.cfg),
                "configs": {k: v["cfg"] for k, v in self.specs.items()},
                "feature_cache_bytes": self.feature_bytes,
                "info": self.server.info,
            },
        }

    def close(self) -> None:
        for e in self.engines.values():
            e.stop()
        self.server.stop()


def quiver_stage_ms(engine, requests, batch_nodes: int, reps: int = 20) -> dict:
    """Mean ms of each stage for one request (~32 seeds) and one full batch, run directly
    (the first configuration's threads): wall and (``*_cpu``) process CPU ms."""
    out = {}
    rng = np.random.default_rng(1)
    full = rng.integers(0, engine.node_count, size=batch_nodes)
    for label, seeds in (("one request", None), (f"batch of {batch_nodes}", full)):
        t = {k: 0.0 for k in ("sample", "gather", "model", "sample_cpu", "gather_cpu", "model_cpu")}
        for r in range(reps):
            s = np.unique(np.asarray(requests[r % len(requests)]) if seeds is None else seeds)
            t0, c0 = time.perf_counter(), _cpu_s()
            n_id, _, adjs = engine.sampler.sample(torch.from_numpy(s))
            t1, c1 = time.perf_counter(), _cpu_s()
            x, model_adjs = engine.gather_inputs(n_id, adjs)  # a folded store: + layer 1
            t2, c2 = time.perf_counter(), _cpu_s()
            with torch.inference_mode():
                engine.model(x, model_adjs)
            t3, c3 = time.perf_counter(), _cpu_s()
            t["sample"] += t1 - t0
            t["gather"] += t2 - t1
            t["model"] += t3 - t2
            t["sample_cpu"] += c1 - c0
            t["gather_cpu"] += c2 - c1
            t["model_cpu"] += c3 - c2
        out[label] = {k: v * 1e3 / reps for k, v in t.items()}
    return out


def _cpu_s() -> float:
    """Process CPU seconds (every thread; the machine is otherwise idle during this)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ---- report
def machine_line() -> str:
    """The CPU model and load average, printed with every table."""
    la = os.getloadavg()
    return (
        f"machine: {cpu_model()}, {os.cpu_count()} cores; load average {la[0]:.2f} "
        f"{la[1]:.2f} {la[2]:.2f} (1/5/15 min)"
    )


def best_per_bound(results: dict, bounds) -> dict:
    """``{bound: (sustained req/s, configuration)}``: each bound's best configuration.

    Sustained = the highest offered rate at which every request was answered (none shed or
    failed) with p99 within the bound. The offered rate, not the served one: over a few
    seconds of Poisson arrivals the served rate is the offered one plus sampling noise, and
    every system runs the same arrivals at a rate.
    """
    out = {}
    for b in bounds:
        vals = [(common.knee(res, b)[0], label) for label, res in results.items()]
        out[b] = max(vals, default=(0.0, None))
    return out


def best_light(results: dict, rates) -> dict:
    """``{rate: (p99 ms, configuration)}``: the lowest p99 of any configuration at each rate
    (nan and None when no configuration ran it)."""
    out = {}
    for rate in rates:
        vals = [
            (r["p99_ms"], label)
            for label, res in results.items()
            for r in res
            if r["offered_rps"] == rate and r["rejected"] == 0 and r["errors"] == 0
        ]
        out[rate] = min(vals, default=(float("nan"), None))
    return out


def ratio(num: float, den: float) -> float:
    """``num / den`` with ``x / 0`` -> inf (x > 0) or nan (x = 0); nan in, nan out."""
    if math.isnan(num) or math.isnan(den):
        return float("nan")
    if den == 0:
        return float("inf") if num > 0 else float("nan")
    return num / den


def summarize_run(run: dict, bounds, light_rates) -> dict:
    """Per system the best configuration per bound and per light rate; Quiver's ratios."""
    sustained = {s: best_per_bound(v["results"], bounds) for s, v in run.items()}
    # met at the highest rate its best configuration ran: the figure is a lower bound
    open_ended = {
        s: {
            b: label is not None and common.knee(run[s]["results"][label], b)[1] is None
            for b, (_, label) in per.items()
        }
        for s, per in sustained.items()
    }
    light = {s: best_light(v["results"], light_rates) for s, v in run.items()}
    ratios = {}
    if "quiver" in run:
        for base in [s for s in run if s != "quiver"]:
            for b in bounds:
                ratios[f"sustained p99<={b:g} quiver/{base}"] = ratio(
                    sustained["quiver"][b][0], sustained[base][b][0]
                )
            for r in light_rates:
                ratios[f"p99 at {r:g} req/s quiver/{base}"] = ratio(
                    light["quiver"][r][0], light[base][r][0]
                )
    return {"sustained": sustained, "open_ended": open_ended, "light_p99": light, "ratios": ratios}


def median(values: list[float]) -> float:
    """Median of the defined values (inf counts; nan is left out); nan if none."""
    vals = [v for v in values if not math.isnan(v)]
    return float(np.median(vals)) if vals else float("nan")


def fmt_x(v: float) -> str:
    return "n/a" if math.isnan(v) else ("inf" if math.isinf(v) else f"{v:.2f}x")


def target_lines(medians: dict, per_run: list[dict], bounds, light_rates) -> list[str]:
    """One PASS / FAIL / n/a line per target of the issue (ratios: medians over the runs)."""
    lines = []
    for kind, at, base, cmp, want in TARGETS:
        if kind == "sustained":
            if at not in bounds:
                continue
            key = f"sustained p99<={at:g} quiver/{base}"
            what = f"sustained req/s at p99 <= {at:g} ms, Quiver / best {base.upper()}"
        else:
            if at not in light_rates:
                continue
            key = f"p99 at {at:g} req/s quiver/{base}"
            what = f"p99 at {at:g} req/s, Quiver / best {base.upper()}"
        if key not in medians:
            lines.append(f"  n/a   {what} {cmp} {want:g}x: {base} not run")
            continue
        v = medians[key]
        runs = ", ".join(fmt_x(r["ratios"].get(key, float("nan"))) for r in per_run)
        ok = (v >= want) if cmp == ">=" else (v <= want)
        verdict = "n/a " if math.isnan(v) else ("PASS" if ok else "FAIL")
        lines.append(f"  {verdict}  {what} {cmp} {want:g}x: {fmt_x(v)}   (runs: {runs})")
    return lines


def format_results(run: dict) -> str:
    """Every rate each configuration ran, one line each."""
    head = (
        f"{'system':<8} {'config':<20} {'offered':>8} {'rps':>8} {'p50ms':>8} {'p95ms':>8} "
        f"{'p99ms':>8} {'late':>5} {'rej':>5} {'err':>4}"
    )
    lines = [head]
    for system, v in run.items():
        for label, res in v["results"].items():
            for r in res:
                lines.append(
                    f"{system:<8} {label:<20} {r['offered_rps']:>8.1f} "
                    f"{r['throughput_rps']:>8.1f} {r['p50_ms']:>8.2f} {r['p95_ms']:>8.2f} "
                    f"{r['p99_ms']:>8.2f} {r['late']:>5} {r['rejected']:>5} {r['errors']:>4}"
                )
    return "\n".join(lines)


def print_run_summary(summary: dict, bounds, light_rates) -> None:
    print(machine_line())
    print("sustained req/s at each p99 bound (best configuration):")
    for system, per in summary["sustained"].items():
        opened = summary.get("open_ended", {}).get(system, {})
        cells = ", ".join(
            f"<={b:g} ms: {'>=' if opened.get(b) and v > 0 else ''}{v:.1f} ({lab or '-'})"
            for b, (v, lab) in per.items()
        )
        print(f"  {system:<8} {cells}")
    if any(v for per in summary.get("open_ended", {}).values() for v in per.values()):
        print("  (>=: met at the highest rate run; add higher --rates to find the knee)")
    print("p99 ms at the light rates (best configuration):")
    for system, per in summary["light_p99"].items():
        cells = ", ".join(f"{r:g}/s: {v:.1f} ({lab or '-'})" for r, (v, lab) in per.items())
        print(f"  {system:<8} {cells}")
    print("ratios:")
    for k, v in summary["ratios"].items():
        print(f"  {k:<36} {fmt_x(v)}")


def write_csv(path: Path, runs: list[dict]) -> None:
    rows = [
        {"run": i, "system": s, "config": label, **r}
        for i, run in enumerate(runs)
        for s, v in run.items()
        for label, res in v["results"].items()
        for r in res
    ]
    if not rows:
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def estimate_s(plan, configs: dict[str, int], runs: int) -> tuple[float, float]:
    """``(typical, at most)`` seconds of the whole benchmark.

    At most: every configuration sweeps the whole grid and every bound's knee takes every
    probe on two configurations. Typical: the sweeps stop past the knee (about 2/3 of the
    grid's time), and one configuration per bound needs the probes.
    """
    per_rate = [
        max(plan.min_requests, min(plan.max_requests, int(r * plan.duration_s))) / r + 0.3
        for r in plan.rates
    ]
    coarse = sum(per_rate) + 2.0  # + the warm-up
    probe = max(plan.duration_s, plan.min_requests / max(plan.rates)) + 1.0
    refine = len(plan.bounds_ms) * plan.refine_steps * probe
    # Quiver starts once (in this process); each baseline starts once per run
    once = STARTUP_S["quiver"] if "quiver" in configs else 0.0
    start = {s: 0.0 if s == "quiver" else STARTUP_S[s] for s in configs}
    most = sum(start[s] + n * coarse + 2 * refine for s, n in configs.items())
    typical = sum(start[s] + n * coarse * 2 / 3 + refine for s, n in configs.items())
    return once + typical * runs, once + most * runs


def run_baseline_search(args, name, data, ckpt, weights, plan_file, out: Path, tag: str) -> dict:
    """One baseline's configurations searched in its own env and process; its results JSON."""
    res_file = out / f"{name}-{tag}.json"
    model_arg = ["--checkpoint", str(ckpt)] if name == "pyg" else ["--weights", str(weights)]
    run_baseline(
        env_python(name),
        f"{name}_server.py",
        [
            str(data),
            *model_arg,
            "--plan",
            str(plan_file),
            "--configs",
            args.baseline_configs,
            "--out",
            str(res_file),
            "--slo-ms",
            str(args.slo_ms),
        ],
        BASELINE_TIMEOUT_S,
    )
    return json.loads(res_file.read_text())


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - {"quiver", "pyg", "dgl"}
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from quiver, pyg, dgl")
    for name in [s for s in systems if s != "quiver"]:
        if env_python(name) is None:
            print(f"{name}: .bench-env/{name} is not built (run `make bench-env`); skipping it")
            systems.remove(name)
    quiver_configs = [c.strip() for c in args.quiver_configs.split(",") if c.strip()]
    try:
        for c in quiver_configs:
            parse_mode(c)
        thread_configs = common.parse_thread_configs(args.baseline_configs)
    except ValueError as e:
        raise SystemExit(f"bench/serving.py: {e}") from None
    cores = os.cpu_count() or 1
    for w, t in thread_configs:
        if w * t > cores:
            print(f"note: baseline configuration {w}x{t} runs {w * t} threads on {cores} cores")
    rates = sorted(float(r) for r in args.rates.split(","))
    bounds = sorted({args.slo_ms, *(float(s) for s in args.extra_slos.split(",") if s.strip())})
    light_rates = [r for r in (2.0, 4.0, 8.0, 16.0) if r in rates]
    lo, _, hi = args.sizes.partition("-")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()

    data = ensure_dataset(args)
    ckpt = ensure_checkpoint(args, data)
    if args.only_updates:
        print(machine_line())
        print(f"read-under-updates ({args.update_rate:g} updates/s, 2 lanes):", flush=True)
        res = updates_row(args, data, ckpt)
        (out / "updates.json").write_text(json.dumps(res, indent=2) + "\n")
        return 0
    node_count = json.loads((data / "manifest.json").read_text())["num_nodes"]
    plan = common.Plan(
        rates=rates,
        bounds_ms=bounds,
        stop_ms=max(bounds),
        node_count=node_count,
        tol=args.tol,
        refine_steps=args.refine_steps,
        min_size=int(lo),
        max_size=int(hi or lo),
        duration_s=args.duration,
        min_requests=args.min_requests,
        max_requests=args.max_requests,
        seed=args.seed,
    )
    plan_file = out / "plan.json"
    plan.save(plan_file)
    n_configs = {
        s: (len(quiver_configs) if s == "quiver" else len(thread_configs)) for s in systems
    }
    typical, most = estimate_s(plan, n_configs, args.runs)
    print(machine_line())
    print(
        f"plan: {args.runs} run(s); systems {systems}; configurations {n_configs}; coarse "
        f"rates {rates}; p99 bounds {bounds} ms, knees to within {args.tol:.0%} "
        f"(<= {args.refine_steps} probes each); expected duration ~{typical / 60:.0f} min "
        f"(at most {most / 60:.0f} min)",
        flush=True,
    )

    weights = out / "sage-dgl.npz"
    if "dgl" in systems:
        from export_weights import export

        export(ckpt, weights, FANOUTS)
    verified = (
        {}
        if args.skip_verify
        else verify(args, ckpt, weights, out, [s for s in systems if s != "quiver"])
    )
    for name, v in verified.items():
        print(f"verify {name}: {v}")

    quiver = QuiverSystem(args, data, ckpt, quiver_configs) if "quiver" in systems else None
    runs: list[dict] = []
    summaries: list[dict] = []
    try:
        for i in range(args.runs):
            order = systems[i % len(systems) :] + systems[: i % len(systems)]
            print(f"\n=== run {i + 1}/{args.runs}: {', '.join(order)}")
            run: dict = {}
            for name in order:
                print(f"== {name} (run {i + 1})", flush=True)
                if name == "quiver":
                    run[name] = quiver.search(plan)
                else:
                    run[name] = run_baseline_search(
                        args, name, data, ckpt, weights, plan_file, out, f"run{i}"
                    )
            run = {s: run[s] for s in systems}  # a fixed order for the tables
            runs.append(run)
            summaries.append(summarize_run(run, bounds, light_rates))
            print(f"\n-- run {i + 1} results")
            print(machine_line())
            print(format_results(run))
            print_run_summary(summaries[-1], bounds, light_rates)
    finally:
        if quiver is not None:
            quiver.close()

    keys = list(summaries[0]["ratios"])
    medians = {k: median([s["ratios"].get(k, float("nan")) for s in summaries]) for k in keys}
    print(f"\n=== summary over {args.runs} run(s) (median of each ratio)")
    print(machine_line())
    for k in keys:
        vals = ", ".join(fmt_x(s["ratios"].get(k, float("nan"))) for s in summaries)
        print(f"  {k:<36} {fmt_x(medians[k]):>8}   (runs: {vals})")
    print("targets (issue 20):")
    for line in target_lines(medians, summaries, bounds, light_rates):
        print(line)
    print("per-stage mean ms (Quiver: direct calls, one request and one full batch; baselines:")
    print("per request served, by configuration), last run:")
    for k, v in runs[-1].items():
        print(f"  {k:<8} {json.dumps(v.get('stage_ms'), default=lambda x: round(x, 2))}")
    if quiver is not None:
        print(f"quiver: {quiver.server.info}")
    updates = None
    if args.read_rate > 0 and "quiver" in systems:
        print(f"\nread-under-updates ({args.update_rate:g} updates/s, 2 lanes):", flush=True)
        updates = updates_row(args, data, ckpt)
    load_end = os.getloadavg()
    wall = time.perf_counter() - t_start
    print(
        f"load average at start {load_start[0]:.2f}, at end {load_end[0]:.2f}; "
        f"{wall / 60:.1f} min in all (expected ~{typical / 60:.0f})"
    )

    write_csv(out / "serving.csv", runs)
    from quiver.serving import loadgen
    from quiver.serving.loadgen import LoadResult

    curves = {
        f"{s} {label}": [LoadResult(**r) for r in res]
        for s, v in runs[0].items()
        for label, res in v["results"].items()
    }
    loadgen.plot(out / "serving.png", curves, args.slo_ms)
    (out / "summary.json").write_text(
        json.dumps(
            {
                "args": vars(args),
                "machine": {"cpu_model": cpu_model(), "cores": cores},
                "dataset": str(data),
                "checkpoint": str(ckpt),
                "plan": asdict(plan),
                "verified": verified,
                "summaries": summaries,
                "medians": medians,
                "runs": runs,
                "read_under_updates": updates,
                "loadavg": {"start": load_start, "end": load_end},
                "wall_s": wall,
            },
            indent=2,
            default=str,
        )
        + "\n"
    )
    print(f"wrote {out / 'serving.csv'}, {out / 'serving.png'}, {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
