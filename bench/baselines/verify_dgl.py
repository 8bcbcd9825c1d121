"""Smoke test of the DGL baseline env: NeighborSampler samples correct blocks on a random graph.

Runs inside `.bench-env/dgl` (`.bench-env/dgl/bin/python bench/baselines/verify_dgl.py`); exits
non-zero with a message naming the failed check. The checks are exact, not statistical: every
sampled edge must exist in the graph, and a seed keeps min(in-degree, fanout) distinct in-edges.
"""

import os
import sys

# Without it DGL's first import guesses a backend and writes ~/.dgl/config.json.
os.environ.setdefault("DGLBACKEND", "pytorch")

import dgl  # noqa: E402
import torch  # noqa: E402

NUM_NODES = 2_000
NUM_EDGES = 20_000
FANOUTS = [10, 5]
BATCH_SIZE = 128
NUM_SEEDS = 512


def check(ok: bool, what: str) -> None:
    """Stops the script with `what` when a verification fails."""
    if not ok:
        sys.exit(f"verify_dgl: FAILED: {what}")


def main() -> None:
    # DGL's sampler has its own generator; its OpenMP sampling still varies from run to run,
    # which is why the checks below are exact invariants rather than counts.
    dgl.seed(0)
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, NUM_NODES, (NUM_EDGES,), generator=gen)
    dst = torch.randint(0, NUM_NODES, (NUM_EDGES,), generator=gen)
    # to_simple drops duplicate edges, so "distinct in-neighbours" equals in-degree.
    graph = dgl.to_simple(dgl.graph((src, dst), num_nodes=NUM_NODES))
    seeds = torch.randperm(NUM_NODES, generator=gen)[:NUM_SEEDS]

    sampler = dgl.dataloading.NeighborSampler(FANOUTS)
    loader = dgl.dataloading.DataLoader(
        graph, seeds, sampler, batch_size=BATCH_SIZE, shuffle=False, drop_last=False
    )
    num_batches = num_edges = 0
    for input_nodes, output_nodes, blocks in loader:
        batch_seeds = seeds[num_batches * BATCH_SIZE : (num_batches + 1) * BATCH_SIZE]
        check(len(blocks) == len(FANOUTS), f"{len(blocks)} blocks for {len(FANOUTS)} hops")
        check(torch.equal(output_nodes, batch_seeds), "output nodes are not the batch's seeds")
        check(torch.equal(blocks[0].srcdata[dgl.NID], input_nodes), "input nodes mismatch")
        for inner, outer in zip(blocks[:-1], blocks[1:]):
            check(
                torch.equal(inner.dstdata[dgl.NID], outer.srcdata[dgl.NID]),
                "consecutive blocks do not chain",
            )
        # DGL orders fanouts by layer: blocks[i] is sampled with FANOUTS[i] and the last block's
        # destinations are the seeds, so the seeds get FANOUTS[-1] (PyG's num_neighbors[0]
        # is the seeds' fanout: the same list means reversed hops in the two libraries).
        for block, fanout in zip(blocks, FANOUTS):
            src_local, dst_local = block.edges()
            src_global = block.srcdata[dgl.NID][src_local]
            dst_global = block.dstdata[dgl.NID][dst_local]
            check(
                bool(graph.has_edges_between(src_global, dst_global).all()),
                "a sampled edge is not in the graph",
            )
            expected = graph.in_degrees(block.dstdata[dgl.NID]).clamp(max=fanout)
            check(
                torch.equal(block.in_degrees(), expected),
                f"in-degrees differ from min(in-degree, {fanout})",
            )
            num_edges += block.num_edges()
        num_batches += 1
    check(num_batches == -(-NUM_SEEDS // BATCH_SIZE), f"{num_batches} batches")
    print(
        f"verify_dgl: ok: dgl {dgl.__version__}, torch {torch.__version__}: {num_batches} batches, "
        f"{num_edges} sampled edges, fanouts {FANOUTS} on a {NUM_NODES}-node random graph"
    )


if __name__ == "__main__":
    main()
