"""Benchmark: colocated vs disaggregated vs monolithic on 2 real ranks (issue 24, item 5).

For each shipped 2-section example (``examples/kd.toml``, ``examples/mllm.toml``), three
layouts of the same job on 2 ranks, run for real (gloo, this CPU), interleaved, median of
``--repeats``:

- disaggregated: the example as written (each section on its own rank, wavefront);
- colocated: every section in one ``group`` with ``dp = 2`` (each rank runs both sections on
  its samples, each on its own micro-batches, outputs in memory);
- monolithic: ``--monolithic --nproc 2`` with a length-balanced sampler (the tuned baseline,
  its best micro-batch of ``--mbs``).

- colocated grids (``--grids``): one group, each member on its own grid: the frozen teacher
  / the vision encoder at ``dp = 2`` beside the student / the LLM at ``tp = 2``.

Prints samples/s and each rank's busy fraction, and the ratios to the best monolithic run.

``--sim GPUS`` instead plans the full-scale scenarios (``kd``, ``mllm``; analytical H100s)
at that budget three ways: the best colocated plan (``SearchOptions(colocate="only")``), the
best disaggregated plan (every section on its own devices) and the two baselines, and prints
GPU-hours per million samples and the savings.

Run: ``.venv/bin/python bench/maestro_colocate.py [--steps 8] [--repeats 3] [--grids]``, or
``.venv/bin/python bench/maestro_colocate.py --sim 256``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def layouts(path: Path, steps: int, mbs_choices, grids: bool = False):
    from maestro import config as C

    base = C.load(path)
    d = base.to_dict()
    d["steps"] = steps
    out = {"disaggregated": (C.from_dict(copy.deepcopy(d)), False)}
    col = copy.deepcopy(d)
    for s in col["sections"].values():
        s["dp"], s["group"] = 2, "all"
    col["config_dir"] = base.config_dir
    out["colocated"] = (C.from_dict(col), False)
    if grids:
        g = copy.deepcopy(col)
        last = list(g["sections"])[-1]  # the student / the LLM: tensor parallel
        g["sections"][last].update(dp=1, tp=2)
        out["colocated grids"] = (C.from_dict(g), False)
    for m in mbs_choices:
        mono = copy.deepcopy(d)
        mono["monolithic_micro_batch_size"] = m
        mono["monolithic_order"] = "balanced"
        out[f"monolithic mbs={m}"] = (C.from_dict(mono), True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", default="kd,mllm")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mbs", default="2,4,8", help="monolithic micro-batch sizes tried")
    ap.add_argument("--grids", action="store_true", help="also the per-member-grid layout")
    ap.add_argument("--sim", type=int, default=None, metavar="GPUS", help="plan at GPUS instead")
    args = ap.parse_args(argv)
    if args.sim is not None:
        return simulate(args.sim, args.examples)
    from maestro.runtime import RunOptions, launch

    print(f"# CPU: {cpu_model()}; 2 ranks, gloo; median of {args.repeats} interleaved runs")
    for ex in args.examples.split(","):
        runs = layouts(
            ROOT / "examples" / f"{ex}.toml",
            args.steps,
            [int(m) for m in args.mbs.split(",")],
            args.grids,
        )
        rates: dict[str, list[float]] = {k: [] for k in runs}
        busy: dict[str, dict] = {}
        for _ in range(args.repeats):
            for label, (cfg, mono) in runs.items():
                r = launch(cfg, 2, RunOptions(progress=False, monolithic=mono), timeout_s=600)
                rates[label].append(r["samples_per_s"])
                busy[label] = r["busy"]
        med = {k: statistics.median(v) for k, v in rates.items()}
        best_mono = max(v for k, v in med.items() if k.startswith("monolithic"))
        print(f"\n{ex}: samples/s (median), ratio to the best monolithic, busy fraction")
        for k, v in med.items():
            b = " ".join(f"{n}={x:.0%}" for n, x in busy[k].items())
            print(f"  {k:<18} {v:8.2f}  {v / best_mono:5.2f}x  {b}")
    return 0


def simulate(gpus: int, scenarios: str) -> int:
    """Best colocated vs best disaggregated plan vs both baselines at ``gpus`` (simulated)."""
    import time

    from maestro.plan import SearchOptions, plan_maestro, plan_monolithic
    from maestro.plan.report import layout_label
    from maestro.plan.workload import load_workload

    print(f"# CPU: {cpu_model()}; analytical H100 model; {gpus} GPUs; GPU-h per M samples")
    print(
        "| scenario | colocated | disaggregated | (b) tuned | (a) conventional | colocated vs "
        "disaggregated | colocated vs (b) | colocated vs (a) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for sc in scenarios.split(","):
        t0 = time.time()
        wl = load_workload(sc, gpus, None)
        args = (wl.samples, wl.sections, wl.cost_model, gpus)
        col = plan_maestro(*args, SearchOptions(colocate="only", include_monolithic=False))
        apart = plan_maestro(*args, SearchOptions(include_monolithic=False))
        tuned = plan_monolithic(*args, SearchOptions())
        conv = plan_monolithic(*args, SearchOptions(balance_monolithic=False))
        c, d, b, a = (p.gpu_hours_per_million for p in (col, apart, tuned, conv))
        print(
            f"| {sc} | {c:.2f} | {d:.2f} | {b:.2f} | {a:.2f} | {1 - c / d:+.1%} | "
            f"{1 - c / b:+.1%} | {1 - c / a:+.1%} |"
        )
        for label, p in (("colocated", col), ("disaggregated", apart), ("(b)", tuned)):
            print(f"  {label}: {layout_label(p)}, {p.gpus} GPUs: {p.describe()}")
        print(f"  ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
