"""``quiver calibrate DATASET_DIR``: measure CPU vs GPU sampling latency against batch PSGS,
store the crossover threshold in the dataset's manifest and plot both curves."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser(
        "calibrate",
        help="time CPU and GPU sampling vs batch PSGS; store the routing threshold",
        description=(
            "Times the CPU (numba) and GPU (vectorized torch) sampling paths on the same random "
            "batches of 1..MAX_BATCH seeds, fits latency = a + b * PSGS for each, and writes the "
            "crossover threshold into DATASET_DIR/manifest.json (under 'calibration') and a PNG "
            "plot. Without CUDA the second path is the torch kernel on the CPU."
        ),
    )
    p.add_argument("dataset_dir", metavar="DATASET_DIR", help="a directory from `quiver prepare`")
    p.add_argument(
        "--sizes", default=None, help="fanouts, e.g. 15,10,5 (default: the manifest's fanouts)"
    )
    p.add_argument("--max-batch", type=int, default=1024, help="largest batch (default 1024)")
    p.add_argument("--repeats", type=int, default=5, help="batches per size (default 5)")
    p.add_argument("--device", default=None, help="GPU path device (default: cuda if present)")
    p.add_argument("--plot", default=None, help="PNG path (default DATASET_DIR/calibration.png)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed (default 0)")
    p.set_defaults(func=run)


def _parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--sizes must be comma-separated integers, got {text!r}") from None
    if not sizes:
        raise ValueError("--sizes names no hop")
    return sizes


def run(args: argparse.Namespace) -> int:
    import json
    import math

    import torch

    d = Path(args.dataset_dir)
    if not (d / "manifest.json").is_file():
        raise FileNotFoundError(f"{d} is not a prepared dataset (no manifest.json)")
    manifest = json.loads((d / "manifest.json").read_text())
    if args.sizes:
        sizes = _parse_sizes(args.sizes)
    elif manifest.get("fanouts"):
        sizes = [int(k) for k in manifest["fanouts"]]
    else:
        raise ValueError("the manifest names no fanouts; pass --sizes 15,10,5")
    from quiver.datasets import load_prepared
    from quiver.hybrid import calibrate, plot_calibration, write_calibration

    topo = load_prepared(d).topo
    device = args.device
    if device is None and not torch.cuda.is_available():
        print(
            "no CUDA device: calibrating the numba CPU kernel against the vectorized torch "
            "kernel on the CPU (the serving dispatcher will run CPU-only on this machine)"
        )
        device = "cpu"

    def progress(done: int, total: int) -> None:
        if done == total or done % max(1, total // 10) == 0:
            print(f"  measured {done}/{total} batches", flush=True)

    cal = calibrate(
        topo,
        sizes,
        gpu_device=device,
        max_batch=args.max_batch,
        repeats=args.repeats,
        seed=args.seed,
        progress=progress,
    )
    write_calibration(d / "manifest.json", cal)
    plot = plot_calibration(cal, args.plot or d / "calibration.png")
    for path in ("cpu", "gpu"):
        f = cal.fits[path]
        name = cal.cpu_path if path == "cpu" else cal.gpu_path
        print(f"{path}: latency = {f['a'] * 1e3:.3f} ms + {f['b'] * 1e6:.4f} us/PSGS  ({name})")
    if math.isinf(cal.threshold):
        print("threshold (fit crossover): none -- the GPU path was not faster at any batch size")
    else:
        print(f"threshold (fit crossover): batches with PSGS >= {cal.threshold:,.0f} -> GPU path")
    emp = cal.empirical_threshold
    print(
        "threshold (best on the measured batches): "
        + ("none" if math.isinf(emp) else f"PSGS >= {emp:,.0f}")
    )
    print(f"wrote {d / 'manifest.json'} ['calibration'] and {plot}")
    return 0
