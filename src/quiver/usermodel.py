"""Serve the user's own PyG model: load it, and adapt its forward to the engine's ``(x, adjs)``.

The engine calls ``model(x, adjs)`` for logits and ``model.forward_all(x, adjs)`` for
``(embedding, logits)``, with ``adjs`` as the sampler returns them (outermost hop first, see
``quiver.sampling.Adj``). :class:`ServedModel` gives any ``torch.nn.Module`` that interface, for
three input conventions:

* ``"edge_index"``: ``forward(x, edge_index)`` on the sampled subgraph, as PyG's
  ``NeighborLoader`` feeds it: nodes ordered by hop (seeds first), edges ordered by hop (the
  seeds' in-edges first). The sampler must then expand only each hop's new nodes
  (``frontier=True``); :attr:`ServedModel.frontier` says so. When ``forward`` accepts
  ``num_sampled_nodes_per_hop`` and ``num_sampled_edges_per_hop`` they are passed, so PyG's
  ``trim_to_layer`` (``torch_geometric.nn.models.basic_gnn``) drops at layer ``i`` the ``i``
  outermost hops, which no later layer needs.
* ``"subgraph"``: ``forward(x, edge_index)`` on one plain subgraph: the same sample, nodes and
  edges as ``"edge_index"`` (every node within the model's reach, relabelled, seeds first), but
  no per-hop counts, so every layer runs on the whole subgraph and the seeds' rows are taken
  from the output. For models whose layers must all see the same nodes: PyG's
  ``BasicGNN(jk='cat')`` (``GraphSAGE``, ``GCN``, ...) accepts the counts, but trimmed layers
  give its jumping-knowledge concatenation outputs of different lengths. Chosen by default
  for a module that accepts the counts and has a ``JumpingKnowledge`` submodule.
* ``"adjs"``: torch-quiver's and PyG's legacy ``forward(x, adjs)``, fed unchanged.

Degree-normalised layers (``GCNConv`` and its kin) weigh the edge ``u -> v`` by
``1 / sqrt(deg(u) deg(v))``, counted in the graph the layer sees. On a sampled subgraph the
outermost hop's nodes have no in-edges, so their degree would be 1 (the self-loop) whatever the
graph says. For such models one extra hop is sampled (:attr:`ServedModel.extra_hops`, at the
outermost fanout): every node whose degree enters a seed's output then has its sampled
in-edges. The normalisation of the sampled path is therefore the symmetric one with each
node's *sampled* in-degree (``min(deg, fanout)`` of its hop, plus the self-loop); with
all-neighbour fanouts (``-1``) that is the true degree, and the seeds' outputs equal the
module's on the full graph. ``ChebConv``'s Laplacian counts *out*-degrees (edge weights summed
by source): a node's out-edges into the next hop are in the sample only once that hop is
expanded, so it gets two extra hops (:data:`OUT_DEGREE_NORMALISED`), and its answers equal the
full graph's only where every out-neighbour is also an in-neighbour (a symmetric graph, as
ChebConv expects): an out-edge to a node that does not reach the seeds is never sampled.

Edge features: a module whose ``forward`` has an ``edge_attr`` parameter (``forward(x,
edge_index, edge_attr)``; PyG's ``GINEConv``, ``GATConv(edge_dim=...)``, ``TransformerConv``,
``NNConv``) gets the sampled edges' rows of the dataset's ``edge_features.npy`` once the server
hands them over (:meth:`ServedModel.use_edge_features`): ``edge_features[e_id]`` of every hop,
in the order of the ``edge_index`` it is given (``edge_index``/``subgraph``: one ``[E_s, D]``
tensor, innermost hop first; the phantom node's padding edges get zero rows). An ``"adjs"``
module gets ``edge_attr`` as a list of ``[E_h, D]`` tensors, one per hop, aligned with ``adjs``.
The rows are cast to the input's dtype and device. A required ``edge_attr`` without edge
features is refused by the server in one line; an optional one (``edge_attr=None``) is simply
not passed.

Multi-hop layers count their receptive field, one fanout per hop (:func:`layer_hops`):
``SGConv``/``SSGConv``/``TAGConv``/``APPNP`` ``K``, ``ChebConv`` ``K - 1``, ``MixHopConv``
``max(powers)``, ``ARMAConv`` ``num_layers``.

Embeddings (``output: "embedding"``) are the input of the last message-passing layer, caught by
a forward pre-hook on the last top-level ``MessagePassing`` module that runs, or the result of
the model's own ``embed`` method when it has one (called like ``forward``).

Loading (:func:`load_served_model`): a ``state_dict`` for the module a user factory builds
(``package.module:function``), a checkpoint that records its factory (:func:`save_model`, the
format ``quiver train-model`` writes too), a ``torch.export`` archive (``torch.export.save``),
or (only with ``trust_pickle=True``) a module pickled whole by ``torch.save(model)``. Every
problem is one ``ValueError``/``FileNotFoundError`` line naming the file or the option.

The checkpoint format, one for Quiver's own models and the user's: a ``torch.save``'d dict ::

    {
        "state_dict": module.state_dict(),
        "factory": "package.module:function",   # builds the module: function(**factory_kwargs)
        "factory_kwargs": {...},                # numbers, strings, bools, None, lists, dicts
        "fanouts": [15, 10, 5],                 # optional: the default sampling fanouts
        ...                                     # anything else (metrics, names) is ignored
    }

It loads with ``torch.load(weights_only=True)``: no pickled code. The factory it names is
imported and called, so a factory outside the ``quiver`` package runs only when the user names
it (``--model`` the same spec) or passes ``--trust-pickle``. The format before it (``{"config":
<quiver.models.ModelConfig fields>, "state_dict": ..., "fanouts": ...}``, ``quiver train-model``
until it wrote this one) still loads, as factory ``quiver.models:sampled_gnn`` with
``factory_kwargs = config``.
"""

from __future__ import annotations

import importlib
import inspect
import pickle
import sys
import warnings
import zipfile
from pathlib import Path

import torch
from torch import Tensor, nn

__all__ = [
    "CONVENTIONS",
    "DEGREE_NORMALISED",
    "K_HOP_LAYERS",
    "OUT_DEGREE_NORMALISED",
    "ServedModel",
    "export_layers",
    "graph_is_symmetric",
    "import_factory",
    "layer_hops",
    "load_served_model",
    "message_passing_layers",
    "save_model",
]

CONVENTIONS = ("edge_index", "subgraph", "adjs")

#: ``torch_geometric.nn`` layers that normalise by degrees counted in the graph they see
#: (``gcn_norm``); with ``normalize=False`` (where the layer has the flag) they do not.
DEGREE_NORMALISED = (
    "GCNConv",
    "SGConv",
    "SSGConv",
    "TAGConv",
    "GCN2Conv",
    "APPNP",
    "ARMAConv",
    "ChebConv",
    "ClusterGCNConv",
    "LGConv",
    "FAConv",
    "MixHopConv",
)

#: degree-normalised layers that count *out*-degrees (``get_laplacian`` sums edge weights by
#: source): the sample gets two extra hops for them, and their answers equal the full graph's
#: only on a symmetric graph (an out-edge to a node that does not reach the seeds is never
#: sampled)
OUT_DEGREE_NORMALISED = ("ChebConv",)

#: ``torch_geometric.nn`` layers that propagate ``K`` hops in one module (``S^K x``, a sum of
#: ``S^k x``, or ``K`` personalised-PageRank steps): each needs ``K`` fanouts, not one
K_HOP_LAYERS = ("SGConv", "SSGConv", "TAGConv", "APPNP")

#: ``torch_geometric.nn.aggr`` aggregations that read a target's neighbours as a sequence,
#: zero-padded to the longest one in the graph the layer sees (``to_dense_batch``), and keep the
#: last step: their answer depends on the neighbours' order and on that padded length
SEQUENCE_AGGREGATIONS = ("LSTMAggregation", "GRUAggregation")

_COUNT_KWARGS = ("num_sampled_nodes_per_hop", "num_sampled_edges_per_hop")


#: what a file ``torch.load`` reads starts with: a zip archive (``torch.save``), or a pickle
#: (protocol 2+, torch's legacy format)
_CHECKPOINT_MAGIC = (b"PK\x03\x04", b"\x80")


def _check_checkpoint_bytes(path: Path) -> None:
    """``ValueError`` in one line when ``path`` cannot be a checkpoint ``torch.load`` reads (a
    text file, an empty one, other bytes), before torch's own advice (e.g. to retry with
    ``weights_only=False``) can mislead."""
    with open(path, "rb") as f:
        head = f.read(256)
    if head.startswith(_CHECKPOINT_MAGIC):
        return
    expected = "expected a file written by torch.save (a zip archive) or torch.export.save"
    if not head:
        what = "the file is empty"
    else:
        try:
            text = head.decode("utf-8")
        except UnicodeDecodeError as e:  # a character cut at the end of the read is fine
            text = head[: e.start].decode("utf-8") if e.start >= len(head) - 3 else None
        if text is not None and all(c.isprintable() or c in "\t\r\n" for c in text):
            first = text.strip().splitlines()[0] if text.strip() else ""
            what = f"it is a text file (starting {first[:40]!r})"
        else:
            what = f"it starts with the bytes {head[:8]!r}"
    raise ValueError(f"--checkpoint {path} is not a PyTorch checkpoint: {what}; {expected}")


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def heterogeneous_parts(module: nn.Module) -> str | None:
    """What marks ``module`` as a heterogeneous-graph model (``HeteroConv`` layers, relation
    layers ``to_hetero`` made, a ``forward(x_dict, edge_index_dict)``), or None."""
    inner = getattr(module, "module", module)
    try:
        from torch_geometric.nn import HeteroConv, MessagePassing
    except ImportError:  # pragma: no cover - torch_geometric is a dependency
        return None
    for m in inner.modules():
        if isinstance(m, HeteroConv):
            return "HeteroConv layers"
        if (
            isinstance(m, nn.ModuleDict)
            and len(m)
            and all(isinstance(c, MessagePassing) for c in m.values())
            and all("__" in k for k in m.keys())
        ):
            return "one layer per relation (to_hetero)"
    try:
        params = inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        return None
    if "x_dict" in params or "edge_index_dict" in params:
        return "forward(x_dict, edge_index_dict)"
    return None


def message_passing_layers(module: nn.Module) -> list[nn.Module]:
    """The top-level ``MessagePassing`` modules of ``module`` (none nested in another)."""
    try:
        from torch_geometric.nn import MessagePassing
    except ImportError:  # pragma: no cover - torch_geometric is a dependency
        return []
    found: list[nn.Module] = []

    def walk(m: nn.Module):
        for child in m.children():
            if isinstance(child, MessagePassing):
                found.append(child)
            else:
                walk(child)

    if isinstance(module, MessagePassing):
        return [module]
    walk(module)
    return found


def layer_hops(layer: nn.Module) -> int:
    """The hops one message-passing layer propagates (its receptive field), read from PyG's
    ``forward``: ``K`` for :data:`K_HOP_LAYERS`; ``K - 1`` for ``ChebConv`` (its Chebyshev
    polynomial of order ``K - 1`` in the scaled Laplacian: ``K - 1`` propagations);
    ``max(powers)`` for ``MixHopConv`` (``A^p x`` for each power ``p``); ``num_layers`` for
    ``ARMAConv`` (``num_layers`` propagations per stack, each adding a root term of the input);
    else 1."""
    name = type(layer).__name__
    if name in K_HOP_LAYERS:
        return max(int(getattr(layer, "K", 1)), 0)
    if name == "ChebConv" and hasattr(layer, "lins"):
        return max(len(layer.lins) - 1, 0)
    if name == "MixHopConv" and getattr(layer, "powers", None):
        return max(int(p) for p in layer.powers)
    if name == "ARMAConv" and hasattr(layer, "num_layers"):
        return int(layer.num_layers)
    return 1


def graph_is_symmetric(topo) -> bool:
    """Whether every edge ``u -> v`` of a ``CSRTopo`` has its reverse ``v -> u`` (as often):
    where an :data:`OUT_DEGREE_NORMALISED` layer's sampled out-degrees are the true ones."""
    n = int(topo.node_count)
    dst = torch.repeat_interleave(torch.arange(n), torch.as_tensor(topo.degree))
    src = torch.as_tensor(topo.indices).long()
    forward = torch.sort(src * n + dst).values
    backward = torch.sort(dst * n + src).values
    return bool(torch.equal(forward, backward))


def _hop_setting(layer: nn.Module) -> str:
    """The setting that makes a layer propagate other than one hop, for messages."""
    name = type(layer).__name__
    if name == "ChebConv":
        return f"ChebConv K={len(layer.lins)}: {layer_hops(layer)} hops"
    if name == "MixHopConv":
        return f"MixHopConv powers {list(layer.powers)}: {layer_hops(layer)} hops"
    if name == "ARMAConv":
        return f"ARMAConv num_layers={layer.num_layers}: {layer_hops(layer)} hops"
    return f"{name} K={layer_hops(layer)}"


def _hop_detail(layers: list[nn.Module]) -> str:
    """``"SGConv K=2"``-style names of the layers propagating other than one hop."""
    return ", ".join(_hop_setting(m) for m in layers if layer_hops(m) != 1)


def _needs_degrees(module: nn.Module) -> bool:
    for m in module.modules():
        if type(m).__name__ in DEGREE_NORMALISED and getattr(m, "normalize", True):
            return True
    return False


def _degree_hops(module: nn.Module) -> int:
    """Hops to sample beyond the model's for its degree normalisation: 0 without one; 2 with
    a :data:`OUT_DEGREE_NORMALISED` layer (a node's out-edges into the next hop exist in the
    sample only once that hop is expanded); else 1."""
    if not _needs_degrees(module):
        return 0
    return 2 if any(type(m).__name__ in OUT_DEGREE_NORMALISED for m in module.modules()) else 1


def _has_sequence_aggregation(module: nn.Module) -> bool:
    return any(type(m).__name__ in SEQUENCE_AGGREGATIONS for m in module.modules())


def _convention_of(module: nn.Module) -> str:
    """``"adjs"`` when ``forward``'s second parameter is named like a list of hops;
    ``"subgraph"`` when it takes the per-hop counts but has a ``JumpingKnowledge`` (whose
    layers' outputs must cover the same nodes); else ``"edge_index"``."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return "edge_index"
    if len(params) >= 2 and params[1].name in ("adjs", "adj", "blocks", "adjs_t"):
        return "adjs"
    if _accepts_counts(module) and any(
        type(m).__name__ == "JumpingKnowledge" for m in module.modules()
    ):
        return "subgraph"
    return "edge_index"


def _edge_attr_param(module: nn.Module) -> tuple[bool, bool]:
    """``(takes, requires)``: whether ``forward`` has an ``edge_attr`` parameter, and whether
    it has no default."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False, False
    p = params.get("edge_attr")
    if p is None:
        return False, False
    return True, p.default is inspect.Parameter.empty


def _edge_widths(module: nn.Module) -> list[tuple[str, int]]:
    """``(layer class, edge feature width)`` of the layers that show theirs: ``edge_dim``
    (``GATConv``, ``TransformerConv``, ...), or ``GINEConv``'s edge ``Linear``."""
    out = []
    for m in module.modules():
        dim = getattr(m, "edge_dim", None)
        if dim is None and type(m).__name__ == "GINEConv" and getattr(m, "lin", None) is not None:
            dim = getattr(m.lin, "in_channels", None)
        if isinstance(dim, int) and dim > 0:
            out.append((type(m).__name__, dim))
    return out


class _EdgeTable:
    """The dataset's ``[E_in, D]`` edge features (often a memory map), shared, never copied:
    ``copy.deepcopy`` of a model (bf16 weights, see ``quiver.precision``) keeps the same table."""

    def __init__(self, table: Tensor):
        self.table = table

    def __deepcopy__(self, memo):
        return self

    def gather(self, e_id: Tensor, like: Tensor) -> Tensor:
        """``(len(e_id), D)`` rows of the edges ``e_id``, in ``like``'s float dtype and device."""
        rows = self.table[e_id.cpu()]
        dtype = like.dtype if like.dtype.is_floating_point else torch.float32
        return rows.to(device=like.device, dtype=dtype)


def _accepts_counts(module: nn.Module) -> bool:
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return all(k in params for k in _COUNT_KWARGS)


class ServedModel(nn.Module):
    """Give a PyG module the engine's ``forward(x, adjs)`` / ``forward_all(x, adjs)``.

    Args:
        module: the user's ``nn.Module`` (or a ``torch.export`` program's ``.module()``).
        convention: ``"edge_index"`` (``forward(x, edge_index)`` on the hop-ordered sample,
            with the per-hop counts when it takes them), ``"subgraph"`` (``forward(x,
            edge_index)`` on one plain subgraph, no counts) or ``"adjs"`` (``forward(x,
            adjs)``); default: ``"adjs"`` when ``forward``'s second parameter is called
            ``adjs``, ``"subgraph"`` for a module that takes the counts and has a
            ``JumpingKnowledge``, else ``"edge_index"``.
        extra_hops: hops sampled beyond the model's layers (``edge_index``/``subgraph``
            only); default 1 for models with a degree-normalised layer (2 with a ``ChebConv``;
            see the module docstring), else 0.
        pass_counts: pass ``num_sampled_nodes_per_hop``/``num_sampled_edges_per_hop`` (default:
            when ``forward`` accepts both; ``edge_index`` only).
        embeddable: whether embeddings can be served (default: the model has ``embed`` or a
            ``MessagePassing`` layer); when False, :attr:`has_embedding` is False and the
            engine refuses ``output: "embedding"`` with a 422.
        num_layers: the hops ``module`` propagates, when its submodules do not show them (a
            ``torch.export`` program's, see :func:`export_layers`); default: its top-level
            ``MessagePassing`` modules, a multi-hop one counting its hops (:func:`layer_hops`).
        source: a short description for messages (e.g. the factory spec).

    Attributes:
        frontier: the sampler must expand only each hop's new nodes (``edge_index``,
            ``subgraph``).
        num_layers: the hops the model propagates, one fanout each (0 when unknown): one per
            top-level message-passing layer, a multi-hop one its :func:`layer_hops`.
        out_degrees: its degree normalisation counts out-degrees
            (:data:`OUT_DEGREE_NORMALISED`, sampled with two extra hops): its answers equal the
            full graph's only on a symmetric graph (see :func:`graph_is_symmetric`).
        hop_detail: the layers counted other than one hop (``"SGConv K=2"``, ``"ChebConv
            K=3: 2 hops"``), for messages.
        sequence_aggregation: the module has an LSTM or GRU aggregation
            (:data:`SEQUENCE_AGGREGATIONS`) and takes ``edge_index``: it reads each target's
            neighbours as a sequence padded to the longest in the subgraph, so the same node's
            answer would depend on which nodes share its batch.
        pad_neighbours: for such a module, the sequence length every batch is padded to (0:
            none). The server sets it to the longest neighbour list a sample can hold (the
            graph's largest in-degree, capped by the largest fanout), so a node's answer does
            not depend on its batch, and with all-neighbour fanouts equals the module's on the
            full graph (where PyG pads to the largest in-degree too). It is done with one
            phantom node after the sampled ones, with that many in-edges from itself (its row
            feeds no other node); the per-hop counts are then not passed.
    """

    def __init__(
        self,
        module: nn.Module,
        convention: str | None = None,
        extra_hops: int | None = None,
        pass_counts: bool | None = None,
        embeddable: bool | None = None,
        num_layers: int | None = None,
        source: str = "",
    ):
        super().__init__()
        convention = convention or _convention_of(module)
        if convention not in CONVENTIONS:
            raise ValueError(
                f"model input convention must be one of {CONVENTIONS}, got {convention!r}"
            )
        self.module = module
        self.convention = convention
        self.source = source or type(module).__name__
        self.frontier = convention in ("edge_index", "subgraph")
        if extra_hops is None:
            extra_hops = _degree_hops(module) if self.frontier else 0
        if extra_hops and not self.frontier:
            raise ValueError("extra hops need the edge_index or subgraph convention")
        self.extra_hops = int(extra_hops)
        self.out_degrees = self.extra_hops >= 2 and any(
            type(m).__name__ in OUT_DEGREE_NORMALISED for m in module.modules()
        )
        self.pass_counts = (
            _accepts_counts(module) if pass_counts is None else bool(pass_counts)
        ) and convention == "edge_index"
        self.sequence_aggregation = self.frontier and _has_sequence_aggregation(module)
        self.pad_neighbours = 0
        self.takes_edge_attr, self.needs_edge_attr = _edge_attr_param(module)
        self._edges: _EdgeTable | None = None
        self._layers = message_passing_layers(module)
        if num_layers is None:
            self.num_layers = sum(layer_hops(m) for m in self._layers)
            self.hop_detail = _hop_detail(self._layers)
        else:
            self.num_layers, self.hop_detail = int(num_layers), ""
        self._embed = getattr(module, "embed", None)
        if not callable(self._embed):
            self._embed = None
        if embeddable is None:
            embeddable = self._embed is not None or bool(self._layers)
        self.has_embedding = bool(embeddable)
        self._catch = False
        self._caught: Tensor | None = None
        for layer in self._layers:
            layer.register_forward_pre_hook(self._catch_input, with_kwargs=True)

    def use_edge_features(self, table: Tensor | None) -> None:
        """Pass ``table[e_id]`` of the sampled edges as ``edge_attr`` (see the module docstring).

        Args:
            table: ``[E_in, D]`` edge features indexed by the sampler's edge ids (the input
                order of the edge list, ``CSRTopo.eid``), or None to pass none.

        Raises:
            ValueError: the module's forward takes no ``edge_attr``, ``table`` is not 2-D, or a
                layer's ``edge_dim`` is not ``table``'s width.
        """
        if table is None:
            self._edges = None
            return
        if not self.takes_edge_attr:
            raise ValueError(f"{self.source}: its forward takes no edge_attr")
        if table.dim() != 2:
            raise ValueError(f"edge features must be [E, D], got shape {list(table.shape)}")
        for name, dim in _edge_widths(self.module):
            if dim != table.shape[1]:
                raise ValueError(
                    f"{self.source}: its {name} takes {dim} edge features (edge_dim) but the "
                    f"dataset's edge_features.npy has {table.shape[1]} per edge"
                )
        self._edges = _EdgeTable(table)

    @property
    def edge_features(self) -> Tensor | None:
        """The ``[E_in, D]`` edge feature table the rows are gathered from, or None."""
        return None if self._edges is None else self._edges.table

    def _edge_attr(self, x: Tensor, adjs) -> list[Tensor] | None:
        """Per hop (``adjs``' order) the sampled edges' feature rows, or None."""
        if self._edges is None:
            if self.needs_edge_attr:
                raise ValueError(
                    f"{self.source}: its forward needs edge_attr, but the dataset has no edge "
                    "features (edge_features.npy)"
                )
            return None
        return [self._edges.gather(a[1], x) for a in adjs]

    def _catch_input(self, layer, args, kwargs):
        if self._catch:
            x = args[0] if args else kwargs.get("x")
            if isinstance(x, (tuple, list)):  # bipartite (x_src, x_dst): the targets' rows
                x = x[1] if x[1] is not None else x[0]
            self._caught = x
        return None

    def train(self, mode: bool = True) -> ServedModel:
        """``nn.Module.train``; a ``torch.export`` module (no train/eval switch) is left as is."""
        self.training = mode
        try:
            self.module.train(mode)
        except NotImplementedError:  # torch.export's module: its mode was fixed when exported
            pass
        return self

    # ---- inputs ------------------------------------------------------------------------------
    def _inputs(self, x: Tensor, adjs) -> tuple[tuple, dict, int]:
        """``(args, kwargs, batch_size)`` for the module's forward."""
        batch_size = int(adjs[-1][2][1]) if adjs else x.shape[0]
        per_hop = self._edge_attr(x, adjs) if self.takes_edge_attr else None
        if self.convention == "adjs":
            return (x, adjs), ({} if per_hop is None else {"edge_attr": per_hop}), batch_size
        hops = list(reversed(adjs))  # innermost (the seeds' in-edges) first, as NeighborLoader
        edge_index = (
            torch.cat([h[0] for h in hops], dim=1)
            if hops
            else torch.empty(2, 0, dtype=torch.long, device=x.device)
        )
        kwargs = {}
        if per_hop is not None:
            dim = self._edges.table.shape[1]
            kwargs["edge_attr"] = (
                torch.cat(per_hop[::-1]) if per_hop else x.new_zeros(0, dim)
            )  # (E_s, D), in edge_index's order
        if self.pad_neighbours:
            # a phantom node after the sampled ones with pad_neighbours in-edges from itself:
            # every sequence aggregation pads to that length, whatever the batch; its edges come
            # last and its id is the largest, so the edges stay sorted by target
            p = x.shape[0]
            x = torch.cat([x, x.new_zeros(1, x.shape[1])])
            loop = torch.full((2, self.pad_neighbours), p, dtype=torch.long, device=x.device)
            if "edge_attr" in kwargs:
                ea = kwargs["edge_attr"]
                pad = ea.new_zeros(self.pad_neighbours, ea.shape[1])
                kwargs["edge_attr"] = torch.cat([ea, pad])
            return (x, torch.cat([edge_index, loop], dim=1)), kwargs, batch_size
        if self.pass_counts:
            totals = [batch_size] + [int(h[2][0]) for h in hops]
            kwargs["num_sampled_nodes_per_hop"] = [totals[0]] + [
                b - a for a, b in zip(totals[:-1], totals[1:])
            ]
            kwargs["num_sampled_edges_per_hop"] = [int(h[0].shape[1]) for h in hops]
        return (x, edge_index), kwargs, batch_size

    # ---- engine interface --------------------------------------------------------------------
    def forward(self, x: Tensor, adjs) -> Tensor:
        """Logits of the seeds: ``(batch_size, out_dim)``."""
        args, kwargs, batch_size = self._inputs(x, adjs)
        return self.module(*args, **kwargs)[:batch_size]

    def forward_all(self, x: Tensor, adjs) -> tuple[Tensor, Tensor]:
        """``(embedding (B, hidden), logits (B, out_dim))`` of the seeds."""
        if not self.has_embedding:
            raise ValueError(f"{self.source} cannot give embeddings (no embed method, no layers)")
        args, kwargs, batch_size = self._inputs(x, adjs)
        if self._embed is not None:
            emb = self._embed(*args, **kwargs)
            return emb[:batch_size], self.module(*args, **kwargs)[:batch_size]
        self._catch, self._caught = True, None
        try:
            logits = self.module(*args, **kwargs)
        finally:
            self._catch = False
        emb, self._caught = self._caught, None
        if emb is None:
            raise ValueError(f"{self.source}: no message-passing layer ran, so no embedding")
        return emb[:batch_size], logits[:batch_size]


# ---- loading ---------------------------------------------------------------------------------
def import_factory(spec: str):
    """The callable named by ``package.module:function`` (the current directory importable)."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"--model must look like package.module:function, got {spec!r}")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:
        raise ValueError(f"--model {spec}: cannot import {mod_name} ({_one_line(e)})") from None
    obj = mod
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"--model {spec}: module {mod_name} has no attribute {attr!r}")
    if not callable(obj):
        raise ValueError(f"--model {spec}: {attr} is not callable")
    return obj


def _build(spec: str, kwargs: dict | None = None, origin: str | None = None) -> nn.Module:
    """``factory(**kwargs)`` for ``spec``; ``origin`` names where the spec came from."""
    origin = origin or f"--model {spec}"
    factory = import_factory(spec)
    try:
        module = factory(**(kwargs or {}))
    except Exception as e:
        how = f" with factory_kwargs {sorted(kwargs)}" if kwargs else ""
        raise ValueError(f"{origin}: calling the factory{how} failed ({_one_line(e)})") from None
    if not isinstance(module, nn.Module):
        raise ValueError(
            f"{origin}: the factory returned {type(module).__name__}, not a torch.nn.Module"
        )
    return module


_PLAIN = (str, int, float, bool, type(None))

#: the factory of Quiver's own GNN (``quiver.models.sampled_gnn``), which ``quiver
#: train-model`` checkpoints record; named here, below ``quiver.models``, which imports it
QUIVER_GNN_FACTORY = "quiver.models:sampled_gnn"
#: factories a checkpoint may name and have called without ``--model`` or ``--trust-pickle``
_TRUSTED_FACTORIES = (QUIVER_GNN_FACTORY,)


def _is_plain(v) -> bool:
    if isinstance(v, _PLAIN):
        return True
    if isinstance(v, (list, tuple)):
        return all(_is_plain(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _is_plain(x) for k, x in v.items())
    return False


def save_model(
    path,
    module: nn.Module,
    factory: str,
    factory_kwargs: dict | None = None,
    fanouts=None,
    extra: dict | None = None,
) -> None:
    """Save ``module`` in the checkpoint format ``quiver serve`` loads (see the module docstring).

    Written atomically (a temporary file, then a rename).

    Args:
        path: the file to write.
        module: the trained module; its ``state_dict()`` is saved.
        factory: ``package.module:function`` that builds an untrained ``module`` from
            ``factory_kwargs``; it must be importable where the checkpoint is served.
        factory_kwargs: keyword arguments for the factory: numbers, strings, booleans, None,
            lists and dicts only, so the file loads without unpickling code (default none).
        fanouts: default sampling fanouts, one per message-passing layer (default: none; the
            server then takes ``--fanouts`` or the dataset manifest's).
        extra: more entries to store (metrics, a dataset name); ignored when serving.

    Raises:
        ValueError: a malformed ``factory`` or ``factory_kwargs`` that are not plain data.
    """
    import os

    mod_name, sep, attr = str(factory).partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"factory must look like package.module:function, got {factory!r}")
    kwargs = dict(factory_kwargs or {})
    if not _is_plain(kwargs):
        raise ValueError(
            "factory_kwargs must hold only numbers, strings, booleans, None, lists and dicts "
            f"(got {sorted(kwargs)})"
        )
    ckpt = {
        **(extra or {}),
        "factory": factory,
        "factory_kwargs": kwargs,
        "state_dict": module.state_dict(),
    }
    if fanouts:
        ckpt["fanouts"] = [int(k) for k in fanouts]
    tmp = f"{path}.tmp"
    torch.save(ckpt, tmp)
    os.replace(tmp, path)


def _fit_state_dict(module: nn.Module, state: dict, path: str, what: str) -> None:
    """``load_state_dict(strict=True)``, with a one-line account of what does not fit."""
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k} {list(state[k].shape)} vs {list(own[k].shape)}"
        for k in own
        if k in state and isinstance(state[k], Tensor) and state[k].shape != own[k].shape
    ]

    def few(items):
        return ", ".join(items[:3]) + (f" (+{len(items) - 3} more)" if len(items) > 3 else "")

    parts = []
    if missing:
        parts.append(f"missing keys {few(missing)}")
    if unexpected:
        parts.append(f"unexpected keys {few(unexpected)}")
    if shapes:
        parts.append(f"shape mismatch (checkpoint vs module) {few(shapes)}")
    if parts:
        raise ValueError(f"--checkpoint {path} does not fit {what}: " + "; ".join(parts))
    try:
        module.load_state_dict(state)
    except Exception as e:
        raise ValueError(f"--checkpoint {path}: load_state_dict failed ({_one_line(e)})") from None


_ZIP_MAGIC = b"PK\x03\x04"


def _is_legacy_torch_file(path: Path) -> bool:
    """Whether ``path`` starts like ``torch.save``'s pre-zip format: a pickled magic number.

    Read with ``pickletools.genops``, which parses opcodes without running any.
    """
    import io
    import pickletools

    with open(path, "rb") as f:
        head = f.read(64)
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(head)):
            if op.name == "STOP":
                return False
            if isinstance(arg, int) and arg == torch.serialization.MAGIC_NUMBER:
                return True
    except Exception:  # not a pickle, or the first one is longer than the head
        return False
    return False


def _check_readable(path: Path) -> None:
    """One-line ``ValueError`` for a file no checkpoint loader can read, before any unpickling.

    ``torch.save`` and ``torch.export.save`` write zip archives whose members carry CRC-32
    checksums that ``torch.load`` never verifies: a damaged file would otherwise load with wrong
    weights, or fail deep in the unpickler with a message that blames its contents (e.g. a
    flipped bit in a class name reads as "pickled Python objects"). A pickle file that
    ``torch.save`` did not write (no magic number first) is refused before ``torch.load``, whose
    weights-only loader would warn about its protocol and then fail at length.
    """
    if path.stat().st_size == 0:
        raise ValueError(f"--checkpoint {path} is empty: not a PyTorch checkpoint")
    with open(path, "rb") as f:
        head = f.read(4)
    if head == _ZIP_MAGIC or zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as z:
                bad = z.testzip()
        except Exception as e:  # no central directory (truncated), bad headers, bad names
            raise ValueError(
                f"--checkpoint {path} is truncated or corrupted: not a PyTorch checkpoint Quiver "
                f"can read (its zip archive: {_one_line(e)}); save or copy it again"
            ) from None
        if bad is not None:
            raise ValueError(
                f"--checkpoint {path} is corrupted: its member {bad} fails its CRC-32 check (the "
                "file changed after it was written); save or copy it again"
            )
        return
    if head[:1] == b"\x80" and not _is_legacy_torch_file(path):  # pickle protocol 2+
        raise ValueError(
            f"--checkpoint {path} is not a model checkpoint Quiver can load: a pickle file that "
            "torch.save did not write (save model.state_dict() with torch.save and pass --model)"
        )


def _is_export_archive(path: Path) -> bool:
    """A ``torch.export.save`` archive: a zip without the ``data.pkl`` of ``torch.save``."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
    return not any(n.endswith("data.pkl") for n in names) and any(
        n.endswith(".json") for n in names
    )


def _is_state_dict(obj) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(v, Tensor) for v in obj.values())


def _type_name(t) -> str:
    """``package.module.Class`` of an ``nn_module_stack`` entry's type (a name or a class)."""
    if isinstance(t, type):
        return f"{t.__module__}.{t.__qualname__}"
    return str(t)


def _is_message_passing(type_name: str) -> bool:
    """Whether ``type_name`` names a ``MessagePassing`` class already imported (none is)."""
    try:
        from torch_geometric.nn import MessagePassing
    except ImportError:  # pragma: no cover - torch_geometric is a dependency
        return False
    mod_name, _, cls_name = type_name.rpartition(".")
    cls = getattr(sys.modules.get(mod_name), cls_name, None)
    return isinstance(cls, type) and issubclass(cls, MessagePassing)


def export_layers(program) -> tuple[int, bool]:
    """``(message-passing layers, whether one normalises by degree)`` of a torch.export program.

    ``program.module()`` keeps only the parameters' module paths, not the classes, so neither
    :func:`message_passing_layers` nor the degree check sees a layer in it; the program's
    nodes record the modules they were traced in (``nn_module_stack``: path and class name).
    A module is a message-passing layer when its class is a ``MessagePassing`` (looked up
    among the modules already imported; nothing is imported) or it ran an ``aggr_module``
    (what ``MessagePassing.propagate`` calls); the layers counted are those inside no other.
    A layer of a :data:`DEGREE_NORMALISED` class normalises unless every operation traced in
    it has a stack trace and none of them comes from a ``*norm`` call (``normalize=False``;
    ``ChebConv``'s is ``__norm__``).
    A layer counts one hop per call of its aggregation, so ``SGConv(K=2)`` counts 2.

    Returns ``(hops, degrees)``: the hops of all layers (one fanout each); ``(0, False)`` when
    the program shows no message-passing layer.
    """
    hops, degrees, _ = _export_hops(program)
    return sum(hops.values()), bool(degrees)


def _export_hops(program) -> tuple[dict[str, int], int, str]:
    """``({top-level layer path: hops}, degree hops, detail)`` of a torch.export program (see
    :func:`export_layers`): ``degree hops`` are the extra hops its degree normalisation needs
    (0, 1, or 2 for a ChebConv); ``detail`` names the layers counted other than one hop."""
    types: dict[str, str] = {}
    traces: dict[str, list] = {}
    calls: dict[str, set] = {}  # module path -> its calls' stack keys ("c.aggr_module@1": 2nd)
    for node in program.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        trace = node.meta.get("stack_trace")
        for key, (path, t) in stack.items():
            path = str(path)
            types.setdefault(path, _type_name(t))
            traces.setdefault(path, []).append(trace)
            calls.setdefault(path, set()).add(key)
    layers = {
        path
        for path, t in types.items()
        if _is_message_passing(t) or (f"{path}.aggr_module" if path else "aggr_module") in types
    }

    def inside_another(path: str) -> bool:  # the root module's path is ""
        if not path:
            return False
        parts = path.split(".")
        return any(".".join(parts[:i]) in layers for i in range(len(parts)))

    top = sorted(p for p in layers if not inside_another(p))
    degrees = 0  # the extra hops their degree normalisation needs (see _degree_hops)
    for path in top:
        cls = types[path].rpartition(".")[2]
        if cls not in DEGREE_NORMALISED:
            continue
        seen = traces.get(path, [])
        traced = bool(seen) and all(seen)
        if not traced or any("norm(" in t or "norm__(" in t for t in seen):  # ChebConv: __norm__
            degrees = max(degrees, 2 if cls in OUT_DEGREE_NORMALISED else 1)
    # one hop per propagation: a K-hop layer (SGConv, TAGConv, APPNP) calls its aggregation K
    # times, each call a stack key of its own
    hops = {p: max(1, len(calls.get(f"{p}.aggr_module" if p else "aggr_module", ()))) for p in top}

    def named(p: str, k: int) -> str:
        cls = types[p].rpartition(".")[2]
        return f"{cls} K={k}" if cls in K_HOP_LAYERS else f"{cls} {k} hops"

    detail = ", ".join(named(p, k) for p, k in sorted(hops.items()) if k != 1)
    return hops, degrees, detail


def load_served_model(
    checkpoint,
    model: str | None = None,
    trust_pickle: bool = False,
    convention: str | None = None,
    map_location="cpu",
) -> tuple[nn.Module, dict]:
    """Load what ``quiver serve --checkpoint FILE [--model SPEC]`` names, ready for the engine.

    Args:
        checkpoint: a ``state_dict`` file (with ``model``), a checkpoint recording its
            factory (:func:`save_model`; ``quiver train-model`` writes these, and its older
            ``config`` checkpoints load too), a ``torch.export`` archive, or a whole pickled
            module (with ``trust_pickle``).
        model: ``package.module:function`` building the module the ``state_dict`` is for
            (called with no arguments, or with the checkpoint's ``factory_kwargs`` when the
            checkpoint records this same factory; the current directory is importable).
        trust_pickle: allow unpickling arbitrary objects, and calling a factory that a
            checkpoint names outside Quiver without ``model`` (both run code the file chose).
        convention: ``"edge_index"``, ``"subgraph"`` or ``"adjs"`` (default: from
            ``forward``'s signature, see :class:`ServedModel`; ``torch.export`` archives are
            ``edge_index``).
        map_location: ``torch.load``'s.

    Returns:
        ``(model, info)``: the model has ``forward(x, adjs)`` and ``forward_all(x, adjs)``
        (a :class:`ServedModel`, or a Quiver ``SampledGNN``); ``info`` holds ``kind`` (a
        description), ``fanouts`` (the checkpoint's, or None) and ``frontier``/``extra_hops``
        (how to sample for it).

    Raises:
        FileNotFoundError: the checkpoint does not exist.
        ValueError: anything else that is wrong, in one line naming the file or option.
    """
    path = Path(checkpoint)
    if not path.exists():
        raise FileNotFoundError(f"--checkpoint {path}: no such file")
    if path.is_dir():
        raise ValueError(f"--checkpoint {path} is a directory, expected a file")
    _check_readable(path)
    if _is_export_archive(path):
        if model:
            raise ValueError(
                f"--checkpoint {path} is a torch.export archive, which holds its own module; "
                "drop --model"
            )
        try:
            program = torch.export.load(str(path))
        except Exception as e:
            raise ValueError(
                f"--checkpoint {path}: cannot load the torch.export archive ({_one_line(e)})"
            ) from None
        convention = convention or "edge_index"
        hops, degrees, detail = _export_hops(program)
        num_layers = sum(hops.values())
        served = ServedModel(
            program.module(),
            convention,
            extra_hops=degrees if convention != "adjs" else 0,
            pass_counts=False,
            embeddable=False,
            num_layers=num_layers,
            source=f"the torch.export archive {path.name}",
        )
        served.hop_detail = detail
        served.out_degrees = degrees >= 2 and convention != "adjs"
        return served, _info(served, f"torch.export {path.name}", None)
    _check_checkpoint_bytes(path)
    try:
        with warnings.catch_warnings():  # e.g. the pickle protocol: the error below says it all
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if "GLOBAL" not in str(e):  # not a pickled class: random bytes, a bad opcode
            raise ValueError(
                f"--checkpoint {path} is not a PyTorch checkpoint ({_one_line(e)})"
            ) from None
        if not trust_pickle:
            raise ValueError(
                f"--checkpoint {path} holds pickled Python objects (e.g. torch.save(model)); "
                "loading it runs code from the file: pass --trust-pickle if you trust it, or "
                "save model.state_dict() and pass --model package.module:factory"
            ) from None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                obj = torch.load(path, map_location=map_location, weights_only=False)
        except Exception as e:
            raise ValueError(f"--checkpoint {path}: cannot unpickle ({_one_line(e)})") from None
    except Exception as e:  # random bytes; a zip archive torch's reader finds damaged
        if "PytorchStreamReader" in str(e):
            raise ValueError(
                f"--checkpoint {path} is truncated or corrupted: torch cannot read its zip "
                f"archive ({_one_line(e)}); save or copy it again"
            ) from None
        raise ValueError(
            f"--checkpoint {path} is not a PyTorch checkpoint ({_one_line(e)})"
        ) from None

    if isinstance(obj, nn.Module):
        if model:
            raise ValueError(f"--checkpoint {path} holds a whole module; drop --model")
        served = ServedModel(obj.to(map_location).eval(), convention, source=type(obj).__name__)
        return served, _info(served, f"pickled {type(obj).__name__}", None)
    recorded = _recorded_factory(path, obj)
    if recorded is not None:
        return _from_recorded(path, obj, recorded, model, trust_pickle, convention, map_location)
    state = obj
    if isinstance(obj, dict) and not _is_state_dict(obj):
        for key in ("state_dict", "model_state_dict", "model"):
            if _is_state_dict(obj.get(key)):
                state = obj[key]
                break
    if not _is_state_dict(state):
        raise ValueError(
            f"--checkpoint {path} holds neither a state_dict nor a checkpoint naming its factory "
            f"(a {type(obj).__name__})"
        )
    if not model:
        raise ValueError(
            f"--checkpoint {path} holds a state_dict: pass --model package.module:factory naming "
            "the function that builds its module"
        )
    module = _build(model)
    _fit_state_dict(module, state, str(path), f"the module --model {model} builds")
    module.to(map_location).eval()
    served = ServedModel(module, convention, source=model)
    fanouts = obj.get("fanouts") if isinstance(obj, dict) and state is not obj else None
    return served, _info(served, f"{model} ({type(module).__name__})", fanouts)


def _info(served: ServedModel, kind: str, fanouts) -> dict:
    return {
        "kind": kind,
        "fanouts": list(fanouts) if fanouts else None,
        "frontier": served.frontier,
        "extra_hops": served.extra_hops,
        "num_layers": served.num_layers,
        "hop_detail": served.hop_detail,
        "out_degrees": served.out_degrees,
        "convention": served.convention,
    }


def _recorded_factory(path: Path, obj) -> tuple[str, dict] | None:
    """``(factory spec, kwargs)`` a checkpoint records (see the module docstring), or None."""
    if not isinstance(obj, dict) or "state_dict" not in obj:
        return None
    if "factory" in obj:
        spec, kwargs = obj["factory"], obj.get("factory_kwargs") or {}
        if not isinstance(spec, str) or ":" not in spec:
            raise ValueError(
                f"--checkpoint {path}: 'factory' must be 'package.module:function', got {spec!r}"
            )
    elif "config" in obj:  # the format before: quiver.models.ModelConfig's fields
        spec, kwargs = QUIVER_GNN_FACTORY, obj["config"]
    else:
        return None
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        what = "'config'" if "factory" not in obj else "'factory_kwargs'"
        raise ValueError(f"--checkpoint {path}: {what} must be a dict of keyword arguments")
    if not _is_state_dict(obj["state_dict"]):
        raise ValueError(f"--checkpoint {path}: 'state_dict' does not hold a state_dict")
    return spec, kwargs


def _from_recorded(
    path: Path, obj: dict, recorded, model, trust_pickle, convention, map_location
) -> tuple[nn.Module, dict]:
    """Build the recorded factory's module (or ``--model``'s) and load the checkpoint's weights."""
    spec, kwargs = recorded
    if model and model != spec:  # the user's factory wins, called as --model always is
        spec, kwargs, origin = model, {}, f"--model {model}"
    elif model:
        origin = f"--model {model}"
    else:
        trusted = spec in _TRUSTED_FACTORIES or trust_pickle
        if not trusted:
            raise ValueError(
                f"--checkpoint {path} names its factory {spec}, whose code would run: pass "
                f"--model {spec} to confirm it (or --trust-pickle)"
            )
        origin = f"--checkpoint {path} (factory {spec})"
    module = _build(spec, kwargs, origin)
    what = f"the module {spec} builds"
    _fit_state_dict(module, obj["state_dict"], str(path), what)
    module.to(map_location).eval()
    fanouts = obj.get("fanouts")
    describe = getattr(module, "quiver_served_info", None)
    if callable(describe):  # Quiver's own GNN takes the sampler's adjs as they are
        return module, describe(fanouts)
    served = ServedModel(module, convention, source=spec)
    return served, _info(served, f"{spec} ({type(module).__name__})", fanouts)
