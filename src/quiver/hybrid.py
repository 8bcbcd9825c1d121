"""PSGS-steered hybrid sampling: small batches on CPU threads, large ones on the GPU.

:class:`HybridSampler` sums the PSGS (:func:`quiver.workload.psgs`) of a batch's seeds and
sends the batch to the GPU kernel when the sum reaches a threshold, to the numba CPU kernel
otherwise. :func:`calibrate` finds the threshold by measurement: it times both paths on the
same random batches of 1..1024 seeds, fits latency = a + b * PSGS per path, and takes the
crossover (``quiver calibrate DATASET_DIR`` stores it in the dataset's manifest).

Without CUDA the second path is the same vectorized torch kernel on CPU tensors, so the
routing logic and the calibration run (and are tested) on any machine.

torch-quiver's ``HybridSampler(csr_topo, sizes, device_num, worker_num_per_device,
batched_queue_list, cpu_range=[])`` is a different design (CPU sampling worker processes fed
by queues): called with those arguments, ``HybridSampler`` builds a
:class:`QueueHybridSampler`, which keeps that interface.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from quiver.workload import psgs as psgs_table_of

__all__ = [
    "HybridSampler",
    "QueueHybridSampler",
    "Calibration",
    "calibrate",
    "write_calibration",
    "read_calibration",
    "plot_calibration",
]

log = logging.getLogger("quiver.hybrid")

PATHS = ("cpu", "gpu")


def _default_gpu_device() -> torch.device | None:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


# arguments only torch-quiver's HybridSampler takes (it needs at least five)
_QUEUE_ARGS = frozenset({"device_num", "worker_num_per_device", "batched_queue_list", "cpu_range"})


class HybridSampler:
    """Routes each batch to CPU or GPU sampling by its summed PSGS.

    Called with torch-quiver's arguments (``device_num``, ``worker_num_per_device``,
    ``batched_queue_list``, ...: five or more, where this class takes at most three
    positionally), it returns a :class:`QueueHybridSampler` instead.

    A batch whose PSGS is ``>= threshold`` goes to the GPU path; smaller ones to the CPU path.
    Both paths return the same format (:class:`quiver.sampling.SampledSubgraph`, or
    ``(n_id, batch_size, adjs)`` from :meth:`sample`); tensors live on the path's device.

    Args:
        csr_topo: the graph (:class:`quiver.CSRTopo`).
        sizes: fanouts per hop, seeds' hop first (e.g. ``[15, 10, 5]``).
        threshold: batch PSGS at which batches switch to the GPU (``0``: always GPU;
            ``math.inf``: never), usually :attr:`Calibration.threshold` from
            :func:`read_calibration`. Required when a GPU path exists.
        gpu_device: device of the second path. Default: the current CUDA device, or none
            without CUDA (CPU-only, announced once with a warning). ``"cpu"`` runs the
            vectorized torch kernel on CPU tensors (tests, CPU calibration).
        psgs_table: precomputed ``[node_count]`` PSGS for ``sizes`` (else computed here).
        seed: sampling seed (the GPU path uses ``seed + 1``); ``None`` draws one.
        num_threads: threads of the CPU kernel (default: all cores).
        uva: GPU path reads a pinned host topology (``mode="UVA"``) instead of a device copy.
        frontier: both paths expand only each hop's new nodes (PyG ``NeighborLoader``
            semantics, for ``forward(x, edge_index)`` models); default False.
    """

    def __new__(cls, *args, **kwargs):
        if cls is HybridSampler and (len(args) > 3 or _QUEUE_ARGS & kwargs.keys()):
            return QueueHybridSampler(*args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        csr_topo,
        sizes,
        threshold: float | None = None,
        *,
        gpu_device=None,
        psgs_table: torch.Tensor | None = None,
        seed: int | None = None,
        num_threads: int | None = None,
        uva: bool = False,
        frontier: bool = False,
    ):
        from quiver.sampling import CPUSampler, TorchSampler

        self.sizes = [int(k) for k in sizes]
        self.node_count = csr_topo.node_count
        if psgs_table is None:
            psgs_table = psgs_table_of(csr_topo.to("cpu"), self.sizes)
        psgs_table = torch.as_tensor(psgs_table, dtype=torch.float32).cpu()
        if psgs_table.shape != (self.node_count,):
            raise ValueError(
                f"psgs_table must have shape [{self.node_count}], got {list(psgs_table.shape)}"
            )
        self.psgs_table = psgs_table
        self._psgs_np = psgs_table.numpy()
        self.frontier = bool(frontier)
        self.cpu = CPUSampler(
            csr_topo.to("cpu"), self.sizes, seed=seed, num_threads=num_threads, frontier=frontier
        )
        device = _default_gpu_device() if gpu_device is None else torch.device(gpu_device)
        self.gpu = None
        if device is None:
            log.warning("HybridSampler: CUDA is not available; every batch is sampled on the CPU")
            self.threshold = math.inf
        else:
            if threshold is None:
                raise ValueError(
                    "HybridSampler needs a PSGS threshold: run `quiver calibrate DATASET_DIR` "
                    "and pass read_calibration(...).threshold, or give threshold= explicitly"
                )
            gseed = None if seed is None else seed + 1
            mode = "UVA" if uva else "GPU"
            self.gpu = TorchSampler(
                csr_topo, self.sizes, device=device, mode=mode, seed=gseed, frontier=frontier
            )
            self.threshold = float(threshold)
        if not self.threshold >= 0:
            raise ValueError(f"threshold must be >= 0 (or math.inf), got {threshold}")
        self.counts = {p: {"batches": 0, "seeds": 0} for p in PATHS}

    @property
    def gpu_device(self) -> torch.device | None:
        """Device of the GPU path (``None`` when CPU-only)."""
        return None if self.gpu is None else self.gpu.device

    def batch_psgs(self, seeds: torch.Tensor) -> float:
        """Summed PSGS of ``seeds`` (validated ids)."""
        if seeds.numel() == 0:
            return 0.0
        # numpy, not torch: no intra-op thread wake-ups on the per-batch path
        return float(self._psgs_np[seeds.cpu().numpy()].sum(dtype=np.float64))

    def _route(self, seeds: torch.Tensor) -> tuple[str, float]:
        p = self.batch_psgs(seeds)
        return ("gpu" if self.gpu is not None and p >= self.threshold else "cpu"), p

    def route(self, seeds) -> tuple[str, float]:
        """``("cpu" | "gpu", batch PSGS)`` for a batch of seed ids (not sampled)."""
        from quiver.sampling.base import check_seeds

        return self._route(check_seeds(seeds, self.node_count))

    def sample_subgraph(self, seeds):
        """Sample ``seeds`` on the routed path; returns a ``SampledSubgraph``."""
        from quiver.sampling.base import check_seeds

        seeds = check_seeds(seeds, self.node_count)
        path, _ = self._route(seeds)
        # seeds are validated once, here; the samplers' _sample skips their own check
        out = (self.gpu if path == "gpu" else self.cpu)._sample(seeds)
        self.last_path = path
        c = self.counts[path]
        c["batches"] += 1
        c["seeds"] += out.batch_size
        return out

    def sample(self, seeds):
        """``(n_id, batch_size, adjs)`` as ``GraphSageSampler.sample``, on the routed path."""
        out = self.sample_subgraph(seeds)
        return out.n_id, out.batch_size, out.adjs()

    def stats(self) -> dict:
        """Batches and seeds sampled per path so far."""
        return {p: dict(c) for p, c in self.counts.items()}


# ----------------------------------------------------------------------- calibration


def _queue_worker(rank, task_queues, result_queues, device_num, sizes, csr_topo, cpu_range):
    """One CPU sampling process of :class:`QueueHybridSampler` (``None`` task: stop)."""
    from quiver.pyg import GraphSageSampler

    if cpu_range:
        os.sched_setaffinity(0, [cpu_range[rank % len(cpu_range)]])
    sampler = GraphSageSampler(csr_topo, sizes, device="cpu", mode="CPU", num_threads=1)
    tasks, results = task_queues[rank % device_num], result_queues[rank % device_num]
    while (task := tasks.get()) is not None:
        start = time.perf_counter()
        res = sampler.sample(task)
        results.put((res, time.perf_counter() - start))


class QueueHybridSampler:
    """torch-quiver's ``HybridSampler``: CPU sampling processes fed by request queues.

    ``start()`` launches ``device_num * worker_num_per_device`` processes; worker ``r`` takes
    seed batches from ``batched_queue_list[0][r % device_num]`` and puts
    ``((n_id, batch_size, adjs), seconds)`` on ``sampled_request_queue_list()[0][r %
    device_num]``; the GPU queues ``batched_queue_list[1]`` pass through untouched, as in
    torch-quiver. Put ``None`` on a task queue (or call :meth:`stop`) to end its worker.

    Args:
        csr_topo: the graph (moved to shared memory).
        sizes: fanouts, seeds' hop first.
        device_num: number of GPU lanes (one result queue each).
        worker_num_per_device: CPU sampling processes per lane.
        batched_queue_list: ``[cpu_task_queues, gpu_task_queues]``, one queue per lane each.
        cpu_range: CPU cores to pin the workers to, round robin (default: no pinning).
    """

    def __init__(
        self, csr_topo, sizes, device_num, worker_num_per_device, batched_queue_list, cpu_range=()
    ):
        if int(device_num) < 1 or int(worker_num_per_device) < 1:
            raise ValueError("device_num and worker_num_per_device must be >= 1")
        if len(batched_queue_list) != 2 or len(batched_queue_list[0]) < int(device_num):
            raise ValueError(
                "batched_queue_list must be [cpu_queues, gpu_queues] with a cpu queue per device"
            )
        import torch.multiprocessing as mp

        self.csr_topo = csr_topo.share_memory_()
        self.sizes = [int(k) for k in sizes]
        self.device_num = int(device_num)
        self.cpu_num_workers = self.device_num * int(worker_num_per_device)
        self.cpu_range = list(cpu_range)
        self.cpu_batched_queue_list = batched_queue_list[0]
        self.gpu_batched_queue_list = batched_queue_list[1]
        self._ctx = mp.get_context("spawn")
        self.cpu_sampled_queue_list = [self._ctx.Queue() for _ in range(self.device_num)]
        self._procs = []

    def start(self) -> None:
        """Launch the CPU sampling processes (daemons)."""
        for rank in range(self.cpu_num_workers):
            args = (rank, self.cpu_batched_queue_list, self.cpu_sampled_queue_list)
            args += (self.device_num, self.sizes, self.csr_topo, self.cpu_range)
            p = self._ctx.Process(target=_queue_worker, args=args, daemon=True)
            p.start()
            self._procs.append(p)

    def sampled_request_queue_list(self) -> list:
        """``[cpu_sampled_queues, gpu_task_queues]``, as torch-quiver returns."""
        return [self.cpu_sampled_queue_list, self.gpu_batched_queue_list]

    def stop(self, timeout: float = 10.0) -> None:
        """Send every worker a stop task and wait for it (terminating stragglers)."""
        for rank in range(len(self._procs)):
            self.cpu_batched_queue_list[rank % self.device_num].put(None)
        for p in self._procs:
            p.join(timeout)
            if p.is_alive():
                p.terminate()
        self._procs = []


@dataclass
class Calibration:
    """Result of :func:`calibrate`, stored under ``"calibration"`` in a dataset manifest.

    Attributes:
        threshold: batch PSGS from which the GPU path is faster (crossover of the fits);
            ``math.inf`` when the GPU path never wins, ``0`` when it always does.
        fits: ``{"cpu": {"a": s, "b": s per PSGS unit}, "gpu": {...}}``, latency = a + b * PSGS.
        empirical_threshold: the threshold that minimises the measured total latency of the
            calibration batches (a check on the fitted one).
        sizes: fanouts calibrated.
        cpu_path, gpu_path: what each path ran (e.g. ``"numba, 2 threads"``, ``"torch on cuda:0"``).
        points: ``{"cpu": [[psgs, seconds, batch_size], ...], "gpu": [...]}``.
        created: UTC timestamp.
    """

    threshold: float
    fits: dict
    empirical_threshold: float
    sizes: list
    cpu_path: str
    gpu_path: str
    points: dict = field(repr=False)
    created: str = ""

    def predict(self, path: str, batch_psgs: float) -> float:
        """Fitted latency (seconds) of ``path`` for a batch of this PSGS."""
        f = self.fits[path]
        return f["a"] + f["b"] * batch_psgs

    def to_json(self) -> dict:
        d = asdict(self)
        for k in ("threshold", "empirical_threshold"):
            d[k] = None if math.isinf(d[k]) else d[k]  # JSON has no infinity: null = never
        return d

    @classmethod
    def from_json(cls, d: dict) -> Calibration:
        d = dict(d)
        for k in ("threshold", "empirical_threshold"):
            d[k] = math.inf if d.get(k) is None else float(d[k])
        return cls(**d)


def _fit_line(x: np.ndarray, y: np.ndarray) -> dict:
    """Least squares of ``y ~ a + b x`` in *relative* error (weights 1/y), so the small
    batches that decide the crossover count as much as the large ones."""
    w = 1.0 / np.maximum(y, 1e-9)
    a_mat = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (a, b), *_ = np.linalg.lstsq(a_mat, y * w, rcond=None)
    return {"a": float(a), "b": float(b)}


def _crossover(cpu: dict, gpu: dict, x_max: float) -> float:
    """Smallest PSGS from which the fitted GPU latency is below the CPU one."""
    da, db = gpu["a"] - cpu["a"], cpu["b"] - gpu["b"]  # gpu better where db * x > da
    if db > 0:
        return max(0.0, da / db)
    # the GPU's slope is no better: it wins everywhere (if at all) only by its intercept
    return 0.0 if da < 0 and da - db * x_max < 0 else math.inf


def _empirical_threshold(points: dict) -> float:
    """Threshold minimising the total measured latency when routing the calibration batches."""
    cpu = np.asarray(points["cpu"])
    gpu = np.asarray(points["gpu"])
    x, tc, tg = cpu[:, 0], cpu[:, 1], gpu[:, 1]
    order = np.argsort(x)
    x, tc, tg = x[order], tc[order], tg[order]
    # threshold just above x[i-1]: first i batches on the CPU, the rest on the GPU
    cost = np.concatenate([[0.0], np.cumsum(tc)]) + np.concatenate([np.cumsum(tg[::-1])[::-1], [0]])
    i = int(np.argmin(cost))
    if i == len(x):
        return math.inf
    return 0.0 if i == 0 else float((x[i - 1] + x[i]) / 2)


def _batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, ... up to ``max_batch``: even steps on a log scale."""
    out = sorted(
        {int(round(v)) for v in np.geomspace(1, max_batch, 2 * int(np.log2(max_batch)) + 1)}
    )
    return [b for b in out if b >= 1]


def calibrate(
    csr_topo,
    sizes,
    gpu_device=None,
    max_batch: int = 1024,
    repeats: int = 5,
    seed: int = 0,
    num_threads: int | None = None,
    psgs_table: torch.Tensor | None = None,
    progress=None,
) -> Calibration:
    """Time the CPU and GPU sampling paths on the same random batches and fit the crossover.

    For each batch size on a log grid from 1 to ``max_batch``, ``repeats`` batches of distinct
    random seeds are sampled by both paths (alternating which goes first, after a warm-up);
    each timing is one call, synchronised on CUDA.

    Args:
        csr_topo: the graph.
        sizes: fanouts per hop.
        gpu_device: second path's device; default CUDA if available, else ``"cpu"`` (the
            vectorized torch kernel on CPU tensors).
        max_batch: largest batch (seeds).
        repeats: batches per size.
        seed: RNG seed of the batches and the samplers.
        num_threads: CPU kernel threads.
        psgs_table: precomputed PSGS table for ``sizes``.
        progress: optional callable ``progress(done, total)``.

    Returns:
        A :class:`Calibration`.
    """
    if max_batch < 2:
        raise ValueError(f"max_batch must be >= 2, got {max_batch}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    device = _default_gpu_device() if gpu_device is None else torch.device(gpu_device)
    if device is None:
        device = torch.device("cpu")
    h = HybridSampler(
        csr_topo,
        sizes,
        threshold=0.0,
        gpu_device=device,
        psgs_table=psgs_table,
        seed=seed,
        num_threads=num_threads,
    )
    n = csr_topo.node_count
    max_batch = min(max_batch, n)
    rng = np.random.default_rng(seed)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(sampler, seeds) -> float:
        sync()
        t0 = time.perf_counter()
        sampler.sample_subgraph(seeds)
        sync()
        return time.perf_counter() - t0

    warm = torch.from_numpy(rng.choice(n, size=min(64, n), replace=False))
    for _ in range(3):
        timed(h.cpu, warm)
        timed(h.gpu, warm)
    points: dict[str, list] = {"cpu": [], "gpu": []}
    grid = _batch_sizes(max_batch)
    total, done = len(grid) * repeats, 0
    for b in grid:
        for r in range(repeats):
            seeds = torch.from_numpy(rng.choice(n, size=b, replace=False))
            p = h.batch_psgs(seeds)
            first, second = (h.cpu, h.gpu) if r % 2 == 0 else (h.gpu, h.cpu)
            t_first, t_second = timed(first, seeds), timed(second, seeds)
            t_cpu, t_gpu = (t_first, t_second) if r % 2 == 0 else (t_second, t_first)
            points["cpu"].append([p, t_cpu, b])
            points["gpu"].append([p, t_gpu, b])
            done += 1
            if progress is not None:
                progress(done, total)
    fits = {}
    for path in PATHS:
        a = np.asarray(points[path])
        fits[path] = _fit_line(a[:, 0], a[:, 1])
    x_max = max(p[0] for p in points["cpu"])
    threads = h.cpu.num_threads
    return Calibration(
        threshold=_crossover(fits["cpu"], fits["gpu"], x_max),
        fits=fits,
        empirical_threshold=_empirical_threshold(points),
        sizes=list(h.sizes),
        cpu_path=f"numba kernel, {threads} threads",
        gpu_path=f"vectorized torch kernel on {device}",
        points=points,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )


def plot_calibration(cal: Calibration, path) -> Path:
    """Plot both paths' latencies against batch PSGS (log-log), their fits and the threshold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"cpu": "tab:blue", "gpu": "tab:orange"}
    labels = {"cpu": f"CPU ({cal.cpu_path})", "gpu": f"GPU path ({cal.gpu_path})"}
    x_all = np.asarray(cal.points["cpu"])[:, 0]
    xs = np.geomspace(max(x_all.min(), 1.0), x_all.max(), 200)
    for p in PATHS:
        a = np.asarray(cal.points[p])
        ax.scatter(a[:, 0], a[:, 1] * 1e3, s=8, alpha=0.5, color=colors[p], label=labels[p])
        ax.plot(xs, [cal.predict(p, x) * 1e3 for x in xs], color=colors[p], lw=1.5)
    if math.isfinite(cal.threshold) and cal.threshold > 0:
        ax.axvline(
            cal.threshold, color="k", ls="--", lw=1, label=f"threshold PSGS = {cal.threshold:,.0f}"
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("batch PSGS (expected sampled nodes)")
    ax.set_ylabel("sampling latency (ms)")
    ax.set_title(f"quiver calibrate: fanouts {cal.sizes}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def write_calibration(manifest_path, cal: Calibration) -> None:
    """Store ``cal`` under ``"calibration"`` in a manifest.json, atomically (temp + rename)."""
    p = Path(manifest_path)
    manifest = json.loads(p.read_text()) if p.exists() else {}
    manifest["calibration"] = cal.to_json()
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, p)


def read_calibration(dataset_dir_or_manifest) -> Calibration:
    """The calibration stored by ``quiver calibrate`` in a dataset's manifest.json.

    Raises:
        FileNotFoundError: no manifest.
        ValueError: the manifest holds no calibration.
    """
    p = Path(dataset_dir_or_manifest)
    if p.is_dir():
        p = p / "manifest.json"
    if not p.exists():
        raise FileNotFoundError(f"manifest not found: {p}")
    d = json.loads(p.read_text()).get("calibration")
    if not d:
        raise ValueError(f"{p} holds no calibration; run `quiver calibrate {p.parent}`")
    return Calibration.from_json(d)
