"""Random reads from 4 KiB pages against 2 MiB transparent huge pages (anonymous memory,
``madvise(MADV_HUGEPAGE)``): sampling over the graph's ``indices`` and the folded first layer
over its node tables, the same batches on both layouts, interleaved.

- ``sample``: the serving sampler (1 thread) on the prepared topology as loaded (memory-mapped
  ``.npy``, page cache) and on a copy in huge pages;
- ``fold``: ``FoldedFirstLayer.gather_layer`` + the model's other layers on tables in ordinary
  memory and in huge pages.

Prints ms per batch per layout and the ratio, with the kernel's THP mode and the
``AnonHugePages`` the process got.

    .venv/bin/python bench/hugepages.py --data data/products-like
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))

import mmap  # noqa: E402
from pathlib import Path  # noqa: E402

_HUGE = 2 << 20  # 2 MiB
#: tables smaller than this stay where they are (a copy buys nothing measurable)
MIN_BYTES = 64 << 20


def thp_mode() -> str:
    """The kernel's THP setting: ``"always"``, ``"madvise"``, ``"never"`` or ``"unknown"``."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    for word in text.split():
        if word.startswith("["):
            return word.strip("[]")
    return "unknown"


def huge_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor whose memory is ``madvise(MADV_HUGEPAGE)``-ed anonymous memory
    (an ordinary ``torch.empty`` where that is not available)."""
    shape = tuple(int(s) for s in shape)
    count = int(np.prod(shape)) if shape else 1
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes == 0 or advice is None or thp_mode() in ("never", "unknown"):
        return torch.empty(shape, dtype=dtype)
    size = -(-nbytes // _HUGE) * _HUGE
    try:
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(advice)
    except (OSError, ValueError):
        return torch.empty(shape, dtype=dtype)
    # the tensor keeps ``buf`` alive; its pages fault in (as 2 MiB pages) on first write
    flat = torch.frombuffer(buf, dtype=dtype, count=count)
    return flat.view(shape)


def huge_copy(t, min_bytes: int = MIN_BYTES):
    """``t`` (a tensor or numpy array) copied into huge-page memory, same type, dtype and
    shape; returned as is when smaller than ``min_bytes`` (or a tensor not on the CPU)."""
    if isinstance(t, np.ndarray):
        if t.nbytes < min_bytes:
            return t
        out = huge_empty(t.shape, torch.from_numpy(np.empty(0, dtype=t.dtype)).dtype).numpy()
        np.copyto(out, t)
        return out
    if t.numel() * t.element_size() < min_bytes or t.device.type != "cpu":
        return t
    out = huge_empty(t.shape, t.dtype)
    out.copy_(t)
    return out


def _anon_huge_mib() -> float:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    from _machine import cpu_model
    from quiver import CSRTopo
    from quiver.datasets import load_prepared
    from quiver.models import load_checkpoint
    from quiver.pyg import GraphSageSampler
    from quiver.serving.folded import FoldedFirstLayer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="data/products-like")
    ap.add_argument("--checkpoint", default=None, help="default <data>/sage.pt")
    ap.add_argument("--batches", default="8,32,64,256", help="seeds per batch")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch and sampler threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    print(f"CPU {cpu_model()}, load average {os.getloadavg()[0]:.2f}, THP {thp_mode()}")
    ds = load_prepared(args.data)
    model, ckpt = load_checkpoint(args.checkpoint or os.path.join(args.data, "sage.pt"))
    fanouts = ckpt.get("fanouts") or ds.manifest.get("fanouts")
    before = _anon_huge_mib()
    ip, ix = ds.topo.numpy()
    t0 = time.perf_counter()
    huge_topo = CSRTopo.from_csr(huge_copy(ip), huge_copy(ix), validate=False)
    copy_s = time.perf_counter() - t0
    samplers = {
        "mmap": GraphSageSampler(ds.topo, fanouts, mode="CPU", seed=0, num_threads=args.threads),
        "huge": GraphSageSampler(huge_topo, fanouts, mode="CPU", seed=0, num_threads=args.threads),
    }
    plain = FoldedFirstLayer(model, ds.features)
    huge = FoldedFirstLayer(model, ds.features)
    huge.left, huge.right = huge_copy(plain.left), huge_copy(plain.right)
    folds = {"4k": plain, "huge": huge}
    print(
        f"topology copied in {copy_s:.1f} s; AnonHugePages {before:.0f} -> "
        f"{_anon_huge_mib():.0f} MiB (topology {ix.nbytes / 2**20:.0f} MiB, tables "
        f"{plain.nbytes / 2**20:.0f} MiB)"
    )
    rng = np.random.default_rng(0)
    for s in samplers.values():  # warm-up (numba load) and first touch
        s.sample(torch.arange(64))
    print(f"\n{'seeds':>6} {'sample mmap':>12} {'sample huge':>12} {'ratio':>6} "
          f"{'fold 4k':>9} {'fold huge':>10} {'ratio':>6}")  # fmt: skip
    for b in (int(v) for v in args.batches.split(",")):
        t = {k: 0.0 for k in ("mmap", "huge", "4k", "fhuge")}
        for r in range(args.reps):
            seeds = torch.from_numpy(np.unique(rng.integers(0, ds.num_nodes, b)))
            order = ["mmap", "huge"] if r % 2 == 0 else ["huge", "mmap"]
            for k in order:
                t0 = time.perf_counter()
                n_id, _, adjs = samplers[k].sample(seeds)
                t[k] += time.perf_counter() - t0
            for k in order:
                f = folds["4k" if k == "mmap" else "huge"]
                t0 = time.perf_counter()
                f.tail(*f.gather_layer(n_id, adjs))
                t["4k" if k == "mmap" else "fhuge"] += time.perf_counter() - t0
        ms = {k: v / args.reps * 1e3 for k, v in t.items()}
        print(
            f"{b:>6} {ms['mmap']:>12.2f} {ms['huge']:>12.2f} {ms['mmap'] / ms['huge']:>5.2f}x "
            f"{ms['4k']:>9.2f} {ms['fhuge']:>10.2f} {ms['4k'] / ms['fhuge']:>5.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
