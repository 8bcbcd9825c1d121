"""Graph topology in compressed sparse row (CSR) form: ``CSRTopo``.

Row ``v`` of the CSR lists the neighbours the sampler draws for ``v``; their messages flow to
``v`` (sampled edges are ``indices -> row``). Which end of an edge list becomes the row is the
``orientation`` of the build:

- ``"out"`` (torch-quiver's ``CSRTopo(edge_index)``): row ``u = edge_index[0]`` lists its
  out-neighbours ``edge_index[1]``; repeated edges are dropped (``coalesce=True``), as
  torch-quiver's COO -> CSR conversion does.
- ``"in"`` (PyG's message flow, ``edge_index[0]`` = source, ``edge_index[1]`` = target, quiver's
  ``from_edge_index``/``from_pyg`` and every prepared dataset): row ``v`` lists its
  in-neighbours, the nodes whose messages reach it in a PyG model.

On the usual undirected (symmetrised) graphs both give the same CSR. All ids are int64 torch
tensors; on disk the topology is a directory of ``.npy`` files that can be memory-mapped so
graphs larger than RAM load in O(1) memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

__all__ = ["CSRTopo"]

_META = "topo.json"

ORIENTATIONS = ("out", "in")
_ORIENTATION_TEXT = {
    "in": "in-neighbours (row = target)",
    "out": "out-neighbours (row = source)",
    None: "as given (CSR input)",
}


def _as_int64_numpy(x, name: str) -> np.ndarray:
    """Return ``x`` (tensor, array or list) as an int64 numpy array, copy-free if possible."""
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype == torch.bool or x.is_complex():
            raise ValueError(f"{name} must hold integers, got dtype {x.dtype}")
        x = x.detach().cpu().numpy()
    else:
        x = np.asarray(x)
        if x.size and not np.issubdtype(x.dtype, np.integer):
            raise ValueError(f"{name} must hold integers, got dtype {x.dtype}")
    return x.astype(np.int64, copy=False)


def _to_tensor(a: np.ndarray) -> torch.Tensor:
    """Wrap an int64 numpy array (possibly a copy-on-write memmap) as a tensor without copying."""
    if not a.flags.writeable:
        # torch.from_numpy warns on read-only buffers; a copy-on-write view avoids the copy
        a = a.view()
        try:
            a.flags.writeable = True
        except ValueError:
            a = np.array(a)
    return torch.from_numpy(a)


def _counting_sort_by_row(
    col: np.ndarray, row: np.ndarray, num_nodes: int, coalesce: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group edges by ``row``: keep the input order inside each row (a stable sort), or, with
    ``coalesce``, sort each row by ``col`` and keep one edge per ``(row, col)`` pair (the first).

    Returns ``(indptr [N+1], indices [E'], eid [E'])`` where ``eid[j]`` is the position in the
    input edge list of the edge stored at CSR slot ``j``.
    """
    if coalesce:
        key = row * np.int64(num_nodes) + col
        _, eid = np.unique(key, return_index=True)  # sorted by (row, col), first occurrence
        eid = eid.astype(np.int64, copy=False)
        counts = np.bincount(row[eid], minlength=num_nodes)
    else:
        counts = np.bincount(row, minlength=num_nodes)
        eid = np.argsort(row, kind="stable").astype(np.int64, copy=False)
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    indices = col[eid]
    return indptr, indices, eid


class CSRTopo:
    """CSR topology of a graph: row ``v`` lists the neighbours sampled for ``v``.

    Build it with one of:

    - ``CSRTopo(edge_index)``: torch-quiver's constructor and semantics: row
      ``edge_index[0]``, neighbours ``edge_index[1]`` (``orientation="out"``), repeated edges
      dropped (``coalesce=True``). Pass ``orientation="in", coalesce=False`` for PyG's
      in-neighbour convention (the same as ``from_edge_index``);
    - ``CSRTopo.from_edge_index(ei, num_nodes=None)``: quiver's PyG-convention constructor,
      ``ei[0]`` sources, ``ei[1]`` targets, row ``v`` = in-neighbours of ``v``
      (``orientation="in"``), repeated edges kept (``coalesce=False``);
    - ``CSRTopo(indptr=p, indices=i)`` / ``CSRTopo.from_csr(p, i, eid=None)``: an existing CSR,
      used as given;
    - ``CSRTopo.from_scipy(m)``: ``m[i, j] != 0`` means an edge ``i -> j`` (the convention of
      ``torch_geometric.utils.to_scipy_sparse_matrix``); rows = in-neighbours;
    - ``CSRTopo.from_pyg(data)``: a ``torch_geometric.data.Data`` with ``edge_index``, rows =
      in-neighbours (what PyG's own samplers draw);
    - ``CSRTopo.load(directory, mmap=False)``: a directory written by :meth:`save`.

    Args:
        edge_index: ``[2, E]`` integer edges.
        indptr: ``[N + 1]`` row pointers, non-decreasing, ``indptr[0] == 0``.
        indices: ``[E]`` neighbour ids, each in ``[0, N)``.
        eid: optional ``[E]`` edge ids: ``eid[j]`` is the id (position in the original edge
            list) of the edge stored at CSR slot ``j``. Edge-list builds always set it.
        num_nodes: node count for ``edge_index`` input; default ``max id + 1`` over both rows
            (torch-quiver sizes rows by ``edge_index[0]`` only; ids beyond it are isolated here).
        validate: check ids and pointers (O(E)); ``load`` skips it for trusted files.
        orientation: ``edge_index`` input only. ``"out"`` (default, torch-quiver): row ``u``
            holds the targets ``edge_index[1]`` of its edges; ``"in"`` (PyG): row ``v`` holds
            the sources ``edge_index[0]`` of the edges into it.
        coalesce: ``edge_index`` input only. ``True`` (default, torch-quiver) keeps one edge
            per ``(row, neighbour)`` pair (its first occurrence, for ``eid``) and sorts each row
            by neighbour id; ``False`` keeps repeated edges and the input order within a row.

    Attributes:
        feature_order: optional ``[N]`` int64 tensor, torch-quiver's feature order:
            ``feature_order[v]`` is the row of node ``v`` in a feature tensor stored in that
            order. :class:`quiver.Feature` built with this topology reads it (see there).
    """

    def __init__(
        self,
        edge_index=None,
        indptr=None,
        indices=None,
        eid=None,
        num_nodes: int | None = None,
        validate: bool = True,
        *,
        orientation: str = "out",
        coalesce: bool = True,
    ):
        if orientation not in ORIENTATIONS:
            raise ValueError(f"orientation must be 'out' or 'in', got {orientation!r}")
        self._orientation: str | None = None
        if edge_index is not None:
            if indptr is not None or indices is not None:
                raise ValueError("give either edge_index or indptr+indices, not both")
            ip, ix, ei = self._build_from_edge_index(edge_index, num_nodes, orientation, coalesce)
            self._indptr, self._indices, self._eid = _to_tensor(ip), _to_tensor(ix), _to_tensor(ei)
            self._orientation = orientation
        else:
            if indptr is None or indices is None:
                raise ValueError("CSRTopo needs edge_index, or both indptr and indices")
            self._indptr = self._tensor_1d(indptr, "indptr")
            self._indices = self._tensor_1d(indices, "indices")
            self._eid = None if eid is None else self._tensor_1d(eid, "eid")
            if validate:
                self._validate_csr(num_nodes)
        self._degree: torch.Tensor | None = None
        self._feature_order: torch.Tensor | None = None

    # ----------------------------------------------------------------- constructors

    @classmethod
    def from_edge_index(
        cls,
        edge_index,
        num_nodes: int | None = None,
        *,
        orientation: str = "in",
        coalesce: bool = False,
    ) -> CSRTopo:
        """Build from ``[2, E]`` edges; sets ``eid``.

        Defaults to PyG's convention (row 0 source, row 1 target, row ``v`` = in-neighbours of
        ``v``, repeated edges kept); ``orientation="out", coalesce=True`` gives
        torch-quiver's ``CSRTopo(edge_index)``.
        """
        return cls(
            edge_index=edge_index, num_nodes=num_nodes, orientation=orientation, coalesce=coalesce
        )

    @classmethod
    def from_csr(cls, indptr, indices, eid=None, validate: bool = True) -> CSRTopo:
        """Wrap an existing CSR (row ``v`` = the neighbours sampled for ``v``); no copy for
        int64 input."""
        return cls(indptr=indptr, indices=indices, eid=eid, validate=validate)

    @classmethod
    def from_scipy(cls, matrix) -> CSRTopo:
        """Build from a scipy sparse adjacency where ``matrix[i, j] != 0`` means edge ``i -> j``.

        The matrix must be square. Edge ids follow the column-major (CSC) order of ``matrix``.
        """
        import scipy.sparse as sp

        if not sp.issparse(matrix):
            raise ValueError(f"expected a scipy sparse matrix, got {type(matrix).__name__}")
        if matrix.shape[0] != matrix.shape[1]:
            raise ValueError(f"adjacency matrix must be square, got shape {matrix.shape}")
        csc = matrix.tocsc()
        csc.sort_indices()
        topo = cls(indptr=csc.indptr, indices=csc.indices)
        topo._orientation = "in"
        return topo

    @classmethod
    def from_pyg(cls, data) -> CSRTopo:
        """Build from a ``torch_geometric.data.Data`` (uses ``edge_index`` and ``num_nodes``)."""
        edge_index = getattr(data, "edge_index", None)
        if edge_index is None:
            raise ValueError("PyG data object has no edge_index")
        return cls(
            edge_index=edge_index, num_nodes=data.num_nodes, orientation="in", coalesce=False
        )

    @staticmethod
    def _build_from_edge_index(edge_index, num_nodes, orientation, coalesce):
        ei = _as_int64_numpy(edge_index, "edge_index")
        if ei.ndim != 2 or ei.shape[0] != 2:
            raise ValueError(f"edge_index must have shape [2, E], got {list(ei.shape)}")
        src, dst = np.ascontiguousarray(ei[0]), np.ascontiguousarray(ei[1])
        if ei.shape[1] and min(int(src.min()), int(dst.min())) < 0:
            raise ValueError("edge_index holds negative node ids")
        max_id = int(max(src.max(), dst.max())) if ei.shape[1] else -1
        if num_nodes is None:
            num_nodes = max_id + 1
        elif num_nodes <= max_id:
            raise ValueError(f"edge_index holds node id {max_id} but num_nodes is {num_nodes}")
        if orientation == "out":
            return _counting_sort_by_row(dst, src, int(num_nodes), coalesce)
        return _counting_sort_by_row(src, dst, int(num_nodes), coalesce)

    @staticmethod
    def _tensor_1d(x, name: str) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            if x.dtype.is_floating_point or x.dtype == torch.bool:
                raise ValueError(f"{name} must hold integers, got dtype {x.dtype}")
            t = x.to(torch.int64)
        else:
            t = _to_tensor(_as_int64_numpy(x, name))
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {list(t.shape)}")
        return t

    def _validate_csr(self, num_nodes: int | None) -> None:
        ip, ix = self._indptr, self._indices
        if ip.numel() < 1:
            raise ValueError("indptr must have at least one entry (node_count + 1)")
        if int(ip[0]) != 0:
            raise ValueError(f"indptr[0] must be 0, got {int(ip[0])}")
        if int(ip[-1]) != ix.numel():
            raise ValueError(
                f"indptr[-1] = {int(ip[-1])} does not match len(indices) = {ix.numel()}"
            )
        if ip.numel() > 1 and bool((ip[1:] < ip[:-1]).any()):
            raise ValueError("indptr must be non-decreasing")
        n = ip.numel() - 1
        if num_nodes is not None and num_nodes != n:
            raise ValueError(f"num_nodes = {num_nodes} but indptr describes {n} nodes")
        if ix.numel() and (int(ix.min()) < 0 or int(ix.max()) >= n):
            raise ValueError(f"indices must lie in [0, {n}); found ids out of range")
        if self._eid is not None and self._eid.numel() != ix.numel():
            raise ValueError(f"len(eid) = {self._eid.numel()} != len(indices) = {ix.numel()}")

    # ------------------------------------------------------------------- properties

    @property
    def indptr(self) -> torch.Tensor:
        """``[N + 1]`` int64 row pointers; row ``v`` is ``indices[indptr[v]:indptr[v + 1]]``."""
        return self._indptr

    @property
    def indices(self) -> torch.Tensor:
        """``[E]`` int64 neighbour ids, grouped by row (in-neighbours for ``orientation="in"``,
        out-neighbours for ``"out"``)."""
        return self._indices

    @property
    def eid(self) -> torch.Tensor | None:
        """``[E]`` int64 original edge id of each CSR slot, or ``None`` if unknown."""
        return self._eid

    @property
    def node_count(self) -> int:
        """Number of nodes ``N``."""
        return self._indptr.numel() - 1

    @property
    def edge_count(self) -> int:
        """Number of edges ``E``."""
        return self._indices.numel()

    @property
    def degree(self) -> torch.Tensor:
        """``[N]`` int64 row length of every node: its in-degree for ``orientation="in"``, its
        out-degree (after coalescing) for ``"out"``. Computed once, cached."""
        if self._degree is None:
            self._degree = self._indptr[1:] - self._indptr[:-1]
        return self._degree

    @property
    def orientation(self) -> str | None:
        """How an edge list became rows: ``"out"`` (row = ``edge_index[0]``), ``"in"`` (row =
        ``edge_index[1]``), or ``None`` for a CSR given as is."""
        return self._orientation

    @property
    def feature_order(self) -> torch.Tensor | None:
        """torch-quiver's feature order: ``feature_order[v]`` = row of node ``v`` in a
        feature tensor stored in that order, or ``None``. Settable; checked for length."""
        return self._feature_order

    @feature_order.setter
    def feature_order(self, order) -> None:
        if order is None:
            self._feature_order = None
            return
        t = self._tensor_1d(order, "feature_order")
        if t.numel() != self.node_count:
            raise ValueError(
                f"feature_order has {t.numel()} entries but the graph has {self.node_count} nodes"
            )
        self._feature_order = t

    @property
    def device(self) -> torch.device:
        """Device of the topology tensors."""
        return self._indptr.device

    @property
    def nbytes(self) -> int:
        """Bytes held by ``indptr``, ``indices`` and ``eid``."""
        n = self._indptr.numel() + self._indices.numel()
        if self._eid is not None:
            n += self._eid.numel()
        return 8 * n

    def __repr__(self) -> str:
        return (
            f"CSRTopo(node_count={self.node_count}, edge_count={self.edge_count}, "
            f"device={self.device}, eid={'yes' if self._eid is not None else 'no'})"
        )

    # ---------------------------------------------------------------- conversions

    def _replace(self, indptr, indices, eid) -> CSRTopo:
        out = CSRTopo.__new__(CSRTopo)
        out._indptr, out._indices, out._eid = indptr, indices, eid
        out._degree = None
        out._orientation = self._orientation
        out._feature_order = self._feature_order
        return out

    def __setstate__(self, state: dict) -> None:
        # objects pickled before orientation/feature_order existed
        state.setdefault("_orientation", None)
        state.setdefault("_feature_order", None)
        self.__dict__.update(state)

    def share_memory_(self) -> CSRTopo:
        """Move the tensors (``indptr``, ``indices``, ``eid``, ``feature_order``) to shared
        memory, as torch-quiver does before handing a topology to worker processes; returns
        ``self``. (Pickling through ``torch.multiprocessing`` shares them anyway.) A
        memory-mapped topology is copied into shared memory."""
        for t in (self._indptr, self._indices, self._eid, self._feature_order, self._degree):
            if t is not None and t.device.type == "cpu":
                t.share_memory_()
        return self

    def to(self, device) -> CSRTopo:
        """Return a copy of the topology on ``device`` (``self`` if already there)."""
        device = torch.device(device)
        if device == self.device:
            return self
        eid = None if self._eid is None else self._eid.to(device)
        return self._replace(self._indptr.to(device), self._indices.to(device), eid)

    def pin_memory(self) -> CSRTopo:
        """Return a copy in page-locked host memory, readable by the GPU directly (UVA).

        Raises:
            ValueError: if CUDA is not available (pinned memory needs a CUDA driver).
        """
        if not torch.cuda.is_available():
            raise ValueError("pinned (UVA) topology needs CUDA, which is not available here")
        eid = None if self._eid is None else self._eid.cpu().pin_memory()
        return self._replace(self._indptr.cpu().pin_memory(), self._indices.cpu().pin_memory(), eid)

    def to_edge_index(self) -> torch.Tensor:
        """``[2, E]`` int64 message-flow edges in CSR order: row 0 the neighbour (message
        source), row 1 the node whose row holds it. For ``orientation="in"`` these are the
        original edges; for ``"out"`` they are the original edges reversed."""
        dst = torch.repeat_interleave(
            torch.arange(self.node_count, device=self.device), self.degree
        )
        return torch.stack([self._indices, dst])

    def numpy(self) -> tuple[np.ndarray, np.ndarray]:
        """``(indptr, indices)`` as numpy arrays sharing memory (topology must be on CPU)."""
        if self.device.type != "cpu":
            raise ValueError(f"numpy() needs a CPU topology, this one is on {self.device}")
        return self._indptr.numpy(), self._indices.numpy()

    # ------------------------------------------------------------------------ files

    def save(self, directory) -> Path:
        """Write ``indptr.npy``, ``indices.npy`` (``eid.npy``) and ``topo.json`` to ``directory``.

        Returns the directory path. Existing files of the same names are overwritten.
        """
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        np.save(d / "indptr.npy", self._indptr.cpu().numpy())
        np.save(d / "indices.npy", self._indices.cpu().numpy())
        if self._eid is not None:
            np.save(d / "eid.npy", self._eid.cpu().numpy())
        elif (d / "eid.npy").exists():
            (d / "eid.npy").unlink()
        meta = self._meta()
        (d / _META).write_text(json.dumps(meta, indent=2) + "\n")
        return d

    def _meta(self) -> dict:
        return {
            "format": "quiver.CSRTopo/1",
            "node_count": self.node_count,
            "edge_count": self.edge_count,
            "orientation": _ORIENTATION_TEXT[self._orientation],
            "has_eid": self._eid is not None,
        }

    @classmethod
    def load(cls, directory, mmap: bool = False, validate: bool = False) -> CSRTopo:
        """Load a topology written by :meth:`save`.

        Args:
            directory: the directory holding ``indptr.npy`` and ``indices.npy``.
            mmap: memory-map the arrays (copy-on-write) instead of reading them, so loading
                takes O(1) memory and pages are read on first touch.
            validate: run the O(E) id checks (off by default: the files were written by us).
        """
        d = Path(directory)
        if not d.is_dir():
            raise FileNotFoundError(f"topology directory not found: {d}")
        for name in ("indptr.npy", "indices.npy"):
            if not (d / name).exists():
                raise FileNotFoundError(f"missing {name} in {d}")
        mode = "c" if mmap else None
        indptr = np.load(d / "indptr.npy", mmap_mode=mode)
        indices = np.load(d / "indices.npy", mmap_mode=mode)
        eid = np.load(d / "eid.npy", mmap_mode=mode) if (d / "eid.npy").exists() else None
        for name, a in (("indptr", indptr), ("indices", indices), ("eid", eid)):
            if a is not None and a.dtype != np.int64:
                raise ValueError(f"{d / (name + '.npy')} has dtype {a.dtype}, expected int64")
        topo = cls(indptr=indptr, indices=indices, eid=eid, validate=False)
        if (d / _META).exists():
            text = json.loads((d / _META).read_text()).get("orientation")
            topo._orientation = {v: k for k, v in _ORIENTATION_TEXT.items()}.get(text)
        # cheap structural checks always; O(E) id checks only when asked
        if int(topo.indptr[-1]) != topo.edge_count:
            raise ValueError(f"corrupt topology in {d}: indptr[-1] != len(indices)")
        if validate:
            topo._validate_csr(None)
        return topo
