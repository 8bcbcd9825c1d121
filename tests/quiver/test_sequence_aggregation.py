"""A user's SAGE with ``aggr='lstm'``: the neighbour sequence each node's LSTM reads is the same
whichever requests share its batch (canonical order, one padded length), so its answer no longer
depends on the batch, and with all-neighbour fanouts it is PyG's on the full graph."""

import numpy as np
import pytest
import torch

from quiver import CSRTopo
from quiver.datasets import save_prepared
from quiver.serving import ServeConfig
from quiver.serving.server import Server
from quiver.usermodel import save_model

N, DIM = 80, 6
FACTORY = "torch_geometric.nn:GraphSAGE"
KWARGS = dict(in_channels=DIM, hidden_channels=8, out_channels=3, num_layers=2, aggr="lstm")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from torch_geometric.nn import GraphSAGE
    from torch_geometric.utils import sort_edge_index

    d = tmp_path_factory.mktemp("lstm")
    rng = np.random.default_rng(0)
    # sorted by target (PyG's LSTM aggregation needs it), then by source: the CSR rows'
    # order, which the sampler keeps
    ei = sort_edge_index(torch.from_numpy(rng.integers(0, N, (2, 400))), sort_by_row=False)
    x = rng.standard_normal((N, DIM)).astype(np.float32)
    topo = CSRTopo.from_edge_index(ei, num_nodes=N)
    save_prepared(d / "data", topo, x, rng.integers(0, 3, N), {}, {})
    torch.manual_seed(0)
    model = GraphSAGE(**KWARGS).eval()
    save_model(d / "lstm.pt", model, FACTORY, KWARGS, fanouts=[-1, -1])
    with torch.no_grad():
        full = model(torch.from_numpy(x), ei).numpy()
    return d, full, int(topo.degree.max())


def test_lstm_answers_do_not_depend_on_the_batch(world):
    d, full, most = world
    cfg = ServeConfig(max_batch_nodes=N, max_request_nodes=N)
    with Server.from_dataset(
        d / "data", d / "lstm.pt", cfg, model=FACTORY, seed=0, sampler_threads=1
    ) as server:
        # what each node's first LSTM reads and returns: its aggregation row
        lstm = server.engine.model.module.convs[0].aggr_module
        caught = []
        lstm.register_forward_hook(lambda mod, inp, out: caught.append(out.detach().clone()))
        alone, alone_seq = [], []
        for v in range(N):
            caught.clear()
            alone.append(server.predict([v], output="logits").values[0])
            alone_seq.append(caught[0][0])  # the seed is the subgraph's first node
        caught.clear()
        batched = server.predict(list(range(N)), output="logits").values
        batched_seq = caught[0][:N]  # seeds first, in request order
    # the sequence the LSTM aggregated, bit for bit (was: zero-padded to the longest
    # neighbour list in the batch, so a node alone read a shorter sequence)
    torch.testing.assert_close(torch.stack(alone_seq), batched_seq, rtol=0, atol=0)
    alone = np.stack(alone)
    # later layers' matrix products round a row by where it sits in the batch (the BLAS
    # kernels' tiles), about 1e-7; the batch used to change answers by 0.1-0.3
    np.testing.assert_allclose(alone, batched, rtol=0, atol=1e-5)
    np.testing.assert_allclose(alone, full, rtol=0, atol=1e-5)
    assert np.abs(full).max() > 0.05
    assert f"neighbour sequences padded to {most}" in server.info  # the graph's max in-degree
