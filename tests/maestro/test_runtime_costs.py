"""The run's cost model (profile or FLOP estimate), profiles from real runs, the run-ahead bound."""

import json

import pytest
import torch

from maestro import config as C
from maestro.costmodel import MeasuredCostModel, micro_batch_features
from maestro.profiling.runs import run_and_profile
from maestro.runtime import RunOptions, launch, reference_train
from maestro.runtime.costs import FlopCostModel, flop_cost_model, runtime_cost_model

KD = """
global_batch = 8
steps = 3
dtype = "float64"
scheduler = "{scheduler}"
{extra}
[workload]
name = "kd"
vocab_size = 32
seq_len_min = 4
seq_len_max = 14
teacher_dim = 16
teacher_layers = 2
student_dim = 8
student_layers = 1
heads = 2
[sections.teacher]
dp = 1
micro_batch_size = 2
frozen = true
{teacher}
[sections.student]
dp = 1
micro_batch_size = 2
lr = 0.01
{student}
"""

MLLM = """
global_batch = 10
steps = 2
[workload]
name = "mllm"
vocab_size = 32
seq_len_min = 4
seq_len_max = 30
llm_dim = 16
llm_layers = 1
heads = 2
vision_dim = 32
vision_layers = 2
image_patches = 16
patch_dim = 6
mix = { text = 0.5, image = 0.5 }
[sections.vision]
dp = 1
micro_batch_size = 2
[sections.llm]
dp = 1
micro_batch_size = 2
"""


def kd(scheduler="fifo", extra="", teacher="", student=""):
    return C.loads(KD.format(scheduler=scheduler, extra=extra, teacher=teacher, student=student))


def test_max_in_flight_and_cost_profile_are_validated(tmp_path):
    with pytest.raises(ValueError, match=r"sections.student.max_in_flight .*trainable"):
        kd(student="max_in_flight = 1")
    with pytest.raises(ValueError, match=r"sections.teacher.max_in_flight must be >= 0"):
        kd(teacher="max_in_flight = -1")
    with pytest.raises(ValueError, match=r"sections.teacher.max_in_flight must be an integer"):
        kd(teacher="max_in_flight = 1.5")
    missing = tmp_path / "nope.json"
    with pytest.raises(ValueError, match="cost_profile: .*nope.json is not a file"):
        kd(extra=f'cost_profile = "{missing}"')
    bounded = kd(teacher="max_in_flight = 0")
    assert bounded.sections["teacher"].max_in_flight == 0
    assert {s.name: s.max_in_flight for s in bounded.section_specs()} == {
        "teacher": 0,
        "student": None,
    }


def test_flop_estimate_is_deterministic_and_ranks_sections_by_work():
    cfg = C.loads(MLLM)
    a, b = flop_cost_model(cfg), flop_cost_model(cfg)
    assert isinstance(a, FlopCostModel)
    assert {n: f.coef for n, f in a.forward_flops.items()} == {
        n: f.coef for n, f in b.forward_flops.items()
    }
    image = micro_batch_features([{"tokens": 20, "text_tokens": 4, "images": 1}])
    text = micro_batch_features([{"tokens": 20, "text_tokens": 20, "images": 0}])
    # a 2-layer d=32 encoder over 16 patches costs more than a 1-layer d=16 LLM over 20 tokens
    assert a.forward_time("vision", image) > a.forward_time("llm", text) > 0
    # longer sequences cost the LLM more; the backward is twice the forward when trainable
    longer = micro_batch_features([{"tokens": 40, "text_tokens": 40, "images": 0}])
    assert a.forward_time("llm", longer) > a.forward_time("llm", text)
    assert a.backward_time("llm", text) == pytest.approx(2 * a.forward_time("llm", text))
    assert isinstance(runtime_cost_model(cfg), FlopCostModel)


def test_frozen_teacher_bound_keeps_training_exact_with_a_profile_from_a_run(tmp_path):
    """Profile a real traced run, then train with that profile, the wavefront scheduler and
    a teacher allowed one message in flight: the losses still equal a single process's."""
    prof = run_and_profile(kd(), steps=3, seed=7)
    assert prof["source"] == "trace" and prof["run"]["seed"] == 7
    assert set(prof["sections"]) == {"teacher", "student"}
    assert prof["sections"]["student"]["optimizer_s"] > 0
    assert prof["sections"]["teacher"]["optimizer_s"] == 0
    assert prof["sections"]["teacher"]["bytes_per"]  # logits go to the student
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(prof))
    MeasuredCostModel.from_profile(path)  # the profile format the simulator reads
    cfg = kd("wavefront", extra=f'cost_profile = "{path}"', teacher="max_in_flight = 1")
    assert isinstance(runtime_cost_model(cfg), MeasuredCostModel)
    trace = tmp_path / "trace.json"
    res = launch(cfg, 2, RunOptions(progress=False, trace=str(trace)), timeout_s=240)
    _, losses = reference_train(cfg)
    torch.testing.assert_close(
        torch.tensor(res["losses"]), torch.tensor(losses), rtol=1e-10, atol=0
    )
    events = json.loads(trace.read_text())["traceEvents"]
    bound = [e for e in events if e.get("name") == "run-ahead bound"]
    assert bound and all(e["tid"] == 0 for e in bound)  # only the frozen teacher waits


BOUND_WORKER = """
import json
import os
import time

import torch


def _bound_worker(rank, port, out, limit):
    import torch.distributed as dist

    from maestro.runtime.wire import Transport

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    tr = Transport(torch.device("cpu"))
    if rank == 0:
        seen = []
        for i in range(5):
            tr.limit_in_flight(limit)
            seen.append(tr.in_flight())
            tr.send(1, 1, [(i, {"x": torch.full((1000,), float(i))})])
        tr.flush()
        with open(out, "w") as f:
            json.dump(seen, f)
    else:
        time.sleep(0.5)  # the sender runs ahead until the bound stops it
        got = [float(tr.get(0, 1, i)["x"][0]) for i in range(5)]
        assert got == [0.0, 1.0, 2.0, 3.0, 4.0]
    dist.barrier()
    dist.destroy_process_group()
"""


@pytest.mark.parametrize("limit", [0, 2])
def test_transport_bounds_messages_in_flight(tmp_path, monkeypatch, limit):
    import importlib

    import torch.multiprocessing as mp

    from maestro.runtime.launch import free_port

    # spawned ranks import the worker by module name: put it on the path they inherit
    (tmp_path / "bound_worker.py").write_text(BOUND_WORKER)
    monkeypatch.syspath_prepend(str(tmp_path))
    worker = importlib.import_module("bound_worker")._bound_worker
    out = tmp_path / "seen.json"
    mp.start_processes(worker, args=(free_port(), str(out), limit), nprocs=2, start_method="spawn")
    seen = json.loads(out.read_text())
    assert max(seen) <= limit
    # with room for two, the sender does run ahead of the sleeping receiver
    assert (max(seen) == limit) if limit else seen == [0] * 5


def test_profile_from_run_cli_feeds_simulate(tmp_path, capsys):
    from maestro.cli import main

    cfg = tmp_path / "kd.toml"
    cfg.write_text(KD.format(scheduler="fifo", extra="", teacher="", student=""))
    out = tmp_path / "p.json"
    assert main(["profile", str(cfg), "--from-run", "--steps", "2", "--out", str(out)]) == 2
    assert "steps must be >= 3" in capsys.readouterr().err
    assert main(["profile", str(cfg), "--from-run", "--steps", "3", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "contention" in text and "wrote" in text
    prof = json.loads(out.read_text())
    assert prof["source"] == "trace" and prof["run"]["steps"] == 3
    args = ["simulate", str(cfg), "--profile", str(out), "--no-gantt", "--scheduler", "wavefront"]
    assert main(args) == 0
    assert "== wavefront" in capsys.readouterr().out


@pytest.mark.slow  # four real 2-process runs (~10-35 s on 2 shared cores)
def test_profile_from_runs_at_several_micro_batch_sizes_covers_what_the_planner_picks():
    """Real traced runs at micro-batch 1 and 2, sections and monolithic: per-micro-batch and
    per-sample costs are both identified, the monolithic runtime gets its own fit, and the
    planner stays within the sizes run."""
    from maestro.plan import SearchOptions, plan_maestro, plan_monolithic
    from maestro.workloads import get_workload

    cfg = kd()
    prof = run_and_profile(cfg, steps=3, seed=11, micro_batches=[1, 2], monolithic=True)
    assert prof["run"]["micro_batches"] == [1, 2] and prof["run"]["monolithic"]
    for rec in prof["sections"].values():
        assert rec["max_micro_batch"] == 2
        # 2 measured steps of 8 samples, at 1 and at 2 samples per micro-batch
        assert len(rec["rows"]) == 2 * 8 + 2 * 4
    mono = prof["monolithic"]
    # per rank 4 samples a step: 4 micro-batches of 1, then 2 of 2; 2 ranks, 2 steps each
    assert len(mono["rows"]) == 2 * 2 * (4 + 2)
    assert sorted({r["features"]["samples"] for r in mono["rows"]}) == [1.0, 2.0]
    assert all(r["forward_backward_s"] > r["forward_s"] > 0 for r in mono["rows"])
    assert set(mono["allreduce_s"]) == {"2"} and mono["optimizer_s"] > 0
    cm = MeasuredCostModel.from_profile(json.loads(json.dumps(prof)))
    assert cm.whole_model is not None and cm.max_samples == {"teacher": 2.0, "student": 2.0}
    wl = get_workload(cfg)
    samples = wl.sample_infos(wl.batch(0), wl.graph(build=[]))
    opts = SearchOptions(colocate=False, objective="step_time", balance_monolithic=False)
    plan = plan_maestro(samples, cfg.section_specs(), cm, 2, opts)
    assert all(sp.micro_batch_size <= 2 for sp in plan.sections.values())
    mono_plan = plan_monolithic(samples, cfg.section_specs(), cm, 2, opts)
    assert all(sp.micro_batch_size <= 2 for sp in mono_plan.sections.values())
    # the monolithic plan is priced by the whole-model fit: its predicted step is at least
    # the fitted micro-batches of its busiest rank plus the fitted tail
    w = cm.whole_model
    assert mono_plan.step_time >= w.tail(mono_plan.sections["student"].dp)
    with pytest.raises(ValueError, match="micro_batches"):
        run_and_profile(cfg, steps=3, micro_batches=[0])
