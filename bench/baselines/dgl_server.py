"""DGL serving baseline: per request, `dgl.dataloading.NeighborSampler` blocks, a feature gather and
a DGL GraphSAGE (`SAGEConv('mean')`) carrying our checkpoint's weights, on a small thread pool.
No cross-request batching.

Runs in `.bench-env/dgl` (torch 2.2.1 + dgl 2.1.0; our package is not installed there). The
weights come from an .npz that `bench/baselines/export_weights.py` writes in the main venv:

    .venv/bin/python bench/baselines/export_weights.py ckpt.pt sage.npz
    .bench-env/dgl/bin/python bench/baselines/dgl_server.py DATASET_DIR --weights sage.npz \
        --plan plan.json --out dgl.json --configs 1x1,1x2,2x1
    .bench-env/dgl/bin/python bench/baselines/dgl_server.py DATASET_DIR --weights sage.npz \
        --verify expected.npz        # logits equal Quiver's (graph with in-degrees < fanouts)

The graph is built once from the prepared CSR, which lists in-neighbours, i.e. it is the CSC
DGL samples in-edges from (`dgl.graph(("csc", ...))`, no conversion at request time).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_common as common  # noqa: E402


def build_dgl_sage(weights_npz):
    """A DGL GraphSAGE with the exported weights: `(model, config dict)`.

    `model(blocks, x)` returns `(num_seeds, C)` logits; `blocks` are outermost hop first.
    """
    import dgl.nn as dglnn
    import torch
    from torch import nn

    z = np.load(weights_npz)
    cfg = json.loads(str(z["config_json"]))
    if cfg["kind"] != "sage":
        raise SystemExit(f"dgl_server: only GraphSAGE is mapped, the checkpoint is {cfg['kind']}")

    class DGLSage(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList()
            for i in range(cfg["num_layers"]):
                w = z[f"layer{i}_fc_neigh"]  # (out, in)
                conv = dglnn.SAGEConv(w.shape[1], w.shape[0], "mean")
                with torch.no_grad():
                    conv.fc_neigh.weight.copy_(torch.from_numpy(w))
                    conv.fc_self.weight.copy_(torch.from_numpy(z[f"layer{i}_fc_self"]))
                    # DGL 2.x keeps the (single) bias of a "mean" SAGEConv in fc_self
                    conv.fc_self.bias.copy_(torch.from_numpy(z[f"layer{i}_bias"]))
                self.layers.append(conv)

        def forward(self, blocks, x):
            last = len(self.layers) - 1
            for i, (layer, block) in enumerate(zip(self.layers, blocks)):
                x = layer(block, x)
                if i != last:
                    x = torch.relu(x)
            return x

    return DGLSage().eval(), cfg


class DglServer(common.ThreadPoolServer):
    """DGL serving: `NeighborSampler.sample_blocks` + `x[input_nodes]` + DGL SAGE, per request.

    Args:
        dataset_dir: prepared dataset directory.
        weights: .npz from `export_weights.py` (weights, model config, fanouts).
        num_workers / slo_ms: see `ThreadPoolServer`.
    """

    def __init__(self, dataset_dir, weights, num_workers=1, slo_ms=30.0):
        super().__init__(num_workers, slo_ms)
        import dgl
        import torch

        self.model, cfg = build_dgl_sage(weights)
        # ours: seeds' hop first; DGL's list is per layer, input layer first (seeds' hop last)
        self.fanouts = [int(k) for k in cfg["fanouts"]]
        if len(self.fanouts) != cfg["num_layers"]:
            raise SystemExit("dgl_server: fanouts and layers differ in number")
        indptr, indices, n = common.load_graph(dataset_dir)
        self.graph = dgl.graph(
            ("csc", (torch.from_numpy(indptr), torch.from_numpy(indices), torch.tensor([]))),
            num_nodes=n,
        )
        # in-edge sampling reads the CSC only; building COO/CSR too would cost GBs on products
        self.graph = self.graph.formats("csc")
        self.x = torch.from_numpy(common.load_features(dataset_dir))  # (N, F)
        self.sampler = dgl.dataloading.NeighborSampler(self.fanouts[::-1])
        self.num_nodes = n

    def set_threads(self, num_threads: int) -> None:
        """This worker's intra-op threads: torch's, and DGL's own OpenMP pool (DGL links the
        system libgomp, torch its own copy, so each keeps its own thread count)."""
        import dgl
        import torch

        torch.set_num_threads(num_threads)
        dgl.utils.set_num_threads(num_threads)

    def logits(self, seeds: np.ndarray) -> np.ndarray:
        """`(len(seeds), C)` logits (unique seeds)."""
        import torch

        t0 = time.perf_counter()
        input_nodes, output_nodes, blocks = self.sampler.sample_blocks(
            self.graph, torch.from_numpy(seeds)
        )
        t1 = time.perf_counter()
        x = self.x[input_nodes]
        t2 = time.perf_counter()
        with torch.inference_mode():
            out = self.model(blocks, x)
        t3 = time.perf_counter()
        assert torch.equal(output_nodes, torch.from_numpy(seeds)), "DGL keeps the seed order"
        self.stage_s["sample"] += t1 - t0
        self.stage_s["gather"] += t2 - t1
        self.stage_s["model"] += t3 - t2
        return out.float().numpy()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(p)
    p.add_argument("--weights", required=True, help=".npz from export_weights.py")
    args = p.parse_args(argv)
    server = DglServer(args.dataset_dir, args.weights, slo_ms=args.slo_ms)
    if args.verify:
        common.verify_main(server.logits, args.verify)
        return
    if not (args.plan and args.out):
        raise SystemExit("dgl_server: give --plan and --out (or --verify)")
    print(
        f"dgl server: {server.num_nodes:,} nodes, fanouts {server.fanouts}, "
        f"configurations (workers x threads) {args.configs}"
    )
    common.bench_main(server, args)


if __name__ == "__main__":
    main()
