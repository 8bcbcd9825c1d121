"""Benchmark: wavefront vs fifo vs monolithic scheduling, simulated at GPU scale and run for real.

Three parts (``--part sim,real,validate``; all by default), each printing ratios:

- ``sim``: the simulator on analytical H100/H200 presets, 256 GPUs, paper-like MLLM mixes
  (20/40/60% text-only), MLLM with audio, and KD. The monolithic baseline gets its best
  whole-model micro-batch size from a sweep. Also times one wavefront schedule and one
  simulation at 1,024 GPUs x 8,192 samples.
- ``real``: ``examples/mllm.toml`` on 2 processes (one per core, one thread each) with 20/40/60%
  text-only: samples/s of ``--scheduler fifo``, ``wavefront`` and ``--monolithic`` (best of
  micro-batch sizes 4 and 8). Step times come from the runtime's trace; ``--repeats`` runs of
  every mode, interleaved; the median and range of the runs' samples/s, and of the
  per-repeat wavefront/fifo ratio (``--mixes`` picks the text-only shares).
- ``validate``: for KD, MLLM (40% text-only) and MLLM with audio, the step time the simulator
  predicts against the measured one. The profile is fitted from traced real fifo runs on other
  batches (seeds 1000, 1001, ...; ``maestro.sim.calibrate``), interleaved with the measured
  runs; the prediction replays the measured steps' schedules back to back
  (``maestro.sim.replay``) with the runtime's rules.

Run: ``.venv/bin/python bench/maestro_schedule.py [--part sim] [--steps 8] [--repeats 2]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def sim_part() -> None:
    from maestro.schedule import get_scheduler, monolithic_schedule
    from maestro.sim import simulate
    from maestro.sim.scenarios import build

    print("== simulation, analytical presets (step time; ratios are samples/s)")
    print(
        f"{'gpu':<5}{'scenario':<16}{'gpus':>5}{'fifo s':>9}{'wave s':>9}{'mono s':>9}"
        f"{'mono mbs':>9}{'wf/fifo':>9}{'wf/mono':>9}"
    )
    cases = [
        ("H100", "mllm", 0.2),
        ("H100", "mllm", 0.4),
        ("H100", "mllm", 0.6),
        ("H200", "mllm", 0.4),
        ("H100", "mllm-audio", 0.4),
        ("H100", "kd", 0.0),
    ]
    for gpu, name, text in cases:
        sc = build(name, 256, gpu=gpu, text_only=text)
        args = (sc.samples, sc.sections, sc.cost_model)
        fifo = simulate(get_scheduler("fifo")(*args), *args).step_time
        wave = simulate(get_scheduler("wavefront")(*args), *args).step_time
        # the baseline's best whole-model micro-batch size (memory is not modelled: generous)
        mono, mbs = min(
            (simulate(monolithic_schedule(*args, micro_batch_size=m), *args).step_time, m)
            for m in (1, 2, 4, 8, 16)
        )
        label = f"{name}-{int(text * 100)}%" if name == "mllm" else name
        print(
            f"{gpu:<5}{label:<16}{256:>5}{fifo:>9.3f}{wave:>9.3f}{mono:>9.3f}{mbs:>9}"
            f"{fifo / wave:>9.2f}{mono / wave:>9.2f}"
        )
    sc = build("mllm-audio", 1024, num_samples=8192)
    args = (sc.samples, sc.sections, sc.cost_model)
    # CPU seconds as well as wall: other processes share this machine's two cores
    w, c = time.perf_counter(), time.process_time()
    sched = get_scheduler("wavefront")(*args)
    sched_wall, sched_cpu = time.perf_counter() - w, time.process_time() - c
    w, c = time.perf_counter(), time.process_time()
    simulate(sched, *args)
    sim_wall, sim_cpu = time.perf_counter() - w, time.process_time() - c
    print(
        f"1024 GPUs x 8192 samples (mllm-audio): wavefront schedule {sched_cpu:.2f} s CPU "
        f"({sched_wall:.2f} s wall), simulation {sim_cpu:.2f} s CPU ({sim_wall:.2f} s wall)"
    )


def _config(path: Path, steps: int, **changes):
    from maestro.config import load

    cfg = load(path)
    cfg.steps, cfg.threads = steps, 1
    for k, v in changes.items():
        if k == "mix":
            cfg.model.mix = v
        else:
            setattr(cfg, k, v)
    cfg.validate()
    return cfg


def _step_times(trace_path: Path) -> list[float]:
    """Wall seconds of every step, from a runtime trace: a step starts when the first rank
    starts building its batch and ends when the next step starts (the last: when the last
    rank's last event ends)."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    starts: dict[int, list[float]] = {}
    end = 0.0
    for e in events:
        if e.get("ph") != "X":
            continue
        if e["name"] == "batch + schedule":
            starts.setdefault(e["tid"], []).append(e["ts"])
        end = max(end, e["ts"] + e["dur"])
    per_rank = list(starts.values())
    steps = min(len(v) for v in per_rank)
    begin = [min(v[k] for v in per_rank) for k in range(steps)] + [end]
    return [(begin[k + 1] - begin[k]) * 1e-6 for k in range(steps)]


def _run(cfg, monolithic: bool = False) -> list[float]:
    """Per-step wall seconds of one real run (the warm-up step dropped)."""
    from maestro.runtime.launch import RunOptions, launch

    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        opts = RunOptions(monolithic=monolithic, progress=False, device="cpu", trace=str(trace))
        launch(cfg, 2 if monolithic else cfg.world_size, opts)
        return _step_times(trace)[1:]


def real_part(steps: int, repeats: int, mixes=(0.2, 0.4, 0.6)) -> None:
    import statistics

    from maestro.profiling.runs import run_and_profile

    print(
        f"\n== real runs, examples/mllm.toml on 2 processes x 1 thread, {steps} steps (first "
        f"is warm-up); {repeats} interleaved repeats per mode; samples/s from each run's mean "
        "step time: median [min-max]; wf/fifo: median of the per-repeat ratios [min-max]",
        flush=True,
    )
    print(
        f"{'text-only':<10}{'fifo':>20}{'wavefront':>20}{'wf+profile':>20}{'monolithic':>20}"
        f"{'mono mbs':>9}{'wf/fifo':>20}{'wf+p/fifo':>20}{'wf/mono':>9}",
        flush=True,
    )
    for text in mixes:
        mix = {"text": text, "image": round(1 - text, 6)}
        rates: dict[str, list[float]] = {}
        batch = _config(EXAMPLES / "mllm.toml", steps).global_batch
        # wf+profile: the scheduler's cost model fitted from a traced run on other batches
        fit = _config(EXAMPLES / "mllm.toml", steps, mix=mix)
        prof_path = Path(tempfile.mkdtemp()) / "profile.json"
        prof_path.write_text(json.dumps(run_and_profile(fit, steps=steps, seed=1000)))
        for _ in range(repeats):  # interleaved, so slow phases of a shared machine hit all
            for mode in ("fifo", "wavefront", "wf+profile", "mono4", "mono8"):
                if mode.startswith("mono"):
                    cfg = _config(
                        EXAMPLES / "mllm.toml",
                        steps,
                        mix=mix,
                        monolithic_micro_batch_size=int(mode[4:]),
                    )
                    r = _run(cfg, monolithic=True)
                elif mode == "wf+profile":
                    cfg = _config(
                        EXAMPLES / "mllm.toml",
                        steps,
                        mix=mix,
                        scheduler="wavefront",
                        cost_profile=str(prof_path),
                    )
                    r = _run(cfg)
                else:
                    r = _run(_config(EXAMPLES / "mllm.toml", steps, mix=mix, scheduler=mode))
                rates.setdefault(mode, []).append(batch / (sum(r) / len(r)))
        med = {m: statistics.median(v) for m, v in rates.items()}
        mono_mbs = 4 if med["mono4"] >= med["mono8"] else 8
        mono = f"mono{mono_mbs}"
        pairs = [w / f for w, f in zip(rates["wavefront"], rates["fifo"])]
        pairs_p = [w / f for w, f in zip(rates["wf+profile"], rates["fifo"])]

        def cell(v):
            return f"{statistics.median(v):.1f} [{min(v):.1f}-{max(v):.1f}]"

        print(
            f"{int(text * 100):>8}% {cell(rates['fifo']):>20}{cell(rates['wavefront']):>20}"
            f"{cell(rates['wf+profile']):>20}{cell(rates[mono]):>20}{mono_mbs:>9}"
            f"{f'{statistics.median(pairs):.3f} [{min(pairs):.2f}-{max(pairs):.2f}]':>20}"
            f"{f'{statistics.median(pairs_p):.3f} [{min(pairs_p):.2f}-{max(pairs_p):.2f}]':>20}"
            f"{med['wavefront'] / med[mono]:>9.3f}",
            flush=True,
        )


def _predict(cfg, cm, scheduler: str, steps: int, contention: float = 0.0):
    """Replayed step time of the measured steps (``maestro.sim.replay``), each step's schedule
    computed as the runtime computes it (same scheduler and cost model), its CPU time
    measured here and charged to the step."""
    from maestro.runtime.costs import runtime_cost_model
    from maestro.runtime.executor import resolve_scheduler
    from maestro.sim.replay import replay_steps
    from maestro.workloads import get_workload

    wl = get_workload(cfg)
    graph = wl.graph(build=[])
    specs = cfg.section_specs()
    sched_cm = None if scheduler == "fifo" else runtime_cost_model(cfg, wl)
    fn = resolve_scheduler(scheduler)
    runs, t_sched = [], []
    for step in range(1, steps):  # the runtime's first step is its warm-up
        infos = wl.sample_infos(wl.batch(step), graph)
        t = time.process_time()
        runs.append((fn(infos, specs, sched_cm), infos))
        t_sched.append(time.process_time() - t)
    return replay_steps(runs, specs, cm, schedule_s=t_sched, contention=contention).step_time


def validate_part(steps: int, repeats: int, fit_seed: int = 1000) -> None:
    import statistics

    from maestro.costmodel import MeasuredCostModel
    from maestro.profiling.runs import param_bytes_of
    from maestro.runtime.launch import RunOptions, launch
    from maestro.sim.calibrate import profile_from_trace

    print(
        f"\n== simulator vs measured step time. Per config, {repeats} rounds of: a traced fifo "
        f"run on seed {fit_seed}+k batches (the fit), then a fifo and a wavefront run on seed 0 "
        f"batches (measured), so fit and measurement see the same phases of this shared "
        f"machine. Profile: maestro.sim.calibrate over the fit traces; prediction: "
        f"maestro.sim.replay of the measured steps. {steps} steps per run; measured = median "
        f"of the runs' mean step time [min-max]",
        flush=True,
    )
    print(
        f"{'config':<18}{'scheduler':<11}{'ranks':>6}{'predicted ms':>14}{'measured ms':>13}"
        f"{'(min-max)':>18}{'error':>8}",
        flush=True,
    )
    for name in ("kd.toml", "mllm.toml", "mllm_audio.toml"):
        cfgs = {s: _config(EXAMPLES / name, steps, scheduler=s) for s in ("fifo", "wavefront")}
        measured: dict[str, list[float]] = {s: [] for s in cfgs}
        with tempfile.TemporaryDirectory() as tmp:
            traces = []
            for k in range(repeats):
                fit = _config(EXAMPLES / name, steps, scheduler="fifo", seed=fit_seed + k)
                traces.append(Path(tmp) / f"fit{k}.json")
                opts = RunOptions(progress=False, device="cpu", trace=str(traces[-1]))
                launch(fit, fit.world_size, opts)
                for sched, c in cfgs.items():
                    r = _run(c)
                    measured[sched].append(sum(r) / len(r))
            prof = profile_from_trace(
                traces,
                param_bytes=param_bytes_of(cfgs["fifo"]),
                dp={n: sc.dp for n, sc in cfgs["fifo"].sections.items()},
            )
        cm = MeasuredCostModel.from_profile(prof)
        print(f"{name}: fitted contention {prof['contention']:.2f} per other busy rank", flush=True)
        for sched, c in cfgs.items():
            pred = _predict(copy.deepcopy(c), cm, sched, steps, prof["contention"])
            ms = measured[sched]
            med = statistics.median(ms)
            print(
                f"{name:<18}{sched:<11}{c.world_size:>6}{pred * 1e3:>14.1f}{med * 1e3:>13.1f}"
                f"{f'({min(ms) * 1e3:.0f}-{max(ms) * 1e3:.0f})':>18}{(pred - med) / med:>+8.1%}",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="sim,real,validate")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mixes", default="0.2,0.4,0.6", help="text-only shares for --part real")
    args = ap.parse_args()
    parts = set(args.part.split(","))
    print(f"load average at start: {os.getloadavg()[0]:.1f} (2 cores)", flush=True)
    if "sim" in parts:
        sim_part()
    if "real" in parts:
        real_part(args.steps, args.repeats, [float(x) for x in args.mixes.split(",")])
    if "validate" in parts:
        validate_part(args.steps, args.repeats)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
