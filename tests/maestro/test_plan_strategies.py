"""The layout cost model (tp, fsdp, zero, recompute) the planner and the simulator share."""

from __future__ import annotations

import pytest

from maestro.costmodel import (
    GPU_PRESETS,
    AnalyticalCostModel,
    LinearFit,
    MeasuredCostModel,
    SectionFacts,
    facts_of,
)
from maestro.plan import SearchOptions, plan_maestro
from maestro.plan.options import SectionPlan
from maestro.plan.report import shrink_layout
from maestro.plan.tpmodel import LayoutCostModel, SectionStrategy, config_strategies, with_layout
from maestro.schedule.types import MicroBatch, SampleInfo, Schedule, SectionSpec
from maestro.sim import simulate
from maestro.sim.scenarios import SHAPES

FEATS = {"samples": 4.0, "tokens": 4096.0, "tokens_sq": 4 * 1024.0**2, "tokens_padded": 4096.0}


def _analytical():
    return AnalyticalCostModel({"llm": SHAPES["llm"]}, gpu=GPU_PRESETS["H100"])


def _measured(facts=True) -> MeasuredCostModel:
    # 1 ms per sample forward, 2 ms backward; 1 MB of gradients; a 100 MB/s link
    fb = LinearFit({"const": 0.0, "samples": 3e-3})
    return MeasuredCostModel(
        forward={"s": LinearFit({"const": 0.0, "samples": 1e-3})},
        forward_backward={"s": fb},
        param_bytes={"s": 1e6},
        link_bw=1e8,
        link_latency=1e-4,
        optimizer_s={"s": 4e-3},
        facts={
            "s": SectionFacts(
                blocks=3,
                hidden=64,
                param_bytes=1e6,
                grad_bytes=1e6,
                block_fraction=0.8,
                heads=4,
                act_bytes=4.0,
                state_bytes=4e6,
            )
        }
        if facts
        else {},
    )


def test_plain_strategies_leave_the_model_alone():
    base = _analytical()
    assert with_layout(base, strategies={"llm": SectionStrategy()}) is base
    m = LayoutCostModel(base, {"llm": SectionStrategy()})
    assert m.forward_time("llm", FEATS) == base.forward_time("llm", FEATS)
    assert m.backward_time("llm", FEATS) == base.backward_time("llm", FEATS)
    assert m.allreduce_time("llm", 8, True) == base.allreduce_time("llm", 8, True)
    assert m.memory_bytes("llm", FEATS, True) == base.memory_bytes("llm", FEATS, True)
    assert not m.lockstep("llm")


def test_fsdp_shards_state_and_pays_gathers_on_an_analytical_gpu():
    base = _analytical()
    sh = SHAPES["llm"]
    fa = facts_of(base, "llm")
    assert fa.blocks == sh.layers and fa.param_bytes == 2.0 * sh.state_params
    plain = base.memory_bytes("llm", FEATS, True)
    for f in (2, 4, 8):
        m = with_layout(base, strategies={"llm": SectionStrategy(fsdp=f)})
        assert m.lockstep("llm") == f
        state = 18.0 * sh.state_params * (1 + base.fw.allocator_headroom)
        mem = m.memory_bytes("llm", FEATS, True)
        # state / f, plus one gathered block (weights and gradient) and the gathered root
        assert plain - state + state / f < mem < plain - state + state / f + 0.1 * state
        # gathers overlap compute: exposed, but small against the pass
        f0, f1 = base.forward_time("llm", FEATS), m.forward_time("llm", FEATS)
        assert f0 < f1 < 1.05 * f0
        assert base.backward_time("llm", FEATS) < m.backward_time("llm", FEATS)
        # no gradient all-reduce after the last backward: the tail is the optimizer shard
        assert m.allreduce_time("llm", f, True) < base.allreduce_time("llm", f, True)


def test_measured_fsdp_tp_and_recompute_follow_the_facts():
    base = _measured()
    one = {"samples": 2.0, "tokens": 100.0, "tokens_padded": 120.0}
    f0, b0 = base.forward_time("s", one), base.backward_time("s", one)
    fs = with_layout(base, strategies={"s": SectionStrategy(fsdp=2)})
    # CPU collectives add up: a ring all-gather of 1 MB over 2 ranks, one message per unit
    gather = 0.5 * 1e6 / 1e8 + 4 * 1e-4
    assert fs.forward_time("s", one) == pytest.approx(f0 + gather)
    # backward: the blocks gathered again (reshard_after_forward) and the gradients
    # reduce-scattered
    again = 0.5 * 0.8e6 / 1e8 + 3 * 1e-4
    assert fs.backward_time("s", one) == pytest.approx(b0 + again + gather)
    keep = with_layout(base, strategies={"s": SectionStrategy(fsdp=2, reshard_after_forward=False)})
    assert keep.backward_time("s", one) == pytest.approx(b0 + gather)
    assert fs.memory_bytes("s", one, True) < 4e6
    tp = with_layout(base, tp={"s": 2})
    ar = 2 * (0.5 * 120 * 64 * 4 / 1e8 + 1e-4)  # one all-reduce of (B, T, C) activations
    assert tp.forward_time("s", one) == pytest.approx(f0 * (0.2 + 0.8 / 2) + 2 * 3 * ar)
    rc = with_layout(base, recompute={"s": True})
    assert rc.backward_time("s", one) == pytest.approx(b0 + 0.8 * f0)
    with pytest.raises(ValueError, match="facts"):
        with_layout(_measured(facts=False), strategies={"s": SectionStrategy(fsdp=2)})
    with pytest.raises(ValueError, match="zero = 1 needs fsdp = 1"):
        LayoutCostModel(base, {"s": SectionStrategy(fsdp=2, zero=1)})


def test_simulator_pads_and_locksteps_fsdp_replicas():
    base = _measured()
    samples = [SampleInfo(i, frozenset({"s"}), {"tokens": 10.0}) for i in range(3)]
    spec = SectionSpec("s", dp=2, micro_batch_size=1)
    # replica 0 runs two micro-batches, replica 1 one
    sched = Schedule({"s": [[MicroBatch((0,)), MicroBatch((1,))], [MicroBatch((2,))]]})
    plain = simulate(sched, samples, [spec], base)
    assert plain.sections["s"].busy[1] == pytest.approx(3e-3)
    fs = with_layout(base, strategies={"s": SectionStrategy(fsdp=2)})
    res = simulate(sched, samples, [spec], fs)
    one = fs.forward_time("s", {"samples": 1.0}) + fs.backward_time("s", {"samples": 1.0})
    # the short replica runs a padding micro-batch, in step with the other
    assert res.sections["s"].busy == pytest.approx([2 * one, 2 * one])
    assert res.sections["s"].finish == pytest.approx([2 * one, 2 * one])


def test_measured_plan_shards_when_memory_says_so():
    base = _measured()
    samples = [SampleInfo(i, frozenset({"s"}), {"tokens": 10.0}) for i in range(8)]
    secs = [SectionSpec("s")]
    free = plan_maestro(samples, secs, base, 4, SearchOptions(objective="step_time"))
    assert free.gpus <= 4
    tight = SearchOptions(
        objective="step_time", memory_limit=3e6, include_monolithic=False, tp_choices=(1,)
    )
    p = plan_maestro(samples, secs, base, 4, tight)
    s = p.sections["s"]
    assert s.fsdp >= 2 and s.memory <= 3e6 and p.gpus == s.dp * s.fsdp * s.tp <= 4


def test_config_strategies_and_shrunk_layouts():
    from maestro.config import load

    cfg = load(_examples() / "kd.toml")
    cfg.sections["student"].fsdp = 2
    cfg.sections["student"].reshard_after_forward = False
    st = config_strategies(cfg)
    assert st["student"] == SectionStrategy(fsdp=2, reshard_after_forward=False)
    assert st["teacher"].trivial
    plan = {"t": SectionPlan(8, 2, 16), "s": SectionPlan(4, 2, 8, fsdp=4)}
    small = shrink_layout(plan, 4)
    assert sum(s.gpus for s in small.values()) <= 4
    assert small["s"].fsdp > 1 or small["s"].tp > 1  # still a sharded layout


def _examples():
    from pathlib import Path

    return Path(__file__).resolve().parents[2] / "examples"


def test_baseline_pipeline_and_context_parallel_pricing():
    """pp and cp (baselines only): a stage does 1/pp of the work and holds 1/pp of the state;
    a context-parallel rank computes 1/cp of each sequence; the 1F1B bubble is (pp - 1)
    stage-micro-batches."""
    base = _analytical()
    f = {"samples": 2.0, "tokens": 16384.0, "tokens_sq": 2 * 8192.0**2}
    plain = with_layout(base, strategies={"llm": SectionStrategy(tp=2)})
    pp4 = with_layout(base, strategies={"llm": SectionStrategy(tp=2, pp=4)})
    cp2 = with_layout(base, strategies={"llm": SectionStrategy(tp=2, cp=2)})
    assert pp4.forward_time("llm", f) == pytest.approx(plain.forward_time("llm", f) / 4)
    assert pp4.pipeline_bubble("llm", f) == pytest.approx(
        3 * (pp4.forward_time("llm", f) + pp4.backward_time("llm", f))
    )
    assert plain.pipeline_bubble("llm", f) == 0
    m_plain, m_pp = plain.memory_bytes("llm", f, True), pp4.memory_bytes("llm", f, True)
    fixed = plain.memory_bytes("llm", {"samples": 1.0}, True)
    assert m_pp == pytest.approx(fixed / 4 + (m_plain - fixed))
    # half of every sequence per rank: less than plain, more than half (attention is quadratic
    # in the length, the rest linear)
    t_cp, t_plain = cp2.forward_time("llm", f), plain.forward_time("llm", f)
    assert 0.4 * t_plain < t_cp < 0.6 * t_plain
    assert cp2.memory_bytes("llm", f, True) < m_plain
    with pytest.raises(ValueError, match="pp of section"):
        with_layout(base, strategies={"llm": SectionStrategy(pp=0)})


def test_maestro_stages_keep_the_shared_parameters_on_every_stage():
    """``maestro train``'s pp (``pp_shared``): every stage holds the embedding and the head
    and all-reduces their gradients over the stages; the blocks split as the baselines'."""
    base = _analytical()
    sh = SHAPES["llm"]
    shared = sh.spec.embedding_params + sh.spec.head_params
    assert shared > 0
    f = {"samples": 2.0, "tokens": 8192.0, "tokens_sq": 2 * 4096.0**2}
    meg = with_layout(base, strategies={"llm": SectionStrategy(pp=4)})
    ours = with_layout(base, strategies={"llm": SectionStrategy(pp=4, pp_shared=True)})
    fixed = base.memory_bytes("llm", {"samples": 1.0}, True)
    extra = fixed * shared / sh.state_params * (1 - 1 / 4)
    assert ours.memory_bytes("llm", f, True) == pytest.approx(
        meg.memory_bytes("llm", f, True) + extra
    )
    assert ours.forward_time("llm", f) == meg.forward_time("llm", f)
    assert ours.pipeline_bubble("llm", f) == meg.pipeline_bubble("llm", f)
    # the shared gradients' ring over the 4 stages: 2 * 3/4 of their fp32 bytes
    hw = base.hw
    ring = ours.allreduce_time("llm", 8, True) - meg.allreduce_time("llm", 8, True)
    assert ring == pytest.approx(
        2 * (0.75 * 4.0 * shared / (hw.nvlink_bw * hw.nvlink_eff) + 3 * hw.link_latency)
    )


def test_plan_pipelines_a_section_when_memory_says_so():
    """No tp, fsdp or ZeRO allowed and one GPU cannot hold the LLM's state: the planner
    cuts it into pipeline stages (the runtime's pp), and without pp choices nothing fits."""
    from dataclasses import replace

    base = _analytical()
    samples = [
        SampleInfo(
            i, frozenset({"llm"}), {"samples": 1.0, "tokens": 2048.0, "tokens_sq": 2048.0**2}
        )
        for i in range(16)
    ]
    secs = [SectionSpec("llm")]
    state = base.memory_bytes("llm", {"samples": 1.0}, True)
    opts = SearchOptions(
        memory_limit=0.6 * state,
        tp_choices=(1,),
        fsdp_choices=(1,),
        zero_choices=(0,),
        recompute_choices=(True,),
        include_monolithic=False,
        pp_choices=(1, 2, 4),  # maestro plan --pp
    )
    p = plan_maestro(samples, secs, base, 16, opts)
    s = p.sections["llm"]
    assert s.pp >= 2 and s.memory <= 0.6 * state and p.gpus == s.dp * s.pp <= 16
    assert f"pp={s.pp}" in p.describe()
    with pytest.raises(ValueError, match="no \\(tp, fsdp, zero"):
        plan_maestro(samples, secs, base, 16, replace(opts, pp_choices=(1,)))
