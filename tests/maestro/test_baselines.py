"""The three monolithic baselines (DESIGN 2.4): conventional (a, data order), careful (b',
token-count-balanced sampler) and tuned (b, Maestro's cost-aware balancer), their samplers,
the comparison's savings and where they are printed."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from maestro.cli import main
from maestro.costmodel import AnalyticalCostModel, SectionShape, micro_batch_features
from maestro.plan import SearchOptions, compare, format_comparison, plan_monolithic, plan_toml
from maestro.plan.options import Plan, SectionPlan
from maestro.plan.plot import SweepPoint, format_sweep
from maestro.plan.problem import _balanced_order, _Problem
from maestro.plan.report import BASELINES, Comparison, format_breakdown
from maestro.schedule import monolithic as M
from maestro.schedule.types import SampleInfo, SectionSpec

TUNED = "tuned (b, contains Maestro's cost-aware balancer)"


class NoCostModel:
    """A cost model that must not be consulted: pricing anything fails the test."""

    def _boom(self, *args, **kwargs):
        raise AssertionError("the sampler consulted the cost model")

    forward_time = backward_time = optimizer_time = allreduce_time = _boom


def _problem(samples, world, **opts) -> _Problem:
    cm = AnalyticalCostModel({"m": SectionShape(layers=2, hidden=256)})
    return _Problem(samples, [SectionSpec("m")], cm, world, SearchOptions(**opts))


class WorkCostModel:
    """Forward time is a sample's ``work`` feature, independent of its tokens."""

    def forward_time(self, name, f):
        return f["work"]

    def backward_time(self, name, f):
        return 2 * f["work"]


def _samples(n: int, seed: int = 0) -> list[SampleInfo]:
    """Long-tailed token counts, and a ``work`` unrelated to them."""
    rng = random.Random(seed)
    return [
        SampleInfo(
            i,
            frozenset({"m"}),
            {"tokens": float(int(rng.lognormvariate(6, 1)) + 16), "work": rng.random() ** 3},
        )
        for i in range(n)
    ]


def _shards(order, world):
    n = len(order)
    return [order[(r * n) // world : ((r + 1) * n) // world] for r in range(world)]


def _spread(order, world, key):
    sums = [sum(key(s) for s in shard) for shard in _shards(order, world)]
    return max(sums) - min(sums)


def _tokens(s):
    return s.cost["tokens"]


def _work(s):  # WorkCostModel's work of a trainable unit: forward + backward
    return 3 * micro_batch_features([s.cost])["work"]


def test_data_order_is_data_order():
    samples = _samples(50)
    assert M.sampler_order("data", samples, 8, NoCostModel()) == samples
    p = _problem(samples, 8, balance_monolithic=False)
    assert p.opts.monolithic_order == "data"
    assert _balanced_order(p, samples, 8, NoCostModel()) == samples
    with pytest.raises(ValueError, match="unknown monolithic order"):
        M.sampler_order("random", samples, 8)


@pytest.mark.parametrize("n, world", [(256, 8), (250, 8), (37, 5), (7, 7)])
def test_token_sampler_balances_token_sums_without_the_cost_model(n, world):
    samples = _samples(n, seed=n)
    out = M.sampler_order("tokens", samples, world, NoCostModel(), [("m", False)])
    assert sorted(s.sample_id for s in out) == list(range(n))
    # equal sample counts: the same contiguous shard sizes monolithic_schedule cuts
    assert [len(x) for x in _shards(out, world)] == [len(x) for x in _shards(samples, world)]
    longest = max(_tokens(s) for s in samples)
    assert _spread(out, world, _tokens) <= longest
    if n >= 16 * world:  # enough samples per rank for the greedy to even them out
        assert _spread(out, world, _tokens) < _spread(samples, world, _tokens) / 4
    for shard in _shards(out, world):  # length-sorted micro-batches: longest first per rank
        assert [_tokens(s) for s in shard] == sorted((_tokens(s) for s in shard), reverse=True)
    assert out == M.token_balanced_order(samples, world)  # deterministic, no model needed
    # the planner's path too: a problem whose sampler is "tokens" never prices a sample
    p = _problem(samples, world, monolithic_order="tokens")
    assert _balanced_order(p, samples, world, NoCostModel()) == out


def test_cost_sampler_balances_cost_model_work_not_tokens():
    samples, world = _samples(256, seed=1), 8
    cm = WorkCostModel()
    cost = M.sampler_order("cost", samples, world, cm, [("m", False)])
    tokens = M.sampler_order("tokens", samples, world)
    assert sorted(s.sample_id for s in cost) == list(range(256))
    assert cost == M.balanced_order(samples, world, cm, [("m", False)])
    heaviest = max(_work(s) for s in samples)
    assert _spread(cost, world, _work) <= heaviest
    # each balances its own measure, not the other's: work is unrelated to tokens here
    assert _spread(cost, world, _work) < _spread(tokens, world, _work) / 4
    assert _spread(tokens, world, _tokens) < _spread(cost, world, _tokens) / 4


def test_the_careful_baseline_never_calls_the_cost_balancer(kd16, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the careful baseline called Maestro's cost-aware balancer")

    monkeypatch.setattr(M, "balanced_order", boom)
    wl = kd16
    opts = SearchOptions(simulate_top=1, monolithic_order="tokens")
    p = plan_monolithic(wl.samples, wl.sections, wl.cost_model, 16, opts)
    assert p.monolithic and p.order == "tokens"
    with pytest.raises(AssertionError, match="cost-aware balancer"):
        plan_monolithic(
            wl.samples, wl.sections, wl.cost_model, 16, replace(opts, monolithic_order="cost")
        )


def test_search_options_sampler_field_and_alias():
    assert SearchOptions().monolithic_order == "cost"
    assert SearchOptions(balance_monolithic=False).monolithic_order == "data"
    assert SearchOptions(balance_monolithic=True).monolithic_order == "cost"
    assert SearchOptions(monolithic_order="balanced").monolithic_order == "cost"
    o = SearchOptions(balance_monolithic=False)
    assert replace(o, monolithic_order="tokens").monolithic_order == "tokens"
    assert replace(o).monolithic_order == "data"
    with pytest.raises(ValueError, match="monolithic_order must be one of data, tokens, cost"):
        SearchOptions(monolithic_order="length")


def _plan(gph: float, order: str = "", bound: float | None = None) -> Plan:
    # gpus * step / samples * 1e6 / 3600 = gph  with 1 GPU, 1 sample
    step = gph * 3600 / 1e6
    return Plan(
        {"m": SectionPlan(1, 1, 1)},
        bool(order),
        1,
        1,
        step,
        step,
        busy_bound=bound if bound is not None else step,
        order=order,
    )


def test_savings_are_against_the_right_plan():
    c = Comparison(
        _plan(60.0),
        monolithic=_plan(75.0, "cost", bound=75.0 * 3600 / 1e6),
        conventional=_plan(120.0, "data"),
        careful=_plan(80.0, "tokens"),
    )
    assert c.saving == pytest.approx(1 - 60 / 75)
    assert c.saving_careful == pytest.approx(1 - 60 / 80)
    assert c.saving_conventional == pytest.approx(1 - 60 / 120)
    assert c.tuned is c.monolithic
    assert [(b.attr, p.order) for b, p in c.baselines()] == [
        ("conventional", "data"),
        ("careful", "tokens"),
        ("monolithic", "cost"),
    ]
    text = format_comparison("toy", 1, c)
    assert "50.0% vs conventional (a), 25.0% vs careful (b'), 20.0% vs " + TUNED in text
    # a hand-built comparison without the weaker baselines falls back to the tuned one
    alone = Comparison(_plan(60.0), _plan(75.0, "cost"))
    assert alone.saving_careful == alone.saving_conventional == alone.saving
    assert "careful" not in format_comparison("toy", 1, alone)
    b = format_breakdown({"full": 60.0, "x": 20.0}, c.careful)
    assert "careful baseline (b') 80.00, saved 25.0%" in b
    assert "saved vs (b') with it off:" in b and b.split()[-1] == "0.0%"  # 60 + 20 = (b')


def test_baselines_plan_the_batch_as_other_systems_run_it(kd16, monkeypatch):
    import maestro.plan.report as R

    seen = []

    def record(kind):
        def plan(samples, sections, cm, gpus, opts=None, baseline=False):
            # the baselines (and only they) search pipeline and context parallelism
            assert baseline == (kind == "baseline")
            seen.append((kind, samples, getattr(opts, "monolithic_order", None)))
            return _plan(50.0 if kind == "maestro" else 60.0, "" if kind == "maestro" else "x")

        return plan

    monkeypatch.setattr(R, "plan_maestro", record("maestro"))
    monkeypatch.setattr(R, "plan_monolithic", record("baseline"))
    theirs = [replace(s, cost={**s.cost, "tokens": s.cost["tokens"] + 256}) for s in kd16.samples]
    c = R.compare(replace(kd16, baseline_samples=theirs), 16, match=False)
    assert [(k, x is kd16.samples, o) for k, x, o in seen[:1]] == [("maestro", True, "cost")]
    assert [(k, x is theirs, o) for k, x, o in seen[1:]] == [
        ("baseline", True, "data"),
        ("baseline", True, "tokens"),
        ("baseline", True, "cost"),
    ]
    assert c.saving_careful == pytest.approx(1 - 50 / 60)
    seen.clear()
    R.compare(kd16, 16, match=False)  # none given: the baselines plan Maestro's batch
    assert all(x is kd16.samples for _, x, _ in seen)
    # maestro plan's progress bar: one call before each search, in the order they run
    monkeypatch.setattr(R, "gpus_to_match", lambda *a, **k: None)
    said = []
    R.compare(kd16, 16, progress=said.append)
    assert said == ["maestro", *(b.label for b in R.BASELINES), "match"]


@pytest.fixture(scope="module")
def kd_compare(kd16):
    return compare(kd16, 16, SearchOptions(simulate_top=1), match=False)


def test_compare_plans_all_three_baselines(kd16, kd_compare):
    c, wl = kd_compare, kd16
    assert (c.conventional.order, c.careful.order, c.monolithic.order) == ("data", "tokens", "cost")
    assert all(p.monolithic for _, p in c.baselines())
    for b, p in c.baselines():  # each is plan_monolithic under its own sampler
        want = plan_monolithic(
            wl.samples,
            wl.sections,
            wl.cost_model,
            16,
            SearchOptions(simulate_top=1, monolithic_order=b.order),
            baseline=True,
        )
        assert p.gpu_hours_per_million == pytest.approx(want.gpu_hours_per_million)
        assert c.saving_against(p) == pytest.approx(
            1 - c.maestro.gpu_hours_per_million / want.gpu_hours_per_million
        )
    # Maestro's own monolithic candidates use its balancer: never worse than the whole-model
    # layout maestro train runs under it ((b) itself may pipeline or split sequences, which
    # Maestro's plans may not, so it can win)
    runnable = plan_monolithic(
        wl.samples, wl.sections, wl.cost_model, 16, SearchOptions(simulate_top=1)
    )
    assert c.maestro.gpu_hours_per_million <= runnable.gpu_hours_per_million + 1e-9
    # the printed figures are those of the plans
    text = format_comparison("kd", 16, c)
    rows = {
        b.label: line
        for b, _ in c.baselines()
        for line in text.splitlines()
        if line.startswith(b.label + "  ")
    }
    for b, p in c.baselines():
        cols = rows[b.label].removeprefix(b.label).split()
        assert int(cols[0]) == p.gpus and float(cols[1]) == pytest.approx(p.step_time, abs=1e-3)
        assert float(cols[3]) == pytest.approx(p.gpu_hours_per_million, abs=0.01)
        assert cols[5] == f"{100 * c.saving_against(p):.1f}%"


def test_plan_toml_writes_each_baselines_sampler(kd16):
    # the whole-model layouts maestro train runs (no pp, no cp), one per sampler
    wl = kd16
    runnable = {
        order: plan_monolithic(
            wl.samples,
            wl.sections,
            wl.cost_model,
            16,
            SearchOptions(simulate_top=1, monolithic_order=order),
        )
        for order in ("data", "tokens", "cost")
    }
    for order, want in (("data", "data"), ("tokens", "tokens"), ("cost", "balanced")):
        assert f'monolithic_order = "{want}"' in plan_toml(kd16, runnable[order])
    assert 'monolithic_order = "data"' in plan_toml(kd16, runnable["cost"], order="data")
    assert 'monolithic_order = "balanced"' in plan_toml(kd16, runnable["tokens"], order="cost")
    with pytest.raises(ValueError, match="order must be one of"):
        plan_toml(kd16, runnable["cost"], order="sorted")


def test_plan_cli_names_all_three_baselines(capsys):
    # 16 GPUs: the same table as at 64, in a quarter of the time (four searches and the
    # GPUs-to-match bisection on the kernel-level cost model)
    assert main(["plan", "kd", "--gpus", "16"]) == 0
    text = capsys.readouterr().out
    for b in BASELINES:
        row = next(line for line in text.splitlines() if line.startswith(b.label + "  "))
        assert row.endswith("%")  # Maestro's saving against it, in its row
        assert f"{b.label}: monolithic " in text and b.sampler in text
    saved = next(line for line in text.splitlines() if line.startswith("GPU-hours saved"))
    assert "vs conventional (a)" in saved and "vs careful (b')" in saved and f"vs {TUNED}" in saved


def test_sweep_table_has_three_baselines():
    text = format_sweep([SweepPoint(8, 60.0, 75.0, 120.0, "m dp=1", careful=80.0)])
    row = next(line for line in text.splitlines() if line.startswith("    8 "))
    assert row.split()[1:8] == ["60.00", "120.00", "80.00", "75.00", "+50.0%", "+25.0%", "+20.0%"]
    assert TUNED in text and "careful (b'" in text


def test_baselines_may_pipeline_and_split_sequences_maestro_may_not():
    """The baselines' search is open to whole-model pp and cp (other systems have them);
    plan_maestro's own monolithic candidate is not (maestro train --monolithic runs plain
    replicas), its sections pipeline only as its runtime does, and plan_toml refuses a
    baseline's staged plan."""
    from maestro.plan import SearchOptions, plan_maestro, plan_monolithic, plan_toml
    from maestro.plan.workload import ScenarioSpec, scenario_workload

    wl = scenario_workload(ScenarioSpec(name="kd", gpus=16, samples_per_gpu=4))
    # a tight memory limit makes staging the only way to fit the 34B teacher with the student
    opts = SearchOptions(memory_limit=40e9, tp_choices=(1, 2), fsdp_choices=(1,))
    base = plan_monolithic(wl.samples, wl.sections, wl.cost_model, 16, opts, baseline=True)
    assert any(s.pp > 1 or s.cp > 1 for s in base.sections.values())
    assert base.gpus == next(iter(base.sections.values())).gpus
    with pytest.raises(ValueError, match="only the baselines may"):
        plan_toml(wl, base)
    with pytest.raises(ValueError, match="no monolithic layout fits"):
        plan_monolithic(wl.samples, wl.sections, wl.cost_model, 16, opts)
    try:
        m = plan_maestro(wl.samples, wl.sections, wl.cost_model, 16, opts)
    except ValueError:
        return  # nothing Maestro runs fits: fine
    # Maestro pipelines and splits sequences per section (maestro train runs both), never
    # across the whole model
    assert not m.monolithic or all(s.pp == 1 and s.cp == 1 for s in m.sections.values())
