"""Serving data path per batch: sample, gather, model; the previous code and the current one
side by side, interleaved on the same batches, with wall and process-CPU ms and their ratios.
(Benchmark, not a test.)

    flock -x /tmp/bench.lock .venv/bin/python bench/serving_path.py --data data/products-like \
        --checkpoint data/products-like/sage.pt

"before" is the code as of commit 80880e3: the sampler's kernel module of that commit (read
from git; rows sampled one by one), the gather writing into a fresh output tensor, and SAGE
layers computing ``lin_l(agg / deg) + lin_r(x_dst)`` and ``relu`` out of place. "after" is the
library as it is: two-pass row sampling, outputs from recycled buffers, in-place division,
``addmm`` accumulation and in-place ``relu`` under inference mode. Samples, features and
logits are checked equal.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

BEFORE = "80880e3"


def before_kernel():
    """The sampler's numba kernel module as of ``BEFORE``, imported from git history."""
    import importlib.util
    import subprocess
    import tempfile

    src = subprocess.run(
        ["git", "show", f"{BEFORE}:src/quiver/sampling/_cpu_kernel.py"],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    ).stdout
    path = os.path.join(tempfile.mkdtemp(), "before_kernel.py")
    with open(path, "w") as f:
        f.write(src.replace("cache=True", "cache=False"))
    spec = importlib.util.spec_from_file_location("before_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def faults() -> int:
    """Minor page faults of the process so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def cpu_s() -> float:
    """Process CPU seconds (all threads: torch's and the gather's helpers count too)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def before_sage_layer(conv, x, edge_index, num_dst):
    """The CSR SAGE layer as of 80880e3 (out-of-place division and ``lin_l + lin_r``)."""
    src, dst = edge_index[0], edge_index[1]
    deg = torch.bincount(dst, minlength=num_dst)
    crow = torch.zeros(num_dst + 1, dtype=torch.long)
    torch.cumsum(deg, 0, out=crow[1:])
    ones = torch.ones(src.numel(), dtype=x.dtype)
    adj = torch.sparse_csr_tensor(
        crow, src, ones, size=(num_dst, x.shape[0]), check_invariants=False
    )
    agg = torch.sparse.mm(adj, x) / deg.clamp(min=1).unsqueeze(1).to(x.dtype)
    return conv.lin_l(agg) + conv.lin_r(x[:num_dst])


def before_forward(model, x, adjs):
    """``SampledGNN.forward`` as of 80880e3 (SAGE only)."""
    last = len(model.convs) - 1
    for i, (edge_index, _, size) in enumerate(adjs):
        x = before_sage_layer(model.convs[i], x, edge_index, size[1])
        if i != last:
            x = torch.relu(x)
    return x


def main() -> int:
    from quiver.datasets import load_prepared
    from quiver.feature import Feature
    from quiver.models import load_checkpoint
    from quiver.pyg import GraphSageSampler

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="data/products-like", help="prepared dataset")
    ap.add_argument("--checkpoint", default=None, help="GraphSAGE checkpoint (<data>/sage.pt)")
    ap.add_argument("--batches", default="16,64,256", help="seeds per batch (16,64,256)")
    ap.add_argument("--reps", type=int, default=20, help="batches per size (20)")
    ap.add_argument("--torch-threads", type=int, default=2, help="model threads (2)")
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    warnings.simplefilter("ignore", UserWarning)  # sparse CSR beta notice
    ds = load_prepared(args.data)
    model, _ = load_checkpoint(args.checkpoint or os.path.join(args.data, "sage.pt"))
    if model.cfg.kind != "sage":
        raise SystemExit("serving_path compares the SAGE model step; give a sage checkpoint")
    fanouts = [15, 10, 5][: model.cfg.num_layers]
    # as bench/serving.py serves: every row in RAM in FAP order, CPU sampling
    nbytes = os.path.getsize(os.path.join(args.data, "features.npy"))
    t0 = time.perf_counter()
    feat = Feature(0, [], 0, csr_topo=ds.topo, sizes=fanouts, host_cache_size=nbytes)
    feat.from_mmap(os.path.join(args.data, "features.npy"))
    print(f"feature store built in {time.perf_counter() - t0:.1f} s: {feat}")
    import quiver.sampling.cpu as cpu_sampler

    kernels = (before_kernel(), cpu_sampler.K)
    # the same seed and call numbers: "before" and "after" must draw the same subgraphs
    samplers = [GraphSageSampler(ds.topo, fanouts, seed=0) for _ in kernels]

    def sample(v, seeds):
        cpu_sampler.K = kernels[v]  # the sampler looks its kernel module up at call time
        try:
            return samplers[v].sample(seeds)
        finally:
            cpu_sampler.K = kernels[1]

    # stages run on their own threads, as in the engine: a worker thread's large allocations
    # come from its own malloc arena (or mmap), not from the main thread's heap
    sample_thread = ThreadPoolExecutor(1, thread_name_prefix="sampler")
    model_thread = ThreadPoolExecutor(1, thread_name_prefix="model")

    def timed(pool, fn, *a):
        t, c, f = time.perf_counter(), cpu_s(), faults()
        out = pool.submit(fn, *a).result()
        return out, (time.perf_counter() - t, cpu_s() - c, faults() - f)

    def before_gather(n_id):
        return feat.gather(n_id, out=torch.empty((len(n_id), feat.shape[1])))

    def forward(v, x, adjs):
        with torch.inference_mode():
            return before_forward(model, x, adjs) if v == 0 else model(x, adjs)

    timed(model_thread, torch.set_num_threads, args.torch_threads)
    rng = np.random.default_rng(0)
    load0 = os.getloadavg()[0]
    print(f"{ds.manifest.get('name')}: GraphSAGE {fanouts}, {args.torch_threads} torch threads")
    head = f"{'seeds':>5} {'nodes':>7} {'stage':>7}"
    print(
        f"{head} {'before wall':>11} {'after wall':>10} {'before cpu':>10} {'after cpu':>9} "
        f"{'cpu ratio':>9} {'kflt bef':>8} {'kflt aft':>7}"
    )
    for b in (int(v) for v in args.batches.split(",")):
        wall = {k: 0.0 for k in ("sample0", "sample1", "gather0", "gather1", "model0", "model1")}
        cpu, flt = dict(wall), dict(wall)
        nodes = 0
        for r in range(args.reps + 1):  # the first batch warms up and is not counted
            seeds = torch.from_numpy(np.unique(rng.integers(0, ds.num_nodes, b)))
            steps, xs, outs, subs = {}, {}, {}, {}
            # alternate which variant goes first, so neither always runs on a warmer cache
            order = (0, 1) if r % 2 else (1, 0)
            for v in order:
                subs[v], steps[f"sample{v}"] = timed(sample_thread, sample, v, seeds)
            n_id, _, adjs = subs[1]
            assert torch.equal(n_id, subs[0][0]) and all(
                torch.equal(a[0], b[0]) for a, b in zip(adjs, subs[0][2])
            )
            for v in order:
                fn = before_gather if v == 0 else feat.__getitem__
                xs[v], steps[f"gather{v}"] = timed(sample_thread, fn, n_id)
            for v in order:
                outs[v], steps[f"model{v}"] = timed(model_thread, forward, v, xs[v], adjs)
            assert torch.equal(xs[0], xs[1])
            torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
            del xs, outs
            if r == 0:
                continue
            nodes += len(n_id)
            for k, (w, cp, fl) in steps.items():
                wall[k] += w
                cpu[k] += cp
                flt[k] += fl
        ms = {k: v * 1e3 / args.reps for k, v in wall.items()}
        kflt = {k: v / 1e3 / args.reps for k, v in flt.items()}
        cms = {k: v * 1e3 / args.reps for k, v in cpu.items()}
        rows = [
            ("sample", "sample0", "sample1"),
            ("gather", "gather0", "gather1"),
            ("model", "model0", "model1"),
        ]
        tot = [0.0, 0.0, 0.0, 0.0]
        for name, k0, k1 in rows:
            vals = (ms[k0], ms[k1], cms[k0], cms[k1])
            tot = [a + v for a, v in zip(tot, vals)]
            ratio = cms[k0] / cms[k1] if cms[k1] > 0 else float("nan")
            print(
                f"{b:>5} {nodes // args.reps:>7} {name:>7} {vals[0]:>11.2f} {vals[1]:>10.2f} "
                f"{vals[2]:>10.2f} {vals[3]:>9.2f} {ratio:>8.2f}x "
                f"{kflt[k0]:>8.1f} {kflt[k1]:>7.1f}"
            )
        print(
            f"{b:>5} {'':>7} {'total':>7} {tot[0]:>11.2f} {tot[1]:>10.2f} {tot[2]:>10.2f} "
            f"{tot[3]:>9.2f} {tot[2] / tot[3]:>8.2f}x"
        )
    print(
        f"load average {load0:.2f} at start, {os.getloadavg()[0]:.2f} at end (2 cores); "
        f"buffers: {feat._buffers.allocated} allocated, {feat._buffers.reused} reused"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
