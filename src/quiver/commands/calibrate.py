"""``quiver calibrate DATASET_DIR``: measure CPU vs GPU sampling latency against batch PSGS,
store the crossover threshold in the dataset's manifest and plot both curves; with
``--checkpoint``, also time the feature gather and the model in fp32 and bf16 and record the
faster per stage for this CPU model (what ``quiver serve --precision auto`` uses)."""

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
            "plot. Without CUDA the second path is the torch kernel on the CPU. With --checkpoint "
            "it also times the feature gather and the model in fp32 and bf16 on sampled batches "
            "and records the faster per stage, with this CPU's model name, under 'precision' "
            "(read by `quiver serve --precision auto`)."
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
    p.add_argument(
        "--checkpoint",
        default=None,
        help="also choose the serving precision for this model (see `quiver serve`)",
    )
    p.add_argument("--model", default=None, help="factory for a state_dict --checkpoint")
    p.add_argument("--trust-pickle", action="store_true", help="as for `quiver serve`")
    p.add_argument(
        "--precision-batches",
        default="32,256",
        help="seeds per batch of the precision timing (default 32,256)",
    )
    p.add_argument("--precision-repeats", type=int, default=5, help="batches per size (default 5)")
    p.add_argument(
        "--torch-threads", type=int, default=1, help="model threads, as served (default 1)"
    )
    p.add_argument(
        "--no-sampling",
        dest="sampling",
        action="store_false",
        help="skip the CPU/GPU sampling calibration (with --checkpoint: precision only)",
    )
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

    if not args.sampling and not args.checkpoint:
        raise ValueError("--no-sampling leaves nothing to calibrate without --checkpoint")
    ds = load_prepared(d)
    if args.sampling:
        _calibrate_sampling(args, d, ds.topo, sizes)
    if args.checkpoint:
        _calibrate_precision(args, d, ds, sizes)
    return 0


def _calibrate_precision(args, d: Path, ds, sizes: list[int]) -> None:
    from quiver.precision import measure_precision, write_precision
    from quiver.pyg import GraphSageSampler
    from quiver.usermodel import load_served_model

    batches = _parse_sizes(args.precision_batches)
    net, minfo = load_served_model(args.checkpoint, args.model, args.trust_pickle, None)
    if not args.sizes and minfo["fanouts"]:
        sizes = [int(k) for k in minfo["fanouts"]]
    sizes = sizes + sizes[-1:] * minfo["extra_hops"]
    sampler = GraphSageSampler(
        ds.topo, sizes, mode="CPU", seed=args.seed, frontier=minfo["frontier"]
    )
    print(f"precision: timing gather and model in fp32 and bf16 (batches {batches})", flush=True)
    choice = measure_precision(
        sampler,
        ds.features,
        net,
        ds.num_nodes,
        batch_sizes=batches,
        repeats=args.precision_repeats,
        seed=args.seed,
        num_threads=args.torch_threads,
    )
    for stage in ("gather", "model"):
        t = choice.timings[stage]
        ms = ", ".join(f"{p} {v * 1e3:.1f} ms" for p, v in t.items())
        print(f"  {stage}: {ms} (summed over {len(batches) * args.precision_repeats} batches)")
    if choice.agreement is not None:
        print(
            f"  bf16 model vs fp32: argmax agreement {choice.agreement:.4f}, "
            f"max |logit diff| {choice.max_abs_diff:.4g}"
        )
    if choice.note:
        print(f"  note: {choice.note}")
    write_precision(d / "manifest.json", choice)
    print(f"precision: {choice.describe()}; wrote {d / 'manifest.json'} ['precision']")


def _calibrate_sampling(args, d: Path, topo, sizes: list[int]) -> None:
    import math

    import torch

    from quiver.hybrid import calibrate, plot_calibration, write_calibration

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
