"""Issue 9, item 5: atomic per-section checkpoints and exact resume.

The unit tests drive ``maestro.runtime.checkpoint`` directly (crash mid-write, truncation,
corruption, stray temp files); the ``dist`` tests interrupt real gloo runs with SIGKILL and
check that the resumed run's losses and weights equal an uninterrupted run bit for bit.
"""

import json

import pytest
import torch

from maestro import config as C
from maestro.runtime import RunOptions, launch
from maestro.runtime import checkpoint as ck

KD = """
global_batch = 8
steps = 6
dtype = "float32"
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
micro_batch_size = 8
frozen = true
[sections.student]
dp = 2
micro_batch_size = 2
optimizer = "adamw"
lr = 0.01
"""

MLLM = """
global_batch = 10
steps = 5
seed = 2
dtype = "float64"
[workload]
name = "mllm"
vocab_size = 32
seq_len_min = 4
seq_len_max = 14
llm_dim = 8
llm_layers = 1
heads = 2
vision_dim = 8
vision_layers = 1
image_patches = 3
patch_dim = 6
mix = { text = 0.4, image = 0.6 }
[sections.vision]
dp = 1
micro_batch_size = 3
lr = 0.01
[sections.llm]
dp = 1
micro_batch_size = 2
optimizer = "sgd"
lr = 0.1
"""


def _write(d, step, value):
    """A checkpoint of one tiny section (a Linear and its AdamW state) at ``step``."""
    torch.manual_seed(step)
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.ones(1, 3)).sum().backward()
    opt.step()
    with torch.no_grad():
        m.weight.fill_(value)
    ck.save_section(d, step, "sec", m, opt)
    ck.save_meta(d, step, {"next_step": step, "losses": [value] * step})
    ck.commit(d, step, ["sec"])
    return m, opt


def test_latest_loads_the_newest_complete_checkpoint(tmp_path):
    _write(tmp_path, 2, 2.0)
    m, opt = _write(tmp_path, 4, 4.0)
    got = ck.latest(tmp_path)
    assert got.next_step == 4 and got.sections == ["sec"]
    st = got.section("sec")
    assert torch.equal(st["module"]["weight"], m.weight)
    assert st["optimizer"]["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    assert got.meta()["losses"] == [4.0] * 4
    assert not list(tmp_path.glob(".tmp-*")), "temp files must be renamed away"


def test_truncated_file_falls_back_to_previous_checkpoint(tmp_path):
    _write(tmp_path, 2, 2.0)
    _write(tmp_path, 4, 4.0)
    f = tmp_path / "step-00000004.sec.pt"
    f.write_bytes(f.read_bytes()[:-10])
    assert "does not match" in ck.verify(tmp_path, 4)
    skipped = []
    got = ck.latest(tmp_path, skipped)
    assert got.next_step == 2
    assert float(got.section("sec")["module"]["weight"][0, 0]) == 2.0
    # the fallback is told: which checkpoint, which file, why
    assert skipped == [
        f"checkpoint {tmp_path}/step-00000004 skipped: step-00000004.sec.pt does not match "
        "the manifest (truncated or corrupted)"
    ]


def test_corrupted_byte_same_size_is_detected(tmp_path):
    _write(tmp_path, 2, 2.0)
    _write(tmp_path, 4, 4.0)
    f = tmp_path / "step-00000004.meta.pt"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))
    assert ck.latest(tmp_path).next_step == 2


def test_crash_mid_write_leaves_no_loadable_checkpoint(tmp_path):
    """Files and a temp file of step 6 but no manifest (the crash came before the commit)."""
    _write(tmp_path, 4, 4.0)
    m = torch.nn.Linear(3, 2)
    ck.save_section(tmp_path, 6, "sec", m, None)
    (tmp_path / ".tmp-step-00000006.meta.pt.abc").write_bytes(b"half a file")
    assert ck.latest(tmp_path).next_step == 4
    (tmp_path / "step-00000004.manifest.json").unlink()
    assert ck.latest(tmp_path) is None


def test_missing_file_and_pruning(tmp_path):
    for s in (2, 4, 6):
        _write(tmp_path, s, float(s))
    # only the newest KEEP complete checkpoints stay
    assert sorted(p.name for p in tmp_path.glob("*.manifest.json")) == [
        "step-00000004.manifest.json",
        "step-00000006.manifest.json",
    ]
    (tmp_path / "step-00000006.sec.pt").unlink()
    assert ck.verify(tmp_path, 6) == "step-00000006.sec.pt is missing"
    assert ck.latest(tmp_path).next_step == 4


def test_discard_newer_removes_only_later_manifests(tmp_path):
    for s in (2, 4):
        _write(tmp_path, s, float(s))
    ck.discard_newer(tmp_path, 2)
    assert ck.latest(tmp_path).next_step == 2
    assert not (tmp_path / "step-00000004.manifest.json").exists()


def test_committed_history_drops_rolled_back_steps(tmp_path):
    lines = [
        {"attempt": 0, "resume_from": 0},
        {"attempt": 0, "step": 0, "section": "s", "ids": [0, 1]},
        {"attempt": 0, "step": 1, "section": "s", "ids": [0, 1]},
        {"attempt": 0, "step": 2, "section": "s", "ids": [0, 1]},
        {"attempt": 1, "resume_from": 2},
        {"attempt": 1, "step": 2, "section": "s", "ids": [0, 1]},
        {"attempt": 1, "step": 3, "section": "s", "ids": [0, 1], "skipped": True},
    ]
    text = "\n".join(json.dumps(x) for x in lines) + '\n{"attempt": 1, "st'
    (tmp_path / "samples-rank0.jsonl").write_text(text)
    (tmp_path / "samples-rank1.jsonl").write_text(
        json.dumps({"attempt": 0, "step": 2, "section": "s", "ids": [2]}) + "\n"
    )
    hist = ck.committed_history(tmp_path)
    assert hist == {("s", 0): [0, 1], ("s", 1): [0, 1], ("s", 2): [0, 1, 2]}


def test_options_are_validated():
    with pytest.raises(ValueError, match="need --checkpoint-dir"):
        RunOptions(checkpoint_every=2).validate()
    with pytest.raises(ValueError, match="need --checkpoint-dir"):
        RunOptions(resume=True).validate()
    with pytest.raises(ValueError, match="stop or skip"):
        RunOptions(on_nonfinite="ignore").validate()


def _opts(**kw):
    return RunOptions(progress=False, device="cpu", **kw)


def _interrupt(cfg, nproc, d, monkeypatch, kill_at, every, mode_kw=None):
    """Run until rank 1 SIGKILLs itself mid-step ``kill_at``; the run must fail."""
    monkeypatch.setenv("MAESTRO_FAULT_KILL_AT_STEP", str(kill_at))
    with pytest.raises(Exception, match="signal|SIGKILL|exit"):
        launch(cfg, nproc, _opts(checkpoint_every=every, checkpoint_dir=str(d)), timeout_s=120)
    monkeypatch.delenv("MAESTRO_FAULT_KILL_AT_STEP")


def _equal_weights(a, b, names):
    for n in names:
        sa, sb = torch.load(a / f"{n}.pt"), torch.load(b / f"{n}.pt")
        for k in sa:
            assert torch.equal(sa[k], sb[k]), f"{n}.{k} differs"


@pytest.mark.dist
def test_kd_killed_and_resumed_equals_uninterrupted_exactly(tmp_path, monkeypatch):
    """3 ranks, float32: kill mid-step 5, truncate the newest checkpoint, resume from step 2."""
    cfg = C.loads(KD)
    ref_dir, out_dir, d = tmp_path / "ref", tmp_path / "out", tmp_path / "ck"
    ref = launch(cfg, 3, _opts(save_dir=str(ref_dir)), timeout_s=120)
    _interrupt(cfg, 3, d, monkeypatch, kill_at=5, every=2)
    assert ck.latest(d).next_step == 4
    f = d / "step-00000004.student.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # a crash mid-write
    with pytest.raises(ValueError, match="already holds checkpoints"):
        launch(cfg, 3, _opts(checkpoint_every=2, checkpoint_dir=str(d)), timeout_s=120)
    res = launch(
        cfg,
        3,
        _opts(checkpoint_every=2, checkpoint_dir=str(d), resume=True, save_dir=str(out_dir)),
        timeout_s=120,
    )
    assert res["start_step"] == 2
    assert res["losses"] == ref["losses"]  # the same floats, not just close
    assert ck.latest(d).next_step == 6 and ck.verify(d, 4) is None  # rewritten intact
    _equal_weights(ref_dir, out_dir, ["student"])
    hist = ck.committed_history(d)
    for step in range(cfg.steps):
        for sec in ("teacher", "student"):
            assert sorted(hist[(sec, step)]) == list(range(cfg.global_batch)), (sec, step)


@pytest.mark.dist
def test_mllm_resume_exact_and_into_monolithic(tmp_path, monkeypatch):
    """Trainable vision (AdamW) + llm (SGD), float64; resume Maestro, then resume monolithic."""
    cfg = C.loads(MLLM)
    ref_dir, out_dir, d = tmp_path / "ref", tmp_path / "out", tmp_path / "ck"
    ref = launch(cfg, 2, _opts(save_dir=str(ref_dir)), timeout_s=120)
    _interrupt(cfg, 2, d, monkeypatch, kill_at=3, every=1)
    assert ck.latest(d).next_step == 3
    mono = launch(cfg, 2, _opts(monolithic=True, checkpoint_dir=str(d), resume=True), timeout_s=120)
    assert mono["start_step"] == 3 and mono["losses"][:3] == ref["losses"][:3]
    # a different execution order: equal up to float64 rounding, not bit for bit
    torch.testing.assert_close(
        torch.tensor(mono["losses"]), torch.tensor(ref["losses"]), rtol=1e-10, atol=0
    )
    assert mono["losses"][3:] != [0.0, 0.0]
    res = launch(
        cfg,
        2,
        _opts(checkpoint_every=1, checkpoint_dir=str(d), resume=True, save_dir=str(out_dir)),
        timeout_s=120,
    )
    assert res["start_step"] == 3
    assert res["losses"] == ref["losses"]
    _equal_weights(ref_dir, out_dir, ["vision", "llm"])


def test_resume_with_a_different_model_is_a_value_error(tmp_path):
    cfg = C.loads(MLLM)
    found = ck.Checkpoint(tmp_path, 3, ["vision", "llm"])
    meta = {"fingerprint": ck.fingerprint(cfg)}
    ck.check_compatible(found, meta, cfg)
    # a different layout or schedule trains the same model: allowed
    relaid = MLLM.replace(
        'micro_batch_size = 2\noptimizer = "sgd"', 'micro_batch_size = 1\noptimizer = "sgd"'
    )
    assert relaid != MLLM
    ck.check_compatible(found, meta, C.loads(relaid))
    other = C.loads(MLLM.replace("llm_dim = 8", "llm_dim = 4"))
    with pytest.raises(ValueError, match="different run config.*workload"):
        ck.check_compatible(found, meta, other)
    lr = C.loads(MLLM.replace("lr = 0.1", "lr = 0.2"))
    with pytest.raises(ValueError, match=r"differs in: sections\.llm\.lr\)"):
        ck.check_compatible(found, meta, lr)
    # the LR schedule is the optimizer's too
    warm = C.loads(MLLM.replace("lr = 0.1", "lr = 0.1\nwarmup_steps = 2"))
    with pytest.raises(ValueError, match=r"differs in: sections\.llm\.warmup_steps\)"):
        ck.check_compatible(found, meta, warm)
    # a checkpoint written before the schedule was recorded still resumes
    old = {"fingerprint": ck.fingerprint(cfg)}
    for sec in old["fingerprint"]["sections"].values():
        for f in ("optimizer_args", "lr_schedule", "warmup_steps", "min_lr_ratio"):
            del sec[f]
    ck.check_compatible(found, old, cfg)
    ck.check_compatible(found, old, warm)
    with pytest.raises(ValueError, match="only 2 steps"):
        ck.check_compatible(found, meta, C.loads(MLLM.replace("steps = 5", "steps = 2")))


def _scheduled(steps: int) -> C.TrainConfig:
    """MLLM with decaying LR schedules (cosine vision, linear llm, both to 0) over ``steps``."""
    text = MLLM.replace("steps = 5", f"steps = {steps}")
    text = text.replace("lr = 0.01\n", 'lr = 0.01\nlr_schedule = "cosine"\n')
    return C.loads(text.replace("lr = 0.1\n", 'lr = 0.1\nlr_schedule = "linear"\n'))


@pytest.mark.dist
def test_resume_under_other_steps_keeps_the_lr_schedule_total(tmp_path):
    """The checkpoint stores the schedule's total: a resume with other ``steps`` keeps it."""
    import shutil

    ref_dir, out_dir, d = tmp_path / "ref", tmp_path / "out", tmp_path / "ck"
    ref = launch(
        _scheduled(6),
        2,
        _opts(checkpoint_every=3, checkpoint_dir=str(d), save_dir=str(ref_dir)),
        timeout_s=120,
    )
    assert ck.latest(d).meta()["lr_schedule_steps"] == 6
    # from step 3 under steps = 5: step 3 updates at the 6-step schedule's LR (before, at
    # the 5-step one's), so step 4's loss equals the uninterrupted run's bit for bit
    d3 = tmp_path / "ck3"
    shutil.copytree(d, d3)
    ck.discard_newer(d3, 3)
    short = launch(_scheduled(5), 2, _opts(checkpoint_dir=str(d3), resume=True), timeout_s=120)
    assert short["start_step"] == 3 and short["losses"] == ref["losses"][:5]
    # from step 6 under steps = 8: past the schedule's end the LR stays at its final value
    # (0 here), so the weights do not move; the new checkpoint keeps the original total
    longer = _opts(checkpoint_every=2, checkpoint_dir=str(d), resume=True, save_dir=str(out_dir))
    res = launch(_scheduled(8), 2, longer, timeout_s=120)
    assert res["start_step"] == 6 and res["losses"][:6] == ref["losses"]
    _equal_weights(ref_dir, out_dir, ["vision", "llm"])
    assert ck.latest(d).next_step == 8 and ck.latest(d).meta()["lr_schedule_steps"] == 6


def test_lr_steps_warning_and_progress_bar_of_a_resume(capsys):
    from maestro.runtime.launch import _bar_kwargs, _lr_schedule_steps

    cfg = _scheduled(30)
    # a checkpoint written before the total was stored: the run's own steps, no warning
    assert _lr_schedule_steps({"losses": []}, cfg, 0) == 30
    assert _lr_schedule_steps({"lr_schedule_steps": 30}, cfg, 0) == 30
    assert capsys.readouterr().out == ""
    assert _lr_schedule_steps({"lr_schedule_steps": 20}, cfg, 1) == 20  # only rank 0 warns
    assert capsys.readouterr().out == ""
    assert _lr_schedule_steps({"lr_schedule_steps": 20}, cfg, 0) == 20
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "maestro train: resuming a run started with steps = 20 under steps = 30: the LR "
        "schedule (vision, llm) keeps decaying over 20 steps (steps 20-29 train at its final "
        "LR); start a fresh run to change it"
    ]
    assert _lr_schedule_steps({"lr_schedule_steps": 40}, cfg, 0) == 40
    assert "stops at step 30, before the schedule's end" in capsys.readouterr().out
    # constant schedules do not depend on the total: nothing to warn about
    assert _lr_schedule_steps({"lr_schedule_steps": 20}, C.loads(MLLM), 0) == 20
    assert capsys.readouterr().out == ""
    # the bar continues from the resumed step
    kw = _bar_kwargs(cfg, _opts(), 12)
    assert kw["initial"] == 12 and kw["total"] == 30
