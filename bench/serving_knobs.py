"""Process knobs of an in-process Quiver server under open-loop load: the GIL switch interval
and freezing the start-up heap out of the garbage collector, A/B on the same requests.

Each variant serves the same Poisson requests (sizes 1-64, uniform ids) at each rate, in
rotated order over ``--reps`` rounds; prints p50 / p99 per variant and rate (median over the
rounds), the p99 ratio to the default, and the garbage collector's pauses during the runs.

    .venv/bin/python bench/serving_knobs.py --data data/products-like --rates 16,64
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

VARIANTS = {
    "default": {"switch": None, "freeze": False},
    "switch 0.5ms": {"switch": 0.0005, "freeze": False},
    "gc.freeze": {"switch": None, "freeze": True},
    "both": {"switch": 0.0005, "freeze": True},
}


def main() -> int:
    from _machine import cpu_model
    from quiver.serving import ServeConfig, loadgen
    from quiver.serving.server import Server

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="data/products-like")
    ap.add_argument("--checkpoint", default=None, help="default <data>/sage.pt")
    ap.add_argument("--rates", default="16,64", help="requests/s")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds of arrivals per run")
    ap.add_argument("--reps", type=int, default=3, help="rounds over the variants")
    ap.add_argument("--lanes", type=int, default=2, help="engine lanes (0: staged pipeline)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="which variants")
    args = ap.parse_args()
    names = [v.strip() for v in args.variants.split(",")]
    ckpt = args.checkpoint or os.path.join(args.data, "sage.pt")
    cfg = ServeConfig(num_lanes=args.lanes, torch_threads=1 if args.lanes else 2)
    server = Server.from_dataset(args.data, ckpt, cfg, seed=0, precision="auto").start()
    print(f"CPU {cpu_model()}, load average {os.getloadavg()[0]:.2f}\nquiver: {server.info}")
    send = loadgen.engine_target(server.engine)
    default_switch = sys.getswitchinterval()
    pauses: list[float] = []
    started = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((time.perf_counter() - started[0]) * 1e3)

    gc.callbacks.append(on_gc)
    rng = np.random.default_rng(0)
    n = server.engine.node_count
    rates = [float(r) for r in args.rates.split(",")]
    reqs = {
        r: [
            rng.integers(0, n, int(rng.integers(1, 65))).tolist()
            for _ in range(int(r * args.duration))
        ]
        for r in rates
    }
    res = {(v, r): [] for v in names for r in rates}
    gc_ms = {v: [] for v in names}

    async def warm():
        for nodes in reqs[rates[0]][:30]:
            await send(nodes)

    asyncio.run(warm())
    for rep in range(args.reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for v in order:
            knob = VARIANTS[v]
            sys.setswitchinterval(knob["switch"] or default_switch)
            if knob["freeze"]:
                gc.collect()
                gc.freeze()
            for r in rates:
                pauses.clear()
                out = asyncio.run(loadgen.run_open_loop(send, reqs[r], r, seed=rep))
                res[(v, r)].append((out.p50_ms, out.p99_ms))
                gc_ms[v].extend(pauses)
            gc.unfreeze()
    sys.setswitchinterval(default_switch)
    server.stop()
    print(f"\n{'variant':>14} " + " ".join(f"{f'{r:g}/s p50 / p99':>22}" for r in rates)
          + "   p99 vs default   gc pauses: count, max ms")  # fmt: skip
    base = {r: float(np.median([p for _, p in res[(names[0], r)]])) for r in rates}
    for v in names:
        cells, ratios = [], []
        for r in rates:
            p50 = float(np.median([a for a, _ in res[(v, r)]]))
            p99 = float(np.median([b for _, b in res[(v, r)]]))
            cells.append(f"{p50:>9.1f} / {p99:>8.1f} ms")
            ratios.append(f"{p99 / base[r]:.2f}x")
        g = gc_ms[v]
        print(
            f"{v:>14} " + " ".join(f"{c:>22}" for c in cells) + f"   {' '.join(ratios):>14}"
            f"   {len(g)}, {max(g) if g else 0:.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
