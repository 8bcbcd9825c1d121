"""GPU check (issue 10): correctness and speed of Quiver's GPU paths, as one bounded run.

Sections (each prints a line to the final table; full logs go to --out):

a. sampling: GPU-mode and UVA-mode samples against the CPU sampler on a fresh random graph —
   every sampled edge exists, each target gets min(deg, k) neighbours, and the neighbour choice
   of a high-degree node is uniform (chi-square) on both paths; feature tiers (device cache,
   host zero-copy) equal ``x[n_id]``;
b. calibration: CPU vs GPU sampling latency against batch PSGS, the crossover threshold;
c. bandwidth: host zero-copy gather and device gather (GB/s) beside a device-to-device copy and
   a pinned host-to-device copy (the ceilings);
d. serving: Quiver's engine with the model on the device under open-loop load (requests/s at
   the SLO, p99 at light load).

Runs on CPU too (``--device cpu --quick``; UVA and the host link are then skipped), which is
how the tests keep it working without a GPU.

    python bench/gpu_check.py --device cuda --out $OUT
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

ROWS: list[tuple[str, str, str]] = []  # (check, figure, verdict)


def row(check: str, figure: str, ok: bool | None) -> None:
    verdict = "n/a" if ok is None else ("PASS" if ok else "FAIL")
    ROWS.append((check, figure, verdict))
    print(f"[{verdict}] {check}: {figure}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def skewed_topo(n: int, e: int, seed: int):
    """The sampling issue's skewed graph: src = perm[N u^1.5], dst = perm[N u^2]."""
    from quiver import CSRTopo

    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    src = perm[np.minimum((n * rng.random(e) ** 1.5).astype(np.int64), n - 1)]
    dst = perm[np.minimum((n * rng.random(e) ** 2).astype(np.int64), n - 1)]
    return CSRTopo.from_edge_index(torch.from_numpy(np.stack([src, dst])), num_nodes=n)


def check_structure(topo, n_id, adjs, sizes) -> tuple[bool, str]:
    """Every sampled edge exists; every target of every hop has min(deg, k) in-edges."""
    indptr = topo.indptr.cpu().numpy()
    indices = topo.indices.cpu().numpy()
    n = topo.node_count
    rows = np.repeat(np.arange(n), np.diff(indptr))
    keys = np.sort(rows * n + indices)
    n_id = n_id.cpu().numpy()
    deg = np.diff(indptr)
    for hop, (ei, _, size) in enumerate(reversed(adjs)):  # seeds' hop first
        ei = ei.cpu().numpy()
        src, dst = n_id[ei[0]], n_id[ei[1]]
        k = np.searchsorted(keys, dst * n + src)
        if (
            not (k < len(keys)).all()
            or not (keys[np.minimum(k, len(keys) - 1)] == dst * n + src).all()
        ):
            return False, f"hop {hop}: an edge that is not in the graph"
        counts = np.bincount(ei[1], minlength=size[1])
        want = np.minimum(deg[n_id[: size[1]]], sizes[hop])
        if not (counts == want).all():
            return False, f"hop {hop}: {int((counts != want).sum())} targets with a wrong count"
    return True, "edges exist, min(deg, k) per target"


def chi_square_p(sampler, topo, node: int, k: int, draws: int) -> float:
    """p-value that ``node``'s sampled first-hop neighbours are uniform over its row."""
    from scipy.stats import chisquare

    lo, hi = int(topo.indptr[node]), int(topo.indptr[node + 1])
    row_ids = topo.indices[lo:hi].cpu().numpy()
    uniq, mult = np.unique(row_ids, return_counts=True)
    counts = np.zeros(len(uniq))
    seeds = torch.tensor([node])
    for _ in range(draws):
        n_id, _, adjs = sampler.sample(seeds)
        ei = adjs[-1][0].cpu().numpy()
        picked = n_id.cpu().numpy()[ei[0]]
        counts += np.bincount(np.searchsorted(uniq, picked), minlength=len(uniq))
    # pool neighbours into at most 32 groups so every expected count is large enough for the
    # chi-square approximation (a high-degree row has ~2 expected picks per neighbour)
    groups = np.arange(len(uniq)) % min(32, len(uniq))
    obs = np.bincount(groups, weights=counts)
    expected = np.bincount(groups, weights=mult) / mult.sum() * counts.sum()
    return float(chisquare(obs, expected).pvalue)


def section_sampling(args, device, log) -> None:
    from quiver.feature import Feature
    from quiver.pyg import GraphSageSampler

    n, e = (5_000, 100_000) if args.quick else (1_000_000, 20_000_000)
    sizes = [15, 10, 5]
    topo = skewed_topo(n, e, seed=int(time.time()) % 10_000)  # fresh random input each run
    cpu = GraphSageSampler(topo, sizes, mode="CPU", seed=1)
    modes = [("GPU", dict(mode="GPU", device=device))]
    if device.type == "cuda":
        modes.append(("UVA", dict(mode="UVA", device=device)))
    seeds = torch.randperm(n)[: 1000 if not args.quick else 200]
    deg = topo.degree.cpu()
    node = int(torch.argmax(deg))
    draws = 200 if args.quick else 2000
    p_cpu = chi_square_p(cpu, topo, node, sizes[0], draws)
    for name, kw in [("CPU", None)] + modes:
        s = (
            cpu
            if kw is None
            else GraphSageSampler(topo.to(device) if name == "GPU" else topo, sizes, seed=2, **kw)
        )
        n_id, bs, adjs = s.sample(seeds.to(device) if name == "GPU" else seeds)
        ok, msg = check_structure(topo, n_id, adjs, sizes)
        p = p_cpu if kw is None else chi_square_p(s, topo, node, sizes[0], draws)
        row(
            f"sampling {name}",
            f"{msg}; uniformity p={p:.3f} (deg {int(deg[node])})",
            ok and p > 1e-3,
        )
        log[f"sampling_{name}"] = {"structure": msg, "chi2_p": p}
    # feature tiers against x[n_id]
    x = torch.randn(n, 64)
    ids = torch.cat([torch.randint(0, n, (5000,)), torch.tensor([0, 0, n - 1])])
    for label, cache in (("device cache 10%", int(0.1 * n) * 64 * 4), ("host zero-copy", 0)):
        f = Feature(0, [device], cache, csr_topo=topo, sizes=sizes).from_cpu_tensor(x)
        got = f[ids.to(device) if device.type == "cuda" else ids].cpu()
        row(
            f"feature {label}",
            f"gather of {len(ids)} rows equals x[n_id]",
            bool(torch.equal(got, x[ids])),
        )


def section_calibration(args, device, log) -> None:
    from quiver.hybrid import calibrate

    n, e = (5_000, 100_000) if args.quick else (1_000_000, 20_000_000)
    topo = skewed_topo(n, e, seed=3)
    cal = calibrate(
        topo,
        [15, 10, 5],
        gpu_device=device,
        max_batch=64 if args.quick else 1024,
        repeats=2 if args.quick else 5,
    )
    log["calibration"] = cal.to_json()
    thr = "never" if math.isinf(cal.threshold) else f"{cal.threshold:,.0f}"
    row("calibration", f"crossover batch PSGS {thr} ({cal.cpu_path} vs {cal.gpu_path})", None)


def _gbps(nbytes: int, fn, device, reps: int = 5) -> float:
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return nbytes * reps / (time.perf_counter() - t0) / 1e9


def section_bandwidth(args, device, log) -> None:
    from quiver.feature import Feature

    n, dim, k = (50_000, 64, 20_000) if args.quick else (4_000_000, 128, 1_000_000)
    x = torch.randn(n, dim)
    idx = torch.randint(0, n, (k,))
    nbytes = k * dim * 4
    host = Feature(0, [device], 0).from_cpu_tensor(x)  # every row on the host tier
    didx = idx.to(device)
    zc = _gbps(nbytes, lambda: host[didx], device)
    xd = x.to(device)
    dev = _gbps(nbytes, lambda: xd.index_select(0, didx), device)
    big = torch.empty(n * dim, device=device)
    d2d = _gbps(2 * big.numel() * 4, lambda: big.clone(), device)
    figs = {"zero_copy_gather_gbps": zc, "device_gather_gbps": dev, "d2d_copy_gbps": d2d}
    if device.type == "cuda":
        pinned = torch.empty(n * dim).pin_memory()
        h2d = _gbps(pinned.numel() * 4, lambda: pinned.to(device, non_blocking=True), device)
        figs["h2d_pinned_gbps"] = h2d
        row(
            "zero-copy gather",
            f"{zc:.1f} GB/s = {zc / h2d:.0%} of pinned H2D {h2d:.1f} GB/s",
            zc / h2d >= 0.7,
        )
    else:
        row("host gather", f"{zc:.2f} GB/s (no host link on CPU)", None)
    row("device gather", f"{dev:.1f} GB/s; D2D copy ceiling {d2d:.1f} GB/s", None)
    log["bandwidth"] = figs


def section_serving(args, device, log, work: Path) -> None:
    from quiver.datasets import load_prepared, scaled, synthetic
    from quiver.serving import ServeConfig, loadgen
    from quiver.serving.server import Server
    from quiver.training import TrainConfig, train_model

    preset = scaled("reddit-like", 2_000) if args.quick else scaled("reddit-like", 100_000)
    d = work / "reddit-scaled"
    if not (d / "manifest.json").exists():
        synthetic(preset, seed=0, out=d)
    ckpt = d / "sage.pt"
    train_model(
        load_prepared(d),
        TrainConfig(fanouts=(15, 10, 5), epochs=1, max_steps_per_epoch=5 if args.quick else 50),
        out=ckpt,
        progress=False,
    )
    cfg = ServeConfig(max_batch_nodes=512, max_wait_ms=2, torch_threads=4)
    server = Server.from_dataset(d, ckpt, cfg, device=device).start()
    rates = [20, 50] if args.quick else [100, 300, 1000, 3000, 10000]
    mix = loadgen.RequestMix(server.engine.node_count, 1, 64)

    async def target():
        async def close():
            return None

        return loadgen.engine_target(server.engine), close

    try:
        res = loadgen.sweep(
            target,
            mix,
            rates,
            duration_s=1.0 if args.quick else 5.0,
            max_requests=20_000,
            progress=False,
        )
    finally:
        server.stop()
    print(loadgen.format_table({"quiver": res}))
    best = loadgen.sustained_rps(res, 30.0)
    log["serving"] = {"info": server.info, "sustained_rps": best, "light_p99_ms": res[0].p99_ms}
    row(
        "serving (Quiver, model on device)",
        f"{best:.0f} req/s at p99 <= 30 ms; p99 at {rates[0]} req/s {res[0].p99_ms:.1f} ms",
        None,
    )
    row("serving (PyG baseline on device)", "not run: needs the PyG server's device option", None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small inputs (CPU smoke run)")
    ap.add_argument("--out", default="data/gpu-check", help="logs and JSON go here")
    ap.add_argument("--sections", default="sampling,calibration,bandwidth,serving")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: --device cuda but CUDA is not available")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log: dict = {"device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        log["gpu"] = torch.cuda.get_device_name(device)
    sections = {
        "sampling": section_sampling,
        "calibration": section_calibration,
        "bandwidth": section_bandwidth,
        "serving": lambda a, d, lg: section_serving(a, d, lg, out),
    }
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            sections[name](args, device, log)
        except Exception as e:  # one broken section must not hide the others' results
            row(name, f"crashed: {type(e).__name__}: {e}", False)
        log.setdefault("seconds", {})[name] = time.perf_counter() - t0
    (out / "gpu_check.json").write_text(json.dumps(log, indent=1, default=str))
    print(f"\n== GPU check on {log.get('gpu', device)} ==")
    w = max(len(c) for c, _, _ in ROWS)
    for check, fig, verdict in ROWS:
        print(f"{verdict:<5} {check:<{w}}  {fig}")
    return 1 if any(v == "FAIL" for _, _, v in ROWS) else 0


if __name__ == "__main__":
    raise SystemExit(main())
