"""A cost-model profile fitted from a real run's trace, so the simulator sees what ranks pay.

``maestro.sim.profile`` times each section alone in one process. A real rank pays more per
micro-batch: packing and sending its outputs, receiving and unpacking its inputs, the Python
around each micro-batch, padding of mixed lengths, and, per step, the non-finite check, the
optimizer, all-reduces and building the global batch, all while other ranks share the
machine's memory bandwidth. ``profile_from_trace`` fits the same JSON profile format as the
isolated profiler (``MeasuredCostModel.from_profile`` reads both) from the spans the runtime
records (``runtime/trace.py``):

- Each forward or backward span opens a *unit of work* of its micro-batch. The unit's time is
  the span plus the sends right after it plus every gap (time in no span: Python work) until
  the rank next blocks; time a rank spends blocked (receive waits, the run-ahead bound,
  flushing sends) is excluded, because the simulator produces waiting itself. Gaps before a
  step's first unit belong to the step overhead.
- A forward row is ``(micro-batch features, forward unit seconds)``; the section's backward
  unit of the same micro-batch gives ``forward_backward_s``.
- ``optimizer_s``: per step, the work after the last unit (gradient checks and other gaps),
  the optimizer span, and the fastest non-finite guard (its own cost without waiting).
- DP all-reduce spans (``dp > 1``) give ``link_bw`` (ring all-reduce of the gradient bytes).
- ``bytes_per``: bytes sent per unit of the cost feature whose ratio is steadiest.
- ``contention``: ranks sharing one machine slow each other (memory bandwidth, caches,
  cores). A unit's compute time is modelled as ``(1 + c * k)`` times its uncontended time,
  ``k`` the mean number of other ranks computing meanwhile (from the trace); ``c`` is fitted
  over all rows, and the rows keep the uncontended times. ``maestro.sim.replay`` applies it.
- ``step_overhead_s``: building the batch (the ``batch + schedule`` span minus the scheduler's
  own ``scheduler`` span), the gaps before the first unit and between steps.

``maestro.profiling.runs.run_and_profile`` runs a short real training with tracing on and fits
its profile with this module (the simulator never imports the runtime).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

#: span categories that are compute (``runtime.trace.COMPUTE``)
COMPUTE = ("forward", "backward", "optimizer")
#: cost keys tried as the unit of a section's output bytes (the steadiest ratio wins)
BYTE_KEYS = ("images", "audio", "text_tokens", "tokens", "samples")
_US = 1e-6


def _by_rank(events: Sequence[Mapping]) -> dict[int, tuple[str, list[Mapping]]]:
    """``rank -> (label, complete events sorted by start)`` from Chrome trace events."""
    labels: dict[int, str] = {}
    spans: dict[int, list[Mapping]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            labels[e["tid"]] = e["args"]["name"].split(": ", 1)[-1]
        elif e.get("ph") == "X":
            spans[e["tid"]].append(e)
    return {r: (labels.get(r, ""), sorted(v, key=lambda e: e["ts"])) for r, v in spans.items()}


class _Unit:
    __slots__ = ("kind", "step", "mb", "feats", "cost", "bytes", "span", "others", "run")

    def __init__(self, kind, step, mb, feats, cost, span):
        self.kind, self.step, self.mb, self.feats, self.cost = kind, step, mb, feats, cost
        self.bytes = 0.0
        self.span = span  # (start, end) seconds of the compute span itself
        self.others = 0.0  # mean number of other ranks computing during ``span``
        self.run = 0  # which trace it comes from


def _split_rank(spans: list[Mapping]):
    """Units of work, per-step overheads, tails and comm spans of one rank's timeline."""
    units: list[_Unit] = []
    overhead: list[float] = []  # per step: batch building and pre-work gaps
    between: list[float] = []  # gaps from a step's last span to the next step's start
    tails: list[float] = []  # per step: work after the last unit, plus the optimizer span
    guards: list[float] = []
    allreduce: list[float] = []
    sched: list[float] = []
    cur: _Unit | None = None
    pre = 0.0  # work since the last unit closed, charged to the next unit
    started = False  # a unit has run in this step
    prev_end = None
    tail = None
    for e in spans:
        ts, dur = e["ts"] * _US, e["dur"] * _US
        name, cat = e["name"], e["cat"]
        if name == "scheduler":  # nested inside "batch + schedule"
            sched.append(dur)
            overhead[-1] -= dur
            continue
        gap = max(0.0, ts - prev_end) if prev_end is not None else 0.0
        end = ts + dur
        if name == "batch + schedule":
            if tail is not None:
                tails.append(tail)
                between.append(gap)
            overhead.append(dur)
            cur, pre, started, tail = None, 0.0, False, None
            prev_end = end
            continue
        if not overhead:  # spans before the first step (none expected)
            prev_end = end
            continue
        if cat in ("forward", "backward"):
            a = e.get("args", {})
            if not started:
                overhead[-1] += pre + gap
                pre, gap = 0.0, 0.0
            cur = _Unit(cat, a.get("step"), a.get("mb"), a.get("feats"), pre + gap + dur, (ts, end))
            units.append(cur)
            pre, started, tail = 0.0, True, 0.0
        elif cat == "send":
            if cur is not None:
                cur.cost += gap + dur
                cur.bytes += float(e.get("args", {}).get("bytes", 0.0))
            else:
                pre += gap + dur
        elif cat == "wait":
            if cur is not None:
                cur.cost += gap
            else:
                pre += gap
            cur = None
        else:  # comm, optimizer, checkpoint: the step's tail
            cur = None
            if tail is None:
                tail = 0.0
            tail += pre + gap
            pre = 0.0
            if name == "non-finite guard":
                guards.append(dur)
            elif cat == "comm":
                allreduce.append(dur)
            elif cat == "optimizer":
                tail += dur
        prev_end = max(prev_end or end, end)
    if tail is not None:
        tails.append(tail + pre)
    return units, overhead, between, tails, guards, allreduce, sched


def _split_monolithic(spans: list[Mapping]) -> list[dict]:
    """Per step of one monolithic rank (``runtime/monolithic.py``): its micro-batches'
    ``(mb, forward unit, backward unit)`` seconds, and its overhead, tail and all-reduce.

    A forward unit is the forward span plus the Python before it; a backward unit the
    backward span plus the gap after its forward. Gaps before a step's first forward and
    after the step's last span belong to the step overhead (``between``: to the next step's
    start); the tail is everything from the last backward to the step's end (the untraced
    non-finite guard, the optimizer) except the gradient all-reduce, kept apart.
    """
    steps: list[dict] = []
    prev_end = None
    for e in spans:
        ts, dur = e["ts"] * _US, e["dur"] * _US
        gap = max(0.0, ts - prev_end) if prev_end is not None else 0.0
        prev_end = max(prev_end or ts + dur, ts + dur)
        name, cat = e["name"], e["cat"]
        if name == "batch + schedule":
            if steps:
                steps[-1]["between"] = gap
            steps.append({"units": [], "overhead": dur, "tail": 0.0, "allreduce": 0.0})
            continue
        if not steps:
            continue
        st = steps[-1]
        if cat == "forward":
            if st["units"]:
                st["units"].append([e.get("args", {}).get("mb"), gap + dur, 0.0])
            else:
                st["overhead"] += gap
                st["units"].append([e.get("args", {}).get("mb"), dur, 0.0])
        elif cat == "backward" and st["units"]:
            st["units"][-1][2] += gap + dur
        elif cat == "comm":
            st["tail"] += gap
            st["allreduce"] += dur
        elif cat == "optimizer":
            st["tail"] += gap + dur
    return steps


def _fit_monolithic(runs: list[tuple[Sequence[Mapping], object]], skip_steps: int) -> dict:
    """The profile's ``"monolithic"`` record from monolithic traces and their feature maps.

    Rows keep their measured times (contention included: every rank of a monolithic run
    computes at once). Per step, the tail and all-reduce are the smallest over the ranks
    (the last rank to reach the guard waits least), then the median over steps; the
    all-reduce is kept per world size.
    """
    rows, tails, overheads, betweens = [], [], [], []
    allreduce: dict[int, list[float]] = defaultdict(list)
    largest = 0.0
    for events, feats_of in runs:
        ranks = _by_rank(events)
        world = len(ranks)
        per_rank = {r: _split_monolithic(spans) for r, (_, spans) in ranks.items()}
        num_steps = min(len(v) for v in per_rank.values())
        for step in range(skip_steps, num_steps):
            for r, steps in per_rank.items():
                st = steps[step]
                for mb, fwd, bwd in st["units"]:
                    f = feats_of(step, r, mb)
                    largest = max(largest, f["samples"])
                    rows.append({"features": f, "forward_s": fwd, "forward_backward_s": fwd + bwd})
                overheads.append(st["overhead"])
                if "between" in st:
                    betweens.append(st["between"])
            tails.append(min(steps[step]["tail"] for steps in per_rank.values()))
            allreduce[world].append(min(steps[step]["allreduce"] for steps in per_rank.values()))
    if len(rows) < 2:
        raise ValueError(f"monolithic traces have {len(rows)} micro-batches; need 2 or more")
    keys = select_features(rows)
    for r in rows:
        r["features"] = {k: v for k, v in r["features"].items() if k in keys or k == "samples"}
    return {
        "rows": rows,
        "optimizer_s": _median(tails),
        "allreduce_s": {str(w): _median(v) for w, v in allreduce.items()},
        "step_overhead_s": _median(overheads) + (min(betweens) if betweens else 0.0),
        "max_micro_batch": largest,
    }


def _bytes_per(units: list[_Unit]) -> dict[str, float]:
    """Bytes per unit of the cost key whose bytes-per-unit ratio varies least."""
    rows = [(u.feats, u.bytes) for u in units if u.kind == "forward" and u.feats and u.bytes > 0]
    best = None
    for key in BYTE_KEYS:
        ratios = [b / f[key] for f, b in rows if f.get(key, 0.0) > 0]
        if rows and len(ratios) == len(rows):
            mean = statistics.mean(ratios)
            spread = statistics.pstdev(ratios) / max(mean, 1e-12)
            if best is None or spread < best[0]:
                best = (spread, key, mean)
    return {best[1]: best[2]} if best is not None else {}


def _loo_error(rows: list[tuple[Mapping[str, float], float]], keys: list[str]) -> float:
    """Leave-one-out RMS relative error of a ``LinearFit`` on ``keys`` (plus a constant)."""
    from maestro.costmodel import LinearFit

    err = 0.0
    for i, (f, y) in enumerate(rows):
        fit = LinearFit.fit(rows[:i] + rows[i + 1 :], keys)
        err += ((fit({**f, "samples": f.get("samples", 1.0)}) - y) / max(y, 1e-9)) ** 2
    return (err / len(rows)) ** 0.5


def select_features(rows: list[dict], max_keys: int = 3) -> list[str]:
    """Cost features that predict a section's times, chosen by leave-one-out error.

    With a few dozen rows, fitting on every feature that varies (``samples``, ``tokens``,
    ``tokens_sq``, ``images``, ...; many collinear) overfits. Greedy forward selection: start
    from a constant per micro-batch and add the feature that lowers the leave-one-out error
    of the forward (and forward+backward) fits most, while it lowers it by 5% or more.

    Args:
        rows: profile rows (``features``, ``forward_s``, optional ``forward_backward_s``).
        max_keys: at most this many features.
    """
    targets = [[(r["features"], r["forward_s"]) for r in rows]]
    fb = [(r["features"], r["forward_backward_s"]) for r in rows if "forward_backward_s" in r]
    if len(fb) >= 3:
        targets.append(fb)
    if len(rows) < 3:
        return []
    first = rows[0]["features"]
    cands = sorted(
        k
        for k in {k for r in rows for k in r["features"]}
        if any(r["features"].get(k, 0.0) != first.get(k, 0.0) for r in rows)
    )

    def error(keys: list[str]) -> float:
        return sum(_loo_error(t, keys) for t in targets)

    chosen: list[str] = []
    best = error(chosen)
    while len(chosen) < max_keys:
        trials = [(error([*chosen, k]), k) for k in cands if k not in chosen]
        if not trials:
            break
        e, k = min(trials)
        if e > 0.95 * best:
            break
        chosen.append(k)
        best = e
    return chosen


def _fit_contention(sections: dict[str, dict], max_c: float = 1.5) -> float:
    """Fit ``c`` in ``time = (1 + c * others) * base(features)`` and divide it out of the rows.

    ``base`` is each section's linear fit on its selected features, refitted for every ``c``
    on a grid of step 0.02 in ``[0, max_c]``; the ``c`` with the smallest squared relative
    error over every row (forward and forward+backward) wins. Then every row's time is
    divided by its ``1 + c * others``.
    """
    from maestro.costmodel import LinearFit

    groups = []
    for rec in sections.values():
        rows = rec["rows"]
        for key, okey in (("forward_s", "others"), ("forward_backward_s", "others_fb")):
            data = [r for r in rows if key in r]
            if len(data) >= 2:
                keys = sorted(
                    k for k in data[0]["features"] if len({r["features"].get(k) for r in data}) > 1
                )
                groups.append(
                    (
                        [r["features"] for r in data],
                        [r[key] for r in data],
                        [r[okey] for r in data],
                        keys,
                    )
                )

    def error(c: float) -> float:
        err = 0.0
        for feats, ys, ks, keys in groups:
            fit = LinearFit.fit([(f, y / (1 + c * k)) for f, y, k in zip(feats, ys, ks)], keys)
            err += sum(((1 + c * k) * fit(f) / y - 1) ** 2 for f, y, k in zip(feats, ys, ks))
        return err

    grid = [i * 0.02 for i in range(int(round(max_c / 0.02)) + 1)]
    c = min(grid, key=error) if groups else 0.0
    for rec in sections.values():
        for r in rec["rows"]:
            r["forward_s"] /= 1.0 + c * r["others"]
            if "forward_backward_s" in r:
                r["forward_backward_s"] /= 1.0 + c * r["others_fb"]
    return c


def _median(xs: Sequence[float], default: float = 0.0) -> float:
    return float(statistics.median(xs)) if xs else default


def _events_of(trace) -> Sequence[Mapping]:
    if isinstance(trace, (str, Path)):
        path = Path(trace)
        if not path.exists():
            raise FileNotFoundError(f"trace {path} does not exist")
        trace = json.loads(path.read_text())
    return trace["traceEvents"] if isinstance(trace, Mapping) else trace


def _collect(events, run: int, skip_steps: int, per_section) -> None:
    """Add one trace's units (with their overlap with other ranks) and per-step figures."""
    from maestro.sim.replay import busy_integral

    ranks = _by_rank(events)
    busy = busy_integral(
        {
            r: [(e["ts"] * _US, (e["ts"] + e["dur"]) * _US) for e in spans if e["cat"] in COMPUTE]
            for r, (_, spans) in ranks.items()
        }
    )
    for _, (label, spans) in sorted(ranks.items()):
        section = label.split("[")[0]
        units, overhead, between, tails, guards, allr, sched = _split_rank(spans)
        units = [u for u in units if u.step is None or u.step >= skip_steps]
        for u in units:
            a, b = u.span
            u.run = run
            u.others = max(0.0, busy(b) - busy(a) - (b - a)) / (b - a) if b > a else 0.0
        d = per_section[section]
        d["units"] += units
        d["overhead"] += overhead[skip_steps:]
        d["between"] += between[skip_steps:]
        d["tails"] += tails[skip_steps:]
        d["guards"] += guards[skip_steps:]
        d["allreduce"] += allr[skip_steps:]
        d["sched"] += sched[skip_steps:]


def profile_from_trace(
    trace: str | Path | Mapping | Sequence[Mapping],
    *,
    skip_steps: int = 1,
    param_bytes: Mapping[str, float] | None = None,
    dp: Mapping[str, int] | None = None,
    link_latency: float = 50e-6,
    monolithic: Sequence[tuple[object, object]] = (),
) -> dict:
    """Fit a cost-model profile from a runtime trace (``maestro train --trace``).

    Args:
        trace: a Chrome trace file written by the runtime, its parsed dict, or its events;
            or a list of trace files or dicts (several runs, fitted together). Section
            runs only (``maestro train`` without ``--monolithic``).
        skip_steps: leading steps to ignore (the warm-up).
        param_bytes: section -> gradient bytes (for ``MeasuredCostModel.allreduce_time``).
        dp: section -> replicas in the traced run (to fit ``link_bw`` from all-reduces).
        link_latency: seconds per message, kept in the profile.
        monolithic: ``(trace, features)`` of monolithic runs (``--monolithic``), features
            from ``monolithic_features``; fitted into the profile's ``"monolithic"`` record
            (``costmodel.WholeModelFit``), so monolithic layouts are priced with the
            monolithic runtime's own costs.

    Returns:
        A profile dict for ``MeasuredCostModel.from_profile``, plus ``"source": "trace"`` and
        ``"scheduler_s"`` (mean seconds the traced run's scheduler took per step).

    Raises:
        ValueError: the trace has no forward spans with features (an older runtime, or
            ``skip_steps`` dropped every step), or a section has fewer than 2 rows.
    """
    many = (
        isinstance(trace, list)
        and bool(trace)
        and not (isinstance(trace[0], Mapping) and "ph" in trace[0])
    )
    per_section: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for run, one in enumerate(trace if many else [trace]):
        _collect(_events_of(one), run, skip_steps, per_section)
    sections: dict[str, dict] = {}
    overheads, scheds = [], []
    link_bws = []
    # the guard is an all-reduce over the trainable ranks: all but the last to arrive wait
    # in it, so its own cost is its fastest instance anywhere
    guard_s = min((g for d in per_section.values() for g in d["guards"]), default=0.0)
    for name, d in per_section.items():
        fwd = {(u.run, u.step, u.mb): u for u in d["units"] if u.kind == "forward" and u.feats}
        bwd = {(u.run, u.step, u.mb): u for u in d["units"] if u.kind == "backward"}
        rows = []
        for key, u in fwd.items():
            row = {"features": dict(u.feats), "forward_s": u.cost, "others": u.others}
            if key in bwd:
                b = bwd[key]
                row["forward_backward_s"] = u.cost + b.cost
                w = (u.span[1] - u.span[0], b.span[1] - b.span[0])
                row["others_fb"] = (row["others"] * w[0] + b.others * w[1]) / max(sum(w), 1e-12)
            rows.append(row)
        if len(rows) < 2:
            raise ValueError(
                f"trace has {len(rows)} forward spans with features for section {name!r}; "
                "need 2 or more (trace a run of the current runtime with more steps)"
            )
        keys = select_features(rows)
        for r in rows:  # the profile keeps only the selected features (and the count)
            r["features"] = {k: v for k, v in r["features"].items() if k in keys or k == "samples"}
            if "samples" not in keys:  # constant, so ``from_profile`` leaves it out
                r["features"]["samples"] = 1.0
        trainable = bool(bwd)
        optimizer_s = 0.0
        if trainable:
            optimizer_s = _median(d["tails"]) + guard_s
        pb = float((param_bytes or {}).get(name, 0.0))
        n = int((dp or {}).get(name, 1))
        if trainable and n > 1 and pb > 0 and d["allreduce"]:
            t = min(d["allreduce"]) - 2 * (n - 1) * link_latency
            if t > 0:
                link_bws.append(2.0 * (n - 1) / n * pb / t)
        sections[name] = {
            "rows": rows,
            "bytes_per": _bytes_per(d["units"]),
            "param_bytes": pb,
            "optimizer_s": optimizer_s,
        }
        overheads.append(_median(d["overhead"]) + (min(d["between"]) if d["between"] else 0.0))
        scheds += d["sched"]
    if not sections:
        raise ValueError("trace has no ranks with spans")
    contention = _fit_contention(sections)
    prof = {
        "sections": sections,
        "step_overhead_s": statistics.mean(overheads),
        "link_latency": link_latency,
        "source": "trace",
        "contention": contention,
        "scheduler_s": statistics.mean(scheds) if scheds else 0.0,
    }
    if link_bws:
        prof["link_bw"] = statistics.median(link_bws)
    if monolithic:
        rec = _fit_monolithic([(_events_of(t), f) for t, f in monolithic], skip_steps)
        # frozen sections have no gradients (``param_bytes_of`` counts 0 bytes for them)
        rec["param_bytes"] = float(sum((param_bytes or {}).values()))
        prof["monolithic"] = rec
    return prof


def step_scale_by_size(rows: Sequence[Mapping]) -> dict[str, dict[int, float]]:
    """Per layout kind, the median measured over replayed step time of the profiling runs at
    each micro-batch size (``rows`` as ``_step_scale`` records them). The ratio is not
    constant: on this machine a 2-rank KD section pipeline measures 1.35-1.48x its replay at
    micro-batches 1-2 and 1.11-1.18x at 8 (more, smaller messages, each a wait the replay
    does not see), so one median over all sizes would over-charge the large micro-batches
    the planner picks. A row's size is its layout's smallest micro-batch (the profiling runs
    use one size for every section)."""
    by: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["replayed_s"] > 0:
            by[r["layout"]][int(r["micro_batch"])].append(r["measured_s"] / r["replayed_s"])
    return {k: {m: _median(v, 1.0) for m, v in sorted(t.items())} for k, t in by.items()}


__all__ = [
    "BYTE_KEYS",
    "profile_from_trace",
    "select_features",
    "step_scale_by_size",
]
