"""Model step of serving: PyG's SAGEConv scatter aggregation vs our CSR path, same weights.

Both paths run in one process on the same sampled subgraphs, interleaved, and must give the same
logits; prints ms per forward and the ratio.

    .venv/bin/python bench/model_forward.py --data data/products-like \
        --checkpoint data/products-like/sage.pt
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def main() -> int:
    from quiver.datasets import load_prepared, synthetic
    from quiver.models import ModelConfig, build_model, load_checkpoint
    from quiver.pyg import GraphSageSampler

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=None, help="prepared dataset (default: small preset)")
    ap.add_argument("--checkpoint", default=None, help="checkpoint (default: random weights)")
    ap.add_argument("--batches", default="32,256", help="seeds per batch (32,256)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ds = load_prepared(args.data) if args.data else synthetic("small", seed=0)
    if args.checkpoint:
        model, _ = load_checkpoint(args.checkpoint)
    else:
        model = build_model(ModelConfig("sage", int(ds.features.shape[1]), ds.num_classes)).eval()
    sampler = GraphSageSampler(ds.topo, [15, 10, 5][: model.cfg.num_layers], seed=0)
    feats = torch.as_tensor(np.asarray(ds.features))
    rng = np.random.default_rng(0)
    print(f"{ds.manifest.get('name')}: {model.cfg}, {args.threads} threads")
    print(f"{'seeds':>6} {'sampled':>8} {'pyg ms':>8} {'csr ms':>8} {'speed-up':>8}")
    for b in (int(v) for v in args.batches.split(",")):
        t = {True: 0.0, False: 0.0}
        nodes = 0
        for _ in range(args.reps):
            seeds = torch.from_numpy(np.unique(rng.integers(0, ds.num_nodes, b)))
            n_id, _, adjs = sampler.sample(seeds)
            x = feats[n_id]
            nodes += len(n_id)
            outs = {}
            with torch.inference_mode():
                for fast in (False, True):
                    model.fast_sage = fast
                    t0 = time.perf_counter()
                    outs[fast] = model(x, adjs)
                    t[fast] += time.perf_counter() - t0
            assert torch.allclose(outs[True], outs[False], atol=1e-4, rtol=1e-4)
        pyg, csr = t[False] / args.reps * 1e3, t[True] / args.reps * 1e3
        print(f"{b:>6} {nodes // args.reps:>8} {pyg:>8.1f} {csr:>8.1f} {pyg / csr:>7.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
