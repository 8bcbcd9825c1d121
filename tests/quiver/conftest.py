"""Fixtures shared by the Quiver tests: a small serving world (graph, features, model, sampler)."""

import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from quiver import CSRTopo
from quiver.models import ModelConfig, build_model
from quiver.pyg import GraphSageSampler

# shared test modules of this directory (``hetero_cases``) import by name under importlib mode
sys.path.insert(0, os.path.dirname(__file__))


def small_world(num_nodes=300, in_degree=3, fanouts=(4, 4), seed=0, dim=8, classes=4):
    """A graph whose in-degree never exceeds the fanouts, so sampling takes every neighbour and
    each node's prediction is the same whatever batch it is served in."""
    rng = np.random.default_rng(seed)
    dst = np.repeat(np.arange(num_nodes), in_degree)
    src = (dst + rng.integers(1, num_nodes, size=dst.size)) % num_nodes
    edges = np.unique(np.stack([src, dst]), axis=1)  # distinct edges, in-degree <= in_degree
    topo = CSRTopo.from_edge_index(torch.from_numpy(edges), num_nodes=num_nodes)
    torch.manual_seed(seed)
    x = torch.randn(num_nodes, dim)
    model = build_model(
        ModelConfig("sage", in_dim=dim, out_dim=classes, hidden_dim=16, num_layers=len(fanouts))
    ).eval()
    sampler = GraphSageSampler(topo, list(fanouts), mode="CPU", seed=seed)
    return topo, x, model, sampler


def skewed_world(num_nodes, num_edges, seed, dim=6, classes=3):
    """A skewed random graph whose busiest rows exceed small fanouts, so answers depend on the
    random sample: ``(topo, x, model)`` with a 2-layer SAGE model over ``dim`` features."""
    rng = np.random.default_rng(seed)
    src = (num_nodes * rng.random(num_edges) ** 2).astype(np.int64)
    dst = (num_nodes * rng.random(num_edges) ** 1.5).astype(np.int64)
    topo = CSRTopo.from_edge_index(torch.from_numpy(np.stack([src, dst])), num_nodes=num_nodes)
    torch.manual_seed(seed)
    x = torch.randn(num_nodes, dim)
    model = build_model(ModelConfig("sage", dim, classes, hidden_dim=8, num_layers=2)).eval()
    return topo, x, model


class ExplodingSampler:
    """Wraps a sampler and fails on batches that contain node 13."""

    def __init__(self, inner):
        self.inner = inner

    def sample(self, seeds):
        if (seeds == 13).any():
            raise RuntimeError("sampler crashed")
        return self.inner.sample(seeds)


class ThreadKillingSampler:
    """Wraps a sampler; its first call raises ``SystemExit``, which ends the calling thread
    (not just the batch)."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = 0

    def sample(self, seeds):
        self.calls += 1
        if self.calls == 1:
            raise SystemExit("killed")
        return self.inner.sample(seeds)


@pytest.fixture
def exploding_sampler():
    """``ExplodingSampler`` as a fixture (test modules cannot import conftest helpers)."""
    return ExplodingSampler


@pytest.fixture
def thread_killing_sampler():
    """``ThreadKillingSampler`` as a fixture."""
    return ThreadKillingSampler


@pytest.fixture
def make_skewed_world():
    """``skewed_world`` as a fixture (test modules cannot import conftest helpers)."""
    return skewed_world


def offline_logits(model, sampler, x, nodes):
    """Logits of each node served alone, in the order given: ``(len(nodes), classes)``."""
    rows = []
    with torch.inference_mode():
        for v in nodes:
            n_id, bs, adjs = sampler.sample(torch.tensor([v]))
            rows.append(model(x[n_id], adjs)[0])
    return torch.stack(rows)


@pytest.fixture
def world():
    """A small graph served exactly (in-degree <= fanouts) with ``offline(nodes)`` logits."""
    topo, x, model, sampler = small_world()
    return SimpleNamespace(
        topo=topo,
        x=x,
        model=model,
        sampler=sampler,
        n=topo.node_count,
        offline=lambda nodes: offline_logits(model, sampler, x, nodes).numpy(),
    )


@pytest.fixture(scope="module")
def module_world():
    """``small_world()`` shared by a module's tests: ``(topo, x, model, sampler)``."""
    return small_world()
