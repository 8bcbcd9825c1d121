"""The first SAGE layer folded into the feature table (``quiver serve --fold-first-layer``).

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

Only Quiver's own ``SampledGNN`` with a SAGE first layer (mean aggregation, root weight, no
normalisation or projection) and at least two layers folds: :func:`why_not_foldable` says why
another model does not. A user's module is opaque to us (its ``forward`` may do anything with
``x``), so it is served unfolded.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

__all__ = [
    "FOLD_CHOICES",
    "FoldChoice",
    "FoldedFirstLayer",
    "measure_fold",
    "read_fold",
    "why_not_foldable",
    "write_fold",
]

#: values of ``--fold-first-layer``
FOLD_CHOICES = ("auto", "on", "off")


def why_not_foldable(model: nn.Module) -> str | None:
    """None when ``model``'s first layer can be folded into the feature table, else why not."""
    from quiver.models import SampledGNN

    if not isinstance(model, SampledGNN):
        return f"the model is a {type(model).__name__}, not Quiver's own GNN"
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


class FoldedFirstLayer:
    """Node tables ``L = X W_l^T`` and ``R = X W_r^T`` of a SAGE model's first layer.

    The engine's feature store when folding is on: :meth:`gather_layer` replaces the row
    gather and layer 1, and :attr:`tail` (layers 2..L, sharing the model's parameters) replaces
    the model.

    Args:
        model: a foldable ``SampledGNN`` (see :func:`why_not_foldable`), fp32 weights.
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
    ):
        reason = why_not_foldable(model)
        if reason is not None:
            raise ValueError(f"--fold-first-layer: cannot fold this model: {reason}")
        conv = model.convs[0]
        n, f = int(features.shape[0]), int(features.shape[1])
        if f != conv.lin_l.weight.shape[1]:
            raise ValueError(
                f"the model's first layer takes {conv.lin_l.weight.shape[1]} features per node; "
                f"the dataset has {f}"
            )
        hidden = conv.lin_l.weight.shape[0]
        # both maps in one GEMM per chunk: (rows, F) @ (F, 2H)
        w = torch.cat([conv.lin_l.weight, conv.lin_r.weight], 0).detach().float().t()
        self.left = torch.empty((n, hidden), dtype=dtype)  # (N, H): L = X W_l^T
        self.right = torch.empty((n, hidden), dtype=dtype)  # (N, H): R = X W_r^T
        bias = conv.lin_l.bias
        self.bias = (
            bias.detach().float().clone() if bias is not None else torch.zeros(hidden)
        )  # (H,)
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
                both = rows.float() @ w  # (rows, 2H)
                self.left[lo:hi] = both[:, :hidden]
                self.right[lo:hi] = both[:, hidden:]
        self.build_s = time.perf_counter() - t0
        self.tail = _tail(model)
        self.num_nodes, self.hidden = n, hidden

    def to(self, dtype: torch.dtype) -> FoldedFirstLayer:
        """The same tables stored in ``dtype`` (a new object sharing :attr:`tail`)."""
        other = copy.copy(self)
        other.left, other.right = self.left.to(dtype), self.right.to(dtype)
        return other

    @property
    def dtype(self) -> torch.dtype:
        return self.left.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of both tables."""
        return self.left.numel() * self.left.element_size() * 2

    @property
    def shape(self) -> torch.Size:
        """``(N, H)``: one row of each table per node."""
        return self.left.shape

    def gather_layer(self, n_id: Tensor, adjs: list) -> tuple[Tensor, list]:
        """Layer 1's activations of a sampled batch and the hops left for :attr:`tail`.

        Args:
            n_id: ``(S,)`` global ids of the sampled nodes, targets of hop 1 first.
            adjs: the sampler's hops, outermost first (see ``quiver.models``).

        Returns:
            ``(relu(h1) (num_dst, H) fp32, adjs[1:])``.
        """
        edge_index, _, (_, num_dst) = adjs[0]
        # a GPU-sampled batch (HybridSampler) reads the host tables with host ids
        n_id, edge_index = n_id.cpu(), edge_index.cpu()
        src, dst = edge_index[0], edge_index[1]
        if dst.numel() > 1 and not bool((dst[1:] >= dst[:-1]).all()):
            order = torch.argsort(dst, stable=True)  # bags need edges grouped by target
            src, dst = src[order], dst[order]
        deg = torch.bincount(dst, minlength=num_dst)  # (num_dst,)
        offsets = torch.zeros(num_dst, dtype=torch.long)
        if num_dst > 1:
            torch.cumsum(deg[:-1], 0, out=offsets[1:])
        # the neighbour mean straight from the node table (an empty bag gives 0, like the
        # unfolded CSR and scatter paths)
        h = torch.nn.functional.embedding_bag(n_id[src], self.left, offsets, mode="mean")
        h = h.float() if h.dtype != torch.float32 else h  # (num_dst, H)
        h += self.right.index_select(0, n_id[:num_dst])
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


# ------------------------------------------------------------------------------ the decision


@dataclass
class FoldChoice:
    """What ``--fold-first-layer auto`` measured, stored in the dataset's manifest (``"fold"``)
    and reused as is by every later start on the same machine, model, precision and fanouts,
    so a restart serves the same tables (the same logits) without measuring again.

    Attributes:
        folded: whether the folded path won.
        table: the winning tables' dtype (``"fp32"`` or ``"bf16"``); empty when not folded.
        summary: what the start-up line said (e.g. the measured speed-up).
        gather: the precision of the unfolded gather it was measured against.
        model: the precision of the model it was measured with.
        sizes: the sampled fanouts of the measured batches.
        model_id: the model (``quiver.precision.model_id``).
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
    cpu_model: str = ""
    cpu_flags: list | None = None
    cpu_cores: int | None = None
    created: str = ""

    def key(self) -> tuple:
        """What a stored choice must match to be reused (beside the machine)."""
        return (self.gather, self.model, [int(k) for k in self.sizes], self.model_id)


def read_fold(manifest: dict, want: FoldChoice) -> FoldChoice | None:
    """The stored ``"fold"`` decision when it was measured on this machine for ``want``'s
    :meth:`FoldChoice.key`; else None (measure again)."""
    from quiver.precision import same_machine

    d = manifest.get("fold")
    if not isinstance(d, dict):
        return None
    try:
        stored = FoldChoice(**{k: v for k, v in d.items() if k in FoldChoice.__dataclass_fields__})
    except TypeError:
        return None
    if not same_machine(d) or stored.key() != want.key():
        return None
    if stored.folded and stored.table not in ("fp32", "bf16"):
        return None
    return stored


def write_fold(manifest_path, choice: FoldChoice) -> None:
    """Store ``choice`` under ``"fold"`` in a manifest.json (atomically), with this machine."""
    from quiver.precision import machine, update_manifest

    choice.created = choice.created or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    update_manifest(manifest_path, "fold", {**asdict(choice), **machine()})
