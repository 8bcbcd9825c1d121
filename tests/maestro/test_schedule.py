"""Schedulers: hand-checked cases, validate_schedule's rejections, and hypothesis properties
over random section DAGs, activation sets and costs."""

from __future__ import annotations

import time
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from maestro.costmodel import UnitCostModel
from maestro.schedule import (
    SCHEDULERS,
    MicroBatch,
    SampleInfo,
    Schedule,
    SectionSpec,
    get_scheduler,
    validate_schedule,
)
from maestro.schedule.wavefront import greedy_wavefront
from maestro.sim import simulate
from maestro.sim.scenarios import build


def mllm_case():
    secs = [
        SectionSpec("vision", dp=1, micro_batch_size=2),
        SectionSpec("llm", inputs=("vision",), dp=2, micro_batch_size=2),
    ]
    # image samples first in data order: fifo makes the llm wait for the encoder
    samples = [
        SampleInfo(i, frozenset({"vision", "llm"}), {"tokens": 10, "images": 1}) for i in range(4)
    ] + [SampleInfo(i, frozenset({"llm"}), {"tokens": 10}) for i in range(4, 8)]
    return samples, secs


def test_greedy_pass_runs_text_only_samples_while_the_encoder_works():
    samples, secs = mllm_case()
    s = greedy_wavefront(samples, secs, lookahead=0.0)
    validate_schedule(s, samples, secs)
    firsts = {sid for rep in s.order["llm"] for sid in rep[0].sample_ids}
    assert firsts == {4, 5, 6, 7}, "the llm should start on the samples that need no encoder"


def test_wavefront_beats_fifo_and_starts_the_llm_at_once():
    samples, secs = mllm_case()
    s = get_scheduler("wavefront")(samples, secs)
    validate_schedule(s, samples, secs)
    cm = UnitCostModel()
    wf = simulate(s, samples, secs, cm, trace=True)
    ff = simulate(get_scheduler("fifo")(samples, secs), samples, secs, cm)
    # hand-computed: fifo 216 units; the llm replica that waits for the first image
    # micro-batch lets the encoder's backward start earlier: 192
    assert ff.step_time == pytest.approx(216.0)
    assert wf.step_time == pytest.approx(192.0)
    llm_starts = [a for sec, _, kind, a, _ in wf.events if sec == "llm" and kind == "fwd"]
    assert min(llm_starts) == 0.0, "text-only samples start while the encoder works"


def test_wavefront_balances_cost_not_count():
    secs = [SectionSpec("llm", dp=2, micro_batch_size=1)]
    toks = [100, 1, 1, 1, 1, 1, 1, 1]  # one long sample, seven short
    samples = [SampleInfo(i, frozenset({"llm"}), {"tokens": t}) for i, t in enumerate(toks)]
    s = get_scheduler("wavefront")(samples, secs)
    validate_schedule(s, samples, secs)
    loads = sorted(len(rep) for rep in s.order["llm"])
    assert loads == [1, 7], "the replica with the long sample should get nothing else"
    assert s.order["llm"][s.replica_of("llm", 0)] == [MicroBatch((0,))]


def test_token_budget_is_respected_by_every_scheduler():
    secs = [SectionSpec("llm", dp=2, micro_batch_size=4, token_budget=100)]
    toks = [60, 60, 30, 30, 30, 150, 10, 90]
    samples = [SampleInfo(i, frozenset({"llm"}), {"tokens": t}) for i, t in enumerate(toks)]
    for name in SCHEDULERS:
        s = get_scheduler(name)(samples, secs)
        validate_schedule(s, samples, secs)
        for rep in s.order["llm"]:
            for mb in rep:
                assert len(mb.sample_ids) == 1 or sum(toks[i] for i in mb.sample_ids) <= 100


def test_monolithic_is_colocated_data_order():
    samples, secs = mllm_case()
    s = get_scheduler("monolithic")(samples, secs)
    validate_schedule(s, samples, secs)
    assert s.colocated and len(s.order["llm"]) == 3  # world = 1 + 2 ranks
    # contiguous shards in data order, one micro-batch size (min over sections = 2)
    # shards [0:2], [2:5], [5:8]
    assert [[mb.sample_ids for mb in rep] for rep in s.order["llm"]] == [
        [(0, 1)],
        [(2, 3), (4,)],
        [(5, 6), (7,)],
    ]
    assert s.order["vision"][1] == [MicroBatch((2, 3)), MicroBatch(())]  # text-only: empty


def test_unknown_scheduler_lists_known_names():
    with pytest.raises(ValueError, match="fifo, monolithic, wavefront"):
        get_scheduler("nope")


@pytest.mark.parametrize(
    "secs,match",
    [
        ([SectionSpec("a", inputs=("b",)), SectionSpec("b", inputs=("a",))], "cycle"),
        ([SectionSpec("a", inputs=("zz",))], "unknown input"),
        ([SectionSpec("a", dp=0)], "dp must be"),
        ([SectionSpec("a", micro_batch_size=0)], "micro_batch_size must be"),
        ([SectionSpec("a"), SectionSpec("a")], "twice"),
    ],
)
def test_bad_sections_are_rejected(secs, match):
    samples = [SampleInfo(0, frozenset({"a"}), {})]
    for name in SCHEDULERS:
        with pytest.raises(ValueError, match=match):
            get_scheduler(name)(samples, secs)


def _good():
    samples, secs = mllm_case()
    return samples, secs, get_scheduler("wavefront")(samples, secs)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda o: o["llm"][0].pop(0), "never scheduled"),
        (lambda o: o["llm"][1].append(o["llm"][0][0]), "twice"),
        (lambda o: o["llm"][0].append(MicroBatch(())), "empty"),
        (lambda o: o["llm"][0].append(MicroBatch((99,))), "unknown sample"),
        (lambda o: o["vision"][0].append(MicroBatch((5,))), "does not activate"),
        (lambda o: o["llm"].pop(), "dp=2"),
        (lambda o: o.pop("vision"), "missing"),
        (
            lambda o: o["llm"].__setitem__(
                0, [MicroBatch(sum((m.sample_ids for m in o["llm"][0]), ()))]
            ),
            "micro_batch_size=2",
        ),
    ],
)
def test_validate_rejects_broken_schedules(mutate, match):
    samples, secs, s = _good()
    order = {k: [list(r) for r in v] for k, v in s.order.items()}
    mutate(order)
    with pytest.raises(ValueError, match=match):
        validate_schedule(Schedule(order=order), samples, secs)


def test_validate_rejects_split_colocation():
    samples, secs = mllm_case()
    s = get_scheduler("monolithic")(samples, secs)
    order = {k: [list(r) for r in v] for k, v in s.order.items()}
    # move sample 0's vision part to rank 1 while its llm part stays on rank 0
    order["vision"][0][0] = MicroBatch((1,))
    order["vision"][1][1] = MicroBatch((0,))
    with pytest.raises(ValueError, match="different ranks"):
        validate_schedule(Schedule(order=order, colocated=True), samples, secs)


# --------------------------------------------------------------------------------------------
# properties over random DAGs


@st.composite
def workloads(draw):
    k = draw(st.integers(1, 5))
    secs = []
    for j in range(k):
        inputs = tuple(f"s{p}" for p in range(j) if draw(st.booleans()))
        budget = draw(st.one_of(st.none(), st.integers(20, 300)))
        secs.append(
            SectionSpec(
                f"s{j}",
                inputs=inputs,
                dp=draw(st.integers(1, 4)),
                micro_batch_size=draw(st.integers(1, 5)),
                frozen=draw(st.booleans()),
                token_budget=budget,
            )
        )
    secs = draw(st.permutations(secs))  # list order need not be topological
    n = draw(st.integers(0, 40))
    names = [s.name for s in secs]
    samples = []
    for i in range(n):
        act = draw(st.sets(st.sampled_from(names), min_size=1))
        cost = {"tokens": draw(st.integers(1, 200)), "images": draw(st.integers(0, 3))}
        samples.append(SampleInfo(i, frozenset(act), cost))
    return samples, list(secs)


def _check_independently(s: Schedule, samples, secs):
    """The invariants, counted directly (not through validate_schedule)."""
    by = {x.name: x for x in secs}
    for name, reps in s.order.items():
        seen = Counter(i for rep in reps for mb in rep for i in mb.sample_ids)
        want = {x.sample_id for x in samples if name in x.sections}
        assert set(seen) == want and all(c == 1 for c in seen.values())
        for rep in reps:
            for mb in rep:
                assert len(mb.sample_ids) <= by[name].micro_batch_size
        if not s.colocated:
            assert len(reps) == by[name].dp


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.sampled_from(sorted(SCHEDULERS)))
def test_every_scheduler_yields_a_valid_schedule(work, name):
    samples, secs = work
    s = get_scheduler(name)(samples, secs, UnitCostModel())
    validate_schedule(s, samples, secs)
    _check_independently(s, samples, secs)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.sampled_from(sorted(SCHEDULERS)))
def test_no_consumer_runs_before_its_producers_outputs_exist(work, name):
    samples, secs = work
    s = get_scheduler(name)(samples, secs)
    res = simulate(s, samples, secs, UnitCostModel(), trace=True)
    fwd = {}  # (section, replica) -> ordered forward intervals
    for sec, r, kind, a, b in res.events:
        if kind == "fwd":
            fwd.setdefault((sec, r), []).append((a, b))
    by = {x.name: x for x in secs}
    act = {x.sample_id: x.sections for x in samples}
    # map each (section, sample) to its forward interval
    span = {}
    for name_, reps in s.order.items():
        for r, rep in enumerate(reps):
            nonempty = [mb for mb in rep if mb.sample_ids] if s.colocated else rep
            for mb, iv in zip(nonempty, fwd.get((name_, r), [])):
                for i in mb.sample_ids:
                    span[(name_, i)] = iv
    assert len(span) == sum(len(a) for a in act.values())
    for (name_, i), (start, _) in span.items():
        for p in by[name_].inputs:
            if p in act[i]:
                assert start >= span[(p, i)][1] - 1e-9, (name_, p, i)
    assert res.step_time >= max((b for *_, b in res.events), default=0.0) - 1e-9


# --------------------------------------------------------------------------------------------
# speed (issue 7: one wavefront schedule for 8,192 samples at 1,024 GPUs in under 1 s)


def test_wavefront_is_fast_at_scale():
    from dataclasses import replace

    sc = build("mllm-audio", 1024, num_samples=8192)
    # each timing on a fresh copy of the cost model: it caches the micro-batches it priced,
    # so a warm one would make whichever runs second look faster
    fresh = lambda: replace(sc.cost_model)  # noqa: E731
    # CPU time, not wall time: other processes share this machine's two cores
    t = time.process_time()
    s = get_scheduler("wavefront")(sc.samples, sc.sections, fresh())
    took = time.process_time() - t
    validate_schedule(s, sc.samples, sc.sections)
    # against a reference on the same input and machine: one simulation of the fifo schedule
    # (the wavefront scheduler runs a few greedy passes and simulates each; measured 13-14x
    # one simulation). The absolute 1 s target is a benchmark figure (bench/maestro_schedule.py)
    from maestro.schedule.timeline import simulate

    fifo = get_scheduler("fifo")(sc.samples, sc.sections, sc.cost_model)
    ref = []
    for _ in range(3):
        cm = fresh()
        t = time.process_time()
        simulate(fifo, sc.samples, sc.sections, cm)
        ref.append(time.process_time() - t)
    assert took <= 25 * min(ref), f"wavefront took {took:.2f} s = {took / min(ref):.1f} sims"
