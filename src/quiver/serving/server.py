"""``quiver.Server``: a dataset, a checkpoint and an engine in one object, with optional HTTP.

Example::

    server = quiver.Server.from_dataset("data/products", "ckpt.pt")
    with server:                                  # starts the engine (no HTTP)
        print(server.predict([1, 2, 3]).values)
    server.start(port=8000)                       # engine + HTTP on 127.0.0.1:8000
"""

from __future__ import annotations

import logging
from pathlib import Path

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
                all cores). 1 leaves parallelism to the ``num_sampler_workers`` batches in
                flight and avoids waking an idle core per request.
            model: ``package.module:function`` that builds the module a ``state_dict``
                checkpoint is for (called without arguments).
            trust_pickle: allow a checkpoint that unpickles arbitrary objects.
            convention: the model's input, ``"edge_index"`` or ``"adjs"`` (default: from its
                ``forward`` signature).
        """
        import torch

        from quiver.datasets import load_prepared
        from quiver.pyg import GraphSageSampler
        from quiver.usermodel import load_served_model

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
        ds = load_prepared(dataset_dir)
        if ds.features.shape[0] != ds.num_nodes:
            raise ValueError(
                f"{Path(dataset_dir) / 'features.npy'} has {ds.features.shape[0]} rows but the "
                f"graph has {ds.num_nodes} nodes"
            )
        net, minfo = load_served_model(checkpoint, model, trust_pickle, convention)
        fanouts = [int(k) for k in (fanouts or minfo["fanouts"] or ds.manifest.get("fanouts"))]
        if any(k == 0 or k < -1 for k in fanouts):
            raise ValueError(f"--fanouts must be positive or -1 (all neighbours), got {fanouts}")
        if minfo["num_layers"] and len(fanouts) != minfo["num_layers"]:
            raise ValueError(
                f"{len(fanouts)} fanouts {fanouts} but the model has {minfo['num_layers']} "
                "message-passing layers; give one per layer with --fanouts"
            )
        in_dim = minfo.get("in_dim")
        if in_dim is not None and in_dim != ds.features.shape[1]:
            raise ValueError(
                f"checkpoint expects {in_dim} features per node; the dataset has "
                f"{ds.features.shape[1]}"
            )
        # extra hops (degree-normalised models, see quiver.usermodel) sample at the outer fanout
        sizes = fanouts + fanouts[-1:] * minfo["extra_hops"]
        frontier = minfo["frontier"]
        cfg = cfg or ServeConfig()
        net.to(device)
        features = ds.features
        if device.type == "cuda":
            from quiver.feature import Feature

            features = Feature(
                0, [device], gpu_cache, csr_topo=ds.topo, sizes=fanouts
            ).from_cpu_tensor(torch.as_tensor(ds.features))
        elif feature_cache:
            from quiver.feature import Feature

            features = Feature(
                0, [], 0, csr_topo=ds.topo, sizes=fanouts, host_cache_size=feature_cache
            ).from_mmap(Path(dataset_dir) / "features.npy")
        sampler = None
        path_info = "CPU sampling (numba threads)"
        calib = ds.manifest.get("calibration")
        if hybrid and torch.cuda.is_available() and calib:
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
        engine = Engine(sampler, features, net, ds.num_nodes, cfg, psgs_table=psgs_table)
        name = ds.manifest.get("name", Path(dataset_dir).name)
        extra = f" (+{minfo['extra_hops']} degree hop)" if minfo["extra_hops"] else ""
        info = (
            f"{name}: {ds.num_nodes:,} nodes, {ds.topo.edge_count:,} edges; "
            f"{minfo['kind']}, input {minfo['convention']}, fanouts {fanouts}{extra}; "
            f"{path_info}; model on {device}"
        )
        return cls(engine, info)

    def start(self, host: str = "127.0.0.1", port: int | None = None) -> Server:
        """Warm up, start the engine; with ``port`` (0 = any free one) also serve HTTP.

        Raises ``ValueError`` (one line) when the model fails on its first sampled subgraph.
        """
        try:
            self.engine.warmup()
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0]
            raise ValueError(
                f"the model failed on a sampled subgraph at start-up: {type(e).__name__}: {first}"
            ) from None
        self.engine.start()
        if port is not None and self.http is None:
            from quiver.serving.app import create_app
            from quiver.serving.http import HTTPThread

            self.http = HTTPThread(create_app(self.engine), host, port).start()
        return self

    @property
    def url(self) -> str | None:
        return self.http.url if self.http else None

    def predict(self, nodes, output: str = "class", timeout: float | None = 60.0):
        """In-process prediction (see ``Engine.predict``)."""
        return self.engine.predict(nodes, output, timeout)

    def stop(self) -> None:
        """Stop HTTP first (no new requests), then drain and stop the engine."""
        if self.http is not None:
            self.http.stop()
            self.http = None
        self.engine.stop()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
