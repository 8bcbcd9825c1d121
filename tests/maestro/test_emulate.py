"""Emulated-device runs (``maestro train --emulate``): the real runtime, compute as waits.

The waits must be the cost model's durations, the runtime must realise the step the
simulator predicts for the same schedule (FSDP lockstep, TP peers, transfers, all-reduces),
and user mistakes are one-line errors.
"""

import time

import pytest

from maestro import config as C
from maestro.costmodel import micro_batch_features
from maestro.emulate import emulated_config
from maestro.emulate.predict import predict
from maestro.runtime import RunOptions, launch
from maestro.schedule.monolithic import balanced_order
from maestro.sim.scenarios import kd_samples

# a per-section layout: teacher tensor-parallel on 2 ranks, student FSDP over 2 ranks
KD = """
global_batch = 16
steps = 4
dtype = "bfloat16"
scheduler = "wavefront"
monolithic_micro_batch_size = 4
monolithic_order = "{order}"
[workload]
name = "maestro.emulate.job:job"
scenario = "kd"
time_scale = {scale}
[sections.teacher]
tp = {teacher_tp}
micro_batch_size = 4
token_budget = 16384
frozen = true
[sections.student]
fsdp = {student_fsdp}
micro_batch_size = 2
token_budget = 8192
"""


def _cfg(scale=0.1, order="balanced", teacher_tp=2, student_fsdp=2, **kw):
    text = KD.format(scale=scale, order=order, teacher_tp=teacher_tp, student_fsdp=student_fsdp)
    return C.loads(text)


def test_sections_wait_the_cost_models_forward_and_backward():
    cfg = _cfg(scale=0.5, teacher_tp=1, student_fsdp=1)
    job = cfg.job()
    cm = job.cost_model
    graph = job.graph()
    batch = job.batch(0)[:3]
    feats = micro_batch_features([s["cost"] for s in batch])
    graph["teacher"].run(batch, {})  # warm: the first call pays one-time costs (lazy init)
    t0 = time.perf_counter()
    (teacher_out,) = [graph["teacher"].run(batch, {})]
    fwd = time.perf_counter() - t0
    want = cm.forward_time("teacher", feats) * 0.5
    assert want > 0.05 and abs(fwd - want) < 0.1 * want + 0.02
    # the student's backward waits its own backward time (after its forward's wait)
    outs = graph["student"].run(batch, {"teacher": teacher_out})
    loss = sum(o["loss"] for o in outs)
    t0 = time.perf_counter()
    loss.backward()
    bwd = time.perf_counter() - t0
    want = cm.backward_time("student", feats) * 0.5
    assert want > 0.05 and abs(bwd - want) < 0.1 * want + 0.02
    # outputs carry their ready time: forward end plus the modelled transfer
    assert all("ready_us" in o for o in teacher_out)


def test_emulated_config_prices_the_step_tail_in_the_optimizer():
    cfg = emulated_config(_cfg(scale=1.0), "kd", time_scale=0.5)
    sc = cfg.sections["student"]
    assert sc.optimizer == "maestro.emulate.job:WaitOptimizer"
    cm = cfg.job().cost_model
    assert sc.optimizer_args["seconds"] == pytest.approx(
        0.5 * cm.allreduce_time("student", 2, True)
    )
    assert cfg.sections["teacher"].optimizer != "maestro.emulate.job:WaitOptimizer"


def test_bad_scenario_and_mismatched_sections_are_one_line_errors():
    with pytest.raises(ValueError, match=r"--emulate.scenario: unknown scenario 'gpt'"):
        emulated_config(_cfg(), "gpt")
    with pytest.raises(ValueError, match=r"--emulate mllm: the config's sections"):
        emulated_config(_cfg(), "mllm")


def test_balanced_order_evens_the_shards_work():
    samples = kd_samples(64, seed=3)
    cfg = _cfg()
    cm = cfg.job().cost_model
    units = [("teacher", True), ("student", False)]

    def loads(order):
        def work(s):
            f = micro_batch_features([s.cost])
            return (
                cm.forward_time("teacher", f)
                + cm.forward_time("student", f)
                + cm.backward_time("student", f)
            )

        return [sum(work(s) for s in order[r * 16 : (r + 1) * 16]) for r in range(4)]

    data, bal = loads(samples), loads(balanced_order(samples, 4, cm, units))
    assert sorted(s.sample_id for s in balanced_order(samples, 4, cm, units)) == list(range(64))
    assert max(bal) / min(bal) < 1.05 < max(data) / min(data)
    assert balanced_order(samples, 4, cm, units) == balanced_order(samples, 4, cm, units)


@pytest.mark.dist
@pytest.mark.parametrize("monolithic", [False, True], ids=["per-section", "monolithic"])
def test_emulated_run_realises_the_simulated_step(monolithic):
    base = _cfg(scale=0.25)
    world = 2 if monolithic else 4
    cfg = emulated_config(base, "kd", monolithic=monolithic, world=world, time_scale=0.25)
    res = launch(cfg, world, RunOptions(progress=False, monolithic=monolithic), timeout_s=240)
    steps = res["measured_steps"]
    measured = res["elapsed_s"] / steps / 0.25
    pred = predict(cfg, monolithic=monolithic, world=world, steps=steps)
    # the runtime's own overhead (2 cores for every rank) is a few percent at this scale
    assert pred.window > 0.5
    assert abs(measured / pred.window - 1) < 0.3, (measured, pred)
