"""Per-section parallel strategies over real gloo ranks equal the single-process step, and
their checkpoints resume exactly under another layout.

Each launch trains 3 steps (float64) with sections using different strategies at once and
compares every trainable section's weights and the losses to ``reference_train``
(<= 1e-10 relative); the per-rank memory of the sharded layouts is checked on the way.
"""

import pytest
import torch

from maestro import config as C
from maestro.runtime import RunOptions, launch, reference_train
from maestro.runtime import checkpoint as ck
from maestro.workloads import get_workload

pytestmark = pytest.mark.dist

KD = """
global_batch = 8
steps = 3
dtype = "float64"
scheduler = "{scheduler}"
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
micro_batch_size = {teacher_mbs}
frozen = true
{teacher}
[sections.student]
micro_batch_size = 2
lr = 0.01
grad_clip = 0.5
{student}
"""

MLLM = """
global_batch = 8
steps = 3
seed = 2
dtype = "float64"
[workload]
name = "mllm"
vocab_size = 32
seq_len_min = 4
seq_len_max = 12
llm_dim = 16
llm_layers = 1
heads = 2
vision_dim = 16
vision_layers = 1
image_patches = 3
patch_dim = 6
mix = {{ text = 0.5, image = 0.5 }}
[sections.vision]
micro_batch_size = 2
lr = 0.01
{vision}
[sections.llm]
micro_batch_size = 2
optimizer = "sgd"
lr = 0.1
{llm}
"""


def _rel_err(saved, ref):
    num = sum(((saved[k].double() - ref[k].double()) ** 2).sum() for k in ref)
    den = sum((ref[k].double() ** 2).sum() for k in ref)
    return float((num / den).sqrt())


def _run_and_compare(tmp_path, text, trained):
    cfg = C.loads(text)
    res = launch(cfg, opts=RunOptions(save_dir=str(tmp_path), progress=False), timeout_s=300)
    graph, losses = reference_train(cfg)
    for name in trained:
        init = get_workload(cfg).build_module(name).state_dict()
        ref = graph[name].module.state_dict()
        assert max(float((ref[k] - init[k]).abs().max()) for k in ref) > 1e-4, name
        err = _rel_err(torch.load(tmp_path / f"{name}.pt"), ref)
        assert err <= 1e-10, f"{name}: relative error {err:.3g}"
    torch.testing.assert_close(
        torch.tensor(res["losses"]), torch.tensor(losses), rtol=1e-10, atol=0
    )
    return cfg, res


def _bytes(res, section):
    return [m for m in res["state_bytes"] if m["label"].startswith(section + "[")]


def _replicated_bytes(cfg, name):
    """params + grads + AdamW's two moments of an unsharded replica (the step scalars aside)."""
    n = sum(p.numel() * p.element_size() for p in get_workload(cfg).build_module(name).parameters())
    return 4 * n


CASES = {
    # KD: the frozen teacher and the student use different strategies at once; wavefront
    # gives the FSDP replicas unequal micro-batch counts (padding micro-batches run)
    "kd-teacher_tp2-student_fsdp2": ("kd", "tp = 2", "fsdp = 2"),
    "kd-teacher_fsdp2-student_tp2_recompute": ("kd", "fsdp = 2", "tp = 2\nrecompute = true"),
    "kd-student_fsdp2xtp2": ("kd", "", "fsdp = 2\ntp = 2\nreshard_after_forward = false"),
    "kd-student_zero1_recompute": ("kd", "", "dp = 2\nzero = 1\nrecompute = true"),
    "kd-student_hsdp_dp2xfsdp2": ("kd", "", "dp = 2\nfsdp = 2"),
    # MLLM: text-only samples skip vision; replicas get unequal micro-batch counts
    "mllm-vision_fsdp2_recompute-llm_dp2_zero1": (
        "mllm",
        "fsdp = 2\nrecompute = true",
        "dp = 2\nzero = 1",
    ),
    "mllm-vision_tp2-llm_fsdp2xtp2": ("mllm", "tp = 2", "fsdp = 2\ntp = 2"),
    # vision dp=1 with llm tp=2 (two TP replicas, ZeRO-1 over them)
    "mllm-vision_dp1_recompute-llm_dp2xtp2_zero1": (
        "mllm",
        "recompute = true",
        "dp = 2\ntp = 2\nzero = 1",
    ),
    # pipeline stages (pp): a frozen teacher forward-only over 2 stages; the student's
    # stages sharded by FSDP (padding micro-batches flow through both stages) and split by
    # TP with recompute; the student's sink runs 1F1B, the vision producer every forward
    # then every backward, its gradients reaching it from the LLM's first stage
    "kd-teacher_pp2-student_pp2xfsdp2": ("kd", "pp = 2", "pp = 2\nfsdp = 2"),
    "kd-student_pp2xtp2_recompute": ("kd", "", "pp = 2\ntp = 2\nrecompute = true"),
    "mllm-vision_pp2-llm_pp2": ("mllm", "pp = 2", "pp = 2"),
}

#: blocks for two stages (the templates' teacher, vision encoder and LLM have one)
STAGED = {"teacher_layers = 1": "teacher_layers = 2", "vision_layers = 1": "vision_layers = 2"}
STAGED["llm_layers = 1"] = "llm_layers = 3"  # 3 blocks over 2 stages: an uneven cut


@pytest.mark.parametrize("case", list(CASES))
def test_strategy_equals_reference(tmp_path, case):
    kind, first, second = CASES[case]
    if kind == "kd":
        wavefront = case in (
            "kd-teacher_fsdp2-student_tp2_recompute",
            "kd-student_fsdp2xtp2",
            "kd-teacher_pp2-student_pp2xfsdp2",
        )
        text = KD.format(
            teacher=first,
            student=second,
            scheduler="wavefront" if wavefront else "fifo",
            teacher_mbs=3 if wavefront else 4,
        )
        trained = ["student"]
    else:
        text = MLLM.format(vision=first, llm=second)
        trained = ["vision", "llm"]
    if "pp2" in case:
        for a, b in STAGED.items():
            text = text.replace(a, b)
    cfg, res = _run_and_compare(tmp_path, text, trained)
    if case == "kd-teacher_tp2-student_fsdp2":
        full = _replicated_bytes(cfg, "student")
        for m in _bytes(res, "student"):  # FSDP degree 2: about half of everything
            assert abs(m["total"] / (full / 2) - 1) < 0.10, m
    if case == "kd-student_zero1_recompute":
        full = _replicated_bytes(cfg, "student")
        for m in _bytes(res, "student"):  # ZeRO-1 degree 2: half the optimizer state
            assert abs(m["optimizer"] / (full / 4) - 1) < 0.10, m
            assert m["params"] == m["grads"] == full // 4


def test_bf16_fsdp_runs_close_to_reference(tmp_path):
    """``dtype = "bfloat16"``: autocast compute, fp32 master weights, FSDP gathers bf16
    parameters (``MixedPrecisionPolicy``); the losses stay within bf16 rounding."""
    text = KD.format(teacher="", student="fsdp = 2", scheduler="fifo", teacher_mbs=4)
    cfg = C.loads(text.replace('dtype = "float64"', 'dtype = "bfloat16"'))
    res = launch(cfg, opts=RunOptions(progress=False), timeout_s=300)
    _, losses = reference_train(cfg)
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(losses), rtol=3e-2, atol=0)


# -- checkpoints of sharded sections ---------------------------------------------------------
# A checkpoint holds whole tensors in a single-rank run's format (``maestro.parallel.state``),
# so each test trains 2 steps under one layout, resumes for 2 more under a different one and
# compares weights and all 4 losses to the single-process ``reference_train`` (float64).


def _opts(**kw):
    return RunOptions(progress=False, **kw)


def _resume_across(tmp_path, first: str, second: str, trained):
    d = tmp_path / "ckpt"
    cfg1 = C.loads(first.replace("steps = 3", "steps = 2"))
    launch(cfg1, opts=_opts(checkpoint_every=2, checkpoint_dir=str(d)), timeout_s=300)
    found = ck.latest(d)
    assert found is not None and found.next_step == 2
    cfg2 = C.loads(second.replace("steps = 3", "steps = 4"))
    out = tmp_path / "out"
    res = launch(
        cfg2,
        opts=_opts(checkpoint_dir=str(d), resume=True, save_dir=str(out)),
        timeout_s=300,
    )
    assert res["start_step"] == 2
    graph, losses = reference_train(cfg2)
    for name in trained:
        err = _rel_err(torch.load(out / f"{name}.pt"), graph[name].module.state_dict())
        assert err <= 1e-10, f"{name}: relative error {err:.3g} after resuming"
    torch.testing.assert_close(
        torch.tensor(res["losses"]), torch.tensor(losses), rtol=1e-10, atol=0
    )


def test_kd_fsdp_tp_checkpoint_resumes_under_dp1_and_zero(tmp_path):
    """teacher tp=2 + student fsdp=2 x tp=2 -> teacher dp=1 + student dp=2 zero=1."""
    kw = {"scheduler": "fifo", "teacher_mbs": 4}
    first = KD.format(teacher="tp = 2", student="fsdp = 2\ntp = 2", **kw)
    second = KD.format(teacher="", student="dp = 2\nzero = 1", **kw)
    _resume_across(tmp_path, first, second, ["student"])


def test_pipelined_checkpoint_resumes_under_dp2_and_back(tmp_path):
    """student pp=2 writes one whole-section file (its stages gathered) -> dp=2 resumes it;
    and dp=2 zero=1 -> pp=2 x fsdp=2 (every stage loads its own share)."""
    kw = {"scheduler": "fifo", "teacher_mbs": 4}
    _resume_across(
        tmp_path / "a",
        KD.format(teacher="", student="pp = 2", **kw),
        KD.format(teacher="", student="dp = 2", **kw),
        ["student"],
    )
    _resume_across(
        tmp_path / "b",
        KD.format(teacher="", student="dp = 2\nzero = 1", **kw),
        KD.format(teacher="", student="pp = 2\nfsdp = 2", **kw),
        ["student"],
    )


def test_mllm_zero_checkpoint_resumes_under_fsdp(tmp_path):
    """vision dp=1 + llm dp=2 zero=1 -> vision fsdp=2 + llm tp=2, and back to dp=1 (file)."""
    first = MLLM.format(vision="", llm="dp = 2\nzero = 1")
    second = MLLM.format(vision="fsdp = 2", llm="tp = 2")
    _resume_across(tmp_path, first, second, ["vision", "llm"])


# -- sharded checkpoints (``--checkpoint-format sharded``, torch.distributed.checkpoint) ------


def _sharded_resume(tmp_path, first: str, seconds: dict[str, str], trained):
    """Train 2 steps under ``first`` writing sharded checkpoints, then resume each layout of
    ``seconds`` for 2 more; weights and losses equal ``reference_train``."""
    d = tmp_path / "ckpt"
    cfg1 = C.loads(first.replace("steps = 3", "steps = 2"))
    opts = _opts(checkpoint_every=2, checkpoint_dir=str(d), checkpoint_format="sharded")
    launch(cfg1, opts=opts, timeout_s=300)
    found = ck.latest(d)
    assert found is not None and found.next_step == 2 and found.format == "sharded"
    for label, second in seconds.items():
        cfg2 = C.loads(second.replace("steps = 3", "steps = 4"))
        out = tmp_path / f"out-{label}"
        res = launch(
            cfg2,
            opts=_opts(checkpoint_dir=str(d), resume=True, save_dir=str(out)),
            timeout_s=300,
        )
        assert res["start_step"] == 2, label
        graph, losses = reference_train(cfg2)
        for name in trained:
            err = _rel_err(torch.load(out / f"{name}.pt"), graph[name].module.state_dict())
            assert err <= 1e-10, f"{label} {name}: relative error {err:.3g} after resuming"
        torch.testing.assert_close(
            torch.tensor(res["losses"]), torch.tensor(losses), rtol=1e-10, atol=0
        )
    return d


def test_sharded_checkpoint_fsdp2xtp2_resumes_same_layout_and_dp1(tmp_path):
    """student fsdp=2 x tp=2: every rank writes its own DCP shards; resumes under the same
    layout and under dp=1 (DCP reshards the DTensors)."""
    kw = {"scheduler": "fifo", "teacher_mbs": 4}
    first = KD.format(teacher="", student="fsdp = 2\ntp = 2", **kw)
    d = _sharded_resume(
        tmp_path,
        first,
        {"same": first, "dp1": KD.format(teacher="", student="", **kw)},
        ["student"],
    )
    # every rank of the sharded section wrote a shard file
    files = [f.name for f in ck.section_dir(d, 2, "student").iterdir()]
    assert sum(f.endswith(".distcp") for f in files) == 4, files


def test_sharded_checkpoint_zero1_and_tp_resume_across_layouts(tmp_path):
    """MLLM vision tp=2 + llm dp=2 zero=1 (ZeRO's slices in the parameter's layout) ->
    vision fsdp=2 + llm tp=2."""
    first = MLLM.format(vision="tp = 2", llm="dp = 2\nzero = 1")
    second = MLLM.format(vision="fsdp = 2", llm="tp = 2")
    _sharded_resume(tmp_path, first, {"fsdp_tp": second}, ["vision", "llm"])


def test_truncated_shard_falls_back_to_previous_checkpoint(tmp_path):
    """A truncated shard file of the newest sharded checkpoint: ``latest`` falls back to the
    previous complete one, and ``Checkpoint.section`` reads it whole in one process."""
    d = tmp_path / "ckpt"
    text = KD.format(teacher="", student="fsdp = 2", scheduler="fifo", teacher_mbs=4)
    cfg = C.loads(text)
    opts = _opts(checkpoint_every=1, checkpoint_dir=str(d), checkpoint_format="sharded")
    launch(cfg, opts=opts, timeout_s=300)
    assert ck.latest(d).next_step == 3
    shard = sorted(ck.section_dir(d, 3, "student").glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    found = ck.latest(d)
    assert found is not None and found.next_step == 2 and found.format == "sharded"
    st = found.section("student")
    want = get_workload(cfg).build_module("student").state_dict()
    assert set(st["module"]) == set(want)
    assert all(st["module"][k].shape == want[k].shape for k in want)
    assert st["optimizer"]["state"] and st["optimizer"]["param_groups"]
