"""Where a light-load request's time goes in Quiver, with and without the idle fast lane.
(Benchmark, not a test.)

    .venv/bin/python bench/fast_lane.py                       # products-like, 2-16 req/s
    .venv/bin/python bench/fast_lane.py --rates 2,8 --requests 60 --rounds 1

One in-process server (the same config as ``bench/serving.py``: products-like, GraphSAGE
[15, 10, 5], all features in RAM, 1 sampler worker, 2 torch threads, 2 ms batch window), one
request list per rate (sizes 1-64, as ``bench/serving.py`` draws them) and one Poisson arrival
seed per rate. Each rate runs the same requests with the fast lane off ("pipeline": batcher
thread -> sampler thread -> model thread) and on ("fast"), alternating which goes first per
round, so both modes see the same machine. The engine's trace gives each request's stage
timestamps; the table splits the client's latency into:

- ``lag``: scheduled send time to ``submit`` (the client's event loop waking up),
- ``window``: admission to batch close (the batcher's ``max_wait_ms``, and its wake-up),
- ``to_smp``: batch close to a sampler thread picking it up (queue hand-off),
- ``sample``, ``gather``: the stages,
- ``to_mdl``: gather done to the model thread starting it (hand-off),
- ``model``: forward pass and splitting the answers,
- ``back``: answer set to the client's coroutine resuming.

Also prints the back-to-back cost of one request of 1, 32 and 64 seeds (what a 30 ms SLO
must fit).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

PARTS = ("lag", "window", "to_smp", "sample", "gather", "to_mdl", "model", "back")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="products-like")
    p.add_argument("--scale", type=int, default=0)
    p.add_argument("--data", help="prepared dataset dir (default data/<preset>)")
    p.add_argument("--checkpoint", help="checkpoint (default <data>/sage.pt)")
    p.add_argument("--train-steps", type=int, default=200)
    p.add_argument("--rates", default="2,4,8,16", help="requests/s (2,4,8,16)")
    p.add_argument("--requests", type=int, default=100, help="requests per rate and mode (100)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each mode per rate (2)")
    p.add_argument("--sizes", default="1-64")
    p.add_argument("--slo-ms", type=float, default=30.0)
    p.add_argument("--max-batch-nodes", type=int, default=256)
    p.add_argument("--max-wait-ms", type=float, default=2.0)
    p.add_argument("--sampler-workers", type=int, default=1)
    p.add_argument("--torch-threads", type=int, default=2)
    p.add_argument(
        "--sampler-threads", type=int, default=0, help="threads per sampling call (0: all cores)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--modes",
        default="pipeline,fast",
        help="modes to compare: pipeline, fast (= staged), lanesNxT (N lanes x T torch "
        "threads), each with optional suffixes -1t / -mt (sampling and gather calls on the "
        "calling thread only / on helper threads too; lanes default to -1t) and -cap / -nocap "
        "(adaptive batch cap on / off; lanes default to -cap); see bench/serving.py parse_mode",
    )
    p.add_argument("--out", default="data/fast-lane", help="output directory")
    return p.parse_args(argv)


async def open_loop(engine, requests, rate: float, seed: int) -> list[dict]:
    """Send ``requests`` at Poisson times (the arrivals of ``loadgen.run_open_loop``)."""
    rng = np.random.default_rng(seed + 1)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=len(requests)))
    t0 = time.perf_counter()
    out: list[dict] = []

    async def one(nodes, at):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        sent = time.perf_counter()
        fut = engine.submit(nodes)
        res = await asyncio.wrap_future(fut)
        out.append(
            {"fut": fut, "sched": t0 + at, "sent": sent, "back": time.perf_counter(), "res": res}
        )

    await asyncio.gather(*(one(n, a) for n, a in zip(requests, arrivals)))
    return out


def breakdown(rows: list[dict], trace: list[dict]) -> dict:
    """Per-request ms of each part (``PARTS``) and the client latency, joined on the future."""
    by_fut = {}
    for b in trace:
        for f, arrival in zip(b["futures"], b["arrivals"]):
            by_fut[id(f)] = (b, arrival)
    parts = {k: [] for k in (*PARTS, "latency")}
    lanes = {"fast": 0, "split": 0, "pipeline": 0}
    for r in rows:
        b, arrival = by_fut[id(r["fut"])]
        lanes[b["lane"]] += 1
        v = {
            "lag": arrival - r["sched"],
            "window": b["closed"] - arrival,
            "to_smp": b["picked"] - b["closed"],
            "sample": b["sampled"] - b["picked"],
            "gather": b["gathered"] - b["sampled"],
            "to_mdl": b["started"] - b["gathered"],
            "model": b["answered"] - b["started"],
            "back": r["back"] - b["answered"],
            "latency": r["back"] - r["sched"],
        }
        for k, x in v.items():
            parts[k].append(x * 1e3)
    lat = np.array(parts["latency"])
    # the tail: what the slowest 5% of requests spent their time on (what a p99 is made of)
    tail = lat >= np.percentile(lat, 95)
    tail_seeds = [by_fut[id(r["fut"])][0]["seeds"] for r in rows]
    return {
        "n": len(rows),
        "p50": float(np.percentile(lat, 50)),
        "p95": float(np.percentile(lat, 95)),
        "p99": float(np.percentile(lat, 99)),
        "mean": float(lat.mean()),
        "parts_mean": {k: float(np.mean(parts[k])) for k in PARTS},
        "parts_p50": {k: float(np.median(parts[k])) for k in PARTS},
        "parts_tail": {k: float(np.mean(np.asarray(parts[k])[tail])) for k in PARTS},
        "tail_batch_seeds": float(np.mean(np.asarray(tail_seeds)[tail])),
        "batch_seeds": float(np.mean(tail_seeds)),
        "lanes": lanes,
        "latencies": parts["latency"],
        "batches": len({id(by_fut[id(r["fut"])][0]) for r in rows}),
    }


def back_to_back(engine, sizes=(1, 32, 64), reps: int = 20) -> dict:
    """Mean ms of sample / gather / model for one request of each size, run back to back."""
    rng = np.random.default_rng(7)
    out = {}
    for size in sizes:
        t = np.zeros(3)
        for _ in range(reps):
            seeds = torch.from_numpy(np.unique(rng.integers(0, engine.node_count, size=size)))
            t0 = time.perf_counter()
            n_id, _, adjs = engine.sampler.sample(seeds)
            t1 = time.perf_counter()
            x, adjs = engine.gather_inputs(n_id, adjs)
            t2 = time.perf_counter()
            with torch.inference_mode():
                engine.model(x, adjs)
            t3 = time.perf_counter()
            t += (t1 - t0, t2 - t1, t3 - t2)
        ms = t * 1e3 / reps
        out[size] = {"sample": ms[0], "gather": ms[1], "model": ms[2], "total": float(ms.sum())}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    import serving as sv  # bench/serving.py: the same dataset, checkpoint and config
    from quiver.serving import Engine, loadgen
    from quiver.serving.server import Server

    load_start = os.getloadavg()
    data = sv.ensure_dataset(args)
    ckpt = sv.ensure_checkpoint(args, data)
    cfg = sv.serve_config(args)
    feature_bytes = (data / "features.npy").stat().st_size
    server = Server.from_dataset(
        data,
        ckpt,
        cfg,
        fanouts=sv.FANOUTS,
        seed=args.seed,
        feature_cache=feature_bytes,
        sampler_threads=args.sampler_threads or None,
    ).start()
    engine = server.engine
    print(f"server: {server.info}; {cfg}")
    rates = [float(r) for r in args.rates.split(",")]
    lo, _, hi = args.sizes.partition("-")
    mix = loadgen.RequestMix(engine.node_count, int(lo), int(hi or lo))
    results: dict = {}
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        specs = {m: sv.parse_mode(m) for m in modes}
    except ValueError as e:
        raise SystemExit(str(e)) from None
    all_threads = sv.default_call_threads(engine)
    # one engine per mode over the same sampler, features and model (one runs at a time)
    engines = {}
    for mode, spec in specs.items():
        mcfg = replace(cfg, **spec["cfg"])
        engines[mode] = Engine(
            engine.sampler, engine.features, engine.model, engine.node_count, mcfg,
            fast_lane=spec["fast_lane"],
        ).start()  # fmt: skip

    def set_mode(mode: str):
        sv.call_threads(engines[mode], specs[mode]["single_thread_calls"], all_threads)
        return engines[mode]

    try:
        warm = mix.draw(20, seed=999)
        for mode in modes:
            eng = set_mode(mode)
            for nodes in warm:
                eng.predict(nodes)
        for i, rate in enumerate(rates):
            requests = mix.draw(args.requests, seed=args.seed + i)
            for rnd in range(args.rounds):
                k = (i + rnd) % len(modes)  # rotate which mode goes first
                for mode in modes[k:] + modes[:k]:
                    eng = set_mode(mode)
                    eng.trace = []
                    time.sleep(0.5)  # idle between runs, as between arrivals
                    rows = asyncio.run(open_loop(eng, requests, rate, args.seed + 100 + i))
                    b = breakdown(rows, eng.trace)
                    eng.trace = None
                    results.setdefault(rate, {}).setdefault(mode, []).append(b)
                    print(
                        f"rate {rate:4g}/s round {rnd} {mode:<11}: p50 {b['p50']:6.1f}  "
                        f"p99 {b['p99']:6.1f} ms  lanes {b['lanes']}",
                        flush=True,
                    )
        stages = back_to_back(engine)
    finally:
        for eng in engines.values():
            eng.stop()
        server.stop()
    load_end = os.getloadavg()

    print("\nper request, mean ms over all rounds (client latency = lag + ... + back):")
    print(
        f"{'rate':>5} {'mode':<11} {'n':>4} {'p50':>6} {'p95':>6} {'p99':>6} {'mean':>6} | "
        + " ".join(f"{k:>6}" for k in PARTS)
    )
    summary: dict = {}
    for rate, by_mode in results.items():
        for mode, runs in by_mode.items():
            # every round's requests pooled: 2 rounds of 100 give a p99 that is not the max
            lat = np.concatenate([r["latencies"] for r in runs])
            n = len(lat)
            agg = {
                "n": n,
                **{f"p{q}": float(np.percentile(lat, q)) for q in (50, 95, 99)},
                "mean": float(lat.mean()),
                "parts_mean": {
                    k: float(
                        np.average(
                            [r["parts_mean"][k] for r in runs], weights=[r["n"] for r in runs]
                        )
                    )
                    for k in PARTS
                },
                "parts_tail": {
                    k: float(np.mean([r["parts_tail"][k] for r in runs])) for k in PARTS
                },
                "tail_batch_seeds": float(np.mean([r["tail_batch_seeds"] for r in runs])),
                "batch_seeds": float(np.mean([r["batch_seeds"] for r in runs])),
                "lanes": {
                    k: sum(r["lanes"][k] for r in runs) for k in ("fast", "split", "pipeline")
                },
            }
            summary.setdefault(rate, {})[mode] = agg
            print(
                f"{rate:5g} {mode:<11} {n:4d} {agg['p50']:6.1f} {agg['p95']:6.1f} "
                f"{agg['p99']:6.1f} {agg['mean']:6.1f} | "
                + " ".join(f"{agg['parts_mean'][k]:6.2f}" for k in PARTS)
            )
    print("\nthe slowest 5% of requests (what a p99 is made of), mean ms per part:")
    print(
        f"{'rate':>5} {'mode':<11} {'seeds':>6} {'tail':>6} | " + " ".join(f"{k:>6}" for k in PARTS)
    )
    for rate, by_mode in summary.items():
        for mode, agg in by_mode.items():
            print(
                f"{rate:5g} {mode:<11} {agg['tail_batch_seeds']:6.0f} {agg['batch_seeds']:6.0f} | "
                + " ".join(f"{agg['parts_tail'][k]:6.2f}" for k in PARTS)
            )
    print("(seeds: mean batch seeds of a tail request; tail: of any request)")
    print(f"\nratios {modes[0]} / other mode (> 1: the other mode is faster):")
    for rate, m in summary.items():
        p = m[modes[0]]
        for mode in modes[1:]:
            f = m[mode]
            print(
                f"  {rate:4g} req/s {mode:<12}: p50 {p['p50'] / f['p50']:.2f}x  "
                f"p95 {p['p95'] / f['p95']:.2f}x  p99 {p['p99'] / f['p99']:.2f}x  "
                f"mean {p['mean'] / f['mean']:.2f}x  (lanes {f['lanes']})"
            )
    print("\nback to back, one request (ms): sample / gather / model = total")
    for size, v in stages.items():
        print(
            f"  {size:3d} seeds: {v['sample']:.1f} / {v['gather']:.1f} / {v['model']:.1f} "
            f"= {v['total']:.1f}"
        )
    print(f"load average at start {load_start[0]:.2f}, at end {load_end[0]:.2f} (2 cores)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fast_lane.json").write_text(
        json.dumps(
            {
                "args": vars(args),
                "summary": {str(k): v for k, v in summary.items()},
                "runs": {str(k): v for k, v in results.items()},
                "back_to_back_ms": stages,
                "loadavg": {"start": load_start, "end": load_end},
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out / 'fast_lane.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
