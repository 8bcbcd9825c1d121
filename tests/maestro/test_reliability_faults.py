"""Issue 9, items 6 and 7: a rank killed under torchrun, and NaN/inf losses.

Real processes throughout: gloo ranks spawned by ``launch`` or by ``torchrun`` (its elastic
agent restarts the job after a SIGKILL). Fault injection is by environment variables
(``maestro.runtime.faults``).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from maestro import config as C
from maestro.runtime import RunOptions, launch
from maestro.runtime import checkpoint as ck
from maestro.runtime.faults import NonFiniteError
from maestro.runtime.local import compound_loss, make_optimizer
from maestro.workloads import get_workload

pytestmark = pytest.mark.dist

KD = """
global_batch = 8
steps = 5
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
dp = 1
micro_batch_size = 2
optimizer = "adamw"
lr = 0.01
"""

MLLM = """
global_batch = 10
steps = 4
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
dp = 2
micro_batch_size = 2
lr = 0.01
"""


def _opts(**kw):
    return RunOptions(progress=False, device="cpu", **kw)


def test_torchrun_restart_after_sigkill_loses_and_repeats_no_sample(tmp_path):
    """torchrun --max-restarts 1; rank 1 (student) SIGKILLs itself mid-step 3 on attempt 0."""
    cfg_path = tmp_path / "kd.toml"
    cfg_path.write_text(KD)
    cfg = C.loads(KD)
    d, out, ref_dir = tmp_path / "ck", tmp_path / "out", tmp_path / "ref"
    ref = launch(cfg, 2, _opts(save_dir=str(ref_dir)), timeout_s=120)
    env = {**os.environ, "MAESTRO_FAULT_KILL_AT_STEP": "3", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "-m",
        "maestro.train",
        str(cfg_path),
        "--checkpoint-every",
        "1",
        "--checkpoint-dir",
        str(d),
        "--save-dir",
        str(out),
        "--result",
        str(tmp_path / "result.json"),
        "--device",
        "cpu",
        "--quiet",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exitcode: -9" in proc.stderr or "SIGKILL" in proc.stderr  # the kill did happen
    logs = [(d / f"samples-rank{r}.jsonl").read_text() for r in range(2)]
    for text in logs:  # both ranks ran two attempts; the second resumed after step 2
        assert '"attempt": 1, "resume_from": 3' in text
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["start_step"] == 3
    assert res["losses"] == ref["losses"]
    # sample-id accounting over the final history: every sample of every step, exactly once
    hist = ck.committed_history(d)
    assert set(hist) == {(s, t) for s in ("teacher", "student") for t in range(cfg.steps)}
    for key, ids in hist.items():
        assert sorted(ids) == list(range(cfg.global_batch)), key
    # attempt 0 trained step 3 partly (killed): those updates were rolled back, not counted
    first = [json.loads(x) for x in logs[0].splitlines()]
    assert any(r.get("attempt") == 0 and r.get("step") == 3 for r in first)
    sd, want = torch.load(out / "student.pt"), torch.load(ref_dir / "student.pt")
    assert all(torch.equal(sd[k], want[k]) for k in want)


def test_nan_loss_stops_before_any_update_naming_section_and_step(tmp_path, monkeypatch):
    monkeypatch.setenv("MAESTRO_FAULT_NONFINITE_AT_STEP", "2")
    cfg = C.loads(KD)
    d = tmp_path / "ck"
    with pytest.raises(NonFiniteError, match="step 2: non-finite loss in section 'student'"):
        launch(cfg, 2, _opts(checkpoint_every=1, checkpoint_dir=str(d)), timeout_s=120)
    # steps 0 and 1 were checkpointed; step 2 never committed
    assert ck.latest(d).next_step == 2
    hist = ck.committed_history(d)
    assert ("student", 2) not in hist and ("student", 1) in hist


def test_cli_reports_nonfinite_in_one_line(tmp_path):
    cfg_path = tmp_path / "kd.toml"
    cfg_path.write_text(KD.replace("steps = 5", "steps = 2"))
    env = {
        **os.environ,
        "MAESTRO_FAULT_NONFINITE_AT_STEP": "1",
        "MAESTRO_FAULT_NONFINITE_VALUE": "inf",
    }
    cmd = [
        sys.executable,
        "-m",
        "maestro.train",
        str(cfg_path),
        "--nproc",
        "2",
        "--device",
        "cpu",
        "--quiet",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "maestro.train: error: step 1: non-finite loss in section 'student', non-finite "
        "gradient in section 'student'; stopped before any optimizer update (--on-nonfinite)"
    )


def _reference_skipping(cfg, skip):
    """Single-process training that leaves out the update of step ``skip``."""
    wl = get_workload(cfg)
    graph = wl.graph()
    opts = {
        s.name: make_optimizer(cfg.sections[s.name], list(s.module.parameters()))
        for s in graph
        if not s.frozen
    }
    for step in range(cfg.steps):
        if step == skip:
            continue
        batch = wl.batch(step)
        loss = compound_loss(graph, batch) / wl.normaliser(batch)
        for o in opts.values():
            o.zero_grad(set_to_none=True)
        loss.backward()
        for o in opts.values():
            o.step()
    return graph


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_nonfinite_skip_drops_the_step_on_every_rank(tmp_path, monkeypatch, value):
    """vision dp=1 + llm dp=2 (3 ranks): the poisoned sample lives on one llm replica only."""
    monkeypatch.setenv("MAESTRO_FAULT_NONFINITE_AT_STEP", "1")
    monkeypatch.setenv("MAESTRO_FAULT_NONFINITE_VALUE", value)
    cfg = C.loads(MLLM)
    res = launch(cfg, 3, _opts(on_nonfinite="skip", save_dir=str(tmp_path)), timeout_s=120)
    assert res["skipped_steps"] == [1]
    assert not torch.isfinite(torch.tensor(res["losses"][1]))
    assert all(torch.isfinite(torch.tensor(x)) for i, x in enumerate(res["losses"]) if i != 1)
    graph = _reference_skipping(cfg, skip=1)
    for name in ("vision", "llm"):
        sd, ref = torch.load(tmp_path / f"{name}.pt"), graph[name].module.state_dict()
        for k in ref:
            torch.testing.assert_close(sd[k], ref[k], rtol=1e-10, atol=1e-12)
