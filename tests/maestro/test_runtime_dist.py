"""Maestro over real gloo processes equals a single-process step of the same compound model.

Each test spawns real ranks (``maestro.runtime.launch``), trains 3 steps and compares every
section's parameters to ``reference_train`` on the same global batches.
"""

import json
import textwrap

import pytest
from dist_cases import KD, MLLM, check_equal, rel_err

from maestro import config as C
from maestro.runtime import RunOptions, launch
from maestro.workloads import get_workload

pytestmark = pytest.mark.dist


def test_kd_mixed_layout_equals_reference_float64(tmp_path):
    """teacher dp=1 mbs=8 (frozen), student dp=2 mbs=2 on 3 ranks."""
    cfg = C.loads(KD.format(dtype="float64", scheduler="fifo", top_k=0, student_dp=2))
    res = launch(cfg, 3, RunOptions(save_dir=str(tmp_path), progress=False), timeout_s=240)
    check_equal(cfg, res, tmp_path, 1e-10, ["student"])
    assert set(res["busy"]) == {"teacher", "student"}
    assert (
        not (tmp_path / "teacher.pt").exists()
        or rel_err(tmp_path, get_workload(cfg).graph(), "teacher") == 0.0
    )  # frozen: untouched


def test_mllm_with_text_only_samples_equals_reference_float64(tmp_path):
    """Trainable vision dp=1 mbs=3, llm dp=2 mbs=2; text-only samples skip the vision rank."""
    text = MLLM.format(
        dtype="float64", scheduler="fifo", mix="{ text = 0.4, image = 0.6 }", audio="", llm_dp=2
    )
    cfg = C.loads(text)
    wl = get_workload(cfg)
    kinds = {s["kind"] for step in range(3) for s in wl.batch(step)}
    assert kinds == {"text", "image"}
    res = launch(cfg, 3, RunOptions(save_dir=str(tmp_path), progress=False), timeout_s=240)
    check_equal(cfg, res, tmp_path, 1e-10, ["vision", "llm"])


SCHED = '''
"""A test scheduler: interleaved (non-contiguous) sharding, micro-batches in reverse order."""
from maestro.schedule.types import MicroBatch, Schedule


def reversed_interleaved(samples, sections, cost_model=None):
    order = {}
    for sec in sections:
        ids = [s.sample_id for s in samples if sec.name in s.sections][::-1]
        shards = [ids[r::sec.dp] for r in range(sec.dp)]
        order[sec.name] = [
            [MicroBatch(tuple(sh[i:i + sec.micro_batch_size]))
             for i in range(0, len(sh), sec.micro_batch_size)][::-1]
            for sh in shards
        ]
    return Schedule(order=order, name="reversed")
'''


def test_mllm_audio_any_schedule_float32_with_trace(tmp_path, monkeypatch):
    """vision, audio and llm on 3 ranks, a schedule that is not in data order, float32."""
    (tmp_path / "rev_sched.py").write_text(textwrap.dedent(SCHED))
    monkeypatch.syspath_prepend(str(tmp_path))
    text = MLLM.format(
        dtype="float32",
        scheduler="rev_sched:reversed_interleaved",
        mix='{ text = 0.4, image = 0.3, "image+audio" = 0.3 }',
        audio="[sections.audio]\ndp = 1\nmicro_batch_size = 2\nlr = 0.01",
        llm_dp=1,
    )
    cfg = C.loads(text)
    trace = tmp_path / "trace.json"
    opts = RunOptions(save_dir=str(tmp_path), progress=False, trace=str(trace))
    res = launch(cfg, 3, opts, timeout_s=240)
    check_equal(cfg, res, tmp_path, 1e-4, ["vision", "audio", "llm"])
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["tid"] for e in events} == {0, 1, 2}
    names = {e["name"] for e in events}
    assert {"vision fwd", "vision bwd", "audio fwd", "llm fwd", "llm bwd", "recv vision"} <= names


@pytest.mark.parametrize("order", ["data", "tokens", "balanced"])
def test_monolithic_baseline_equals_reference_float64(tmp_path, order):
    # tokens: token-count-balanced shards sorted by length (the planner's careful baseline);
    # balanced: the cost-aware balancer's shards (the planner's tuned baseline)
    text = KD.format(dtype="float64", scheduler="fifo", top_k=5, student_dp=1)
    cfg = C.loads(text.replace("[workload]", f'monolithic_order = "{order}"\n[workload]'))
    opts = RunOptions(monolithic=True, save_dir=str(tmp_path), progress=False)
    res = launch(cfg, 2, opts, timeout_s=240)
    assert res["mode"] == "monolithic" and res["world_size"] == 2
    check_equal(cfg, res, tmp_path, 1e-10, ["student"])


def test_kd_top_k_wavefront_scheduler_equals_reference(tmp_path):
    cfg = C.loads(KD.format(dtype="float64", scheduler="wavefront", top_k=5, student_dp=1))
    res = launch(cfg, 2, RunOptions(save_dir=str(tmp_path), progress=False), timeout_s=240)
    check_equal(cfg, res, tmp_path, 1e-10, ["student"])


def test_world_size_mismatch_is_a_value_error():
    cfg = C.loads(KD.format(dtype="float64", scheduler="fifo", top_k=0, student_dp=2))
    with pytest.raises(ValueError, match="sum of dp is 3"):
        launch(cfg, 2, RunOptions(progress=False))
