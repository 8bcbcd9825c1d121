"""Smoke test of the PyG baseline env: NeighborLoader samples correctly through torch-sparse.

Runs inside `.bench-env/pyg` (`.bench-env/pyg/bin/python bench/baselines/verify_pyg.py`); exits
non-zero with a message naming the failed check. It first calls the compiled op
`torch.ops.torch_sparse.neighbor_sample` directly (proof that the locally built wheel loads and
runs), then checks NeighborLoader's batches exactly: every sampled edge exists in the graph, a
seed keeps min(in-degree, fanout) distinct in-edges, and features are the rows of `n_id`.
"""

import sys
import warnings

import torch
import torch_geometric
import torch_geometric.typing
import torch_sparse
from torch_geometric.data import Data
from torch_geometric.loader import NeighborLoader
from torch_geometric.utils import coalesce

NUM_NODES = 2_000
NUM_EDGES = 20_000
NUM_FEATURES = 16
FANOUTS = [10, 5]
BATCH_SIZE = 128
NUM_SEEDS = 512


def check(ok: bool, what: str) -> None:
    """Stops the script with `what` when a verification fails."""
    if not ok:
        sys.exit(f"verify_pyg: FAILED: {what}")


def main() -> None:
    check(torch_geometric.typing.WITH_TORCH_SPARSE, "PyG did not pick up torch-sparse")
    # pyg-lib would take precedence over torch-sparse in NeighborSampler; the baseline we build
    # is the torch-sparse path, so make sure that is the one exercised.
    check(not torch_geometric.typing.WITH_PYG_LIB, "pyg-lib is installed; torch-sparse unused")

    gen = torch.Generator().manual_seed(0)
    edge_index = torch.randint(0, NUM_NODES, (2, NUM_EDGES), generator=gen)
    # Deduplicated so that "distinct in-neighbours" equals in-degree.
    edge_index = coalesce(edge_index, num_nodes=NUM_NODES)  # (2, E), row 0 = source
    x = torch.randn(NUM_NODES, NUM_FEATURES, generator=gen)  # (N, F)
    data = Data(x=x, edge_index=edge_index, num_nodes=NUM_NODES)
    seeds = torch.randperm(NUM_NODES, generator=gen)[:NUM_SEEDS]
    in_degree = torch.bincount(edge_index[1], minlength=NUM_NODES)  # (N,)
    edge_keys = set((edge_index[0] * NUM_NODES + edge_index[1]).tolist())

    # The compiled kernel on its own: CSC of the graph, one hop of fanout FANOUTS[0].
    order = torch.argsort(edge_index[1] * NUM_NODES + edge_index[0])
    row = edge_index[0][order]  # (E,) sources sorted by target
    colptr = torch.zeros(NUM_NODES + 1, dtype=torch.long)
    colptr[1:] = torch.cumsum(in_degree, 0)
    # Returns sampled nodes and, per sampled edge, local source, local target and CSC edge id.
    node, out_row, out_col, out_edge = torch.ops.torch_sparse.neighbor_sample(
        colptr, row, seeds[:BATCH_SIZE], FANOUTS[:1], False, True
    )
    check(torch.equal(node[:BATCH_SIZE], seeds[:BATCH_SIZE]), "neighbor_sample lost the seeds")
    target = node[out_col]
    check(
        bool((colptr[target] <= out_edge).all() and (out_edge < colptr[target + 1]).all()),
        "neighbor_sample returned an edge outside its target's column",
    )
    check(torch.equal(node[out_row], row[out_edge]), "neighbor_sample edge sources are wrong")

    with warnings.catch_warnings():
        # PyG warns that sampling without pyg-lib is deprecated: that is the baseline we want.
        warnings.simplefilter("ignore")
        loader = NeighborLoader(
            data, num_neighbors=FANOUTS, batch_size=BATCH_SIZE, input_nodes=seeds, shuffle=False
        )
    num_batches = num_edges = 0
    for batch in loader:
        batch_seeds = seeds[num_batches * BATCH_SIZE : (num_batches + 1) * BATCH_SIZE]
        n = batch.batch_size
        check(torch.equal(batch.n_id[:n], batch_seeds), "the batch does not start with its seeds")
        check(torch.equal(batch.x, x[batch.n_id]), "batch features are not x[n_id]")
        src = batch.n_id[batch.edge_index[0]]
        dst = batch.n_id[batch.edge_index[1]]
        keys = (src * NUM_NODES + dst).tolist()
        check(all(k in edge_keys for k in keys), "a sampled edge is not in the graph")
        check(len(set(keys)) == len(keys), "an edge was sampled twice without replacement")
        # Seeds are only expanded in the first hop, so their in-edges all come from it.
        seed_in = torch.bincount(batch.edge_index[1][batch.edge_index[1] < n], minlength=n)
        expected = in_degree[batch_seeds].clamp(max=FANOUTS[0])
        check(torch.equal(seed_in, expected), f"seed in-degrees differ from min(deg, {FANOUTS[0]})")
        num_edges += batch.edge_index.size(1)
        num_batches += 1
    check(num_batches == -(-NUM_SEEDS // BATCH_SIZE), f"{num_batches} batches")
    print(
        f"verify_pyg: ok: torch_geometric {torch_geometric.__version__}, torch_sparse "
        f"{torch_sparse.__version__}, torch {torch.__version__}: {num_batches} batches, "
        f"{num_edges} sampled edges, fanouts {FANOUTS} on a {NUM_NODES}-node random graph"
    )


if __name__ == "__main__":
    main()
