"""Updates on a served homogeneous graph: the heterogeneous update layer with one node type.

A prepared homogeneous dataset is viewed as a graph of one node type, :data:`NODE`, and one
relation, :data:`EDGE` (``node__to__node``), and handed to
:class:`quiver.hetero.updates.LiveGraph`: the same operations and request shapes, the same
strict validation, the same fsynced log before the answer, replay at start-up, copy-on-write
versions, and ``quiver compact`` (:func:`compact_homogeneous`). ``node_type`` and
``edge_type`` may be left out of a request (:func:`with_defaults`).

:class:`LiveSampler` samples a version exactly as the homogeneous CPU kernel samples the
prepared CSR: the same random streams per (call, hop, row), so a graph without updates gives
the answers ``GraphSageSampler`` gives, and an updated row is read from the patch buffers
(:func:`quiver.hetero.sampler._sample_patched`).

What homogeneous serving has, under updates: feature rows gathered in bf16 stay bf16 (new and
replaced rows are cast as they are gathered); the FAP cache keeps the base rows it chose, and
new or replaced rows are read from host memory; edge features of added edges are served; new
nodes get the mean PSGS in the batcher's budget; a folded first layer's tables are updated
with the rows they derive from (:func:`open_live`). GPU/hybrid sampling is off (the live rows
are on the CPU), and replicas and feature shards serve read-only.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import torch

from quiver.hetero.updates import LiveGraph, UpdateError, dataset_lock
from quiver.sampling.base import (
    RepeatedSeedsError,
    SampledSubgraph,
    _first_occurrences,
    check_fanouts,
    expand_repeated_seeds,
)

__all__ = [
    "EDGE",
    "NODE",
    "LiveEdgeRows",
    "LiveSampler",
    "compact_homogeneous",
    "fold_names",
    "open_live",
    "with_defaults",
]

#: the one node type of a homogeneous graph, as updates and ``/healthz`` name it
NODE = "node"
#: its one relation
EDGE = (NODE, "to", NODE)
_NODE_OPS = ("add_nodes", "set_features")


class _Relation:
    """The prepared CSR as :class:`LiveGraph` reads a relation."""

    def __init__(self, topo):
        topo = topo.to("cpu")
        self.edge_type = EDGE
        self.indptr = topo.indptr.numpy()
        self.indices = topo.indices.numpy()
        # no eid file: an edge's id is its CSR slot, as the sampler reports it
        self.eid = (
            topo.eid.numpy() if topo.eid is not None else np.arange(topo.edge_count, dtype=np.int64)
        )


class _GraphView:
    """A prepared homogeneous dataset seen as a one-type graph (what :class:`LiveGraph`
    reads: counts, relations, feature and edge-feature tables, manifest, directory)."""

    def __init__(self, ds, table):
        self.num_nodes = {NODE: ds.num_nodes}
        self.relations = {EDGE: _Relation(ds.topo)}
        self.edge_features = {EDGE: ds.edge_features} if ds.edge_features is not None else {}
        self.features = {NODE: table}
        self.labels = {NODE: ds.labels}
        self.manifest = ds.manifest
        self.path = ds.path


def fold_names(folded) -> list[str]:
    """The names a folded first layer's tables have in a version's ``derived`` rows."""
    return [f"fold{i}" for i in range(len(folded.tables))]


def open_live(ds, table, durable: bool = True, folded=None) -> LiveGraph:
    """A :class:`LiveGraph` over prepared dataset ``ds`` whose feature rows come from
    ``table`` (the served store: a tensor or a ``quiver.Feature``); with ``durable`` the
    directory's update log is replayed now and every update is logged (fsynced) before it is
    applied.

    ``folded`` (a ``quiver.serving.folded.FoldedFirstLayer`` built from ``table``): its tables
    are kept with the rows, in the same versions. A folded row is a function of its node's
    feature row alone (the neighbour aggregation runs at serve time on the sampled subgraph),
    so a new or replaced feature row recomputes exactly that node's folded rows, from the row
    as the dataset stores it (the start-up fold reads the stored rows: a bf16-stored dataset's
    are rounded to bf16 first, an fp32 one's are not, whatever the served tables' dtype), and
    a changed neighbourhood recomputes none."""
    derived = None
    if folded is not None:
        dtype = ds.features.dtype
        names = fold_names(folded)

        def refold(rows: torch.Tensor) -> dict:
            return dict(zip(names, folded.project_rows(rows.to(dtype)), strict=True))

        derived = {NODE: (dict(zip(names, folded.tables, strict=True)), refold)}
    return LiveGraph(_GraphView(ds, table), {NODE: table}, durable=durable, derived=derived)


def with_defaults(record):
    """``record`` with ``node_type``/``edge_type`` filled in where a one-type graph lets the
    client leave them out (other values are left for validation to refuse)."""
    if not isinstance(record, dict):
        raise UpdateError("an update is a JSON object with an 'op'")
    rec = dict(record)
    if rec.get("op") in _NODE_OPS:
        rec.setdefault("node_type", NODE)
    elif "op" in rec:
        rec.setdefault("edge_type", "__".join(EDGE))
    return rec


class LiveSampler:
    """``sample(seeds, version) -> (n_id, batch_size, adjs)`` on one version of a live graph,
    in the format and with the random streams of ``quiver.pyg.GraphSageSampler`` in CPU mode
    (see the module docstring).

    Args:
        sizes: per-hop fanouts, innermost first; ``-1`` takes every neighbour.
        seed: the sampling seed (``None`` draws one).
        frontier: sample only each hop's new nodes (``GraphSageSampler``'s ``frontier``).
    """

    def __init__(self, sizes, seed: int | None = None, frontier: bool = False):
        from quiver.sampling.cpu import random_seed

        self.sizes = check_fanouts(sizes)
        self.seed = random_seed() if seed is None else int(seed) & ((1 << 63) - 1)
        self.frontier = bool(frontier)
        self._calls = iter(range(1 << 62))
        self._calls_lock = threading.Lock()
        self._local = threading.local()

    def _marker(self, n: int) -> np.ndarray:
        m = getattr(self._local, "marker", None)
        if m is None or m.shape[0] < n:  # new nodes: a longer marker (all -1 between calls)
            m = self._local.marker = np.full(max(n, 16), -1, dtype=np.int64)
        return m

    def sample(self, seeds, version):
        """Sample the k-hop neighbourhood of ``seeds`` (repeats allowed, as in
        ``GraphSageSampler.sample``) in ``version``."""
        from quiver.sampling.base import check_seeds

        seeds = check_seeds(seeds, version.num_nodes[NODE])
        try:
            sub = self._sample(seeds, version)
        except RepeatedSeedsError:
            uniq, first, inverse = _first_occurrences(seeds)
            sub = expand_repeated_seeds(self._sample(uniq, version), seeds, first, inverse)
        return sub.n_id, sub.batch_size, sub.adjs()

    def _sample(self, seeds: torch.Tensor, version) -> SampledSubgraph:
        from quiver.hetero.sampler import _sample_patched
        from quiver.sampling._cpu_kernel import relabel, reset_marker, stream_key

        with self._calls_lock:
            call = next(self._calls)
        arrays = version.rels[EDGE].arrays()
        marker = self._marker(version.num_nodes[NODE])
        s = seeds.numpy()
        if np.unique(s).shape[0] != s.shape[0]:
            raise RepeatedSeedsError("seeds hold duplicate node ids")
        n_id = np.empty(max(16, 4 * s.shape[0]), dtype=np.int64)
        n = s.shape[0]
        n_id[:n] = s
        marker[s] = np.arange(n)
        num_nodes, hops = [n], []
        try:
            for h, k in enumerate(self.sizes):
                first = num_nodes[h - 1] if (self.frontier and h > 0) else 0
                key = np.uint64(stream_key(self.seed, call, h))
                offs, src, eids = _sample_patched(*arrays, n_id[first:n].copy(), k, key)
                m = int(offs[-1])
                dst = np.empty(m, dtype=np.int64)
                if n_id.shape[0] < n + m:
                    grown = np.empty(max(n + m, 2 * n_id.shape[0]), dtype=np.int64)
                    grown[:n] = n_id[:n]
                    n_id = grown
                n = relabel(src, dst, first, offs, marker, n_id, n)
                num_nodes.append(n)
                hops.append((src, dst, eids))
        finally:
            reset_marker(marker, n_id, n)
        t = torch.from_numpy
        return SampledSubgraph(
            t(n_id[:n].copy()), s.shape[0], num_nodes, [(t(a), t(b), t(c)) for a, b, c in hops]
        )


class LiveEdgeRows:
    """The edge feature table a model's ``edge_attr`` is gathered from, live: base rows and the
    rows of edges added since. An edge's row never changes and ids are never reused, so the
    latest version answers for every batch."""

    def __init__(self, live: LiveGraph):
        self.live = live
        self._base = live.rels[EDGE].efeat

    @property
    def shape(self):
        return self._base.shape

    def dim(self) -> int:
        return 2

    def __getitem__(self, e_id: torch.Tensor) -> torch.Tensor:
        return self.live.rels[EDGE].gather_edges(e_id)


def compact_homogeneous(directory) -> tuple[int, int]:
    """Fold a homogeneous dataset's ``updates.log`` into its files; ``(records folded, seq)``.

    The current graph is written as a complete prepared dataset under a new generation folder
    (``DIR/gen-<seq>/``), fsynced, and the manifest is switched to it atomically (its ``data``
    entry names the folder; ``compacted_seq`` the last record folded): the manifest's
    replacement is the commit point, so a crash before it leaves the old files, manifest and
    log untouched. Then the log drops the folded records and the old files go. Refused while a
    server holds the directory. Measured tables of the old graph (PSGS, FAP, fold and
    calibration entries) are dropped from the manifest: they describe a graph that changed.
    """
    from quiver.datasets.prepared import MANIFEST, convert_features, load_prepared, save_prepared
    from quiver.graph import CSRTopo
    from quiver.hetero.updates import commit_generation

    d = Path(directory)
    lock = dataset_lock(d)
    try:
        ds = load_prepared(d)
        live = open_live(ds, ds.features)
        pending = live.seq - int(ds.manifest.get("compacted_seq", 0))
        if pending == 0:
            live.log.close()
            return 0, live.seq
        version = live.version
        n = version.num_nodes[NODE]
        rel = version.rels[EDGE]
        ei, eids = rel.edge_index(n, with_eids=True)  # [2, E] (src, dst), [E]
        order = np.argsort(ei[1], kind="stable")  # destination rows, each in its row's order
        indices = np.ascontiguousarray(ei[0][order])
        indptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(ei[1], minlength=n), out=indptr[1:])
        efeat = None
        if rel.efeat is not None:  # the new input order is the CSR's: slot j reads row j
            efeat = rel.gather_edges(torch.from_numpy(eids[order])).float()
        topo = CSRTopo(
            indptr=torch.from_numpy(indptr),
            indices=torch.from_numpy(indices),
            eid=torch.arange(indices.shape[0])
            if (efeat is not None or ds.topo.eid is not None)
            else None,
        )
        topo._orientation = ds.topo._orientation  # the same in-neighbour rows as before
        feats = version.features[NODE].gather(torch.arange(n)).float()
        labels = ds.labels
        if n > labels.shape[0]:
            labels = torch.cat([labels, torch.full((n - labels.shape[0],), -1, dtype=labels.dtype)])
        stale = {"num_nodes", "num_edges", "degree", "data", "dtypes", "edge_features"}
        stale |= {"fap", "fold", "calibration", "precision"}
        keep = {k: v for k, v in ds.manifest.items() if k not in stale and "psgs" not in k}
        keep["compacted_seq"] = live.seq
        gen = f"gen-{live.seq}"
        tmp = d / f".{gen}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        save_prepared(tmp, topo, feats, labels, ds.splits, keep, edge_features=efeat)
        if ds.features.dtype == torch.bfloat16:
            convert_features(tmp, "bfloat16")
        manifest = json.loads((tmp / MANIFEST).read_text())
        (tmp / MANIFEST).unlink()
        old = ds.manifest.get("data", ".")
        commit_generation(d, tmp, gen, {**manifest, "data": gen}, live)
        if old == ".":
            for name in _DATA_FILES:
                p = d / name
                if p.is_dir():
                    shutil.rmtree(p)
                elif p.exists():
                    p.unlink()
        elif old != gen and (d / old).exists():
            shutil.rmtree(d / old)
        return pending, live.seq
    finally:
        lock.close()


#: what a prepared homogeneous dataset keeps beside its manifest (before a first compaction)
_DATA_FILES = (
    "indptr.npy",
    "indices.npy",
    "eid.npy",
    "topo.json",
    "features.npy",
    "labels.npy",
    "split",
    "edge_features.npy",
)
