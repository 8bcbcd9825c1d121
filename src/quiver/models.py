"""GNN models for serving and training: GraphSAGE, GCN and GAT from ``torch_geometric.nn`` layers.

Every model consumes the sampler's output unchanged: node features ``x`` of shape
``(len(n_id), F)`` and ``adjs`` ordered from the outermost hop to the seeds, where
``adjs[i] = (edge_index, e_id, (num_src, num_dst))`` and the first ``num_dst`` local nodes are the
targets of hop ``i``. The result has one row per seed: ``(batch_size, out_dim)``.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from quiver.feature.buffers import BufferPool
from quiver.usermodel import QUIVER_GNN_FACTORY, save_model

MODEL_KINDS = ("sage", "gcn", "gat")

#: outputs of inference-mode SAGE layers; a block returns once no tensor views it any more
_BUFFERS = BufferPool()


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a GNN; saved with every checkpoint so the server can rebuild it.

    Args:
        kind: one of ``"sage"``, ``"gcn"``, ``"gat"``.
        in_dim: input feature dimension.
        hidden_dim: hidden dimension of every inner layer (default 128).
        out_dim: number of classes (the logits' width).
        num_layers: number of message-passing layers; must equal the number of fanouts the
            sampler uses (default 3).
        heads: attention heads for GAT inner layers (default 4; ignored by other kinds).
    """

    kind: str
    in_dim: int
    out_dim: int
    hidden_dim: int = 128
    num_layers: int = 3
    heads: int = 4

    def __post_init__(self):
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"model kind must be one of {MODEL_KINDS}, got {self.kind!r}")
        for name in ("in_dim", "out_dim", "hidden_dim", "num_layers", "heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name} must be >= 1, got {getattr(self, name)}")


class SampledGNN(nn.Module):
    """A stack of message-passing layers over sampled bipartite hops.

    ``forward(x, adjs)`` returns logits ``(batch_size, out_dim)``; ``embed(x, adjs)`` returns the
    last hidden representation ``(batch_size, hidden_dim)`` (the input of the final layer).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        from torch_geometric.nn import GATConv, GCNConv, SAGEConv

        self.cfg = cfg
        #: SAGE layers aggregate with a CSR sparse-dense product when a hop's edges come grouped
        #: by target (our samplers' order): the same mean as PyG's scatter, a few times faster.
        self.fast_sage = True
        dims = [cfg.in_dim] + [cfg.hidden_dim] * (cfg.num_layers - 1) + [cfg.out_dim]
        self.convs = nn.ModuleList()
        for i in range(cfg.num_layers):
            d_in, d_out, last = dims[i], dims[i + 1], i == cfg.num_layers - 1
            if cfg.kind == "sage":
                conv = SAGEConv(d_in, d_out)
            elif cfg.kind == "gcn":
                # GCN has no bipartite form: it runs on all sampled nodes, then keeps the targets.
                conv = GCNConv(d_in, d_out, cached=False, add_self_loops=True)
            else:
                heads = 1 if last else cfg.heads
                # concat=False averages heads so every layer's width stays d_out.
                conv = GATConv(d_in, d_out, heads=heads, concat=False, add_self_loops=False)
            self.convs.append(conv)

    def quiver_served_info(self, fanouts=None) -> dict:
        """What ``quiver.usermodel.load_served_model`` reports for this model: it takes the
        sampler's ``adjs`` as they are (no :class:`quiver.usermodel.ServedModel` wrapper)."""
        cfg = self.cfg
        return {
            "kind": f"{cfg.kind} x{cfg.num_layers}",
            "fanouts": list(fanouts) if fanouts else None,
            "frontier": False,
            "extra_hops": 0,
            "num_layers": cfg.num_layers,
            "convention": "adjs",
            "in_dim": cfg.in_dim,
        }

    def _layer(self, i: int, x: Tensor, edge_index: Tensor, num_dst: int) -> Tensor:
        conv = self.convs[i]
        if self.cfg.kind == "gcn":
            return conv(x, edge_index)[:num_dst]
        if self.cfg.kind == "sage" and self.fast_sage:
            out = _sage_csr(conv, x, edge_index, num_dst)
            if out is not None:
                return out
        return conv((x, x[:num_dst]), edge_index)

    def embed(self, x: Tensor, adjs) -> Tensor:
        """Hidden representation of the seeds before the last layer: ``(batch_size, hidden)``."""
        return self.forward_all(x, adjs)[0]

    def forward(self, x: Tensor, adjs) -> Tensor:
        """Logits of the seeds: ``(batch_size, out_dim)``."""
        return self.forward_all(x, adjs)[1]

    def forward_all(self, x: Tensor, adjs) -> tuple[Tensor, Tensor]:
        """Both outputs in one pass: ``(embedding (B, hidden_or_in), logits (B, out_dim))``."""
        if len(adjs) != len(self.convs):
            raise ValueError(
                f"model has {len(self.convs)} layers but the sample has {len(adjs)} hops; "
                "use as many fanouts as layers"
            )
        # features may be stored in a narrower dtype (float16); compute in the weights' dtype
        x = x.to(next(self.parameters()).dtype)
        last = len(self.convs) - 1
        for i, (edge_index, _, size) in enumerate(adjs):
            if i == last:
                emb = x[: size[1]]
            x = self._layer(i, x, edge_index, size[1])
            if i != last:
                # in place when no graph is recorded: x is this layer's fresh output
                x = torch.relu(x) if torch.is_grad_enabled() else torch.relu_(x)
        return emb, x


def _sage_csr(conv, x: Tensor, edge_index: Tensor, num_dst: int) -> Tensor | None:
    """PyG ``SAGEConv`` (mean aggregation, root weight) as ``lin_l(A x / deg) + lin_r(x_dst)``
    with ``A`` the hop's CSR adjacency; None when it does not apply (then PyG's path runs)."""
    if (
        conv.aggr != "mean"
        or not conv.root_weight
        or conv.normalize
        or conv.project
        or edge_index.device.type != "cpu"
    ):
        return None
    src, dst = edge_index[0], edge_index[1]
    if dst.numel() > 1 and not bool((dst[1:] >= dst[:-1]).all()):
        return None  # CSR needs edges grouped by target
    deg = torch.bincount(dst, minlength=num_dst)  # (num_dst,)
    crow = torch.zeros(num_dst + 1, dtype=torch.long)
    torch.cumsum(deg, 0, out=crow[1:])
    if x.dtype == torch.bfloat16 and not torch.is_grad_enabled():
        # torch has no bf16 sparse CSR product; embedding_bag's mean over each target's CSR
        # row is the same neighbour mean (accumulated in fp32, rounded once to bf16; an empty
        # row gives 0 like the CSR path), then the two linear maps run as bf16 GEMMs (oneDNN:
        # AMX / AVX-512-BF16 where the CPU has them)
        agg = torch.nn.functional.embedding_bag(src, x, crow[:-1], mode="mean")
        out = conv.lin_l(agg)
        return out.addmm_(x[:num_dst], conv.lin_r.weight.t())  # (num_dst, out)
    ones = torch.ones(src.numel(), dtype=x.dtype)
    with warnings.catch_warnings():  # torch flags sparse CSR as beta on its first use
        warnings.simplefilter("ignore", UserWarning)
        adj = torch.sparse_csr_tensor(
            crow, src, ones, size=(num_dst, x.shape[0]), check_invariants=False
        )
    deg_f = deg.clamp(min=1).unsqueeze(1).to(x.dtype)  # (num_dst, 1)
    if torch.is_grad_enabled() and (x.requires_grad or conv.lin_l.weight.requires_grad):
        agg = torch.sparse.mm(adj, x) / deg_f
        return conv.lin_l(agg) + conv.lin_r(x[:num_dst])
    # inference: the same products, into recycled buffers and accumulated in place; every
    # fresh (num_dst, dim) temporary would be faulted in page by page (bench/serving_path.py)
    w_l, b_l = conv.lin_l.weight, conv.lin_l.bias
    agg = _BUFFERS.empty((num_dst, x.shape[1]), x.dtype)
    torch.mm(adj, x, out=agg).div_(deg_f)  # neighbour means
    out = _BUFFERS.empty((num_dst, w_l.shape[0]), x.dtype)
    if b_l is None:
        torch.mm(agg, w_l.t(), out=out)
    else:
        torch.addmm(b_l, agg, w_l.t(), out=out)
    return out.addmm_(x[:num_dst], conv.lin_r.weight.t())  # (num_dst, out)


class FeatureMLP(nn.Module):
    """Features-only baseline: an MLP on each seed's own features (no graph)."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int, num_layers: int = 3):
        super().__init__()
        dims = [in_dim] + [hidden_dim] * (num_layers - 1) + [out_dim]
        layers: list[nn.Module] = []
        for i in range(num_layers):
            layers.append(nn.Linear(dims[i], dims[i + 1]))
            if i < num_layers - 1:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def build_model(cfg: ModelConfig) -> SampledGNN:
    """Build the GNN that ``cfg`` describes (random initialisation)."""
    return SampledGNN(cfg)


#: the factory ``quiver train-model`` records in its checkpoints
FACTORY = QUIVER_GNN_FACTORY


def sampled_gnn(
    kind: str,
    in_dim: int,
    out_dim: int,
    hidden_dim: int = 128,
    num_layers: int = 3,
    heads: int = 4,
) -> SampledGNN:
    """Factory of Quiver's own GNN (arguments as :class:`ModelConfig`), as checkpoints name it.

    ``quiver train-model`` checkpoints record ``"factory": "quiver.models:sampled_gnn"`` and
    these arguments as ``"factory_kwargs"``, the same format as a user's own model
    (``quiver.usermodel.save_model``).
    """
    return SampledGNN(ModelConfig(kind, in_dim, out_dim, hidden_dim, num_layers, heads))


def save_checkpoint(path, model: SampledGNN, extra: dict | None = None) -> None:
    """Save ``model`` in the one checkpoint format, atomically (write, then rename).

    The file is ``{"factory": FACTORY, "factory_kwargs": <its ModelConfig>, "state_dict":
    ..., **extra}`` (see ``quiver.usermodel.save_model``); ``extra`` usually holds
    ``"fanouts"``.
    """
    extra = dict(extra or {})
    fanouts = extra.pop("fanouts", None)
    save_model(path, model, FACTORY, asdict(model.cfg), fanouts=fanouts, extra=extra)


def load_checkpoint(path, map_location="cpu") -> tuple[SampledGNN, dict]:
    """Rebuild a Quiver GNN from a checkpoint: ``(model in eval mode, checkpoint dict)``.

    Reads the current format (``save_checkpoint``: ``factory`` ``quiver.models:sampled_gnn``
    with its ``factory_kwargs``) and the format before it (``{"config": <ModelConfig fields>,
    "state_dict", "fanouts"}``); either way the returned dict has ``"config"``.
    """
    import os

    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
        if isinstance(ckpt, dict) and ckpt.get("factory") == FACTORY and "config" not in ckpt:
            ckpt["config"] = dict(ckpt.get("factory_kwargs") or {})
        cfg = ModelConfig(**ckpt["config"])
    except (KeyError, TypeError, RuntimeError, EOFError) as e:
        raise ValueError(f"{path} is not a quiver model checkpoint ({e})") from None
    model = build_model(cfg)
    model.load_state_dict(ckpt["state_dict"])
    model.eval()
    return model, ckpt
