"""``quiver.Server``: a dataset, a checkpoint and an engine in one object, with optional HTTP.

Example::

    server = quiver.Server.from_dataset("data/products", "ckpt.pt")
    with server:                                  # starts the engine (no HTTP)
        print(server.predict([1, 2, 3]).values)
    server.start(port=8000)                       # engine + HTTP on 127.0.0.1:8000
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import torch

from quiver.serving.config import ServeConfig
from quiver.serving.engine import Engine

log = logging.getLogger("quiver.serving")


class Server:
    """An in-process Quiver server around an ``Engine``.

    Args:
        engine: the configured engine (see :meth:`from_dataset` to build one).
        info: a short description printed at start (what is served, which paths).
    """

    def __init__(self, engine: Engine, info: str = ""):
        self.engine = engine
        self.info = info
        self.http = None
        #: the host's ``quiver.feature.peer.PeerFeature`` when serving a partition's shard
        self.peers = None
        #: after :meth:`stop`: False when a peer still served (or was lost) past the linger
        self.stopped_cleanly = True
        #: the live graph (``quiver.serving.live``) when serving with updates, else None
        self.live = None
        self._lock = None

    @classmethod
    def from_dataset(
        cls,
        dataset_dir,
        checkpoint,
        cfg: ServeConfig | None = None,
        fanouts=None,
        seed: int | None = None,
        feature_cache: str | int = 0,
        hybrid: bool = True,
        device=None,
        gpu_cache: str | int = "4G",
        sampler_threads: int | None = None,
        model: str | None = None,
        trust_pickle: bool = False,
        convention: str | None = None,
        precision: str = "fp32",
        peers=None,
        fold: str = "auto",
        updates: bool = False,
    ) -> Server:
        """Build a server for a prepared dataset and a model.

        Args:
            dataset_dir: a directory written by ``quiver prepare``.
            checkpoint: a ``state_dict`` file for the module ``model`` builds, a
                ``torch.export`` archive, a ``quiver train-model`` checkpoint, or (with
                ``trust_pickle``) a module saved whole (see ``quiver.usermodel``).
            cfg: serving config (defaults: ``ServeConfig()``).
            fanouts: sampling fanouts, one per layer; default the checkpoint's, else the
                manifest's.
            seed: sampling seed (fix it for reproducible answers).
            feature_cache: bytes of hot feature rows kept in RAM (FAP order) when the features
                are served from the memory-mapped file; 0 keeps all rows as loaded.
            hybrid: route batches by PSGS between CPU and GPU sampling when a GPU and a
                calibration exist; otherwise sample on CPU threads.
            device: where the model runs (default CPU); with a CUDA device the hottest feature
                rows (FAP order) are cached on it and the rest read zero-copy from pinned host
                memory.
            gpu_cache: bytes of feature rows cached on ``device`` when it is a GPU.
            sampler_threads: threads one CPU sampling call may use for a large hop (default:
                all cores; 1 with ``cfg.num_lanes``, whose lanes sample and gather on their own
                thread). 1 leaves parallelism to the ``num_sampler_workers`` batches in flight
                and avoids waking an idle core per request.
            model: ``package.module:function`` that builds the module a ``state_dict``
                checkpoint is for (called without arguments).
            trust_pickle: allow a checkpoint that unpickles arbitrary objects.
            convention: the model's input, ``"edge_index"``, ``"subgraph"`` or ``"adjs"``
                (see ``quiver.usermodel.ServedModel``; default: from its
                ``forward`` signature).
            precision: ``"fp32"`` (default: as trained), ``"bf16"`` (feature rows gathered in
                bf16, converted at load unless stored so, and the model's weights in bf16), or
                ``"auto"``: per stage the faster on this CPU, from the manifest's
                ``"precision"`` records when one was measured on this machine (CPU model, bf16
                flags, cores: ``quiver.precision.machine``) for these weights and fanouts,
                else measured now
                (``quiver.precision.measure_precision``, a few seconds) and recorded there.
                Logits and embeddings are fp32 either way. A bf16-stored dataset (``quiver
                prepare --feature-dtype bf16``) is gathered in bf16 under every setting.
            peers: a ``quiver.feature.peer.PeerConfig``: serve as one host of a ``quiver
                partition`` of the dataset. The host holds its owned + replicated rows in RAM
                and fetches the others from their owners (one exchange per batch), answering
                the other hosts' requests meanwhile; building the server waits for every host
                to join (``peers.join_timeout_s``). Not with ``feature_cache``.
            fold: ``"auto"`` (default), ``"on"`` or ``"off"``: fold a SAGE model's first
                layer into the feature table (``quiver.serving.folded``): two ``(N, hidden)``
                tables replace the ``(N, F)`` features, and layer 1 becomes a gather with no
                GEMM. ``"auto"`` folds when the model allows it, the features are served from
                RAM on the CPU, the tables fit in half the available memory, and the folded
                path is measured faster on sampled batches at start-up. That decision (and
                the tables' dtype) is recorded in the manifest (``"fold"``,
                ``quiver.serving.folded.FoldChoice``, one record per machine, weights,
                precision and fanouts) and reused as is by later starts on this machine with
                these weights, precision and fanouts, so they serve the same logits;
                re-measuring the precision drops it. ``"on"`` folds or refuses in one
                line.
            updates: take updates (``POST /v1/update``, :meth:`update`; see
                ``quiver.serving.live``), logged durably to the dataset directory's
                ``updates.log`` and replayed now; the directory is locked against a second
                server. Sampling then runs on the CPU; ``peers`` is refused.
        """
        from quiver.precision import PRECISIONS

        if precision not in PRECISIONS:
            raise ValueError(
                f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}"
            )
        if device is not None:
            try:
                device = torch.device(device)
            except RuntimeError as e:
                raise ValueError(f"--device {device!s}: {str(e).splitlines()[0]}") from None
            if device.type not in ("cpu", "cuda"):
                raise ValueError(f"--device {device}: only cpu and cuda devices are supported")
        device = device if device is not None else torch.device("cpu")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {device} requested but CUDA is not available")
        lock = None
        if updates:
            if peers is not None:
                raise ValueError(
                    "a partition's host (--host-rank) serves read-only: add --read-only "
                    "(updates would have to reach every host's shard)"
                )
            from quiver.hetero.updates import dataset_lock

            lock = dataset_lock(dataset_dir)
        try:
            return cls._build(
                dataset_dir, checkpoint, cfg, fanouts, seed, feature_cache, hybrid, device,
                gpu_cache, sampler_threads, model, trust_pickle, convention, precision, peers,
                fold, lock,
            )  # fmt: skip
        except BaseException:
            if lock is not None:
                lock.close()
            raise

    @classmethod
    def _build(
        cls, dataset_dir, checkpoint, cfg, fanouts, seed, feature_cache, hybrid, device,
        gpu_cache, sampler_threads, model, trust_pickle, convention, precision, peers, fold,
        lock,
    ) -> Server:  # fmt: skip
        """:meth:`from_dataset`'s work, with the dataset directory locked when ``lock``."""
        from quiver.datasets import load_prepared
        from quiver.pyg import GraphSageSampler
        from quiver.usermodel import heterogeneous_parts, load_served_model

        ds = load_prepared(dataset_dir)
        if ds.features.shape[0] != ds.num_nodes:
            raise ValueError(
                f"{ds.data_path / 'features.npy'} has {ds.features.shape[0]} rows but the "
                f"graph has {ds.num_nodes} nodes"
            )
        net, minfo = load_served_model(checkpoint, model, trust_pickle, convention)
        hetero = heterogeneous_parts(net)
        if hetero is not None:
            raise ValueError(
                f"--checkpoint {checkpoint} is a heterogeneous model checkpoint ({hetero}) and "
                f"{dataset_dir} is a homogeneous dataset; serve it on a heterogeneous dataset "
                "directory (quiver prepare --hetero)"
            )
        served = net  # the ServedModel (before any precision wrapper): its edge feature rows
        edge_info = _use_edge_features(net, ds, dataset_dir, minfo["kind"])
        fanouts = [int(k) for k in (fanouts or minfo["fanouts"] or ds.manifest.get("fanouts"))]
        if any(k == 0 or k < -1 for k in fanouts):
            raise ValueError(f"--fanouts must be positive or -1 (all neighbours), got {fanouts}")
        if minfo["num_layers"] and len(fanouts) != minfo["num_layers"]:
            extra = (
                " (the extra hop its degree normalisation needs is sampled without one)"
                if minfo["extra_hops"]
                else ""
            )
            if minfo.get("hop_detail"):  # a multi-hop layer (SGConv K, ChebConv K - 1, ...)
                raise ValueError(
                    f"{len(fanouts)} fanouts {fanouts} but the model propagates "
                    f"{minfo['num_layers']} hops ({minfo['hop_detail']}); give "
                    f"{minfo['num_layers']} fanouts, one per hop, with --fanouts{extra}"
                )
            raise ValueError(
                f"{len(fanouts)} fanouts {fanouts} but the model has {minfo['num_layers']} "
                f"message-passing layers; give one per layer with --fanouts{extra}"
            )
        in_dim = minfo.get("in_dim")
        if in_dim is not None and in_dim != ds.features.shape[1]:
            raise ValueError(
                f"checkpoint expects {in_dim} features per node; the dataset has "
                f"{ds.features.shape[1]}"
            )
        # extra hops (degree-normalised models, see quiver.usermodel) sample at the outer fanout
        sizes = fanouts + fanouts[-1:] * minfo["extra_hops"]
        pad_info = ""
        if getattr(net, "sequence_aggregation", False):
            # an LSTM/GRU aggregation pads every neighbour list to the longest in its subgraph:
            # one fixed length for every batch (see quiver.usermodel.ServedModel.pad_neighbours)
            most = int(ds.topo.degree.max()) if ds.num_nodes else 0
            net.pad_neighbours = max(most if k < 0 else min(k, most) for k in sizes)
            pad_info = f", neighbour sequences padded to {net.pad_neighbours}"
        if minfo.get("out_degrees"):
            from quiver.usermodel import graph_is_symmetric

            if not graph_is_symmetric(ds.topo):  # said, not silent (quiver.usermodel)
                note = (
                    "ChebConv's out-degrees are sampled exactly only on a symmetric graph and "
                    "this one is not: answers differ from the full-graph forward"
                )
                pad_info += f", {note}"
                log.warning("%s: %s", minfo["kind"], note)
        frontier = minfo["frontier"]
        cfg = cfg or ServeConfig()
        if cfg.num_lanes > 0 and sampler_threads is None:
            # a lane runs its sampling and gather on its own thread: the lanes are the
            # parallelism, and helper threads would contend with the other lanes for the cores
            sampler_threads = 1
        gather_threads = 1 if cfg.num_lanes > 0 else None
        net.to(device)
        _check_model_runs(net, ds, sizes, frontier, device, dataset_dir)
        choice, how = _precision_choice(
            precision, ds, net, sizes, frontier, device, cfg, sampler_threads
        )
        features = ds.features
        stored_bf16 = features.dtype == torch.bfloat16
        gather = "bf16" if stored_bf16 else choice.gather
        from_file = True  # else the bf16 rows converted in RAM feed --feature-cache
        if peers is not None and feature_cache:
            raise ValueError(
                "--feature-cache does not apply to a partition's host (--host-rank): it holds "
                "its shard in RAM"
            )
        if choice.gather == "bf16" and not stored_bf16 and peers is None:
            from quiver.feature.sizes import parse_bytes

            cache = parse_bytes(feature_cache or 0, "feature_cache")
            if feature_cache and device.type == "cpu" and cache < features.numel() * 2:
                gather = "fp32"
                how += "; fp32 rows: a partial --feature-cache reads the file as stored"
            else:
                features = features.to(torch.bfloat16)  # converted once, in RAM
                from_file = False
        from quiver.precision import DTYPES, PrecisionModel

        raw_net = net
        net = PrecisionModel.wrap(net, DTYPES[choice.model], DTYPES[gather])
        precision_info = f"precision: gather {gather}, model {choice.model} ({how})"
        folded, fold_info = _fold_choice(
            fold,
            raw_net,
            net,
            ds,
            features,
            DTYPES[gather],
            DTYPES[choice.model],
            dict(peers=peers, feature_cache=feature_cache, device=device),
            sizes,
            frontier,
            cfg,
            sampler_threads,
        )
        rows_table = features  # the raw rows as served (a folded store derives from them)
        if folded is not None:
            features, net = folded, folded.tail
        peer_features, peer_info = None, ""
        if folded is not None:
            pass  # the folded tables are the store
        elif peers is not None:
            features, peer_info = _peer_features(dataset_dir, peers, DTYPES[gather], gather_threads)
            peer_features = features
        elif device.type == "cuda":
            from quiver.feature import Feature

            features = Feature(
                0, [device], gpu_cache, csr_topo=ds.topo, sizes=fanouts
            ).from_cpu_tensor(torch.as_tensor(features))
        elif feature_cache:
            from quiver.feature import Feature

            store = Feature(
                0,
                [],
                0,
                csr_topo=ds.topo,
                sizes=fanouts,
                host_cache_size=feature_cache,
                num_threads=gather_threads,
            )
            if from_file:
                path = ds.data_path / "features.npy"
                features = store.from_mmap(path, dtype=ds.features.dtype)
            else:
                features = store.from_cpu_tensor(features)
        sampler = None
        path_info = "CPU sampling (numba threads)"
        calib = ds.manifest.get("calibration")
        live = None
        if lock is not None:
            from quiver.serving.live import LiveEdgeRows, LiveSampler, open_live

            # the rows as served: the store below (FAP cache) or, folded, the rows it folds
            table = features if folded is None else rows_table
            live = open_live(ds, table, folded=folded)  # replays the update log
            sampler = LiveSampler(sizes, seed=seed, frontier=frontier)
            path_info = "CPU sampling of the live graph"
            if getattr(served, "_edges", None) is not None:  # added edges bring their rows
                served._edges.table = LiveEdgeRows(live)
        if sampler is None and hybrid and torch.cuda.is_available() and calib:
            from quiver.hybrid import HybridSampler

            sampler = HybridSampler(
                ds.topo, sizes, threshold=calib["threshold"], seed=seed, frontier=frontier
            )
            path_info = f"hybrid CPU/GPU sampling, PSGS threshold {calib['threshold']:.0f}"
        if sampler is None:
            sampler = GraphSageSampler(
                ds.topo,
                sizes,
                mode="CPU",
                seed=seed,
                num_threads=sampler_threads,
                frontier=frontier,
            )
            if hybrid and not torch.cuda.is_available():
                path_info += "; no CUDA device, so no GPU path"
        psgs_table = None
        if cfg.max_batch_psgs is not None:
            from quiver.workload import psgs

            psgs_table = psgs(ds.topo, sizes, frontier=frontier).numpy()
        node_count = ds.num_nodes if live is None else live.num_nodes["node"]
        engine = Engine(sampler, features, net, node_count, cfg, psgs_table=psgs_table, live=live)
        name = ds.manifest.get("name", Path(dataset_dir).name)
        extra = f" (+{minfo['extra_hops']} degree hop)" if minfo["extra_hops"] else ""
        info = (
            f"{name}: {ds.num_nodes:,} nodes, {ds.topo.edge_count:,} edges; "
            f"{minfo['kind']}, input {minfo['convention']}{edge_info}, fanouts {fanouts}{extra}"
            f"{pad_info}; "
            f"{path_info}; model on {device}; {precision_info}{fold_info}{peer_info}"
        )
        if live is not None:
            info += f"; updates on (replayed to seq {live.seq})"
        server = cls(engine, info)
        server.peers = peer_features
        server.live = live
        server._lock = lock
        if live is not None:
            live.listeners.append(server._on_update)
            server._on_update("add_nodes", {})  # nodes the replayed log added
        return server

    def _on_update(self, op: str, record: dict) -> None:
        """New nodes are served at once: the engine's id range and PSGS table grow (new rows
        get the mean PSGS until a compaction and restart recompute it)."""
        if op != "add_nodes":
            return
        self.engine.grow_nodes(self.live.num_nodes["node"])

    def update(self, record: dict) -> dict:
        """Apply one update (``quiver.hetero.updates.LiveGraph.update``; ``node_type`` and
        ``edge_type`` may be left out on this one-type graph); durable when this returns.

        Raises:
            UpdateError: a bad update (its ``status`` is the HTTP one; 403 on a server
                started without updates); nothing changed.
        """
        from quiver.hetero.updates import UpdateError

        if self.live is None:
            raise UpdateError(
                "this server takes no updates (started read-only: --read-only, --replicas or "
                "--host-rank)",
                status=403,
            )
        from quiver.serving.live import with_defaults

        return self.live.update(with_defaults(record))

    def start(self, host: str = "127.0.0.1", port: int | None = None) -> Server:
        """Warm up, start the engine; with ``port`` (0 = any free one) also serve HTTP.

        Raises ``ValueError`` (one line) when the model fails on its first sampled subgraph.
        """
        try:
            self.engine.warmup()
        except Exception as e:
            shape = getattr(self.engine.features, "shape", None)  # a folded store: hidden wide
            raise ValueError(_model_failure(e, int(shape[1]) if shape else -1)) from None
        self.engine.start()
        if port is not None and self.http is None:
            from quiver.serving.app import create_app
            from quiver.serving.http import HTTPThread

            self.http = HTTPThread(create_app(self.engine, self.update), host, port).start()
        return self

    @property
    def url(self) -> str | None:
        return self.http.url if self.http else None

    def predict(self, nodes, output: str = "class", timeout: float | None = 60.0):
        """In-process prediction (see ``Engine.predict``)."""
        return self.engine.predict(nodes, output, timeout)

    def stop(self) -> None:
        """Stop HTTP first (no new requests), then drain and stop the engine; a partition's
        host then leaves its peers (``PeerFeature.close``: it keeps answering them until they
        stop too, at most ``linger_s``; :attr:`stopped_cleanly` says whether they did)."""
        if self.http is not None:
            self.http.stop()
            self.http = None
        self.engine.stop()
        if self.peers is not None:
            self.stopped_cleanly = self.peers.close()
        if self.live is not None and self.live.log is not None:
            self.live.log.close()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


#: a matrix product given rows of the wrong width: ``(rows x width and in x out)``
_MATMUL_WIDTHS = re.compile(r"mat1 and mat2 shapes cannot be multiplied \((\d+)x(\d+) and (\d+)x")
#: a torch.export program's input guard on its first argument's width
_EXPORT_WIDTH = re.compile(r"Guard failed: \w+\.size\(\)\[1\] == (\d+)")


def _model_failure(e: BaseException, width: int, where: str = "the dataset") -> str:
    """One line for a model that failed on the dataset's rows, naming both widths when the
    failure is the model's input width (``width``: features per node of ``where``)."""
    text = str(e)
    expected = None
    m = _MATMUL_WIDTHS.search(text)
    if m and int(m.group(2)) == width and int(m.group(3)) != width:
        expected = int(m.group(3))
    m = _EXPORT_WIDTH.search(text)
    if m and int(m.group(1)) != width:
        expected = int(m.group(1))
    if expected is not None:
        return (
            f"the model takes {expected} features per node but {where} has {width}: serve it on "
            f"a dataset prepared with {expected}-wide features, or a model trained on these"
        )
    first = (text.strip().splitlines() or [""])[0]
    return f"the model failed on a sampled subgraph at start-up: {type(e).__name__}: {first}"


def _use_edge_features(net, ds, dataset_dir, kind: str) -> str:
    """Hand the dataset's edge features to a model whose forward takes ``edge_attr`` (see
    ``quiver.usermodel``); returns the note for the start-up line. A model that needs them on a
    dataset without them is refused in one line naming the missing file."""
    if not getattr(net, "takes_edge_attr", False):
        return ""
    if ds.edge_features is None:
        if net.needs_edge_attr:
            missing = ds.data_path / "edge_features.npy"
            raise ValueError(
                f"{kind}: its forward needs edge_attr, but {missing} does not exist; prepare "
                "the dataset with --edge-features FILE.npy"
            )
        return ""
    net.use_edge_features(ds.edge_features)
    return f" + edge_attr ({ds.edge_features.shape[1]} per edge)"


def _check_model_runs(net, ds, sizes, frontier, device, dataset_dir) -> None:
    """Run the fp32 model on one sampled node before anything is measured or built, so a model
    that cannot take the dataset's rows (their width above all) is refused in one line."""
    from quiver.pyg import GraphSageSampler

    if ds.num_nodes == 0:
        return
    sampler = GraphSageSampler(ds.topo, sizes, mode="CPU", seed=0, num_threads=1, frontier=frontier)
    n_id, _, adjs = sampler.sample(torch.zeros(1, dtype=torch.int64))
    x = torch.as_tensor(ds.features[n_id]).to(device, torch.float32)
    adjs = [(ei.to(device), eid, size) for ei, eid, size in adjs]
    try:
        with torch.inference_mode():
            net(x, adjs)
    except Exception as e:
        where = f"{ds.data_path / 'features.npy'}"
        raise ValueError(_model_failure(e, x.shape[1], where)) from None


def _peer_features(dataset_dir, peers, dtype, num_threads=None):
    """``(PeerFeature, info)`` of this host's shard, joined to the other hosts."""
    from quiver.feature.peer import PeerFeature

    feat = PeerFeature.from_prepared(dataset_dir, peers, dtype=dtype, num_threads=num_threads)
    part = feat.partition
    owned = int((part.owner == peers.host_rank).sum())
    local = feat.local_ids.numel()
    info = (
        f"; features: host {peers.host_rank} of {peers.hosts}, {local:,} rows local ({owned:,} "
        f"owned + {local - owned:,} replicated of {part.num_nodes:,}), the rest from their "
        f"owners over gloo (rendezvous {peers.peer_addr})"
    )
    return feat, info


def _fold_choice(
    fold,
    raw_net,
    net,
    ds,
    features,
    table_dtype,
    model_dtype,
    where,
    sizes,
    frontier,
    cfg,
    sampler_threads,
):
    """``(FoldedFirstLayer or None, info)`` for ``Server.from_dataset``'s ``fold``."""
    from quiver.serving.folded import (
        FOLD_CHOICES,
        FoldedFirstLayer,
        fold_table_bytes,
        measure_fold,
        why_not_foldable,
    )

    if fold not in FOLD_CHOICES:
        raise ValueError(
            f"--fold-first-layer must be one of {', '.join(FOLD_CHOICES)}, got {fold!r}"
        )
    if fold == "off":
        return None, ""
    reason = why_not_foldable(raw_net)
    if reason is None and where["device"].type != "cpu":
        reason = f"the model runs on {where['device']}"
    if reason is None and where["peers"] is not None:
        reason = "a partition's host (--host-rank) serves its shard of the raw features"
    if reason is None and where["feature_cache"]:
        from quiver.feature.sizes import parse_bytes

        full = ds.features.numel() * ds.features.element_size()
        if parse_bytes(where["feature_cache"], "feature_cache") < full:
            reason = "a partial --feature-cache serves the raw features from the memory-mapped file"
    # "auto" also measures an fp32 table when the gather runs in bf16: a bf16 neighbour mean
    # is not faster on every CPU (converting rows can cost more than the bytes it saves)
    build_dtype = torch.float32 if fold == "auto" else table_dtype
    stored = want = None
    if fold == "auto" and reason is None:
        # decided once per machine, model, precision and fanouts: a restart reuses the stored
        # decision as a whole (the same tables, the same logits) and measures nothing
        from quiver.precision import model_id, weights_id
        from quiver.serving.folded import FoldChoice, read_fold

        want = FoldChoice(
            folded=False,
            gather=_DTYPE_NAMES[table_dtype],
            model=_DTYPE_NAMES[model_dtype],
            sizes=[int(k) for k in sizes],
            model_id=model_id(raw_net),
            weights=weights_id(raw_net),
        )
        stored = read_fold(ds.manifest, want)
        if stored is not None and not stored.folded:
            return None, f"; first layer not folded ({stored.summary}; auto, from the manifest)"
        if stored is not None:
            build_dtype = DTYPES_BY_NAME[stored.table]
    if reason is None:
        need = fold_table_bytes(raw_net, ds.num_nodes, build_dtype)
        avail = _available_ram()
        if avail is not None and need > (avail // 2 if fold == "auto" else avail):
            reason = f"its tables need {_gib(need)} and {_gib(avail)} of RAM is available" + (
                " (auto folds within half of it)" if fold == "auto" else ""
            )
    if reason is not None:
        if fold == "on":
            raise ValueError(f"--fold-first-layer on: cannot fold: {reason}")
        return None, f"; first layer not folded ({reason})"
    from quiver.precision import PrecisionModel

    folded = FoldedFirstLayer(raw_net, ds.features, dtype=build_dtype, progress=sys.stderr.isatty())
    folded.tail = PrecisionModel.wrap(folded.tail, model_dtype, torch.float32)
    built = f"built in {folded.build_s:.1f} s"
    how = ""
    if stored is not None:
        how = f"; {stored.summary}; auto, from the manifest"
    elif fold == "auto":
        from quiver.pyg import GraphSageSampler

        folds = {_DTYPE_NAMES[build_dtype]: folded}
        if table_dtype != build_dtype:
            folds[_DTYPE_NAMES[table_dtype]] = folded.to(table_dtype)
        sampler = GraphSageSampler(
            ds.topo, sizes, mode="CPU", seed=0, num_threads=sampler_threads, frontier=frontier
        )
        m = measure_fold(
            sampler, features, net, folds, ds.num_nodes, repeats=2, num_threads=cfg.torch_threads
        )
        best = min(m["folded_s"], key=m["folded_s"].get)
        speed = m["unfolded_s"] / max(m["folded_s"][best], 1e-9)
        if not m["folded_s"][best] < 0.95 * m["unfolded_s"]:
            want.summary = (
                f"measured {speed:.2f}x the unfolded gather + model speed on sampled batches"
            )
            _record_fold(ds, want)
            return None, f"; first layer not folded ({want.summary})"
        folded = folds[best]
        want.summary = f"gather + model {speed:.2f}x faster on sampled batches"
        if len(folds) > 1:
            other = next(n for n in folds if n != best)
            ratio = m["folded_s"][other] / m["folded_s"][best]
            want.summary += f", {best} tables {ratio:.2f}x {other}"
        want.folded, want.table = True, best
        _record_fold(ds, want)
        how = f"; {want.summary}"
    shape = folded.describe()  # e.g. "2 x 1,000 x 128 fp32"
    info = f"; first layer folded into {shape} tables ({_gib(folded.nbytes)}, {built}{how})"
    return folded, info


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
DTYPES_BY_NAME = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


def _record_fold(ds, choice) -> None:
    """Store a measured ``FoldChoice`` in the dataset's manifest (a warning when it cannot)."""
    from quiver.serving.folded import write_fold

    if ds.path is None:
        return
    try:
        write_fold(Path(ds.path) / "manifest.json", choice)
    except OSError as e:
        log.warning("could not record the fold decision in %s: %s", ds.path, e)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _available_ram() -> int | None:
    """``MemAvailable`` from /proc/meminfo in bytes (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _precision_choice(precision, ds, net, sizes, frontier, device, cfg, sampler_threads):
    """``(PrecisionChoice, how it was decided)`` for ``Server.from_dataset``'s ``precision``."""
    from quiver.precision import (
        PRECISIONS,
        PrecisionChoice,
        measure_precision,
        read_precision,
        stored_records,
        write_precision,
    )

    if precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision != "auto":
        return PrecisionChoice.fixed(precision), "as asked"
    if device.type != "cpu":
        return PrecisionChoice.fixed("fp32"), f"auto measures CPU models only; model on {device}"
    choice = read_precision(ds.manifest, model=net, sizes=sizes)
    if choice is not None:
        how = f"auto, from the manifest: measured on {choice.where()}"
        return choice, how + (f"; {choice.note}" if choice.note else "")
    from quiver.pyg import GraphSageSampler

    # a sampler of its own, so a seeded serving sampler's stream is not advanced
    sampler = GraphSageSampler(
        ds.topo, sizes, mode="CPU", seed=0, num_threads=sampler_threads, frontier=frontier
    )
    choice = measure_precision(
        sampler, ds.features, net, ds.num_nodes, repeats=2, num_threads=cfg.torch_threads
    )
    how = f"auto, measured now on {choice.where()}"
    # this model's fold decisions were measured on top of another precision (write_precision)
    ds.manifest["fold"] = [
        d for d in stored_records(ds.manifest, "fold") if d.get("weights") != choice.weights
    ]
    if ds.path is not None:
        try:
            write_precision(Path(ds.path) / "manifest.json", choice)
            how += ", recorded in the manifest"
        except OSError as e:
            log.warning("could not record the precision choice in %s: %s", ds.path, e)
    if choice.note:  # why a stage stayed fp32 (e.g. the bf16 model's answers disagree)
        how += f"; {choice.note}"
    return choice, how
