"""torch-quiver's queue-based serving pipeline (``quiver.RequestBatcher``,
``quiver.InferenceServer``), CPU-only, for code written against it.

torch-quiver wires its serving example from queues::

    batcher = quiver.RequestBatcher(device_num, stream_queues, input_proc_per_device, "CPU")
    tasks = batcher.batched_request_queue_list()
    sampler = quiver.HybridSampler(csr_topo, sizes, device_num, workers, tasks)
    sampler.start()
    sampled = sampler.sampled_request_queue_list()
    server = quiver.InferenceServer(model_path, device_list, x, sampled, "CPU", csr_topo, sizes,
                                    proc_num_per_device=1)
    results = server.result_queue_list()
    server.start()

Here the batcher and the server run threads in the calling process (the sampler's workers
are processes, :class:`quiver.hybrid.QueueHybridSampler`); the model is loaded by
:func:`quiver.usermodel.load_served_model` and run on the host. Quiver's own server
(``quiver serve``, :class:`quiver.serving.Engine`) batches, samples and answers each request
itself; this pipeline only keeps torch-quiver's interface.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path

import numpy as np
import torch

__all__ = ["InferenceServer", "InferenceServer_Debug", "RequestBatcher"]

log = logging.getLogger("quiver.serving")

SAMPLE_MODES = ("CPU", "GPU", "Auto")


def _new_queue():
    import torch.multiprocessing as mp

    return mp.get_context("spawn").Queue()


class RequestBatcher:
    """torch-quiver's ``RequestBatcher``: forward seed batches from the stream queues to a CPU
    or a GPU task queue per device.

    Args:
        device_num: lanes (one CPU and one GPU task queue each).
        stream_queue_list: ``device_num * input_proc_per_device`` queues of seed batches;
            forwarder ``i`` reads queue ``i`` into lane ``i % device_num``. ``None`` stops it.
        input_proc_per_device: forwarders per lane (threads here; processes in torch-quiver).
        sample_mode: ``"CPU"`` or ``"GPU"`` (every batch to that queue), or ``"Auto"``: a batch
            whose sampled-neighbour total (``neighbour_path``'s table, e.g.
            :func:`quiver.generate_neighbour_num`) exceeds ``threshold`` goes to the GPU queue.
        request_mode: with ``"Auto"``, ``"Preparation"`` puts every batch on both queues.
        threshold: the ``"Auto"`` split.
        batch_time_limit, fixed_batch_size, cpu_range: torch-quiver's; unused here (batches
            pass as they come; threads are not pinned).
        neighbour_path: ``.npy`` of per-node sampled-neighbour counts (``"Auto"`` only).
    """

    def __init__(
        self,
        device_num,
        stream_queue_list,
        input_proc_per_device,
        sample_mode="GPU",
        request_mode="CPU",
        threshold=800,
        batch_time_limit=10,
        fixed_batch_size=512,
        neighbour_path=None,
        cpu_range=(),
    ):
        if sample_mode not in SAMPLE_MODES:
            raise ValueError(f"sample_mode must be one of {SAMPLE_MODES}, got {sample_mode!r}")
        self.device_num = int(device_num)
        workers = self.device_num * int(input_proc_per_device)
        if self.device_num < 1 or workers < 1:
            raise ValueError("device_num and input_proc_per_device must be >= 1")
        if len(stream_queue_list) < workers:
            raise ValueError(
                f"stream_queue_list has {len(stream_queue_list)} queues; "
                f"device_num * input_proc_per_device is {workers}"
            )
        self.neighbour_num = None
        if sample_mode == "Auto":
            if neighbour_path is None:
                raise ValueError("sample_mode='Auto' needs neighbour_path")
            self.neighbour_num = np.load(neighbour_path)
        self.stream_queue_list = stream_queue_list
        self.sample_mode, self.request_mode = sample_mode, request_mode
        self.threshold = float(threshold)
        self.cpu_batched_queue_list = [_new_queue() for _ in range(self.device_num)]
        self.gpu_batched_queue_list = [_new_queue() for _ in range(self.device_num)]
        self._threads = [
            threading.Thread(
                target=self._forward, args=(i,), daemon=True, name=f"quiver-batcher-{i}"
            )
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def _forward(self, idx: int) -> None:
        stream = self.stream_queue_list[idx]
        lane = idx % self.device_num
        cpu, gpu = self.cpu_batched_queue_list[lane], self.gpu_batched_queue_list[lane]
        while True:
            item = stream.get()
            if item is None:
                return
            if self.sample_mode == "CPU":
                cpu.put(item)
            elif self.sample_mode == "GPU":
                gpu.put(item)
            elif self.request_mode == "Preparation":
                gpu.put(item)
                cpu.put(item)
            else:
                ids = torch.as_tensor(item).cpu().numpy()
                heavy = float(np.take(self.neighbour_num, ids).sum()) > self.threshold
                (gpu if heavy else cpu).put(item)

    def batched_request_queue_list(self) -> list:
        """``[cpu_task_queues, gpu_task_queues]``, one queue per lane each."""
        return [self.cpu_batched_queue_list, self.gpu_batched_queue_list]


class InferenceServer:
    """torch-quiver's ``InferenceServer``: run the model on sampled batches, one output queue
    per worker.

    Args:
        model_path: the model file (torch-quiver saves the whole module, ``torch.save(model)``;
            any checkpoint :func:`quiver.usermodel.load_served_model` reads); loading a whole
            module runs code from the file, as ``torch.load`` does in torch-quiver.
        device_list: torch-quiver's GPU ordinals; one lane each (the model runs on the host).
        x_feature: node features, ``feature[n_id]`` (a tensor or a :class:`quiver.Feature`).
        task_queue_list: ``[cpu_sampled_queues, gpu_task_queues]``
            (``HybridSampler.sampled_request_queue_list()``): sampled
            ``((n_id, batch_size, adjs), seconds)`` items, and seed batches to sample here.
        sample_mode: ``"CPU"`` (read sampled items), ``"GPU"`` (sample seed batches with
            :class:`quiver.pyg.GraphSageSampler` on the host), ``"Auto"`` (half the workers each).
        csr_topo, sizes: graph and fanouts for the ``"GPU"`` workers.
        ignord_length, uva_gpu: torch-quiver's; unused.
        proc_num_per_device: workers per lane (threads here).
    """

    def __init__(
        self,
        model_path,
        device_list,
        x_feature,
        task_queue_list,
        sample_mode,
        csr_topo,
        sizes,
        ignord_length=100,
        proc_num_per_device=0,
        uva_gpu="GPU",
    ):
        if sample_mode not in SAMPLE_MODES:
            raise ValueError(f"sample_mode must be one of {SAMPLE_MODES}, got {sample_mode!r}")
        self.device_list = list(device_list)
        self.num_proc = len(self.device_list) * int(proc_num_per_device)
        if self.num_proc < 1:
            raise ValueError("InferenceServer needs device_list and proc_num_per_device >= 1")
        self.model_path = model_path
        self.x_feature = x_feature
        self.cpu_sampled_queue_list, self.gpu_task_queue_list = task_queue_list
        self.sample_mode = sample_mode
        self.csr_topo, self.sizes = csr_topo, list(sizes)
        self.output_queue_list = [_new_queue() for _ in range(self.num_proc)]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def result_queue_list(self) -> list:
        """One output queue per worker; each gets the model's output for each batch."""
        return self.output_queue_list

    def _model(self):
        from quiver.usermodel import load_served_model

        model, _ = load_served_model(self.model_path, trust_pickle=True, convention="adjs")
        return model.eval()

    def _run(self, rank: int) -> None:
        model = self._model()
        lanes = len(self.device_list)
        half = self.num_proc // 2
        use_tasks = self.sample_mode == "GPU" or (self.sample_mode == "Auto" and rank < half)
        lane = (rank if self.sample_mode != "Auto" or rank < half else rank - half) % lanes
        sampler = None
        if use_tasks:
            from quiver.pyg import GraphSageSampler

            sampler = GraphSageSampler(self.csr_topo, self.sizes, mode="CPU")
            source = self.gpu_task_queue_list[lane]
        else:
            source = self.cpu_sampled_queue_list[lane]
        idle = 0.0
        while not self._stop.is_set():
            try:
                item = source.get(timeout=0.1)
            except queue.Empty:
                idle += 0.1
                self._idle(rank, idle)
                continue
            idle = 0.0
            if item is None:
                break
            start = time.perf_counter()
            if sampler is not None:
                n_id, batch_size, adjs = sampler.sample(torch.as_tensor(item))
                sampled = time.perf_counter()  # a time, as torch-quiver's column holds
            else:
                (n_id, batch_size, adjs), sampled = item  # the sampler's seconds
            with torch.inference_mode():
                out = model(self.x_feature[n_id], adjs)
            self._emit(rank, out, [start, sampled, time.perf_counter(), batch_size, len(n_id)])
        self._idle(rank, float("inf"))

    def _emit(self, rank: int, out: torch.Tensor, timing: list) -> None:
        """One batch done: its output to this worker's queue."""
        self.output_queue_list[rank].put(out.cpu())

    def _idle(self, rank: int, seconds: float) -> None:
        """This worker's queue has been empty for ``seconds`` (``inf``: the worker ends)."""

    def start(self, join: bool = True) -> None:
        """Start the workers. With ``join`` (the default) wait until they end, as
        torch-quiver's ``start()`` does (it runs ``mp.spawn(..., join=True)`` and its serving
        example calls it last, once the request and result processes are running); they end
        on :meth:`stop` (from another thread) or ``None`` on each of their queues.
        ``join=False`` returns at once: feed and read the queues, then :meth:`stop`."""
        for rank in range(self.num_proc):
            t = threading.Thread(
                target=self._run, args=(rank,), daemon=True, name=f"quiver-infer-{rank}"
            )
            t.start()
            self._threads.append(t)
        if join:
            for t in self._threads:
                t.join()

    def stop(self, timeout: float = 10.0) -> None:
        """End the workers (each finishes the batch it holds)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
        self._threads = []


class InferenceServer_Debug(InferenceServer):  # noqa: N801 - torch-quiver's name
    """torch-quiver's ``InferenceServer_Debug``: the same workers, timing each batch instead
    of returning outputs (the result queues stay empty).

    When a worker's queue has been empty for :attr:`idle_s` seconds (torch-quiver: 10) or it
    ends, it prints one line (average and p99 latency, sampling and feature + inference
    latency, throughput, seeds) and, with ``result_path``, saves its rows to
    ``{result_path}/{exp_id}_{CPU|GPU}_{rank}.npy``: ``[start, sampled, end, batch_size,
    sampled_nodes]`` per batch after the first ``ignord_length``, where ``sampled`` is the
    time sampling ended (``GPU`` workers, which sample here) or the sampler's seconds (``CPU``
    workers). Each summary is also kept in :attr:`summaries`. Latency counts from the batch
    leaving the queue (torch-quiver starts the clock before waiting on the queue).

    Args: as :class:`InferenceServer`, in torch-quiver's order, plus
        result_path: a folder for the ``.npy`` rows (None: print only).
        exp_id: the files' prefix.
    """

    #: seconds a worker's queue stays empty before it reports (torch-quiver's get timeout)
    idle_s = 10.0

    def __init__(
        self,
        model_path,
        device_list,
        x_feature,
        task_queue_list,
        sample_mode,
        csr_topo,
        sizes,
        ignord_length=100,
        result_path=None,
        exp_id=0,
        proc_num_per_device=0,
        uva_gpu="GPU",
    ):
        super().__init__(
            model_path,
            device_list,
            x_feature,
            task_queue_list,
            sample_mode,
            csr_topo,
            sizes,
            ignord_length=ignord_length,
            proc_num_per_device=proc_num_per_device,
            uva_gpu=uva_gpu,
        )
        self.ignord_length = int(ignord_length)
        self.result_path, self.exp_id = result_path, exp_id
        self.summaries: list[dict] = []
        self._timings: dict[int, list] = {r: [] for r in range(self.num_proc)}
        self._lock = threading.Lock()

    def _emit(self, rank: int, out: torch.Tensor, timing: list) -> None:
        self._timings[rank].append(timing)

    def _idle(self, rank: int, seconds: float) -> None:
        if seconds < self.idle_s or not self._timings[rank]:
            return
        rows, self._timings[rank] = np.array(self._timings[rank], dtype=np.float64), []
        rows = rows[self.ignord_length :]
        if not len(rows):
            return
        half = self.num_proc // 2
        on_gpu = self.sample_mode == "GPU" or (self.sample_mode == "Auto" and rank < half)
        kind = "GPU" if on_gpu else "CPU"
        local = rank - half if self.sample_mode == "Auto" and not on_gpu else rank
        start, mark, end, seeds = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3]
        sample_s = mark - start if on_gpu else mark
        latency = end - start + (0.0 if on_gpu else mark)
        span = float(end.max() - end.min())
        summary = {
            "kind": kind,
            "rank": local,
            "avg_latency_s": float(np.average(latency, weights=seeds)),
            "p99_latency_ms": float(np.percentile(latency, 99) * 1000),
            "avg_sample_s": float(np.average(sample_s, weights=seeds)),
            "avg_feature_inference_s": float(
                np.average(end - (mark if on_gpu else start), weights=seeds)
            ),
            "throughput": float(seeds.sum() / span) if span > 0 else float("inf"),
            "total": int(seeds.sum()),
        }
        print(
            f"{kind} Rank {local}: Avg Latency: {summary['avg_latency_s']}, TP99 Latency: "
            f"{summary['p99_latency_ms']}, Avg Sampled Latency: {summary['avg_sample_s']}, "
            f"Avg F_I Latency: {summary['avg_feature_inference_s']}, Throughput: "
            f"{summary['throughput']}, Total: {summary['total']}",
            flush=True,
        )
        if self.result_path is not None:
            Path(self.result_path).mkdir(parents=True, exist_ok=True)
            np.save(Path(self.result_path) / f"{self.exp_id}_{kind}_{local}.npy", rows)
        with self._lock:
            self.summaries.append(summary)
