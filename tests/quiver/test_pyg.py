"""quiver.pyg: torch-quiver's GraphSageSampler interface and the PyG NodeLoader sampler."""

import pytest
import torch
from torch_geometric.data import Data
from torch_geometric.loader import NodeLoader
from torch_geometric.nn import SAGEConv

from quiver.graph import CSRTopo
from quiver.pyg import GraphSageSampler, QuiverNodeSampler


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    n = 300
    ei = torch.randint(0, n, (2, 3000), generator=g)
    ei = ei[:, ei[0] != ei[1]]
    return Data(x=torch.randn(n, 12, generator=g), edge_index=ei, num_nodes=n)


class SAGE(torch.nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.convs = torch.nn.ModuleList(SAGEConv(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward_sampled(self, x, adjs):
        # x: [len(n_id), C]; each Adj shrinks it to its targets, ending at [batch_size, C_out]
        for conv, (edge_index, _, size) in zip(self.convs, adjs):
            x = conv((x, x[: size[1]]), edge_index)
        return x

    def forward_full(self, x, edge_index):
        for conv in self.convs:
            x = conv(x, edge_index)
        return x


@pytest.mark.parametrize("mode", ["CPU", "GPU"])
def test_output_feeds_sageconv_and_matches_full_graph_with_all_neighbours(data, mode):
    torch.manual_seed(0)
    model = SAGE([12, 16, 16, 5]).eval()
    topo = CSRTopo.from_pyg(data)
    seeds = torch.tensor([4, 250, 17, 99])
    # fanout -1 takes every neighbour: the sampled forward must equal the full-graph forward
    sampler = GraphSageSampler(topo, [-1, -1, -1], mode=mode, seed=0)
    n_id, batch_size, adjs = sampler.sample(seeds)
    with torch.no_grad():
        sampled = model.forward_sampled(data.x[n_id], adjs)
        full = model.forward_full(data.x, data.edge_index)[seeds]
    assert sampled.shape == (batch_size, 5)
    torch.testing.assert_close(sampled, full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["CPU", "GPU"])
def test_sampled_output_trains_a_sage_model(data, mode):
    """A few Adam steps on sampled mini-batches fit labels that depend on the neighbourhood:
    the training loss falls well below its start (a sampler whose subgraphs do not match
    their features, or a broken relabelling, cannot be fitted)."""
    torch.manual_seed(1)
    model = SAGE([12, 16, 3])
    topo = CSRTopo.from_pyg(data)
    # labels from a full-graph mean aggregation: learnable only through the edges
    agg = torch.zeros(data.num_nodes, 12).index_add_(
        0, data.edge_index[1], data.x[data.edge_index[0]]
    )
    y = agg[:, :3].argmax(1)
    sampler = GraphSageSampler(topo, [10, 5], mode=mode, seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    losses = []
    for step in range(60):
        seeds = torch.arange(64 * (step % 4), 64 * (step % 4 + 1))
        n_id, bs, adjs = sampler.sample(seeds)
        out = model.forward_sampled(data.x[n_id], adjs)
        assert out.shape == (bs, 3)
        loss = torch.nn.functional.cross_entropy(out, y[seeds])
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-4:]) / 4 < 0.6 * sum(losses[:4]) / 4, losses[::10]


def test_modes_and_errors(data):
    topo = CSRTopo.from_pyg(data)
    with pytest.raises(ValueError, match="mode"):
        GraphSageSampler(topo, [5], mode="TPU")
    with pytest.raises(ValueError, match="CSRTopo"):
        GraphSageSampler(data.edge_index, [5])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            GraphSageSampler(topo, [5], mode="UVA")
    s = GraphSageSampler(topo, [5], mode="GPU", device="cpu", seed=0)
    assert s.device == torch.device("cpu")
    with pytest.raises(ValueError, match="node_count"):
        s.sample(torch.tensor([300]))


@pytest.mark.parametrize("mode", ["CPU", "GPU"])
def test_node_loader_uses_our_sampler(data, mode):
    data = data.clone()
    data.edge_attr = torch.arange(data.edge_index.size(1), dtype=torch.float)
    topo = CSRTopo.from_pyg(data)
    train = torch.arange(0, 300, 3)
    loader = NodeLoader(
        data,
        QuiverNodeSampler(topo, [6, 3], mode=mode, seed=0),
        input_nodes=train,
        batch_size=32,
        shuffle=False,
    )
    seen = []
    for batch in loader:
        n = batch.num_nodes
        assert batch.edge_index.max() < n
        assert torch.equal(batch.n_id[: batch.batch_size], train[batch.input_id])
        # edge attributes are sliced by e_id: each edge carries its original position
        assert torch.equal(batch.edge_attr.long(), batch.e_id)
        g = batch.n_id[batch.edge_index]
        assert torch.equal(g, data.edge_index[:, batch.e_id])
        assert batch.e_id.unique().numel() == batch.e_id.numel(), "hops never repeat an edge"
        assert sum(batch.num_sampled_nodes) == n
        assert sum(batch.num_sampled_edges) == batch.edge_index.size(1)
        seen.append(batch.n_id[: batch.batch_size])
    assert torch.equal(torch.cat(seen), train)
