"""Planner layouts: colocated groups, Maestro never worse than monolithic, steady-state steps,
ZeRO-1 memory, and the cost model against published training figures."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from maestro.costmodel import (
    GPU_PRESETS,
    AnalyticalCostModel,
    CostModel,
    SectionShape,
    micro_batch_features,
)
from maestro.plan import ScenarioSpec, SearchOptions, plan_maestro, plan_monolithic
from maestro.plan.colocate import (
    GroupedCostModel,
    merged_samples,
    merged_specs,
    set_partitions,
    valid_groupings,
)
from maestro.plan.problem import _Problem, _section_options
from maestro.plan.report import plan_toml, read_plan
from maestro.plan.steady import steady_state
from maestro.plan.tpmodel import TPCostModel
from maestro.plan.workload import scenario_workload
from maestro.schedule import monolithic_schedule, wavefront_schedule
from maestro.schedule.types import SampleInfo, SectionSpec
from maestro.sim import simulate

# ---------------------------------------------------------------------------------------------
# groupings


def test_set_partitions_count_is_the_bell_number():
    assert [len(set_partitions("abcde"[:k])) for k in range(1, 6)] == [1, 2, 5, 15, 52]
    parts = set_partitions(["a", "b", "c"])
    assert sorted(sorted(p) for p in parts)[0] == [("a",), ("b",), ("c",)]
    assert all(sorted(n for g in p for n in g) == ["a", "b", "c"] for p in parts)


def test_a_group_must_be_convex():
    chain = [
        SectionSpec("a"),
        SectionSpec("b", inputs=("a",)),
        SectionSpec("c", inputs=("b",)),
    ]
    got = {tuple(sorted(p)) for p in map(tuple, valid_groupings(chain))}
    # {a, c} without b would have to run both before and after b
    assert (("a", "c"), ("b",)) not in got
    assert len(got) == 4  # 5 partitions minus the non-convex one
    assert (("a", "b", "c"),) in got


def test_merged_graph_routes_through_groups(mllm16):
    groups = [("vision", "audio"), ("llm",)]
    specs = merged_specs(
        mllm16.sections, groups, {groups[0]: 3, groups[1]: 5}, {"vision": 8, "audio": 2, "llm": 4}
    )
    by = {s.name: s for s in specs}
    assert by["vision+audio"].dp == 3 and by["vision+audio"].micro_batch_size == 8
    assert by["llm"].inputs == ("vision+audio",) and by["llm"].dp == 5
    assert not by["vision+audio"].frozen
    smp = merged_samples(mllm16.samples, groups)
    for old, new in zip(mllm16.samples, smp):
        assert ("vision+audio" in new.sections) == bool({"vision", "audio"} & old.sections)
        assert ("llm" in new.sections) == ("llm" in old.sections)
        if "audio" in old.sections:
            assert new.cost["audio/audio"] == old.cost["audio"]
        assert "audio/samples" not in new.cost or "audio" in old.sections


def test_grouped_cost_is_the_sum_of_member_chunks(kd16):
    base = kd16.cost_model
    groups = [("teacher", "student")]
    mbs = {"teacher": 8, "student": 2}
    gcm = GroupedCostModel(base, kd16.sections, groups, mbs)
    smp = merged_samples(kd16.samples[:8], groups)
    feats = micro_batch_features(s.cost for s in smp)
    # the student (token budget 8192) runs ceil(8 / 2) chunks at least; the teacher one
    chunks = {n: k for n, k, _ in gcm._chunks("teacher+student", feats)}
    tokens = sum(s.cost["tokens"] for s in kd16.samples[:8])
    assert chunks["teacher"] == max(1, math.ceil(tokens / 16384))
    assert chunks["student"] == max(4, math.ceil(tokens / 8192))
    # with one chunk per member (each micro-batch small enough) the group is exactly the sum
    one = merged_samples(kd16.samples[:2], groups)
    f1 = micro_batch_features(s.cost for s in one)
    orig = micro_batch_features(s.cost for s in kd16.samples[:2])
    if orig["tokens"] <= 8192:
        assert gcm.forward_time("teacher+student", f1) == pytest.approx(
            base.forward_time("teacher", orig) + base.forward_time("student", orig)
        )
        # the frozen teacher has no backward
        assert gcm.backward_time("teacher+student", f1) == pytest.approx(
            base.backward_time("student", orig)
        )
    assert gcm.allreduce_time("teacher+student", 4, True) == base.allreduce_time("student", 4, True)


def _plain(num: int, seed: int = 0):
    """Two trainable sections (no token budgets), samples of varied length."""
    import random

    rng = random.Random(seed)
    samples = [
        SampleInfo(i, frozenset({"enc", "dec"}), {"tokens": rng.choice([256, 512, 1024, 2048])})
        for i in range(num)
    ]
    secs = [SectionSpec("enc"), SectionSpec("dec", inputs=("enc",))]
    cm = AnalyticalCostModel(
        {
            "enc": SectionShape(layers=8, hidden=1024),
            "dec": SectionShape(layers=16, hidden=2048, vocab=32000),
        }
    )
    return samples, secs, cm


def test_all_colocated_with_equal_micro_batches_is_the_monolithic_layout():
    samples, secs, cm = _plain(64)
    groups = [("enc", "dec")]
    mbs = {"enc": 4, "dec": 4}
    p = _Problem(samples, secs, cm, 8, SearchOptions())
    from maestro.plan.problem import _simulate

    specs_m = [replace(s, dp=8, micro_batch_size=4) for s in secs]
    mono = _simulate(p, specs_m, cm, monolithic=True, mbs=4)
    specs_g = merged_specs(secs, groups, {groups[0]: 8}, mbs)
    gcm = GroupedCostModel(cm, secs, groups, mbs)
    grouped = _simulate(p, specs_g, gcm, True, 4, groups, [("enc+dec", False)])
    assert grouped[0] == pytest.approx(mono[0], rel=1e-9)


# ---------------------------------------------------------------------------------------------
# Maestro never loses to monolithic


@pytest.mark.parametrize("name", ["kd", "mllm", "mllm-audio"])
@pytest.mark.parametrize("gpus", [8, 16, 24])
def test_maestro_never_uses_more_gpu_hours_than_monolithic(name, gpus):
    """The monolithic layouts are Maestro candidates, so its plan is the better of the
    per-section search and the monolithic one: exactly their minimum (a search that kept
    the costlier plan, or dropped either family, fails). Measured 2026-12-01 with FSDP open
    to both: the per-section search alone loses on all nine of these analytical cases
    (e.g. kd/16: 116.7 vs 110.9 GPU-h per million samples), so Maestro's plan here is the
    monolithic one; BENCHMARKS.md has the figures."""
    wl = scenario_workload(ScenarioSpec(name=name, gpus=gpus, samples_per_gpu=4))
    # Maestro's whole-model candidates: under its balancer and under token-count balance
    mono = min(
        (
            plan_monolithic(
                wl.samples, wl.sections, wl.cost_model, gpus, SearchOptions(monolithic_order=o)
            )
            for o in ("cost", "tokens")
        ),
        key=lambda p: p.gpu_hours_per_million,
    )
    sec = plan_maestro(
        wl.samples, wl.sections, wl.cost_model, gpus, SearchOptions(include_monolithic=False)
    )
    m = plan_maestro(wl.samples, wl.sections, wl.cost_model, gpus)
    assert m.gpus <= gpus
    best = min(sec.gpu_hours_per_million, mono.gpu_hours_per_million)
    assert m.gpu_hours_per_million == pytest.approx(best, rel=1e-9)


def test_disaggregated_only_search_may_lose_and_device_sharing_recovers_it(mllm16):
    wl = mllm16
    apart = plan_maestro(
        wl.samples,
        wl.sections,
        wl.cost_model,
        16,
        SearchOptions(colocate=False, include_monolithic=False),
    )
    full = plan_maestro(wl.samples, wl.sections, wl.cost_model, 16)
    assert all(not s.group for s in apart.sections.values()) and not apart.monolithic
    assert full.gpu_hours_per_million <= apart.gpu_hours_per_million * (1 + 1e-9)


def test_a_colocated_plan_round_trips_through_toml(mllm16):
    wl = mllm16
    p = plan_maestro(wl.samples, wl.sections, wl.cost_model, 16)
    mono, secs = read_plan(plan_toml(wl, p))
    assert mono == p.monolithic
    if p.monolithic:  # the whole-model layout is said in the header; sections read as one replica
        assert all(s.dp == 1 for s in secs.values())
        key = lambda s: (s.micro_batch_size, s.recompute)  # noqa: E731
    else:
        key = lambda s: (s.dp, s.tp, s.micro_batch_size, s.recompute, s.group)  # noqa: E731
    assert {n: key(s) for n, s in secs.items()} == {n: key(s) for n, s in p.sections.items()}


# ---------------------------------------------------------------------------------------------
# steady state


class _Flat(CostModel):
    """Seconds per sample, no transfers or all-reduces."""

    def __init__(self, fwd: dict[str, float]):
        self.fwd = fwd

    def forward_time(self, section, feats):
        return self.fwd[section] * feats.get("samples", 0.0)

    def backward_time(self, section, feats):
        return 2 * self.forward_time(section, feats)

    def transfer_time(self, producer, feats, same_node):
        return 0.0

    def allreduce_time(self, section, dp, same_node):
        return 0.0


def _chain(frozen: bool, n: int = 16):
    samples = [SampleInfo(i, frozenset({"a", "b"}), {"tokens": 1}) for i in range(n)]
    secs = [
        SectionSpec("a", dp=1, micro_batch_size=2, frozen=frozen),
        SectionSpec("b", inputs=("a",), dp=1, micro_batch_size=2),
    ]
    return samples, secs


def test_one_step_equals_the_simulator_with_one_trainable_section(kd16):
    wl = kd16
    specs = [replace(s, dp=4) for s in wl.sections]
    sched = wavefront_schedule(wl.samples, specs, wl.cost_model)
    one = steady_state(sched, wl.samples, specs, wl.cost_model, steps=1)
    ref = simulate(sched, wl.samples, specs, wl.cost_model).step_time
    assert one.period == pytest.approx(ref, rel=1e-12)
    assert one.first_step == pytest.approx(ref, rel=1e-12)


def test_a_frozen_producer_runs_one_step_ahead():
    samples, secs = _chain(frozen=True)
    cm = _Flat({"a": 1.0, "b": 0.5})  # b: 1.5 s per sample fwd+bwd, a: 1.0
    sched = wavefront_schedule(samples, secs, cm)
    res = steady_state(sched, samples, secs, cm, steps=6)
    # one step from idle waits for a's first micro-batch (2 s); in steady state a's outputs
    # for the next step are ready, so b works back to back: 16 * 1.5 = 24 s per step
    assert res.first_step == pytest.approx(2.0 + 24.0)
    assert res.period == pytest.approx(24.0)
    assert res.busy == pytest.approx(24.0)


def test_a_slow_frozen_producer_bounds_the_step_and_runs_no_more_than_one_step_ahead():
    samples, secs = _chain(frozen=True)
    cm = _Flat({"a": 2.0, "b": 0.25})  # a: 32 s per step, b: 12 s
    sched = wavefront_schedule(samples, secs, cm)
    res = steady_state(sched, samples, secs, cm, steps=6)
    assert res.period == pytest.approx(32.0)
    # a never gets more than one step ahead of b's finished steps
    assert all(e >= 32.0 * (k + 1) for k, e in enumerate(res.step_ends))


def test_trainable_sections_do_not_overlap_steps():
    samples, secs = _chain(frozen=False)
    cm = _Flat({"a": 1.0, "b": 0.5})
    sched = wavefront_schedule(samples, secs, cm)
    res = steady_state(sched, samples, secs, cm, steps=5)
    # the non-finite guard synchronises every trainable rank at each step's end
    assert res.period == pytest.approx(res.first_step)
    assert res.step_ends == pytest.approx([res.first_step * (k + 1) for k in range(5)])


def test_colocated_schedule_period_is_its_step():
    samples, secs = _chain(frozen=True)
    cm = _Flat({"a": 1.0, "b": 0.5})
    sched = monolithic_schedule(samples, secs, cm, world_size=2, micro_batch_size=2)
    res = steady_state(sched, samples, secs, cm, steps=3)
    ref = simulate(sched, samples, secs, cm).step_time
    assert res.period == pytest.approx(ref) and res.first_step == pytest.approx(ref)


def test_steady_state_rejects_zero_steps(kd16):
    sched = wavefront_schedule(kd16.samples, kd16.sections, kd16.cost_model)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        steady_state(sched, kd16.samples, kd16.sections, kd16.cost_model, steps=0)


# ---------------------------------------------------------------------------------------------
# ZeRO-1 and the cost model against published figures


def test_zero1_shards_optimizer_state_and_lowers_the_needed_tp(kd16):
    wl = kd16
    student = wl.cost_model.shapes["student"]
    # (pipeline stages off: they shard the state too, and the comparison is about ZeRO-1)
    plain = SearchOptions(pp_choices=(1,))
    with_z = _Problem(wl.samples, wl.sections, wl.cost_model, 16, plain)
    without = _Problem(wl.samples, wl.sections, wl.cost_model, 16, replace(plain, zero1=False))
    a = _section_options(with_z, "student")
    b = _section_options(without, "student")
    # 18 bytes per parameter unsharded need tp >= 2 without recompute; ZeRO-1 over a few
    # replicas (Megatron's 6 + 12/dp bytes) brings tp = 2 without recompute into reach
    # (FSDP shards all of it: the comparison is between options without FSDP)
    a = [o for o in a if o.fsdp == 1]
    b = [o for o in b if o.fsdp == 1]
    assert any(o.tp == 2 and not o.recompute for o in a)
    assert not any(o.tp == 2 and not o.recompute for o in b)
    for o in a:
        assert o.memory <= with_z.memory_limit
        if o.min_dp > 1:  # the fewest replicas that fit: one fewer would not
            unsharded = o.mem_one - 12.0 * student.params / o.tp
            assert unsharded + 12.0 * student.params / o.tp / (o.min_dp - 1) > (with_z.memory_limit)


# Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM" (SC'21), Table 1: GPT models on A100s, sequence 2048, per-GPU throughput as a
# share of the 312 TFLOP/s peak: (layers, hidden, tensor-parallel size, published MFU).
NARAYANAN_TABLE1 = (
    (24, 2304, 1, 0.44),
    (30, 3072, 2, 0.44),
    (36, 4096, 4, 0.46),
    (40, 6144, 8, 0.43),
)


@pytest.mark.parametrize("layers, hidden, tp, published", NARAYANAN_TABLE1)
def test_model_mfu_matches_published_megatron_figures(layers, hidden, tp, published):
    a100 = GPU_PRESETS["A100"]
    shape = SectionShape(layers=layers, hidden=hidden, vocab=51200)
    # Megatron-LM's fused kernels (the framework the published runs used)
    base = AnalyticalCostModel({"m": shape}, gpu=a100, framework="megatron")
    cm = TPCostModel(base, {"m": tp})
    f = {"samples": 1.0, "tokens": 2048.0, "tokens_sq": 2048.0**2}
    seconds = cm.forward_time("m", f) + cm.backward_time("m", f)
    mfu = 3 * shape.forward_flops(f) / (seconds * a100.flops * tp)
    # a secondary check (the calibration proper: test_estimate_calibration.py, H100 runs):
    # compute only, with TP's all-reduces exposed; at tp = 4 and 8 the model sits 5-8 points
    # below these 2021 A100 figures (BENCHMARKS.md, "cost model calibration")
    assert published - 0.09 <= mfu <= published + 0.08


def test_h100_7b_mfu_and_tensor_parallel_cost_are_in_the_published_range():
    h100 = GPU_PRESETS["H100"]
    shape = SectionShape(layers=32, hidden=4096, ffn_hidden=16512, vocab=32000)
    f = {"samples": 1.0, "tokens": 4096.0, "tokens_sq": 4096.0**2}

    def mfu(tp):
        cm = TPCostModel(AnalyticalCostModel({"m": shape}, gpu=h100), {"m": tp})
        s = cm.forward_time("m", f) + cm.backward_time("m", f)
        return 3 * shape.forward_flops(f) / (s * h100.flops * tp)

    # 7B-class bf16 training on H100: torchtitan's eager FSDP runs reach 33-39% MFU
    # (docs/performance.md), Megatron-LM's fused kernels 47% (its weak-scaling table)
    assert 0.33 <= mfu(1) <= 0.56
    # tp = 8 loses at least the ~10-20% published; the model errs on the costly side, which
    # favours per-section layouts that avoid tensor parallelism (stated in BENCHMARKS.md)
    assert mfu(8) <= 0.9 * mfu(1)


@pytest.mark.parametrize("name", ["kd", "mllm-audio"])
def test_steady_state_lies_between_the_busiest_rank_and_one_step_from_idle(name):
    # the steady state (maestro.sim.replay's rules) hides some pipeline fill and drain, never
    # the busiest rank's own work; KD's frozen teacher runs one step ahead, so its fill is
    # hidden entirely and the student's work sets the period
    wl = scenario_workload(ScenarioSpec(name=name, gpus=16, samples_per_gpu=4))
    sched = wavefront_schedule(wl.samples, wl.sections, wl.cost_model)
    res = steady_state(sched, wl.samples, wl.sections, wl.cost_model, steps=8)
    assert res.busy <= res.period * (1 + 1e-9)
    assert res.period <= res.first_step
    if name == "kd":
        assert res.period == pytest.approx(res.busy, rel=1e-9)
        assert res.period < 0.9 * res.first_step


def test_replay_of_equal_schedules_matches_the_replay_of_one_shared_schedule(kd16):
    # consecutive steps of one schedule share one precomputed step model; distinct but equal
    # schedules build their own and must replay the same
    import copy

    from maestro.sim.replay import replay_steps

    wl = kd16
    sched = wavefront_schedule(wl.samples, wl.sections, wl.cost_model)
    shared = replay_steps([(sched, wl.samples)] * 5, wl.sections, wl.cost_model)
    fresh = replay_steps(
        [(copy.deepcopy(sched), wl.samples) for _ in range(5)], wl.sections, wl.cost_model
    )
    assert shared.step_times == pytest.approx(fresh.step_times, rel=1e-12)
    assert shared.step_ends == pytest.approx(fresh.step_ends, rel=1e-12)


def test_extra_batches_score_a_layout_by_its_mean_step_over_them():
    # a plan scored over further batches: the planned batch, then one step per extra batch;
    # its step time is the mean step after the first, as the replay of that sequence gives
    import random

    from maestro.costmodel import LinearFit, MeasuredCostModel
    from maestro.plan.search import SearchOptions
    from maestro.sim.replay import replay_steps

    def batch(seed):
        rng = random.Random(seed)
        return [
            SampleInfo(i, frozenset({"t", "s"}), {"tokens": float(rng.randint(4, 64))})
            for i in range(16)
        ]

    secs = [
        SectionSpec("t", dp=1, micro_batch_size=2, frozen=True),
        SectionSpec("s", inputs=("t",), dp=1, micro_batch_size=2),
    ]
    cm = MeasuredCostModel(
        forward={
            "t": LinearFit({"const": 0.5, "tokens": 0.02}),
            "s": LinearFit({"const": 0.2, "tokens": 0.01}),
        },
        forward_backward={"s": LinearFit({"const": 0.6, "tokens": 0.03})},
        max_samples={"t": 8.0, "s": 8.0},
    )
    extra = [batch(k) for k in (1, 2, 3)]
    opts = SearchOptions(
        colocate=False, objective="step_time", batches=extra, balance_monolithic=False
    )
    plan = plan_maestro(batch(0), secs, cm, 2, opts)
    mbs = plan.sections["s"].micro_batch_size
    if plan.monolithic:
        from maestro.schedule.monolithic import sampler_order

        specs = [replace(s, dp=2, micro_batch_size=mbs) for s in secs]
        units = [(s.name, s.frozen) for s in secs]
        seq = []
        for b in (batch(0), *extra):
            b2 = sampler_order(plan.order, b, 2, cm, units)  # the sampler the plan chose
            seq.append((monolithic_schedule(b2, specs, cm, world_size=2, micro_batch_size=mbs), b2))
    else:
        specs = [replace(s, micro_batch_size=plan.sections[s.name].micro_batch_size) for s in secs]
        seq = [(wavefront_schedule(b, specs, cm), b) for b in (batch(0), *extra)]
    ends = replay_steps(seq, specs, cm).step_ends
    assert plan.step_time == pytest.approx((ends[-1] - ends[0]) / 3, rel=1e-9)
    # one batch alone: the steady state of that batch, a different figure
    alone = plan_maestro(batch(0), secs, cm, 2, replace(opts, batches=()))
    assert alone.step_time != pytest.approx(plan.step_time, rel=1e-6)
