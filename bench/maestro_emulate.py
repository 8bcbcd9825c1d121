"""Benchmark: the planner's layouts run on the real runtime with emulated devices.

For each paper-like scenario (kd, mllm) and GPU count (default 16 and 32): plan Maestro, the
tuned baseline (b: best monolithic plan, length-balanced sampler) and the conventional one
(a: one configuration, data order) under the same search, plus Maestro's best per-section
(disaggregated) layout; write each as a run config; run each with ``maestro train --emulate``
(``maestro.emulate``: launcher, scheduler, executor, messages, FSDP/TP collectives and
all-reduces real; every compute a wait of the H100 cost model's duration) and print the
measured steady-state step against the simulator's prediction, and the savings measured on
the runtime against (a) and (b).

THIS IS AN EMULATION: no model runs and no GPU is involved; what it checks is that the
runtime's own ordering and synchronisation realise the step the simulator predicts for the
plan, at rank counts this machine cannot run for real.

Run: ``.venv/bin/python bench/maestro_emulate.py [--gpus 16,32] [--scenarios kd,mllm]
[--steps 4] [--time-scale 1.0]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def plans(scenario: str, gpus: int):
    """``{label: (Plan, order)}``: Maestro, its best disaggregated layout, (b) and (a)."""
    from maestro.plan import SearchOptions, compare, load_workload
    from maestro.plan.search import Ablation, plan_maestro

    wl = load_workload(scenario, gpus)
    opts = SearchOptions(objective="gpu_hours", balance_monolithic=True)
    c = compare(wl, gpus, opts, match=False)
    out = {
        "maestro": (c.maestro, "balanced"),
        "tuned (b)": (c.monolithic, "balanced"),
        "conventional (a)": (c.conventional, "data"),
    }
    if c.maestro.monolithic:
        dis = plan_maestro(
            wl.samples,
            wl.sections,
            wl.cost_model,
            gpus,
            replace(opts, ablation=Ablation(disaggregated=True)),
        )
        out["per-section"] = (dis, "balanced")
    return wl, out


def run_emulated(path: Path, plan, scenario: str, steps: int, scale: float) -> dict:
    sp = next(iter(plan.sections.values()))
    cmd = [
        sys.executable,
        "-m",
        "maestro.cli",
        "train",
        str(path),
        "--emulate",
        scenario,
        "--steps",
        str(steps),
        "--quiet",
        "--emulate-time-scale",
        str(scale),
    ]
    if plan.monolithic:
        cmd += ["--monolithic", "--nproc", str(sp.data_parallel)]
    res = path.with_suffix(".json")
    cmd += ["--result", str(res)]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    r = json.loads(res.read_text())
    r["wall_s"] = time.time() - t0
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", default="16,32")
    ap.add_argument("--scenarios", default="kd,mllm")
    ap.add_argument("--steps", type=int, default=4, help="steps per run (the first is warm-up)")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    from maestro.plan import plan_toml

    print(f"# CPU: {cpu_model()}; EMULATION (H100 cost model), time scale {args.time_scale}")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for scenario in args.scenarios.split(","):
            for gpus in [int(g) for g in args.gpus.split(",")]:
                wl, ps = plans(scenario, gpus)
                print(f"\n{scenario} at {gpus} GPUs, {len(wl.samples)} samples per step")
                print(
                    f"  {'plan':<17} {'GPUs':>4} {'planned':>8} {'sim win':>8} {'emulated':>8} "
                    f"{'error':>7} {'GPU-h/M plan':>12} {'GPU-h/M emul':>12}  layout"
                )
                got = {}
                for label, (plan, order) in ps.items():
                    path = Path(d) / f"{scenario}-{gpus}-{label.split()[0]}.toml"
                    path.write_text(plan_toml(wl, plan, order=order))
                    r = run_emulated(path, plan, scenario, args.steps, args.time_scale)
                    em = r["emulation"]
                    step, win = em["measured_step_s"], em["simulated_window_step_s"]
                    # GPU-hours from the emulated window, against the simulator's same window
                    gh = plan.gpus * step / len(wl.samples) / 3600 * 1e6
                    got[label] = gh
                    row = {
                        "scenario": scenario,
                        "gpus": gpus,
                        "plan": label,
                        "plan_gpus": plan.gpus,
                        "planned_period_s": plan.step_time,
                        "sim_window_step_s": win,
                        "emulated_step_s": step,
                        "error": em["error"],
                        "gpu_h_per_m_planned": plan.gpu_hours_per_million,
                        "gpu_h_per_m_emulated": gh,
                        "layout": plan.describe(),
                        "wall_s": r["wall_s"],
                    }
                    rows.append(row)
                    print(
                        f"  {label:<17} {plan.gpus:>4} {plan.step_time:>8.3f} {win:>8.3f} "
                        f"{step:>8.3f} {em['error']:>+7.1%} {plan.gpu_hours_per_million:>12.2f} "
                        f"{gh:>12.2f}  {plan.describe()}",
                        flush=True,
                    )
                m = got["maestro"]
                print(
                    f"  emulated saving: {1 - m / got['tuned (b)']:+.1%} vs (b), "
                    f"{1 - m / got['conventional (a)']:+.1%} vs (a)"
                )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
