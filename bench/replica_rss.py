"""Memory per replica of ``quiver serve --replicas 2``: is the prepared dataset shared?

Prepares a synthetic dataset (100k nodes x 256 fp32 features, ~100 MB of features), trains a
small model for one epoch, starts ``quiver serve DATA --replicas 2`` (a local Ray cluster),
sends predictions over every node so each replica gathers feature rows from all of the file,
then prints for each replica its VmRSS, RssAnon and RssFile and, for the ``features.npy``
mapping, Rss, Pss and the shared / private clean pages from ``/proc/PID/smaps``. With the file
memory-mapped, its pages are shared (``Pss`` about ``Rss / replicas``) rather than copied.

Usage: ``python bench/replica_rss.py [--nodes 100000] [--dim 256]`` (needs ``.[scale]``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path


def smaps_for(pid: int, needle: str) -> dict:
    """Summed smaps fields (kB) of ``pid``'s mappings whose path contains ``needle``."""
    out: dict = {}
    inside = False
    for line in open(f"/proc/{pid}/smaps"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:
            inside = needle in line
        elif inside and line.split(":")[0] in (
            "Rss",
            "Pss",
            "Shared_Clean",
            "Private_Clean",
            "Private_Dirty",
        ):
            key, value = line.split(":")
            out[key] = out.get(key, 0) + int(value.split()[0])
    return out


def status_for(pid: int) -> dict:
    fields = ("VmRSS", "RssAnon", "RssFile")
    return {
        k: int(v.split()[0])
        for k, v in (ln.split(":", 1) for ln in open(f"/proc/{pid}/status"))
        if k in fields
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=256)
    args = p.parse_args()
    import httpx

    from quiver.cli import main as quiver_main
    from quiver.datasets import synthetic
    from quiver.datasets.synthetic import PRESETS
    from quiver.serving.client import wait_until_ready
    from quiver.serving.http import free_port

    work = Path(tempfile.mkdtemp(prefix="qrss"))
    preset = PRESETS["small"]
    preset = replace(
        preset, name="rss", num_nodes=args.nodes, num_edges=10 * args.nodes, num_features=args.dim
    )
    synthetic(preset, seed=0, out=work / "data")
    ckpt = work / "ckpt.pt"
    train = ["train-model", str(work / "data"), "--out", str(ckpt), "--epochs", "1"]
    assert quiver_main(train + ["--fanouts", "5,3", "--batch-size", "1024", "--hidden", "16"]) == 0
    port = free_port()
    argv = [sys.executable, "-m", "quiver.cli", "serve", str(work / "data")]
    argv += ["--checkpoint", str(ckpt), "--port", str(port), "--replicas", "2"]
    argv += ["--replica-cpus", "0.5", "--slo-ms", "5000"]
    env = {**os.environ, "RAY_TMPDIR": tempfile.mkdtemp(prefix="qr", dir="/tmp")}
    log = open(work / "serve.log", "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(url, timeout=180, proc=proc)
        with httpx.Client(base_url=url, timeout=60) as client:
            t0 = time.monotonic()
            for _ in range(2):
                for lo in range(0, args.nodes, 1024):
                    nodes = list(range(lo, min(lo + 1024, args.nodes)))
                    r = client.post("/v1/predict", json={"nodes": nodes})
                    assert r.status_code == 200, r.text
            print(f"{2 * args.nodes} predictions in {time.monotonic() - t0:.1f} s")
            pids = {}
            while len(pids) < 2:
                body = client.get("/healthz").json()
                pids[body["replica"]] = body["pid"]
        size = (work / "data" / "features.npy").stat().st_size >> 10
        print(f"features.npy: {size} kB")
        for replica, pid in pids.items():
            print(f"replica {replica} pid {pid}: {status_for(pid)} kB")
            print(f"  features.npy mapping: {smaps_for(pid, 'features.npy')} kB")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
