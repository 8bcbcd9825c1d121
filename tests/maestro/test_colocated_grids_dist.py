"""Colocated members on their own grids (over real gloo processes) equal one process.

A group replica is ``T`` ranks (the members' largest ``tp``); a member at a smaller ``tp``
splits the replica's samples over sub-replicas and the replica all-gathers its outputs, with
a staged backward (``maestro.runtime.colocated``). Each test trains 3 steps in float64 and
compares every member's parameters and the losses to ``reference_train``.
"""

import pytest
from dist_cases import MLLM, check_equal
from test_colocated_dist import kd_colocated, mllm_audio, mllm_colocated

from maestro import config as C
from maestro.runtime import RunOptions, launch

pytestmark = pytest.mark.dist


def _set(text: str, section: str, **fields) -> str:
    """``text`` with ``fields`` added to (or replacing ``dp`` in) ``[sections.section]``."""
    head = f"[sections.{section}]\n"
    assert head in text, section
    before, after = text.split(head, 1)
    lines = after.split("\n")
    body_end = next((i for i, ln in enumerate(lines) if ln.startswith("[")), len(lines))
    body = [ln for ln in lines[:body_end] if ln.split(" = ")[0] not in fields]
    body[:0] = [f"{k} = {v}" for k, v in fields.items()]
    return before + head + "\n".join(body + lines[body_end:])


def _run(text: str, nproc: int, tmp_path, trained):
    cfg = C.loads(text)
    res = launch(cfg, nproc, RunOptions(save_dir=str(tmp_path), progress=False), timeout_s=300)
    check_equal(cfg, res, tmp_path, 1e-10, trained)
    return cfg, res


@pytest.mark.parametrize("scheduler", ["fifo", "wavefront"])
def test_kd_teacher_split_beside_a_tensor_parallel_student(tmp_path, scheduler):
    """2 ranks: the frozen teacher at dp = 2 (each rank half the samples, then all-gathered)
    beside the student at tp = 2 (one replica of both ranks)."""
    text = _set(kd_colocated(scheduler), "student", dp=1, tp=2)
    cfg, res = _run(text, 2, tmp_path, ["student"])
    assert cfg.group_tp("teacher+student") == 2


@pytest.mark.parametrize("scheduler", ["fifo", "wavefront"])
def test_mllm_vision_split_beside_a_tensor_parallel_llm(tmp_path, scheduler):
    """2 ranks: trainable vision at dp = 2 beside the llm at tp = 2, 40% text-only: the
    vision gradients come back through the staged backward."""
    text = _set(mllm_colocated(scheduler), "llm", dp=1, tp=2)
    _, res = _run(text, 2, tmp_path, ["vision", "llm"])
    # the max_memory prediction (before step 1) is what each rank held after training, up
    # to AdamW's scalar step counters
    for row in res["state_bytes"]:
        assert 0 <= row["total"] - sum(row["predicted"].values()) <= 0.01 * row["total"], row
        assert set(row["predicted"]) == {"vision", "llm"}


def test_max_memory_stops_a_group_that_does_not_fit(tmp_path):
    text = _set(mllm_colocated("fifo"), "llm", dp=1, tp=2)
    cfg = C.loads('max_memory = "2KiB"\n' + text)
    msg = r"max_memory: rank [01] \(vision\+llm\) needs .* \(vision"
    with pytest.raises(ValueError, match=msg):
        launch(cfg, 2, RunOptions(progress=False), timeout_s=120)


def test_mllm_four_ranks_vision_dp4_zero_beside_llm_tp2_dp2(tmp_path):
    """4 ranks: vision at dp = 4 with ZeRO-1, the llm at tp = 2 x dp = 2: two group
    replicas of two ranks each."""
    text = _set(mllm_colocated("wavefront", dp=4), "vision", dp=4, zero=1)
    text = _set(text, "llm", dp=2, tp=2)
    cfg, _ = _run(text, 4, tmp_path, ["vision", "llm"])
    assert cfg.unit_layout() == {"vision+llm": [0, 1, 2, 3]}


@pytest.mark.parametrize("scheduler", ["fifo", "wavefront"])
def test_kd_frozen_teacher_beside_an_fsdp_student(tmp_path, scheduler):
    """2 ranks: the frozen teacher at dp = 2 beside the student at fsdp = 2; replicas run
    different numbers of student chunks, so FSDP's lockstep needs zero-weight ones."""
    text = _set(kd_colocated(scheduler), "student", dp=1, fsdp=2)
    _run(text, 2, tmp_path, ["student"])


def test_mllm_fsdp_vision_beside_a_tensor_parallel_llm(tmp_path):
    """2 ranks: vision at fsdp = 2 (sharded, each rank half the samples) beside the llm at
    tp = 2."""
    text = _set(mllm_colocated("wavefront"), "vision", dp=1, fsdp=2)
    text = _set(text, "llm", dp=1, tp=2)
    _run(text, 2, tmp_path, ["vision", "llm"])


def test_mllm_both_members_fsdp(tmp_path):
    """2 ranks: vision and llm both at fsdp = 2 (two FSDP meshes over the same ranks)."""
    text = _set(mllm_colocated("fifo"), "vision", dp=1, fsdp=2)
    text = _set(text, "llm", dp=1, fsdp=2)
    _run(text, 2, tmp_path, ["vision", "llm"])


def test_an_outside_producer_feeds_a_split_member(tmp_path):
    """vision (1 rank) feeds the llm (dp = 2, split) colocated with audio (tp = 2) on 2 ranks:
    the gradients of the llm's inputs from vision are summed over the replica before they go
    back to vision, and the trainable audio's gradients from the llm, a member at tp = 1 < T,
    are scaled by the llm's own tp (1), not the group's T (2)."""
    text = mllm_audio({"audio": "al", "llm": "al"}, {"llm": 2}, "fifo")
    # SGD: a gradient off by a constant factor moves the weights (AdamW would hide it)
    text = _set(text, "vision", optimizer='"sgd"', lr=0.1)
    text = _set(text, "audio", dp=1, tp=2, optimizer='"sgd"', lr=0.1)
    cfg = C.loads(text)
    assert cfg.unit_layout() == {"vision": [0], "audio+llm": [1, 2]}
    assert cfg.group_tp("audio+llm") == 2 and cfg.sections["llm"].tp == 1
    _run(text, 3, tmp_path, ["audio", "vision", "llm"])


def test_a_split_member_feeds_a_consumer_outside_its_group(tmp_path):
    """vision (tp = 2) and audio (dp = 2, split) colocated on 2 ranks feed the llm (1 rank):
    every rank of the replica gets the llm's gradients of the audio outputs, so each counts
    them once over T (2), and the vision's, which cross no exchange, whole."""
    text = mllm_audio({"vision": "enc", "audio": "enc"}, {"audio": 2}, "fifo")
    text = _set(text, "vision", dp=1, tp=2, optimizer='"sgd"', lr=0.1)
    text = _set(text, "audio", optimizer='"sgd"', lr=0.1)  # AdamW would hide a scale
    cfg = C.loads(text)
    assert cfg.unit_layout() == {"vision+audio": [0, 1], "llm": [2]}
    _run(text, 3, tmp_path, ["audio", "vision", "llm"])


def test_a_group_with_a_tensor_parallel_member_resumes_disaggregated(tmp_path):
    """Step 1 with the llm at tp = 2 inside the group, steps 2-3 disaggregated, from one
    checkpoint directory (whole tensors, under each member's name)."""
    colo = _set(mllm_colocated("fifo"), "llm", dp=1, tp=2)
    apart = MLLM.format(
        dtype="float64", scheduler="fifo", mix="{ text = 0.4, image = 0.6 }", audio="", llm_dp=1
    )
    d, out = tmp_path / "ck", tmp_path / "out"
    opts = dict(progress=False, checkpoint_dir=str(d), checkpoint_every=1)
    launch(C.loads(colo.replace("steps = 3", "steps = 1")), 2, RunOptions(**opts), timeout_s=300)
    cfg = C.loads(apart)
    res = launch(cfg, 2, RunOptions(resume=True, save_dir=str(out), **opts), timeout_s=300)
    assert res["start_step"] == 1
    check_equal(cfg, res, out, 1e-10, ["vision", "llm"])
