"""Times a baseline library's neighbour sampler on a graph and seed batches written by
bench/sampling.py; prints one JSON object. Runs inside a baseline env:

    .bench-env/dgl/bin/python bench/baselines/sampling_worker.py --framework dgl --graph DIR \
        --seeds seeds.npz --fanouts 15,10,5 --threads 2

Graph: DIR/indptr.npy + DIR/indices.npy (in-neighbour CSR). Seeds: an .npz with one [B, bs]
array per batch size, named ``bs<bs>``. Fanouts are innermost first (PyG's order).
- pyg: torch_geometric.sampler.NeighborSampler (what NeighborLoader calls per batch), backend
  pyg-lib or torch-sparse, whichever PyG picks; expands only each hop's new nodes.
- dgl: dgl.dataloading.NeighborSampler.sample_blocks; expands every node of the previous block.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("DGLBACKEND", "pytorch")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--framework", choices=["pyg", "dgl"], required=True)
    ap.add_argument("--graph", required=True)
    ap.add_argument("--seeds", required=True)
    ap.add_argument("--fanouts", default="15,10,5")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()

    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    fanouts = [int(k) for k in args.fanouts.split(",")]
    indptr = torch.from_numpy(np.load(os.path.join(args.graph, "indptr.npy")))
    indices = torch.from_numpy(np.load(os.path.join(args.graph, "indices.npy")))
    n = indptr.numel() - 1
    seeds = np.load(args.seeds)

    if args.framework == "pyg":
        import torch_geometric
        from torch_geometric.data import Data
        from torch_geometric.sampler import NeighborSampler, NodeSamplerInput

        dst = torch.repeat_interleave(torch.arange(n), indptr[1:] - indptr[:-1])
        data = Data(edge_index=torch.stack([indices, dst]), num_nodes=n)
        sampler = NeighborSampler(data, fanouts)
        backend = "pyg-lib" if torch_geometric.typing.WITH_PYG_LIB else "torch-sparse"
        version = f"torch_geometric {torch_geometric.__version__} ({backend})"

        def sample(batch):
            out = sampler.sample_from_nodes(NodeSamplerInput(None, batch))
            return int(out.row.numel())
    else:
        import dgl

        g = dgl.graph(("csc", (indptr, indices, torch.empty(0, dtype=torch.int64))), num_nodes=n)
        g = g.formats(["csc"])
        sampler = dgl.dataloading.NeighborSampler(list(reversed(fanouts)))
        version = f"dgl {dgl.__version__}"

        def sample(batch):
            _, _, blocks = sampler.sample_blocks(g, batch)
            return int(sum(b.num_edges() for b in blocks))

    results = {}
    for key in seeds.files:
        batches = torch.from_numpy(seeds[key])
        for b in batches[: args.warmup]:
            sample(b)
        lat, edges = [], []
        for b in batches:
            t0 = time.perf_counter()
            edges.append(sample(b))
            lat.append(time.perf_counter() - t0)
        results[key] = {"lat_s": lat, "edges": edges}
    print(json.dumps({"framework": args.framework, "version": version, "results": results}))


if __name__ == "__main__":
    main()
