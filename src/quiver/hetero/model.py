"""A user's heterogeneous GNN, served: inputs built from a sampled :class:`HeteroBatch`.

The served module is any ``torch.nn.Module`` whose ``forward(x_dict, edge_index_dict)`` takes
what PyG's hetero models take (``to_hetero(...)``, ``HeteroConv``, RGCN-style models written
over the dicts) and returns either a dict of per-type outputs or the target type's output:

- ``x_dict[t]``: ``[n_t, F_t]`` float32 features of the sampled ``t`` nodes for a type with
  features; for a type *without* features, ``[n_t]`` int64 **global node ids**, for the
  model's own embedding table (``nn.Embedding(num_nodes[t], dim)``), as PyG's MAG examples
  do for authors, institutions and fields;
- ``edge_index_dict[(src, rel, dst)]``: ``[2, E]`` int64 local ``(src, dst)`` indices into
  those rows; every type and relation is present, empty when nothing was sampled;
- ``edge_attr_dict[(src, rel, dst)]`` (third argument, only to a ``forward`` that takes one):
  ``[E, D]`` float32 features of the sampled edges, in ``edge_index_dict``'s order, for the
  relations that have edge features (what ``HeteroConv`` hands its edge-aware convs).

Rows ``[:batch_size]`` of the target type's output are the requested nodes' answers. A module
with an ``embed(x_dict, edge_index_dict)`` method can also answer ``output="embedding"``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from quiver.hetero.sampler import HeteroBatch

__all__ = [
    "HeteroFeatures",
    "HeteroInput",
    "HeteroServedModel",
    "load_hetero_model",
    "read_hetero_checkpoint",
]


class HeteroInput:
    """The model's inputs for one sampled batch (``.to(device)`` moves every tensor)."""

    def __init__(
        self, x_dict: dict, edge_index_dict: dict, batch: HeteroBatch, edge_attr_dict=None
    ):
        self.x_dict = x_dict
        self.edge_index_dict = edge_index_dict
        self.edge_attr_dict = edge_attr_dict or {}
        self.batch = batch

    def to(self, device, non_blocking: bool = False) -> HeteroInput:
        def mv(d):
            return {k: v.to(device, non_blocking=non_blocking) for k, v in d.items()}

        return HeteroInput(
            mv(self.x_dict), mv(self.edge_index_dict), self.batch, mv(self.edge_attr_dict)
        )


class HeteroFeatures:
    """Feature rows per node type; ``self[batch]`` gives the batch's :class:`HeteroInput`.

    Args:
        tables: node type -> a ``quiver.Feature`` or a ``[N_t, F_t]`` tensor (types without
            features are left out: their rows are the node ids).
        live: a :class:`quiver.hetero.updates.LiveGraph`: rows come through its overlays
            (replaced and new rows), gathered by the sampler under the batch's version.
    """

    def __init__(self, tables: dict, live=None, edge_tables: dict | None = None):
        self.tables = dict(tables)
        self.live = live
        #: edge type -> ``[E, D]`` edge features in input order (``batch.edge_ids`` index it)
        self.edge_tables = dict(edge_tables or {})

    def gather(self, batch: HeteroBatch, version=None) -> HeteroInput:
        """The batch's inputs, from a live graph's ``version`` (the one it was sampled in;
        default the current one)."""
        if self.live is not None and version is None:
            version = self.live.version
        x = {}
        for t, ids in batch.node_ids.items():
            if version is not None and t in version.features:
                x[t] = version.features[t].gather(ids)
                continue
            table = self.tables.get(t)
            x[t] = ids if table is None else table[ids]
        ea = {}
        for et, eids in batch.edge_ids.items():
            if version is not None and version.rels[et].efeat is not None:
                ea[et] = version.rels[et].gather_edges(eids)
            elif et in self.edge_tables:
                ea[et] = self.edge_tables[et][eids]
        return HeteroInput(x, dict(batch.edge_index), batch, ea)

    def __getitem__(self, batch: HeteroBatch) -> HeteroInput:
        return batch.inputs if batch.inputs is not None else self.gather(batch)

    def stats(self) -> dict:
        """Rows served per tier, summed over the types' stores (``quiver.Feature.stats``)."""
        total: dict = {}
        for table in self.tables.values():
            fn = getattr(table, "stats", None)
            if callable(fn):
                st = fn()
                for k, v in dict(st.get("rows", st)).items():
                    if isinstance(v, (int, float)):
                        total[k] = total.get(k, 0) + v
        return total


class HeteroServedModel(nn.Module):
    """Wrap a hetero module so a ``quiver.serving.Engine`` can run it for one target type.

    Args:
        module: the user's module (see the module docstring).
        target: the node type whose answers are asked for.
    """

    def __init__(self, module: nn.Module, target: str):
        super().__init__()
        self.module = module
        self.target = target
        self.has_embedding = callable(getattr(module, "embed", None))
        self.takes_edge_attr = _takes_edge_attr(module.forward)

    def _pick(self, out, inp: HeteroInput) -> Tensor:
        if isinstance(out, dict):
            if self.target not in out:
                raise ValueError(
                    f"the model gives no output for node type {self.target!r} (it gives "
                    f"{', '.join(map(str, out))})"
                )
            out = out[self.target]
        if not isinstance(out, Tensor) or out.ndim != 2:
            raise ValueError(
                "the model must return a [nodes, classes] tensor or a dict of them per node type"
            )
        return out[: inp.batch.batch_size[self.target]]

    def _args(self, inp: HeteroInput) -> tuple:
        if self.takes_edge_attr:
            return inp.x_dict, inp.edge_index_dict, inp.edge_attr_dict
        return inp.x_dict, inp.edge_index_dict

    def forward(self, inp: HeteroInput, adjs=None) -> Tensor:
        """``[batch_size, C]`` outputs of the target type's seeds."""
        return self._pick(self.module(*self._args(inp)), inp)

    def forward_all(self, inp: HeteroInput, adjs=None) -> tuple[Tensor, Tensor]:
        """``(embedding, logits)`` of the seeds (the embedding from ``module.embed``)."""
        logits = self.forward(inp)
        if not self.has_embedding:
            raise ValueError("this model has no embed(x_dict, edge_index_dict) method")
        return self._pick(self.module.embed(*self._args(inp)), inp), logits


def _takes_edge_attr(fn) -> bool:
    """Whether ``forward`` takes a third positional argument (the edge attributes)."""
    import inspect

    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3


def _materialise(module: nn.Module, probe: HeteroInput | None) -> None:
    """Run one forward so lazy modules (``in_channels=-1``, common with ``to_hetero``) get
    their shapes before the weights are loaded."""
    lazy = any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters())
    if lazy and probe is not None:
        args = (probe.x_dict, probe.edge_index_dict)
        if _takes_edge_attr(module.forward):
            args = (*args, probe.edge_attr_dict)
        with torch.no_grad():
            module(*args)


def read_hetero_checkpoint(checkpoint):
    """The checkpoint file's contents (weights-only load), or a one-line error."""
    from quiver.usermodel import _check_checkpoint_bytes, _check_readable, _one_line

    path = Path(checkpoint)
    if not path.is_file():
        raise FileNotFoundError(f"--checkpoint {path}: no such file")
    _check_readable(path)
    _check_checkpoint_bytes(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"--checkpoint {path}: cannot load ({_one_line(e)})") from None


def hetero_hops(module: nn.Module) -> int:
    """The message-passing hops a hetero module propagates (0 when it shows none).

    A group of ``MessagePassing`` modules side by side, one per relation (``HeteroConv``'s
    ``convs``, each layer ``to_hetero`` rewrote), is one layer: its hops are its deepest
    member's. Layers anywhere else (``RGCNConv`` over a flattened graph) count one each, as
    :func:`quiver.usermodel.layer_hops` reads them.
    """
    from quiver.usermodel import layer_hops

    try:
        from torch_geometric.nn import MessagePassing
    except ImportError:  # pragma: no cover - torch_geometric is a dependency
        return 0

    def walk(m: nn.Module) -> int:
        total = 0
        for child in m.children():
            if isinstance(child, MessagePassing):
                total += layer_hops(child)
            elif (
                isinstance(child, nn.ModuleDict)
                and len(child)
                and all(isinstance(c, MessagePassing) for c in child.values())
            ):
                total += max(layer_hops(c) for c in child.values())
            else:
                total += walk(child)
        return total

    if isinstance(module, MessagePassing):
        return layer_hops(module)
    return walk(module)


def load_hetero_model(
    checkpoint, model: str | None = None, trust_pickle: bool = False, probe=None, obj=None
) -> tuple[nn.Module, dict]:
    """Build and load the module a factory checkpoint names (``quiver.usermodel.save_model``).

    Args:
        checkpoint: the file ``save_model`` wrote (factory, factory_kwargs, state_dict).
        model: ``package.module:function`` to build it (confirms the checkpoint's factory).
        trust_pickle: call the checkpoint's own factory without ``model``.
        probe: a :class:`HeteroInput` to run once before loading (materialises lazy modules).
        obj: the file's contents when the caller read them already
            (:func:`read_hetero_checkpoint`), so a large checkpoint is read once.

    Returns:
        ``(module, info)``; ``info`` has ``kind``, the checkpoint's ``fanouts`` (or None) and
        ``num_layers``, the hops the module propagates (:func:`hetero_hops`, 0 when unknown).

    Raises:
        FileNotFoundError, ValueError: one line naming the file or option.
    """
    from quiver.usermodel import _build, _fit_state_dict, _recorded_factory

    path = Path(checkpoint)
    if obj is None:
        obj = read_hetero_checkpoint(path)
    recorded = _recorded_factory(path, obj)
    if recorded is None:
        if not (
            model and isinstance(obj, dict) and all(isinstance(v, Tensor) for v in obj.values())
        ):
            raise ValueError(
                f"--checkpoint {path}: a hetero model is served from a factory checkpoint "
                "(quiver.usermodel.save_model) or a state_dict with --model"
            )
        spec, kwargs, state = model, {}, obj
    else:
        spec, kwargs = recorded
        state = obj["state_dict"]
        if model and model != spec:
            spec, kwargs = model, {}
        elif not model and not trust_pickle:
            raise ValueError(
                f"--checkpoint {path} names its factory {spec}, whose code would run: pass "
                f"--model {spec} to confirm it (or --trust-pickle)"
            )
    module = _build(spec, kwargs, f"--model {spec}")
    _materialise(module, probe)
    _fit_state_dict(module, state, str(path), f"the module {spec} builds")
    module.eval()
    fanouts = obj.get("fanouts") if isinstance(obj, dict) else None
    return module, {
        "kind": f"{spec} ({type(module).__name__})",
        "fanouts": fanouts,
        "num_layers": hetero_hops(module),
    }
