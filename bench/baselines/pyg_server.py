"""PyG serving baseline: per request, PyG's NeighborSampler (torch-sparse), a feature gather and the
same model with the same weights, on a small worker-thread pool. No cross-request batching.

Runs in `.bench-env/pyg` (torch 2.13 + torch-sparse 0.6.18 + our package, editable):

    .bench-env/pyg/bin/python bench/baselines/pyg_server.py DATASET_DIR --checkpoint ckpt.pt \
        --plan plan.json --out pyg.json --configs 1x1,1x2,2x1
    .bench-env/pyg/bin/python bench/baselines/pyg_server.py DATASET_DIR --checkpoint ckpt.pt \
        --verify expected.npz          # logits equal Quiver's (graph with in-degrees < fanouts)

What a PyG user writes, given its best shot: `torch_geometric.sampler.NeighborSampler` created
once over the graph's CSC (given as a `SparseTensor adj_t`, so no edge sort at start), called
directly with each request's nodes (`NeighborLoader` minus its per-batch `Data` construction),
then `x[node]` and the model on the whole sampled subgraph. With torch-sparse, PyG returns no
per-hop counts (`num_sampled_nodes` is None), so the subgraph cannot be trimmed per layer:
every conv runs on all sampled nodes and the first `batch_size` rows are the answer
(`full_subgraph_forward`), the standard PyG inference pattern.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_common as common  # noqa: E402


def full_subgraph_forward(model, x, edge_index, batch_size: int):
    """Logits of the first `batch_size` nodes: each conv of `model` (a `quiver.models.SampledGNN`)
    applied to all nodes of the sampled subgraph.

    Args:
        model: the `SampledGNN` (its `convs` and `cfg.kind` are used).
        x: `(num_sub_nodes, F)` features of the subgraph, seeds first.
        edge_index: `(2, num_sub_edges)` local (source, target) ids.
        batch_size: number of seeds.

    Equals `model(x, adjs)` whenever the subgraph holds every sampled node's sampled in-edges,
    since hop-wise layers only skip rows that cannot reach the seeds.
    """
    import torch

    x = x.to(next(model.parameters()).dtype)
    last = len(model.convs) - 1
    for i, conv in enumerate(model.convs):
        x = conv(x, edge_index)
        if i != last:
            x = torch.relu(x)
    return x[:batch_size]


class PygServer(common.ThreadPoolServer):
    """PyG serving: `NeighborSampler` + `x[node]` + the model, per request.

    Args:
        dataset_dir: prepared dataset directory.
        checkpoint: a `quiver train-model` checkpoint (loaded with `quiver.models`).
        fanouts: per-hop fanouts, seeds' hop first (default: the checkpoint's).
        num_workers / slo_ms: see `ThreadPoolServer`.
    """

    def __init__(self, dataset_dir, checkpoint, fanouts=None, num_workers=1, slo_ms=30.0):
        super().__init__(num_workers, slo_ms)
        import torch
        import torch_geometric.typing
        from torch_geometric.data import Data
        from torch_geometric.sampler import NeighborSampler
        from torch_sparse import SparseTensor

        from quiver.models import load_checkpoint

        if not torch_geometric.typing.WITH_TORCH_SPARSE:
            raise SystemExit("pyg_server: torch-sparse is not importable in this env")
        self.model, ckpt = load_checkpoint(checkpoint)
        self.fanouts = list(fanouts or ckpt.get("fanouts") or [15, 10, 5])
        indptr, indices, n = common.load_graph(dataset_dir)
        self.x = torch.from_numpy(common.load_features(dataset_dir))  # (N, F)
        # our CSR rows list in-neighbours, which is the CSC of the (source -> target) graph,
        # i.e. the CSR of adj_t: PyG reads it as is
        adj_t = SparseTensor(
            rowptr=torch.from_numpy(indptr),
            col=torch.from_numpy(indices),
            sparse_sizes=(n, n),
            is_sorted=True,
            trust_data=True,
        )
        self.sampler = NeighborSampler(Data(adj_t=adj_t, num_nodes=n), self.fanouts)
        self.num_nodes = n

    def set_threads(self, num_threads: int) -> None:
        """This worker's intra-op threads (torch-sparse's sampler is single-threaded)."""
        import torch

        torch.set_num_threads(num_threads)

    def sample(self, seeds: np.ndarray):
        """`(node (S,), edge_index (2, E_sub))` of PyG's sampled subgraph, seeds first."""
        import torch
        from torch_geometric.sampler import NodeSamplerInput

        seeds_t = torch.from_numpy(seeds)
        out = self.sampler.sample_from_nodes(NodeSamplerInput(input_id=None, node=seeds_t))
        return out.node, torch.stack([out.row, out.col])

    def logits(self, seeds: np.ndarray) -> np.ndarray:
        """`(len(seeds), C)` logits (unique seeds)."""
        import torch

        t0 = time.perf_counter()
        node, edge_index = self.sample(seeds)
        t1 = time.perf_counter()
        x = self.x[node]
        t2 = time.perf_counter()
        with torch.inference_mode():
            out = full_subgraph_forward(self.model, x, edge_index, len(seeds))
        t3 = time.perf_counter()
        self.stage_s["sample"] += t1 - t0
        self.stage_s["gather"] += t2 - t1
        self.stage_s["model"] += t3 - t2
        return out.float().numpy()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(p)
    p.add_argument("--checkpoint", required=True, help="quiver train-model checkpoint")
    args = p.parse_args(argv)
    server = PygServer(args.dataset_dir, args.checkpoint, slo_ms=args.slo_ms)
    if args.verify:
        common.verify_main(server.logits, args.verify)
        return
    if not (args.plan and args.out):
        raise SystemExit("pyg_server: give --plan and --out (or --verify)")
    print(
        f"pyg server: {server.num_nodes:,} nodes, fanouts {server.fanouts}, "
        f"configurations (workers x threads) {args.configs}"
    )
    common.bench_main(server, args)


if __name__ == "__main__":
    main()
