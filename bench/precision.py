"""bf16 against fp32 serving on a prepared dataset: accuracy on the test split, time per stage.

Accuracy: every test node is predicted once per pairing of (gather dtype, model dtype), on the
same sampled subgraphs; prints argmax agreement with fp32+fp32, the max |logit difference| and
accuracy against the labels. Timing: ``quiver.precision.measure_precision`` (what ``quiver
calibrate --checkpoint`` and ``serve --precision auto`` run): gather and model summed over
batches, per precision, and the choice it makes on this CPU.

    .venv/bin/python bench/precision.py --data data/products-like \
        --checkpoint data/products-like/sage.pt
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main(argv=None) -> int:
    from quiver.datasets import load_prepared
    from quiver.precision import DTYPES, PrecisionModel, cpu_model, measure_precision
    from quiver.pyg import GraphSageSampler
    from quiver.usermodel import load_served_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="prepared dataset directory")
    ap.add_argument("--checkpoint", required=True, help="model checkpoint (as for quiver serve)")
    ap.add_argument("--model", default=None, help="factory for a state_dict checkpoint")
    ap.add_argument("--split", default="test", help="split to predict (test)")
    ap.add_argument("--max-nodes", type=int, default=0, help="cap on split nodes (0: all)")
    ap.add_argument("--batch", type=int, default=256, help="seeds per accuracy batch (256)")
    ap.add_argument("--timing-batches", default="32,256", help="seeds per timed batch (32,256)")
    ap.add_argument("--reps", type=int, default=10, help="timed batches per size (10)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, as served (1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)

    load = os.getloadavg()
    ds = load_prepared(args.data)
    net, minfo = load_served_model(args.checkpoint, args.model, False, None)
    fanouts = [int(k) for k in (minfo["fanouts"] or ds.manifest["fanouts"])]
    sizes = fanouts + fanouts[-1:] * minfo["extra_hops"]
    sampler = GraphSageSampler(
        ds.topo, sizes, mode="CPU", seed=args.seed, frontier=minfo["frontier"]
    )
    torch.set_num_threads(args.threads)
    tables = {"fp32": ds.features.float(), "bf16": ds.features.to(torch.bfloat16)}
    models = {p: PrecisionModel.wrap(net, d, torch.bfloat16) for p, d in DTYPES.items()}
    nodes = ds.splits[args.split]
    if args.max_nodes:
        nodes = nodes[: args.max_nodes]
    if nodes.numel() == 0:
        raise SystemExit(f"split {args.split!r} is empty")
    cpu = cpu_model()
    print(f"{ds.manifest.get('name')}: {nodes.numel():,} {args.split} nodes, fanouts {fanouts}")
    print(f"CPU: {cpu}; {args.threads} torch threads; load average {load[0]:.2f}")

    pairs = [(g, m) for g in DTYPES for m in DTYPES]
    preds = {p: [] for p in pairs}
    served = []  # seeds in prediction order
    max_diff = {p: 0.0 for p in pairs}
    with torch.inference_mode():
        for lo in range(0, nodes.numel(), args.batch):
            seeds = nodes[lo : lo + args.batch]
            served.append(torch.unique(seeds))
            n_id, _, adjs = sampler.sample(served[-1])
            logits = {(g, m): models[m](tables[g][n_id], adjs) for g, m in pairs}
            ref = logits[("fp32", "fp32")]
            for p in pairs:
                preds[p].append(logits[p].argmax(1))
                max_diff[p] = max(max_diff[p], float((logits[p] - ref).abs().max()))
    seeds = torch.cat(served)
    labels = ds.labels[seeds]
    ref = torch.cat(preds[("fp32", "fp32")])
    result = {"cpu_model": cpu, "load_avg": load, "nodes": int(seeds.numel()), "pairs": {}}
    print(f"\n{'gather+model':>13} {'agree':>8} {'max|dlogit|':>12} {'accuracy':>9}")
    for p in pairs:
        pred = torch.cat(preds[p])
        agree = float((pred == ref).double().mean())
        acc = float((pred == labels)[labels >= 0].double().mean())
        result["pairs"]["+".join(p)] = {"agreement": agree, "max_abs_diff": max_diff[p], "acc": acc}
        print(f"{'+'.join(p):>13} {agree:>8.4f} {max_diff[p]:>12.4g} {acc:>9.4f}")

    batches = [int(b) for b in args.timing_batches.split(",")]
    t0 = time.perf_counter()
    choice = measure_precision(
        sampler,
        ds.features,
        net,
        ds.num_nodes,
        batch_sizes=batches,
        repeats=args.reps,
        seed=args.seed,
        num_threads=args.threads,
    )
    n = len(batches) * args.reps
    print(f"\ntiming: {n} batches of {batches} seeds ({time.perf_counter() - t0:.1f} s)")
    print(f"{'stage':>8} {'fp32 ms':>9} {'bf16 ms':>9} {'fp32/bf16':>10}")
    gather = choice.timings["gather"]
    print(
        f"{'gather':>8} {gather['fp32'] / n * 1e3:>9.2f} {gather['bf16'] / n * 1e3:>9.2f} "
        f"{gather['fp32'] / gather['bf16']:>9.2f}x"
    )
    pair = choice.timings["pairs"]
    # the model on rows of its own precision: fp32+fp32 and bf16+bf16 less their gathers
    m32 = pair.get("fp32+fp32", 0.0) - gather["fp32"]
    m16 = pair.get("bf16+bf16", float("nan")) - gather["bf16"]
    print(f"{'model':>8} {m32 / n * 1e3:>9.2f} {m16 / n * 1e3:>9.2f} {m32 / m16:>9.2f}x")
    print(f"choice: {choice.describe()}" + (f" ({choice.note})" if choice.note else ""))
    result["timing"] = choice.to_json()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
