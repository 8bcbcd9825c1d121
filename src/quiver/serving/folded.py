"""The first layer folded into the feature table (``quiver serve --fold-first-layer``).

A mean-aggregating SAGE layer is linear up to its activation, so its two GEMMs commute with
the neighbour mean::

    h_i = W_l mean_{j in N(i)} x_j + b + W_r x_i
        = mean_{j in N(i)} (x_j W_l^T) + b + (x_i W_r^T)
        = mean_{j in N(i)} L[j]       + b + R[i]

with ``L = X W_l^T`` and ``R = X W_r^T`` computed once at start-up for every node, ``(N, H)``
each. Layer 1 of a sampled batch then needs no GEMM at all: one ``embedding_bag`` mean straight
from ``L`` over each target's sampled neighbours (global ids, so the ``(len(n_id), F)`` rows
are never materialised), plus ``R``'s rows of the targets and the bias. On the products-like
GraphSAGE (F = 100, H = 128) the first layer's GEMMs were more than half the model step: see
``bench/folded.py`` for the measured speed-up and BENCHMARKS.md for its figures.

The cost is memory: ``2 * N * H`` values instead of ``N * F`` (2.56x for products-like), in the
gather's dtype (bf16 halves it). The rewrite is exact in real arithmetic; in fp32 the logits
differ from the unfolded model's by rounding only (about 1e-6).

Which models fold (:func:`why_not_foldable` says why another does not):

* Quiver's own ``SampledGNN`` with a SAGE first layer (mean aggregation, root weight, no
  normalisation or projection) and at least two layers: layer 1 is computed for hop 1's
  targets only, straight from the tables.
* A user's module (``quiver.usermodel.ServedModel``, ``forward(x, edge_index)``) whose first
  message-passing layer to run takes the raw features and is one of :data:`FOLDABLE_LAYERS`,
  with at least two message-passing layers. Its tables, by layer (``W`` the layer's weights):

  - ``SAGEConv`` (mean or sum, root weight or not, ``normalize`` applied after; no
    ``project``) and ``GraphConv`` (sum or mean): the neighbour and root maps, as above;
  - ``GCNConv`` (``cached=False``): ``X W^T``; the normalisation stays at serve time, computed
    by PyG's ``gcn_norm`` on the sampled subgraph exactly as the unfolded layer does (the
    degrees of the sample, with its extra degree hop);
  - ``GINConv`` whose MLP starts with a ``Linear`` (``W_1, b_1``): ``(1 + eps) x_i + sum_j x_j``
    then ``W_1`` is linear, so the table is ``X W_1^T``, ``b_1`` is added once, and the rest of
    the MLP (norm, activation, more layers) runs as it did;
  - ``GATConv`` (any heads, concat or mean, residual or not; no edge features): ``W x`` of
    every head and the per-node attention terms ``a_src . W x`` and ``a_dst . W x``; the
    leaky ReLU, the softmax over each target's in-edges and the weighted sum stay at serve
    time.

  :meth:`FoldedFirstLayer.gather_layer` computes the layer's linear part for every sampled
  node from the tables (the subgraph's edges as the module receives them); the tail then
  calls the module on a placeholder ``x`` (an expanded NaN: no memory, and NaN wherever the
  module reads it), which its first layer answers with that output (a ``forward`` installed
  on the layer; it runs the class's own ``forward`` for any other input). Whether the layer
  is the first to run, takes the raw features, and is the module's only reader of them is
  checked once on a small random probe sample (folded against unfolded), so a model that
  transforms ``x`` first or reads it again (a skip connection) is refused with a reason.
"""

from __future__ import annotations

import copy
import threading
import time
import types
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

__all__ = [
    "FOLDABLE_LAYERS",
    "FOLD_CHOICES",
    "FoldChoice",
    "FoldedFirstLayer",
    "fold_table_bytes",
    "measure_fold",
    "read_fold",
    "why_not_foldable",
    "write_fold",
]

#: values of ``--fold-first-layer``
FOLD_CHOICES = ("auto", "on", "off")


def why_not_foldable(model: nn.Module) -> str | None:
    """None when ``model``'s first layer can be folded into the feature table, else why not
    (one line): Quiver's own ``SampledGNN`` with a mean SAGE first layer, or a user's module
    (a :class:`~quiver.usermodel.ServedModel`) whose first message-passing layer is one of
    :data:`FOLDABLE_LAYERS` on the raw features (checked on a small random probe sample)."""
    from quiver.models import SampledGNN
    from quiver.usermodel import ServedModel

    if isinstance(model, ServedModel):
        return _why_not_user(model)
    if not isinstance(model, SampledGNN):
        return f"the model is a {type(model).__name__}, not Quiver's own GNN or a user's module"
    if model.cfg.kind != "sage":
        return f"its first layer is {model.cfg.kind}, not SAGE"
    if len(model.convs) < 2:
        return "a one-layer model's embedding is the raw features"
    conv = model.convs[0]
    if conv.aggr != "mean" or not conv.root_weight or conv.normalize or conv.project:
        return "its first SAGE layer is not a plain mean aggregation with a root weight"
    if conv.lin_l.weight.device.type != "cpu":
        return "the model is not on the CPU"
    return None


def fold_table_bytes(model: nn.Module, num_nodes: int, dtype: torch.dtype) -> int:
    """Bytes of the tables :class:`FoldedFirstLayer` builds for a foldable ``model``."""
    from quiver.usermodel import ServedModel

    size = torch.empty((), dtype=dtype).element_size()
    if isinstance(model, ServedModel):
        return num_nodes * sum(_Recipe(model._layers[0]).widths) * size
    return 2 * num_nodes * int(model.convs[0].lin_l.weight.shape[0]) * size


class FoldedFirstLayer:
    """Node tables of a model's first layer: its per-node linear maps of the raw features.

    For Quiver's ``SampledGNN`` (SAGE): ``L = X W_l^T`` and ``R = X W_r^T``. For a user's
    module (a ``ServedModel``), by its first layer's class (see the module docstring):
    ``SAGEConv``/``GraphConv`` the same two, ``GCNConv`` ``X W^T``, ``GINConv`` ``X W_1^T`` of
    its MLP's first ``Linear``, ``GATConv`` ``W x`` of every head, the attention terms
    ``a_src . W x`` and ``a_dst . W x`` per head, and its residual map when it has one.

    The engine's feature store when folding is on: :meth:`gather_layer` replaces the row
    gather (and layer 1 of a ``SampledGNN``), and :attr:`tail` (sharing the model's
    parameters) replaces the model.

    Args:
        model: a foldable model (see :func:`why_not_foldable`), fp32 weights.
        features: ``(N, F)`` node features (fp32 or bf16; a memory map is read in chunks).
        dtype: dtype the tables are stored and gathered in (``torch.float32`` or
            ``torch.bfloat16``); the products are computed in fp32 either way.
        chunk_rows: rows projected at a time (bounds the fp32 temporaries).
        progress: show a progress bar while the tables are built.
    """

    def __init__(
        self,
        model: nn.Module,
        features,
        dtype: torch.dtype = torch.float32,
        chunk_rows: int = 65536,
        progress: bool = False,
        _check: bool = True,
    ):
        reason = why_not_foldable(model) if _check else None
        if reason is not None:
            raise ValueError(f"--fold-first-layer: cannot fold this model: {reason}")
        from quiver.models import SampledGNN

        self.sampled = isinstance(model, SampledGNN)
        if self.sampled:
            conv = model.convs[0]
            in_dim = int(conv.lin_l.weight.shape[1])
            # both maps in one GEMM per chunk: (rows, F) @ (F, 2H)
            w = torch.cat([conv.lin_l.weight, conv.lin_r.weight], 0).detach().float().t()
            hidden = int(conv.lin_l.weight.shape[0])
            widths = [hidden, hidden]
            bias = conv.lin_l.bias
            self.bias = (
                bias.detach().float().clone() if bias is not None else torch.zeros(hidden)
            )  # (H,)

            def project(rows):
                both = rows @ w  # (rows, 2H)
                return [both[:, :hidden], both[:, hidden:]]

            self.recipe = None
        else:
            conv = model._layers[0]
            in_dim = _in_dim(conv)
            self.recipe = _Recipe(conv)
            hidden, widths, project = self.recipe.out_dim, self.recipe.widths, self.recipe.project
        n, f = int(features.shape[0]), int(features.shape[1])
        if f != in_dim:
            raise ValueError(
                f"the model's first layer takes {in_dim} features per node; the dataset has {f}"
            )
        self._project = project
        self.tables = [torch.empty((n, k), dtype=dtype) for k in widths]
        chunks = range(0, n, chunk_rows)
        if progress:
            from tqdm import tqdm

            chunks = tqdm(chunks, desc="folding layer 1", unit="chunk", leave=False)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for lo in chunks:
                hi = min(lo + chunk_rows, n)
                rows = (
                    torch.as_tensor(np.asarray(features[lo:hi]))
                    if not isinstance(features, Tensor)
                    else features[lo:hi]
                )
                for table, part in zip(self.tables, project(rows.float())):
                    table[lo:hi] = part
        self.build_s = time.perf_counter() - t0
        if self.sampled:
            self.tail = _tail(model)
        else:
            for m in _installed(conv):
                _install(m)
            self.tail = _FoldedTail(model, in_dim).eval()
        self.num_nodes, self.hidden = n, hidden

    def project_rows(self, rows: Tensor) -> list[Tensor]:
        """Every table's rows for feature rows ``rows`` (``(n, F)``, computed in fp32 as at
        start-up): what new or replaced feature rows make of the tables (updates while
        serving, ``quiver.serving.live``)."""
        with torch.inference_mode():
            return [part.clone() for part in self._project(rows.float())]

    @property
    def left(self) -> Tensor:
        """``(N, H)``: the first table (a SAGE model's ``L = X W_l^T``)."""
        return self.tables[0]

    @property
    def right(self) -> Tensor:
        """``(N, H)``: a SAGE model's ``R = X W_r^T``."""
        return self.tables[1]

    def to(self, dtype: torch.dtype) -> FoldedFirstLayer:
        """The same tables stored in ``dtype`` (a new object sharing :attr:`tail`)."""
        other = copy.copy(self)
        other.tables = [t.to(dtype) for t in self.tables]
        return other

    @property
    def dtype(self) -> torch.dtype:
        return self.tables[0].dtype

    @property
    def nbytes(self) -> int:
        """Bytes of all tables."""
        return sum(t.numel() * t.element_size() for t in self.tables)

    @property
    def shape(self) -> torch.Size:
        """``(N, H)``: nodes, and the width of the first layer's output."""
        return torch.Size((self.num_nodes, self.hidden))

    def describe(self) -> str:
        """The tables' shapes and dtype, e.g. ``"2 x 1,000 x 128 fp32"``."""
        widths = [int(t.shape[1]) for t in self.tables]
        dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(self.dtype, str(self.dtype))
        if len(set(widths)) == 1:
            return f"{len(widths)} x {self.num_nodes:,} x {widths[0]} {dtype}"
        return f"{self.num_nodes:,} x ({' + '.join(map(str, widths))}) {dtype}"

    def gather_layer(self, n_id: Tensor, adjs: list, rows=None) -> tuple[Tensor, list]:
        """Layer 1's folded output of a sampled batch and the hops left for :attr:`tail`.

        Args:
            n_id: ``(S,)`` global ids of the sampled nodes, targets of hop 1 first.
            adjs: the sampler's hops, outermost first (see ``quiver.models``).
            rows: this batch's rows of every table (``(S, w)`` each, in ``n_id``'s order),
                read from a live graph's version (updated rows included); default: read
                from :attr:`tables` by global id.

        Returns:
            A ``SampledGNN``'s ``(relu(h1) (num_dst, H) fp32, adjs[1:])``; a user module's
            ``(h1 (S, H) fp32, adjs)``: its first layer's linear part for every sampled node,
            which :attr:`tail` hands that layer in place of its computation.
        """
        tables = self.tables
        if rows is not None:  # the rows themselves: local ids index them
            tables, n_id = list(rows), torch.arange(n_id.numel())
        if self.recipe is not None:
            n_id = n_id.cpu()
            edge_index = subgraph_edge_index([(a[0].cpu(),) for a in adjs])
            return self.recipe.aggregate(tables, n_id, edge_index), adjs
        edge_index, _, (_, num_dst) = adjs[0]
        # a GPU-sampled batch (HybridSampler) reads the host tables with host ids
        n_id, edge_index = n_id.cpu(), edge_index.cpu()
        left, right = tables
        h = _bags(left, n_id, edge_index, num_dst, "mean")  # (num_dst, H)
        h += right.index_select(0, n_id[:num_dst])
        h += self.bias
        return h.relu_(), adjs[1:]


def _tail(model: nn.Module) -> nn.Module:
    """Layers 2..L of a ``SampledGNN`` as a ``SampledGNN`` sharing its parameters."""
    from dataclasses import replace

    from quiver.models import SampledGNN

    tail = SampledGNN.__new__(SampledGNN)
    nn.Module.__init__(tail)
    tail.cfg = replace(model.cfg, num_layers=len(model.convs) - 1, in_dim=model.cfg.hidden_dim)
    tail.fast_sage = model.fast_sage
    tail.convs = nn.ModuleList(list(model.convs)[1:])
    return tail.eval()


def measure_fold(
    sampler,
    features,
    model: nn.Module,
    folds: dict[str, FoldedFirstLayer],
    node_count: int,
    batch_sizes=(32, 256),
    repeats: int = 3,
    seed: int = 0,
    num_threads: int = 1,
) -> dict:
    """Time gather + model unfolded and with each folded store on the same sampled batches.

    ``features`` are the rows the unfolded path gathers (in its dtype) and ``model`` the
    model it runs; ``folds`` names the folded stores to try (e.g. ``{"fp32": ..., "bf16":
    ...}``). Every path runs on each batch, in rotated order, after one warm-up batch.
    Returns ``{"unfolded_s": s, "folded_s": {name: s}, "max_abs_diff": {name: d},
    "agreement": {name: a}}``: times summed over the timed batches, and each folded path's
    largest logit difference and argmax agreement against the unfolded one.
    """
    from quiver.precision import sampled_batches

    rng = np.random.default_rng(seed)
    prev = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    t = dict.fromkeys(["unfolded", *folds], 0.0)
    agree = dict.fromkeys(folds, 0)
    max_diff = dict.fromkeys(folds, 0.0)
    total = 0
    try:
        with torch.inference_mode():
            batches = sampled_batches(sampler, node_count, batch_sizes, repeats, rng)

            def run(name, n_id, adjs):
                if name == "unfolded":
                    return model(features[n_id], adjs)
                x, rest = folds[name].gather_layer(n_id, adjs)
                return folds[name].tail(x, rest)

            names = list(t)
            for name in names:  # warm-up on every size: first-touch pages, kernel set-up
                for j in range(0, len(batches), repeats):
                    run(name, *batches[j])
            for i, (n_id, adjs) in enumerate(batches):
                outs = {}
                k = i % len(names)
                for name in names[k:] + names[:k]:
                    t0 = time.perf_counter()
                    outs[name] = run(name, n_id, adjs).float()
                    t[name] += time.perf_counter() - t0
                ref = outs["unfolded"]
                total += ref.shape[0]
                for name in folds:
                    agree[name] += int((ref.argmax(1) == outs[name].argmax(1)).sum())
                    max_diff[name] = max(max_diff[name], float((ref - outs[name]).abs().max()))
    finally:
        torch.set_num_threads(prev)
    return {
        "unfolded_s": t["unfolded"],
        "folded_s": {name: t[name] for name in folds},
        "max_abs_diff": max_diff,
        "agreement": {name: agree[name] / total if total else None for name in folds},
    }


# ------------------------------------------------------------------------------ user models

#: the ``torch_geometric.nn`` layers a user's model may have folded as its first layer (the
#: exact classes: a subclass may change ``forward``)
FOLDABLE_LAYERS = ("SAGEConv", "GCNConv", "GraphConv", "GINConv", "GATConv")

_ACTIVE = threading.local()  # the folded batch a tail is running on this thread


@dataclass
class _Batch:
    """What a folded tail hands its first layer: ``placeholder`` stands in for the raw
    features (NaN, so a model reading them elsewhere gives NaN), ``pre`` is the layer's folded
    output before its nonlinear part (``(S, H)``), ``num_edges`` the sampled subgraph's."""

    placeholder: Tensor
    pre: Tensor
    num_edges: int
    used: bool = False


def _intercept(self, x, *args, **kwargs):
    """``forward`` of a folded first layer (and of a GIN MLP's first ``Linear``): the folded
    output when called on this thread's placeholder, else the class's own ``forward``."""
    batch = getattr(_ACTIVE, "batch", None)
    if batch is None or x is not batch.placeholder:
        return type(self).forward(self, x, *args, **kwargs)
    if not isinstance(self, _message_passing()):  # the first Linear of a GIN MLP
        return batch.pre
    edge_index = args[0] if args else kwargs.pop("edge_index", None)
    extra = [a for a in (*args[1:], *kwargs.values()) if a is not None]
    if (
        extra
        or not isinstance(edge_index, Tensor)
        or edge_index.dim() != 2
        or edge_index.shape[1] != batch.num_edges
    ):
        raise ValueError(
            f"the folded {type(self).__name__} was called with other inputs than the sampled "
            "subgraph (edge weights, attributes, a size or another edge_index); serve the model "
            "with --fold-first-layer off"
        )
    batch.used = True
    return _finish(self, batch)


def _message_passing():
    from torch_geometric.nn import MessagePassing

    return MessagePassing


def _install(module: nn.Module) -> None:
    """Route ``module``'s calls through :func:`_intercept` (once; a deep copy keeps it)."""
    if "forward" not in module.__dict__:
        module.forward = types.MethodType(_intercept, module)


def _installed(conv: nn.Module) -> list[nn.Module]:
    """The modules of a first layer whose ``forward`` a fold routes: the layer and, for a
    ``GINConv``, its MLP's first ``Linear``."""
    mods = [conv]
    if type(conv).__name__ == "GINConv":
        mods.append(_first_linear(conv.nn))
    return mods


def _finish(conv: nn.Module, batch: _Batch) -> Tensor:
    """The layer's output from its folded part: what follows the linear part, run in the
    layer's own (possibly bf16) parameters."""
    name = type(conv).__name__
    if name == "SAGEConv" and conv.normalize:
        return torch.nn.functional.normalize(batch.pre, p=2.0, dim=-1)
    if name == "GINConv":
        return conv.nn(batch.placeholder)  # its first Linear answers batch.pre
    return batch.pre


def _first_linear(mlp: nn.Module) -> nn.Module | None:
    """The ``Linear`` a GIN MLP applies first: itself, a ``Sequential``'s first module, or a
    PyG ``MLP``'s first ``lins``."""
    from torch_geometric.nn import MLP
    from torch_geometric.nn.dense.linear import Linear as PygLinear

    linear = (nn.Linear, PygLinear)
    if isinstance(mlp, linear):
        return mlp
    if isinstance(mlp, nn.Sequential) and len(mlp) and isinstance(mlp[0], linear):
        return mlp[0]
    if isinstance(mlp, MLP) and len(mlp.lins) and isinstance(mlp.lins[0], linear):
        return mlp.lins[0]
    return None


def _weight(lin: nn.Module) -> Tensor | None:
    w = getattr(lin, "weight", None)
    if w is None or isinstance(w, nn.parameter.UninitializedParameter):
        return None
    return w


def _layer_reason(conv: nn.Module) -> str | None:
    """None when ``conv``'s class and settings fold exactly, else why not (one line)."""
    import torch_geometric.nn as pyg

    name = type(conv).__name__
    if name not in FOLDABLE_LAYERS or type(conv) is not getattr(pyg, name):
        return (
            f"its first message-passing layer is a {name}, not one of {', '.join(FOLDABLE_LAYERS)}"
        )
    if getattr(conv, "flow", "source_to_target") != "source_to_target":
        return f"its first {name} has flow={conv.flow!r}"
    lins = {
        "SAGEConv": "lin_l",
        "GraphConv": "lin_rel",
        "GCNConv": "lin",
        "GATConv": "lin" if getattr(conv, "lin", None) is not None else "lin_src",
    }
    if name == "GINConv":
        lin = _first_linear(conv.nn)
        if lin is None:
            return "its first GINConv's MLP does not start with a Linear"
    else:
        lin = getattr(conv, lins[name])
    if _weight(lin) is None:
        return f"its first {name} is lazy (in_channels=-1) and has no weights yet"
    aggr = conv.aggr if isinstance(conv.aggr, str) else type(conv.aggr).__name__
    if name == "SAGEConv":
        if aggr not in ("mean", "add", "sum") or conv.project:
            return f"its first SAGEConv is not a plain mean or sum aggregation (aggr={aggr!r})"
    elif name in ("GraphConv", "GINConv") and aggr not in ("mean", "add", "sum"):
        return f"its first {name} aggregates with {aggr!r}, not a sum or mean"
    elif name == "GCNConv" and conv.cached:
        return "its first GCNConv has cached=True (one graph's normalisation for every batch)"
    elif name == "GATConv" and conv.lin_edge is not None:
        return "its first GATConv takes edge features (edge_dim)"
    return None


def _in_dim(conv: nn.Module) -> int:
    name = type(conv).__name__
    if name == "SAGEConv":
        return int(conv.lin_l.weight.shape[1])
    if name == "GraphConv":
        return int(conv.lin_rel.weight.shape[1])
    if name == "GINConv":
        return int(_first_linear(conv.nn).weight.shape[1])
    lin = conv.lin if getattr(conv, "lin", None) is not None else conv.lin_src
    return int(lin.weight.shape[1])


class _Recipe:
    """How one layer type folds: the node tables' columns (:meth:`project`) and the layer's
    linear part of a sampled subgraph from them (:meth:`aggregate`)."""

    def __init__(self, conv: nn.Module):
        self.name = type(conv).__name__
        self.conv = conv
        f32 = lambda t: None if t is None else t.detach().float().clone()  # noqa: E731
        c = conv
        if self.name in ("SAGEConv", "GraphConv"):
            left, right = (
                (c.lin_l, getattr(c, "lin_r", None))
                if self.name == "SAGEConv"
                else (c.lin_rel, c.lin_root)
            )
            root = self.name == "GraphConv" or c.root_weight
            ws = [left.weight] + ([right.weight] if root else [])
            self.weights = [f32(w) for w in ws]
            self.bias = f32(left.bias)
            self.mode = "mean" if c.aggr == "mean" else "sum"
            self.root_scale = 1.0
            self.out_dim = int(left.weight.shape[0])
        elif self.name == "GINConv":
            lin = _first_linear(c.nn)
            self.weights = [f32(lin.weight)]
            self.bias = f32(lin.bias)
            self.mode = "mean" if c.aggr == "mean" else "sum"
            self.root_scale = 1.0 + float(c.eps.detach())  # (1 + eps) x_i + sum_j x_j
            self.out_dim = int(lin.weight.shape[0])
        elif self.name == "GCNConv":
            self.weights = [f32(c.lin.weight)]
            self.bias = f32(c.bias)
            self.out_dim = int(c.lin.weight.shape[0])
        else:  # GATConv
            self.heads, self.channels = int(c.heads), int(c.out_channels)
            self.bias = f32(c.bias)
            self.out_dim = self.heads * self.channels if c.concat else self.channels
        self.widths = self._widths()

    def _widths(self) -> list[int]:
        if self.name != "GATConv":
            return [int(w.shape[0]) for w in self.weights]
        hc = self.heads * self.channels
        res = getattr(self.conv, "res", None)
        return [hc, 2 * self.heads] + ([self.out_dim] if res is not None else [])

    def project(self, rows: Tensor) -> list[Tensor]:
        """``(rows, w)`` for each table: the per-node linear maps of fp32 ``rows``."""
        if self.name != "GATConv":
            return [rows @ w.t() for w in self.weights]
        c = self.conv
        h, ch = self.heads, self.channels
        if c.lin is not None:  # as GATConv computes them, node by node
            x_src = x_dst = c.lin(rows).view(-1, h, ch)
        else:
            x_src, x_dst = c.lin_src(rows).view(-1, h, ch), c.lin_dst(rows).view(-1, h, ch)
        att = torch.cat([(x_src * c.att_src).sum(-1), (x_dst * c.att_dst).sum(-1)], 1)
        out = [x_src.reshape(-1, h * ch), att]
        if c.res is not None:
            out.append(c.res(rows))
        return out

    def aggregate(self, tables: list[Tensor], n_id: Tensor, edge_index: Tensor) -> Tensor:
        """The layer's linear part on the subgraph of ``n_id`` (``(S,)`` global ids; edges
        in local ids): ``(S, out_dim)`` fp32, as the unfolded layer computes it on rows
        ``X[n_id]``."""
        num_nodes = int(n_id.numel())
        if self.name in ("SAGEConv", "GraphConv", "GINConv"):
            h = _bags(tables[0], n_id, edge_index, num_nodes, self.mode)
            if len(tables) > 1:
                h += tables[1].index_select(0, n_id).float()
            elif self.name == "GINConv":
                h += self.root_scale * tables[0].index_select(0, n_id).float()
        elif self.name == "GCNConv":
            h = self._gcn(tables[0], n_id, edge_index, num_nodes)
        else:
            h = self._gat(tables, n_id, edge_index, num_nodes)
        if self.bias is not None:
            h += self.bias
        return h

    def _gcn(self, table, n_id, edge_index, num_nodes) -> Tensor:
        c = self.conv
        weight = None
        if c.normalize:  # the unfolded layer's gcn_norm, on the subgraph it sees
            from torch_geometric.nn.conv.gcn_conv import gcn_norm

            edge_index, weight = gcn_norm(
                edge_index, None, num_nodes, c.improved, c.add_self_loops, c.flow, torch.float32
            )
        return _bags(table, n_id, edge_index, num_nodes, "sum", weight)

    def _gat(self, tables, n_id, edge_index, num_nodes) -> Tensor:
        import torch.nn.functional as F
        from torch_geometric.utils import add_self_loops, remove_self_loops, softmax

        c = self.conv
        h, ch = self.heads, self.channels
        if c.add_self_loops:
            edge_index, _ = remove_self_loops(edge_index)
            edge_index, _ = add_self_loops(edge_index, num_nodes=num_nodes)
        src, dst = edge_index[0], edge_index[1]
        att = tables[1].index_select(0, n_id).float()  # (S, 2 heads): a_src.Wx, a_dst.Wx
        alpha = att[src, :h] + att[dst, h:]  # (E, heads)
        alpha = softmax(F.leaky_relu(alpha, c.negative_slope), dst, num_nodes=num_nodes)
        msg = tables[0].index_select(0, n_id[src]).float().view(-1, h, ch) * alpha.unsqueeze(-1)
        out = torch.zeros(num_nodes, h, ch).index_add_(0, dst, msg)  # (S, heads, C)
        out = out.view(num_nodes, h * ch) if c.concat else out.mean(dim=1)
        if len(tables) > 2:  # the residual map of the raw features
            out += tables[2].index_select(0, n_id).float()
        return out


def _bags(table, n_id, edge_index, num_nodes, mode, weight=None) -> Tensor:
    """Per target, the ``mode`` (``"sum"``/``"mean"``, ``weight``-ed) of its sources' rows of
    ``table``, read by global id; an empty bag gives 0 (as PyG's scatter does)."""
    src, dst = edge_index[0], edge_index[1]
    if dst.numel() > 1 and not bool((dst[1:] >= dst[:-1]).all()):
        order = torch.argsort(dst, stable=True)  # bags need edges grouped by target
        src, dst = src[order], dst[order]
        weight = weight[order] if weight is not None else None
    if weight is not None and table.dtype != torch.float32:  # bags weigh in the table's dtype
        rows = table.index_select(0, n_id[src]).float() * weight.unsqueeze(1)
        return torch.zeros(num_nodes, table.shape[1]).index_add_(0, dst, rows)
    deg = torch.bincount(dst, minlength=num_nodes)
    offsets = torch.zeros(num_nodes, dtype=torch.long)
    if num_nodes > 1:
        torch.cumsum(deg[:-1], 0, out=offsets[1:])
    h = torch.nn.functional.embedding_bag(
        n_id[src], table, offsets, mode=mode, per_sample_weights=weight
    )
    return h.float() if h.dtype != torch.float32 else h


def subgraph_edge_index(adjs) -> Tensor:
    """The sampled subgraph's edges as ``ServedModel`` hands them to a module: every hop's,
    innermost (the seeds' in-edges) first, in local ids."""
    hops = [a[0] for a in reversed(adjs)]
    return torch.cat(hops, dim=1) if hops else torch.empty(2, 0, dtype=torch.long)


class _FoldedTail(nn.Module):
    """The user's :class:`~quiver.usermodel.ServedModel` run on a folded batch: its module is
    called on a NaN placeholder of the raw features, which its first layer answers with the
    folded output (see :func:`_intercept`)."""

    def __init__(self, served: nn.Module, in_dim: int):
        super().__init__()
        self.served = served
        self.in_dim = in_dim
        self.has_embedding = bool(getattr(served, "has_embedding", True))

    def _run(self, call, pre: Tensor, adjs):
        # (S, F) of one NaN: no memory, and NaN wherever the module reads it
        placeholder = pre.new_full((1, 1), float("nan")).expand(pre.shape[0], self.in_dim)
        batch = _Batch(placeholder, pre, sum(int(a[0].shape[1]) for a in adjs))
        _ACTIVE.batch = batch
        try:
            out = call(placeholder, adjs)
        finally:
            _ACTIVE.batch = None
        if not batch.used:
            raise ValueError("the folded first layer was not called on the raw features")
        return out

    def forward(self, pre: Tensor, adjs) -> Tensor:
        return self._run(self.served, pre, adjs)

    def forward_all(self, pre: Tensor, adjs) -> tuple[Tensor, Tensor]:
        return self._run(self.served.forward_all, pre, adjs)


def _probe_sample(hops: int, batch: int = 2) -> tuple[int, list]:
    """``(num_nodes, adjs)`` of a small hop-ordered sample as the frontier sampler lays it out:
    each hop's targets get one or two new neighbours and an edge from node 0 (a self-loop of
    node 0 at the first hop; the outermost hop's nodes have no in-edges)."""
    num, frontier, adjs = batch, list(range(batch)), []
    for _ in range(hops):
        src, dst, new = [], [], []
        for i, t in enumerate(frontier):
            for _ in range(1 + i % 2):
                src.append(num)
                dst.append(t)
                new.append(num)
                num += 1
            src.append(0)
            dst.append(t)
        prev = adjs[0][2][0] if adjs else batch
        adjs.insert(0, (torch.tensor([src, dst]), None, (num, prev)))
        frontier = new
    return num, adjs


def _why_not_user(served: nn.Module) -> str | None:
    """None when a :class:`~quiver.usermodel.ServedModel`'s first layer folds, else why not."""
    if served.convention == "adjs":
        return "the model takes (x, adjs); folding needs a forward(x, edge_index)"
    if served.sequence_aggregation:
        return "it has an LSTM/GRU aggregation (its padded neighbour lists add a row to x)"
    if served.edge_features is not None:
        return "it takes edge attributes (edge_attr); the folded tables hold node rows only"
    layers = served._layers
    if not layers:
        return "no message-passing layer is visible in it (a torch.export program keeps no classes)"
    if len(layers) < 2:
        return "a one-layer model's embedding is the raw features"
    reason = _layer_reason(layers[0])
    if reason is not None:
        return reason
    if any(p.device.type != "cpu" for p in served.parameters()):
        return "the model is not on the CPU"
    return _probe(served, layers[0])


def _probe(served: nn.Module, conv: nn.Module) -> str | None:
    """Run the module unfolded and folded on a small random sample: None when the first
    message-passing layer to run is ``conv`` on the raw features and the answers agree."""
    name = type(conv).__name__
    num_nodes, adjs = _probe_sample(served.num_layers + served.extra_hops)
    x = torch.randn(num_nodes, _in_dim(conv), generator=torch.Generator().manual_seed(0))
    seen: list = []

    def first(layer, args, kwargs):
        if not seen:
            arg = args[0] if args else kwargs.get("x")
            seen.append((layer, arg is x))

    hooks = [m.register_forward_pre_hook(first, with_kwargs=True) for m in served._layers]
    try:
        with torch.inference_mode():
            want = served(x, adjs)
    except Exception as e:
        return f"it fails on a probe sample ({type(e).__name__}: {str(e)[:80]})"
    finally:
        for h in hooks:
            h.remove()
    if not seen or seen[0][0] is not conv:
        ran = type(seen[0][0]).__name__ if seen else "none"
        return f"its first message-passing layer to run is not its first {name} ({ran})"
    if not seen[0][1]:
        return f"its first {name} does not take the raw features (the model changes x first)"
    # the probe's fold leaves a module it does not serve as it was
    fresh = [m for m in _installed(conv) if "forward" not in m.__dict__]
    try:
        fold = FoldedFirstLayer(served, x, _check=False)
        with torch.inference_mode():
            pre, rest = fold.gather_layer(torch.arange(num_nodes), adjs)
            got = fold.tail(pre, rest)
    except Exception as e:
        return f"its folded {name} fails on a probe sample ({type(e).__name__}: {str(e)[:80]})"
    finally:
        for m in fresh:
            m.__dict__.pop("forward", None)
    scale = max(1.0, float(want.abs().max()))
    if not bool(torch.isfinite(got).all()) or float((got - want).abs().max()) > 1e-4 * scale:
        return f"the model reads its raw features outside its first {name}"
    return None


# ------------------------------------------------------------------------------ the decision


@dataclass
class FoldChoice:
    """What ``--fold-first-layer auto`` measured, stored in the dataset's manifest (one of the
    ``"fold"`` records) and reused as is by every later start on the same machine, weights,
    precision and fanouts, so a restart serves the same tables (the same logits) without
    measuring again; a decision for other weights (another checkpoint) is kept beside it.

    Attributes:
        folded: whether the folded path won.
        table: the winning tables' dtype (``"fp32"`` or ``"bf16"``); empty when not folded.
        summary: what the start-up line said (e.g. the measured speed-up).
        gather: the precision of the unfolded gather it was measured against.
        model: the precision of the model it was measured with.
        sizes: the sampled fanouts of the measured batches.
        model_id: the model (``quiver.precision.model_id``).
        weights: its weights (``quiver.precision.weights_id``).
        cpu_model: the machine (``quiver.precision.machine``): CPU model name,
        cpu_flags: its bf16-relevant flags
        cpu_cores: and the cores the measuring process could use.
        created: UTC timestamp.
    """

    folded: bool
    table: str = ""
    summary: str = ""
    gather: str = "fp32"
    model: str = "fp32"
    sizes: list = field(default_factory=list)
    model_id: str = ""
    weights: str = ""
    cpu_model: str = ""
    cpu_flags: list | None = None
    cpu_cores: int | None = None
    created: str = ""

    def key(self) -> tuple:
        """What a stored choice must match to be reused (beside the machine)."""
        return (
            self.gather,
            self.model,
            [int(k) for k in self.sizes],
            self.model_id,
            self.weights,
        )


def _stored_fold(d: dict) -> FoldChoice | None:
    try:
        return FoldChoice(**{k: v for k, v in d.items() if k in FoldChoice.__dataclass_fields__})
    except TypeError:
        return None


def read_fold(manifest: dict, want: FoldChoice) -> FoldChoice | None:
    """The newest stored ``"fold"`` decision measured on this machine for ``want``'s
    :meth:`FoldChoice.key`; else None (measure again)."""
    from quiver.precision import same_machine, stored_records

    for d in reversed(stored_records(manifest, "fold")):
        stored = _stored_fold(d)
        if stored is None or not same_machine(d) or stored.key() != want.key():
            continue
        if stored.folded and stored.table not in ("fp32", "bf16"):
            continue
        return stored
    return None


def write_fold(manifest_path, choice: FoldChoice) -> None:
    """Store ``choice`` among the ``"fold"`` records of a manifest.json (atomically), with this
    machine, in place of a record for the same key and machine (the others stay)."""
    from quiver.precision import machine, same_machine, update_records

    choice.created = choice.created or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    here = machine()

    def same(d: dict) -> bool:
        stored = _stored_fold(d)
        return stored is not None and same_machine(d, here) and stored.key() == choice.key()

    update_records(manifest_path, "fold", {**asdict(choice), **here}, same)
