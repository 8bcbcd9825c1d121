"""The planner's search: memory limits, GPU budgets, TP model, monolithic equivalence."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from maestro.costmodel import GPU_PRESETS, AnalyticalCostModel, SectionShape
from maestro.plan import (
    Ablation,
    SearchOptions,
    TPCostModel,
    gpus_to_match,
    plan_maestro,
    plan_monolithic,
)
from maestro.plan.problem import _balanced_order, _Problem
from maestro.schedule.types import SampleInfo, SectionSpec
from maestro.sim.scenarios import SHAPES

FEATS = {"samples": 4.0, "tokens": 4096.0, "tokens_sq": 4 * 1024.0**2}


def used_gpus(plan) -> int:
    """GPUs a plan occupies: a colocated group's (or the monolithic layout's) counted once."""
    if plan.monolithic:
        s = next(iter(plan.sections.values()))
        return s.gpus
    seen, total = set(), 0
    for n, s in plan.sections.items():
        key = s.group or n
        if key not in seen:
            seen.add(key)
            total += s.gpus  # dp * fsdp * tp
    return total


def test_tp1_is_the_base_model_exactly():
    base = AnalyticalCostModel({"llm": SHAPES["llm"]})
    tp = TPCostModel(base, {"llm": 1})
    assert tp.forward_time("llm", FEATS) == base.forward_time("llm", FEATS)
    assert tp.backward_time("llm", FEATS) == base.backward_time("llm", FEATS)
    assert tp.allreduce_time("llm", 8, False) == base.allreduce_time("llm", 8, False)
    assert tp.memory_bytes("llm", FEATS, True) == base.memory_bytes("llm", FEATS, True)


def test_tp_splits_compute_and_memory_but_pays_communication():
    base = AnalyticalCostModel({"llm": SHAPES["llm"]})
    f1 = base.forward_time("llm", FEATS)
    for t in (2, 4, 8):
        m = TPCostModel(base, {"llm": t})
        ft = m.forward_time("llm", FEATS)
        assert f1 / t < ft < f1  # faster, but not perfectly
        assert m.memory_bytes("llm", FEATS, True) == pytest.approx(
            base.memory_bytes("llm", FEATS, True) / t
        )
    with pytest.raises(ValueError, match="tp of section"):
        TPCostModel(base, {"llm": 0})


@pytest.mark.parametrize("gpus", [4, 8, 13, 16])
def test_plans_respect_the_gpu_budget(mllm16, gpus):
    p = plan_maestro(mllm16.samples, mllm16.sections, mllm16.cost_model, gpus)
    assert set(p.sections) == {"vision", "audio", "llm"}
    assert p.gpus == used_gpus(p) <= gpus
    assert all(s.dp >= 1 and s.tp in (1, 2, 4, 8) for s in p.sections.values())
    for g in {s.group for s in p.sections.values()} - {""}:
        # a colocated group's members share one (dp, tp)
        assert len({(s.dp, s.tp) for s in p.sections.values() if s.group == g}) == 1
    mono = plan_monolithic(mllm16.samples, mllm16.sections, mllm16.cost_model, gpus)
    (tp,) = {s.tp for s in mono.sections.values()}
    (dp,) = {s.data_parallel for s in mono.sections.values()}  # dp * fsdp
    assert mono.gpus == dp * tp <= gpus and 1 <= dp <= gpus // tp


def test_gpu_budget_below_one_per_section_is_an_error_unless_sections_share(mllm16):
    apart = SearchOptions(colocate=False, include_monolithic=False)
    with pytest.raises(ValueError, match="at least one GPU per section"):
        plan_maestro(mllm16.samples, mllm16.sections, mllm16.cost_model, 2, apart)
    # three sections fit three GPUs only if the 7B LLM fitted one GPU; it needs tp >= 2
    with pytest.raises(ValueError, match="no layout of the sections fits within 3 GPUs"):
        plan_maestro(mllm16.samples, mllm16.sections, mllm16.cost_model, 3, apart)
    # sharing devices, the three sections fit on 4 GPUs, fewer than they need apart (one
    # replica group holds them all; with the logits and the allocator's headroom counted,
    # 2 GPUs no longer hold the 7B LLM's state and a micro-batch)
    with pytest.raises(ValueError, match="no layout of the sections fits within 4 GPUs"):
        plan_maestro(mllm16.samples, mllm16.sections, mllm16.cost_model, 4, apart)
    p = plan_maestro(mllm16.samples, mllm16.sections, mllm16.cost_model, 4)
    assert p.gpus == used_gpus(p) <= 4
    assert p.monolithic or len({s.group for s in p.sections.values()}) == 1


def test_memory_limit_is_respected_and_forces_tp(kd16):
    cm = kd16.cost_model
    teacher_weights = 2.0 * SHAPES["teacher"].params
    # room for the teacher's weights on 2 GPUs but not on 1: they must be sharded, by tp,
    # by fsdp or by pipeline stages (which the search weighs against each other)
    limit = 0.7 * teacher_weights
    opts = SearchOptions(memory_limit=limit)
    p = plan_maestro(kd16.samples, kd16.sections, cm, 16, opts)
    assert all(s.memory <= limit for s in p.sections.values())
    t = p.sections["teacher"]
    assert t.tp * t.fsdp * t.pp >= 2
    from maestro.plan.problem import _section_options

    tight = _section_options(_Problem(kd16.samples, kd16.sections, cm, 16, opts), "teacher")
    loose = _section_options(
        _Problem(kd16.samples, kd16.sections, cm, 16, SearchOptions(memory_limit=1e15)),
        "teacher",
    )
    assert {o.tp for o in tight if o.fsdp == 1 and o.pp == 1} == {2, 4, 8} and 1 in {
        o.tp for o in loose
    }
    assert all(o.fsdp >= 2 for o in tight if o.tp == 1 and o.pp == 1)
    mono = plan_monolithic(kd16.samples, kd16.sections, cm, 16, opts)
    assert all(s.memory <= limit for s in mono.sections.values())
    # the monolithic replica holds both models: it must shard them (tp or fsdp)
    m = mono.sections["teacher"]
    assert m.tp * m.fsdp * m.pp >= 2
    with pytest.raises(ValueError, match="fits"):
        plan_maestro(kd16.samples, kd16.sections, cm, 16, SearchOptions(memory_limit=1e9))
    with pytest.raises(ValueError, match="no monolithic layout fits"):
        plan_monolithic(kd16.samples, kd16.sections, cm, 16, SearchOptions(memory_limit=1e9))


def test_producer_holding_its_batch_needs_enough_replicas(mllm16):
    # the trainable vision encoder runs all forwards before its backwards, so its kept
    # activations shrink only with more replicas: a tight limit without recompute needs dp
    # (per-section layouts only: a whole-model replica holds no batch of activations, and
    # under GPU-hours a one-GPU whole-model plan may win)
    opts = SearchOptions(
        recompute_choices=(False,),
        tp_choices=(1,),
        memory_limit=20e9,
        pp_choices=(1,),
        include_monolithic=False,
    )
    wl = replace(mllm16, sections=[s for s in mllm16.sections if s.name != "audio"])
    wl.sections[-1] = replace(wl.sections[-1], inputs=("vision",))
    samples = [replace(s, sections=s.sections - {"audio"}) for s in wl.samples]
    cm = AnalyticalCostModel(
        {"vision": SHAPES["vision"], "llm": SectionShape(layers=2, hidden=512, vocab=1000)},
        gpu=GPU_PRESETS["H100"],
    )
    p = plan_maestro(samples, wl.sections, cm, 16, opts)
    v = p.sections["vision"]
    assert v.memory <= 20e9
    one = _Problem(samples, wl.sections, cm, 16, opts)
    from maestro.plan.problem import _section_options

    # data-parallel ranks: replica groups, or FSDP ranks sharing one copy of the state
    need = min(o.min_dp * o.fsdp for o in _section_options(one, "vision"))
    assert need > 1 and v.dp * v.fsdp >= need


def _uniform(num: int, tokens: int, section: str = "llm") -> list[SampleInfo]:
    return [SampleInfo(i, frozenset({section}), {"tokens": tokens}) for i in range(num)]


@pytest.mark.parametrize("gpus", [4, 8, 16])
def test_one_section_plan_equals_the_monolithic_plan(gpus):
    cm = AnalyticalCostModel({"llm": SHAPES["llm"]})
    samples = _uniform(64, 1024)
    secs = [SectionSpec("llm", token_budget=8192)]
    m = plan_maestro(samples, secs, cm, gpus)
    mono = plan_monolithic(samples, secs, cm, gpus)
    a, b = m.sections["llm"], mono.sections["llm"]
    assert (a.dp, a.tp, a.micro_batch_size, a.recompute) == (
        b.dp,
        b.tp,
        b.micro_batch_size,
        b.recompute,
    )
    assert m.step_time == pytest.approx(mono.step_time, rel=1e-9)
    assert m.gpus == mono.gpus


def test_ablations_tie_the_knob_and_the_full_search_contains_them(mllm16):
    wl = mllm16
    full = plan_maestro(wl.samples, wl.sections, wl.cost_model, 16)
    for ab, attr in ((Ablation(same_mbs=True), "micro_batch_size"), (Ablation(same_tp=True), "tp")):
        p = plan_maestro(wl.samples, wl.sections, wl.cost_model, 16, SearchOptions(ablation=ab))
        assert len({getattr(s, attr) for s in p.sections.values()}) == 1
        assert full.step_time <= p.step_time + 1e-12


def test_gpus_to_match_reaches_the_target_with_fewer_gpus(kd16):
    wl = kd16
    top = plan_maestro(wl.samples, wl.sections, wl.cost_model, 16)
    target = 0.6 * top.samples_per_s
    got = gpus_to_match(wl.samples, wl.sections, wl.cost_model, target, 16)
    assert got is not None and got.samples_per_s >= target and got.gpus < 16
    assert gpus_to_match(wl.samples, wl.sections, wl.cost_model, 10 * top.samples_per_s, 16) is None


def test_balanced_order_equalises_rank_work():
    rng = random.Random(0)
    samples = [
        SampleInfo(i, frozenset({"llm"}), {"tokens": int(rng.lognormvariate(6, 1)) + 16})
        for i in range(256)
    ]
    secs = [SectionSpec("llm")]
    cm = AnalyticalCostModel({"llm": SectionShape(layers=2, hidden=256)})
    p = _Problem(samples, secs, cm, 8, SearchOptions())
    out = _balanced_order(p, samples, 8, cm)
    assert sorted(s.sample_id for s in out) == list(range(256))

    def shard_tokens(order):
        return [sum(s.cost["tokens"] for s in order[r * 32 : (r + 1) * 32]) for r in range(8)]

    bal, raw = shard_tokens(out), shard_tokens(samples)
    assert max(bal) - min(bal) < (max(raw) - min(raw)) / 4


def _kd_batch(seed: int, num: int = 16) -> list[SampleInfo]:
    rng = random.Random(seed)
    return [
        SampleInfo(i, frozenset({"t", "s"}), {"tokens": float(rng.randint(64, 2048))})
        for i in range(num)
    ]


KD_SECS = [
    SectionSpec("t", frozen=True, micro_batch_size=4),
    SectionSpec("s", inputs=("t",), micro_batch_size=4),
]
KD_CM = AnalyticalCostModel(
    {"t": SectionShape(layers=4, hidden=1024), "s": SectionShape(layers=2, hidden=512)},
    gpu=GPU_PRESETS["H100"],
)


@pytest.mark.parametrize(
    ("batches", "match"),
    [
        (None, "sequence of batches"),
        ("abc", "sequence of batches"),
        (_kd_batch(1), "not of samples: wrap one batch"),
        ([[]], r"batches\[0\] is empty"),
        ([_kd_batch(1), ()], r"batches\[1\] is empty"),
        ([7], r"batches\[0\] must be a sequence of SampleInfo, got int"),
        ([{"tokens": 5}], r"batches\[0\] must be a sequence of SampleInfo, got dict"),
        ([[*_kd_batch(1)[:15], {"tokens": 5}]], r"batches\[0\] holds a dict"),
        ([_kd_batch(1, num=8)], r"batches\[0\] has 8 samples, the planned batch 16"),
        ([[*_kd_batch(1)[:15], _kd_batch(1)[0]]], r"batches\[0\] repeats a sample_id"),
        (
            [[*_kd_batch(1)[:15], SampleInfo(15, frozenset({"vision"}), {"tokens": 8.0})]],
            r"unknown sections: \['vision'\]",
        ),
    ],
)
def test_bad_extra_batches_are_a_value_error(batches, match):
    opts = SearchOptions(batches=batches)
    with pytest.raises(ValueError, match=match):
        plan_maestro(_kd_batch(0), KD_SECS, KD_CM, 4, opts)
    with pytest.raises(ValueError, match=match):
        plan_monolithic(_kd_batch(0), KD_SECS, KD_CM, 4, opts)


def test_extra_batches_score_colocated_groups_too():
    # one GPU for two sections: only the colocated group fits, so this is its score
    opts = SearchOptions(include_monolithic=False, tp_choices=(1,), colocate=True)
    one = plan_maestro(_kd_batch(0), KD_SECS, KD_CM, 1, opts)
    assert len({s.group for s in one.sections.values()}) == 1 and one.sections["t"].group
    # scored over other batches, the group's step time moves with them ...
    other = plan_maestro(
        _kd_batch(0), KD_SECS, KD_CM, 1, replace(opts, batches=[_kd_batch(k) for k in (1, 2, 3)])
    )
    assert other.step_time != pytest.approx(one.step_time, rel=1e-6)
    # ... and over copies of the planned batch it is that batch's step (a colocated step
    # never overlaps its neighbours, so every step of the sequence is the same)
    same = plan_maestro(_kd_batch(0), KD_SECS, KD_CM, 1, replace(opts, batches=[_kd_batch(0)] * 3))
    assert same.step_time == pytest.approx(one.step_time, rel=1e-9)
    assert same.describe() == one.describe()


def test_no_skip_ablation_applies_to_extra_batches_too():
    # samples that skip the teacher: with no_skip every sample, of every batch, runs it
    def skipping(seed):
        return [
            replace(s, sections=frozenset({"s"}) if s.sample_id % 2 else s.sections)
            for s in _kd_batch(seed)
        ]

    opts = SearchOptions(batches=[skipping(1)], ablation=Ablation(no_skip=True))
    p = _Problem(skipping(0), KD_SECS, KD_CM, 4, opts)
    assert all(s.sections == {"t", "s"} for b in (p.samples, *p.batches) for s in b)


def test_token_budget_ablation_cuts_micro_batches_by_count_only():
    from maestro.plan.options import Ablation
    from maestro.plan.report import ABLATIONS, breakdown
    from maestro.plan.workload import load_workload

    wl = load_workload("kd", 8)
    assert any(s.token_budget for s in wl.sections)
    opts = SearchOptions(simulate_top=1, ablation=Ablation(no_token_budget=True))
    p = _Problem(wl.samples, wl.sections, wl.cost_model, 8, opts)
    assert all(s.token_budget is None for s in p.sections.values())
    label = next(k for k, a in ABLATIONS.items() if a.no_token_budget)
    b = breakdown(wl, 8, SearchOptions(simulate_top=1))
    assert label in b and math.isfinite(b[label])
