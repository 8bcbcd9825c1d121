"""GNN models over sampled hops: shapes, one-pass embedding, checkpoints, clear errors."""

import pytest
import torch

from quiver.models import (
    MODEL_KINDS,
    FeatureMLP,
    ModelConfig,
    build_model,
    load_checkpoint,
    save_checkpoint,
)


def _two_hop_sample():
    # 10 sampled nodes -> 5 targets of hop 0 -> 2 seeds; local ids, targets are prefixes
    e0 = torch.tensor([[5, 6, 7, 8, 9, 2, 3], [0, 1, 2, 3, 4, 0, 1]])
    e1 = torch.tensor([[2, 3, 4], [0, 1, 1]])
    return [(e0, None, (10, 5)), (e1, None, (5, 2))]


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_forward_shapes_and_embedding_feeds_last_layer(kind):
    torch.manual_seed(0)
    m = build_model(ModelConfig(kind, in_dim=8, out_dim=3, hidden_dim=16, num_layers=2)).eval()
    adjs = _two_hop_sample()
    x = torch.randn(10, 8)
    emb, logits = m.forward_all(x, adjs)
    assert logits.shape == (2, 3) and emb.shape == (2, 16)
    assert torch.equal(m(x, adjs), logits)
    # node 9 reaches seed 1 through hop-0 target 4: perturbing it changes seed 1's logits
    x2 = x.clone()
    x2[9] += 10.0
    assert not torch.allclose(m(x2, adjs)[1], logits[1])


def test_sage_logits_depend_only_on_reachable_nodes():
    torch.manual_seed(0)
    m = build_model(ModelConfig("sage", in_dim=4, out_dim=2, hidden_dim=8, num_layers=2)).eval()
    adjs = _two_hop_sample()
    x = torch.randn(10, 4)
    base = m(x, adjs)
    # node 5 reaches target 0 of hop 0, which is seed 0: it changes seed 0 only
    x2 = x.clone()
    x2[5] += 5.0
    out = m(x2, adjs)
    assert not torch.allclose(out[0], base[0])
    assert torch.allclose(out[1], base[1])


def test_hop_count_mismatch_is_a_value_error():
    m = build_model(ModelConfig("sage", in_dim=8, out_dim=3, num_layers=3))
    with pytest.raises(ValueError, match="3 layers but the sample has 2 hops"):
        m(torch.randn(10, 8), _two_hop_sample())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(kind="mlp", in_dim=4, out_dim=2), "model kind"),
        (dict(kind="sage", in_dim=0, out_dim=2), "in_dim"),
        (dict(kind="gat", in_dim=4, out_dim=2, num_layers=0), "num_layers"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kwargs)


def test_checkpoint_round_trip(tmp_path):
    torch.manual_seed(1)
    m = build_model(ModelConfig("gat", in_dim=8, out_dim=3, hidden_dim=16, num_layers=2)).eval()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, m, extra={"val_acc": 0.5})
    m2, ckpt = load_checkpoint(path)
    assert ckpt["val_acc"] == 0.5
    x = torch.randn(10, 8)
    assert torch.equal(m(x, _two_hop_sample()), m2(x, _two_hop_sample()))


def test_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing.pt")
    bad = tmp_path / "bad.pt"
    torch.save({"weights": 1}, bad)
    with pytest.raises(ValueError, match="not a quiver model checkpoint"):
        load_checkpoint(bad)


def test_feature_mlp_shape():
    assert FeatureMLP(8, 16, 3)(torch.randn(5, 8)).shape == (5, 3)


def test_fast_sage_path_equals_pyg_sageconv_forward_and_backward():
    import numpy as np

    from quiver import CSRTopo
    from quiver.pyg import GraphSageSampler

    rng = np.random.default_rng(0)
    n = 400
    ei = np.stack([rng.integers(0, n, 6000), (n * rng.random(6000) ** 2).astype(np.int64)])
    topo = CSRTopo.from_edge_index(torch.from_numpy(ei), num_nodes=n)
    n_id, bs, adjs = GraphSageSampler(topo, [6, 4, 3], seed=1).sample(torch.arange(0, 50))
    torch.manual_seed(0)
    m = build_model(ModelConfig("sage", in_dim=12, out_dim=5, hidden_dim=16, num_layers=3))
    x = torch.randn(n, 12)[n_id].requires_grad_()
    outs, grads = [], []
    for fast in (True, False):
        m.fast_sage = fast
        m.zero_grad()
        x.grad = None
        out = m(x, adjs)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append((x.grad.clone(), m.convs[0].lin_l.weight.grad.clone()))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-4, atol=1e-5)


def test_inference_sage_path_equals_pyg_and_recycles_nothing_it_returned():
    """Under inference mode the CSR path writes into recycled buffers and accumulates in
    place; its logits equal PyG's SAGEConv, and a kept result is never overwritten later."""
    import numpy as np

    from quiver import CSRTopo
    from quiver.pyg import GraphSageSampler

    rng = np.random.default_rng(1)
    n = 3000
    ei = np.stack([rng.integers(0, n, 40000), (n * rng.random(40000) ** 2).astype(np.int64)])
    topo = CSRTopo.from_edge_index(torch.from_numpy(ei), num_nodes=n)
    sampler = GraphSageSampler(topo, [8, 6, 4], seed=3)
    torch.manual_seed(0)
    m = build_model(ModelConfig("sage", in_dim=96, out_dim=7, hidden_dim=160, num_layers=3))
    m.eval()
    feats = torch.randn(n, 96)
    kept = []
    for seeds in (torch.arange(0, 400), torch.arange(1000, 1300), torch.arange(2000, 2600)):
        n_id, _, adjs = sampler.sample(seeds)
        x = feats[n_id]
        with torch.inference_mode():
            m.fast_sage = True
            emb, fast = m.forward_all(x, adjs)
            m.fast_sage = False
            emb_ref, ref = m.forward_all(x, adjs)
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(emb, emb_ref, rtol=1e-5, atol=1e-5)
        kept.append((emb, fast, emb.clone(), fast.clone()))
    for emb, fast, emb_copy, fast_copy in kept:
        assert torch.equal(emb, emb_copy) and torch.equal(fast, fast_copy)
    from quiver.models import _BUFFERS

    assert _BUFFERS.reused > 0  # the sizes above do reach the recycled-buffer path
    # grad mode (training) takes the out-of-place path and gives the same logits
    m.fast_sage = True
    out_grad = m(x, adjs)
    torch.testing.assert_close(out_grad.detach(), kept[-1][3], rtol=1e-5, atol=1e-5)
