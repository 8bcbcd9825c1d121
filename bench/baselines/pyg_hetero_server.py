"""PyG hetero serving baseline: per request, PyG's ``NeighborLoader`` collate (its hetero
``NeighborSampler`` over torch-sparse, then ``filter_hetero_data``), and the same hetero model
with the same weights, on a small worker-thread pool. No cross-request batching.

Runs in `.bench-env/pyg` (torch 2.13 + torch-sparse 0.6.18 + our package, editable), driven by
``bench/hetero.py``:

    .bench-env/pyg/bin/python bench/baselines/pyg_hetero_server.py DATASET_DIR \
        --checkpoint ckpt.pt --plan plan.json --out pyg.json --configs 1x1,1x2,2x1

What a PyG user writes: ``NeighborLoader(data, num_neighbors={edge_type: fanouts},
input_nodes=(target, ...))`` built once over the whole ``HeteroData``; per request its
``collate_fn(seeds)`` gives the sampled ``HeteroData`` batch (``n_id`` per type), then
``model(x_dict, edge_index_dict)`` with features per type (global ids for featureless types,
as Quiver passes them) and the first ``batch_size`` rows of the target type. Sampling follows
PyG's hetero semantics, as Quiver's does; the random draws differ.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_common as common  # noqa: E402


class PygHeteroServer(common.ThreadPoolServer):
    """PyG hetero serving: ``NeighborLoader.collate_fn`` + the model, per request."""

    def __init__(
        self, dataset_dir, checkpoint, model, fanouts, target, num_workers=1, slo_ms=100.0
    ):
        super().__init__(num_workers, slo_ms)
        import torch
        import torch_geometric.typing
        from torch_geometric.loader import NeighborLoader

        from quiver.hetero import HeteroGraph, load_hetero_model
        from quiver.hetero.sampler import resolve_fanouts

        if not torch_geometric.typing.WITH_TORCH_SPARSE:
            raise SystemExit("pyg_hetero_server: torch-sparse is not importable in this env")
        g = HeteroGraph.load(dataset_dir)
        self.data = g.to_pyg()
        self.target = target
        fan = resolve_fanouts(g, fanouts)
        self.loader = NeighborLoader(
            self.data,
            num_neighbors={et: ks for et, ks in fan.items()},
            input_nodes=(target, None),
            batch_size=64,
        )
        self.model, _ = load_hetero_model(checkpoint, model)
        self.torch = torch

    def set_threads(self, num_threads: int) -> None:
        self.torch.set_num_threads(num_threads)

    def logits(self, seeds: np.ndarray) -> np.ndarray:
        torch = self.torch
        t0 = time.perf_counter()
        batch = self.loader.collate_fn(torch.from_numpy(seeds))
        t1 = time.perf_counter()
        x = {t: batch[t].x if "x" in batch[t] else batch[t].n_id for t in batch.node_types}
        t2 = time.perf_counter()
        with torch.inference_mode():
            out = self.model(x, batch.edge_index_dict)
        out = out[self.target] if isinstance(out, dict) else out
        t3 = time.perf_counter()
        self.stage_s["sample"] += t1 - t0
        self.stage_s["gather"] += t2 - t1
        self.stage_s["model"] += t3 - t2
        return out[: len(seeds)].float().numpy()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(p)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--model", required=True, help="the checkpoint's factory")
    p.add_argument("--fanouts", default="10,5")
    p.add_argument("--target", default="paper")
    args = p.parse_args(argv)
    fanouts = [int(k) for k in args.fanouts.split(",")]
    server = PygHeteroServer(
        args.dataset_dir, args.checkpoint, args.model, fanouts, args.target, slo_ms=args.slo_ms
    )
    common.bench_main(server, args)


if __name__ == "__main__":
    main()
