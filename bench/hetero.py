"""Hetero serving benchmark (issue 36): Quiver's HeteroServer against PyG serving the same
hetero model on the same requests, and read latency under a stream of durable updates.

    .venv/bin/python bench/hetero.py                      # mag-like at 0.1 scale, ~5-15 min
    .venv/bin/python bench/hetero.py --scale 1            # OGB-MAG sized (1.9M nodes)
    make bench-env                                        # once: builds .bench-env/pyg

1. Serving: open-loop Poisson load (``quiver.serving.loadgen``), one request = 1-``--max-size``
   paper ids, rates searched as ``bench/serving.py`` does (coarse grid, then the p99 <=
   ``--bound-ms`` knee bisected), each system in its best of several thread configurations:
   Quiver in-process (engine target) with its default pipeline and with 2 lanes; PyG
   (``bench/baselines/pyg_hetero_server.py``, in ``.bench-env/pyg``: NeighborLoader over
   torch-sparse, 1x1 / 1x2 / 2x1 worker x threads) per request. Prints p50/p99 per rate and the
   sustained rate at p99 <= the bound, and the ratio.
2. Updates: Quiver's read p50/p99 at a fixed rate without updates, then the same reads while
   ``--update-rate`` updates/s (add_edges / set_features, fsynced to the log) stream in.

The model is ``quiver.hetero.examples.hetero_sage`` (HeteroConv of SAGEConv, embedding tables
for featureless types) with random weights: latency does not depend on training.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "bench" / "baselines"))
import serving_common as common  # noqa: E402

from _machine import cpu_model  # noqa: E402

FACTORY = "quiver.hetero.examples:hetero_sage"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=0.1, help="fraction of OGB-MAG (0.1)")
    p.add_argument("--data", help="dataset dir (default data/mag-like-<scale>)")
    p.add_argument("--fanouts", default="10,5", help="per relation, per hop (10,5)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--max-size", type=int, default=16, help="largest request, in nodes (16)")
    p.add_argument("--rates", default="5,10,20,40,80,160", help="coarse rate grid, req/s")
    p.add_argument("--bound-ms", type=float, default=100.0, help="p99 bound (100 ms)")
    p.add_argument("--duration", type=float, default=6.0, help="seconds per rate (6)")
    p.add_argument("--update-rate", type=float, default=100.0, help="updates/s (100)")
    p.add_argument("--configs", default="1x1,1x2,2x1", help="PyG worker x thread configs")
    p.add_argument("--out", default=str(REPO / "data" / "hetero-bench" / "hetero.json"))
    p.add_argument("--skip-pyg", action="store_true")
    p.add_argument(
        "--only-updates",
        type=float,
        metavar="RATE",
        help="run part 2 only, reads at RATE req/s (default: both parts, reads at half "
        "Quiver's sustained rate)",
    )
    return p.parse_args(argv)


def ensure_data(args) -> tuple[Path, Path]:
    from quiver.hetero import HeteroGraph, mag_like
    from quiver.hetero.examples import hetero_sage
    from quiver.usermodel import save_model

    d = Path(args.data or REPO / "data" / f"mag-like-{args.scale:g}")
    if not (d / "manifest.json").exists():
        t0 = time.perf_counter()
        print(f"dataset: generating mag-like at scale {args.scale:g} into {d}", flush=True)
        mag_like(args.scale, seed=0).save(d)
        print(f"dataset: {time.perf_counter() - t0:.0f}s", flush=True)
    g = HeteroGraph.load(d)
    print(f"dataset: {g.describe()}")
    ckpt = d / "hetero_sage.pt"
    if not ckpt.exists():
        kw = dict(
            num_nodes=g.num_nodes,
            in_dims={t: int(x.shape[1]) for t, x in g.features.items()},
            edge_types=[list(e) for e in g.edge_types],
            hidden=args.hidden,
            out_dim=int(g.labels["paper"].max()) + 1,
            num_layers=len(args.fanouts.split(",")),
            target="paper",
        )
        torch.manual_seed(0)
        save_model(ckpt, hetero_sage(**kw), FACTORY, kw)
    return d, ckpt


def quiver_search(d, ckpt, args, plan) -> dict:
    from quiver.hetero import HeteroServer
    from quiver.serving.config import ServeConfig
    from quiver.serving.loadgen import engine_target

    configs = {"pipeline": ServeConfig(slo_ms=args.bound_ms), "2 lanes": ServeConfig(
        slo_ms=args.bound_ms, num_lanes=2)}  # fmt: skip
    state = {"srv": None}

    def activate(label: str, warmup: int):
        if state["srv"] is not None:
            state["srv"].stop()
        srv = HeteroServer.from_dataset(
            d, ckpt, configs[label], fanouts=args.fanouts, model=FACTORY, seed=0, updates=False
        )
        srv.start()
        state["srv"] = srv
        send = engine_target(srv.engines["paper"])

        async def warm():
            reqs, _ = common.requests_for(plan, plan.rates[0])
            for nodes in reqs[:warmup]:
                await send(nodes)

        asyncio.run(warm())
        return send

    try:
        return common.search_configs(list(configs), activate, plan)
    finally:
        if state["srv"] is not None:
            state["srv"].stop()


def updates_run(d, ckpt, args, rate: float, lanes: int = 2) -> dict:
    """Read p50/p99 at ``rate`` without, then with, ``args.update_rate`` updates/s, on the
    serving configuration that won part 1 (``lanes`` lanes; 0 = the pipeline)."""
    import shutil

    from quiver.hetero import HeteroGraph, HeteroServer
    from quiver.serving.config import ServeConfig
    from quiver.serving.loadgen import RequestMix, engine_target, run_open_loop

    work = d.with_name(d.name + "-updates")  # a copy: the benchmark's updates stay out of d
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(d, work, ignore=shutil.ignore_patterns("updates.log", ".serving.lock"))
    g = HeteroGraph.load(work)
    n_paper = g.num_nodes["paper"]
    out = {}
    srv = HeteroServer.from_dataset(
        work, ckpt, ServeConfig(slo_ms=args.bound_ms, num_lanes=lanes), fanouts=args.fanouts,
        model=FACTORY,
        seed=0,
    )  # fmt: skip
    srv.start()
    try:
        send = engine_target(srv.engines["paper"])
        mix = RequestMix(n_paper, 1, args.max_size)
        n = max(100, int(rate * args.duration * 2))
        for phase in ("without updates", "with updates"):
            stop = threading.Event()
            applied, waits = [0], []

            def writer(stop=stop, applied=applied, waits=waits):
                rng = np.random.default_rng(1)
                period = 1.0 / args.update_rate
                nxt = time.perf_counter()
                while not stop.is_set():
                    nxt += period
                    t0 = time.perf_counter()
                    if applied[0] % 2:
                        a, b = (int(v) for v in rng.integers(n_paper, size=2))
                        u = {"op": "add_edges", "edge_type": "paper__cites__paper",
                             "src": [a], "dst": [b]}  # fmt: skip
                    else:
                        u = {"op": "set_features", "node_type": "paper",
                             "ids": [int(rng.integers(n_paper))],
                             "features": rng.standard_normal((1, 128)).tolist()}  # fmt: skip
                    srv.update(u)
                    waits.append(time.perf_counter() - t0)
                    applied[0] += 1
                    time.sleep(max(0.0, nxt - time.perf_counter()))

            t = threading.Thread(target=writer) if phase == "with updates" else None
            t0 = time.perf_counter()
            if t is not None:
                t.start()
            res = asyncio.run(run_open_loop(send, mix.draw(n, seed=7), rate, seed=8))
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
                f"  reads at {rate:.0f}/s {phase}: p50 {res.p50_ms:.2f} ms, p99 {res.p99_ms:.2f} "
                f"ms, {res.errors} errors, {applied[0]} updates ({applied[0] / elapsed:.0f}/s)"
                + (f", update p99 {out[phase]['update_p99_ms']:.2f} ms" if waits else ""),
                flush=True,
            )
    finally:
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    d, ckpt = ensure_data(args)
    from quiver.hetero import HeteroGraph

    n_paper = HeteroGraph.load(d).num_nodes["paper"]
    out_dir = Path(args.out).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = common.Plan(
        rates=[float(r) for r in args.rates.split(",")],
        bounds_ms=[args.bound_ms],
        stop_ms=args.bound_ms,
        node_count=n_paper,
        min_size=1,
        max_size=args.max_size,
        duration_s=args.duration,
        max_requests=2000,
    )
    if args.only_updates:
        print(f"machine: {cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}")
        print(f"updates (reads at {args.only_updates:g}/s, 2 lanes):", flush=True)
        res = updates_run(d, ckpt, args, args.only_updates)
        Path(args.out).with_name("hetero-updates.json").write_text(json.dumps(res, indent=2) + "\n")
        return 0
    plan_file = out_dir / "hetero-plan.json"
    plan.save(plan_file)
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}")
    print("quiver:", flush=True)
    q = quiver_search(d, ckpt, args, plan)
    results = {"quiver": q}
    py = REPO / ".bench-env" / "pyg" / "bin" / "python"
    if not args.skip_pyg and py.exists():
        print("pyg:", flush=True)
        res_file = out_dir / "hetero-pyg.json"
        cmd = [str(py), str(REPO / "bench" / "baselines" / "pyg_hetero_server.py"), str(d),
               "--checkpoint", str(ckpt), "--model", FACTORY, "--fanouts", args.fanouts,
               "--plan", str(plan_file), "--configs", args.configs, "--out", str(res_file),
               "--slo-ms", str(args.bound_ms)]  # fmt: skip
        import subprocess

        if subprocess.run(cmd, cwd=REPO).returncode == 0:
            results["pyg"] = json.loads(res_file.read_text())["results"]
    elif not args.skip_pyg:
        print("pyg: .bench-env/pyg missing (run `make bench-env`): no baseline this run")

    def best(sysres: dict) -> tuple[float, str, dict | None]:
        top = (0.0, "-", None)
        for label, pts in sysres.items():
            for r in pts:
                if common._passes(r, args.bound_ms) and r["throughput_rps"] > top[0]:
                    top = (r["throughput_rps"], label, r)
        return top

    summary = {}
    for name, sysres in results.items():
        rps, label, r = best(sysres)
        summary[name] = {"sustained_rps": rps, "config": label, "at": r}
        p = f", p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms" if r else ""
        print(f"{name}: sustained {rps:.1f} req/s at p99 <= {args.bound_ms:g} ms ({label}){p}")
    if "pyg" in summary and summary["pyg"]["sustained_rps"] > 0:
        ratio = summary["quiver"]["sustained_rps"] / summary["pyg"]["sustained_rps"]
        print(f"sustained-rate ratio quiver / pyg: {ratio:.2f}x")
        summary["ratio_sustained"] = ratio
    rate = max(1.0, 0.5 * summary["quiver"]["sustained_rps"])
    lanes = 2 if summary["quiver"]["config"] == "2 lanes" else 0
    print(f"updates (reads at {rate:.0f}/s, half Quiver's sustained rate):", flush=True)
    summary["updates"] = updates_run(d, ckpt, args, rate, lanes)
    Path(args.out).write_text(
        json.dumps(
            {"machine": cpu_model(), "args": vars(args), "summary": summary, "results": results},
            indent=2,
            default=str,
        )
        + "\n"  # fmt: skip
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
