"""The step-level correction keyed by micro-batch size (``maestro.sim.calibrate``)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from maestro.costmodel import LinearFit, MeasuredCostModel
from maestro.schedule import SampleInfo, SectionSpec, fifo_schedule, monolithic_schedule
from maestro.sim.calibrate import step_scale_by_size
from maestro.sim.replay import correction_micro_batch, replay_steps


def _kd_like():
    samples = [SampleInfo(i, frozenset({"t", "s"}), {"tokens": 1.0}) for i in range(8)]
    sections = [
        SectionSpec("t", dp=1, micro_batch_size=4, frozen=True),
        SectionSpec("s", inputs=("t",), dp=1, micro_batch_size=2),
    ]
    cm = MeasuredCostModel(
        forward={"t": LinearFit({"samples": 1.0}), "s": LinearFit({"samples": 3.0})},
        forward_backward={"s": LinearFit({"samples": 9.0})},
        optimizer_s={"s": 0.5},
    )
    return samples, sections, cm


def _row(kind, mbs, measured, replayed):
    return {"layout": kind, "micro_batch": mbs, "measured_s": measured, "replayed_s": replayed}


def test_ratios_are_kept_per_kind_and_size_as_medians():
    rows = [
        _row("sections", 1, 1.4, 1.0),
        _row("sections", 8, 1.1, 1.0),
        _row("sections", 8, 1.3, 1.0),
        _row("sections", 8, 1.2, 1.0),
        _row("monolithic", 4, 2.0, 2.0),
        _row("monolithic", 2, 0.0, 0.0),  # nothing replayed: no ratio
    ]
    got = step_scale_by_size(rows)
    assert got == {
        "sections": {1: pytest.approx(1.4), 8: pytest.approx(1.2)},
        "monolithic": {4: 1.0},
    }


def test_step_factor_interpolates_in_log_size_and_clamps():
    cm = MeasuredCostModel(forward={}, forward_backward={})
    assert cm.step_factor("sections", 4) == 1.0  # no correction at all
    cm.step_scale = {"sections": 1.3}
    assert cm.step_factor("sections", 4) == 1.3  # one factor for every size
    cm.step_scale_by_mbs = {"sections": {1: 1.4, 2: 1.4, 4: 1.2, 8: 1.1}}
    assert [cm.step_factor("sections", m) for m in (1, 2, 4, 8)] == [1.4, 1.4, 1.2, 1.1]
    # between measured sizes: linear in log2 of the size
    w = math.log2(6) - 2
    assert cm.step_factor("sections", 6) == pytest.approx((1 - w) * 1.2 + w * 1.1)
    assert cm.step_factor("sections", 64) == 1.1 and cm.step_factor("sections", 0) == 1.4
    # a kind without a table falls back to its single factor, then 1
    assert cm.step_factor("monolithic", 4) == 1.0
    cm.step_scale["monolithic"] = 1.02
    assert cm.step_factor("monolithic", 4) == 1.02


def test_profile_round_trips_the_table(tmp_path):
    prof = {
        "sections": {
            "t": {"rows": [{"features": {"samples": k}, "forward_s": 0.1 * k} for k in (1, 2)]}
        },
        "step_scale": {"sections": 1.3},
        "step_scale_by_mbs": {"sections": {"1": 1.4, "8": 1.1}},
    }
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))  # JSON keys are strings
    cm = MeasuredCostModel.from_profile(path)
    assert cm.step_scale_by_mbs == {"sections": {1: 1.4, 8: 1.1}}
    assert cm.step_factor("sections", 8) == 1.1


def test_replay_scales_each_step_by_its_own_micro_batch_size():
    samples, sections, cm = _kd_like()
    sched = fifo_schedule(samples, sections)
    plain = replay_steps([(sched, samples)] * 3, sections, cm, step_scale=1.0)
    # the layout's smallest micro-batch (the most micro-batches) is the student's 2
    assert correction_micro_batch(sched, sections) == 2
    cm.step_scale = {"sections": 2.0}
    cm.step_scale_by_mbs = {"sections": {2: 1.5, 4: 1.25}}
    got = replay_steps([(sched, samples)] * 3, sections, cm)
    assert got.step_times == pytest.approx([1.5 * t for t in plain.step_times])
    # larger micro-batches: another schedule, its own factor
    big = [replace(s, micro_batch_size=4) for s in sections]
    bsched = fifo_schedule(samples, big)
    bare = replay_steps([(bsched, samples)], big, cm, step_scale=1.0).step_time
    assert replay_steps([(bsched, samples)], big, cm).step_time == pytest.approx(1.25 * bare)
    # a colocated step is keyed by its whole-model micro-batch (here 2 of the 4 per rank)
    mono = [replace(s, dp=2, micro_batch_size=4) for s in sections]
    msched = monolithic_schedule(samples, mono, world_size=2, micro_batch_size=2)
    assert correction_micro_batch(msched, mono) == 2
    cm.step_scale_by_mbs["monolithic"] = {2: 3.0, 4: 1.0}
    mbare = replay_steps([(msched, samples)], mono, cm, step_scale=1.0).step_time
    assert replay_steps([(msched, samples)], mono, cm).step_time == pytest.approx(3.0 * mbare)
