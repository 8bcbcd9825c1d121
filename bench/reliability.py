"""Serving reliability (issue 9, items 1-2): soak and overload against `quiver serve`.

Starts `quiver serve` as its own process on a loopback port, finds the sustainable rate (the
highest offered rate whose p99 meets the SLO with nothing rejected), then:

1. soak: N requests (default 200,000) at 80% of that rate, in windows of 10,000; reports
   errors, late answers, rejections, p99 per window and the server's resident memory (RSS) at
   start and end;
2. overload: 2x the sustainable rate for 60 s: how many requests got 429 and how fast, the p99
   of admitted requests, then normal load again: seconds until p99 is back under the SLO.

Every loop is bounded in count and time; traffic goes to 127.0.0.1 only. Results are printed
and appended to RELIABILITY.md.

    .venv/bin/python bench/reliability.py --preset small --requests 200000
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import signal
import subprocess
import time
from pathlib import Path

import httpx

from quiver.serving import loadgen
from quiver.serving.client import wait_until_ready
from quiver.serving.http import spawn_serve

ROOT = Path(__file__).resolve().parents[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def server_counts(url: str) -> dict[tuple[str, str], float]:
    """The server's 429 counters by reason and its latency/stage histogram buckets.

    Keys: ``("rejected", reason)``, ``("latency", le)``, ``(stage, le)`` (cumulative counts).
    """
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for smp in fam.samples:
            if smp.name == "quiver_rejected_requests_total":
                out["rejected", smp.labels.get("reason", "")] = smp.value
            elif smp.name == "quiver_request_latency_seconds_bucket":
                out["latency", smp.labels["le"]] = smp.value
            elif smp.name == "quiver_stage_seconds_bucket":
                out[smp.labels["stage"], smp.labels["le"]] = smp.value
    return out


def server_view(before: dict, after: dict, slo_s: float) -> str:
    """Where admitted requests spent their time in the server between two ``server_counts``.

    The share of server-side latencies over the SLO (the rest of a client's late answers is the
    HTTP path) and each stage's p99 bucket bound (per batch).
    """

    def diff(name: str) -> list[tuple[float, float]]:
        return sorted((float(k[1]), after[k] - before.get(k, 0.0)) for k in after if k[0] == name)

    def p99(rows) -> str:
        total = rows[-1][1] if rows else 0.0
        bound = next((le for le, c in rows if total and c >= 0.99 * total), float("nan"))
        return f"<={bound * 1e3:g} ms"

    lat = diff("latency")
    total = lat[-1][1] if lat else 0.0
    within = next((c for le, c in lat if le >= slo_s - 1e-9), total)
    stages = ("queue", "sample", "gather", "model_wait", "model")
    parts = ", ".join(f"{s} {p99(diff(s))}" for s in stages if diff(s))
    share = (total - within) / total if total else 0.0
    return (
        f"server-side: {share:.2%} of {total:.0f} answers over the SLO, p99 {p99(lat)}; "
        f"per-batch stage p99: {parts}"
    )


def prepare(preset: str, work: Path) -> tuple[Path, Path]:
    from quiver.datasets import load_prepared, synthetic
    from quiver.training import TrainConfig, train_model

    d = work / preset
    if not (d / "manifest.json").exists():
        synthetic(preset, seed=0, out=d, progress=True)
    ckpt = d / "reliability_sage.pt"
    if not ckpt.exists():
        train_model(
            load_prepared(d),
            TrainConfig(fanouts=(15, 10, 5), epochs=1, max_steps_per_epoch=30),
            out=ckpt,
        )
    return d, ckpt


async def window(url: str, mix, n: int, rate: float, seed: int) -> loadgen.LoadResult:
    # the lean client: the generator shares the 2 cores with the server it measures
    return await loadgen.run_open_loop_http(url, mix.draw(n, seed), rate, seed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--data", default=str(ROOT / "data"))
    ap.add_argument(
        "--requests", type=int, default=200_000, help="soak requests (0: skip the soak)"
    )
    ap.add_argument("--slo-ms", type=float, default=30.0)
    ap.add_argument("--rates", default="50,100,150,200,300,400", help="probe rates")
    ap.add_argument("--overload-s", type=float, default=60.0)
    ap.add_argument(
        "--sizes",
        default="1-64",
        help="request sizes, uniform LO-HI nodes (1-64); smaller requests raise the rate",
    )
    ap.add_argument(
        "--max-late-share",
        type=float,
        default=0.01,
        help="stated SLO: at most this share of soak answers may be late",
    )
    ap.add_argument(
        "--server-nice",
        type=int,
        default=0,
        help="run the server at this nice level (e.g. 5) so the generator, which shares the "
        "cores, sends on schedule; 0: same priority",
    )
    ap.add_argument(
        "--sustainable",
        type=float,
        default=0.0,
        help="take this as the sustainable rate instead of probing --rates (for quick overload "
        "experiments with --requests 0); 0: probe",
    )
    ap.add_argument(
        "--no-record", action="store_true", help="print the table only (no RELIABILITY.md append)"
    )
    args = ap.parse_args()

    work = Path(args.data)
    work.mkdir(parents=True, exist_ok=True)
    d, ckpt = prepare(args.preset, work)
    server, url = spawn_serve(d, ckpt, "--slo-ms", str(args.slo_ms), nice=args.server_nice)
    rows: list[str] = []
    try:
        node_count = wait_until_ready(url, proc=server)["node_count"]
        lo, _, hi = args.sizes.partition("-")
        mix = loadgen.RequestMix(node_count, int(lo), int(hi or lo))
        for nodes in mix.draw(20, seed=1):  # warm-up: kernel load and first-call costs
            httpx.post(f"{url}/v1/predict", json={"nodes": nodes}, timeout=60)

        # sustainable rate: highest probe rate meeting the SLO with nothing rejected
        sustainable = args.sustainable
        probes = [] if sustainable > 0 else [float(r) for r in args.rates.split(",")]
        for i, rate in enumerate(probes):
            for attempt in range(2):  # a failing probe is retried once: one stall is not capacity
                res = asyncio.run(
                    window(url, mix, int(rate * 5), rate, seed=100 + i + 50 * attempt)
                )
                ok = res.p99_ms <= args.slo_ms and res.rejected == 0 and res.errors == 0
                if ok:
                    break
            print(
                f"probe {rate:6.0f} rps: p99 {res.p99_ms:8.2f} ms, rejected {res.rejected}, "
                f"{'ok' if ok else 'over'}",
                flush=True,
            )
            if not ok:
                break
            sustainable = rate
        if sustainable == 0:
            raise SystemExit("no probe rate met the SLO; lower --rates")

        # 1. soak at 80% (--requests 0: skip)
        rate = 0.8 * sustainable
        if args.requests > 0:
            rss0 = rss_mb(server.pid)
            totals = dict(sent=0, ok=0, late=0, rejected=0, errors=0)
            p99s, lags = [], []
            t0 = time.monotonic()
            remaining, k = args.requests, 0
            while remaining > 0:
                n = min(10_000, remaining)
                res = asyncio.run(window(url, mix, n, rate, seed=1000 + k))
                for key in totals:
                    totals[key] += getattr(res, key)
                p99s.append(res.p99_ms)
                lags.append(res.send_lag_p99_ms)
                remaining -= n
                k += 1
                print(
                    f"soak window {k}: {totals['sent']:,} sent, p99 {res.p99_ms:.2f} ms, "
                    f"late {res.late}, errors {res.errors}, RSS {rss_mb(server.pid):.0f} MB",
                    flush=True,
                )
            rss1 = rss_mb(server.pid)
            soak_s = time.monotonic() - t0
            answered = totals["ok"] + totals["late"]
            late_share = totals["late"] / max(1, answered)
            rows.append(
                f"| soak | {totals['sent']:,} at {rate:.0f} rps (80% of {sustainable:.0f}) | "
                f"{totals['errors']} | {totals['rejected']} | {totals['late']} "
                f"({late_share:.2%}; stated max {args.max_late_share:.0%}) | "
                f"max window p99 {max(p99s):.1f} ms (generator up to {max(lags):.0f} ms "
                f"late) | RSS {rss0:.0f} -> {rss1:.0f} MB | "
                f"{soak_s:.0f} s |"
            )

        # 2. overload at 2x, then recovery at the normal rate
        over = 2 * sustainable
        n_over = int(over * args.overload_s)
        t_over = time.monotonic()
        before = server_counts(url)
        res = asyncio.run(window(url, mix, n_over, over, seed=7))
        over_s = time.monotonic() - t_over
        after = server_counts(url)
        why = ", ".join(
            f"{k[1]} {after[k] - before.get(k, 0):.0f}"
            for k in sorted(after)
            if k[0] == "rejected" and after[k] > before.get(k, 0) and k[1] != "invalid"
        )
        print(f"overload {server_view(before, after, args.slo_ms / 1e3)}", flush=True)
        recovery = float("nan")
        t_rec = time.monotonic()
        for j in range(20):  # 1 s windows at 80% until p99 is back under the SLO
            r = asyncio.run(window(url, mix, max(1, int(rate)), rate, seed=9000 + j))
            if r.p99_ms <= args.slo_ms and r.errors == 0:
                recovery = time.monotonic() - t_rec
                break
        rows.append(
            f"| overload | {res.sent:,} at {over:.0f} rps (2x) for {over_s:.0f} s | "
            f"{res.errors} | {res.rejected} (429 after p50 {res.reject_p50_ms:.1f} / p99 "
            f"{res.reject_p99_ms:.1f} ms; "
            f"{why or 'none'}) | "
            f"{res.late} | admitted p99 {res.p99_ms:.1f} ms (generator sent up to "
            f"{res.send_lag_p99_ms:.0f} ms late, p99) | "
            f"recovered to p99 <= SLO in {recovery:.1f} s | |"
        )
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            out, _ = server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            out = "(killed)"
        lines = out.strip().splitlines()
        print(lines[-1] if lines else "")
        problems = [ln for ln in lines if "Error" in ln or "Traceback" in ln or "died" in ln]
        if problems:  # the server's own account of any errors the generator counted
            print(f"server log: {len(problems)} error lines, first ones:")
            print("\n".join(problems[:10]))
        drained = server.returncode == 0
    rows.append(
        f"| SIGTERM | drain and exit | exit code {server.returncode} | | | | "
        f"{'ok' if drained else 'FAILED'} | |"
    )
    header = (
        f"\n## Serving reliability, {datetime.date.today()} (`python bench/reliability.py "
        f"--preset {args.preset} --requests {args.requests} --slo-ms {args.slo_ms:g} "
        f"--sizes {args.sizes}`)\n\n"
        "| run | load | errors | rejected (429) | late | latency | memory / recovery | time |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- |\n"
    )
    text = header + "\n".join(rows) + "\n"
    print(text)
    if args.no_record:
        return 0
    path = ROOT / "RELIABILITY.md"
    if not path.exists():
        path.write_text(
            "# Reliability\n\nMeasured by `bench/reliability.py` (serving) and the "
            "tests named below (training).\n"
        )
    with path.open("a") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
