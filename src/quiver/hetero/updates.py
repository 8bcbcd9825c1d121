"""Updates while serving: new nodes, added and removed edges, replaced feature rows, durable.

:class:`LiveGraph` puts a patch layer over a prepared :class:`HeteroGraph` (whose files stay
read-only and memory-mapped):

- a destination row touched by an update is rewritten whole into an append-only patch buffer
  (``p_start[v]``, ``p_deg[v]`` point at it; ``-1`` = the base row), so the sampler reads one
  row from one of two places (:func:`quiver.hetero.sampler._sample_patched`) and an untouched
  row costs one extra load; new nodes get ids after the last one and empty rows;
- a replaced or new feature row lives in an overlay table per type (``over_idx[v]`` -> row).

Consistency without blocking: the graph is a chain of immutable :class:`Version` s. A batch
takes the current one (``live.reading()``, one reference read) and samples and gathers from it
alone. An update (validated, logged) builds the next version copy-on-write, copying only what
it changes: the touched relation's row table (``p_start``/``p_deg``, 16 bytes per destination
node), a type's overlay index, the node counts; the row and feature buffers are append-only
and shared, since a version never reads past its own fill mark. Then it publishes the new
version with one assignment. Readers never wait for writers, nor writers for readers (a first
version, with a readers-writer lock, let each update stall new batches behind the ones in
flight: read p99 53 -> 280 ms under 100 updates/s, ``bench/hetero.py``).

Durability: :class:`UpdateLog` appends each update as one checksummed JSON line to
``updates.log`` in the dataset directory and fsyncs it *before* the update is applied and
acknowledged. At start-up the log is replayed (records past the manifest's
``compacted_seq``); a torn last line (a crash mid-write, never acknowledged) is cut off.
:func:`compact` folds the log into new CSR and feature files under a fresh generation folder
and switches the manifest to it atomically (``quiver compact DIR``).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import threading
import zlib
from pathlib import Path

import numpy as np
import torch

from quiver.hetero.graph import MANIFEST, HeteroGraph, edge_type_name, parse_edge_type

__all__ = [
    "LiveGraph",
    "UpdateError",
    "UpdateLog",
    "Version",
    "commit_generation",
    "compact",
    "dataset_lock",
]

log = logging.getLogger("quiver.serving")
LOG_FILE = "updates.log"
LOCK_FILE = ".serving.lock"
OPS = ("add_nodes", "add_edges", "remove_edges", "set_features")


class UpdateError(ValueError):
    """A bad update (HTTP 4xx): it names the problem and changed nothing."""

    def __init__(self, message: str, status: int = 422):
        super().__init__(message)
        self.status = status


def dataset_lock(directory):
    """An exclusive ``flock`` on the dataset directory (held by a serving process), or a
    ``ValueError`` naming the holder."""
    path = Path(directory) / LOCK_FILE
    try:
        f = open(path, "a+")  # noqa: SIM115 - held for the process's life
    except OSError as e:
        raise ValueError(
            f"{directory}: cannot write the update lock and log there ({e.strerror}); serve it "
            "with --read-only"
        ) from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ValueError(
            f"{directory} is in use by {holder} (a server serving it): stop it first"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}\n")
    f.flush()
    return f


# ------------------------------------------------------------------------------ the log


def _line(record: dict) -> bytes:
    body = json.dumps(record, separators=(",", ":"))
    return f"{body}\t{zlib.crc32(body.encode()):08x}\n".encode()


class UpdateLog:
    """The append-only, fsynced update log of a dataset directory (module docstring)."""

    def __init__(self, directory):
        self.path = Path(directory) / LOG_FILE
        self._f = None

    def read(self, after: int = 0) -> list[dict]:
        """Records with ``seq > after``, in order; a torn or corrupt *last* line is cut off the
        file (it was never acknowledged); a corrupt line before the last is an error."""
        if not self.path.exists():
            return []
        raw = self.path.read_bytes()
        out, good_end, pos = [], 0, 0
        lines = raw.split(b"\n")
        for i, ln in enumerate(lines):
            end = pos + len(ln) + 1
            last = i == len(lines) - 1 or all(not x for x in lines[i + 1 :])
            if not ln:
                pos = end
                continue
            body, _, crc = ln.rpartition(b"\t")
            ok = end <= len(raw) and crc and f"{zlib.crc32(body):08x}".encode() == crc
            if not ok:
                if last:
                    log.warning("%s: dropping a torn last record (never acknowledged)", self.path)
                    with open(self.path, "r+b") as f:
                        f.truncate(good_end)
                        os.fsync(f.fileno())
                    break
                raise ValueError(f"{self.path}: record {i + 1} is corrupt (checksum mismatch)")
            rec = json.loads(body)
            if rec["seq"] > after:
                out.append(rec)
            good_end = pos = end
        return out

    def append(self, record: dict) -> None:
        """Write one record and fsync it (the acknowledgement waits for this)."""
        if self._f is None:
            self._f = open(self.path, "ab")  # noqa: SIM115 - kept open while serving
        self._f.write(_line(record))
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


# --------------------------------------------------------------------------- live graph


def _grow(a: np.ndarray, need: int, fill, copy: bool = False) -> np.ndarray:
    """``a`` with room for ``need`` entries (new ones ``fill``); a new array when it grows, or
    when ``copy`` (copy-on-write: the caller's version gets its own)."""
    if need <= a.shape[0]:
        return a.copy() if copy else a
    out = np.full(max(need, 2 * a.shape[0], 16), fill, dtype=a.dtype)
    out[: a.shape[0]] = a
    return out


def _grow_rows(t: torch.Tensor, used: int, need: int) -> torch.Tensor:
    """An append-only row buffer with room for ``need`` rows (its first ``used`` kept): ``t``
    itself while it fits, so older versions share it (they never read past their own fill)."""
    if need <= t.shape[0]:
        return t
    out = torch.zeros(max(need, 2 * t.shape[0], 16), t.shape[1], dtype=t.dtype)
    out[:used] = t[:used]
    return out


class _LiveRelation:
    """One relation: base CSR arrays plus the patched rows (module docstring)."""

    def __init__(self, rel, efeat=None):
        self.edge_type = rel.edge_type
        #: ``[E, D]`` base edge features in input order (None: the relation has none); edges
        #: added since have ids ``E, E+1, ...`` and their rows in ``e_over``
        self.efeat = efeat
        self.e_over = None if efeat is None else torch.zeros(0, efeat.shape[1])
        self.e_used = 0
        self.indptr = np.ascontiguousarray(rel.indptr, dtype=np.int64)
        self.indices = np.ascontiguousarray(rel.indices, dtype=np.int64)
        self.eid = np.ascontiguousarray(rel.eid, dtype=np.int64)
        self.base_n = self.indptr.shape[0] - 1
        self.p_start = np.zeros(0, dtype=np.int64)
        self.p_deg = np.zeros(0, dtype=np.int64)
        self.p_indices = np.zeros(0, dtype=np.int64)
        self.p_eid = np.zeros(0, dtype=np.int64)
        self.p_used = 0
        # the first id an added edge gets: past every base edge id and every base feature row
        # (with deduplicated input edges, ids can exceed the CSR's slot count)
        top = int(self.eid.max()) + 1 if self.eid.shape[0] else 0
        rows = 0 if efeat is None else int(efeat.shape[0])
        self.first_new_eid = max(self.indices.shape[0], top, rows)
        self.next_eid = self.first_new_eid

    def row(self, v: int) -> tuple[np.ndarray, np.ndarray]:
        """``(sources, edge ids)`` of destination ``v`` in the current version."""
        if v < self.p_start.shape[0] and self.p_start[v] >= 0:
            s, d = self.p_start[v], self.p_deg[v]
            return self.p_indices[s : s + d], self.p_eid[s : s + d]
        if v < self.base_n:
            s, e = self.indptr[v], self.indptr[v + 1]
            return self.indices[s:e], self.eid[s:e]
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)

    def set_rows(self, rows: dict[int, tuple[np.ndarray, np.ndarray]]) -> None:
        """Write new versions of rows (on this version's copy, before it is published)."""
        total = sum(r[0].shape[0] for r in rows.values())
        self.p_indices = _grow(self.p_indices, self.p_used + total, -1)
        self.p_eid = _grow(self.p_eid, self.p_used + total, -1)
        top = max(rows) + 1
        # the row table is this version's own (copy-on-write): older versions keep theirs
        self.p_start = _grow(self.p_start, top, -1, copy=True)
        self.p_deg = _grow(self.p_deg, top, 0, copy=True)
        for v, (src, eid) in rows.items():
            n = src.shape[0]
            self.p_indices[self.p_used : self.p_used + n] = src
            self.p_eid[self.p_used : self.p_used + n] = eid
            self.p_start[v] = self.p_used
            self.p_deg[v] = n
            self.p_used += n

    def gather_edges(self, eids: torch.Tensor) -> torch.Tensor:
        """``[len(eids), D]`` edge features (base rows or added edges' rows)."""
        base_e = self.first_new_eid
        if self.e_used == 0:
            return self.efeat[eids]
        new = eids >= base_e
        out = self.efeat[torch.where(new, torch.zeros_like(eids), eids)].clone()
        out[new] = self.e_over[eids[new] - base_e].to(out.dtype)
        return out

    def add_edge_rows(self, rows: torch.Tensor) -> None:
        """Append the features of newly added edges (before the version is published)."""
        need = self.e_used + rows.shape[0]
        self.e_over = _grow_rows(self.e_over, self.e_used, need)
        self.e_over[self.e_used : need] = rows
        self.e_used = need

    def edge_index(self, n_dst: int, with_eids: bool = False):
        """``[2, E]`` (src, dst) of the current version, rows in order (vectorised); with
        ``with_eids`` also the ``[E]`` edge ids."""
        patched = np.zeros(max(n_dst, self.base_n), dtype=bool)
        k = min(self.p_start.shape[0], patched.shape[0])
        patched[:k] = self.p_start[:k] >= 0
        base_dst = np.repeat(np.arange(self.base_n, dtype=np.int64), np.diff(self.indptr))
        keep = ~patched[base_dst]
        vs = np.nonzero(patched)[0]
        degs = self.p_deg[vs]
        # positions of every patched row's entries in the patch buffer
        offs = np.repeat(self.p_start[vs] - np.concatenate([[0], np.cumsum(degs)[:-1]]), degs)
        pos = offs + np.arange(int(degs.sum()), dtype=np.int64)
        src = np.concatenate([self.indices[keep], self.p_indices[pos]])
        dst = np.concatenate([base_dst[keep], np.repeat(vs, degs)])
        ei = np.stack([src, dst]).astype(np.int64)
        if with_eids:
            return ei, np.concatenate([self.eid[keep], self.p_eid[pos]]).astype(np.int64)
        return ei

    def num_edges(self) -> int:
        """Edges in the current version (base rows not patched, plus the patched rows)."""
        base_deg = np.diff(self.indptr)
        k = min(self.p_start.shape[0], self.base_n)
        patched = self.p_start >= 0
        return int(
            self.indices.shape[0] - base_deg[:k][patched[:k]].sum() + self.p_deg[patched].sum()
        )

    def arrays(self) -> tuple:
        return (
            self.indptr, self.indices, self.eid, self.base_n,
            self.p_start, self.p_deg, self.p_indices, self.p_eid,
        )  # fmt: skip


class _LiveFeatures:
    """One type's feature rows: the base table and an overlay of replaced or new rows."""

    def __init__(self, table, base_n: int, width: int, dtype=torch.float32):
        self.table = table
        self.base_n = base_n
        self.width = width
        self.over_idx = np.zeros(0, dtype=np.int64)
        self.over_rows = torch.zeros(0, width, dtype=dtype)
        self.used = 0

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """``[len(ids), F]`` rows of this version."""
        n = ids.shape[0]
        over = self.over_idx
        if over.shape[0] == 0:
            return self.table[ids]
        ids_np = ids.numpy()
        pos = np.full(n, -1, dtype=np.int64)
        inside = ids_np < over.shape[0]
        pos[inside] = over[ids_np[inside]]
        hit = pos >= 0
        if not hit.any():
            return self.table[ids]
        base_ids = ids.clone()
        base_ids[torch.from_numpy(hit)] = 0 if self.base_n else -1
        if self.base_n:
            out = self.table[base_ids].clone()
        else:
            out = torch.empty(n, self.width, dtype=self.over_rows.dtype)
        # new and replaced rows live in host memory; the base rows may come from a device cache
        rows = self.over_rows[torch.from_numpy(pos[hit])].to(device=out.device, dtype=out.dtype)
        out[torch.from_numpy(hit).to(out.device)] = rows
        return out

    def set_rows(self, ids: np.ndarray, rows: torch.Tensor) -> None:
        """Replace or add rows: always into fresh slots of the shared append-only buffer, and
        a copied index, so an older version still reads its own rows."""
        self.over_idx = _grow(self.over_idx, int(ids.max()) + 1, -1, copy=True)
        need = self.used + ids.shape[0]  # ids are distinct (validated)
        self.over_rows = _grow_rows(self.over_rows, self.used, need)
        self.over_rows[self.used : need] = rows.to(self.over_rows.dtype)
        self.over_idx[ids] = np.arange(self.used, need, dtype=np.int64)
        self.used = need


def _ids(values, what: str) -> np.ndarray:
    """A list of JSON integers as int64, strictly: predict's rule, so an update never stores
    ``1.5``, ``"1"`` or ``true`` as an id (numpy would silently convert all three)."""
    if not isinstance(values, list) or any(type(v) is not int for v in values):
        raise UpdateError(f"{what}: a list of integer ids (no floats, strings or booleans)")
    try:
        return np.asarray(values, dtype=np.int64).reshape(-1)
    except OverflowError:
        raise UpdateError(f"{what}: an id out of the int64 range") from None


def _rows(rows, what: str) -> np.ndarray:
    """A list of lists of JSON numbers as float32, strictly (numpy would take ``"1.5"`` and
    ``true``); the caller checks the shape and finiteness."""
    if not isinstance(rows, list) or not all(
        isinstance(r, list)
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in r)
        for r in rows
    ):
        raise UpdateError(f"{what}: rows of numbers (no strings or booleans)")
    try:
        return np.asarray(rows, dtype=np.float32)
    except (TypeError, ValueError, OverflowError):
        raise UpdateError(f"{what}: rows of numbers of one width") from None


class Version:
    """One immutable version of a live graph: node counts, relations, feature overlays.

    Attributes:
        seq: the last update it includes.
        num_nodes: node type -> count.
        rels: edge type -> its relation (base CSR + this version's patched rows).
        features: node type -> its feature rows (base table + this version's overlay).
        derived: name -> rows computed from a node type's features (a folded first layer's
            tables, see :class:`LiveGraph`'s ``derived``), updated in the same version.
    """

    def __init__(self, seq: int, num_nodes: dict, rels: dict, features: dict, derived=None):
        self.seq = seq
        self.num_nodes = num_nodes
        self.rels = rels
        self.features = features
        self.derived = derived if derived is not None else {}


class _Reading:
    def __init__(self, version: Version):
        self.version = version

    def __enter__(self) -> Version:
        return self.version

    def __exit__(self, *exc) -> None:
        return None


class LiveGraph:
    """A served :class:`HeteroGraph` that takes updates (module docstring).

    Args:
        graph: the prepared graph (loaded from its directory for a durable log).
        tables: node type -> the base feature store (``quiver.Feature`` or tensor).
        durable: log every update to ``graph.path / updates.log`` and replay it now.
        derived: node type -> ``(tables, fn)``: per-node tables computed from that type's
            feature rows (``{name: (N, w) tensor}``) and ``fn(rows (n, F) fp32) -> {name:
            (n, w)}`` computing them for new or replaced rows. They are updated in the same
            version as the rows they derive from, so a batch never sees one without the other
            (a folded first layer under updates, ``quiver.serving.live``).
    """

    def __init__(
        self,
        graph: HeteroGraph,
        tables: dict | None = None,
        durable: bool = True,
        derived: dict | None = None,
    ):
        self.graph = graph
        self._derive = {t: fn for t, (_, fn) in (derived or {}).items()}
        self._writer = threading.Lock()  # one update at a time, validation to publish
        tables = tables if tables is not None else graph.features
        self.version = Version(
            int(graph.manifest.get("compacted_seq", 0)),
            dict(graph.num_nodes),
            {
                et: _LiveRelation(r, graph.edge_features.get(et))
                for et, r in graph.relations.items()
            },
            {
                t: _LiveFeatures(tables[t], graph.num_nodes[t], int(graph.features[t].shape[1]))
                for t in graph.features
            },
            {
                name: _LiveFeatures(table, graph.num_nodes[t], int(table.shape[1]))
                for t, (named, _) in (derived or {}).items()
                for name, table in named.items()
            },
        )
        self.listeners: list = []  # called with (op, record) after each applied update
        #: featureless node type -> the most nodes the served model can embed (set by the
        #: server from the model's embedding tables; add_nodes past it is refused)
        self.capacity: dict[str, int] = {}
        self.compacting = False
        self.log = UpdateLog(graph.path) if durable and graph.path is not None else None
        if self.log is not None:
            for rec in self.log.read(after=self.seq):
                try:
                    self._validate(rec)
                except UpdateError as e:
                    raise ValueError(f"{self.log.path}: record {rec.get('seq')}: {e}") from None
                self.version = self._apply(rec)[0]

    # the latest version's parts (what validation and materialise read)
    @property
    def seq(self) -> int:
        return self.version.seq

    @property
    def num_nodes(self) -> dict:
        return self.version.num_nodes

    @property
    def rels(self) -> dict:
        return self.version.rels

    @property
    def features(self) -> dict:
        return self.version.features

    def stats(self) -> dict:
        """Live counts for ``/healthz`` and ``/metrics``: nodes per type, edges per relation,
        and the update log's length (records applied since the last compaction)."""
        version = self.version  # one version: the counts agree with each other
        base = int(self.graph.manifest.get("compacted_seq", 0))
        return {
            "seq": version.seq,
            "log_records": version.seq - base,
            "num_nodes": dict(version.num_nodes),
            "num_edges": {edge_type_name(et): r.num_edges() for et, r in version.rels.items()},
        }

    def reading(self) -> _Reading:
        """``with live.reading() as version:`` the version a batch samples and gathers from
        (the current one; it never changes under the batch)."""
        return _Reading(self.version)

    # ---------------------------------------------------------------- updates
    def update(self, record: dict) -> dict:
        """Validate, log (fsync), apply one update; returns what it did (e.g. new ids).

        ``record``: ``{"op": "add_nodes", "node_type": t, "count": n}`` (or ``"features":
        [[...], ...]`` for a type with features), ``{"op": "add_edges" | "remove_edges",
        "edge_type": "src__rel__dst", "src": [...], "dst": [...]}``, ``{"op":
        "set_features", "node_type": t, "ids": [...], "features": [[...], ...]}``.

        Raises:
            UpdateError: a bad update (unknown op, type or id, wrong feature width, a missing
                edge to remove, an update during compaction); nothing changed.
        """
        if not isinstance(record, dict):
            raise UpdateError("an update is a JSON object with an 'op'")
        with self._writer:
            if self.compacting:
                raise UpdateError("a compaction is running: retry when it ends", status=409)
            rec = self._validate(dict(record))
            rec["seq"] = self.seq + 1
            if self.log is not None:
                self.log.append(rec)
            version, result = self._apply(rec)
            self.version = version  # the publish: one reference assignment
            for fn in self.listeners:
                fn(rec["op"], rec)
            return {"seq": rec["seq"], **result}

    def _validate(self, rec: dict) -> dict:
        op = rec.get("op")
        if op not in OPS:
            raise UpdateError(f"unknown op {op!r}; one of {', '.join(OPS)}")
        allowed = {
            "add_nodes": {"op", "node_type", "count", "features", "seq"},
            "add_edges": {"op", "edge_type", "src", "dst", "edge_features", "seq"},
            "remove_edges": {"op", "edge_type", "src", "dst", "seq"},
            "set_features": {"op", "node_type", "ids", "features", "seq"},
        }[op]
        extra = sorted(set(rec) - allowed)
        if extra:
            raise UpdateError(f"{op}: unknown field '{extra[0]}'")
        if op in ("add_nodes", "set_features"):
            t = rec.get("node_type")
            if t not in self.num_nodes:
                raise UpdateError(f"{op}: unknown node type {t!r}")
            feats = self.features.get(t)
            rows = rec.get("features")
            if op == "set_features":
                ids = _ids(rec.get("ids"), "set_features.ids")
                if feats is None:
                    raise UpdateError(f"set_features: node type {t!r} has no features")
                self._check_ids(ids, t, op)
                if np.unique(ids).shape[0] != ids.shape[0]:
                    raise UpdateError("set_features: repeated ids")
                rec["ids"] = ids.tolist()
                n = ids.shape[0]
            else:
                if feats is not None:
                    if rows is None:
                        raise UpdateError(f"add_nodes: {t} nodes need 'features' (one row each)")
                    n = len(rows) if isinstance(rows, list) else -1
                else:
                    if rows is not None:
                        raise UpdateError(f"add_nodes: node type {t!r} has no features")
                    n = rec.get("count")
                    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                        raise UpdateError("add_nodes: 'count' must be a positive integer")
                    room = self.capacity.get(t)
                    if room is not None and self.num_nodes[t] + n > room:
                        # the model embeds these nodes by id: a row past its table would
                        # make every later predict touching them fail
                        left = max(room - self.num_nodes[t], 0)
                        raise UpdateError(
                            f"add_nodes: node type {t!r} is featureless and the model embeds "
                            f"{room} of them; room for {left} more, asked for {n}",
                            status=409,
                        )
                    return rec
            if feats is not None:
                arr = _rows(rows, f"{op}: 'features'")
                if arr.ndim != 2 or arr.shape != (n, feats.width) or n < 1:
                    raise UpdateError(
                        f"{op}: features of {t!r} must be [{max(n, 1)}, {feats.width}], got "
                        f"{list(arr.shape)}"
                    )
                if not np.isfinite(arr).all():
                    raise UpdateError(f"{op}: features must be finite numbers")
            return rec
        # edges
        try:
            et = parse_edge_type(rec.get("edge_type"))
        except ValueError as e:
            raise UpdateError(f"{op}: {e}") from None
        if et not in self.rels:
            known = ", ".join(edge_type_name(e) for e in self.rels)
            raise UpdateError(f"{op}: unknown edge type {edge_type_name(et)}; {known}")
        rec["edge_type"] = edge_type_name(et)
        src = _ids(rec.get("src"), f"{op}.src")
        dst = _ids(rec.get("dst"), f"{op}.dst")
        if src.shape != dst.shape or src.size == 0:
            raise UpdateError(f"{op}: 'src' and 'dst' must be non-empty and of equal length")
        self._check_ids(src, et[0], op)
        self._check_ids(dst, et[2], op)
        efeat = self.rels[et].efeat
        if op == "add_edges" and efeat is not None:
            rows = rec.get("edge_features")
            if rows is None:
                raise UpdateError(
                    f"add_edges: {edge_type_name(et)} has edge features: give 'edge_features' "
                    "(one row per edge)"
                )
            arr = _rows(rows, "add_edges: 'edge_features'")
            want = (src.shape[0], int(efeat.shape[1]))
            if arr.shape != want or not np.isfinite(arr).all():
                raise UpdateError(
                    f"add_edges: edge_features of {edge_type_name(et)} must be finite "
                    f"[{want[0]}, {want[1]}], got {list(arr.shape)}"
                )
        elif rec.get("edge_features") is not None:
            raise UpdateError(f"{op}: {edge_type_name(et)} has no edge features")
        if op == "remove_edges":
            rel = self.rels[et]
            for s, d in zip(src.tolist(), dst.tolist(), strict=True):
                if s not in set(rel.row(d)[0].tolist()):
                    raise UpdateError(
                        f"remove_edges: no edge {s} -> {d} in {edge_type_name(et)}", status=404
                    )
        rec["src"], rec["dst"] = src.tolist(), dst.tolist()
        return rec

    def _check_ids(self, ids: np.ndarray, t: str, op: str) -> None:
        n = self.num_nodes[t]
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            bad = int(ids.max()) if ids.max() >= n else int(ids.min())
            raise UpdateError(f"{op}: {t} id {bad} is not in [0, {n})", status=404)

    def _apply(self, rec: dict) -> tuple[Version, dict]:
        """The next version with ``rec`` applied (copy-on-write; the current one untouched)
        and what the update did."""
        import copy

        cur = self.version
        num_nodes, rels, features = dict(cur.num_nodes), dict(cur.rels), dict(cur.features)
        derived = dict(cur.derived)
        nxt = Version(rec["seq"], num_nodes, rels, features, derived)
        op = rec["op"]

        def set_rows(t: str, ids: np.ndarray, rows: torch.Tensor) -> None:
            features[t] = copy.copy(features[t])
            features[t].set_rows(ids, rows)
            if t in self._derive:
                for name, part in self._derive[t](rows).items():
                    derived[name] = copy.copy(derived[name])
                    derived[name].set_rows(ids, part)

        if op == "add_nodes":
            t = rec["node_type"]
            start = num_nodes[t]
            if t in features:
                rows = torch.tensor(rec["features"], dtype=torch.float32)
                n = rows.shape[0]
                set_rows(t, np.arange(start, start + n, dtype=np.int64), rows)
            else:
                n = int(rec["count"])
            num_nodes[t] = start + n
            return nxt, {"node_type": t, "ids": list(range(start, start + n))}
        if op == "set_features":
            t = rec["node_type"]
            ids = np.asarray(rec["ids"], dtype=np.int64)
            set_rows(t, ids, torch.tensor(rec["features"], dtype=torch.float32))
            return nxt, {"node_type": t, "ids": rec["ids"]}
        et = parse_edge_type(rec["edge_type"])
        rel = rels[et] = copy.copy(rels[et])
        src = np.asarray(rec["src"], dtype=np.int64)
        dst = np.asarray(rec["dst"], dtype=np.int64)
        rows = {}
        if op == "add_edges" and rel.efeat is not None:
            # edge ids are handed out in this order below (per destination, record order)
            order = np.concatenate([np.nonzero(dst == d)[0] for d in np.unique(dst)])
            feats = torch.tensor(rec["edge_features"], dtype=torch.float32)[torch.from_numpy(order)]
            rel.add_edge_rows(feats)
        for d in np.unique(dst).tolist():
            cur_src, cur_eid = rel.row(d)
            mine = src[dst == d]
            if op == "add_edges":
                new_eid = np.arange(rel.next_eid, rel.next_eid + mine.shape[0], dtype=np.int64)
                rel.next_eid += mine.shape[0]
                rows[d] = (np.concatenate([cur_src, mine]), np.concatenate([cur_eid, new_eid]))
            else:
                keep = ~np.isin(cur_src, mine)
                rows[d] = (cur_src[keep].copy(), cur_eid[keep].copy())
        rel.set_rows(rows)
        return nxt, {"edge_type": rec["edge_type"], "edges": int(src.shape[0])}

    # ---------------------------------------------------------------- views
    def materialise(self) -> HeteroGraph:
        """The current version as a plain :class:`HeteroGraph` (features in RAM)."""
        edges, efeats = {}, {}
        for et, rel in self.rels.items():
            ei, eids = rel.edge_index(self.num_nodes[et[2]], with_eids=True)
            edges[et] = ei
            if rel.efeat is not None:
                efeats[et] = rel.gather_edges(torch.from_numpy(eids))
        feats = {t: f.gather(torch.arange(self.num_nodes[t])) for t, f in self.features.items()}
        labels = {}
        for t, y in self.graph.labels.items():
            extra = self.num_nodes[t] - y.shape[0]
            labels[t] = torch.cat([y, torch.full((extra,), -1, dtype=y.dtype)]) if extra else y
        manifest = {k: v for k, v in self.graph.manifest.items() if k not in ("node_types",)}
        return HeteroGraph.from_edges(self.num_nodes, edges, feats, labels, manifest, efeats)


def compact(directory) -> tuple[int, int]:
    """Fold ``updates.log`` into new files (a new generation folder) and switch the manifest to
    them atomically; returns ``(records folded, seq)``. Refuses while a server holds the
    directory."""
    d = Path(directory)
    lock = dataset_lock(d)
    try:
        graph = HeteroGraph.load(d)
        live = LiveGraph(graph)
        pending = live.seq - int(graph.manifest.get("compacted_seq", 0))
        if pending == 0:
            return 0, live.seq
        new = live.materialise()
        gen = f"gen-{live.seq}"
        tmp = d / f".{gen}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        new.manifest = {**new.manifest, "compacted_seq": live.seq}
        new.save(tmp, write_manifest=False)
        old_data = graph.manifest.get("data", ".")
        commit_generation(d, tmp, gen, new.manifest_for(gen), live)
        if old_data == ".":
            for p in list(d.glob("rel_*")) + [d / "features", d / "labels"]:
                if p.exists():
                    shutil.rmtree(p)
        elif (d / old_data).exists() and old_data != gen:
            shutil.rmtree(d / old_data)
        return pending, live.seq
    finally:
        lock.close()


def commit_generation(d: Path, tmp: Path, gen: str, manifest: dict, live: LiveGraph) -> None:
    """A compaction's commit, for both kinds of dataset: the new files in ``tmp`` fsynced and
    moved to ``d / gen``, then ``manifest`` (naming ``gen``) replacing the old one atomically
    (the commit point: a crash before it leaves the old files, manifest and log), then the log
    cut to the records past ``live.seq`` (those are not in the new files)."""
    _fsync_tree(tmp)
    os.replace(tmp, d / gen)
    mtmp = d / (MANIFEST + ".tmp")
    mtmp.write_text(json.dumps(manifest, indent=2) + "\n")
    with open(mtmp) as f:
        os.fsync(f.fileno())
    os.replace(mtmp, d / MANIFEST)  # the commit point
    live.log.close()
    keep = [_line(r) for r in UpdateLog(d).read(after=live.seq)]
    ltmp = d / (LOG_FILE + ".tmp")
    ltmp.write_bytes(b"".join(keep))
    os.replace(ltmp, d / LOG_FILE)


def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
