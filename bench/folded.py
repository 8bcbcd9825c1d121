"""First layer folded into the feature table vs the unfolded gather + model, same batches.

For each batch size, the same sampled subgraphs go through four paths, interleaved in rotated
order, on the serving engine's thread settings:

- ``gather fp32`` / ``gather bf16``: rows of the (N, F) table gathered, then the fp32 model
  (today's serving path at each gather precision; the best of the two is the baseline);
- ``folded fp32`` / ``folded bf16``: layer 1 from the folded (N, H) tables
  (``quiver.serving.folded``), then layers 2..L.

Prints ms per batch (gather + model), the speed-up of each folded path over the best unfolded
one, and the accuracy on the dataset's test split (argmax agreement with the fp32 unfolded
model on the same sampled subgraphs, and the largest logit difference).

    .venv/bin/python bench/folded.py --data data/products-like \
        --checkpoint data/products-like/sage.pt

A user's checkpoint (a ``SAGEConv``/``GCNConv``/``GraphConv``/``GINConv``/``GATConv`` first
layer, see ``quiver.serving.folded``) loads as ``quiver serve`` loads it: add ``--model
package.module:factory`` where ``quiver serve`` needs it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))


def main() -> int:
    from _machine import cpu_model
    from quiver.datasets import load_prepared
    from quiver.precision import PrecisionModel
    from quiver.pyg import GraphSageSampler
    from quiver.serving.folded import FoldedFirstLayer
    from quiver.usermodel import load_served_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="data/products-like")
    ap.add_argument("--checkpoint", default="data/products-like/sage.pt")
    ap.add_argument("--model", default=None, help="package.module:factory (as quiver serve)")
    ap.add_argument("--batches", default="1,8,32,64,256", help="seeds per batch")
    ap.add_argument("--reps", type=int, default=10, help="batches per size")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--accuracy-nodes", type=int, default=20000, help="test-split nodes (0: all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    print(f"CPU {cpu_model()}, load average {os.getloadavg()[0]:.2f}")
    ds = load_prepared(args.data)
    model, info = load_served_model(args.checkpoint, args.model)
    fanouts = info["fanouts"] or ds.manifest.get("fanouts")
    sizes = list(fanouts) + list(fanouts[-1:]) * info["extra_hops"]  # GCN's degree hop
    raw = ds.features
    tables = {"fp32": raw.float(), "bf16": raw.to(torch.bfloat16)}
    t0 = time.perf_counter()
    folds = {p: FoldedFirstLayer(model, raw, dtype=tables[p].dtype) for p in tables}
    build = (time.perf_counter() - t0) / 2
    f_bytes = raw.numel() * 4
    print(
        f"{ds.manifest.get('name')}: {ds.num_nodes:,} nodes, {info['kind']}, fanouts {sizes}, "
        f"{args.threads} threads; folded tables built in {build:.1f} s each; memory: features "
        f"fp32 {f_bytes / 2**30:.2f} GiB, folded fp32 {folds['fp32'].nbytes / 2**30:.2f} GiB, "
        f"folded bf16 {folds['bf16'].nbytes / 2**30:.2f} GiB"
    )
    sampler = GraphSageSampler(ds.topo, sizes, mode="CPU", seed=0, frontier=info["frontier"])
    on_bf16 = PrecisionModel.wrap(model, torch.float32, torch.bfloat16)  # casts the rows
    paths = {
        "gather fp32": lambda n_id, adjs: model(tables["fp32"][n_id], adjs),
        "gather bf16": lambda n_id, adjs: on_bf16(tables["bf16"][n_id], adjs),
        "folded fp32": lambda n_id, adjs: folds["fp32"].tail(
            *folds["fp32"].gather_layer(n_id, adjs)
        ),
        "folded bf16": lambda n_id, adjs: folds["bf16"].tail(
            *folds["bf16"].gather_layer(n_id, adjs)
        ),
    }
    names = list(paths)
    rng = np.random.default_rng(0)
    # warm-up: first-touch pages of every table, oneDNN set-up
    n_id, _, adjs = sampler.sample(torch.arange(256))
    for fn in paths.values():
        fn(n_id, adjs)
    print(
        f"\n{'seeds':>6} {'sampled':>8} "
        + " ".join(f"{n:>12}" for n in names)
        + "   speed-up fp32 / bf16 folded vs best unfolded"
    )
    rows = []
    for b in (int(v) for v in args.batches.split(",")):
        t = dict.fromkeys(names, 0.0)
        sampled = 0
        for r in range(args.reps):
            seeds = torch.from_numpy(np.unique(rng.integers(0, ds.num_nodes, b)))
            n_id, _, adjs = sampler.sample(seeds)
            sampled += len(n_id)
            k = r % len(names)
            for name in names[k:] + names[:k]:
                t0 = time.perf_counter()
                paths[name](n_id, adjs)
                t[name] += time.perf_counter() - t0
        ms = {n: t[n] / args.reps * 1e3 for n in names}
        best = min(ms["gather fp32"], ms["gather bf16"])
        rows.append((b, ms))
        print(
            f"{b:>6} {sampled // args.reps:>8} "
            + " ".join(f"{ms[n]:>12.2f}" for n in names)
            + f"   {best / ms['folded fp32']:.2f}x / {best / ms['folded bf16']:.2f}x"
        )
    # accuracy on the test split: the same sampled subgraph for every path
    test = ds.splits.get("test")
    test = np.arange(ds.num_nodes) if test is None or len(test) == 0 else test.numpy()
    if args.accuracy_nodes and len(test) > args.accuracy_nodes:
        test = np.sort(np.random.default_rng(1).choice(test, args.accuracy_nodes, replace=False))
    agree = dict.fromkeys(names[1:], 0)
    diff = dict.fromkeys(names[1:], 0.0)
    for lo in range(0, len(test), 256):
        n_id, _, adjs = sampler.sample(torch.from_numpy(test[lo : lo + 256]))
        ref = paths["gather fp32"](n_id, adjs)
        for n in names[1:]:
            out = paths[n](n_id, adjs).float()
            agree[n] += int((out.argmax(1) == ref.argmax(1)).sum())
            diff[n] = max(diff[n], float((out - ref).abs().max()))
    print(f"\naccuracy on {len(test):,} test-split nodes (vs gather fp32, same subgraphs):")
    for n in names[1:]:
        print(f"  {n}: argmax agreement {agree[n] / len(test):.4%}, max |logit diff| {diff[n]:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
