"""Planner reports: Maestro against three monolithic baselines, the saving's breakdown, TOMLs.

``compare`` plans Maestro and the three baselines of DESIGN 2.4 for one budget (the same
whole-model layout search, ``plan_monolithic``, under three samplers) and finds the GPUs
Maestro needs to match the tuned baseline's throughput; ``breakdown`` re-plans with one of
Maestro's freedoms switched off at a time (``Ablation``) and reports how many GPU-hours each
one is worth; ``plan_toml`` writes a plan as a config: a run config (loads with
``maestro.config.load``) or a scenario plan.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from maestro.costmodel import splits_tp
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
    "token-budget micro-batches (vs sample counts only)": Ablation(no_token_budget=True),
}


@dataclass(frozen=True)
class Baseline:
    """One of the three baselines: how it is printed and which sampler it runs.

    Args:
        attr: its ``Comparison`` attribute.
        label: the name printed everywhere a saving is printed.
        short: the name in narrow columns and inline lists.
        order: its ``SearchOptions.monolithic_order``.
        sampler: what its sampler does, in words.
    """

    attr: str
    label: str
    short: str
    order: str
    sampler: str


#: The three baselines of DESIGN 2.4, weakest sampler first. Each is the best one-size-fits-all
#: layout (``plan_monolithic``: the same tp/fsdp/mbs/recompute search); only the sampler
#: differs.
BASELINES: tuple[Baseline, ...] = (
    Baseline(
        "conventional",
        "conventional (a)",
        "(a)",
        "data",
        "data order (a DistributedSampler's contiguous shards)",
    ),
    Baseline(
        "careful",
        "careful (b')",
        "(b')",
        "tokens",
        "token-count-balanced (equal tokens per rank, longest first; length-sorted "
        "micro-batches, as trainers' group-by-length samplers; no cost model)",
    ),
    Baseline(
        "monolithic",
        "tuned (b, contains Maestro's cost-aware balancer)",
        "(b)",
        "cost",
        "Maestro's cost-aware balancer (equal cost-model work per rank)",
    ),
)


@dataclass
class Comparison:
    """Maestro and the three monolithic baselines for one budget (DESIGN 2.4).

    Each baseline is the best whole-model plan under the same search effort; they differ in
    their sampler only (``BASELINES``):

    - ``conventional`` (a), the paper's one-size-fits-all: samples in data order;
    - ``careful`` (b'), a token-count-balanced sampler as trainers ship
      (``maestro.schedule.monolithic.token_balanced_order``);
    - ``monolithic``, the *tuned* baseline (b): Maestro's own cost-aware balancer
      (``balanced_order``), so the saving against it excludes what balancing buys.

    ``conventional`` and ``careful`` may be ``None`` (a hand-built comparison); their
    savings then fall back to the tuned baseline.

    Args:
        maestro: the per-section plan.
        monolithic: the tuned baseline (b).
        match: the Maestro plan with the fewest GPUs reaching the tuned baseline's throughput
            (None if not searched or not reachable).
        conventional: the data-order baseline (a).
        careful: the token-balanced baseline (b').
    """

    maestro: Plan
    monolithic: Plan
    match: Plan | None = None
    conventional: Plan | None = None
    careful: Plan | None = None
    runtime_cp: bool = False

    def lacking(self, plan: Plan) -> list[str]:
        """Strategies a baseline plan uses that ``maestro train`` does not run as it does:
        context parallelism (when Maestro's search had none: ``runtime_cp``), a pipeline
        through the whole model (Maestro pipelines per section)."""
        out = []
        any_cp = max((s.cp for s in plan.sections.values()), default=1)
        if any_cp > 1 and not self.runtime_cp:
            out.append(f"context parallelism (cp={any_cp})")
        any_pp = max((s.pp for s in plan.sections.values()), default=1)
        if plan.monolithic and any_pp > 1:
            out.append(f"a whole-model pipeline (pp={any_pp}; Maestro's are per section)")
        return out

    @property
    def tuned(self) -> Plan:
        """The tuned baseline (b) (``monolithic``)."""
        return self.monolithic

    def baselines(self) -> list[tuple[Baseline, Plan]]:
        """``(Baseline, plan)`` of every baseline present, (a), (b'), (b) in that order."""
        out = [(b, getattr(self, b.attr)) for b in BASELINES]
        return [(b, p) for b, p in out if p is not None]

    def saving_against(self, base: Plan) -> float:
        """Fraction of GPU-hours per sample Maestro saves against ``base``."""
        return 1.0 - self.maestro.gpu_hours_per_million / base.gpu_hours_per_million

    def saving_bound_against(self, base: Plan) -> float:
        """``saving_against(base)`` at both plans' ``busy_bound`` (fill and drain
        overlapped)."""
        return 1.0 - self.maestro.gpu_hours_per_million_bound / base.gpu_hours_per_million_bound

    @property
    def saving_bound(self) -> float:
        """``saving`` at both plans' ``busy_bound`` (fill and drain overlapped)."""
        return self.saving_bound_against(self.monolithic)

    @property
    def saving(self) -> float:
        """Fraction of GPU-hours per sample Maestro saves against the tuned baseline (b)."""
        return self.saving_against(self.monolithic)

    @property
    def saving_conventional(self) -> float:
        """Fraction saved against the conventional baseline (a) (the tuned one when it is
        ``None``)."""
        return self.saving_against(self.conventional or self.monolithic)

    @property
    def saving_careful(self) -> float:
        """Fraction saved against the careful baseline (b') (the tuned one when it is
        ``None``)."""
        return self.saving_against(self.careful or self.monolithic)


def compare(
    wl: Workload,
    gpus: int,
    options: SearchOptions | None = None,
    match: bool = True,
    progress=None,
) -> Comparison:
    """Plan Maestro and the three baselines under the same search options.

    Maestro's own monolithic candidates use ``options.monolithic_order``; each baseline
    replaces it with its own sampler (``BASELINES``), whatever it is. The baselines plan
    ``wl.baseline_samples`` when the workload has them (the batch as other systems run it,
    e.g. a blank image tile for a text-only sample), else the same batch as Maestro.
    ``progress(label)``, when given, is called before each search (``maestro``, each
    baseline's label, ``match``): ``maestro plan`` shows it as a progress bar.
    """
    opts = options or SearchOptions()
    say = progress or (lambda label: None)
    say("maestro")
    m = plan_maestro(wl.samples, wl.sections, wl.cost_model, gpus, opts)
    theirs = wl.samples if wl.baseline_samples is None else wl.baseline_samples
    base = {}
    for b in BASELINES:
        say(b.label)
        base[b.attr] = plan_monolithic(
            theirs,
            wl.sections,
            wl.cost_model,
            gpus,
            replace(opts, monolithic_order=b.order),
            baseline=True,
        )
    mono = base.pop("monolithic")
    base["runtime_cp"] = any(k > 1 for k in opts.cp_choices)
    found = None
    if match:
        say("match")
        # one simulated layout per family keeps the binary search affordable at 1,024 GPUs
        quick = replace(opts, simulate_top=1)
        found = gpus_to_match(
            wl.samples, wl.sections, wl.cost_model, mono.samples_per_s, gpus, quick
        )
    return Comparison(m, mono, found, **base)


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
    """A readable table of Maestro's plan and every baseline, with Maestro's saving against
    each (GPU-hours per million samples, step time, GPUs)."""
    bases = c.baselines()
    w = max(len(b.label) for b, _ in bases) + 2
    rows = [
        f"{label}: {c.maestro.num_samples} samples per step, budget {gpus} GPUs",
        f"{'plan':<{w}}{'GPUs':>6}{'step s':>10}{'samples/s':>12}{'GPU-h/M samples':>17}"
        f"{'simulated':>11}{'Maestro saves':>15}",
    ]
    for name, p, saved in [("maestro", c.maestro, "")] + [
        (b.label, p, f"{100 * c.saving_against(p):.1f}%") for b, p in bases
    ]:
        rows.append(
            f"{name:<{w}}{p.gpus:>6}{p.step_time:>10.3f}{p.samples_per_s:>12.1f}"
            f"{p.gpu_hours_per_million:>17.2f}{f'{p.simulated}/{p.candidates}':>11}{saved:>15}"
        )
    rows.append(f"maestro: {c.maestro.describe()}")
    for b, p in bases:
        rows.append(
            f"{b.label}: monolithic {p.describe().removeprefix('monolithic: ')}; "
            f"sampler: {b.sampler}"
        )
        lack = c.lacking(p)
        if lack:
            rows.append(f"  {b.short} uses what maestro train lacks: {', '.join(lack)}")
    rows.append(
        "GPU-hours saved per sample by Maestro: "
        + ", ".join(f"{100 * c.saving_against(p):.1f}% vs {b.label}" for b, p in bases)
    )
    rows.append(
        f"  step times are steady-state periods of {STEPS_NOTE}; the first step from idle: "
        f"maestro {c.maestro.first_step:.3f} s, "
        + ", ".join(f"{b.short} {p.first_step:.3f} s" for b, p in bases)
    )
    rows.append(
        "  lower bound if all fill/drain overlapped (busiest GPU's work): "
        f"maestro {c.maestro.busy_bound:.3f} s/step, "
        + ", ".join(f"{b.short} {p.busy_bound:.3f}" for b, p in bases)
        + "; saved "
        + ", ".join(f"{100 * c.saving_bound_against(p):.1f}% vs {b.short}" for b, p in bases)
    )
    if c.match is not None:
        rows.append(
            "GPUs Maestro needs to match the tuned baseline's (b) "
            f"{c.monolithic.samples_per_s:.1f} samples/s: {c.match.gpus} (vs {c.monolithic.gpus}; "
            f"{c.match.describe()})"
        )
    return "\n".join(rows)


def format_breakdown(b: dict[str, float], careful: Plan | None = None) -> str:
    """``breakdown``'s result as text: GPU-h/M samples each freedom adds when switched off
    and, given the careful baseline (b'), Maestro's saving against it with that freedom off
    (what each mechanism buys, measured against (b'), not against a baseline that already
    contains Maestro's balancer)."""
    b = dict(b)
    full = b.pop("full")
    head = f"\nbreakdown: GPU-h/M samples added when one freedom is off (full plan {full:.2f}"
    if careful is not None:
        ref = careful.gpu_hours_per_million
        head += f"; careful baseline (b') {ref:.2f}, saved {100 * (1 - full / ref):.1f}%"
    lines = [head + ")"]
    for label, extra in b.items():
        row = f"  {label:<54}{extra:>+9.2f}"
        if careful is not None:
            row += f"   saved vs (b') with it off: {100 * (1 - (full + extra) / ref):>6.1f}%"
        lines.append(row)
    return "\n".join(lines)


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


#: ``SearchOptions.monolithic_order`` (or config spelling) -> ``TrainConfig.monolithic_order``
CONFIG_ORDERS = {"data": "data", "tokens": "tokens", "cost": "balanced", "balanced": "balanced"}


def _config_order(plan: Plan, order: str | None) -> str:
    """The ``monolithic_order`` to write: ``order``, default the sampler ``plan`` was scored
    with (``balanced`` for a plan that does not say)."""
    o = order if order is not None else (plan.order or "balanced")
    if o not in CONFIG_ORDERS:
        raise ValueError(f"order must be one of {', '.join(CONFIG_ORDERS)}, got {o!r}")
    return CONFIG_ORDERS[o]


def plan_toml(wl: Workload, plan: Plan, scale_down: int = 0, order: str | None = None) -> str:
    """The plan as TOML.

    For a run config: the same config with each section's ``dp``, ``fsdp``, ``tp``,
    ``zero``, ``recompute`` and ``micro_batch_size`` (the runtime's ``SectionConfig`` fields;
    a monolithic plan sets ``monolithic_micro_batch_size`` and is run with ``maestro train
    --monolithic --nproc DP``); it loads with ``maestro.config.load``. For a scenario: the
    Hugging Face job of the scenario's shape with the planned layout
    (``scenario_run_config``; ``scale_down = K``: a copy shrunk to run here); ``read_plan``
    reads the layout back. ``order``: a monolithic plan's ``monolithic_order``, default the
    sampler the plan was scored with (``Plan.order``): ``data`` (the conventional
    baseline's), ``tokens`` (the careful one's token-count balance) or ``balanced``
    (``cost``: the tuned one's cost-aware balancer).

    A colocated group's members get its ``group`` (the plan's ``"a+b"``) and share its
    grid (ZeRO-1 is written off for members). A per-section plan giving ``tp > 1`` to a
    section the runtime cannot split (``maestro.costmodel.splits_tp``, as the planner
    checks) is a ``ValueError`` naming the section.
    """
    staged = [n for n, sp in plan.sections.items() if plan.monolithic and (sp.cp > 1 or sp.pp > 1)]
    if staged:
        raise ValueError(
            f"sections.{staged[0]}: the plan splits sequences (cp) or pipelines the whole "
            "model (pp), which only the baselines may (they stand for other systems); "
            "maestro train runs pp and cp per section only"
        )
    if not plan.monolithic:
        for n, sp in plan.sections.items():
            if sp.tp > 1 and not splits_tp(wl.cost_model, n):
                raise ValueError(
                    f"sections.{n}.tp = {sp.tp}: the section's module has no transformer block "
                    "to split (maestro train refuses it); plan it with tp = 1"
                )
    head = [
        f"# maestro plan: {layout_label(plan)} layout, "
        f"{plan.gpus} GPUs, predicted step {plan.step_time:.4g} s, "
        f"{plan.samples_per_s:.4g} samples/s, {plan.gpu_hours_per_million:.4g} GPU-h per "
        "million samples",
    ]
    if wl.config is None:
        return scenario_run_config(wl, plan, head, scale_down, order)
    if scale_down:
        raise ValueError("--scale-down is for scenarios; a run config is planned as it is")
    d = wl.config.to_dict()
    secs = d.pop("sections")
    work = d.pop("workload")
    if plan.monolithic:
        sp = next(iter(plan.sections.values()))
        d["monolithic_micro_batch_size"] = sp.micro_batch_size
        d["monolithic_order"] = _config_order(plan, order)
        head.append(f"# run: maestro train THIS.toml --monolithic --nproc {sp.dp}")
    else:
        for n, sp in plan.sections.items():
            secs[n]["dp"] = sp.dp
            secs[n]["fsdp"] = sp.fsdp
            secs[n]["tp"] = sp.tp
            secs[n]["pp"] = sp.pp
            secs[n]["cp"] = sp.cp
            secs[n]["zero"] = 0 if sp.group else sp.zero
            secs[n]["recompute"] = sp.recompute
            secs[n]["micro_batch_size"] = sp.micro_batch_size
            secs[n]["group"] = sp.group or None
        d["scheduler"] = "wavefront"  # the plan was scored with it
        head.append(f"# run: maestro train THIS.toml --nproc {plan.gpus}")
    lines = head + [f"{_key(k)} = {_value(v)}" for k, v in d.items() if v is not None]
    lines += [""] + _table("workload", work)
    for n, s in secs.items():
        lines += [""] + _table(f"sections.{n}", s)
    return "\n".join(lines) + "\n"


#: the most ranks a scaled-down scenario config asks for (``--scale-down``)
RUN_HERE_RANKS = 4


def shrink_layout(
    sections: dict[str, SectionPlan], max_ranks: int = RUN_HERE_RANKS, max_tp: int = 2
) -> dict[str, SectionPlan]:
    """The same layout on at most ``max_ranks`` ranks: while it is too large, the section
    with the most ranks halves its largest degree (dp, then fsdp, then tp on a tie), so each
    section keeps its kind of strategy as long as it can; tp is capped at ``max_tp``."""
    deg = {
        n: [sp.dp, sp.fsdp, min(sp.tp, max_tp), min(sp.pp, max_tp), min(sp.cp, max_tp)]
        for n, sp in sections.items()
    }
    if len(deg) > max_ranks:
        raise ValueError(f"{len(deg)} sections do not fit {max_ranks} ranks")

    def ranks(d):
        return d[0] * d[1] * d[2] * d[3] * d[4]

    while sum(ranks(d) for d in deg.values()) > max_ranks:
        n = max(deg, key=lambda m: ranks(deg[m]))
        d = deg[n]
        i = max(range(5), key=lambda k: (d[k], -k))
        d[i] = max(1, d[i] // 2)
    return {
        n: replace(
            sp,
            dp=d[0],
            fsdp=d[1],
            tp=d[2],
            pp=d[3],
            cp=d[4],
            zero=sp.zero if d[1] == 1 and d[0] > 1 and d[3] == 1 else 0,
        )
        for n, (sp, d) in ((n, (sections[n], deg[n])) for n in sections)
    }


def scenario_run_config(
    wl: Workload, plan: Plan, head: list[str], scale_down: int = 0, order: str | None = None
) -> str:
    """A scenario's plan as a run config ``maestro train`` runs: the Hugging Face job of the
    scenario's shape (``maestro.hf.scenarios``) with the planned layout.

    ``scale_down = 0``: the real shapes, the planned layout on the planned GPUs, bf16.
    ``scale_down = K``: widths and lengths ``/ K`` (``hf.scenarios.scaled``), the layout shrunk
    to at most ``RUN_HERE_RANKS`` ranks (``shrink_layout``), a small batch, float32: it
    trains on this machine in well under a minute. A monolithic plan keeps its ``tp`` and
    ``fsdp`` in the sections at full scale (``maestro train --monolithic`` runs plain
    replicas; under ``--emulate`` each replica stands for ``tp`` GPUs priced with them) and
    ``order`` (default: the sampler it was scored with) as its ``monolithic_order``.
    """
    from maestro.hf.scenarios import scaled, scenario_job

    sc = wl.scenario
    assert sc is not None
    audio = 0.15 * (1 - sc.text_only) / 0.6
    name, job_cfg = scenario_job(sc.name, sc.text_only, audio)
    secs = dict(plan.sections)
    batch = plan.num_samples
    budgets = {s.name: s.token_budget for s in wl.sections}
    if scale_down:
        job_cfg = scaled(job_cfg, scale_down)
        if plan.monolithic:  # every section on the same ranks: shrink the one layout
            (one,) = shrink_layout({"model": next(iter(secs.values()))}).values()
            secs = {n: replace(one, recompute=sp.recompute) for n, sp in secs.items()}
        else:
            # a colocated group shrinks as one unit (its members keep one grid)
            unit = {n: sp.group or n for n, sp in secs.items()}
            first = {}
            for n, u in unit.items():
                first.setdefault(u, n)
            small = shrink_layout({u: secs[n] for u, n in first.items()})
            secs = {
                n: replace(
                    small[unit[n]],
                    micro_batch_size=sp.micro_batch_size,
                    recompute=sp.recompute,
                    group=sp.group,
                )
                for n, sp in secs.items()
            }
        batch = 16
        budgets = {n: (b // scale_down if b else None) for n, b in budgets.items()}
        # one sample always fits: the longest text plus its image and audio tokens
        longest = job_cfg.max_tokens + 64
        budgets = {n: (max(b, longest) if b else None) for n, b in budgets.items()}
        head.append(
            f"# scaled down {scale_down}x to run here (same shape ratios; layout shrunk to "
            f"at most {RUN_HERE_RANKS} ranks; planned on {plan.gpus} GPUs)"
        )
    else:
        head.append(
            f"# full scale: the scenario's shapes, the planned layout on {plan.gpus} GPUs "
            "(write a copy for this machine with --scale-down K)"
        )
    ranks = (
        next(iter(secs.values())).gpus
        if plan.monolithic
        else sum({sp.group or n: sp.gpus for n, sp in secs.items()}.values())
    )
    d = {
        "global_batch": batch,
        "steps": 4 if scale_down else 100,
        "seed": sc.seed,
        "dtype": "float32" if scale_down else "bfloat16",
        "scheduler": "wavefront",
    }
    if plan.monolithic:
        sp = next(iter(secs.values()))
        d["monolithic_micro_batch_size"] = min(sp.micro_batch_size, batch)
        d["monolithic_order"] = _config_order(plan, order)
        world = sp.data_parallel
        head.append(f"# run: maestro train THIS.toml --monolithic --nproc {world}")
        if sp.tp > 1 or sp.fsdp > 1:
            head.append(
                f"# (the plan's tp={sp.tp} fsdp={sp.fsdp} are the analytical baseline's: "
                "maestro train --monolithic runs plain replicas; --emulate prices them)"
            )
    else:
        head.append(f"# run: maestro train THIS.toml --nproc {ranks}")
    lines = head + [f"{_key(k)} = {_value(v)}" for k, v in d.items()]
    lines += [""] + _table("workload", {"name": name, **vars(job_cfg)})
    frozen = {s.name: s.frozen for s in wl.sections}
    for n, sp in secs.items():
        t = {}
        if plan.monolithic and not scale_down:  # what --emulate prices; a real run ignores
            t = {"fsdp": sp.fsdp, "tp": sp.tp, "recompute": sp.recompute and not frozen[n]}
        elif not plan.monolithic:
            t = {
                "dp": sp.dp,
                "fsdp": sp.fsdp,
                "tp": sp.tp,
                "pp": sp.pp,
                "cp": sp.cp,
                "zero": sp.zero if not frozen[n] and sp.fsdp == 1 and sp.pp == 1 else 0,
                "recompute": sp.recompute and not frozen[n],
                "group": sp.group or None,
            }
        t["micro_batch_size"] = min(sp.micro_batch_size, batch)
        t["token_budget"] = budgets.get(n)
        if frozen[n]:
            t["frozen"] = True
        lines += [""] + _table(f"sections.{n}", t)
    return "\n".join(lines) + "\n"


def layout_label(plan: Plan) -> str:
    """``"monolithic"`` or ``"per-section"``: which layout a plan is."""
    return "monolithic" if plan.monolithic else "per-section"


def read_plan(text: str) -> tuple[bool, dict[str, SectionPlan]]:
    """``(monolithic, section -> SectionPlan)`` from a config written by ``plan_toml``.

    A monolithic plan is said in the header comment (its sections carry no layout; each
    reads as one replica). Missing layout fields take ``SectionConfig``'s defaults.
    """
    import tomllib

    data = tomllib.loads(text)
    secs = data.get("sections")
    if not isinstance(secs, dict) or not secs:
        raise ValueError("plan has no [sections.NAME] tables")
    mono = text.startswith("# maestro plan: monolithic")
    out = {}
    for n, t in secs.items():
        if "micro_batch_size" not in t:
            raise ValueError(f"sections.{n}: missing micro_batch_size")
        out[n] = SectionPlan(
            int(t.get("dp", 1)),
            int(t.get("tp", 1)),
            int(t["micro_batch_size"]),
            bool(t.get("recompute", False)),
            group=str(t.get("group", "")),
            fsdp=int(t.get("fsdp", 1)),
            zero=int(t.get("zero", 0)),
            pp=int(t.get("pp", 1)),
            cp=int(t.get("cp", 1)),
        )
    return mono, out


__all__ = [
    "ABLATIONS",
    "BASELINES",
    "CONFIG_ORDERS",
    "Baseline",
    "format_breakdown",
    "RUN_HERE_RANKS",
    "layout_label",
    "scenario_run_config",
    "shrink_layout",
    "read_plan",
    "Comparison",
    "breakdown",
    "compare",
    "format_comparison",
    "plan_toml",
]
