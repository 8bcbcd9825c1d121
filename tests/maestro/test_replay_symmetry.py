"""One set of replay rules for every layout: FSDP lockstep per shard group, in the per-section
replay and the colocated (monolithic) one alike, and a scheduler that keeps a shard group's
micro-batch counts aligned."""

from __future__ import annotations

import pytest

from maestro.costmodel import GPU_PRESETS, AnalyticalCostModel, SectionShape, micro_batch_features
from maestro.plan.tpmodel import SectionStrategy, with_layout
from maestro.schedule import monolithic_schedule, validate_schedule, wavefront_schedule
from maestro.schedule.timeline import StepModel, shard_groups
from maestro.schedule.types import MicroBatch, SampleInfo, Schedule, SectionSpec
from maestro.schedule.wavefront import PASSES, greedy_wavefront
from maestro.sim import simulate
from maestro.sim.replay import replay_steps

SHAPE = SectionShape(layers=4, hidden=1024, vocab=32000)


def _model(fsdp: int, names=("s",)):
    base = AnalyticalCostModel({n: SHAPE for n in names}, gpu=GPU_PRESETS["H100"])
    if fsdp == 1:
        return base
    return with_layout(base, strategies={n: SectionStrategy(fsdp=fsdp) for n in names})


def _samples(lengths, sections=frozenset({"s"})):
    return [
        SampleInfo(i, sections, {"tokens": float(t), "samples": 1.0}) for i, t in enumerate(lengths)
    ]


# 4 ranks, unequal shards: ranks 0/1 (group 0) and 2/3 (group 1) differ in count and size
LENGTHS = [900, 300, 300, 700, 200, 200, 500, 500, 500, 100, 1000, 400, 400]
SHARDS = [[0, 1, 2], [3, 4], [5, 6, 7, 8, 9], [10, 11, 12]]


def _micro_batches(ids, mbs):
    return [MicroBatch(tuple(ids[j : j + mbs])) for j in range(0, len(ids), mbs)]


def _both(lengths, shards, mbs, fsdp):
    """The same one-section layout replayed as a colocated schedule and as a per-section one
    (same samples per rank, same micro-batches)."""
    samples = _samples(lengths)
    per_rank = [_micro_batches(ids, mbs) for ids in shards]
    spec = SectionSpec("s", dp=len(shards), micro_batch_size=mbs)
    cm = _model(fsdp)
    colo = Schedule({"s": per_rank}, name="monolithic", colocated=True)
    sect = Schedule({"s": per_rank}, name="fifo")
    validate_schedule(colo, samples, [spec])
    validate_schedule(sect, samples, [spec])
    return (
        simulate(colo, samples, [spec], cm, trace=True),
        simulate(sect, samples, [spec], cm, trace=True),
        samples,
        spec,
        cm,
    )


@pytest.mark.parametrize("fsdp", [1, 2, 4])
@pytest.mark.parametrize("mbs", [1, 2])
def test_a_one_section_layout_replays_the_same_colocated_or_per_section(fsdp, mbs):
    colo, sect, _, _, _ = _both(LENGTHS, SHARDS, mbs, fsdp)
    assert colo.step_time == pytest.approx(sect.step_time, rel=1e-9)
    assert colo.sections["s"].busy == pytest.approx(sect.sections["s"].busy, rel=1e-9)
    assert colo.sections["s"].finish == pytest.approx(sect.sections["s"].finish, rel=1e-9)
    # the same compute intervals, one by one
    a = sorted((r, k, a, b) for _, r, k, a, b in colo.events)
    b = sorted((r, k, a, b) for _, r, k, a, b in sect.events)
    assert [x[:2] for x in a] == [x[:2] for x in b]
    flat = [t for x in a for t in x[2:]]
    assert flat == pytest.approx([t for x in b for t in x[2:]], rel=1e-9, abs=1e-15)


def test_lockstep_costs_something_and_both_paths_agree_on_it():
    plain_c, plain_s, _, _, _ = _both(LENGTHS, SHARDS, 1, 1)
    lock_c, lock_s, _, _, _ = _both(LENGTHS, SHARDS, 1, 2)
    # padding and waiting for the slowest add time in both paths, by the same amount
    assert lock_c.step_time > plain_c.step_time
    assert lock_s.step_time > plain_s.step_time
    assert lock_c.step_time - plain_c.step_time == pytest.approx(
        lock_s.step_time - plain_s.step_time, rel=1e-9
    )


def test_steady_replay_agrees_too():
    _, _, samples, spec, cm = _both(LENGTHS, SHARDS, 2, 2)
    per_rank = [_micro_batches(ids, 2) for ids in SHARDS]
    colo = Schedule({"s": per_rank}, colocated=True)
    sect = Schedule({"s": per_rank})
    a = replay_steps([(colo, samples)] * 3, [spec], cm)
    b = replay_steps([(sect, samples)] * 3, [spec], cm)
    assert a.step_times == pytest.approx(b.step_times, rel=1e-9)


def _per_replica(res, n="s"):
    out: dict[int, list[tuple[str, float, float]]] = {}
    for sec, r, kind, a, b in res.events:
        if sec == n:
            out.setdefault(r, []).append((kind, a, b))
    return out


@pytest.mark.parametrize("colocated", [False, True])
@pytest.mark.parametrize("frozen", [False, True])
def test_lockstep_is_per_shard_group(colocated, frozen):
    """fsdp = 2, 4 replicas: a slow micro-batch in group 0 does not delay group 1."""
    lengths = [400] * 8
    shards = [[0, 1], [2, 3], [4, 5], [6, 7]]
    spec = SectionSpec("s", dp=4, micro_batch_size=1, frozen=frozen)
    cm = _model(2)

    def run(slow: bool):
        ls = list(lengths)
        if slow:
            ls[0] = 4000  # replica 0's first micro-batch, group 0
        ss = _samples(ls)
        sched = Schedule({"s": [_micro_batches(ids, 1) for ids in shards]}, colocated=colocated)
        return simulate(sched, ss, [spec], cm, trace=True)

    base, slow = run(False), run(True)
    f = slow.sections["s"].finish
    # group 0 waits for its slow member: both replicas end together, later than before
    assert f[0] == pytest.approx(f[1])
    assert f[0] > base.sections["s"].finish[0] * 1.5
    # group 1 (replicas 2, 3) is untouched by it, interval by interval
    assert f[2] == pytest.approx(base.sections["s"].finish[2], rel=1e-12)
    assert f[3] == pytest.approx(base.sections["s"].finish[3], rel=1e-12)
    assert _per_replica(slow)[2] == _per_replica(base)[2]
    assert _per_replica(slow)[3] == _per_replica(base)[3]
    # within group 0, replica 1's first forward lasts its own time but its second starts
    # only when replica 0's slow first micro-batch is done
    ev0, ev1 = _per_replica(slow)[0], _per_replica(slow)[1]
    fwd0 = [e for e in ev0 if e[0] == "fwd"]
    fwd1 = [e for e in ev1 if e[0] == "fwd"]
    assert fwd1[0][2] - fwd1[0][1] < 0.5 * (fwd0[0][2] - fwd0[0][1])
    assert fwd1[1][1] == pytest.approx(fwd0[1][1]) and fwd1[1][1] >= fwd0[0][2]
    # the step still ends after the slowest group and its tail
    assert slow.step_time > base.step_time


@pytest.mark.parametrize("colocated", [False, True])
def test_padding_counts_align_within_groups_not_across(colocated):
    """Replicas of a shard group run the same number of micro-batches (padded); groups may
    differ."""
    samples = _samples(LENGTHS)
    per_rank = [_micro_batches(ids, 1) for ids in SHARDS]  # counts 3, 2, 5, 3
    spec = SectionSpec("s", dp=4, micro_batch_size=1)
    cm = _model(2)
    sched = Schedule({"s": per_rank}, colocated=colocated)
    res = simulate(sched, samples, [spec], cm, trace=True)
    ev = _per_replica(res)
    fwds = {r: sum(1 for e in ev[r] if e[0] == "fwd") for r in range(4)}
    bwds = {r: sum(1 for e in ev[r] if e[0] == "bwd") for r in range(4)}
    assert fwds == {0: 3, 1: 3, 2: 5, 3: 5}
    assert bwds == fwds
    if not colocated:
        step = StepModel(sched, samples, [spec], cm)
        assert [len(x) for x in step.fwd_s["s"]] == [3, 3, 5, 5]
        # a padding micro-batch is one sample: the first of the batch
        pad = cm.forward_time("s", micro_batch_features([samples[0].cost]))
        assert step.fwd_s["s"][1][2] == pytest.approx(pad)
    # with fsdp = 4 the whole section is one group: every replica runs 5
    res4 = simulate(sched, samples, [spec], _model(4), trace=True)
    ev4 = _per_replica(res4)
    assert {r: sum(1 for e in ev4[r] if e[0] == "fwd") for r in range(4)} == dict.fromkeys(
        range(4), 5
    )


def test_colocated_lockstep_pads_a_section_a_group_member_lacks():
    """In a whole-model micro-batch, a lockstep section that one rank of the group has no
    part of runs a one-sample padding part there (its collectives need every rank)."""
    both, llm = frozenset({"enc", "llm"}), frozenset({"llm"})
    samples = [
        SampleInfo(0, both, {"tokens": 400.0, "samples": 1.0}),
        SampleInfo(1, llm, {"tokens": 400.0, "samples": 1.0}),
    ]
    specs = [SectionSpec("enc"), SectionSpec("llm", inputs=("enc",))]
    sched = Schedule(
        {
            "enc": [[MicroBatch((0,))], [MicroBatch(())]],
            "llm": [[MicroBatch((0,))], [MicroBatch((1,))]],
        },
        colocated=True,
    )
    validate_schedule(sched, samples, specs)
    plain = simulate(sched, samples, specs, _model(1, ("enc", "llm")), trace=True)
    lock = simulate(sched, samples, specs, _model(2, ("enc", "llm")), trace=True)
    ran = {(n, r) for n, r, *_ in lock.events}
    assert ("enc", 1) in ran and ("enc", 1) not in {(n, r) for n, r, *_ in plain.events}
    # both ranks end together (every pass in step)
    assert lock.sections["llm"].finish[0] == pytest.approx(lock.sections["llm"].finish[1])


def _counts(sched, n):
    return [len(mbs) for mbs in sched.order[n]]


def _misalignment(counts, k):
    """Sum over shard groups of (most - fewest) micro-batches."""
    return sum(
        max(counts[r] for r in g) - min(counts[r] for r in g) for g in shard_groups(len(counts), k)
    )


@pytest.mark.parametrize("fsdp", [2, 4])
def test_wavefront_aligns_micro_batch_counts_within_shard_groups(fsdp):
    # mixed lengths: an earliest-free-replica scheduler gives the replicas unequal counts
    lengths = [4000 if i % 9 == 0 else ((i * 7919) % 1500) + 100 for i in range(61)]
    samples = _samples(lengths, frozenset({"t", "s"}))
    specs = [
        SectionSpec("t", dp=4, micro_batch_size=4, frozen=True),
        SectionSpec("s", inputs=("t",), dp=8, micro_batch_size=2),
    ]
    base = AnalyticalCostModel({"t": SHAPE, "s": SHAPE}, gpu=GPU_PRESETS["H100"])
    cm = with_layout(
        base, strategies={"t": SectionStrategy(fsdp=2), "s": SectionStrategy(fsdp=fsdp)}
    )
    # every greedy pass aligns (not only the one the simulator's scoring picks)
    for la, jo in PASSES:
        sched = greedy_wavefront(samples, specs, cm, lookahead=la, johnson=jo)
        validate_schedule(sched, samples, specs)
        # equal counts in every shard group, but for one last round that ran out of samples
        assert _misalignment(_counts(sched, "t"), 2) <= 1, (la, jo)
        assert _misalignment(_counts(sched, "s"), fsdp) <= 1, (la, jo)
    best = wavefront_schedule(samples, specs, cm, with_fifo=False)
    validate_schedule(best, samples, specs)
    assert _misalignment(_counts(best, "s"), fsdp) <= 1
    # deterministic
    again = wavefront_schedule(samples, specs, cm, with_fifo=False)
    assert again.order == best.order


def test_wavefront_counts_are_exactly_equal_when_the_samples_allow():
    # two long samples and many short ones: replica 0 would take the long pair while its
    # group mate ran several short micro-batches (the old scheduler: counts 1, 3, 6, 6)
    samples = _samples([4000, 4000, 3000] + [200] * 29)
    spec = SectionSpec("s", dp=4, micro_batch_size=2)
    cm = _model(2)
    sched = wavefront_schedule(samples, [spec], cm, with_fifo=False)
    validate_schedule(sched, samples, [spec])
    c = _counts(sched, "s")
    assert c[0] == c[1] and c[2] == c[3]
    # the long samples are dealt over group 0's round, not stacked on one replica
    first = [set(sched.order["s"][r][0].sample_ids) for r in (0, 1)]
    assert {0, 1} not in first and {0, 1} <= first[0] | first[1]

    # aligned counts are cheaper under lockstep than what an earliest-free-replica pass
    # gives the same batch (replica 0 the long pair, its group mate three short ones)
    def pairs(a, b):
        return [MicroBatch((i, i + 1)) for i in range(a, b, 2)]

    unaligned = Schedule({"s": [pairs(0, 2), pairs(2, 8), pairs(8, 20), pairs(20, 32)]})
    validate_schedule(unaligned, samples, [spec])
    assert (
        simulate(sched, samples, [spec], cm).step_time
        < simulate(unaligned, samples, [spec], cm).step_time
    )


def test_monolithic_schedule_with_fsdp_matches_the_per_section_replay():
    """``monolithic_schedule`` (the planner's baseline) of a one-section model at fsdp = 2
    replays as the per-section layout with the same shards."""
    samples = _samples(LENGTHS)
    spec = SectionSpec("s", dp=4, micro_batch_size=2)
    cm = _model(2)
    colo = monolithic_schedule(samples, [spec], cm, world_size=4, micro_batch_size=2)
    sect = Schedule({"s": colo.order["s"]})
    a = simulate(colo, samples, [spec], cm)
    b = simulate(sect, samples, [spec], cm)
    assert a.step_time == pytest.approx(b.step_time, rel=1e-9)
