"""Quiver beyond one process (issue 21): Ray replicas, feature shards across hosts, 8 on paper.

Four parts (``--parts``, default all), on a products-like synthetic graph
(``quiver.datasets.synthetic.scaled``, default 100K nodes at products' mean degree, 100
features; ``--dataset DIR`` serves a prepared directory instead, e.g. ``data/products-like``):

- ``replicas``: throughput at p99 <= ``--p99-ms`` (100) of ``quiver serve --replicas N`` for
  N = 1 and 2 (Ray Serve, a local cluster; a 3-layer SAGE with random weights, fanouts
  [15,10,5]): open-loop Poisson load at rising rates (x1.5 from ``--start-rate``, halved
  instead while not even the first rate passes) until a rate misses the p99 or gets
  429s/errors; each run's CPU use is split into replicas, Ray's
  proxy, the rest of Ray, the load generator and everything outside this benchmark, which
  says what bounds the throughput on this machine. Skipped when Ray is not installed.
- ``share``: a skewed (Zipf) stream of ``--request-size``-seed requests; rows owned by K BFS
  blocks, each host replicating ``--budget`` of all rows by FAP (its own routed seeds,
  learned from a separate request log of the same stream), degree or random; each request
  routed to the host holding most of the rows it touches. The share of gathered rows read
  remotely at K = 2, 4, 8 (hash ownership without replicas: the floor).
- ``exchange``: two real host processes over gloo (loopback) gather their routed requests at
  K = 2 with FAP replicas: the collective ``DistFeature`` (lockstep all-to-alls, training's
  exchange) and the serving ``PeerFeature`` (point-to-point, a responder thread per host):
  milliseconds and bytes per batch, CPU per batch, against one host holding every row.
- ``paper``: what 8 hosts would do, computed from the figures measured above (assumptions
  printed as such).

(A benchmark, not a test.) Figures depend on the CPU and on what else runs: the CPU model and
the load average are printed first.

    .venv/bin/python bench/scale_out.py                          # ~5 min on 2 idle cores
    .venv/bin/python bench/scale_out.py --dataset data/products-like --budget 0.05
    .venv/bin/python bench/scale_out.py --nodes 5000 --requests 100 --duration 1 --hosts 2,4 \\
        --max-rate 40                                            # smoke run (~2 min)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

from quiver.datasets import load_prepared
from quiver.datasets.synthetic import scaled, synthetic
from quiver.feature.partition import Router, make_partition, parse_budget, remote_share
from quiver.pyg import GraphSageSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import cpu_model  # noqa: E402

SIZES = [15, 10, 5]
PARTS = ("replicas", "share", "exchange", "paper")


def _free_port() -> int:
    from quiver.serving.http import free_port

    return free_port()


def _loadavg() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "n/a"


# ------------------------------------------------------------------------------ CPU use


def _proc_table() -> dict[int, tuple[int, int, str]]:
    """``{pid: (ppid, cpu ticks, cmdline)}`` of every process we can read."""
    out = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(p.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]), cmd)
    return out


def _machine_ticks() -> tuple[int, int]:
    """``(busy, total)`` jiffies of all CPUs since boot."""
    vals = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return sum(vals) - idle, sum(vals)


def _group(cmd: str) -> str:
    if "ServeReplica" in cmd:
        return "replicas"
    if "ProxyActor" in cmd:
        return "proxy"
    return "ray"


def _cpu_snapshot(root: int) -> tuple[dict, tuple[int, int], float]:
    table = _proc_table()
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    groups: dict[str, int] = {}
    stack = [root]
    while stack:
        pid = stack.pop()
        if pid in table:
            groups[_group(table[pid][2])] = groups.get(_group(table[pid][2]), 0) + table[pid][1]
        stack.extend(kids.get(pid, []))
    return groups, _machine_ticks(), time.process_time()


def _cpu_use(before, after, seconds: float) -> dict[str, float]:
    """Cores used per group between two snapshots."""
    hz = os.sysconf("SC_CLK_TCK")
    g0, m0, me0 = before
    g1, m1, me1 = after
    use = {k: (g1.get(k, 0) - g0.get(k, 0)) / hz / seconds for k in set(g0) | set(g1)}
    use["load generator"] = (me1 - me0) / seconds
    busy = (m1[0] - m0[0]) / max(m1[1] - m0[1], 1) * (os.cpu_count() or 1)
    use["machine"] = busy
    ours = sum(v for k, v in use.items() if k != "machine")
    use["outside"] = max(busy - ours, 0.0)
    return use


# ------------------------------------------------------------------------ the dataset


def build_dataset(args, work: Path):
    """``(data_dir, dataset)``: ``--dataset`` as given, else the synthetic graph written to
    ``work``."""
    if args.dataset:
        d = Path(args.dataset)
        return d, load_prepared(d)
    d = work / "data"
    preset = scaled("products-like", args.nodes, name="products-scaled")
    synthetic(preset, seed=args.seed, out=d)
    return d, load_prepared(d)


def request_stream(n: int, args):
    rng = np.random.default_rng(args.seed)
    w = 1.0 / np.arange(1, n + 1) ** args.zipf
    q = rng.permutation(w / w.sum())
    log = rng.choice(n, size=200_000, p=q)
    seeds = [np.unique(rng.choice(n, size=args.request_size, p=q)) for _ in range(args.requests)]
    return log, seeds


def write_checkpoint(ds, path: Path) -> None:
    """A 3-layer SAGE with random weights (throughput does not depend on training)."""
    from quiver.models import ModelConfig, SampledGNN, save_checkpoint

    torch.manual_seed(0)
    classes = int(ds.manifest.get("num_classes", int(ds.labels.max()) + 1))
    cfg = ModelConfig("sage", int(ds.features.shape[1]), max(classes, 2), 128, len(SIZES))
    save_checkpoint(path, SampledGNN(cfg), {"fanouts": SIZES})


def write_partition_folder(part, folder: Path) -> Path:
    """A partition as the folder ``quiver serve --partition-dir`` reads (the dataset
    directory stays untouched)."""
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "owner.npy", part.owner.astype(np.int32))
    flat = np.concatenate(part.replicas) if part.replicas else np.zeros(0, np.int64)
    np.save(folder / "replicas.npy", flat.astype(np.int64))
    offsets = np.cumsum([0] + [r.size for r in part.replicas]).astype(np.int64)
    np.save(folder / "replica_offsets.npy", offsets)
    return folder


# ------------------------------------------------------------------- part 1: replicas


def _wait_up(url: str, proc, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"quiver serve exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready after {timeout:.0f} s")
        try:
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)


def _good(r, p99_ms: float) -> bool:
    return r.sent > 0 and r.p99_ms <= p99_ms and r.rejected == 0 and r.errors == 0


def measure_replicas(args, data_dir: Path, ckpt: Path, node_count: int, work: Path) -> dict:
    """``{N: best throughput}`` of ``quiver serve --replicas N`` at p99 <= ``--p99-ms``."""
    try:
        import ray.serve  # noqa: F401
    except ImportError:
        print("\n(replicas: skipped, Ray Serve is not installed: pip install -c constraints.txt "
              "'.[scale]')")  # fmt: skip
        return {}
    from quiver.serving.loadgen import RequestMix, run_open_loop_http

    mix = RequestMix(node_count, 1, args.request_size * 2, zipf=args.zipf)
    best: dict[int, float] = {}
    print(
        f"\n== replicas: throughput at p99 <= {args.p99_ms:g} ms, quiver serve --replicas N "
        f"(Ray Serve, --replica-cpus {args.replica_cpus:g}, --slo-ms {args.p99_ms:g}); "
        f"requests of 1-{args.request_size * 2} Zipf({args.zipf}) nodes, {args.duration:g} s "
        "per rate"
    )
    print(
        f"{'N':>2} {'offered':>8} {'rps':>7} {'p50ms':>7} {'p99ms':>7} {'rej':>5} {'err':>4} "
        f"| cores: {'replicas':>8} {'proxy':>6} {'ray':>5} {'loadgen':>7} {'outside':>7} "
        f"{'machine':>7}"
    )
    for n in [int(v) for v in args.replicas.split(",")]:
        port = _free_port()
        raytmp = tempfile.mkdtemp(prefix="qso", dir="/tmp")  # Ray's socket paths must be short
        argv = [sys.executable, "-m", "quiver.cli", "serve", str(data_dir)]
        argv += ["--checkpoint", str(ckpt), "--port", str(port), "--replicas", str(n)]
        argv += ["--replica-cpus", str(args.replica_cpus), "--slo-ms", str(args.p99_ms)]
        argv += ["--seed", "0"]
        env = {**os.environ, "RAY_TMPDIR": raytmp, "RAY_USAGE_STATS_ENABLED": "0"}
        log = open(work / f"serve_replicas{n}.log", "w")
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        runs, up = [], float("nan")
        try:
            _wait_up(url, proc, args.start_timeout)
            up = time.monotonic() - t0
            warm = mix.draw(20, seed=999)
            asyncio.run(run_open_loop_http(url, warm, 10.0, seed=999))
            rate, i = args.start_rate, 0
            while rate <= args.max_rate:
                reqs = mix.draw(max(10, int(rate * args.duration)), seed=args.seed + i)
                before = _cpu_snapshot(proc.pid)
                t = time.monotonic()
                res = asyncio.run(run_open_loop_http(url, reqs, rate, seed=args.seed + i))
                use = _cpu_use(before, _cpu_snapshot(proc.pid), time.monotonic() - t)
                runs.append((res, use))
                print(
                    f"{n:>2} {rate:>8.1f} {res.throughput_rps:>7.1f} {res.p50_ms:>7.1f} "
                    f"{res.p99_ms:>7.1f} {res.rejected:>5} {res.errors:>4} | "
                    f"{'':>7}{use.get('replicas', 0):>8.2f} {use.get('proxy', 0):>6.2f} "
                    f"{use.get('ray', 0):>5.2f} {use['load generator']:>7.2f} "
                    f"{use['outside']:>7.2f} {use['machine']:>7.2f}",
                    flush=True,
                )
                i += 1
                if not _good(res, args.p99_ms):
                    if any(_good(r, args.p99_ms) for r, _ in runs) or rate < args.start_rate / 7:
                        break
                    rate /= 2  # not even the first rate: step down
                else:
                    rate *= 1.5
                time.sleep(0.5)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
            shutil.rmtree(raytmp, ignore_errors=True)
        good = [(r, u) for r, u in runs if _good(r, args.p99_ms)]
        if not runs:
            best[n] = 0.0
            continue
        r, u = max(good, key=lambda ru: ru[0].throughput_rps) if good else runs[-1]
        best[n] = r.throughput_rps if good else 0.0
        cores = os.cpu_count() or 1
        bound = (
            f"CPU: the machine's {cores} cores were {u['machine'] / cores:.0%} busy"
            if u["machine"] >= 0.85 * cores
            else f"not the cores alone ({u['machine'] / cores:.0%} busy): latency of the hops "
            "(proxy -> replica -> engine) and queueing"
        )
        split = (
            f"replicas {u.get('replicas', 0):.2f} cores, proxy {u.get('proxy', 0):.2f}, rest "
            f"of Ray {u.get('ray', 0):.2f}, load generator {u['load generator']:.2f}, outside "
            f"this benchmark {u['outside']:.2f}"
        )
        if u["outside"] > 0.3:
            split += "; the machine is shared, rerun it idle"
        if not good:
            print(
                f"   N={n}: no rate met p99 <= {args.p99_ms:g} ms (up in {up:.0f} s; lowest "
                f"tried {r.offered_rps:.1f}/s: p99 {r.p99_ms:.0f} ms); {bound} ({split})"
            )
            continue
        why_next = ""
        if not _good(runs[-1][0], args.p99_ms):
            nr = runs[-1][0]
            why_next = (
                f"; the next rate ({nr.offered_rps:.0f}/s) missed: p99 {nr.p99_ms:.0f} ms, "
                f"{nr.rejected} x 429, {nr.errors} errors"
            )
        print(
            f"   N={n}: {r.throughput_rps:.1f} req/s at p99 {r.p99_ms:.0f} ms (up in {up:.0f} s); "
            f"bound by {bound} ({split}){why_next}"
        )
    if len(best) >= 2 and best.get(1):
        n2 = max(best)
        print(f"   {n2} replicas / 1 replica: {best[n2] / best[1]:.2f}x")
    return best


# ---------------------------------------------------------------------- part 2: share


def measure_share(args, ds, log, seeds) -> dict:
    """Remote-row share per K and policy; returns what the later parts need."""
    topo = ds.topo
    t0 = time.perf_counter()
    sampler = GraphSageSampler(topo, SIZES, mode="CPU", seed=args.seed)
    n_ids = [sampler.sample(torch.from_numpy(s))[0] for s in seeds]
    rows = sum(i.numel() for i in n_ids)
    print(
        f"\n== share: {args.requests} Zipf({args.zipf}) requests x {args.request_size} seeds, "
        f"fanouts {SIZES}, {rows:,} rows gathered ({rows / len(seeds):.0f}/request); replica "
        f"budget {args.budget} of rows per host"
    )
    cols = ["hash, none", "bfs, none", "bfs + fap", "bfs + degree", "bfs + random"]
    print(f"remote-row share (lower is better)\n{'K':>3} " + " ".join(f"{c:>13}" for c in cols))
    out = {"rows_per_request": rows / len(seeds), "share": {}, "routed": {}}
    for k in [int(h) for h in args.hosts.split(",")]:
        cells = []
        for method, policy, budget in [
            ("hash", "random", 0),
            ("bfs", "random", 0),
            ("bfs", "fap", args.budget),
            ("bfs", "degree", args.budget),
            ("bfs", "random", args.budget),
        ]:
            part = make_partition(
                topo, k, budget, policy, method, SIZES, seed_prob=log, batch_size=8
            )
            router = Router(part, topo)
            by_host = [[] for _ in range(k)]
            for s, ids in zip(seeds, n_ids, strict=True):
                by_host[router(s)].append(ids)
            share = remote_share(part, by_host)
            cells.append(share)
            out["share"][(k, method, policy, bool(budget))] = share
            if policy == "fap" and budget:
                out["routed"][k] = (part, by_host)
        print(f"{k:>3} " + " ".join(f"{c * 100:12.1f}%" for c in cells), flush=True)
    print(f"({time.perf_counter() - t0:.0f} s)")
    return out


# ------------------------------------------------------------------- part 3: exchange


def _exchange_worker(rank, mode, port, data_dir, part_dir, batches, result):
    import torch.distributed as dist

    from quiver.feature import DistFeature
    from quiver.feature.partition import find_partition
    from quiver.feature.peer import PeerConfig, PeerFeature

    torch.set_num_threads(1)
    x = load_prepared(data_dir).features
    if mode == "collective":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        part = find_partition(part_dir)
        ids = torch.from_numpy(part.local_ids(rank))
        feat = DistFeature(x[ids].contiguous(), ids, part.owner)
    else:
        cfg = PeerConfig(
            host_rank=rank, hosts=2, peer_addr=f"127.0.0.1:{port}", partition_dir=part_dir
        )
        feat = PeerFeature.from_prepared(data_dir, cfg, num_threads=1)
    mine = batches[rank]
    warm = min(5, len(mine) // 4)
    for b in mine[:warm]:
        feat[b]
    if mode == "collective":
        dist.barrier()
    feat.reset_stats()
    cpu0, t0 = time.process_time(), time.perf_counter()
    for b in mine[warm:]:
        feat[b]
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    s = feat.stats()
    for b in mine[warm : warm + 10]:  # exact, checked outside the timing
        assert torch.equal(feat[b], x[b]), "gathered rows differ from x[n_id]"
    result[rank] = dict(wall=wall, cpu=cpu, batches=len(mine) - warm, **s)
    if mode == "collective":
        dist.barrier()
        dist.destroy_process_group()
    else:
        assert feat.close(), "a host did not say BYE"


def measure_exchange(args, data_dir: Path, share: dict, work: Path) -> dict:
    """ms, bytes and CPU per batch of both exchanges at K = 2 (two processes, loopback)."""
    from quiver.feature import Feature

    if 2 not in share["routed"]:
        print("\n(exchange: needs K = 2 in --hosts)")
        return {}
    part, by_host = share["routed"][2]
    folder = write_partition_folder(part, work / "partition_k2")
    x = load_prepared(data_dir).features
    row_bytes = x.shape[1] * x.element_size()
    out = {"row_bytes": row_bytes}
    print(
        f"\n== exchange: 2 host processes over gloo (loopback), K = 2, bfs + fap, the routed "
        f"requests of part 'share' (one batch = one request), {row_bytes} B/row"
    )
    # one host holding every row: the floor
    full = Feature(num_threads=1).from_cpu_tensor(torch.as_tensor(x).contiguous())
    allb = by_host[0] + by_host[1]
    t0 = time.perf_counter()
    for b in allb:
        full[b]
    one_ms = (time.perf_counter() - t0) / len(allb) * 1e3
    print(f"one host holding every row: {one_ms:.3f} ms/batch gather")
    print(
        f"{'exchange':>11} {'host':>4} {'batches':>7} {'gather ms':>9} {'exch ms':>8} "
        f"{'CPU ms':>7} {'remote rows':>11} {'bytes out':>9} {'bytes in':>9}"
    )
    for mode in ("collective", "p2p"):
        if mode == "collective":  # lockstep: both hosts run the same number of batches
            m = min(len(b) for b in by_host)
            batches = [[b.clone() for b in by_host[h][:m]] for h in range(2)]
        else:
            batches = [[b.clone() for b in by_host[h]] for h in range(2)]
        if min(len(b) for b in batches) < 8:
            print(f"{mode:>11} (too few batches per host: raise --requests)")
            continue
        result = mp.Manager().dict()
        mp.start_processes(
            _exchange_worker,
            args=(mode, _free_port(), str(data_dir), str(folder), batches, result),
            nprocs=2,
            start_method="spawn",
        )
        per = []
        for h in range(2):
            r = dict(result[h])
            g = max(r["batches"], 1)
            remote = r["remote_rows"] / g
            if mode == "collective":
                # all_to_all of counts (8 B x K each way), ids (8 B each) and rows
                b_out = 2 * 8 + remote * 8 + r["served_rows"] / g * row_bytes
                b_in = 2 * 8 + r["served_rows"] / g * 8 + remote * row_bytes
            else:
                b_out = (r["bytes_sent"] + r["bytes_served"]) / g
                b_in = (r["bytes_received"] + r["served_rows"] * 8 + r["requests_served"] * 32) / g
            row = dict(
                gather_ms=r["wall"] / g * 1e3,
                exchange_ms=r["exchange_s"] / max(r["gathers"], 1) * 1e3,
                cpu_ms=r["cpu"] / g * 1e3,
                remote_rows=remote,
                bytes_out=b_out,
                bytes_in=b_in,
                batches=r["batches"],
            )
            per.append(row)
            print(
                f"{mode:>11} {h:>4} {row['batches']:>7} {row['gather_ms']:>9.3f} "
                f"{row['exchange_ms']:>8.3f} {row['cpu_ms']:>7.3f} {remote:>11.1f} "
                f"{b_out:>9.0f} {b_in:>9.0f}",
                flush=True,
            )
        out[mode] = {k: float(np.mean([p[k] for p in per])) for k in per[0]}
    out["one_host_ms"] = one_ms
    print(
        "(gather ms: the whole gather per batch; exch ms: from posting the requests to the "
        "last answer (p2p) or the three all-to-alls (collective); CPU ms: the host process "
        "per batch, answering the other host included; bytes: per batch, both directions)"
    )
    return out


# ---------------------------------------------------------------------- part 4: paper


def on_paper(args, ds, best: dict, share: dict, exch: dict) -> None:
    k = 8
    n, f = ds.features.shape
    row_bytes = f * ds.features.element_size()
    nic = args.nic_gbps * 1e9 / 8  # bytes/s
    print("\n== 8 hosts on paper (from the figures above; * = assumed, not measured here)")
    total_mb = n * row_bytes / 2**20
    budget_rows = parse_budget(args.budget, n)
    per_host_mb = (n / k + budget_rows) * row_bytes / 2**20
    print(
        f"features: {total_mb:,.1f} MB on one host; per host at K=8: 1/8 owned + "
        f"{budget_rows:,} replicated rows = {per_host_mb:,.1f} MB ({per_host_mb / total_mb:.0%})"
    )
    s8 = share["share"].get((k, "bfs", "fap", True)) if share else None
    rpr = share.get("rows_per_request") if share else None
    if s8 is None or rpr is None:
        print("(needs K = 8 in --hosts and part 'share')")
        return
    remote8 = s8 * rpr
    bytes8 = remote8 * (row_bytes + 8) + 7 * 32
    print(
        f"rows read remotely (fap, K=8, measured): {s8:.1%} of {rpr:.0f} rows/request = "
        f"{remote8:.0f} rows = {bytes8 / 1e3:.1f} kB/request (+ ids and headers)"
    )
    p2p = exch.get("p2p") if exch else None
    # a host of the 8 runs what served best here (1 or 2 replicas on this machine's cores)
    n_best = max(best, key=best.get) if best else None
    t1 = best[n_best] if best else None
    if p2p and p2p["remote_rows"] > 0:
        scale = remote8 / p2p["remote_rows"]
        cpu8 = p2p["cpu_ms"] * scale
        wire8 = bytes8 / nic * 1e3 + args.rtt_us / 1e3
        lat8 = max(p2p["exchange_ms"] * scale, wire8)  # the owners answering one by one
        par8 = max(p2p["exchange_ms"] * scale / (k - 1), wire8)  # ... all at once
        print(
            f"exchange per request: measured here (K=2, loopback) {p2p['exchange_ms']:.2f} ms "
            f"and {p2p['cpu_ms']:.2f} ms CPU for {p2p['remote_rows']:.0f} remote rows; scaled "
            f"by rows to K=8: ~{par8:.2f}-{lat8:.2f} ms added latency (7 owners answering at "
            f"once - one by one), ~{cpu8:.2f} ms CPU (on a *{args.nic_gbps:g} Gb/s NIC with "
            f"*{args.rtt_us:g} us RTT the wire alone: {wire8:.3f} ms)"
        )
        if t1:
            per_req_ms = 1e3 / t1
            t8 = k * 1e3 / (per_req_ms + cpu8)
            print(
                f"throughput: this host serves {t1:.0f} req/s at p99 <= {args.p99_ms:g} ms with "
                f"{n_best} replica(s) ({per_req_ms:.1f} ms of the host per request); 8 such "
                f"hosts, each also paying "
                f"~{cpu8:.2f} ms CPU per request for the exchange: ~{t8:,.0f} req/s "
                f"({t8 / t1:.1f}x one host), p99 ~ +{par8:.1f}-{lat8:.1f} ms"
            )
        elif best:
            print(f"(throughput: no replica count met a rate at p99 <= {args.p99_ms:g} ms here)")
        else:
            print("(throughput: needs part 'replicas', i.e. Ray Serve)")
    else:
        print("(exchange figures: needs part 'exchange')")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default=None, metavar="DIR", help="a prepared directory")
    ap.add_argument("--nodes", type=int, default=100_000, help="synthetic graph size (100000)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"subset of {','.join(PARTS)}")
    ap.add_argument("--budget", default="0.05", help="replicated rows per host (count/fraction)")
    ap.add_argument("--requests", type=int, default=1000, help="requests of part share")
    ap.add_argument("--request-size", type=int, default=8, help="seeds per request (8)")
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--hosts", default="2,4,8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replicas", default="1,2", help="replica counts of part replicas (1,2)")
    ap.add_argument("--replica-cpus", type=float, default=0.5)
    ap.add_argument("--p99-ms", type=float, default=100.0)
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per rate (5)")
    ap.add_argument("--start-rate", type=float, default=20.0)
    ap.add_argument("--max-rate", type=float, default=5000.0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--nic-gbps", type=float, default=25.0, help="assumed NIC (paper)")
    ap.add_argument("--rtt-us", type=float, default=50.0, help="assumed RTT (paper)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if parts - set(PARTS):
        ap.error(f"--parts: unknown {sorted(parts - set(PARTS))}")
    if "paper" in parts:
        parts |= {"replicas", "share", "exchange"}
    print(f"== {cpu_model()}, {os.cpu_count()} CPUs, load average {_loadavg()}")
    work = Path(tempfile.mkdtemp(prefix="scale_out"))
    t0 = time.perf_counter()
    try:
        data_dir, ds = build_dataset(args, work)
        n = ds.num_nodes
        print(
            f"{ds.manifest.get('name', data_dir.name)}: {n:,} nodes, {ds.topo.edge_count:,} "
            f"edges, {ds.features.shape[1]} {ds.features.dtype} features "
            f"({time.perf_counter() - t0:.0f} s to build/load)"
        )
        best, share, exch = {}, {}, {}
        if "replicas" in parts:
            ckpt = work / "ckpt.pt"
            write_checkpoint(ds, ckpt)
            best = measure_replicas(args, data_dir, ckpt, n, work)
        if {"share", "exchange"} & parts:
            log, seeds = request_stream(n, args)
            share = measure_share(args, ds, log, seeds)
        if "exchange" in parts:
            exch = measure_exchange(args, data_dir, share, work)
        if "paper" in parts:
            on_paper(args, ds, best, share, exch)
        summary = {
            "replicas_rps": best,
            "exchange": {k: v for k, v in exch.items() if k in ("collective", "p2p")},
        }
        print(f"\n{json.dumps(summary)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"load average {_loadavg()}; {time.perf_counter() - t0:.0f} s in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
