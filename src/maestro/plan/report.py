"""Planner reports: Maestro against the monolithic plan, the saving's breakdown, plan TOMLs.

``compare`` plans both layouts for one budget and finds the GPUs Maestro needs to match the
monolithic throughput; ``breakdown`` re-plans with one of Maestro's freedoms switched off at a
time (``Ablation``) and reports how many GPU-hours each one is worth; ``plan_toml`` writes a
plan as a config: a run config (loads with ``maestro.config.load``) or a scenario plan.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from maestro.plan.search import (
    Ablation,
    Plan,
    SearchOptions,
    SectionPlan,
    gpus_to_match,
    plan_maestro,
    plan_monolithic,
)
from maestro.plan.workload import Workload

STEPS_NOTE = "consecutive steps (a frozen section runs one step ahead, as in the runtime)"

#: Ablations of ``breakdown``: label -> the freedom switched off.
ABLATIONS: dict[str, Ablation] = {
    "device sharing (colocated groups, monolithic layouts)": Ablation(disaggregated=True),
    "per-section micro-batch (forward-only large batches)": Ablation(same_mbs=True),
    "per-section tp (avoided tensor parallelism)": Ablation(same_tp=True),
    "skipped modality work": Ablation(no_skip=True),
    "balance (wavefront vs data-order scheduling)": Ablation(fifo=True),
}


@dataclass
class Comparison:
    """Maestro and monolithic plans for one budget.

    Args:
        maestro: the per-section plan.
        monolithic: the best whole-model plan.
        match: the Maestro plan with the fewest GPUs reaching the monolithic throughput
            (None if not searched or not reachable).
    """

    maestro: Plan
    monolithic: Plan
    match: Plan | None = None

    @property
    def saving_bound(self) -> float:
        """``saving`` at both plans' ``busy_bound`` (fill and drain overlapped)."""
        return 1.0 - (
            self.maestro.gpu_hours_per_million_bound / self.monolithic.gpu_hours_per_million_bound
        )

    @property
    def saving(self) -> float:
        """Fraction of GPU-hours per sample Maestro saves against the monolithic plan."""
        return 1.0 - self.maestro.gpu_hours_per_million / self.monolithic.gpu_hours_per_million


def compare(
    wl: Workload, gpus: int, options: SearchOptions | None = None, match: bool = True
) -> Comparison:
    """Plan Maestro and the monolithic baseline under the same search options."""
    m = plan_maestro(wl.samples, wl.sections, wl.cost_model, gpus, options)
    mono = plan_monolithic(wl.samples, wl.sections, wl.cost_model, gpus, options)
    found = None
    if match:
        # one simulated layout per family keeps the binary search affordable at 1,024 GPUs
        quick = replace(options or SearchOptions(), simulate_top=1)
        found = gpus_to_match(
            wl.samples, wl.sections, wl.cost_model, mono.samples_per_s, gpus, quick
        )
    return Comparison(m, mono, found)


def breakdown(wl: Workload, gpus: int, options: SearchOptions | None = None) -> dict[str, float]:
    """GPU-hours per million samples lost when each freedom is switched off.

    Returns ``{label: ablated - full}`` (GPU-hours per million samples) for every ablation
    in ``ABLATIONS`` that applies (``skipped modality work`` only when some sample skips a
    section), plus ``"full"`` (the full plan's figure).
    """
    opts = options or SearchOptions()
    full = plan_maestro(wl.samples, wl.sections, wl.cost_model, gpus, opts)
    out = {"full": full.gpu_hours_per_million}
    names = {s.name for s in wl.sections}
    skips = any(s.sections != names for s in wl.samples)
    for label, ab in ABLATIONS.items():
        if ab.no_skip and not skips:
            continue
        try:
            p = plan_maestro(
                wl.samples, wl.sections, wl.cost_model, gpus, replace(opts, ablation=ab)
            )
            out[label] = p.gpu_hours_per_million - full.gpu_hours_per_million
        except ValueError:  # nothing fits with the freedom off
            out[label] = float("inf")
    return out


def format_comparison(label: str, gpus: int, c: Comparison) -> str:
    """A readable table of both plans."""
    rows = [
        f"{label}: {c.maestro.num_samples} samples per step, budget {gpus} GPUs",
        f"{'plan':<12}{'GPUs':>6}{'step s':>10}{'samples/s':>12}{'GPU-h/M samples':>17}"
        f"{'simulated':>11}",
    ]
    for name, p in (("maestro", c.maestro), ("monolithic", c.monolithic)):
        rows.append(
            f"{name:<12}{p.gpus:>6}{p.step_time:>10.3f}{p.samples_per_s:>12.1f}"
            f"{p.gpu_hours_per_million:>17.2f}{f'{p.simulated}/{p.candidates}':>11}"
        )
    rows.append(f"maestro:    {c.maestro.describe()}")
    rows.append(f"monolithic: {c.monolithic.describe().removeprefix('monolithic: ')}")
    rows.append(f"GPU-hours saved per sample: {100 * c.saving:.1f}%")
    rows.append(
        f"  step times are steady-state periods of {STEPS_NOTE}; the first step from idle: "
        f"{c.maestro.first_step:.3f} vs {c.monolithic.first_step:.3f} s"
    )
    bound = 1 - c.maestro.gpu_hours_per_million_bound / c.monolithic.gpu_hours_per_million_bound
    rows.append(
        f"  lower bound if all fill/drain overlapped (busiest GPU's work): "
        f"{c.maestro.busy_bound:.3f} vs {c.monolithic.busy_bound:.3f} s/step, "
        f"{100 * bound:.1f}% saved"
    )
    if c.match is not None:
        rows.append(
            f"GPUs Maestro needs to match the monolithic {c.monolithic.samples_per_s:.1f} "
            f"samples/s: {c.match.gpus} (vs {c.monolithic.gpus}; "
            f"{c.match.describe()})"
        )
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------
# TOML output


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else _value(k)


def _table(name: str, d: dict) -> list[str]:
    lines = [f"[{name}]"]
    lines += [f"{_key(k)} = {_value(v)}" for k, v in d.items() if v is not None]
    return lines


def plan_toml(wl: Workload, plan: Plan) -> str:
    """The plan as TOML.

    For a run config: the same config with each section's ``dp`` and ``micro_batch_size``
    (a monolithic plan sets ``monolithic_micro_batch_size`` and is run with ``maestro train
    --monolithic --nproc DP``); it loads with ``maestro.config.load``. For a scenario: the
    ``[scenario]`` table and one ``[sections.NAME]`` table with ``dp``, ``tp``,
    ``micro_batch_size``, ``recompute`` and, for sections sharing devices, ``group`` (the
    colocated group's name; its ``dp * tp`` GPUs are counted once) per section
    (``read_plan`` reads it back).

    A run config can only hold what ``maestro.runtime`` runs: disjoint sections, or the
    whole model on every rank (plan it with ``SearchOptions(colocate=False)``).
    """
    head = [
        f"# maestro plan: {'monolithic' if plan.monolithic else 'per-section'} layout, "
        f"{plan.gpus} GPUs, predicted step {plan.step_time:.4g} s, "
        f"{plan.samples_per_s:.4g} samples/s, {plan.gpu_hours_per_million:.4g} GPU-h per "
        "million samples",
    ]
    if wl.config is not None:
        d = wl.config.to_dict()
        secs = d.pop("sections")
        work = d.pop("workload")
        if any(sp.group for sp in plan.sections.values()):
            raise ValueError(
                "a plan with colocated groups cannot be written as a run config "
                "(maestro.runtime runs disjoint sections or the whole model per rank)"
            )
        if plan.monolithic:
            sp = next(iter(plan.sections.values()))
            d["monolithic_micro_batch_size"] = sp.micro_batch_size
            head.append(f"# run: maestro train THIS.toml --monolithic --nproc {sp.dp}")
        else:
            for n, sp in plan.sections.items():
                secs[n]["dp"] = sp.dp
                secs[n]["micro_batch_size"] = sp.micro_batch_size
            d["scheduler"] = "wavefront"  # the plan was scored with it
            head.append(f"# run: maestro train THIS.toml --nproc {plan.gpus}")
        lines = head + [f"{_key(k)} = {_value(v)}" for k, v in d.items() if v is not None]
        lines += [""] + _table("workload", work)
        for n, s in secs.items():
            lines += [""] + _table(f"sections.{n}", s)
        return "\n".join(lines) + "\n"
    assert wl.scenario is not None
    sc = wl.scenario
    lines = head + [f"monolithic = {_value(plan.monolithic)}", ""]
    lines += _table("scenario", vars(sc))  # gpus: the budget, so the batch size is the same
    for n, sp in plan.sections.items():
        lines += [""] + _table(
            f"sections.{n}",
            {
                "dp": sp.dp,
                "tp": sp.tp,
                "micro_batch_size": sp.micro_batch_size,
                "recompute": sp.recompute,
                "group": sp.group or None,
            },
        )
    return "\n".join(lines) + "\n"


def read_plan(text: str) -> tuple[bool, dict[str, SectionPlan]]:
    """``(monolithic, section -> SectionPlan)`` from a scenario plan written by ``plan_toml``."""
    import tomllib

    data = tomllib.loads(text)
    secs = data.get("sections")
    if not isinstance(secs, dict) or not secs:
        raise ValueError("plan has no [sections.NAME] tables")
    out = {}
    for n, t in secs.items():
        try:
            out[n] = SectionPlan(
                int(t["dp"]),
                int(t["tp"]),
                int(t["micro_batch_size"]),
                bool(t["recompute"]),
                group=str(t.get("group", "")),
            )
        except KeyError as e:
            raise ValueError(f"sections.{n}: missing {e.args[0]}") from None
    return bool(data.get("monolithic", False)), out


__all__ = [
    "ABLATIONS",
    "read_plan",
    "Comparison",
    "breakdown",
    "compare",
    "format_comparison",
    "plan_toml",
]
