"""HSDP (``dp = 2 x fsdp = 2``) over real gloo ranks: lockstep per shard group, one gradient
sum across shard groups per step, and still exactly the single-process step.

The schedule gives the two shard groups (replicas 0-1 and 2-3, one FSDP mesh row each)
different numbers of micro-batches; each replica pads only to the busiest of its own group
(the simulator's rule, ``timeline.shard_groups``), and the trace shows it. Each launch trains
3 steps in float64 and compares the weights and losses to ``reference_train`` (<= 1e-10).
"""

import json
import textwrap
from collections import Counter

import pytest
from dist_cases import check_equal

from maestro import config as C
from maestro.runtime import RunOptions, launch

pytestmark = pytest.mark.dist

# a scheduler that deals each patterned section's samples, in data order, into the given
# micro-batch sizes per replica (other sections: fifo)
SCHED = """
from maestro.schedule.fifo import fifo_schedule
from maestro.schedule.types import MicroBatch, Schedule

PATTERN = {pattern!r}


def patterned(samples, sections, cost_model=None):
    order = dict(fifo_schedule(samples, sections).order)
    for sec in sections:
        if sec.name not in PATTERN:
            continue
        ids = iter([s.sample_id for s in samples if sec.name in s.sections])
        order[sec.name] = [
            [MicroBatch(tuple(next(ids) for _ in range(n))) for n in sizes]
            for sizes in PATTERN[sec.name]
        ]
        assert next(ids, None) is None, "the pattern must cover every sample"
    return Schedule(order=order, name="patterned")
"""

KD = """
global_batch = 8
steps = 3
dtype = "float64"
scheduler = "{module}:patterned"
[workload]
name = "kd"
vocab_size = 32
seq_len_min = 4
seq_len_max = 12
teacher_dim = 16
teacher_layers = 1
student_dim = 16
student_layers = 2
heads = 2
[sections.teacher]
dp = {teacher_dp}
micro_batch_size = 8
frozen = true
{group}
[sections.student]
dp = 2
fsdp = 2
micro_batch_size = 1
lr = 0.01
grad_clip = 0.5
{group}
"""


def _launch(tmp_path, monkeypatch, name, unit, pattern, teacher_dp, group):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(SCHED.format(pattern={unit: pattern})))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = C.loads(KD.format(module=name, teacher_dp=teacher_dp, group=group))
    trace = tmp_path / "trace.json"
    out = tmp_path / "out"
    opts = RunOptions(save_dir=str(out), progress=False, trace=str(trace))
    res = launch(cfg, opts=opts, timeout_s=300)
    check_equal(cfg, res, out, 1e-10, ["student"])
    return cfg, json.loads(trace.read_text())["traceEvents"]


def _counts(events, unit, ranks):
    """``[micro-batches (real, padding) per step]`` of each of ``ranks``, from the trace."""
    got = {r: Counter() for r in ranks}
    for e in events:
        if e.get("tid") in got and e["name"] in (f"{unit} fwd", f"{unit} pad fwd"):
            kind = "pad" if " pad " in e["name"] else "real"
            got[e["tid"]][(e["args"]["step"], kind)] += 1
    return [[(c[(s, "real")], c[(s, "pad")]) for s in range(3)] for c in got.values()]


def _reduces(events, ranks):
    """How many gradient all-reduces each of ``ranks`` ran over the whole run."""
    return [
        sum(e["name"] == "all-reduce grads" for e in events if e.get("tid") == r) for r in ranks
    ]


CASES = {
    # replica micro-batches 3, 2 | 1, 2: group 0 runs 3 each, group 1 runs 2 each
    "uneven": ([[1, 1, 1], [1, 1], [1], [1, 1]], [3, 3, 2, 2], [0, 1, 1, 0]),
    # group 1 has no sample: it runs nothing, yet takes part in the HSDP sum every step
    "idle_group": ([[1, 1, 1], [1, 1, 1, 1, 1], [], []], [5, 5, 0, 0], [2, 0, 0, 0]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hsdp_pads_per_shard_group_and_equals_reference(tmp_path, monkeypatch, case):
    """teacher (1 rank) + student dp = 2 x fsdp = 2 (ranks 1-4 = replicas 0-3)."""
    pattern, runs, pads = CASES[case]
    cfg, events = _launch(tmp_path, monkeypatch, f"hsdp_{case}", "student", pattern, 1, "")
    assert cfg.rank_layout()["student"] == [1, 2, 3, 4]
    counts = _counts(events, "student", [1, 2, 3, 4])
    for r, per_step in enumerate(counts):
        want = (len(pattern[r]), pads[r])
        assert per_step == [want] * 3, (r, per_step)
        assert sum(want) == runs[r]
    # within each shard group the same count, across groups different
    assert runs[0] == runs[1] != runs[2] == runs[3]
    # one gradient sum across the shard groups per step on every student rank
    assert _reduces(events, [1, 2, 3, 4]) == [3, 3, 3, 3]


def test_colocated_hsdp_member_pads_per_shard_group(tmp_path, monkeypatch):
    """teacher (dp = 4) + student (dp = 2 x fsdp = 2) colocated on 4 ranks: the group's
    replicas 0-1 and 2-3 hold one student mesh row each. Group micro-batches of 2 samples
    make 2 student chunks, of 1 sample 1: replicas pad group micro-batches and student chunks
    to their own row's busiest only (3 | 1 group micro-batches)."""
    pattern = [[2, 1, 1], [1], [2], [1]]
    group = 'group = "kd"'
    cfg, events = _launch(tmp_path, monkeypatch, "hsdp_colo", "teacher+student", pattern, 4, group)
    assert cfg.unit_layout() == {"teacher+student": [0, 1, 2, 3]}
    counts = _counts(events, "teacher+student", [0, 1, 2, 3])
    # group micro-batches: 3 | 1 per replica (student chunks are padded inside them)
    assert counts == [[w] * 3 for w in [(3, 0), (1, 2), (1, 0), (1, 0)]], counts
    assert _reduces(events, [0, 1, 2, 3]) == [3, 3, 3, 3]


def test_hsdp_checkpoints_resume_across_layouts(tmp_path):
    """Sharded (DCP) checkpoints of student dp = 2 x fsdp = 2, whose shard groups hold the
    same shards: resume under the same layout and under dp = 1; and a full-tensor
    checkpoint of it resumes under fsdp = 2 (weights and losses equal ``reference_train``)."""
    from test_parallel_dist import KD as PKD
    from test_parallel_dist import _resume_across, _sharded_resume

    kw = {"scheduler": "fifo", "teacher_mbs": 4}
    hsdp = PKD.format(teacher="", student="dp = 2\nfsdp = 2", **kw)
    plain = PKD.format(teacher="", student="", **kw)
    _sharded_resume(tmp_path / "dcp", hsdp, {"same": hsdp, "dp1": plain}, ["student"])
    fsdp = PKD.format(teacher="", student="fsdp = 2", **kw)
    _resume_across(tmp_path / "full", hsdp, fsdp, ["student"])
