"""Serving hosts over a feature partition: remote rows fetched point-to-point from their owners.

:class:`~quiver.feature.dist.DistFeature`'s gather is a collective: every host calls it once per
step, which suits training, not serving, where a host's batches come when its own requests do.
:class:`PeerFeature` holds the same shard (the host's owned + replicated rows in a local
:class:`quiver.Feature`) but fetches the rows it lacks with point-to-point messages over
``torch.distributed`` (gloo), answered on every host by a **responder thread**:

- *requester* (any serving thread, one exchange per batch): the batch's distinct remote ids,
  grouped by owner; to every owner at once a header ``[ROWS, rank, tag, count]`` on the shared
  tag ``REQ`` and the ids on the request's own ``tag``, plus a receive of the answer on that
  tag; the local rows are read while the answers travel, then the receives are waited for.
- *responder* (one thread per host): receives a header from any host on ``REQ``, then that
  host's ids, reads their rows from the local store and sends them back (raw bytes, so fp32
  and bf16 rows travel alike, followed by a status word).

Why it cannot deadlock: a responder only reads local rows, so it never waits on another host;
a requester posts every send and receive before it waits on any, and waits only on
responders; a host's requests use tags of their own (``tag % K == rank``), so an answer and a
request travelling the same way between two hosts never match each other's receive.

Why it cannot hang: every requester wait has a deadline (``peer_timeout_s``). gloo closes a
pair whose operation timed out, so a peer that misses one is marked *lost*: later batches
needing its rows fail at once with a one-line error, the rest keep being served.

Shutdown (:meth:`PeerFeature.close`): the host sends ``BYE`` to every peer, then keeps
answering until every peer has sent its own ``BYE`` (at most ``linger_s``), so a stopping
host's rows stay readable for hosts still serving; a responder ends once all its peers said
``BYE`` (none of them will ask again). When it ended the process group is destroyed.

Rendezvous (:func:`join_hosts`, used by :meth:`PeerFeature.from_prepared`): host 0 listens on
``peer_addr`` with a ``torch.distributed.TCPStore``; every host claims its rank there and
publishes its partition's fingerprint, and each checks every other's before the gloo group is
built on that store, so a taken rank, a host that never comes, or a different partition is a
one-line ``ValueError`` within ``join_timeout_s`` instead of a hang.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch

from quiver.feature.dist import DistFeature

__all__ = ["PeerConfig", "PeerFeature", "join_hosts", "partition_fingerprint"]

log = logging.getLogger("quiver.feature")

_REQ = 1  # the tag every header travels on
_ROWS, _BYE = 1, 0  # header kinds
_OK, _NOT_OWNED = 0, 1  # status word after an answer's rows
_HEADER = 4  # int64 words: kind, requester rank, request tag, id count
#: the gloo group's own timeout: how long an idle responder may wait for a header before gloo
#: gives up on it (a timed-out gloo wait closes its pair); requester waits have their own
_GROUP_TIMEOUT = timedelta(days=100)
_MAX_TAG = 2**31 - 1


@dataclass(kw_only=True)
class PeerConfig:
    """One serving host of a ``quiver partition`` (``quiver serve --host-rank``)."""

    host_rank: int
    """This host's id in the partition: ``0 <= host_rank < hosts``."""
    hosts: int
    """Hosts serving the partition (K); must equal the partition's host count."""
    peer_addr: str = "127.0.0.1:29500"
    """``HOST:PORT`` of the rendezvous store: host 0 listens there, the others connect."""
    partition_dir: str | None = None
    """A prepared directory holding the partition, or its ``partition/`` folder (default: the
    served dataset directory)."""
    join_timeout_s: float = 120.0
    """Seconds for every host to join the rendezvous (> 0)."""
    peer_timeout_s: float = 10.0
    """Seconds a batch waits for a peer's rows before that peer counts as lost (> 0)."""
    linger_s: float = 30.0
    """On stop, seconds this host keeps answering peers that are still serving (>= 0)."""

    def __post_init__(self) -> None:
        for name in ("host_rank", "hosts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | np.integer):
                raise ValueError(f"--{name.replace('_', '-')} must be an integer, got {v!r}")
        if self.hosts < 1:
            raise ValueError(f"--hosts must be >= 1, got {self.hosts}")
        if not 0 <= self.host_rank < self.hosts:
            raise ValueError(
                f"--host-rank must lie in [0, {self.hosts}) for --hosts {self.hosts}, "
                f"got {self.host_rank}"
            )
        self.address()  # validates peer_addr
        for name in ("join_timeout_s", "peer_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.linger_s >= 0:
            raise ValueError(f"linger_s must be >= 0, got {self.linger_s}")

    def address(self) -> tuple[str, int]:
        """``(host, port)`` of :attr:`peer_addr`."""
        host, sep, port = str(self.peer_addr).rpartition(":")
        try:
            p = int(port)
        except ValueError:
            p = -1
        if not sep or not host or not 0 < p <= 65535:
            raise ValueError(f"--peer-addr must be HOST:PORT, got {self.peer_addr!r}")
        return host.strip("[]"), p


def partition_fingerprint(partition, num_nodes: int, dim: int, dtype: torch.dtype) -> str:
    """A short hash of what hosts must agree on: owners, replicas, shape and row dtype."""
    h = hashlib.sha1()
    h.update(np.ascontiguousarray(partition.owner, dtype=np.int32).tobytes())
    for r in partition.replicas:
        h.update(np.ascontiguousarray(r, dtype=np.int64).tobytes())
        h.update(b"|")
    h.update(f"{num_nodes},{dim},{dtype}".encode())
    return h.hexdigest()[:16]


def join_hosts(cfg: PeerConfig, fingerprint: str):
    """Meet the other hosts at ``cfg.peer_addr``; returns the ``TCPStore`` to build the group
    on (host 0's also serves the others, keep it alive).

    Raises ``ValueError`` (one line) when the address cannot be used, the rank is taken, a
    host does not join within ``cfg.join_timeout_s``, or a host serves another partition.
    """
    import torch.distributed as dist

    host, port = cfg.address()
    rank = cfg.host_rank
    timeout = timedelta(seconds=cfg.join_timeout_s)
    # probe with Python sockets first: TCPStore reports a failure with a C++ stack trace
    _probe(host, port, rank, cfg)
    try:
        store = dist.TCPStore(host, port, None, rank == 0, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        raise ValueError(
            f"--peer-addr {cfg.peer_addr}: cannot reach the rendezvous ({_first_line(e)})"
        ) from None
    try:
        return _meet(store, cfg, fingerprint)
    except (RuntimeError, OSError) as e:  # the store went away: host 0 stopped
        raise ValueError(
            f"lost the rendezvous at {cfg.peer_addr} (did host 0 stop?): {_first_line(e)}"
        ) from None


def _probe(host: str, port: int, rank: int, cfg: PeerConfig) -> None:
    """Host 0: the address can be bound. Others: host 0 accepts connections there (retried
    until ``cfg.join_timeout_s``)."""
    import socket

    if rank == 0:
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, port))
        except OSError as e:
            raise ValueError(
                f"--peer-addr {cfg.peer_addr}: host 0 cannot listen there "
                f"({e.strerror or e}); is another host started with --host-rank 0?"
            ) from None
        return
    deadline = time.monotonic() + cfg.join_timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise ValueError(
                    f"--peer-addr {cfg.peer_addr}: host 0 did not answer within "
                    f"{cfg.join_timeout_s:g} s ({e.strerror or e})"
                ) from None
            time.sleep(0.1)


def _meet(store, cfg: PeerConfig, fingerprint: str):
    rank, k = cfg.host_rank, cfg.hosts
    if store.add(f"quiver/claim/{rank}", 1) > 1:
        raise ValueError(f"host rank {rank} is already taken at {cfg.peer_addr}")
    store.set(f"quiver/host/{rank}", json.dumps({"hosts": k, "fingerprint": fingerprint}))
    deadline = time.monotonic() + cfg.join_timeout_s
    checked = {rank}
    while True:
        if store.check(["quiver/abort"]):
            why = store.get("quiver/abort").decode()
            raise ValueError(f"the hosts disagree: {why}")
        for r in range(k):
            if r in checked or not store.check([f"quiver/host/{r}"]):
                continue
            other = json.loads(store.get(f"quiver/host/{r}"))
            why = None
            if other["hosts"] != k:
                why = f"host {r} was started with --hosts {other['hosts']}, host {rank} with {k}"
            elif other["fingerprint"] != fingerprint:
                why = (
                    f"host {r} serves another partition or dataset (fingerprint "
                    f"{other['fingerprint']}) than host {rank} ({fingerprint})"
                )
            if why:
                store.set("quiver/abort", why)
                if rank == 0:
                    time.sleep(0.5)  # the store lives here: let the others read why
                raise ValueError(f"the hosts disagree: {why}")
            checked.add(r)
        if len(checked) == k:
            return store
        if time.monotonic() > deadline:
            missing = sorted(set(range(k)) - checked)
            raise ValueError(
                f"hosts {missing} did not join {cfg.peer_addr} within {cfg.join_timeout_s:g} s "
                f"(this is host {rank} of {k})"
            )
        time.sleep(0.05)


class PeerFeature(DistFeature):
    """A serving host's shard: local rows from its tiers, remote rows from their owners.

    ``feature[n_id]`` returns exactly ``x[n_id]`` and is *not* collective: any thread may
    call it at any time; a responder thread answers the other hosts meanwhile (see the
    module docstring for the protocol). Build one with :meth:`from_prepared` (rendezvous
    included) or, inside an initialised default process group whose ranks are the hosts,
    directly; its timeout then bounds how long the responder may wait idle (gloo closes the
    pairs after it), so give the group a long one.

    Args:
        local, local_ids, owner: as for :class:`~quiver.feature.dist.DistFeature`.
        peer_timeout_s: seconds a gather waits for its answers before the peer is lost.
        linger_s: default of :meth:`close`'s ``linger_s``.
    """

    def __init__(self, local, local_ids, owner, peer_timeout_s: float = 10.0, linger_s=30.0):
        super().__init__(local, local_ids, owner)
        if not peer_timeout_s > 0:
            raise ValueError(f"peer_timeout_s must be > 0, got {peer_timeout_s}")
        self.peer_timeout_s = float(peer_timeout_s)
        self.linger_s = float(linger_s)
        self._row_bytes = self._dim * self._dtype.itemsize
        self._lock = threading.Lock()
        self._counter = 0
        self._lost: dict[int, str] = {}  # peer -> why it is unreachable
        self._said_bye: set[int] = set()  # peers that will send no more requests
        self._closing = False
        self._clean: bool | None = None
        self._keep: list = []  # buffers of timed-out operations: never freed under gloo
        self._owns_group = False
        self._store = None
        self._responder = threading.Thread(
            target=self._respond, name=f"quiver-responder-{self.rank}", daemon=True
        )
        self._responder.start()

    @classmethod
    def from_prepared(
        cls, directory, cfg: PeerConfig, dtype: torch.dtype | None = None, **feature_kwargs
    ) -> PeerFeature:
        """Host ``cfg.host_rank``'s shard of a partitioned prepared directory, joined to the
        other hosts: loads the owned + replicated rows (as ``dtype``, default as stored) into
        a local :class:`quiver.Feature`, meets the hosts at ``cfg.peer_addr``, builds the gloo
        group and starts the responder."""
        import torch.distributed as dist

        from quiver.datasets import load_prepared
        from quiver.feature.partition import find_partition
        from quiver.feature.store import Feature

        if dist.is_initialized():
            raise ValueError("torch.distributed is already initialised: one host per process")
        part = find_partition(cfg.partition_dir or directory)
        ds = load_prepared(directory)
        n, dim = ds.features.shape
        if part.num_nodes != n:
            raise ValueError(
                f"the partition covers {part.num_nodes} nodes, the dataset {directory} has {n}"
            )
        if part.hosts != cfg.hosts:
            raise ValueError(f"the partition is for {part.hosts} hosts, --hosts is {cfg.hosts}")
        ids = part.local_ids(cfg.host_rank)
        rows = ds.features[torch.from_numpy(ids)]
        dtype = dtype or rows.dtype
        rows = rows.to(dtype).contiguous()
        store = join_hosts(cfg, partition_fingerprint(part, n, dim, dtype))
        from torch.distributed import PrefixStore

        try:
            dist.init_process_group(
                "gloo",
                store=PrefixStore("quiver/pg", store),
                rank=cfg.host_rank,
                world_size=cfg.hosts,
                timeout=_GROUP_TIMEOUT,
            )
        except RuntimeError as e:
            raise ValueError(
                f"the hosts met at {cfg.peer_addr} but could not connect over gloo "
                f"({_first_line(e)}); set GLOO_SOCKET_IFNAME to the interface they share"
            ) from None
        local = Feature(**feature_kwargs).from_cpu_tensor(rows)
        feat = cls(local, ids, part.owner, cfg.peer_timeout_s, cfg.linger_s)
        feat._owns_group, feat._store = True, store
        feat.partition = part
        return feat

    # ----------------------------------------------------------------------------- stats

    def reset_stats(self) -> None:
        lock = getattr(self, "_lock", None)  # None while DistFeature.__init__ runs
        with lock or threading.Lock():
            super().reset_stats()
            self._stats.update(bytes_sent=0, bytes_received=0, requests_served=0, bytes_served=0)

    def stats(self) -> dict:
        """:meth:`DistFeature.stats` plus bytes sent (headers + ids) and received (rows) by
        this host's gathers, requests and bytes served to peers, and ``rows`` (local and
        remote rows read, the per-tier counts ``/metrics`` shows)."""
        with self._lock:
            s = dict(self._stats)
        s["rows"] = {"local": s["local_rows"], "remote": s["remote_rows"]}
        return s

    def _add(self, **counts) -> None:
        with self._lock:
            for k, v in counts.items():
                self._stats[k] += v

    def peers(self) -> dict:
        """``{"lost": {peer: why}, "said_bye": [peers]}``: peers this host cannot reach, and
        peers that have stopped asking."""
        with self._lock:
            return {"lost": dict(self._lost), "said_bye": sorted(self._said_bye)}

    # ---------------------------------------------------------------------------- gather

    def gather(self, n_id) -> torch.Tensor:
        """``x[n_id]``: local rows from the local store, the others from their owners in one
        exchange per call (thread-safe, not collective)."""
        n_id = torch.as_tensor(n_id, dtype=torch.int64).cpu().reshape(-1)
        n = self.owner.numel()
        if n_id.numel() and (int(n_id.min()) < 0 or int(n_id.max()) >= n):
            raise ValueError(f"node ids must lie in [0, {n})")
        pos = self._g2l[n_id]
        is_local = pos >= 0
        if bool(is_local.all()):
            self._add(local_rows=n_id.numel())
            if not n_id.numel():
                return torch.empty((0, self._dim), dtype=self._dtype)
            return self.local[pos]
        rem = torch.nonzero(~is_local).reshape(-1)
        uniq, inverse = torch.unique(n_id[rem], return_inverse=True)
        pending = self._request(uniq)  # in flight while the local rows are read
        out = torch.empty((n_id.numel(), self._dim), dtype=self._dtype)
        loc = torch.nonzero(is_local).reshape(-1)
        try:
            if loc.numel():
                out[loc] = self.local[pos[loc]]
        finally:
            fetched = self._collect(uniq, pending)
        out[rem] = fetched[inverse]
        self._add(local_rows=loc.numel(), remote_rows=uniq.numel())
        return out

    def _next_tag(self) -> int:
        with self._lock:
            self._counter += 1
            span = (_MAX_TAG - _REQ - 1) // self.world_size
            return _REQ + 1 + self.rank + self.world_size * (self._counter % span)

    def _request(self, want: torch.Tensor) -> dict:
        """Post, per owner of the distinct ids ``want``, the header, the ids and the receive
        of the answer; returns what :meth:`_collect` waits on."""
        import torch.distributed as dist

        if self._clean is not None:
            raise RuntimeError(f"host {self.rank}'s feature store is closed")
        t0 = time.perf_counter()
        dest = self.owner[want]
        order = torch.argsort(dest, stable=True)
        ids = want[order]
        counts = torch.bincount(dest, minlength=self.world_size).tolist()
        with self._lock:
            for h, c in enumerate(counts):
                if c and h in self._lost:
                    raise RuntimeError(
                        f"host {h} is unreachable ({self._lost[h]}); its rows cannot be read"
                    )
        tag = self._next_tag()
        groups, start, sent = [], 0, 0
        for h, c in enumerate(counts):
            if not c:
                continue
            part = ids[start : start + c]
            start += c
            head = torch.tensor([_ROWS, self.rank, tag, c], dtype=torch.int64)
            answer = torch.empty(c * self._row_bytes + 8, dtype=torch.uint8)
            try:
                works = [
                    dist.isend(head, dst=h, tag=_REQ),
                    dist.isend(part, dst=h, tag=tag),
                    dist.irecv(answer, src=h, tag=tag),
                ]
            except RuntimeError as e:
                with self._lock:  # what was posted may still complete into these
                    self._keep.extend(bufs for _, _, bufs in groups)
                    self._keep.append((head, part, answer))
                why = _peer_cause(e, self.peer_timeout_s)
                self._lose(h, why)
                raise RuntimeError(f"host {h} is unreachable: {why}") from None
            groups.append((h, works, (head, part, answer)))
            sent += head.numel() * 8 + part.numel() * 8
        return {"groups": groups, "order": order, "t0": t0, "sent": sent}

    def _collect(self, want: torch.Tensor, pending: dict) -> torch.Tensor:
        """Wait (with the peer deadline) for the answers of :meth:`_request`; rows of ``want``."""
        deadline = time.monotonic() + self.peer_timeout_s
        got, failure = [], None
        for h, works, bufs in pending["groups"]:
            try:
                for w in works:
                    left = max(deadline - time.monotonic(), 0.001)
                    w.wait(timedelta(seconds=left))
            except RuntimeError as e:
                with self._lock:
                    self._keep.append(bufs)  # gloo may still hold them
                why = _peer_cause(e, self.peer_timeout_s)
                self._lose(h, why)
                failure = failure or RuntimeError(
                    f"host {h} is unreachable: {why} ({bufs[1].numel()} rows not read)"
                )
                continue
            answer = bufs[2]
            # a copy: the status word's offset (count * row bytes) need not be 8-aligned
            status = int(answer[-8:].clone().view(torch.int64))
            if status != _OK:
                failure = failure or RuntimeError(
                    f"host {h} does not own rows host {self.rank} asked it for: the hosts serve "
                    "different partitions"
                )
            got.append(answer[:-8])
        if failure is not None:
            raise failure
        rows = torch.empty((want.numel(), self._dim), dtype=self._dtype)
        if want.numel():
            flat = torch.cat(got) if len(got) > 1 else got[0]
            rows[pending["order"]] = flat.view(self._dtype).reshape(-1, self._dim)
        received = sum(b[2].numel() for _, _, b in pending["groups"])
        self._add(
            exchange_s=time.perf_counter() - pending["t0"],
            gathers=1,
            bytes_sent=pending["sent"],
            bytes_received=received,
        )
        return rows

    def _lose(self, h: int, why) -> None:
        with self._lock:
            if h not in self._lost:
                self._lost[h] = (
                    why if isinstance(why, str) else _peer_cause(why, self.peer_timeout_s)
                )
                log.error("host %d: peer host %d lost: %s", self.rank, h, self._lost[h])

    # ------------------------------------------------------------------------- responder

    def _respond(self) -> None:
        """Answer the other hosts' row requests until every one of them has said BYE."""
        import torch.distributed as dist

        peers = self.world_size - 1
        sending: list = []  # (work, buffer) of answers still being sent
        while True:
            with self._lock:
                if len(self._said_bye) >= peers:
                    break
            head = torch.empty(_HEADER, dtype=torch.int64)
            try:
                dist.irecv(head, src=None, tag=_REQ).wait()
            except RuntimeError as e:
                log.error(
                    "host %d: responder stopped: %s", self.rank, _peer_cause(e, self.peer_timeout_s)
                )
                return
            kind, src, tag, count = head.tolist()
            if kind == _BYE:
                with self._lock:
                    self._said_bye.add(src)
                continue
            try:
                ids = torch.empty(count, dtype=torch.int64)
                dist.irecv(ids, src=src, tag=tag).wait(timedelta(seconds=self.peer_timeout_s))
                answer = self._answer(ids)
                sending.append((dist.isend(answer, dst=src, tag=tag), answer))
            except RuntimeError as e:
                self._lose(src, e)
                continue
            self._add(served_rows=count, requests_served=1, bytes_served=answer.numel())
            sending = self._reap(sending, block=len(sending) > 64)
        self._reap(sending, block=True)

    def _answer(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` as bytes followed by a status word (``[count * row_bytes + 8]``)."""
        out = torch.zeros(ids.numel() * self._row_bytes + 8, dtype=torch.uint8)
        if not ids.numel():
            return out
        n = self.owner.numel()
        pos = self._g2l[ids.clamp(0, n - 1)]
        if int(ids.min()) < 0 or int(ids.max()) >= n or bool((pos < 0).any()):
            out[-8:] = torch.tensor([_NOT_OWNED], dtype=torch.int64).view(torch.uint8)
            return out
        out[:-8] = self.local[pos].contiguous().view(torch.uint8).reshape(-1)
        return out

    def _reap(self, sending: list, block: bool) -> list:
        keep = []
        for w, buf in sending:
            if block or w.is_completed():
                try:
                    w.wait(timedelta(seconds=self.peer_timeout_s))
                except RuntimeError as e:
                    log.warning("host %d: an answer was not delivered: %s", self.rank, e)
                    with self._lock:
                        self._keep.append(buf)
            else:
                keep.append((w, buf))
        return keep

    # -------------------------------------------------------------------------- shutdown

    def close(self, linger_s: float | None = None) -> bool:
        """Tell every peer this host asks no more (``BYE``), keep answering until each peer
        said ``BYE`` too (at most ``linger_s``, default the constructor's), then destroy the
        process group if :meth:`from_prepared` built it.

        Returns True when the responder ended (every peer said ``BYE``); False when a peer
        still serves or was lost: its thread is then left waiting (a daemon), and a process
        that exits now should leave with ``os._exit`` rather than run gloo's destructors.
        Idempotent.
        """
        import torch.distributed as dist

        with self._lock:
            if self._closing:
                return bool(self._clean)
            self._closing = True
        linger = self.linger_s if linger_s is None else float(linger_s)
        bye = torch.tensor([_BYE, self.rank, 0, 0], dtype=torch.int64)
        for h in range(self.world_size):
            if h == self.rank or h in self._lost:
                continue
            try:
                dist.isend(bye, dst=h, tag=_REQ).wait(timedelta(seconds=self.peer_timeout_s))
            except RuntimeError as e:
                self._lose(h, _peer_cause(e, self.peer_timeout_s))
        deadline = time.monotonic() + linger
        while self._responder.is_alive() and time.monotonic() < deadline:
            with self._lock:
                waiting = set(range(self.world_size)) - {self.rank} - self._said_bye
                if waiting <= set(self._lost):
                    break  # only lost peers left: none of them will say BYE
            self._responder.join(0.05)
        self._clean = not self._responder.is_alive()
        if self._clean and self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._store = None
        return self._clean

    def __repr__(self) -> str:
        return (
            f"PeerFeature(host={self.rank}/{self.world_size}, rows={self.owner.numel()}, "
            f"local={self.local_ids.numel()}, dim={self._dim}, dtype={self._dtype})"
        )


def _peer_cause(e, timeout_s: float) -> str:
    """Why a peer could not be reached, in words without the transport's own text (gloo's
    messages carry source paths, addresses and "GLHF! 🏖️"); that text goes to the debug log."""
    log.debug("peer transport error: %s", e)
    text = str(e).lower()
    if "timed out" in text or "timeout" in text:
        return f"no answer within {timeout_s:g} s"
    if any(w in text for w in ("closed", "reset", "refused", "broken pipe", "connection", "glhf")):
        return "connection lost"
    return f"transport error ({type(e).__name__})"


def _first_line(e) -> str:
    text = str(e).strip()
    # gloo's messages start with the source location: keep what follows it
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return (text.splitlines() or [""])[0][:200]
